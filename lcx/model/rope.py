"""Rotary position embeddings and the scaling family, in the Hugging Face half-split ("rotate_half") layout.

Each scaling type maps (RopeConfig, rotary dim d) to inverse frequencies theta'_i (i = 0 .. d/2 - 1) and an
attention factor m that multiplies cos and sin (so attention logits scale by m^2). Formulas: reference-notes §2;
the parity tests compare every type with transformers' own ``ROPE_INIT_FUNCTIONS``.

Static types are computed once in numpy (float64, rounded to float32 like transformers' buffers). ``dynamic`` and
``longrope`` depend on the current sequence length and are computed with jnp from a traced length, so one compiled
function serves every length.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from lcx.config import ModelConfig, RopeConfig


def _exponents(dim: int) -> np.ndarray:
    """2i/d for i = 0 .. d/2 - 1, computed in float32 as transformers does."""
    return np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)


def _default(theta: float, dim: int) -> np.ndarray:
    return 1.0 / (np.float64(theta) ** _exponents(dim).astype(np.float64))


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rope: RopeConfig, dim: int, max_pos: int, original: int) -> tuple[np.ndarray, float]:
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
    extrapolation = 1.0 - ramp  # high-frequency dims (small i) keep theta_i
    base = _default(rope.theta, dim)
    inv_freq = (base / factor) * ramp + base * extrapolation
    return inv_freq, float(m)


def _llama3(rope: RopeConfig, dim: int, original: int) -> np.ndarray:
    inv_freq = _default(rope.theta, dim)
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = original / rope.low_freq_factor
    high_wavelen = original / rope.high_freq_factor
    scaled = np.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (original / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, blended, scaled)


def _longrope_factor(rope: RopeConfig, max_pos: int, original: int) -> float:
    factor = rope.factor if rope.factor is not None else max_pos / original
    if rope.attention_factor is not None:
        return float(rope.attention_factor)
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def inv_freq_and_factor(rope: RopeConfig, dim: int, max_position_embeddings: int,
                        seq_len: int | None = None) -> tuple[np.ndarray, float]:
    """Inverse frequencies ``[dim // 2]`` (float32) and attention factor for a sequence of ``seq_len`` tokens.

    ``seq_len`` only matters for ``dynamic`` and ``longrope``; None means "at most max_position_embeddings".
    """
    original = rope.original_max_position_embeddings or max_position_embeddings
    m = 1.0
    if rope.type == "default":
        inv = _default(rope.theta, dim)
    elif rope.type == "linear":
        inv = _default(rope.theta, dim) / rope.factor
    elif rope.type == "ntk":
        base = rope.theta * rope.factor ** (dim / (dim - 2))
        inv = _default(base, dim)
    elif rope.type == "dynamic":
        length = max(seq_len or 0, max_position_embeddings)
        base = rope.theta * ((rope.factor * length / max_position_embeddings) - (rope.factor - 1)) ** (dim / (dim - 2))
        inv = _default(base, dim)
    elif rope.type == "yarn":
        inv, m = _yarn(rope, dim, max_position_embeddings, original)
    elif rope.type == "llama3":
        inv = _llama3(rope, dim, original)
    elif rope.type == "longrope":
        ext = rope.long_factor if seq_len is not None and seq_len > original else rope.short_factor
        inv = 1.0 / (np.asarray(ext, np.float64) * np.float64(rope.theta) ** _exponents(dim).astype(np.float64))
        m = _longrope_factor(rope, max_position_embeddings, original)
    else:  # unreachable: RopeConfig validates the type
        raise ValueError(f"rope.type={rope.type!r} is not implemented")
    return inv.astype(np.float32), float(m)


def inv_freq_for_length(config: ModelConfig, seq_len: jax.Array) -> jax.Array:
    """Inverse frequencies ``[rotary_dim // 2]`` for a traced ``seq_len`` (the length-dependent types).

    Dynamic NTK: theta'_i = (b * X^(d/(d-2)))^(-2i/d) = b^(-2i/d) * exp(-(2i/(d-2)) * ln X), X = s*T/M - (s-1).
    The first factor is static (float64 -> float32) and the second one is a single float32 exp, which keeps the
    result within a few ulps of transformers' value even at long lengths.
    """
    rope, dim, max_pos = config.rope, config.rotary_dim, config.max_position_embeddings
    if rope.type == "dynamic":
        static = jnp.asarray(_default(rope.theta, dim).astype(np.float32))
        length = jnp.maximum(seq_len, max_pos).astype(jnp.float32)
        x = rope.factor * length / max_pos - (rope.factor - 1)
        powers = jnp.asarray((_exponents(dim).astype(np.float64) * dim / (dim - 2)).astype(np.float32))
        return static * jnp.exp(-powers * jnp.log(x))
    if rope.type == "longrope":  # one of two static tables, picked by the length
        short, _ = inv_freq_and_factor(rope, dim, max_pos, seq_len=None)
        long, _ = inv_freq_and_factor(rope, dim, max_pos, seq_len=config.original_max_position_embeddings + 1)
        return jnp.where(seq_len > config.original_max_position_embeddings, long, short)
    return jnp.asarray(inv_freq_and_factor(rope, dim, max_pos)[0])


def rope_tables(config: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos and sin ``[b, t, rotary_dim]`` (float32, attention factor applied) for int ``positions [b, t]``.

    For ``dynamic``/``longrope`` the sequence length is ``max(positions) + 1``, as in transformers.
    """
    dim = config.rotary_dim
    inv, m = inv_freq_and_factor(config.rope, dim, config.max_position_embeddings)
    if config.rope.type in ("dynamic", "longrope"):
        inv = inv_freq_for_length(config, jnp.max(positions) + 1)
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv, jnp.float32)  # [b, t, d/2]
    angles = jnp.concatenate([freqs, freqs], axis=-1)  # [b, t, d]
    return jnp.cos(angles) * m, jnp.sin(angles) * m


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate ``x [b, t, heads, head_dim]``: the first ``rotary_dim`` dims in half-split pairs, the rest unchanged.

    Computed in float32 (positions of long sequences need the mantissa), returned in ``x.dtype``.
    """
    dim = cos.shape[-1]
    xf = x.astype(jnp.float32)
    rot, rest = xf[..., :dim], xf[..., dim:]
    half = dim // 2
    rotated_half = jnp.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    out = rot * cos[:, :, None, :] + rotated_half * sin[:, :, None, :]
    if rest.shape[-1]:
        out = jnp.concatenate([out, rest], axis=-1)
    return out.astype(x.dtype)
