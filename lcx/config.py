"""Typed, frozen configuration for lcx, loaded from YAML with dotted ``key=value`` overrides.

OmegaConf does the parsing (YAML, dotlists, interpolation); this module turns the resulting plain dict into frozen
dataclasses and validates it once, at load time, so that a bad value fails with one message naming the key, the
value and what is allowed - never deep inside a traced function.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range."""


# --------------------------------------------------------------------------------------------------- dtypes
_DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "f32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "f16": "float16",
}


def canonical_dtype(name: str, key: str = "dtype") -> str:
    """Return the canonical dtype name (``float32``, ``bfloat16``, ``float16``) or raise naming ``key``."""
    if not isinstance(name, str) or name.lower() not in _DTYPES:
        raise ConfigError(f"{key}={name!r} is not a dtype lcx supports; allowed: {sorted(set(_DTYPES))}")
    return _DTYPES[name.lower()]


def dtype_bytes(name: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2}[canonical_dtype(name)]


def _check(cond: bool, key: str, value: Any, allowed: str) -> None:
    if not cond:
        raise ConfigError(f"{key}={value!r} is invalid: {allowed}")


# --------------------------------------------------------------------------------------------------- rope
ROPE_TYPES = ("default", "linear", "ntk", "dynamic", "yarn", "llama3", "longrope")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding and its scaling variant (Hugging Face conventions, half-split layout).

    ``original_max_position_embeddings`` defaults to the model's ``max_position_embeddings`` where a type needs it
    (yarn, llama3, longrope), as transformers does.
    """

    type: str = "default"
    theta: float = 10000.0
    factor: float | None = None
    partial_rotary_factor: float = 1.0
    original_max_position_embeddings: int | None = None
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    # llama3
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    # longrope: one factor per rotary frequency (rotary_dim / 2 values)
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None

    def __post_init__(self):
        _check(self.type in ROPE_TYPES, "rope.type", self.type, f"must be one of {list(ROPE_TYPES)}")
        _check(self.theta > 0, "rope.theta", self.theta, "must be > 0")
        _check(0 < self.partial_rotary_factor <= 1, "rope.partial_rotary_factor", self.partial_rotary_factor,
               "must be in (0, 1]")
        required = {
            "linear": ("factor",),
            "ntk": ("factor",),
            "dynamic": ("factor",),
            "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
            "longrope": ("short_factor", "long_factor"),
        }.get(self.type, ())
        for name in required:
            if getattr(self, name) is None:
                raise ConfigError(f"rope.{name} is required for rope.type={self.type!r} (missing); "
                                  f"{self.type} needs {list(required)}")
        if self.factor is not None:
            _check(self.factor >= 1.0 or self.type in ("default", "longrope"), "rope.factor", self.factor,
                   "a scaling factor must be >= 1")
            _check(self.factor > 0, "rope.factor", self.factor, "must be > 0")
        if self.type == "llama3":
            _check(self.high_freq_factor > self.low_freq_factor, "rope.high_freq_factor", self.high_freq_factor,
                   f"must be > rope.low_freq_factor={self.low_freq_factor}")
        if self.type == "yarn":
            _check(self.beta_fast > self.beta_slow, "rope.beta_fast", self.beta_fast,
                   f"must be > rope.beta_slow={self.beta_slow}")
        for name in ("short_factor", "long_factor"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, tuple(float(x) for x in value))


# --------------------------------------------------------------------------------------------------- attention
ATTENTION_IMPLS = ("reference", "xla", "pallas")


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Which attention implementation the model calls (see ``lcx.kernels.attention``)."""

    impl: str = "pallas"

    def __post_init__(self):
        _check(self.impl in ATTENTION_IMPLS, "attention.impl", self.impl, f"must be one of {list(ATTENTION_IMPLS)}")


