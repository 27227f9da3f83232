"""The slot cache below 8 bits (``cache.kv_dtype: int4 | int2``): bit-packed codes, group scales, a float window.

Storage per layer, row and KV head (``lcx.kernels.lowbit`` for the code layout and the grouping):

- ``k [b, k, d, C' * bits / 8]`` uint8 (``C'``: the slots rounded up to whole key groups): the keys' codes of slots
  ``0 .. q`` (the *quantized* slots), channel-major, packed along the slots - a key group fills whole bytes of each
  channel, and a decode query reads each channel's codes contiguously (``lcx.kernels.lowbit_decode``);
- ``v [b, k, C, d * bits / 8]`` uint8: the values' codes, packed along ``head_dim``;
- ``k_scale, k_zero [b, k, ceil(C / G), d]`` float16: keys **per channel**, one scale and zero per ``G = kv_group``
  consecutive slots of a channel;
- ``v_scale, v_zero [b, k, C, d / Gv]`` float16: values **per token**, one per ``Gv = min(G, d)`` channels of a slot;
- ``k_res, v_res [b, k, R + G, d]`` in ``cache.dtype``: the keys and values of slots ``q .. count``, not quantized.

``q = max(count - R, 0) // G * G`` with ``R = kv_residual``: the ``R`` most recent tokens stay in full precision
(KIVI's residual), and so do the tokens of the key group still filling (fewer than ``G``): a key group is quantized
when its ``G`` tokens are all older than the window, so a group's scale is computed once, from all of its tokens.
The float window holds ``R + G`` tokens at most; it is counted in the cache's bytes.

Attention reads a layer's keys and values dequantized (:func:`float_kv`: codes x scale + zero, the window's slots
overlaid), one layer at a time inside the model's layer scan, and calls the float backend ops - every backend,
position mode and eviction statistic as for a float cache. Eviction scores and compacts the dequantized slots and
quantizes the survivors again (:func:`requantize`): values are re-derived exactly (a token keeps its channel groups,
so its range and grid), keys are regrouped, since compaction moves survivors into new groups of ``G`` slots (the
cost is measured in ``experiments/bench/lowbit_keys.py``: about 40% more attention drift after three evictions of a
quarter than keeping each key's first scale would give).

``fmt`` in the functions below is the format (``lcx.cache.storage.PackedStorage``): its ``name`` (``int4`` /
``int2``), ``group`` (``kv_group``) and ``residual`` (``kv_residual``), one value.

Shapes: b batch, k KV heads, H keep heads, C slots, t new tokens, d head dim, S staging slots.
"""

from __future__ import annotations

import types
from collections.abc import Mapping

import einops
import jax
import jax.numpy as jnp

from lcx.cache.schema import Field
from lcx.kernels import lowbit
from lcx.kernels.lowbit import LOWBIT
from lcx.kernels.lowbit_decode import LowbitKV

_SCALE = "float16"
_KV = ("layers", "batch", "kv_heads")
FIELDS: Mapping[str, Field] = {
    "k": Field((*_KV, "head_dim", "packed_length"), "uint8", 0, role="kv"),
    "v": Field((*_KV, "length", "packed_dim"), "uint8", 0, role="kv"),
    "k_scale": Field((*_KV, "key_groups", "head_dim"), _SCALE, 0.0, role="kv"),
    "k_zero": Field((*_KV, "key_groups", "head_dim"), _SCALE, 0.0, role="kv"),
    "v_scale": Field((*_KV, "length", "value_groups"), _SCALE, 0.0, role="kv"),
    "v_zero": Field((*_KV, "length", "value_groups"), _SCALE, 0.0, role="kv"),
    "k_res": Field((*_KV, "residual", "head_dim"), "kv", 0, role="kv"),
    "v_res": Field((*_KV, "residual", "head_dim"), "kv", 0, role="kv"),
}


def value_group(group: int, head_dim: int) -> int:
    """Channels per value scale: ``group``, or the whole head when the head is smaller."""
    return min(group, head_dim)


