"""FlashAttention forward and backward in Pallas: Triton on GPU, the Pallas interpreter on CPU (see ``mode.py``).

Einsum legend: b batch, t query positions, s key positions, h query heads, k kv heads, g query heads per kv head
(h = k * g + j, the ``reference.py`` order), d head dim.

Forward (one program per ``[block_q]`` rows of one query head): stream K/V in ``[block_k]`` tiles, keep a running
max ``m``, sum ``l`` and fp32 accumulator, rescale by ``2^(m_old - m_new)``; write ``O = acc / l`` and the base-2
log-sum-exp ``lse = m + log2 l``. The ``t x s`` matrix never exists. GQA reads the KV head ``h // g`` in place.
Backward recomputes ``P = 2^(S - lse)`` tile by tile: one kernel for dQ (per query tile, like the forward) and one for
dK/dV (per key tile of one KV head, looping over the ``g`` query heads of its group, so the group sum happens in
registers, never through repeated K/V).

Masks (``flash_masks.py``): query i sits at key position ``pos = s - t + i``, or ``q_offsets[b] + i`` (a traced
per-row scalar; the default keeps a static offset); ``causal`` keeps keys <= pos, ``window`` keys > pos - window;
``kv_lengths [b]`` drops keys at or past the length. Key tiles that are fully visible run a loop without mask
arithmetic; only the tiles on the diagonal / window edge / length edge pay for it; fully hidden tiles are skipped.

Shapes that Triton needs are made in the wrapper, identically in interpret mode so CPU tests run the GPU code path:
sequence lengths are zero-padded to tile multiples (padded keys are masked, padded query rows are sliced off and
masked out of dK/dV), head_dim is zero-padded to a power of two >= 16 (zeros change no dot product), tiles are
powers of two >= 16 (the smallest ``tl.dot``).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from lcx.kernels.flash_masks import (key_block_ranges, query_block_ranges, row_args, row_specs, split_row_refs,
                                     three_loops, tile_mask)
from lcx.kernels.mode import pallas_call_kwargs
from lcx.kernels.reference import attention_reference

LOG2E = math.log2(math.e)
# Finite, so the running max of a row that has seen only masked keys stays finite (no inf - inf = NaN).
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def _is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


@dataclasses.dataclass(frozen=True)
class FlashBlockSizes:
    """Tile sizes (rows of Q, rows of K/V) per kernel and Triton launch settings; defaults aim at H100/H200, bf16.

    Tiles are clipped to the (power-of-two rounded) sequence length, never below 16. ``num_warps=None`` picks 4 for
    head_dim <= 64 and 8 above. ``block_sizes=None`` in the kernels means :meth:`for_dtype` of the input dtype.
    Untuned on hardware so far (see docs/benchmarks.md).
    """

    block_q: int = 128
    block_k: int = 64
    block_q_dkv: int = 64
    block_k_dkv: int = 64
    block_q_dq: int = 64
    block_k_dq: int = 64
    num_warps: int | None = None
    num_stages: int = 3
    num_stages_bwd: int = 2

    @classmethod
    def for_dtype(cls, dtype) -> "FlashBlockSizes":
        """Defaults for an input dtype: 4-byte inputs get half the K/V tile and two stages, so the pipelined tiles
        fit the same shared memory (~227 KiB on H100/H200) as with bf16."""
        if jnp.dtype(dtype).itemsize >= 4:
            return cls(block_q=64, block_k=32, block_q_dkv=32, block_k_dkv=64, block_q_dq=64, block_k_dq=32,
                       num_stages=2, num_stages_bwd=2)
        return cls()

    def __post_init__(self):
        for f in ("block_q", "block_k", "block_q_dkv", "block_k_dkv", "block_q_dq", "block_k_dq"):
            x = getattr(self, f)
            if not (isinstance(x, int) and _is_pow2(x) and x >= 16):
                raise ValueError(f"FlashBlockSizes.{f}={x!r} must be a power of two >= 16")


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything the kernels specialise on (hashable: it is a ``nondiff_argnums`` of the custom VJP)."""

    q_len: int  # true lengths, before padding
    kv_len: int
    groups: int  # g = q_heads // kv_heads
    causal: bool
    window: int | None
    has_lengths: bool
    sm_scale: float
    block_q: int
    block_k: int
    block_q_dkv: int
    block_k_dkv: int
    block_q_dq: int
    block_k_dq: int
    num_warps: int
    num_stages: int
    num_stages_bwd: int
    interpret: bool | None
    has_offsets: bool = False  # per-row q_offsets [b] replace ``offset`` (a traced scalar in the kernels)

    @property
    def offset(self) -> int:
        """Key position of query 0 without q_offsets (causal alignment to the end of the keys)."""
        return self.kv_len - self.q_len

    def masked(self, block_q: int, block_k: int, *, rows: bool = False) -> bool:
        """Whether any tile can need a mask; ``rows``: also hide padded query rows (the dK/dV sum needs that)."""
        return (self.causal or self.window is not None or self.has_lengths or self.kv_len % block_k != 0
                or (rows and self.q_len % block_q != 0))


