"""One decode query attending a bit-packed cache (``cache.kv_dtype: int4 | int2``) on its codes, in XLA: the
backends ``reference`` and ``xla`` (``attention.impl: pallas`` runs ``lcx.kernels.lowbit_pallas``, which reads the
codes tile by tile).

The store (``lcx.cache.lowbit_slots``): key codes channel-major ``k [b, k, d, C' * bits / 8]`` (packed along the
slots, ``C'`` = whole key groups), value codes ``v [b, k, C, d * bits / 8]``; key scales and zeros per channel
over ``group`` slots ``[b, k, ceil(C / group), d]``; value scales and zeros per token over ``Gv`` channels
``[b, k, C, d / Gv]``; and a float window ``[b, k, W, d]`` holding slots ``win_start .. win_start + W`` (the recent
tokens and the key group still filling), which replaces those slots' codes.

The products are written as elementwise multiplies and sums over the codes, not as dots over dequantized keys and
values:

- logits: per key group ``n``, ``q . k_j = sum_c (q_c scale_nc) code_jc + q . zero_n`` - the key scales move onto
  the query, once per group (:func:`lcx.kernels.lowbit.key_logits` is the same identity). The keys are stored
  channel-major, so this sum over channels runs over a major axis, vectorized along each channel's slots;
- output: per value group, ``sum_j p_j v_jc = sum_j (p_j scale_jg) code_jc + sum_j p_j zero_jg`` - a sum over the
  slots, vectorized along the channels;
- the window's slots get their logits from the float window and share the codes' softmax (their codes are not
  read): no gather or scatter over all slots.

What XLA:CPU holds while it runs: the unpacked codes, as a float32 transient of one layer - its compiled memory
analysis at 32,768 slots of SmolLM2's shape shows 53 MiB of temporaries against 6 MiB of codes (the unpack is not
fused into the reductions; slicing the layer into tiles, each made to wait for the last, kept the same total). The
cache stays in codes; the transient is one layer's, inside the model's layer scan. Dots over keys and values
dequantized per layer took half the time of these reductions on one layer alone, but in the whole decode step of
SmolLM2 at 8k the int4 step took 2.12x the float step that way against 1.40x this way, so the reductions stay
(``docs/benchmarks.md``).

Results equal :func:`lcx.kernels.reference.decode_attention_reference` over the dequantized layer up to float32
summation order (``tests/kernels/test_lowbit_decode.py``). SmolLM2-135M at 8,192 tokens on a 2-core CPU: an int4
decode step took 1.99x the float cache's when it dequantized each layer into the float op's layout first, 1.40x this
way.

Shapes: b batch, h query heads, k KV heads, g = h / k, C slots, n key groups, G slots per key group, v value
groups, W window slots, d head dim.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from lcx.kernels.attended import Attended
from lcx.kernels.lowbit import unpack
from lcx.kernels.reference import capped

_F32 = jnp.float32


@flax.struct.dataclass
class LowbitKV:
    """What a bit-packed layer adds to its codes (``k, v``): ``k_scale, k_zero [b, k, n, d]``, ``v_scale, v_zero
    [b, k, C, v]`` (float16), the float window ``k_win, v_win [b, k, W, d]`` and its first slot ``win_start [b, k]``;
    ``quant`` (``int4`` / ``int2``) and ``group`` (slots per key group) are static."""

    k_scale: jax.Array
    k_zero: jax.Array
    v_scale: jax.Array
    v_zero: jax.Array
    k_win: jax.Array
    v_win: jax.Array
    win_start: jax.Array
    quant: str = flax.struct.field(pytree_node=False, default="int4")
    group: int = flax.struct.field(pytree_node=False, default=64)


def _key_logits(qg: jax.Array, k: jax.Array, kv: LowbitKV, slots: int) -> jax.Array:
    """``[b, k, g, C]`` float32 logits of ``qg [b, k, g, d]`` against every slot's codes (channel-major ``k``)."""
    b, kv_heads, d, _ = k.shape
    groups = kv.k_scale.shape[2]
    codes = unpack(k, kv.quant, _F32).reshape(b, kv_heads, 1, d, groups, kv.group)
    q_scaled = jnp.swapaxes(qg[:, :, :, None, :] * kv.k_scale.astype(_F32)[:, :, None], -1, -2)  # [b, k, g, d, n]
    # a sum over the channels (a major axis here), vectorized along each channel's contiguous codes
    logits = jnp.sum(q_scaled[..., None] * codes, axis=3)  # [b, k, g, n, G]
    logits = logits + jnp.einsum("bkgd,bknd->bkgn", qg, kv.k_zero.astype(_F32))[..., None]
    return logits.reshape(*qg.shape[:3], groups * kv.group)[..., :slots]


