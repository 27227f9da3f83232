"""Bit-packed 4- and 2-bit KV codes with asymmetric group scales (KIVI's layout): the storage below 8 bits.

An element is an unsigned code ``c`` in ``[0, 2**bits - 1]`` of a group that shares a float16 ``scale`` and
``zero``: ``x ~= c * scale + zero`` with ``zero = min`` and ``scale = (max - min) / (2**bits - 1)`` over the group
(asymmetric: the codes span the group's own range, which symmetric codes would halve at 2 bits). How elements are
grouped follows KIVI (Liu et al., 2024): **keys per channel** - a group is ``group`` consecutive tokens of one channel
of one KV head, because a few key channels carry outliers that a per-token scale would spread over the whole vector;
**values per token** - a group is ``group`` consecutive channels of one token, because attention mixes values token
by token and their error adds up per token.

Codes are packed ``8 // bits`` to a byte along the last axis (``head_dim``), the first code in the low bits, so a
``[..., d]`` block of codes is a ``[..., d * bits / 8]`` uint8 array - real bytes, what a cache allocates and counts.
(A cache packs its keys channel-major, along the tokens - ``quantize_channels(channel_major=True)`` - so a key group
fills whole bytes; ``lcx.cache.lowbit_slots``.)
Scales and zeros are computed from the float16 values they are stored as, so the codes match what dequantization
reads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lcx.kernels.names import LOWBIT_DTYPES as LOWBIT  # cache.kv_dtype -> bits per stored element
SCALE_DTYPE = jnp.float16


def _bits(kv_dtype: str) -> int:
    if kv_dtype not in LOWBIT:
        raise ValueError(f"kv_dtype={kv_dtype!r} is not a bit-packed dtype (allowed: {sorted(LOWBIT)})")
    return LOWBIT[kv_dtype]


def _divides(size: int, by: int, what: str) -> None:
    if by <= 0 or size % by:
        raise ValueError(f"{what}={size} must be a positive multiple of {by}")


def pack(codes: jax.Array, kv_dtype: str) -> jax.Array:
    """``codes [..., d]`` (uint8, each below ``2**bits``) -> ``[..., d * bits // 8]`` uint8, the first in the low
    bits of each byte."""
    bits = _bits(kv_dtype)
    per = 8 // bits
    _divides(codes.shape[-1], per, "head_dim")
    c = codes.astype(jnp.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // per, per)
    shifts = jnp.arange(per, dtype=jnp.uint8) * bits
    # The shifted codes occupy disjoint bits, so their sum is their bitwise or.
    return jnp.sum(c << shifts, axis=-1, dtype=jnp.uint32).astype(jnp.uint8)


def unpack(packed: jax.Array, kv_dtype: str, dtype=jnp.uint8) -> jax.Array:
    """The inverse of :func:`pack`: ``[..., n]`` uint8 -> ``[..., n * 8 // bits]`` codes in ``dtype`` (uint8, or a
    wider integer or float type a kernel multiplies them in)."""
    bits = _bits(kv_dtype)
    n = packed.shape[-1]
    if n % 4 == 0:  # as 32-bit words (little-endian: byte 0 in the low bits), 32 / bits codes each: code i of word w
        # is element (32 / bits) w + i, so the codes come out in order; XLA:CPU vectorizes the 32-bit lanes, not
        # the uint8 ones (the byte-wise unpack below took 1.2x as long in decode)
        words = jax.lax.bitcast_convert_type(packed.reshape(*packed.shape[:-1], n // 4, 4), jnp.uint32)
        shifts = jnp.arange(32 // bits, dtype=jnp.uint32) * bits
        # int32 before a float: XLA:CPU widens signed 32-bit lanes to float natively, unsigned ones not
        codes = ((words[..., None] >> shifts) & jnp.uint32(2**bits - 1)).astype(jnp.int32)
    else:
        shifts = jnp.arange(8 // bits, dtype=jnp.uint8) * bits
        codes = (packed[..., None] >> shifts) & jnp.uint8(2**bits - 1)
    return codes.reshape(*packed.shape[:-1], n * 8 // bits).astype(dtype)


def _quantize(x: jax.Array, bits: int, axis: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Codes of ``x`` (float32, grouped along ``axis``) with one stored scale and zero per group."""
    top = 2**bits - 1
    lo, hi = jnp.min(x, axis=axis, keepdims=True), jnp.max(x, axis=axis, keepdims=True)
    zero = lo.astype(SCALE_DTYPE)
    scale = ((hi - zero.astype(jnp.float32)) / top).astype(SCALE_DTYPE)  # the stored values, rounded first
    s, z = scale.astype(jnp.float32), zero.astype(jnp.float32)
    codes = jnp.clip(jnp.round((x - z) / jnp.where(s > 0, s, 1.0)), 0, top).astype(jnp.uint8)
    return codes, jnp.squeeze(scale, axis), jnp.squeeze(zero, axis)


def quantize_tokens(x: jax.Array, kv_dtype: str, group: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Values, per token: ``x [..., d]`` -> ``(packed [..., d * bits // 8], scale [..., d // group],
    zero [..., d // group])``; a group is ``group`` consecutive channels of one token."""
    bits = _bits(kv_dtype)
    d = x.shape[-1]
    _divides(d, group, "head_dim")
    xg = x.astype(jnp.float32).reshape(*x.shape[:-1], d // group, group)
    codes, scale, zero = _quantize(xg, bits, axis=-1)
    return pack(codes.reshape(x.shape), kv_dtype), scale, zero


def dequantize_tokens(packed: jax.Array, scale: jax.Array, zero: jax.Array, kv_dtype: str,
                      dtype=jnp.float32) -> jax.Array:
    """The values of :func:`quantize_tokens`' output, ``[..., d]`` in ``dtype``."""
    codes = unpack(packed, kv_dtype).astype(jnp.float32)
    groups = scale.shape[-1]
    cg = codes.reshape(*codes.shape[:-1], groups, codes.shape[-1] // groups)
    x = cg * scale.astype(jnp.float32)[..., None] + zero.astype(jnp.float32)[..., None]
    return x.reshape(codes.shape).astype(dtype)


def quantize_channels(x: jax.Array, kv_dtype: str, group: int, *,
                      channel_major: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Keys, per channel: ``x [..., n, d]`` (``n`` tokens) -> ``(packed [..., n, d * bits // 8],
    scale [..., n // group, d], zero [..., n // group, d])``; a group is ``group`` consecutive tokens of one
    channel. ``channel_major``: the codes packed along the tokens instead, ``[..., d, n * bits // 8]`` - a key
    cache's layout, where a channel's codes are contiguous and a group fills whole bytes."""
    bits = _bits(kv_dtype)
    n, d = x.shape[-2:]
    _divides(n, group, "tokens")
    xg = x.astype(jnp.float32).reshape(*x.shape[:-2], n // group, group, d)
    codes, scale, zero = _quantize(xg, bits, axis=-2)
    codes = codes.reshape(x.shape)
    return pack(jnp.swapaxes(codes, -1, -2) if channel_major else codes, kv_dtype), scale, zero


def dequantize_channels(packed: jax.Array, scale: jax.Array, zero: jax.Array, kv_dtype: str,
                        dtype=jnp.float32, *, channel_major: bool = False) -> jax.Array:
    """The keys of :func:`quantize_channels`' output (with the same ``channel_major``), ``[..., n, d]`` in
    ``dtype``."""
    codes = unpack(packed, kv_dtype, jnp.float32)
    if channel_major:
        codes = jnp.swapaxes(codes, -1, -2)
    n, d = codes.shape[-2:]
    groups = scale.shape[-2]
    cg = codes.reshape(*codes.shape[:-2], groups, n // groups, d)
    x = cg * scale.astype(jnp.float32)[..., None, :] + zero.astype(jnp.float32)[..., None, :]
    return x.reshape(codes.shape).astype(dtype)


def key_logits(q: jax.Array, packed: jax.Array, scale: jax.Array, zero: jax.Array, kv_dtype: str) -> jax.Array:
    """``q [..., d] . k_j`` for the per-channel keys of :func:`quantize_channels` (``packed [n, d * bits // 8]``,
    ``scale, zero [n // group, d]``) without forming a float key: per token group ``g``,
    ``q . k_j = (q * scale_g) . codes_j + q . zero_g`` - the scales move onto the query (one multiply per group, not
    per token), which is how a kernel reads the codes tile by tile. Returns ``[..., n]`` float32."""
    codes = unpack(packed, kv_dtype).astype(jnp.float32)  # [n, d]
    n, d = codes.shape
    groups = scale.shape[0]
    qf = q.astype(jnp.float32)
    q_scaled = qf[..., None, :] * scale.astype(jnp.float32)  # [..., groups, d]
    offset = qf @ zero.astype(jnp.float32).T  # [..., groups]
    cg = codes.reshape(groups, n // groups, d)
    logits = jnp.einsum("...gd,gtd->...gt", q_scaled, cg) + offset[..., None]
    return logits.reshape(*q.shape[:-1], n)


def value_mix(p: jax.Array, packed: jax.Array, scale: jax.Array, zero: jax.Array, kv_dtype: str) -> jax.Array:
    """``sum_j p_j v_j`` for the per-token values of :func:`quantize_tokens` (``packed [n, d * bits // 8]``,
    ``scale, zero [n, d // group]``) without forming a float value: per channel group ``g``,
    ``sum_j p_j v_jc = sum_j (p_j scale_jg) codes_jc + sum_j p_j zero_jg``. ``p [..., n]``; returns ``[..., d]``
    float32."""
    codes = unpack(packed, kv_dtype).astype(jnp.float32)  # [n, d]
    n, d = codes.shape
    groups = scale.shape[-1]
    pf = p.astype(jnp.float32)
    weighted = pf[..., :, None] * scale.astype(jnp.float32)  # [..., n, groups]
    cg = codes.reshape(n, groups, d // groups)
    out = jnp.einsum("...ng,ngc->...gc", weighted, cg) + (pf @ zero.astype(jnp.float32))[..., None]
    return out.reshape(*p.shape[:-1], d)


def lowbit_bytes(tokens: int, head_dim: int, kv_dtype: str, group: int) -> int:
    """Bytes of ``tokens`` keys *and* values of one KV head in this storage: packed codes, plus a float16 scale and
    zero per group (keys: per ``group`` tokens and channel; values: per token and ``group`` channels)."""
    bits = _bits(kv_dtype)
    _divides(tokens, group, "tokens")
    _divides(head_dim, group, "head_dim")
    codes = 2 * tokens * head_dim * bits // 8
    key_groups = (tokens // group) * head_dim
    value_groups = tokens * (head_dim // group)
    return codes + 2 * 2 * (key_groups + value_groups)


__all__ = ["LOWBIT", "SCALE_DTYPE", "dequantize_channels", "dequantize_tokens", "key_logits", "lowbit_bytes", "pack",
           "quantize_channels", "quantize_tokens", "unpack", "value_mix"]
