"""The root of a config file and the public config API.

A config file holds sections; ``Config`` is the root with ``model`` (``ModelConfig``, ``lcx.model.config``),
``cache`` (``CacheConfig``, ``lcx.cache.config``) and ``plugins``; experiment files extend it
(``lcx.experiment.ExperimentConfig``). Every section is a frozen dataclass validated at load time: a bad value fails
with one message naming the key, the value and what is allowed - never deep inside a traced function. The plumbing
(YAML, overrides, dict conversion) lives in ``lcx.config_base``; this module re-exports it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from lcx.cache.config import CacheConfig
from lcx.cache.schedule import layer_budgets
from lcx.config_base import (ConfigError, canonical_dtype, check, coerce, dtype_bytes, from_dict, import_plugins,
                             load_dict, to_dict)
from lcx.model.config import AttentionConfig, ModelConfig, RopeConfig


# --------------------------------------------------------------------------------------------------- root
@dataclasses.dataclass(frozen=True)
class Config:
    """The root of a config file. Later stages (cache, train, eval) add their sections here."""

    model: ModelConfig
    name: str = "lcx"
    cache: CacheConfig = dataclasses.field(default_factory=CacheConfig)
    plugins: tuple[str, ...] = ()  # modules imported before validation (e.g. ones registering eviction policies)

    def __post_init__(self):
        # Settings that depend on both sections (layer budgets, ladder shape) fail here, at load.
        check_cache(self.cache, self.model)


def load_config(path: str | Path | None = None, overrides: Sequence[str] = (), cls=Config):
    """Load and validate a config file (YAML) with ``key=value`` overrides into ``cls`` (default ``Config``)."""
    data = load_dict(path, overrides)
    import_plugins(data.get("plugins") or ())
    return from_dict(cls, data)


def load_model_config(path: str | Path, overrides: Sequence[str] = ()) -> ModelConfig:
    """A ``ModelConfig`` from a YAML file holding either a ``model:`` section or the model keys at top level.

    Overrides are written ``model.KEY=VALUE`` in both cases.
    """
    flat = "model" not in load_dict(path)
    if flat:
        bad = [o for o in overrides if not o.startswith("model.")]
        if bad:
            raise ConfigError(f"override {bad[0]!r} is invalid: model overrides are written model.KEY=VALUE")
        overrides = [o[len("model."):] for o in overrides]
    data = load_dict(path, overrides)
    return from_dict(ModelConfig, data if flat else data["model"], prefix="model")


def check_cache(cache: CacheConfig, model: ModelConfig) -> None:
    """Settings that depend on both the cache and the model (layer budgets, ladder shape): ``ConfigError`` at load."""
    cache.kind(model)


def apply_model_overrides(model: ModelConfig, overrides: Sequence[str]) -> ModelConfig:
    """``model.n_kv_heads=8``-style overrides on a loaded ``ModelConfig`` (the same for YAML and HF sources)."""
    if not overrides:
        return model
    for item in overrides:
        if "=" not in item or not item.startswith("model."):
            raise ConfigError(f"override {item!r} is invalid: overrides are dotted model.key=value pairs, "
                              f"e.g. model.n_kv_heads=8")
    data = load_dict(None, overrides, base={"model": to_dict(model)})
    return from_dict(ModelConfig, data["model"], prefix="model")


__all__ = ["AttentionConfig", "CacheConfig", "Config", "ConfigError", "ModelConfig", "RopeConfig",
           "apply_model_overrides", "canonical_dtype", "check", "check_cache", "coerce", "dtype_bytes",
           "from_dict", "import_plugins", "layer_budgets", "load_config", "load_dict", "load_model_config",
           "to_dict"]
