"""Helpers every Pallas kernel of lcx shares: base-2 softmax constants, fp32-accumulating dots, Triton-friendly
padding, argument checks, and the exact merge of partial attentions.

Einsum legend: b batch, t queries, h query heads, d head dim.

Partial attentions. A softmax attention over keys A is kept as ``(o, m, l)``: the normalized output ``o``, the row
max ``m`` of the logits and the sum ``l = sum_j exp(s_j - m)`` (natural log base). Attention over A u B is then the
log-sum-exp combine of the parts (:func:`merge_partials`) - exact, the way flash-decoding combines its splits - so a
cache can attend its tiers separately (working memory and recalled blocks) and merge.
"""

from __future__ import annotations

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from lcx.kernels.attended import Attended

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
# Finite, so the running max of a row that has seen only masked keys stays finite (no inf - inf = NaN).
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _dot(a, b, contract):
    # fp32 inputs get IEEE fp32 products: Triton's default for them is TF32 (~1e-3 relative), too coarse for an fp32
    # kernel checked to 1e-4. bf16/fp16 inputs use the tensor cores either way; accumulation is always fp32.
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, (contract, ((), ())), precision=precision, preferred_element_type=jnp.float32)


def dot_nt(a, b):
    """``a @ b.T`` with fp32 accumulation."""
    return _dot(a, b, ((1,), (1,)))


def dot_tn(a, b):
    """``a.T @ b`` with fp32 accumulation."""
    return _dot(a, b, ((0,), (0,)))


def dot_nn(a, b):
    """``a @ b`` with fp32 accumulation."""
    return _dot(a, b, ((1,), (0,)))


def fit_block(block: int, length: int) -> int:
    """A tile no longer than the power-of-two rounded length, and >= 16 (smallest Triton dot)."""
    return max(16, min(block, pl.next_power_of_2(max(length, 1))))


def padded_head_dim(d: int) -> int:
    """Triton tensors need power-of-two sizes: 80 and 96 become 128."""
    return max(16, pl.next_power_of_2(d))


DEFAULT_SMS = 132  # an H100 / H200: the count assumed where no GPU says its own (CPU, lowering for CUDA from one)


def target_programs(waves: int = 2) -> int:
    """Programs a split-K decode kernel aims for: ``waves`` waves of the GPU's streaming multiprocessors (a jax GPU
    device's ``core_count``), so that a batch-1 step still fills the chip; ``waves x DEFAULT_SMS`` elsewhere."""
    device = jax.devices()[0]
    sms = getattr(device, "core_count", None) if device.platform == "gpu" else None
    return waves * (sms if isinstance(sms, int) and sms > 0 else DEFAULT_SMS)


def pad_axis(x: jax.Array, axis: int, size: int) -> jax.Array:
    """Zero-pad ``axis`` of ``x`` to ``size`` (no copy when it already has that size)."""
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def row_ints(x, batch: int, kv_heads: int, name: str) -> jax.Array | None:
    """``x`` as int32 ``[batch, kv_heads]`` (None stays None): one value per row (``[batch]``, broadcast over the KV
    heads) or per row and KV head (``[batch, kv_heads]``, caches whose KV heads keep their own tokens)."""
    if x is None:
        return None
    x = jnp.asarray(x)
    if x.shape not in ((batch,), (batch, kv_heads)):
        raise ValueError(f"{name}.shape={x.shape} must be ({batch},) or ({batch}, {kv_heads})")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"{name}.dtype={x.dtype} must be an integer type")
    if x.ndim == 1:
        x = x[:, None]
    return jnp.broadcast_to(x.astype(jnp.int32), (batch, kv_heads))


