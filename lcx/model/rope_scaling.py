"""The RoPE scaling types: one function and one registry entry per type, and ``RopeConfig`` (``rope:`` of a model
config; ``lcx.model.config`` and ``lcx.config`` re-export it), checked against the registry.

A type maps (RopeConfig, rotary dim d, max_position_embeddings, original context, sequence length) to inverse
frequencies theta'_i (i = 0 .. d/2 - 1, float64) and an attention factor m that multiplies cos and sin (attention
logits then scale by m^2). Its registry entry also says which ``rope.*`` fields it needs (config validation), which
fields it writes to a Hugging Face ``config.json`` and under which ``rope_type`` (HF import and export), and, for
types whose frequencies depend on the current length (dynamic NTK, LongRoPE), how to compute them from a traced
length so one compiled function serves every length.

Adding a type: write ``@register("name", required=(...), hf_fields=(...))`` over its frequency function; config
validation, ``lcx.model.rope`` and ``lcx.checkpoints.hf`` pick it up. The parity tests compare every type with
transformers'
``ROPE_INIT_FUNCTIONS``.

Conventions (Hugging Face): base frequencies theta_i = theta^(-2i/d) with the exponent computed in float32, as
transformers does, the rest in float64 and rounded to float32 at the end, like transformers' buffers.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from lcx.config_base import ConfigError, check

InvFreq = Callable[["RopeConfig", int, int, int, "int | None"], "tuple[np.ndarray, float]"]


@dataclasses.dataclass(frozen=True)
class RopeType:
    """One scaling type. ``inv_freq(rope, dim, max_pos, original, seq_len)`` -> (inverse frequencies, factor)."""

    name: str
    inv_freq: InvFreq
    required: tuple[str, ...] = ()  # rope.* fields that must be set
    hf_fields: tuple[str, ...] = ()  # rope.* fields written to / read from config.json
    hf_name: str | None = None  # transformers' rope_type (None: exported through ``to_hf``)
    traced: Callable | None = None  # (rope, dim, max_pos, original, seq_len: jax.Array) -> jnp inverse frequencies
    check: Callable[["RopeConfig"], None] | None = None  # extra validation beyond ``required``
    to_hf: Callable[["RopeConfig", int], dict[str, Any]] | None = None  # custom export (rope, rotary dim)

    @property
    def length_dependent(self) -> bool:
        return self.traced is not None


_REGISTRY: dict[str, RopeType] = {}


# --------------------------------------------------------------------------------------------------- config
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
    # dynamic: a KV cache stores keys before rotation and rotates every key with the current length's base at each
    # call (False: each key keeps the base of the call that wrote it, as transformers' cache does)
    rerotate: bool = False

    def __post_init__(self):
        check(self.type in rope_types(), "rope.type", self.type, f"must be one of {list(rope_types())}")
        kind = get(self.type)
        check(self.theta > 0, "rope.theta", self.theta, "must be > 0")
        check(0 < self.partial_rotary_factor <= 1, "rope.partial_rotary_factor", self.partial_rotary_factor,
              "must be in (0, 1]")
        for name in kind.required:
            if getattr(self, name) is None:
                raise ConfigError(f"rope.{name} is required for rope.type={self.type!r} (missing); "
                                  f"{self.type} needs {list(kind.required)}")
        if self.factor is not None:
            check(self.factor >= 1.0 or self.type in ("default", "longrope"), "rope.factor", self.factor,
                  "a scaling factor must be >= 1")
            check(self.factor > 0, "rope.factor", self.factor, "must be > 0")
        if kind.check is not None:
            kind.check(self)
        check(isinstance(self.rerotate, bool), "rope.rerotate", self.rerotate, "must be true or false")
        if self.rerotate and not kind.length_dependent:
            raise ConfigError(f"rope.rerotate=True is invalid with rope.type={self.type!r}: its frequencies do not "
                              "depend on the length, so a cached key is already rotated as it would be now; allowed "
                              "with rope.type 'dynamic' (or any length-dependent type: "
                              f"{[t.name for t in _REGISTRY.values() if t.length_dependent]})")
        for name in ("short_factor", "long_factor"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, tuple(float(x) for x in value))


# --------------------------------------------------------------------------------------------------- registry
def register(name: str, **entry) -> Callable[[InvFreq], InvFreq]:
    """Decorator: register the decorated frequency function as RoPE type ``name`` (keywords: ``RopeType`` fields)."""
    def wrap(fn: InvFreq) -> InvFreq:
        if name in _REGISTRY:
            raise TypeError(f"a RoPE type named {name!r} is already registered")
        _REGISTRY[name] = RopeType(name=name, inv_freq=fn, **{"hf_name": name, **entry})
        return fn

    return wrap


def rope_types() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def get(name: str) -> RopeType:
    if name not in _REGISTRY:
        raise ConfigError(f"rope.type={name!r} is invalid: must be one of {list(_REGISTRY)}")
    return _REGISTRY[name]


def hf_types() -> dict[str, str]:
    """transformers ``rope_type`` -> lcx type, for the types transformers knows."""
    return {t.hf_name: t.name for t in _REGISTRY.values() if t.hf_name is not None}


def hf_keys() -> frozenset[str]:
    """Every ``rope.*`` field some type reads from config.json."""
    return frozenset(f for t in _REGISTRY.values() for f in t.hf_fields) | {"partial_rotary_factor"}


# --------------------------------------------------------------------------------------------------- helpers
def exponents(dim: int) -> np.ndarray:
    """2i/d for i = 0 .. d/2 - 1, computed in float32 as transformers does."""
    return np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)


def base_inv_freq(theta: float, dim: int) -> np.ndarray:
    """theta^(-2i/d) in float64."""
    return 1.0 / (np.float64(theta) ** exponents(dim).astype(np.float64))


def _ntk_exponent(dim: int) -> float:
    return dim / (dim - 2)


# --------------------------------------------------------------------------------------------------- types
@register("default")
def _default(rope, dim, max_pos, original, seq_len):
    return base_inv_freq(rope.theta, dim), 1.0


@register("linear", required=("factor",), hf_fields=("factor",))
def _linear(rope, dim, max_pos, original, seq_len):
    """Position interpolation: every frequency divided by ``factor``."""
    return base_inv_freq(rope.theta, dim) / rope.factor, 1.0


def _ntk_to_hf(rope, dim):
    # Static NTK is the default RoPE with an enlarged base; transformers has no separate type for it.
    return {"rope_type": "default", "rope_theta": rope.theta * rope.factor ** _ntk_exponent(dim)}


@register("ntk", required=("factor",), hf_name=None, to_hf=_ntk_to_hf)
def _ntk(rope, dim, max_pos, original, seq_len):
    """Static NTK-aware scaling: base theta * factor^(d/(d-2))."""
    return base_inv_freq(rope.theta * rope.factor ** _ntk_exponent(dim), dim), 1.0


def _dynamic_traced(rope, dim, max_pos, original, seq_len):
    """theta'_i = (b * X^(d/(d-2)))^(-2i/d) = b^(-2i/d) * exp(-(2i/(d-2)) * ln X), X = s*T/M - (s-1).

    The first factor is static (float64 -> float32) and the second one is a single float32 exp, which keeps the
    result within a few ulps of transformers' value even at long lengths."""
    import jax.numpy as jnp

    static = jnp.asarray(base_inv_freq(rope.theta, dim).astype(np.float32))
    length = jnp.maximum(seq_len, max_pos).astype(jnp.float32)
    x = rope.factor * length / max_pos - (rope.factor - 1)
    powers = jnp.asarray((exponents(dim).astype(np.float64) * _ntk_exponent(dim)).astype(np.float32))
    return static * jnp.exp(-powers * jnp.log(x))


