"""Column sums of attention probabilities for a window of queries (SnapKV's observation window) in Pallas.

Einsum legend: b batch, t window queries, s key positions, h query heads, k kv heads, g query heads per kv head
(h = k * g + j), d head dim.

SnapKV scores each prefix key by the attention it receives from the last ``w`` prompt queries. With the causal
alignment of ``flash_attention`` (queries sit at the end of the keys) that is ``attention_column_sums(q[:, -w:], k)``
and the ``w x s`` rows are all that is ever computed, never the ``s x s`` matrix:

1. the flash forward kernel on the ``w`` queries gives each row's log-sum-exp (``v = k`` as a stand-in: only the lse
   is kept; the wasted ``P @ V`` is as cheap as the ``Q K^T`` that is needed anyway);
2. one program per ``[block_k]`` key tile of one KV head recomputes ``P = 2^(S - lse)`` for all ``g * w`` rows of
   its group and sums the columns: output ``[b, k, s]`` float32, memory ``O(b k s + b t h d)``.

Per-head or pooled variants (SnapKV's max/avg pooling over neighbouring keys) are for the policy to apply on top.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from lcx.kernels.common import MASK_VALUE, check_qkv, dot_nt, pad_axis, row_ints
from lcx.kernels.flash import flash_forward, logits2
from lcx.kernels.flash_masks import (FlashBlockSizes, make_static, pad_inputs, query_block_ranges, row_args, row_specs,
                                     split_row_refs, three_loops, tile_mask)
from lcx.kernels.mode import pallas_call_kwargs
from lcx.kernels.reference import attention_column_sums_reference


def column_sums_kernel(*refs, st):
    """One ``[block_k_dkv]`` key tile of one KV head. Refs: [lens []], [offs []], q [t, g * d] (head j in columns
    ``j*d:(j+1)*d``), lse [g, t], k [bk, d], [k scale [bk] of 8-bit keys] -> sums [bk]."""
    kv_len_b, off, _, rest = split_row_refs(st, refs)
    (q_ref, lse_ref, k_ref, ks_ref, out_ref) = rest if st.quantized else (*rest[:3], None, rest[3])
    bq, bk = st.block_q_dkv, st.block_k_dkv
    d = k_ref.shape[-1]
    k0 = pl.program_id(0) * bk
    k = k_ref[...]  # [bk, d]
    if st.quantized:  # 8-bit codes widened in registers; the scales weigh the logit columns
        k = k.astype(q_ref.dtype)
        k_scale = ks_ref[...].astype(jnp.float32)[None, :]
    cols = k0 + jnp.arange(bk)
    ranges = query_block_ranges(st, k0, bq, bk, q_ref.shape[0] // bq, kv_len_b, off)

    def head(j, total):
        c0 = pl.multiple_of(j * d, d)

        def body(qb, total, masked):
            r0 = pl.multiple_of(qb * bq, bq)
            qk = dot_nt(q_ref[pl.ds(r0, bq), pl.ds(c0, d)], k)
            s, _ = logits2(st, qk * k_scale if st.quantized else qk)  # [bq, bk] base 2, capped
            if masked:
                s = jnp.where(tile_mask(st, r0 + jnp.arange(bq), cols, kv_len_b, row_valid=True, off=off), s,
                              MASK_VALUE)
            p = jnp.exp2(s - lse_ref[j, pl.ds(r0, bq)][:, None])  # fully masked rows have lse = +inf -> 0
            return total + jnp.sum(p, axis=0)

        return three_loops(body, ranges, total, st.masked(bq, bk, rows=True))

    out_ref[...] = lax.fori_loop(0, st.groups, head, jnp.zeros((bk,), jnp.float32))


def attention_column_sums(q: jax.Array, k: jax.Array, *, causal: bool = True, sm_scale: float | None = None,
                          window: int | None = None, kv_lengths: jax.Array | None = None,
                          q_offsets: jax.Array | None = None, query_weights: jax.Array | None = None,
                          block_sizes: FlashBlockSizes | None = None, interpret: bool | None = None,
                          softcap: float | None = None, k_scale: jax.Array | None = None) -> jax.Array:
    """Sum over queries and each KV head's query group of the softmax attention probabilities.

    Args:
      q: ``[batch, w, q_heads, head_dim]``, e.g. the last ``w`` queries of a prefill; with ``causal`` query i sits
        at key position ``kv_len - w + i`` (or ``q_offsets[b] + i``).
      k: ``[batch, kv_len, kv_heads, head_dim]``.
      query_weights: ``[batch, w]``; only queries with a positive weight are summed (e.g. the observation window
        within a prefill chunk). None: all.
      causal, sm_scale, window, kv_lengths, q_offsets, block_sizes, interpret, softcap: as in ``flash_attention``
        (the column kernel uses the ``*_dkv`` tiles; the sums are of the capped logits' probabilities).
      k_scale: ``[batch, kv_len, kv_heads]``: ``k`` holds 8-bit codes (``lcx.kernels.quant``) of these scales.

    Returns:
      ``[batch, kv_heads, kv_len]`` float32; each counted (query, head) row contributes probabilities summing to 1
      (0 for a row that sees no key), so the total over keys is ``w * g`` at most.
    """
    quantized = k_scale is not None
    g = check_qkv(q, k, k, codes=quantized)
    b, t, _, d = q.shape
    kv_lengths = row_ints(kv_lengths, b, k.shape[2], "kv_lengths")
    q_offsets = row_ints(q_offsets, b, k.shape[2], "q_offsets")
    st = make_static(t, k.shape[1], g, d, q.dtype, causal=causal, sm_scale=sm_scale, window=window,
                     has_lengths=kv_lengths is not None, block_sizes=block_sizes, interpret=interpret,
                     has_offsets=q_offsets is not None, softcap=softcap, quantized=quantized)
    with jax.named_scope("lcx_attention_column_sums"):
        qp, kp, vp = pad_inputs(q, k, k, st)
        ks = pad_axis(k_scale, 1, kp.shape[1]) if quantized else None
        _, lse = flash_forward(qp, kp, vp, kv_lengths, st, q_offsets, None,
                               (ks, ks) if quantized else None)  # [b, h, t_pad], base 2
        _, t_pad, h, dp = qp.shape
        if query_weights is not None:  # an lse of +inf makes every probability of that row 0
            counted = jnp.pad(jnp.asarray(query_weights) > 0, ((0, 0), (0, t_pad - t)))  # [b, t_pad]
            lse = jnp.where(counted[:, None, :], lse, jnp.inf)
        s_pad, kvh = kp.shape[1], kp.shape[2]
        bk = st.block_k_dkv
        sums = pl.pallas_call(
            functools.partial(column_sums_kernel, st=st),
            grid=(s_pad // bk, b, kvh),
            in_specs=row_specs(st, lambda i, bi, ki: (bi, ki)) + [
                pl.BlockSpec((None, t_pad, None, g * dp), lambda i, bi, ki: (bi, 0, ki, 0)),
                pl.BlockSpec((None, None, g, t_pad), lambda i, bi, ki: (bi, ki, 0, 0)),
                pl.BlockSpec((None, bk, None, dp), lambda i, bi, ki: (bi, i, ki, 0)),
            ] + ([pl.BlockSpec((None, bk, None), lambda i, bi, ki: (bi, i, ki))] if quantized else []),
            out_specs=pl.BlockSpec((None, None, bk), lambda i, bi, ki: (bi, ki, i)),
            out_shape=jax.ShapeDtypeStruct((b, kvh, s_pad), jnp.float32),
            name="lcx_attention_column_sums",
            **pallas_call_kwargs(st.interpret, num_warps=st.num_warps, num_stages=st.num_stages_bwd),
        )(*row_args(st, kv_lengths, q_offsets), qp.reshape(b, t_pad, kvh, g * dp), lse.reshape(b, kvh, g, t_pad), kp,
          *([ks] if quantized else []))
    return sums[:, :, :k.shape[1]]


__all__ = ["attention_column_sums", "attention_column_sums_reference"]
