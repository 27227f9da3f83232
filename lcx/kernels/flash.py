"""FlashAttention forward and backward in Pallas: Triton on GPU, the Pallas interpreter on CPU (see ``mode.py``).

Einsum legend: b batch, t query positions, s key positions, h query heads, k kv heads, g query heads per kv head
(h = k * g + j, the ``reference.py`` order), d head dim.

Forward (one program per ``[block_q]`` rows of one query head): stream K/V in ``[block_k]`` tiles, keep a running
max ``m``, sum ``l`` and fp32 accumulator, rescale by ``2^(m_old - m_new)``; write ``O = acc / l`` and the base-2
log-sum-exp ``lse = m + log2 l``. The ``t x s`` matrix never exists. GQA reads the KV head ``h // g`` in place.
Backward recomputes ``P = 2^(S - lse)`` tile by tile: one kernel for dQ (per query tile, like the forward) and one for
dK/dV (per key tile of one KV head, looping over the ``g`` query heads of its group, so the group sum happens in
registers, never through repeated K/V).

Masks (``flash_masks.py``): query i sits at key position ``pos = s - t + i``, or ``q_offsets[b, k] + i`` (a
traced scalar per row and KV head; ``[b]`` is broadcast; the default keeps a static offset); ``causal`` keeps keys
<= pos, ``window`` keys > pos - window; ``kv_lengths [b]`` or ``[b, k]`` drops keys at or past the length. Key
tiles that are fully visible run a loop without mask arithmetic; only the tiles on the diagonal / window edge /
length edge pay for it; fully hidden tiles are skipped.

Soft-capping (``softcap``, Gemma 2): logits ``z = q.k * sm_scale`` become ``c tanh(z / c)`` before the mask and
softmax; the backward recomputes ``tanh`` per tile and multiplies ``dS`` by its derivative ``1 - tanh^2``.

Shapes that Triton needs are made in the wrapper, identically in interpret mode so CPU tests run the GPU code path:
sequence lengths are zero-padded to tile multiples (padded keys are masked, padded query rows are sliced off and
masked out of dK/dV), head_dim is zero-padded to a power of two >= 16 (zeros change no dot product), tiles are
powers of two >= 16 (the smallest ``tl.dot``).
"""

from __future__ import annotations

import functools

import einops
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from lcx.kernels.common import LN2, LOG2E, MASK_VALUE, check_qkv, dot_nn, dot_nt, dot_tn, pad_axis, row_ints
from lcx.kernels.flash_masks import (FlashBlockSizes, FlashStatic, key_block_ranges, make_static, pad_inputs,
                                     pad_segments, query_block_ranges, row_args, row_specs, segment_specs,
                                     split_row_refs, three_loops, tile_mask)
from lcx.kernels.mode import pallas_call_kwargs
from lcx.kernels.reference import attention_reference


# ----------------------------------------------------------------------------------------------------- forward