def _value_sum(p: jax.Array, v: jax.Array, kv: LowbitKV) -> jax.Array:
    """``sum_j p_j v_j`` over the codes: ``p [b, k, g, C]`` -> ``[b, k, g, d]`` float32."""
    b, kv_heads, slots, _ = v.shape
    value_groups = kv.v_scale.shape[-1]
    codes = unpack(v, kv.quant, _F32)
    d = codes.shape[-1]
    codes = codes.reshape(b, kv_heads, 1, slots, value_groups, d // value_groups)
    weighted = p[..., None] * kv.v_scale.astype(_F32)[:, :, None]  # [b, k, g, C, v]
    out = jnp.sum(weighted[..., None] * codes, axis=3)  # [b, k, g, v, Gv]
    out = out + jnp.einsum("bkgc,bkcv->bkgv", p, kv.v_zero.astype(_F32))[..., None]
    return out.reshape(*p.shape[:3], d)


def decode_lowbit(q: jax.Array, k: jax.Array, v: jax.Array, kv: LowbitKV, *, valid: jax.Array, sm_scale: float,
                  softcap: float | None = None, weights: bool = False, residuals: bool = False) -> Attended:
    """Attend one query per row ``q [b, h, d]`` to the codes ``k [b, k, d, C' * bits / 8]`` (channel-major, ``C'``
    the slots rounded up to whole key groups) and ``v [b, k, C, d * bits / 8]`` with ``kv``'s scales, zeros and
    float window; ``valid [b, C]`` or ``[b, k, C]`` the slots the query sees.

    Returns an :class:`Attended` as the backends' ``decode``: ``out [b, h, d]`` in ``q``'s dtype; with ``weights``
    the probabilities per slot summed over each KV head's query group ``[b, k, C]``; with ``residuals`` ``m, l
    [b, h]``."""
    b, heads, d = q.shape
    kv_heads, slots = v.shape[1], v.shape[2]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads must be a multiple of {kv_heads=} key/value heads")
    qg = q.astype(_F32).reshape(b, kv_heads, heads // kv_heads, d)
    width = kv.k_win.shape[2]
    seen = jnp.broadcast_to(valid.astype(bool).reshape(b, -1, slots), (b, kv_heads, slots))
    # The window holds slots win_start + w (those past the capacity do not exist); their codes are not read. The
    # two parts share one softmax - no gather or scatter over the slots, which cost as much as the products here.
    window_slots = kv.win_start[..., None] + jnp.arange(width)  # [b, k, W]
    window_seen = (window_slots < slots) & jnp.take_along_axis(seen, jnp.minimum(window_slots, slots - 1), axis=-1)
    place = jnp.arange(slots)[None, None, :] - kv.win_start[..., None]
    codes_seen = seen & ((place < 0) | (place >= width))
    score = lambda logits, ok: jnp.where(ok[:, :, None], capped(logits * sm_scale, softcap), -jnp.inf)  # noqa
    code_scores = score(_key_logits(qg, k, kv, slots), codes_seen)  # [b, k, g, C]
    window_scores = score(jnp.einsum("bkgd,bkwd->bkgw", qg, kv.k_win.astype(_F32)), window_seen)  # [b, k, g, W]
    row_max = jnp.maximum(jnp.max(code_scores, axis=-1), jnp.max(window_scores, axis=-1))  # [b, k, g]
    shift = jnp.where(jnp.isfinite(row_max), row_max, 0.0)[..., None]  # a row with no slot: p = 0, never NaN
    p_codes, p_window = jnp.exp(code_scores - shift), jnp.exp(window_scores - shift)
    total = jnp.sum(p_codes, axis=-1) + jnp.sum(p_window, axis=-1)  # [b, k, g]
    out = _value_sum(p_codes, v, kv) + jnp.einsum("bkgw,bkwd->bkgd", p_window, kv.v_win.astype(_F32))
    denom = jnp.where(total == 0, 1.0, total)[..., None]
    result = Attended(out=(out / denom).reshape(b, heads, d).astype(q.dtype))
    if weights:  # per slot: the codes' share, and the window's added at its slots
        rows, kv_idx = jnp.arange(b)[:, None, None], jnp.arange(kv_heads)[None, :, None]
        per_slot = jnp.sum(p_codes / denom, axis=2).at[rows, kv_idx, window_slots].add(
            jnp.sum(p_window / denom, axis=2), mode="drop")
        result = result.replace(weights=per_slot)
    if residuals:
        result = result.replace(m=row_max.reshape(b, heads), l=total.reshape(b, heads))
    return result


__all__ = ["LowbitKV", "decode_lowbit"]