@register("dynamic", required=("factor",), hf_fields=("factor",), traced=_dynamic_traced)
def _dynamic(rope, dim, max_pos, original, seq_len):
    """Dynamic NTK: the NTK base grows with the sequence length once it exceeds max_position_embeddings."""
    length = max(seq_len or 0, max_pos)
    base = rope.theta * ((rope.factor * length / max_pos) - (rope.factor - 1)) ** _ntk_exponent(dim)
    return base_inv_freq(base, dim), 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _check_yarn(rope) -> None:
    if not rope.beta_fast > rope.beta_slow:
        raise ConfigError(f"rope.beta_fast={rope.beta_fast!r} is invalid: must be > rope.beta_slow={rope.beta_slow}")


@register("yarn", check=_check_yarn,
          hf_fields=("factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate",
                     "original_max_position_embeddings"))
def _yarn(rope, dim, max_pos, original, seq_len):
    """YaRN: high-frequency dims keep theta_i, low-frequency dims are interpolated by ``factor``, with a linear ramp
    between the dims that complete ``beta_fast`` and ``beta_slow`` turns over the original context; attention
    factor 0.1 ln(s) + 1."""
    factor = rope.factor if rope.factor is not None else max_pos / original
    if rope.attention_factor is not None:
        m = rope.attention_factor
    elif rope.mscale and rope.mscale_all_dim:
        m = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim)
    else:
        m = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        # The dimension whose wavelength completes `rotations` turns over the original context.
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoids a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float64)
    base = base_inv_freq(rope.theta, dim)
    return (base / factor) * ramp + base * (1.0 - ramp), float(m)


