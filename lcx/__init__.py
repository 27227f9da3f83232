"""lcx: long-context decoding in JAX."""

from lcx.config import AttentionConfig, Config, ConfigError, ModelConfig, RopeConfig, load_config
from lcx.model import Decoder, init_params

__version__ = "0.1.0"

__all__ = ["AttentionConfig", "Config", "ConfigError", "Decoder", "ModelConfig", "RopeConfig", "init_params",
           "load_config"]