def flash_forward_kernel(*refs, st: FlashStatic):
    """One ``[block_q]`` tile of one query head. Refs: [lens []], [offs []], [q segs [bq], k segs [s]], q [bq, d],
    k, v [s, d], [k scale, v scale [s] of 8-bit K/V] -> o [bq, d], lse [bq]."""
    kv_len_b, off, segs, rest = split_row_refs(st, refs)
    if st.quantized:
        q_ref, k_ref, v_ref, ks_ref, vs_ref, o_ref, lse_ref = rest
    else:
        (q_ref, k_ref, v_ref, o_ref, lse_ref), ks_ref, vs_ref = rest, None, None
    bq, bk = st.block_q, st.block_k
    q0 = pl.program_id(0) * bq
    q = q_ref[...]  # [bq, d]
    rows = q0 + jnp.arange(bq)

    def body(kb, carry, masked):
        acc, m, l = carry  # [bq, d], [bq], [bq]
        k0 = pl.multiple_of(kb * bk, bk)
        if st.quantized:  # 8-bit codes widened in registers; the scales weigh the logit columns
            qk = dot_nt(q, k_ref[pl.ds(k0, bk), :].astype(q.dtype)) * ks_ref[pl.ds(k0, bk)].astype(jnp.float32)
        else:
            qk = dot_nt(q, k_ref[pl.ds(k0, bk), :])
        s, _ = logits2(st, qk)  # [bq, bk] base-2
        if masked:
            mask = tile_mask(st, rows, k0 + jnp.arange(bk), kv_len_b, off=off, segs=tile_segs(segs, k0, bk))
            s = jnp.where(mask, s, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.exp2(s - m_new[:, None])  # [bq, bk]
        if masked:  # a row with only masked keys so far has m_new == MASK_VALUE and p == 1 there
            p = jnp.where(mask, p, 0.0)
        alpha = jnp.exp2(m - m_new)
        v = v_ref[pl.ds(k0, bk), :]
        if st.quantized:  # ... and the value scales the probability columns of the product
            pv = dot_nn((p * vs_ref[pl.ds(k0, bk)].astype(jnp.float32)[None, :]).astype(q.dtype), v.astype(q.dtype))
        else:
            pv = dot_nn(p.astype(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        return acc, m_new, l * alpha + jnp.sum(p, axis=1)

    carry = (jnp.zeros((bq, q_ref.shape[-1]), jnp.float32), jnp.full((bq,), MASK_VALUE, jnp.float32),
             jnp.zeros((bq,), jnp.float32))
    ranges = key_block_ranges(st, q0, bq, bk, k_ref.shape[0] // bk, kv_len_b, off)
    acc, m, l = three_loops(body, ranges, carry, st.masked(bq, bk))
    empty = l == 0.0  # fully masked row: output 0, lse +inf so the backward's 2^(s - lse) is 0
    o_ref[...] = (acc / jnp.where(empty, 1.0, l)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, jnp.inf, m + jnp.log2(jnp.where(empty, 1.0, l)))


def logits2(st: FlashStatic, qk):
    """Base-2 logits of the raw products ``qk`` (base-2 softmax: exp2 is the native instruction) and, with a
    soft-cap, ``tanh(z / c)`` for the backward's derivative (else None)."""
    if st.softcap is None:
        return qk * (st.sm_scale * LOG2E), None
    th = jnp.tanh(qk * (st.sm_scale / st.softcap))
    return th * (st.softcap * LOG2E), th


def tile_segs(segs, k0, bk):
    """``(query segments of this tile, key segments [k0, k0 + bk))`` from the refs of ``segment_specs``, or None."""
    if segs is None:
        return None
    return segs[0][...], segs[1][pl.ds(k0, bk)]


def flash_forward(q, k, v, lens, st: FlashStatic, offs=None, segs=None, scales=None):
    """Padded ``q [b, t, h, d]``, ``k, v [b, s, k, d]``, ``lens, offs [b]`` int32 or None, ``segs`` (query, key
    segment ids) or None, ``scales`` (k, v scales ``[b, s, k]`` of 8-bit K/V; ``st.quantized``) or None -> ``o [b,
    t, h, d]``, base-2 ``lse [b, h, t]`` (fp32)."""
    b, t, h, d = q.shape
    s = k.shape[1]
    bq, g = st.block_q, st.groups
    in_specs = row_specs(st, lambda i, bi, hi: (bi, lax.div(hi, g))) + segment_specs(
        st, bq, s, lambda i, bi, hi: (bi, i), lambda i, bi, hi: (bi, 0)) + [
        pl.BlockSpec((None, bq, None, d), lambda i, bi, hi: (bi, i, hi, 0)),
        pl.BlockSpec((None, s, None, d), lambda i, bi, hi: (bi, 0, lax.div(hi, g), 0)),  # KV head of query head
        pl.BlockSpec((None, s, None, d), lambda i, bi, hi: (bi, 0, lax.div(hi, g), 0)),
    ]
    args = row_args(st, lens, offs) + list(segs or ()) + [q, k, v]
    if st.quantized:
        in_specs += [pl.BlockSpec((None, s, None), lambda i, bi, hi: (bi, 0, lax.div(hi, g)))] * 2
        args += list(scales)
    return pl.pallas_call(
        functools.partial(flash_forward_kernel, st=st),
        grid=(t // bq, b, h),  # query tiles fastest: neighbouring programs share the same K/V in L2
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, bq, None, d), lambda i, bi, hi: (bi, i, hi, 0)),
                   pl.BlockSpec((None, None, bq), lambda i, bi, hi: (bi, hi, i))],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, h, t), jnp.float32)],
        name="lcx_flash_forward",
        **pallas_call_kwargs(st.interpret, num_warps=st.num_warps, num_stages=st.num_stages),
    )(*args)


