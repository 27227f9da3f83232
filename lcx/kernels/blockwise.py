"""One block of a blockwise attention: a contiguous chunk of queries against a contiguous chunk of keys, forward with
residuals and backward from the *whole* attention's output and log-sum-exp - the pieces ring attention (and the
all-gather strategy) of ``lcx.parallel.context`` are built from.

Einsum legend: b batch, t queries, s keys, h query heads, k kv heads, g query heads per kv head (h = k * g + j),
d head dim.

Mask of a block: query i sits at key position ``offset + i`` of the key chunk (``offset`` a traced int: the distance
between the two chunks' starts in the sequence) and sees keys ``j <= offset + i`` (and ``j > offset + i - window``
with a window); with segment ids (packed documents) only keys of its own segment. An offset at or past the key
chunk's length makes the block fully visible, one below ``-(t - 1)`` fully hidden: a device computes every block of
its ring step with one traced offset, and the Pallas kernel skips the tiles the offset hides.

``forward(...) -> (o [b, t, h, d] float32, lse [b, t, h] float32)``: ``lse`` is the natural log-sum-exp of each row's
logits, ``-inf`` for a row that sees no key (``o = 0``). Blocks over disjoint key sets merge exactly with
:func:`merge` (the log-sum-exp combine). ``backward(..., o, lse, do) -> (dq, dk, dv)``: the block's share of the
gradients given the whole attention's ``o`` and ``lse`` (``P = exp(S - lse)`` is then the block's columns of the
whole softmax, so the shares of all blocks sum to the gradient of the whole attention). Two implementations: ``jnp``
(dense per block, float32) and ``pallas`` (the flash kernels of ``flash.py``: ``flash_forward`` / ``flash_backward``
with per-row offsets and separate query / key segment ids).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from lcx.kernels.common import LN2, LOG2E, merge_partials, pad_axis, row_ints
from lcx.kernels.flash import flash_backward, flash_forward
from lcx.kernels.flash_masks import make_static, pad_inputs, pad_segments


@dataclasses.dataclass(frozen=True)
class BlockSpec:
    """Static settings of every block of one attention (hashable: a custom-VJP and jit static argument)."""

    sm_scale: float
    window: int | None = None
    softcap: float | None = None
    impl: str = "jnp"  # "jnp" or "pallas"

    def __post_init__(self):
        if self.impl not in ("jnp", "pallas"):
            raise ValueError(f"block impl={self.impl!r} is invalid: must be 'jnp' or 'pallas'")


def block_mask(t: int, s: int, offset, q_seg, k_seg, window: int | None) -> jax.Array:
    """``[b or 1, t, s]`` bool: query i (at key position ``offset + i``) may see key j."""
    pos = jnp.arange(t)[:, None] + offset
    key = jnp.arange(s)[None, :]
    mask = key <= pos
    if window is not None:
        mask = mask & (key > pos - window)
    mask = mask[None]
    if q_seg is not None:
        mask = mask & (q_seg[:, :, None] == k_seg[:, None, :])
    return mask


def _logits(spec: BlockSpec, q, k):
    """``(s [b, k, g, t, s] float32 scaled and capped, tanh or None)`` with ``q`` grouped ``[b, t, k, g, d]``."""
    z = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32) * spec.sm_scale
    if spec.softcap is None:
        return z, None
    th = jnp.tanh(z / spec.softcap)
    return th * spec.softcap, th


def _grouped(x, kv_heads: int):
    b, t, h, d = x.shape
    return x.reshape(b, t, kv_heads, h // kv_heads, d)


def _jnp_forward(spec: BlockSpec, q, k, v, offset, q_seg, k_seg):
    b, t, h, d = q.shape
    kv = k.shape[2]
    s, _ = _logits(spec, _grouped(q, kv), k)
    mask = block_mask(t, k.shape[1], offset, q_seg, k_seg, spec.window)[:, None, None]  # [b, 1, 1, t, s]
    s = jnp.where(mask, s, -jnp.inf)
    m = jnp.max(s, axis=-1)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(mask, jnp.exp(s - m_safe[..., None]), 0.0)
    l = jnp.sum(p, axis=-1)  # [b, k, g, t]
    o = jnp.einsum("bkgts,bskd->btkgd", p, v.astype(jnp.float32))
    o = o / jnp.moveaxis(jnp.where(l > 0, l, 1.0), -1, 1)[..., None]
    lse = jnp.where(l > 0, m_safe + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)  # [b, k, g, t]
    return o.reshape(b, t, h, d), jnp.moveaxis(lse, -1, 1).reshape(b, t, h)


def _jnp_backward(spec: BlockSpec, q, k, v, offset, q_seg, k_seg, o, lse, do):
    b, t, h, d = q.shape
    kv = k.shape[2]
    qg, dog, og = (_grouped(x.astype(jnp.float32), kv) for x in (q, do, o))
    kf, vf = k.astype(jnp.float32), v.astype(jnp.float32)
    s, th = _logits(spec, qg, kf)
    mask = block_mask(t, k.shape[1], offset, q_seg, k_seg, spec.window)[:, None, None]
    lse_g = jnp.moveaxis(lse.reshape(b, t, kv, h // kv), 1, -1)  # [b, k, g, t]
    seen = jnp.isfinite(lse_g)[..., None]
    p = jnp.where(mask & seen, jnp.exp(s - jnp.where(seen, lse_g[..., None], 0.0)), 0.0)  # [b, k, g, t, s]
    delta = jnp.moveaxis(jnp.sum(dog * og, axis=-1), 1, -1)  # [b, k, g, t]
    dv = jnp.einsum("bkgts,btkgd->bskd", p, dog)
    ds = p * (jnp.einsum("btkgd,bskd->bkgts", dog, vf) - delta[..., None])
    if th is not None:  # d(c tanh(z / c)) / dz
        ds = ds * (1.0 - th * th)
    dq = jnp.einsum("bkgts,bskd->btkgd", ds, kf).reshape(b, t, h, d) * spec.sm_scale
    dk = jnp.einsum("bkgts,btkgd->bskd", ds, qg) * spec.sm_scale
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _pallas_static(spec: BlockSpec, q, k, has_segments: bool):
    return make_static(q.shape[1], k.shape[1], q.shape[2] // k.shape[2], q.shape[3], q.dtype, causal=True,
                       sm_scale=spec.sm_scale, window=spec.window, has_lengths=False, block_sizes=None,
                       interpret=None, has_offsets=True, has_segments=has_segments, softcap=spec.softcap)


def _pallas_rows(q, k, offset, q_seg, k_seg, st):
    offs = row_ints(jnp.broadcast_to(jnp.asarray(offset, jnp.int32), (q.shape[0],)), q.shape[0], k.shape[2],
                    "offset")
    return offs, pad_segments(q_seg, st, key_segment_ids=k_seg)


def _pallas_forward(spec: BlockSpec, q, k, v, offset, q_seg, k_seg):
    b, t, h, d = q.shape
    st = _pallas_static(spec, q, k, q_seg is not None)
    qp, kp, vp = pad_inputs(q, k.astype(q.dtype), v.astype(q.dtype), st)
    offs, segs = _pallas_rows(q, k, offset, q_seg, k_seg, st)
    o, lse2 = flash_forward(qp, kp, vp, None, st, offs, segs)  # lse2 [b, h, t_pad] base 2, +inf: no key seen
    lse2 = jnp.swapaxes(lse2[:, :, :t], 1, 2)
    return o[:, :t, :, :d].astype(jnp.float32), jnp.where(jnp.isfinite(lse2), lse2 * LN2, -jnp.inf)


def _pallas_backward(spec: BlockSpec, q, k, v, offset, q_seg, k_seg, o, lse, do):
    b, t, h, d = q.shape
    st = _pallas_static(spec, q, k, q_seg is not None)
    qp, kp, vp = pad_inputs(q, k.astype(q.dtype), v.astype(q.dtype), st)
    t_pad, dp = qp.shape[1], qp.shape[3]
    op, dop = (pad_axis(pad_axis(x.astype(q.dtype), 3, dp), 1, t_pad) for x in (o, do))
    lse2 = jnp.where(jnp.isfinite(lse), lse * LOG2E, jnp.inf)  # the kernels' base 2; +inf: P = 0
    lse2 = jnp.pad(jnp.swapaxes(lse2, 1, 2), ((0, 0), (0, 0), (0, t_pad - t)), constant_values=jnp.inf)
    offs, segs = _pallas_rows(q, k, offset, q_seg, k_seg, st)
    dq, dk, dv = flash_backward(qp, kp, vp, None, op, lse2, dop, st, offs, segs)
    s = k.shape[1]
    return dq[:, :t, :, :d], dk[:, :s, :, :d].astype(k.dtype), dv[:, :s, :, :d].astype(v.dtype)


def forward(spec: BlockSpec, q, k, v, offset, q_seg=None, k_seg=None):
    """One block's ``(o, lse)`` (see the module docstring); ``q [b, t, h, d]``, ``k, v [b, s, k, d]``, ``offset``
    an int (traced or not), ``q_seg [b, t]`` / ``k_seg [b, s]`` or None."""
    fn = _pallas_forward if spec.impl == "pallas" else _jnp_forward
    return fn(spec, q, k, v, offset, q_seg, k_seg)


def backward(spec: BlockSpec, q, k, v, offset, q_seg, k_seg, o, lse, do):
    """One block's ``(dq, dk, dv)`` from the whole attention's ``o [b, t, h, d]``, ``lse [b, t, h]`` and the output
    cotangent ``do``."""
    fn = _pallas_backward if spec.impl == "pallas" else _jnp_backward
    return fn(spec, q, k, v, offset, q_seg, k_seg, o, lse, do)


def merge(a, b):
    """``(o, lse)`` of the attention over the union of two blocks' disjoint key sets (float32; ``-inf`` rows
    contribute nothing, a row no block saw stays ``o = 0, lse = -inf``): :func:`merge_partials` with each block's
    log-sum-exp as its max and a sum of 1."""
    parts = [(o, lse, jnp.isfinite(lse).astype(jnp.float32)) for o, lse in (a, b)]
    o, m, l = merge_partials(*parts)
    return o, jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)


def empty(q):
    """The ``(o, lse)`` of a row that has seen no key yet: the identity of :func:`merge`."""
    return jnp.zeros(q.shape, jnp.float32), jnp.full(q.shape[:3], -jnp.inf, jnp.float32)


__all__ = ["BlockSpec", "backward", "block_mask", "empty", "forward", "merge"]
