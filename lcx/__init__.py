"""lcx: long-context decoding in JAX."""

from lcx import hf
from lcx.cache import CacheConfig
from lcx.config import AttentionConfig, Config, ConfigError, ModelConfig, RopeConfig, load_config
from lcx.generate import GenerateResult, Generator, generate
from lcx.model import Decoder, init_params
from lcx.sampling import SamplingConfig
from lcx.sharding import MeshConfig, make_mesh

__version__ = "0.1.0"

__all__ = ["AttentionConfig", "CacheConfig", "Config", "ConfigError", "Decoder", "GenerateResult", "Generator",
           "MeshConfig", "ModelConfig", "RopeConfig", "SamplingConfig", "generate", "hf", "init_params",
           "load_config", "make_mesh"]
