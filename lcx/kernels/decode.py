"""Split-K decode attention (flash-decoding) in Pallas, with the per-slot attention weights eviction policies need.

Einsum legend: b batch, s cache slots, h query heads, k kv heads, g query heads per kv head (h = k * g + j),
n cache splits, r rows of one program (the g heads of a KV group, zero-padded to >= 16 for the Triton dot), d head dim.

One query token per sequence attends to a fixed-capacity cache that may have holes (``valid``) and a fill level
(``lengths``), both per row or per row and KV head (a cache whose KV heads keep different tokens). The cache is cut
into ``n`` splits; program (split, b, kv head) streams its split in ``[block_k]`` tiles with an online softmax for
all g heads of the group at once (K/V are read once per group, never repeated) and writes its partial
``(acc, m, l)``. XLA combines the splits: ``m = max_n m_n``, ``o = sum_n 2^(m_n - m) acc_n /
sum_n 2^(m_n - m) l_n``.

``return_weights``: each program also writes its raw scores (base-2 scaled logits, ``[r', s]`` per group, r' = g
rounded up to a power of two). The combine step knows every row's final log-sum-exp, so the probabilities follow
elementwise and are summed over the group: ``[b, k, s]``, no second pass over K. Forward only (inference).

No copy of the cache is made when ``cache_len`` is a multiple of ``block_k`` and head_dim a power of two (the split
count is chosen among divisors of the tile count); otherwise the wrapper zero-pads K/V, which costs a cache copy.
"""

from __future__ import annotations

import dataclasses
import functools

import einops
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from lcx.kernels.common import (LN2, combine_splits, fit_block, online_softmax, online_update, pad_axis,
                                padded_head_dim, row_ints, scaled_logits, target_programs)
from lcx.kernels.mode import pallas_call_kwargs
from lcx.kernels.reference import decode_attention_reference


@dataclasses.dataclass(frozen=True)
class DecodeBlockSizes:
    """Cache tile per loop step, number of splits (None: enough programs for ``target_programs``, whose None is ~2
    waves of the GPU's SMs: ``lcx.kernels.common.target_programs``).

    ``block_sizes=None`` in :func:`decode_attention` uses ``block_k=128``, or 64 for 4-byte caches. Untuned on hardware.
    """

    block_k: int = 128
    num_splits: int | None = None
    target_programs: int | None = None
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        if not (self.block_k >= 16 and self.block_k & (self.block_k - 1) == 0):
            raise ValueError(f"DecodeBlockSizes.block_k={self.block_k} must be a power of two >= 16")
        if self.num_splits is not None and self.num_splits < 1:
            raise ValueError(f"DecodeBlockSizes.num_splits={self.num_splits} must be None or >= 1")


@dataclasses.dataclass(frozen=True)
class _Static:
    block_k: int
    split_len: int
    rows: int  # r: program rows (g padded to a power of two >= 16)
    score_rows: int  # r': rows of the written scores (g rounded up to a power of two)
    sm_scale: float
    has_lengths: bool
    return_weights: bool
    softcap: float | None = None  # logits z -> softcap * tanh(z / softcap)
    quantized: bool = False  # K/V are 8-bit codes with per-slot scales (two more refs)


def _num_splits(n_tiles: int, want: int) -> int:
    """The largest divisor of ``n_tiles`` that is <= ``want`` (so the splits tile the cache without padding)."""
    want = max(1, min(want, n_tiles))
    return max(d for d in range(1, want + 1) if n_tiles % d == 0)


def decode_kernel(*refs, st: _Static):
    """One cache split of one KV group. Refs: [lens [] of this row and KV head], q [r, d], k, v [split, d], live
    [split] int32, [k scale, v scale [split] of 8-bit K/V] -> acc [r, d], m [r], l [r], [scores [r', split]]."""
    refs = list(refs)
    kv_len_b = refs.pop(0)[()] if st.has_lengths else None
    q_ref, k_ref, v_ref, live_ref = refs[:4]
    ks_ref, vs_ref = refs[4:6] if st.quantized else (None, None)
    acc_ref, m_ref, l_ref = refs[6:9] if st.quantized else refs[4:7]
    s_ref = refs[-1] if st.return_weights else None
    bk = st.block_k
    start = pl.program_id(0) * st.split_len
    q = q_ref[...]  # [r, d]
    n_tiles = st.split_len // bk
    hi = n_tiles if kv_len_b is None else jnp.clip(lax.div(jnp.maximum(kv_len_b - start, 0) + bk - 1, bk),
                                                   0, n_tiles)

    def body(i, carry):  # carry: acc [r, d], m [r], l [r]
        k0 = pl.multiple_of(i * bk, bk)
        live = live_ref[pl.ds(k0, bk)] != 0  # [bk]
        scale = (lambda ref: ref[pl.ds(k0, bk)]) if st.quantized else (lambda ref: None)  # noqa: E731
        s = scaled_logits(q, k_ref[pl.ds(k0, bk), :], st.sm_scale, st.softcap, scale(ks_ref))  # [r, bk]
        if s_ref is not None:
            parts = st.rows // st.score_rows  # Triton splits into equal power-of-two parts only
            s_ref[:, pl.ds(k0, bk)] = s if parts == 1 else lax.split(s, [st.score_rows] * parts, axis=0)[0]
        return online_update(carry, s, live, v_ref[pl.ds(k0, bk), :], scale(vs_ref), q.dtype)

    online_softmax(body, hi, q, acc_ref, m_ref, l_ref)