# --------------------------------------------------------------------------------------------------- model
@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A Llama-family decoder: Llama, Mistral (no sliding window) and Qwen2 (q/k/v bias) share this shape.

    ``dtype`` is the compute dtype, ``param_dtype`` the storage dtype of the weights; softmax, norm statistics and
    logits are float32 regardless.
    """

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    head_dim: int | None = None
    max_position_embeddings: int = 4096
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    dtype: str = "float32"
    param_dtype: str = "float32"
    remat: bool = False
    init_std: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    rope: RopeConfig = dataclasses.field(default_factory=RopeConfig)
    attention: AttentionConfig = dataclasses.field(default_factory=AttentionConfig)

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff",
                     "max_position_embeddings"):
            value = getattr(self, name)
            _check(isinstance(value, int) and value > 0, f"model.{name}", value, "must be a positive integer")
        _check(self.n_heads % self.n_kv_heads == 0, "model.n_heads", self.n_heads,
               f"must be a multiple of model.n_kv_heads={self.n_kv_heads} (GQA groups must be whole); valid "
               f"n_kv_heads for {self.n_heads} heads: {[k for k in range(1, self.n_heads + 1) if self.n_heads % k == 0]}")
        if self.head_dim is None:
            _check(self.d_model % self.n_heads == 0, "model.d_model", self.d_model,
                   f"must be a multiple of model.n_heads={self.n_heads} when model.head_dim is not given")
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        _check(isinstance(self.head_dim, int) and self.head_dim > 0 and self.head_dim % 2 == 0, "model.head_dim",
               self.head_dim, "must be a positive even integer (RoPE rotates pairs)")
        _check(self.norm_eps > 0, "model.norm_eps", self.norm_eps, "must be > 0 (RMSNorm divides by it)")
        _check(self.init_std > 0, "model.init_std", self.init_std, "must be > 0")
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype, "model.dtype"))
        object.__setattr__(self, "param_dtype", canonical_dtype(self.param_dtype, "model.param_dtype"))
        rotary = self.rotary_dim
        _check(rotary % 2 == 0 and rotary > 0, "rope.partial_rotary_factor", self.rope.partial_rotary_factor,
               f"gives an odd or zero rotary dim {rotary} for head_dim={self.head_dim}")
        for name in ("short_factor", "long_factor"):
            value = getattr(self.rope, name)
            if value is not None and len(value) != rotary // 2:
                raise ConfigError(f"rope.{name} has {len(value)} values; rope.type='longrope' needs rotary_dim/2 = "
                                  f"{rotary // 2} (one per frequency)")

    @property
    def n_groups(self) -> int:
        """Query heads per KV head."""
        return self.n_heads // self.n_kv_heads

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rope.partial_rotary_factor)

    @property
    def original_max_position_embeddings(self) -> int:
        return self.rope.original_max_position_embeddings or self.max_position_embeddings

    def num_params(self) -> int:
        """Exact parameter count of this architecture."""
        e, h, k, d, f, v = self.d_model, self.n_heads, self.n_kv_heads, self.head_dim, self.d_ff, self.vocab_size
        attn = e * h * d + 2 * e * k * d + h * d * e
        if self.qkv_bias:
            attn += h * d + 2 * k * d
        if self.o_bias:
            attn += e
        layer = attn + 3 * e * f + 2 * e
        return self.n_layers * layer + v * e * (1 if self.tie_embeddings else 2) + e


# --------------------------------------------------------------------------------------------------- cache
@dataclasses.dataclass(frozen=True, init=False)
class CacheConfig:
    """The KV cache of generation: eviction policy, budget and memory.

    ``CacheConfig(policy="full", budget=None, dtype=None, prefill_chunk=512, interval=64, max_bytes=None,
    **policy_params)``. ``budget`` is the number of tokens per sequence and layer the cache keeps (with ``full``:
    the most it may hold); ``interval`` extra slots let decode compact every ``interval`` steps instead of every
    step; ``max_bytes`` caps the KV memory, checked before anything runs. Policy parameters (``sinks``, ``span``,
    ...) go to the policy named by ``policy`` and are validated by it.
    """

    policy: str = "full"
    budget: int | tuple[int, ...] | None = None
    budget_schedule: str = "uniform"
    dtype: str | None = None
    prefill_chunk: int = 512
    interval: int = 64
    max_bytes: int | None = None
    policy_params: tuple[tuple[str, Any], ...] = ()

    def __init__(self, policy: str = "full", budget: int | Sequence[int] | None = None,
                 budget_schedule: str = "uniform", dtype: str | None = None, prefill_chunk: int = 512,
                 interval: int = 64, max_bytes: int | None = None, **policy_params):
        if isinstance(budget, Sequence) and not isinstance(budget, str):
            budget = tuple(budget)
        values = dict(policy=policy, budget=budget, budget_schedule=budget_schedule, dtype=dtype,
                      prefill_chunk=prefill_chunk, interval=interval, max_bytes=max_bytes,
                      policy_params=tuple(sorted(policy_params.items())))
        for key, value in values.items():
            object.__setattr__(self, key, value)
        self.__post_init__()

    def __post_init__(self):
        budgets = self.budget if isinstance(self.budget, tuple) else (self.budget,)
        for value in budgets:
            _check(value is None or (isinstance(value, int) and not isinstance(value, bool) and value > 0),
                   "cache.budget", self.budget, "must be a positive integer, a list of them (one per layer) or null")
        _check(self.max_bytes is None or (isinstance(self.max_bytes, int) and self.max_bytes > 0), "cache.max_bytes",
               self.max_bytes, "must be a positive integer or null")
        _check(self.budget_schedule in ("uniform", "pyramid"), "cache.budget_schedule", self.budget_schedule,
               "must be 'uniform' or 'pyramid'")
        for name in ("prefill_chunk", "interval"):
            value = getattr(self, name)
            _check(isinstance(value, int) and value > 0, f"cache.{name}", value, "must be a positive integer")
        if self.dtype is not None:
            object.__setattr__(self, "dtype", canonical_dtype(self.dtype, "cache.dtype"))
        policy = self.make_policy()  # validates the name and the policy's parameters
        if policy.evicts and self.budget is None:
            raise ConfigError(f"cache.budget=None is invalid for cache.policy={self.policy!r}: an evicting policy "
                              "needs a budget (tokens kept per sequence and layer)")

    @property
    def params(self) -> dict[str, Any]:
        return dict(self.policy_params)

    @property
    def max_budget(self) -> int | None:
        if self.budget is None:
            return None
        if isinstance(self.budget, tuple):
            return max(self.budget)
        return int(round(self.budget * 1.5)) if self.budget_schedule == "pyramid" else self.budget

    def make_policy(self):
        from lcx.cache.policy import make_policy

        return make_policy(self.policy, self.params)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], prefix: str = "cache") -> "CacheConfig":
        """From a flat mapping (a YAML ``cache:`` section): known keys are fields, the rest policy parameters."""
        data = dict(data)
        data.pop("policy_params", None)
        hints = {"dtype": str | None, "prefill_chunk": int, "interval": int, "max_bytes": int | None,
                 "policy": str, "budget_schedule": str}
        kwargs = {k: _coerce(v, hints[k], f"{prefix}.{k}") if k in hints else v for k, v in data.items()}
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "policy_params"}
        if isinstance(out["budget"], tuple):
            out["budget"] = list(out["budget"])
        out.update(self.params)
        return out


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
        policy = self.cache.make_policy()
        if policy.evicts:
            from lcx.cache.schedule import layer_budgets

            policy.check(self.model.n_layers, layer_budgets(self.cache, self.model.n_layers))


# --------------------------------------------------------------------------------------------------- building
def _unwrap_optional(tp):
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _coerce(value: Any, tp: Any, key: str) -> Any:
    tp, optional = _unwrap_optional(tp)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{key}=None is invalid: a value of type {getattr(tp, '__name__', tp)} is required")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if hasattr(tp, "from_mapping"):
            if not isinstance(value, Mapping):
                raise ConfigError(f"{key}={value!r} is invalid: must be a mapping")
            return tp.from_mapping(value, prefix=key)
        return from_dict(tp, value, prefix=key)
    if tp is bool:
        if isinstance(value, (bool, np.bool_)):
            return bool(value)
        raise ConfigError(f"{key}={value!r} is invalid: must be true or false")
    if tp is int:
        if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
            return int(value)
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{key}={value!r} is invalid: must be an integer")
    if tp is float:
        if isinstance(value, (int, float, np.number)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{key}={value!r} is invalid: must be a number")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}={value!r} is invalid: must be a string")
    origin = typing.get_origin(tp)
    if origin in (tuple, list, Sequence):
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            raise ConfigError(f"{key}={value!r} is invalid: must be a list")
        (item_tp, *_rest) = typing.get_args(tp) or (Any,)
        return tuple(_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value))
    return value


def from_dict(cls, data: Mapping[str, Any] | None, prefix: str = ""):
    """Build dataclass ``cls`` from a plain mapping, rejecting unknown keys with a did-you-mean."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{prefix or cls.__name__}={data!r} is invalid: must be a mapping of {cls.__name__} fields")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}.{key}" if prefix else str(key)
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"unknown key {full!r}{hint} (allowed: {sorted(fields)})")
        kwargs[key] = _coerce(value, hints[key], full)
    missing = [n for n, f in fields.items() if n not in kwargs and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{prefix or cls.__name__} is missing required key(s) {missing}")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{prefix or cls.__name__}: {err}") from err