# ---------------------------------------------------------------------------------------------------- backward


def flash_dq_kernel(*refs, st: FlashStatic):
    """dQ of one ``[block_q_dq]`` tile of one query head. Refs: [lens], [offs], q, do [bq, d], lse, delta [bq],
    k, v [s, d]."""
    kv_len_b, off, segs, (q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, dq_ref) = split_row_refs(st, refs)
    bq, bk = st.block_q_dq, st.block_k_dq
    q0 = pl.program_id(0) * bq
    q, do = q_ref[...], do_ref[...]  # [bq, d]
    lse, delta = lse_ref[...], delta_ref[...]  # [bq]
    rows = q0 + jnp.arange(bq)

    def body(kb, dq, masked):
        k0 = pl.multiple_of(kb * bk, bk)
        k = k_ref[pl.ds(k0, bk), :]
        s, th = logits2(st, dot_nt(q, k))  # [bq, bk]
        if masked:
            mask = tile_mask(st, rows, k0 + jnp.arange(bk), kv_len_b, off=off, segs=tile_segs(segs, k0, bk))
            s = jnp.where(mask, s, MASK_VALUE)
        p = jnp.exp2(s - lse[:, None])
        dp = dot_nt(do, v_ref[pl.ds(k0, bk), :])  # [bq, bk]
        ds = p * (dp - delta[:, None])
        if th is not None:  # d(c tanh(z / c)) / dz
            ds = ds * (1.0 - th * th)
        return dq + dot_nn(ds.astype(k.dtype), k)

    ranges = key_block_ranges(st, q0, bq, bk, k_ref.shape[0] // bk, kv_len_b, off)
    dq = three_loops(body, ranges, jnp.zeros(q.shape, jnp.float32), st.masked(bq, bk))
    dq_ref[...] = (dq * st.sm_scale).astype(dq_ref.dtype)


def flash_dkv_kernel(*refs, st: FlashStatic):
    """dK, dV of one ``[block_k_dkv]`` key tile of one KV head, summed over the ``g`` query heads of its group.

    Refs: [lens], [offs], q, do [t, g * d] (head j in columns ``j*d:(j+1)*d``), lse, delta [g, t], k, v [bk, d].
    """
    kv_len_b, off, segs, (q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, dk_ref, dv_ref) = split_row_refs(st, refs)
    bq, bk = st.block_q_dkv, st.block_k_dkv
    d = k_ref.shape[-1]
    k0 = pl.program_id(0) * bk
    k, v = k_ref[...], v_ref[...]  # [bk, d]
    cols = k0 + jnp.arange(bk)
    ranges = query_block_ranges(st, k0, bq, bk, q_ref.shape[0] // bq, kv_len_b, off)
    masked = st.masked(bq, bk, rows=True)

    def head(j, carry):
        c0 = pl.multiple_of(j * d, d)

        def body(qb, carry, masked):
            dk, dv = carry  # [bk, d] fp32
            r0 = pl.multiple_of(qb * bq, bq)
            q = q_ref[pl.ds(r0, bq), pl.ds(c0, d)]  # [bq, d]
            do = do_ref[pl.ds(r0, bq), pl.ds(c0, d)]
            lse = lse_ref[j, pl.ds(r0, bq)]  # [bq]
            delta = delta_ref[j, pl.ds(r0, bq)]
            s, th = logits2(st, dot_nt(q, k))  # [bq, bk]
            if masked:
                row_segs = None if segs is None else (segs[0][pl.ds(r0, bq)], segs[1][...])
                mask = tile_mask(st, r0 + jnp.arange(bq), cols, kv_len_b, row_valid=True, off=off, segs=row_segs)
                s = jnp.where(mask, s, MASK_VALUE)
            p = jnp.exp2(s - lse[:, None])
            dv = dv + dot_tn(p.astype(do.dtype), do)
            ds = p * (dot_nt(do, v) - delta[:, None])
            if th is not None:
                ds = ds * (1.0 - th * th)
            return dk + dot_tn(ds.astype(q.dtype), q), dv

        return three_loops(body, ranges, carry, masked)

    zeros = jnp.zeros((bk, d), jnp.float32)
    dk, dv = lax.fori_loop(0, st.groups, head, (zeros, zeros))
    dk_ref[...] = (dk * st.sm_scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def flash_backward(q, k, v, lens, o, lse, do, st: FlashStatic, offs=None, segs=None):
    """Padded inputs as in :func:`flash_forward`, ``do [b, t, h, d]`` -> ``dq, dk, dv``."""
    b, t, h, d = q.shape
    s, kvh = k.shape[1], k.shape[2]
    g = st.groups
    # delta_i = sum_j P_ij dP_ij = do_i . o_i: an O(t h d) row statistic, cheapest as one fused XLA op.
    delta = jnp.einsum("bthd,bthd->bht", do.astype(jnp.float32), o.astype(jnp.float32))  # [b, h, t]
    kw = pallas_call_kwargs(st.interpret, num_warps=st.num_warps, num_stages=st.num_stages_bwd)
    row_arrays = row_args(st, lens, offs) + list(segs or ())

    bq, bk = st.block_q_dq, st.block_k_dq
    dq = pl.pallas_call(
        functools.partial(flash_dq_kernel, st=st),
        grid=(t // bq, b, h),
        in_specs=row_specs(st, lambda i, bi, hi: (bi, lax.div(hi, g))) + segment_specs(
            st, bq, s, lambda i, bi, hi: (bi, i), lambda i, bi, hi: (bi, 0)) + [
            pl.BlockSpec((None, bq, None, d), lambda i, bi, hi: (bi, i, hi, 0)),
            pl.BlockSpec((None, bq, None, d), lambda i, bi, hi: (bi, i, hi, 0)),
            pl.BlockSpec((None, None, bq), lambda i, bi, hi: (bi, hi, i)),
            pl.BlockSpec((None, None, bq), lambda i, bi, hi: (bi, hi, i)),
            pl.BlockSpec((None, s, None, d), lambda i, bi, hi: (bi, 0, lax.div(hi, g), 0)),
            pl.BlockSpec((None, s, None, d), lambda i, bi, hi: (bi, 0, lax.div(hi, g), 0)),
        ],
        out_specs=pl.BlockSpec((None, bq, None, d), lambda i, bi, hi: (bi, i, hi, 0)),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        name="lcx_flash_backward_dq",
        **kw,
    )(*row_arrays, q, do, lse, delta, k, v)

    bq, bk = st.block_q_dkv, st.block_k_dkv
    # Free reshapes: the g heads of a KV group sit side by side in the last axis / a middle axis.
    qg, dog = (einops.rearrange(x, "b t (k g) d -> b t k (g d)", k=kvh) for x in (q, do))  # [b, t, k, g*d]
    lseg, deltag = (einops.rearrange(x, "b (k g) t -> b k g t", k=kvh) for x in (lse, delta))  # [b, k, g, t]
    dk, dv = pl.pallas_call(
        functools.partial(flash_dkv_kernel, st=st),
        grid=(s // bk, b, kvh),
        in_specs=row_specs(st, lambda i, bi, ki: (bi, ki)) + segment_specs(
            st, t, bk, lambda i, bi, ki: (bi, 0), lambda i, bi, ki: (bi, i)) + [
            pl.BlockSpec((None, t, None, g * d), lambda i, bi, ki: (bi, 0, ki, 0)),
            pl.BlockSpec((None, t, None, g * d), lambda i, bi, ki: (bi, 0, ki, 0)),
            pl.BlockSpec((None, None, g, t), lambda i, bi, ki: (bi, ki, 0, 0)),
            pl.BlockSpec((None, None, g, t), lambda i, bi, ki: (bi, ki, 0, 0)),
            pl.BlockSpec((None, bk, None, d), lambda i, bi, ki: (bi, i, ki, 0)),
            pl.BlockSpec((None, bk, None, d), lambda i, bi, ki: (bi, i, ki, 0)),
        ],
        out_specs=[pl.BlockSpec((None, bk, None, d), lambda i, bi, ki: (bi, i, ki, 0))] * 2,
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        name="lcx_flash_backward_dkv",
        **kw,
    )(*row_arrays, qg, dog, lseg, deltag, k, v)
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------- custom VJP


# lens, offs and segs are int32 arrays (or None): primal inputs whose cotangent is None, i.e. not differentiable.
@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _flash(q, k, v, lens, offs, segs, st: FlashStatic):
    return flash_forward(q, k, v, lens, st, offs, segs)[0]


def _flash_fwd(q, k, v, lens, offs, segs, st: FlashStatic):
    o, lse = flash_forward(q, k, v, lens, st, offs, segs)
    return o, (q, k, v, lens, offs, segs, o, lse)


def _flash_bwd(st: FlashStatic, res, do):
    q, k, v, lens, offs, segs, o, lse = res
    dq, dk, dv = flash_backward(q, k, v, lens, o, lse, do, st, offs, segs)
    return dq, dk, dv, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True, sm_scale: float | None = None,
                    window: int | None = None, kv_lengths: jax.Array | None = None,
                    q_offsets: jax.Array | None = None, segment_ids: jax.Array | None = None,
                    block_sizes: FlashBlockSizes | None = None, interpret: bool | None = None,
                    return_residuals: bool = False, softcap: float | None = None, k_scale: jax.Array | None = None,
                    v_scale: jax.Array | None = None):
    """Tiled softmax attention with a Pallas forward and backward (``jax.grad`` works through it).

    Args:
      q: ``[batch, q_len, q_heads, head_dim]``.
      k, v: ``[batch, kv_len, kv_heads, head_dim]``; q_heads a multiple of kv_heads (GQA/MQA, no repeated K/V).
      causal: query i sits at key position ``kv_len - q_len + i`` (or ``q_offsets[b] + i``) and sees keys up to it.
      sm_scale: score scale; default ``head_dim ** -0.5``.
      window: keep only the ``window`` most recent keys (own position included).
      softcap: cap the scaled logits at ``softcap * tanh(z / softcap)`` (forward and backward).
      kv_lengths: ``[batch]`` or ``[batch, kv_heads]`` ints; keys at index >= length are padding.
      q_offsets: ``[batch]`` or ``[batch, kv_heads]`` ints, not differentiated: query i of row b sits at key
        position ``q_offsets[b] + i`` (``causal`` and ``window`` count from there). E.g. a prefill chunk of t tokens
        written to cache slots ``[n_b, n_b + t)``: ``k, v`` = the cache, ``q_offsets = n``, ``kv_lengths = n + real
        tokens``. Per KV head (``[batch, kv_heads]``): each KV head's slots are its own (a cache whose heads keep
        different tokens), and its query heads use its offset and length.
      segment_ids: ``[batch, len]`` ints of a self-attention (``q_len == kv_len``, no ``q_offsets``): query i sees
        key j only when ``segment_ids[b, i] == segment_ids[b, j]`` (documents packed into one row stay apart, in the
        forward and the backward). Every visible tile then runs with the mask: the cost of plain causal attention.
      block_sizes: tiles and launch settings (:class:`FlashBlockSizes`).
      interpret: None = interpret unless the default backend is a GPU (``mode.py``).
      return_residuals: also return each row's logit max ``m`` and sum of exponentials ``l`` (``[batch, q_len,
        q_heads]`` float32, natural log base; here ``m`` is the log-sum-exp and ``l`` is 1, or ``-inf`` and 0 for a
        row that sees no key) for :func:`lcx.kernels.merge_partials`. Forward only (inference).
      k_scale, v_scale: ``[batch, kv_len, kv_heads]``: ``k, v`` are 8-bit codes of a quantized cache
        (``lcx.kernels.quant``) with these per-slot scales, folded into each tile's logits and probabilities.
        Forward only (a cache is not differentiated).

    Returns:
      ``[batch, q_len, q_heads, head_dim]`` in ``q.dtype``; rows with no visible key are 0.
    """
    quantized = k_scale is not None
    g = check_qkv(q, k, v, codes=quantized)
    b, t, _, d = q.shape
    kv_lengths = row_ints(kv_lengths, b, k.shape[2], "kv_lengths")
    q_offsets = row_ints(q_offsets, b, k.shape[2], "q_offsets")
    if segment_ids is not None and (jnp.shape(segment_ids) != (b, t) or k.shape[1] != t or q_offsets is not None):
        raise ValueError(f"segment_ids.shape={jnp.shape(segment_ids)} must be (batch, len) = ({b}, {t}) of a "
                         f"self-attention (kv_len={k.shape[1]} == q_len={t}, no q_offsets)")
    st = make_static(t, k.shape[1], g, d, q.dtype, causal=causal, sm_scale=sm_scale, window=window,
                     has_lengths=kv_lengths is not None, block_sizes=block_sizes, interpret=interpret,
                     has_offsets=q_offsets is not None, has_segments=segment_ids is not None, softcap=softcap,
                     quantized=quantized)
    if quantized:
        if v_scale is None or k_scale.shape != k.shape[:3] or v_scale.shape != k.shape[:3] or segment_ids is not None:
            raise ValueError(f"k_scale and v_scale must both be [batch, kv_len, kv_heads] = {k.shape[:3]}, without "
                             "segment_ids (a quantized cache is attended by chunks of queries)")
        with jax.named_scope("lcx_flash_attention"):
            qp, kp, vp = pad_inputs(q, k, v, st)
            s_pad = kp.shape[1]
            scales = [pad_axis(x, 1, s_pad) for x in (k_scale, v_scale)]
            o, lse = flash_forward(qp, kp, vp, kv_lengths, st, q_offsets, None, scales)
        return _outputs(o, lse, t, d, return_residuals)
    with jax.named_scope("lcx_flash_attention"):
        # One dtype for the dots (a cache kept in another dtype than the activations); a no-op when they agree.
        qp, kp, vp = pad_inputs(q, k.astype(q.dtype), v.astype(q.dtype), st)
        segs = pad_segments(segment_ids, st)
        if not return_residuals:
            return _flash(qp, kp, vp, kv_lengths, q_offsets, segs, st)[:, :t, :, :d]
        o, lse = flash_forward(qp, kp, vp, kv_lengths, st, q_offsets, segs)  # lse [b, h, t_pad], base 2
    return _outputs(o, lse, t, d, True)


def _outputs(o, lse, t: int, d: int, residuals: bool):
    """The forward's padded ``o`` and base-2 ``lse [b, h, t_pad]`` as the caller's output: ``o`` cut to ``t`` rows and
    ``d`` dims, with residuals ``(o, m, l)`` (``m`` the natural log-sum-exp, ``l`` 1; ``-inf`` and 0 for a row that
    saw no key)."""
    if not residuals:
        return o[:, :t, :, :d]
    lse = jnp.swapaxes(lse[:, :, :t], 1, 2)  # [b, t, h]
    seen = jnp.isfinite(lse)
    return (o[:, :t, :, :d], jnp.where(seen, lse * LN2, -jnp.inf), seen.astype(jnp.float32))


# The oracle: same signature minus the kernel knobs.
flash_attention_reference = attention_reference

__all__ = ["FlashBlockSizes", "flash_attention", "flash_attention_reference"]