def check_qkv(q, k, v, codes: bool = False) -> int:
    """Validate ``q [b, t, h, d]``, ``k, v [b, s, k, d]`` (``codes``: ``k, v`` may be 8-bit codes of a quantized
    cache); return g = h // k."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be [batch, len, heads, head_dim]; got {q.shape=}, {k.shape=}, {v.shape=}")
    if k.shape != v.shape:
        raise ValueError(f"{k.shape=} must equal {v.shape=}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"{q.shape=} and {k.shape=} must agree on batch and head_dim")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"q_heads={q.shape[2]} must be a multiple of kv_heads={k.shape[2]}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if codes and name != "q" and x.dtype.itemsize == 1:
            continue
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name}.dtype={x.dtype} must be a floating type")
    return q.shape[2] // k.shape[2]


# --------------------------------------------------------------------------------------------------- merging
def scaled_logits(q: jax.Array, k: jax.Array, sm_scale: float, softcap: float | None,
                  k_scale: jax.Array | None = None) -> jax.Array:
    """A decode kernel tile's logits ``q [r, d] k [n, d]^T`` in base 2 (``* log2 e``), soft-capped when asked:
    ``[r, n]``. ``k_scale [n]``: ``k`` holds 8-bit codes (widened here to ``q``'s dtype) of these scales."""
    if k_scale is None:
        s = dot_nt(q, k)
    else:
        s = dot_nt(q, k.astype(q.dtype)) * k_scale.astype(jnp.float32)[None, :]
    if softcap is None:
        return s * (sm_scale * LOG2E)
    return jnp.tanh(s * (sm_scale / softcap)) * (softcap * LOG2E)


def online_update(carry, s: jax.Array, live: jax.Array, v: jax.Array, v_scale: jax.Array | None = None,
                  dtype=None):
    """One tile of the online softmax of the decode kernels: ``carry = (acc [r, d], m [r], l [r])`` (base 2), ``s
    [r, n]`` scaled logits, ``live [n]``, ``v [n, d]`` -> the new carry. ``v_scale [n]``: ``v`` holds 8-bit codes,
    widened to ``dtype``; the scales weigh the probabilities of the product (the row sum takes them unweighted)."""
    acc, m, l = carry
    s = jnp.where(live[None, :], s, MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    p = jnp.where(live[None, :], jnp.exp2(s - m_new[:, None]), 0.0)
    alpha = jnp.exp2(m - m_new)
    if v_scale is None:
        pv = dot_nn(p.astype(v.dtype), v)
    else:
        pv = dot_nn((p * v_scale.astype(jnp.float32)[None, :]).astype(dtype), v.astype(dtype))
    return acc * alpha[:, None] + pv, m_new, l * alpha + jnp.sum(p, axis=1)


def online_softmax(body, n_tiles, q: jax.Array, acc_ref, m_ref, l_ref) -> None:
    """Run ``body(i, carry)`` (an ``online_update`` per tile) over tiles ``0 .. n_tiles - 1`` from the empty state of
    ``q [r, d]``'s rows and write the partial ``(acc, m, l)`` to the output refs."""
    r = q.shape[0]
    init = (jnp.zeros(q.shape, jnp.float32), jnp.full((r,), MASK_VALUE, jnp.float32), jnp.zeros((r,), jnp.float32))
    acc, m, l = lax.fori_loop(0, n_tiles, body, init)
    acc_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


def combine_splits(acc: jax.Array, m: jax.Array, l: jax.Array):
    """Merge split-K partials ``acc [b, k, n, r, d]``, ``m, l [b, k, n, r]`` (base 2) over the splits: ``(o [b, k,
    r, d], m_all, l_all, empty)`` with ``empty`` the rows that saw no live slot (``o = 0``)."""
    # Without the barrier XLA may fuse the max into the rescale below and produce NaNs (a known failure of split-K
    # decode kernels under jit).
    m_all = lax.optimization_barrier(jnp.max(m, axis=2))  # [b, k, r]
    w = jnp.exp2(m - m_all[:, :, None])  # [b, k, n, r]
    l_all = jnp.sum(w * l, axis=2)
    empty = l_all == 0.0
    o = jnp.sum(w[..., None] * acc, axis=2) / jnp.where(empty, 1.0, l_all)[..., None]
    return o, m_all, l_all, empty


def merge_partials(a, b) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Attention over keys A u B from the parts over A and over B: ``(o, m, l)`` each (or an ``Attended`` with
    residuals), ``o [..., d]``, ``m, l [...]``.

    ``m = max(m_a, m_b)``, ``l = l_a e^(m_a - m) + l_b e^(m_b - m)``, ``o = (o_a l_a e^(m_a - m) + o_b l_b e^(m_b -
    m)) / l``. A part that saw no key has ``l = 0`` (any ``m``, ``-inf`` included) and contributes nothing; when
    neither saw a key the output is 0, never NaN. The result is in float32 with ``m = -inf`` for empty rows.
    """
    (oa, ma, la), (ob, mb, lb) = (x.parts if isinstance(x, Attended) else x for x in (a, b))
    chex.assert_equal_shape([oa, ob])
    chex.assert_equal_shape([ma, la, mb, lb, oa[..., 0]])
    ma, mb = (jnp.where(l > 0, m, -jnp.inf).astype(jnp.float32) for m, l in ((ma, la), (mb, lb)))
    m = jnp.maximum(ma, mb)
    safe = jnp.where(jnp.isfinite(m), m, 0.0)
    wa = jnp.where(la > 0, la * jnp.exp(ma - safe), 0.0)
    wb = jnp.where(lb > 0, lb * jnp.exp(mb - safe), 0.0)
    l = wa + wb
    denom = jnp.where(l > 0, l, 1.0)[..., None]
    o = (oa.astype(jnp.float32) * wa[..., None] + ob.astype(jnp.float32) * wb[..., None]) / denom
    return o, m, l


__all__ = ["LN2", "LOG2E", "MASK_VALUE", "check_qkv", "combine_splits", "dot_nn", "dot_nt", "dot_tn", "fit_block",
           "is_pow2", "merge_partials", "online_softmax", "online_update", "pad_axis", "padded_head_dim", "round_up",
           "row_ints", "scaled_logits"]