def to_dict(obj) -> dict[str, Any]:
    """Plain nested dict of a config dataclass (tuples become lists), suitable for YAML or JSON."""

    def plain(v):
        if hasattr(v, "to_dict"):
            return plain(v.to_dict())
        if dataclasses.is_dataclass(v):
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, tuple):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v

    return plain(obj)


def load_dict(path: str | Path | None = None, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Read a YAML file (optional) and apply dotted ``key=value`` overrides; return a plain dict."""
    import yaml
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        base = OmegaConf.load(str(path)) if path is not None else OmegaConf.create({})
    except FileNotFoundError as err:
        raise ConfigError(f"config file {str(path)!r} does not exist") from err
    except (OmegaConfBaseException, yaml.YAMLError) as err:
        raise ConfigError(f"config file {str(path)!r} could not be parsed: {err}") from err
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is invalid: overrides are dotted key=value pairs, "
                              f"e.g. model.rope.type=yarn")
    try:
        merged = OmegaConf.merge(base, OmegaConf.from_dotlist(list(overrides)))
        return OmegaConf.to_container(merged, resolve=True)
    except OmegaConfBaseException as err:
        raise ConfigError(f"config {str(path)!r} with overrides {list(overrides)}: {err}") from err


def import_plugins(modules: Sequence[str]) -> None:
    """Import the modules a config lists under ``plugins`` (custom eviction policies register themselves)."""
    import importlib

    if isinstance(modules, str) or not isinstance(modules, Sequence):
        raise ConfigError(f"plugins={modules!r} is invalid: must be a list of module names")
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as err:
            raise ConfigError(f"plugins: module {name!r} could not be imported: {err}") from err


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