def _check_llama3(rope) -> None:
    if not rope.high_freq_factor > rope.low_freq_factor:
        raise ConfigError(f"rope.high_freq_factor={rope.high_freq_factor!r} is invalid: must be > "
                          f"rope.low_freq_factor={rope.low_freq_factor}")


@register("llama3", required=("factor", "low_freq_factor", "high_freq_factor"), check=_check_llama3,
          hf_fields=("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"))
def _llama3(rope, dim, max_pos, original, seq_len):
    """Llama 3.1: wavelengths above original / low_freq_factor divided by ``factor``, below original /
    high_freq_factor kept, a smooth blend between."""
    inv_freq = base_inv_freq(rope.theta, dim)
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = original / rope.low_freq_factor
    high_wavelen = original / rope.high_freq_factor
    scaled = np.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (original / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, blended, scaled), 1.0


def _longrope_table(rope, dim, long: bool) -> np.ndarray:
    ext = rope.long_factor if long else rope.short_factor
    return 1.0 / (np.asarray(ext, np.float64) * np.float64(rope.theta) ** exponents(dim).astype(np.float64))


def _longrope_traced(rope, dim, max_pos, original, seq_len):
    """One of two static tables, picked by the traced length."""
    import jax.numpy as jnp

    short = _longrope_table(rope, dim, long=False).astype(np.float32)
    long = _longrope_table(rope, dim, long=True).astype(np.float32)
    return jnp.where(seq_len > original, long, short)


@register("longrope", required=("short_factor", "long_factor"), traced=_longrope_traced,
          hf_fields=("factor", "short_factor", "long_factor", "attention_factor", "original_max_position_embeddings"))
def _longrope(rope, dim, max_pos, original, seq_len):
    """LongRoPE (Phi-3): one rescale factor per frequency, ``long_factor`` beyond the original context,
    ``short_factor`` within it; attention factor sqrt(1 + ln(s) / ln(original))."""
    factor = rope.factor if rope.factor is not None else max_pos / original
    if rope.attention_factor is not None:
        m = float(rope.attention_factor)
    else:
        m = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return _longrope_table(rope, dim, long=seq_len is not None and seq_len > original), m


__all__ = ["RopeConfig", "RopeType", "base_inv_freq", "exponents", "get", "hf_keys", "hf_types", "register",
           "rope_types"]