def decode_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, valid: jax.Array | None = None,
                     lengths: jax.Array | None = None, return_weights: bool = False, sm_scale: float | None = None,
                     block_sizes: DecodeBlockSizes | None = None, interpret: bool | None = None,
                     return_residuals: bool = False, softcap: float | None = None, k_scale: jax.Array | None = None,
                     v_scale: jax.Array | None = None):
    """Attention of one new token per sequence over a KV cache.

    Args:
      q: ``[batch, q_heads, head_dim]``.
      k, v: ``[batch, kv_heads, cache_len, head_dim]`` (the slot cache's layout: a program's tile is contiguous);
        q_heads a multiple of kv_heads.
      valid: ``[batch, cache_len]`` or ``[batch, kv_heads, cache_len]`` bool, True for live slots (holes left by
        eviction are False); per KV head when each head keeps its own tokens.
      lengths: ``[batch]`` or ``[batch, kv_heads]`` ints; slots at index >= length are empty (also skipped, not
        just masked).
      return_weights: also return the attention probabilities summed over each KV head's query group.
      sm_scale: default ``head_dim ** -0.5``.
      softcap: cap the scaled logits at ``softcap * tanh(z / softcap)`` (the weights are those of the capped logits).
      block_sizes: :class:`DecodeBlockSizes`.
      interpret: None = interpret unless the default backend is a GPU (``mode.py``).
      k_scale, v_scale: ``[batch, kv_heads, cache_len]``: ``k, v`` are 8-bit codes (``lcx.kernels.quant``) with
        these per-slot scales; each tile is widened in registers and the scales weigh its logits and probabilities.
      return_residuals: also return the row max ``m`` of the logits and the sum of exponentials ``l = sum exp(s -
        m)`` (``[batch, q_heads]`` float32, natural log base; ``-inf`` and 0 for a sequence with no live slot), the
        partial-attention state :func:`lcx.kernels.merge_partials` combines.

    Returns:
      ``out [batch, q_heads, head_dim]`` in ``q.dtype`` (0 for a sequence with no live slot); with
      ``return_weights`` also ``weights [batch, kv_heads, cache_len]`` float32 (each query head's row sums to 1, so
      a slot's weight is in ``[0, g]``); with ``return_residuals`` then ``(m, l)``.
    """
    if q.ndim != 3 or k.ndim != 4 or v.ndim != 4 or k.shape != v.shape:
        raise ValueError(f"q must be [batch, heads, head_dim], k and v equal [batch, kv_heads, cache_len, head_dim];"
                         f" got {q.shape=}, {k.shape=}, {v.shape=}")
    b, h, d = q.shape
    _, kvh, s, _ = k.shape
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"{q.shape=} and {k.shape=} must agree on batch and head_dim")
    if h % kvh:
        raise ValueError(f"q_heads={h} must be a multiple of kv_heads={kvh}")
    if valid is not None and valid.shape not in ((b, s), (b, kvh, s)):
        raise ValueError(f"{valid.shape=} must be ({b}, {s}) or ({b}, {kvh}, {s})")
    quantized = k_scale is not None
    if quantized and (v_scale is None or k_scale.shape != (b, kvh, s) or v_scale.shape != (b, kvh, s)):
        raise ValueError(f"k_scale and v_scale must both be [batch, kv_heads, cache_len] = {(b, kvh, s)}; got "
                         f"{k_scale.shape=}, {None if v_scale is None else v_scale.shape}")
    # 4-byte caches: half the tile, so two pipelined K/V tiles fit the shared memory that bf16 ones use.
    bs = block_sizes or DecodeBlockSizes(block_k=64 if k.dtype.itemsize >= 4 else 128)
    g = h // kvh
    dp = padded_head_dim(d)
    bk = fit_block(bs.block_k, s)
    n_tiles = -(-s // bk)
    n_splits = _num_splits(n_tiles, bs.num_splits or -(-(bs.target_programs or target_programs()) // (b * kvh)))
    s_pad = n_tiles * bk
    rows = max(16, pl.next_power_of_2(g))
    st = _Static(block_k=bk, split_len=s_pad // n_splits, rows=rows, score_rows=pl.next_power_of_2(g),
                 sm_scale=float(d ** -0.5 if sm_scale is None else sm_scale), has_lengths=lengths is not None,
                 return_weights=bool(return_weights), softcap=None if softcap is None else float(softcap),
                 quantized=quantized)

    lengths = row_ints(lengths, b, kvh, "lengths")  # [b, k]
    live = jnp.ones((b, 1, s), bool) if valid is None else valid.astype(bool).reshape(b, -1, s)
    if lengths is not None:
        live = live & (jnp.arange(s)[None, None, :] < lengths[:, :, None])
    live = jnp.broadcast_to(live, (b, kvh, s))
    live = pad_axis(live.astype(jnp.int32), 2, s_pad)  # [b, k, s_pad]; padded slots are dead
    # The query is cast to the cache dtype, not the cache to the query's: that would copy the whole cache (8-bit
    # codes are widened to the query's dtype tile by tile instead).
    qg = einops.rearrange(q if quantized else q.astype(k.dtype), "b (k g) d -> b k g d", k=kvh)
    qg = pad_axis(pad_axis(qg, 3, dp), 2, rows)  # [b, k, r, dp]
    kp = pad_axis(pad_axis(k, 3, dp), 2, s_pad)  # [b, k, s_pad, dp]
    vp = pad_axis(pad_axis(v if quantized else v.astype(k.dtype), 3, dp), 2, s_pad)

    split = st.split_len
    in_specs = [
        pl.BlockSpec((None, None, rows, dp), lambda n, bi, ki: (bi, ki, 0, 0)),
        pl.BlockSpec((None, None, split, dp), lambda n, bi, ki: (bi, ki, n, 0)),
        pl.BlockSpec((None, None, split, dp), lambda n, bi, ki: (bi, ki, n, 0)),
        pl.BlockSpec((None, None, split), lambda n, bi, ki: (bi, ki, n)),
    ]
    args = [qg, kp, vp, live]
    if quantized:
        in_specs += [pl.BlockSpec((None, None, split), lambda n, bi, ki: (bi, ki, n))] * 2
        args += [pad_axis(k_scale, 2, s_pad), pad_axis(v_scale, 2, s_pad)]
    if st.has_lengths:
        in_specs.insert(0, pl.BlockSpec((None, None), lambda n, bi, ki: (bi, ki)))
        args.insert(0, lengths)
    out_specs = [pl.BlockSpec((None, None, None, rows, dp), lambda n, bi, ki: (bi, ki, n, 0, 0)),
                 pl.BlockSpec((None, None, None, rows), lambda n, bi, ki: (bi, ki, n, 0)),
                 pl.BlockSpec((None, None, None, rows), lambda n, bi, ki: (bi, ki, n, 0))]
    out_shape = [jax.ShapeDtypeStruct((b, kvh, n_splits, rows, dp), jnp.float32),  # acc
                 jax.ShapeDtypeStruct((b, kvh, n_splits, rows), jnp.float32),  # m (base 2)
                 jax.ShapeDtypeStruct((b, kvh, n_splits, rows), jnp.float32)]  # l
    if st.return_weights:
        out_specs.append(pl.BlockSpec((None, None, st.score_rows, split), lambda n, bi, ki: (bi, ki, 0, n)))
        out_shape.append(jax.ShapeDtypeStruct((b, kvh, st.score_rows, s_pad), jnp.float32))

    with jax.named_scope("lcx_decode_attention"):
        outs = pl.pallas_call(
            functools.partial(decode_kernel, st=st),
            grid=(n_splits, b, kvh),
            in_specs=in_specs,
            out_specs=out_specs,
            out_shape=out_shape,
            name="lcx_decode_attention",
            **pallas_call_kwargs(interpret, num_warps=bs.num_warps, num_stages=bs.num_stages),
        )(*args)
        o, m_all, l_all, empty = combine_splits(*outs[:3])  # [b, k, r, dp], [b, k, r] x 3
        merge_heads = functools.partial(einops.rearrange, pattern="b k g ... -> b (k g) ...")
        out = merge_heads(o[:, :, :g, :d]).astype(q.dtype)
        results = [out]
        if st.return_weights:
            lse = jnp.where(empty, jnp.inf, m_all + jnp.log2(jnp.where(empty, 1.0, l_all)))[:, :, :g]  # [b, k, g]
            scores = outs[3][:, :, :g, :s]  # [b, k, g, s]
            p = jnp.where(live[:, :, None, :s] != 0, jnp.exp2(scores - lse[..., None]), 0.0)
            results.append(jnp.sum(p, axis=2))  # [b, k, s]
        if return_residuals:  # base-2 scaled logits -> natural: m_nat = m_2 * ln 2, and 2^(s2 - m2) = e^(s - m)
            m_nat = jnp.where(empty, -jnp.inf, m_all * LN2)[:, :, :g]
            results += [merge_heads(m_nat), merge_heads(l_all[:, :, :g])]
        return results[0] if len(results) == 1 else tuple(results)


__all__ = ["DecodeBlockSizes", "decode_attention", "decode_attention_reference"]