def sizes(fmt, head_dim: int, capacity: int) -> dict[str, int]:
    """The logical axes of :data:`FIELDS` beyond the slot cache's own."""
    bits, group = LOWBIT[fmt.name], fmt.group
    return {"packed_dim": head_dim * bits // 8, "key_groups": -(-capacity // group),
            "packed_length": -(-capacity // group) * group * bits // 8,
            "value_groups": head_dim // value_group(group, head_dim), "residual": fmt.residual + group}


def check(fmt, head_dim: int) -> None:
    """Raise ``ValueError`` naming the setting when ``head_dim`` cannot be stored with these codes and groups."""
    per_byte, group = 8 // LOWBIT[fmt.name], fmt.group
    if head_dim % per_byte:
        raise ValueError(f"cache.kv_dtype={fmt.name!r} packs {per_byte} codes per byte along head_dim, which must be a "
                         f"multiple of {per_byte}; the model's head_dim is {head_dim}")
    vg = value_group(group, head_dim)
    if head_dim % vg:
        raise ValueError(f"cache.kv_group={group} must divide the model's head_dim={head_dim} (values are grouped "
                         f"per token over kv_group channels); allowed: a divisor of {head_dim}, or >= {head_dim}")


def quantized_slots(count: jax.Array, fmt) -> jax.Array:
    """The slots held as codes for ``count`` occupied ones: whole groups older than the ``residual`` window."""
    return jnp.maximum(count - fmt.residual, 0) // fmt.group * fmt.group


def per_kv(x: jax.Array, kv_heads: int) -> jax.Array:
    """A keep-head array ``[b, H, ...]`` per KV head ``[b, k, ...]``."""
    return einops.repeat(x, "b H ... -> b (H j) ...", j=kv_heads // x.shape[1])


def _expand_groups(x: jax.Array, group: int, slots: int) -> jax.Array:
    """Key scales ``[..., ceil(C / G), d]`` -> one row per slot ``[..., C, d]`` (a broadcast XLA fuses)."""
    return jnp.repeat(x, group, axis=-2, total_repeat_length=x.shape[-2] * group)[..., :slots, :]


def dequantize_store(layer, fmt, dtype) -> tuple[jax.Array, jax.Array]:
    """Every slot's codes as values ``[b, k, C, d]`` (slots past the quantized ones are meaningless)."""
    slots = layer.v.shape[-2]
    codes = jnp.swapaxes(lowbit.unpack(layer.k, fmt.name, jnp.float32), -1, -2)[..., :slots, :]
    k = codes * _expand_groups(layer.k_scale, fmt.group, slots).astype(jnp.float32) \
        + _expand_groups(layer.k_zero, fmt.group, slots).astype(jnp.float32)
    v = lowbit.dequantize_tokens(layer.v, layer.v_scale, layer.v_zero, fmt.name)
    return k.astype(dtype), v.astype(dtype)


def float_kv(layer, fmt, dtype) -> tuple[jax.Array, jax.Array]:
    """One layer's keys and values as attention reads them, ``[b, k, C, d]`` in ``dtype``: the codes dequantized,
    the float window's slots (``q .. q + R + G``) taken from it."""
    kv_heads, slots = layer.v.shape[1], layer.v.shape[2]
    k, v = dequantize_store(layer, fmt, dtype)
    start = quantized_slots(per_kv(layer.count, kv_heads), fmt)  # [b, k]
    width = layer.k_res.shape[-2]
    idx = jnp.arange(slots)[None, None, :] - start[..., None]  # [b, k, C] the slot's place in the window
    in_window = (idx >= 0) & (idx < width)
    take = lambda res: jnp.take_along_axis(res, jnp.clip(idx, 0, width - 1)[..., None], axis=2)  # noqa: E731
    return (jnp.where(in_window[..., None], take(layer.k_res).astype(dtype), k),
            jnp.where(in_window[..., None], take(layer.v_res).astype(dtype), v))


def decode_view(layer, fmt) -> LowbitKV:
    """The scales, zeros and float window a one-query attend reads beside the codes ``layer.k, layer.v``
    (:func:`lcx.kernels.decode_lowbit`, or the Pallas kernel of ``lcx.kernels.lowbit_pallas``)."""
    start = quantized_slots(per_kv(layer.count, layer.k.shape[1]), fmt)
    return LowbitKV(k_scale=layer.k_scale, k_zero=layer.k_zero, v_scale=layer.v_scale, v_zero=layer.v_zero,
                    k_win=layer.k_res, v_win=layer.v_res, win_start=start, quant=fmt.name, group=fmt.group)


def _quantize_slots(k: jax.Array, v: jax.Array, fmt):
    """Float slots ``[b, k, S, d]`` (``S`` a multiple of ``fmt.group``) -> codes, key and value scales and zeros."""
    kc, ks, kz = lowbit.quantize_channels(k, fmt.name, fmt.group, channel_major=True)  # [b, k, d, S * bits / 8]
    vc, vs, vz = lowbit.quantize_tokens(v, fmt.name, value_group(fmt.group, v.shape[-1]))
    return kc, ks, kz, vc, vs, vz


def _window(x: jax.Array, start: jax.Array, width: int) -> jax.Array:
    """``x [b, k, S, d]`` at slots ``start [b, k] .. + width`` (clipped at the end: those slots are unused)."""
    idx = jnp.clip(start[..., None] + jnp.arange(width), 0, x.shape[2] - 1)
    return jnp.take_along_axis(x, idx[..., None], axis=2)


def write(layer, k: jax.Array, v: jax.Array, ok: jax.Array, fmt):
    """Append ``k, v [b, t, k, d]`` (where ``ok [b, t]``) behind the window; whole key groups that leave it are
    quantized into the store. ``layer.count`` is the count *before* this call (the caller updates it)."""
    b, t, kv_heads, d = k.shape
    group, slots, groups, per_byte = fmt.group, layer.v.shape[2], layer.k_scale.shape[2], 8 // LOWBIT[fmt.name]
    width = layer.k_res.shape[2]
    count = per_kv(layer.count, kv_heads)  # [b, k]
    start = quantized_slots(count, fmt)
    n = jnp.sum(ok, axis=1, dtype=jnp.int32)  # [b]
    rank = jnp.cumsum(ok.astype(jnp.int32), axis=1) - 1
    stage_len = -(-(width + t) // group) * group
    dest = jnp.where(ok[:, None, :], (count - start)[..., None] + rank[:, None, :], stage_len)  # [b, k, t]
    rows, heads = jnp.arange(b)[:, None, None], jnp.arange(kv_heads)[None, :, None]

    def stage(res, x):
        buf = jnp.zeros((b, kv_heads, stage_len, d), jnp.float32).at[:, :, :width].set(res.astype(jnp.float32))
        return buf.at[rows, heads, dest].set(x.swapaxes(1, 2).astype(jnp.float32), mode="drop")

    sk, sv = stage(layer.k_res, k), stage(layer.v_res, v)
    flush = quantized_slots(count + n[:, None], fmt) - start  # [b, k] whole groups leaving the window
    kc, ks, kz, vc, vs, vz = _quantize_slots(sk, sv, fmt)
    i = jnp.arange(stage_len)
    slot = jnp.where(i < flush[..., None], start[..., None] + i, slots)  # [b, k, S]; past the flush: dropped
    g = jnp.arange(stage_len // group)
    grp = jnp.where(g * group < flush[..., None], start[..., None] // group + g, groups)
    byte = jnp.arange(stage_len // per_byte)  # the keys' code bytes of the flushed groups, along the slots
    at_byte = jnp.where(byte < flush[..., None] // per_byte, start[..., None] // per_byte + byte, layer.k.shape[-1])
    put = lambda buf, x, at: buf.at[rows, heads, at].set(x.astype(buf.dtype), mode="drop")  # noqa: E731
    # rows, heads and at_byte index around the channel axis, so the update is [b, k, bytes, d]
    keys = layer.k.at[rows, heads, :, at_byte].set(jnp.swapaxes(kc, -1, -2), mode="drop")
    return layer.replace(
        k=keys, v=put(layer.v, vc, slot), v_scale=put(layer.v_scale, vs, slot),
        v_zero=put(layer.v_zero, vz, slot), k_scale=put(layer.k_scale, ks, grp), k_zero=put(layer.k_zero, kz, grp),
        k_res=_window(sk, flush, width).astype(layer.k_res.dtype),
        v_res=_window(sv, flush, width).astype(layer.v_res.dtype))


def rewind(layer, before: jax.Array, after: jax.Array, fmt) -> dict[str, jax.Array]:
    """The float window once a row's newest tokens are forgotten (``count`` from ``before`` to ``after [b, H]``:
    the rejected drafts of a speculative verification). The window starts at ``quantized_slots(after)``; where
    the forgotten tokens' writes flushed a group past that start, the group's slots come back dequantized from its
    codes (lossy, as a draft may be: the group's scale also saw the forgotten tokens), the rest of the window is the
    old one. Only the window's ``R + G`` slots are read: no layer is dequantized whole."""
    kv_heads, slots, groups = layer.v.shape[1], layer.v.shape[2], layer.k_scale.shape[2]
    group, per_byte, width = fmt.group, 8 // LOWBIT[fmt.name], layer.k_res.shape[2]
    old = quantized_slots(per_kv(before, kv_heads), fmt)  # [b, k] where the window starts now
    new = quantized_slots(per_kv(after, kv_heads), fmt)  # ... and where it must start
    span = -(-width // group) * group  # whole groups from ``new`` (a multiple of the group)
    clip = lambda idx, n: jnp.clip(idx, 0, n - 1)  # noqa: E731 - slots past the cache are never read
    take = lambda x, idx: jnp.take_along_axis(x, idx[..., None], axis=2)  # noqa: E731 - [b, k, n, ...] at idx
    byte = clip(new[..., None] // per_byte + jnp.arange(span // per_byte), layer.k.shape[-1])  # [b, k, n]
    codes = jnp.take_along_axis(layer.k, byte[:, :, None, :], axis=-1)  # [b, k, d, n]
    codes = jnp.swapaxes(lowbit.unpack(codes, fmt.name, jnp.float32), -1, -2)  # [b, k, span, d]
    grp = clip(new[..., None] // group + jnp.arange(span // group), groups)
    scale = lambda x: jnp.repeat(take(x, grp).astype(jnp.float32), group, axis=2)  # noqa: E731
    k = codes * scale(layer.k_scale) + scale(layer.k_zero)
    slot = clip(new[..., None] + jnp.arange(span), slots)
    v = lowbit.dequantize_tokens(take(layer.v, slot), take(layer.v_scale, slot), take(layer.v_zero, slot), fmt.name)
    at = new[..., None] + jnp.arange(width)  # [b, k, R + G] the new window's slots
    kept = (at >= old[..., None])[..., None]  # slots the old window holds; below it, the dequantized group
    idx = jnp.clip(at - old[..., None], 0, width - 1)
    return {"k_res": jnp.where(kept, take(layer.k_res, idx), k[:, :, :width].astype(layer.k_res.dtype)),
            "v_res": jnp.where(kept, take(layer.v_res, idx), v[:, :, :width].astype(layer.v_res.dtype))}


def requantize(count: jax.Array, k: jax.Array, v: jax.Array, fmt, groups: int, dtype) -> dict[str, jax.Array]:
    """The stored buffers of float slots ``k, v [b, k, C, d]`` whose first ``count [b, H]`` are occupied (after an
    eviction compacted the dequantized slots): whole groups below the window as codes, the rest in the window
    (``groups``: the key-scale rows, ``ceil(C / G)``; ``dtype``: the window's)."""
    kv_heads, slots = k.shape[1], k.shape[2]
    pad = lambda x: jnp.pad(x.astype(jnp.float32), ((0, 0), (0, 0), (0, groups * fmt.group - slots), (0, 0)))  # noqa
    kc, ks, kz, vc, vs, vz = _quantize_slots(pad(k), pad(v), fmt)
    start = quantized_slots(per_kv(count, kv_heads), fmt)
    width = fmt.residual + fmt.group
    return dict(k=kc, v=vc[:, :, :slots], k_scale=ks, k_zero=kz, v_scale=vs[:, :, :slots],
                v_zero=vz[:, :, :slots], k_res=_window(k, start, width).astype(dtype),
                v_res=_window(v, start, width).astype(dtype))


STORED = ("k", "v", "k_scale", "k_zero", "v_scale", "v_zero", "k_res", "v_res")


def float_layers(state, fmt, dtype) -> tuple[jax.Array, jax.Array]:
    """:func:`float_kv` of every layer of a stacked state: ``[L, b, k, C, d]`` each (for an eviction, which scores
    and compacts every layer at once)."""
    def one(count, *stored):
        layer = types.SimpleNamespace(count=count, **dict(zip(STORED, stored)))
        return float_kv(layer, fmt, dtype)
    return jax.vmap(one)(state.count, *(getattr(state, n) for n in STORED))


def requantize_layers(state, k: jax.Array, v: jax.Array, fmt):
    """``state`` (stacked, its ``count`` after an eviction) storing the compacted float slots ``k, v [L, b, k, C,
    d]`` (:func:`requantize` per layer)."""
    groups, dtype = state.k_scale.shape[-2], state.k_res.dtype
    out = jax.vmap(lambda c, k, v: requantize(c, k, v, fmt, groups, dtype))(state.count, k, v)
    return state.replace(**out)


__all__ = ["FIELDS", "STORED", "check", "decode_view", "dequantize_store", "float_kv", "float_layers", "per_kv",
           "quantized_slots", "requantize", "requantize_layers", "rewind", "sizes", "value_group", "write"]