def fit_block(block: int, length: int) -> int:
    """A tile no longer than the power-of-two rounded length, and >= 16 (smallest Triton dot)."""
    return max(16, min(block, pl.next_power_of_2(max(length, 1))))


def padded_head_dim(d: int) -> int:
    """Triton tensors need power-of-two sizes: 80 and 96 become 128."""
    return max(16, pl.next_power_of_2(d))


def pad_axis(x: jax.Array, axis: int, size: int) -> jax.Array:
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


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


# ----------------------------------------------------------------------------------------------------- forward


def flash_forward_kernel(*refs, st: _Static):
    """One ``[block_q]`` tile of one query head. Refs: [lens []], [offs []], q [bq, d], k, v [s, d] -> o [bq, d],
    lse [bq]."""
    kv_len_b, off, (q_ref, k_ref, v_ref, o_ref, lse_ref) = split_row_refs(st, refs)
    bq, bk = st.block_q, st.block_k
    q0 = pl.program_id(0) * bq
    scale2 = st.sm_scale * LOG2E  # base-2 softmax: exp2 is the native instruction
    q = q_ref[...]  # [bq, d]
    rows = q0 + jnp.arange(bq)

    def body(kb, carry, masked):
        acc, m, l = carry  # [bq, d], [bq], [bq]
        k0 = pl.multiple_of(kb * bk, bk)
        s = dot_nt(q, k_ref[pl.ds(k0, bk), :]) * scale2  # [bq, bk]
        if masked:
            mask = tile_mask(st, rows, k0 + jnp.arange(bk), kv_len_b, off=off)
            s = jnp.where(mask, s, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.exp2(s - m_new[:, None])  # [bq, bk]
        if masked:  # a row with only masked keys so far has m_new == MASK_VALUE and p == 1 there
            p = jnp.where(mask, p, 0.0)
        alpha = jnp.exp2(m - m_new)
        v = v_ref[pl.ds(k0, bk), :]
        acc = acc * alpha[:, None] + dot_nn(p.astype(v.dtype), v)
        return acc, m_new, l * alpha + jnp.sum(p, axis=1)

    carry = (jnp.zeros((bq, q_ref.shape[-1]), jnp.float32), jnp.full((bq,), MASK_VALUE, jnp.float32),
             jnp.zeros((bq,), jnp.float32))
    ranges = key_block_ranges(st, q0, bq, bk, k_ref.shape[0] // bk, kv_len_b, off)
    acc, m, l = three_loops(body, ranges, carry, st.masked(bq, bk))
    empty = l == 0.0  # fully masked row: output 0, lse +inf so the backward's 2^(s - lse) is 0
    o_ref[...] = (acc / jnp.where(empty, 1.0, l)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, jnp.inf, m + jnp.log2(jnp.where(empty, 1.0, l)))


lens_specs = row_specs  # the older name (window_stats.py), from when lengths were the only per-row ints


def flash_forward(q, k, v, lens, st: _Static, offs=None):
    """Padded ``q [b, t, h, d]``, ``k, v [b, s, k, d]``, ``lens, offs [b]`` int32 or None -> ``o [b, t, h, d]``,
    base-2 ``lse [b, h, t]`` (fp32)."""
    b, t, h, d = q.shape
    s = k.shape[1]
    bq, g = st.block_q, st.groups
    in_specs = row_specs(st, lambda i, bi, hi: (bi,)) + [
        pl.BlockSpec((None, bq, None, d), lambda i, bi, hi: (bi, i, hi, 0)),
        pl.BlockSpec((None, s, None, d), lambda i, bi, hi: (bi, 0, lax.div(hi, g), 0)),  # KV head of query head
        pl.BlockSpec((None, s, None, d), lambda i, bi, hi: (bi, 0, lax.div(hi, g), 0)),
    ]
    args = row_args(st, lens, offs) + [q, k, v]
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


def flash_dq_kernel(*refs, st: _Static):
    """dQ of one ``[block_q_dq]`` tile of one query head. Refs: [lens], [offs], q, do [bq, d], lse, delta [bq],
    k, v [s, d]."""
    kv_len_b, off, (q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, dq_ref) = split_row_refs(st, refs)
    bq, bk = st.block_q_dq, st.block_k_dq
    q0 = pl.program_id(0) * bq
    scale2 = st.sm_scale * LOG2E
    q, do = q_ref[...], do_ref[...]  # [bq, d]
    lse, delta = lse_ref[...], delta_ref[...]  # [bq]
    rows = q0 + jnp.arange(bq)

    def body(kb, dq, masked):
        k0 = pl.multiple_of(kb * bk, bk)
        k = k_ref[pl.ds(k0, bk), :]
        s = dot_nt(q, k) * scale2  # [bq, bk]
        if masked:
            s = jnp.where(tile_mask(st, rows, k0 + jnp.arange(bk), kv_len_b, off=off), s, MASK_VALUE)
        p = jnp.exp2(s - lse[:, None])
        dp = dot_nt(do, v_ref[pl.ds(k0, bk), :])  # [bq, bk]
        ds = p * (dp - delta[:, None])
        return dq + dot_nn(ds.astype(k.dtype), k)

    ranges = key_block_ranges(st, q0, bq, bk, k_ref.shape[0] // bk, kv_len_b, off)
    dq = three_loops(body, ranges, jnp.zeros(q.shape, jnp.float32), st.masked(bq, bk))
    dq_ref[...] = (dq * st.sm_scale).astype(dq_ref.dtype)


def flash_dkv_kernel(*refs, st: _Static):
    """dK, dV of one ``[block_k_dkv]`` key tile of one KV head, summed over the ``g`` query heads of its group.

    Refs: [lens], [offs], q, do [t, g * d] (head j in columns ``j*d:(j+1)*d``), lse, delta [g, t], k, v [bk, d].
    """
    kv_len_b, off, (q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, dk_ref, dv_ref) = split_row_refs(st, refs)
    bq, bk = st.block_q_dkv, st.block_k_dkv
    d = k_ref.shape[-1]
    k0 = pl.program_id(0) * bk
    scale2 = st.sm_scale * LOG2E
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
            s = dot_nt(q, k) * scale2  # [bq, bk]
            if masked:
                mask = tile_mask(st, r0 + jnp.arange(bq), cols, kv_len_b, row_valid=True, off=off)
                s = jnp.where(mask, s, MASK_VALUE)
            p = jnp.exp2(s - lse[:, None])
            dv = dv + dot_tn(p.astype(do.dtype), do)
            ds = p * (dot_nt(do, v) - delta[:, None])
            return dk + dot_tn(ds.astype(q.dtype), q), dv

        return three_loops(body, ranges, carry, masked)

    zeros = jnp.zeros((bk, d), jnp.float32)
    dk, dv = lax.fori_loop(0, st.groups, head, (zeros, zeros))
    dk_ref[...] = (dk * st.sm_scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def flash_backward(q, k, v, lens, o, lse, do, st: _Static, offs=None):
    """Padded inputs as in :func:`flash_forward`, ``do [b, t, h, d]`` -> ``dq, dk, dv``."""
    b, t, h, d = q.shape
    s, kvh = k.shape[1], k.shape[2]
    g = st.groups
    # delta_i = sum_j P_ij dP_ij = do_i . o_i: an O(t h d) row statistic, cheapest as one fused XLA op.
    delta = jnp.einsum("bthd,bthd->bht", do.astype(jnp.float32), o.astype(jnp.float32))  # [b, h, t]
    kw = pallas_call_kwargs(st.interpret, num_warps=st.num_warps, num_stages=st.num_stages_bwd)
    row_arrays = row_args(st, lens, offs)

    bq, bk = st.block_q_dq, st.block_k_dq
    dq = pl.pallas_call(
        functools.partial(flash_dq_kernel, st=st),
        grid=(t // bq, b, h),
        in_specs=row_specs(st, lambda i, bi, hi: (bi,)) + [
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
    qg = q.reshape(b, t, kvh, g * d)  # [b, t, k, g*d]
    dog = do.reshape(b, t, kvh, g * d)
    lseg = lse.reshape(b, kvh, g, t)  # [b, k, g, t]
    deltag = delta.reshape(b, kvh, g, t)
    dk, dv = pl.pallas_call(
        functools.partial(flash_dkv_kernel, st=st),
        grid=(s // bk, b, kvh),
        in_specs=row_specs(st, lambda i, bi, ki: (bi,)) + [
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


# lens and offs are int32 arrays (or None): primal inputs whose cotangent is None, i.e. not differentiable.
@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash(q, k, v, lens, offs, st: _Static):
    return flash_forward(q, k, v, lens, st, offs)[0]


def _flash_fwd(q, k, v, lens, offs, st: _Static):
    o, lse = flash_forward(q, k, v, lens, st, offs)
    return o, (q, k, v, lens, offs, o, lse)


def _flash_bwd(st: _Static, res, do):
    q, k, v, lens, offs, o, lse = res
    dq, dk, dv = flash_backward(q, k, v, lens, o, lse, do, st, offs)
    return dq, dk, dv, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def check_qkv(q, k, v) -> int:
    """Validate ``q [b, t, h, d]``, ``k, v [b, s, k, d]``; return g = h // k."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be [batch, len, heads, head_dim]; got {q.shape=}, {k.shape=}, {v.shape=}")
    if k.shape != v.shape:
        raise ValueError(f"{k.shape=} must equal {v.shape=}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"{q.shape=} and {k.shape=} must agree on batch and head_dim")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"q_heads={q.shape[2]} must be a multiple of kv_heads={k.shape[2]}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name}.dtype={x.dtype} must be a floating type")
    return q.shape[2] // k.shape[2]


def make_static(q_len: int, kv_len: int, groups: int, head_dim: int, dtype, *, causal: bool, sm_scale: float | None,
                window: int | None, has_lengths: bool, block_sizes: FlashBlockSizes | None,
                interpret: bool | None, has_offsets: bool = False) -> _Static:
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"{window=} must be None or a positive int")
    bs = FlashBlockSizes.for_dtype(dtype) if block_sizes is None else block_sizes
    if not isinstance(bs, FlashBlockSizes):
        raise ValueError(f"{block_sizes=} must be a FlashBlockSizes or None")
    dp = padded_head_dim(head_dim)
    return _Static(
        q_len=q_len, kv_len=kv_len, groups=groups, causal=bool(causal), window=window, has_lengths=has_lengths,
        sm_scale=float(head_dim ** -0.5 if sm_scale is None else sm_scale),
        block_q=fit_block(bs.block_q, q_len), block_k=fit_block(bs.block_k, kv_len),
        block_q_dkv=fit_block(bs.block_q_dkv, q_len), block_k_dkv=fit_block(bs.block_k_dkv, kv_len),
        block_q_dq=fit_block(bs.block_q_dq, q_len), block_k_dq=fit_block(bs.block_k_dq, kv_len),
        num_warps=bs.num_warps or (4 if dp <= 64 else 8), num_stages=bs.num_stages,
        num_stages_bwd=bs.num_stages_bwd, interpret=interpret, has_offsets=has_offsets)


def pad_inputs(q, k, v, st: _Static):
    """Zero-pad lengths to every tile size used and head_dim to a power of two."""
    dp = padded_head_dim(q.shape[-1])
    t_pad = round_up(st.q_len, max(st.block_q, st.block_q_dkv, st.block_q_dq))
    s_pad = round_up(st.kv_len, max(st.block_k, st.block_k_dkv, st.block_k_dq))
    q = pad_axis(pad_axis(q, 3, dp), 1, t_pad)  # [b, t_pad, h, dp]
    k = pad_axis(pad_axis(k, 3, dp), 1, s_pad)  # [b, s_pad, k, dp]
    v = pad_axis(pad_axis(v, 3, dp), 1, s_pad)
    return q, k, v


def row_ints(x, batch: int, name: str) -> jax.Array | None:
    """``x`` as int32 ``[batch]`` (None stays None); ``name`` for the error."""
    if x is None:
        return None
    x = jnp.asarray(x)
    if x.shape != (batch,):
        raise ValueError(f"{name}.shape={x.shape} must be ({batch},)")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"{name}.dtype={x.dtype} must be an integer type")
    return x.astype(jnp.int32)


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True, sm_scale: float | None = None,
                    window: int | None = None, kv_lengths: jax.Array | None = None,
                    q_offsets: jax.Array | None = None, block_sizes: FlashBlockSizes | None = None,
                    interpret: bool | None = None) -> jax.Array:
    """Tiled softmax attention with a Pallas forward and backward (``jax.grad`` works through it).

    Args:
      q: ``[batch, q_len, q_heads, head_dim]``.
      k, v: ``[batch, kv_len, kv_heads, head_dim]``; q_heads a multiple of kv_heads (GQA/MQA, no repeated K/V).
      causal: query i sits at key position ``kv_len - q_len + i`` (or ``q_offsets[b] + i``) and sees keys up to it.
      sm_scale: score scale; default ``head_dim ** -0.5``.
      window: keep only the ``window`` most recent keys (own position included).
      kv_lengths: ``[batch]`` ints; keys at index >= length are padding.
      q_offsets: ``[batch]`` ints, not differentiated: query i of row b sits at key position ``q_offsets[b] + i``
        (``causal`` and ``window`` count from there). E.g. a prefill chunk of t tokens written to cache slots
        ``[n_b, n_b + t)``: ``k, v`` = the cache, ``q_offsets = n``, ``kv_lengths = n + real tokens``.
      block_sizes: tiles and launch settings (:class:`FlashBlockSizes`).
      interpret: None = interpret unless the default backend is a GPU (``mode.py``).

    Returns:
      ``[batch, q_len, q_heads, head_dim]`` in ``q.dtype``; rows with no visible key are 0.
    """
    g = check_qkv(q, k, v)
    b, t, _, d = q.shape
    kv_lengths = row_ints(kv_lengths, b, "kv_lengths")
    q_offsets = row_ints(q_offsets, b, "q_offsets")
    st = make_static(t, k.shape[1], g, d, q.dtype, causal=causal, sm_scale=sm_scale, window=window,
                     has_lengths=kv_lengths is not None, block_sizes=block_sizes, interpret=interpret,
                     has_offsets=q_offsets is not None)
    with jax.named_scope("lcx_flash_attention"):
        # One dtype for the dots (a cache kept in another dtype than the activations); a no-op when they agree.
        qp, kp, vp = pad_inputs(q, k.astype(q.dtype), v.astype(q.dtype), st)
        o = _flash(qp, kp, vp, kv_lengths, q_offsets, st)
    return o[:, :t, :, :d]


# The oracle: same signature minus the kernel knobs.
flash_attention_reference = attention_reference

__all__ = ["FlashBlockSizes", "flash_attention", "flash_attention_reference"]
