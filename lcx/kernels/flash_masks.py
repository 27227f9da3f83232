"""Tiles, masks and tile ranges of the flash kernels (``flash.py``, ``window_stats.py``).

Tiles: :class:`FlashBlockSizes` (the user-facing knobs) and :class:`FlashStatic` (everything a kernel specialises
on, derived once by :func:`make_static`); :func:`pad_inputs` zero-pads the inputs to those tiles.

Positions: query row ``r`` of batch row ``b`` sits at key position ``r + off``. ``off`` is the static
``kv_len - q_len`` (queries aligned to the end of the keys) or, with ``q_offsets``, a traced int32 read in the kernel
from a 0-d block, one per batch row and KV head (``[b]`` inputs are broadcast to ``[b, k]``: a cache whose KV heads
keep different tokens has a fill level per head). Query ``r`` sees key ``c`` iff ``c < kv_len`` (padding),
``c < kv_len_b`` (``kv_lengths``), ``c <= r + off`` (``causal``), ``c > r + off - window`` (``window``) and, with
``segment_ids`` (packed documents), ``segment[r] == segment[c]``.

The range functions split the tiles of one loop into ``lo <= lo_full <= hi_full <= hi``: tiles outside ``[lo, hi)``
hold no visible entry and are skipped, tiles in ``[lo_full, hi_full)`` are visible everywhere and run without mask
arithmetic, the rest are masked. Every bound is clamped (negative positions floor to tile 0, positions past the end
to the tile count), so they hold for any offset, negative or past the keys; when in doubt a tile is masked, never
skipped.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from lcx.kernels.common import fit_block, is_pow2, pad_axis, padded_head_dim, round_up


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
            if not (isinstance(x, int) and is_pow2(x) and x >= 16):
                raise ValueError(f"FlashBlockSizes.{f}={x!r} must be a power of two >= 16")


@dataclasses.dataclass(frozen=True)
class FlashStatic:
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
    has_segments: bool = False  # segment ids [b, t] of packed documents: queries see keys of their own segment
    softcap: float | None = None  # logits z -> softcap * tanh(z / softcap)
    quantized: bool = False  # K/V are 8-bit codes with per-slot scales (forward only: a quantized cache)

    @property
    def offset(self) -> int:
        """Key position of query 0 without q_offsets (causal alignment to the end of the keys)."""
        return self.kv_len - self.q_len

    def masked(self, block_q: int, block_k: int, *, rows: bool = False) -> bool:
        """Whether any tile can need a mask; ``rows``: also hide padded query rows (the dK/dV sum needs that)."""
        return (self.causal or self.window is not None or self.has_lengths or self.kv_len % block_k != 0
                or self.has_segments or (rows and self.q_len % block_q != 0))


def make_static(q_len: int, kv_len: int, groups: int, head_dim: int, dtype, *, causal: bool, sm_scale: float | None,
                window: int | None, has_lengths: bool, block_sizes: FlashBlockSizes | None,
                interpret: bool | None, has_offsets: bool = False, has_segments: bool = False,
                softcap: float | None = None, quantized: bool = False) -> FlashStatic:
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"{window=} must be None or a positive int")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"{softcap=} must be None or a positive number")
    bs = FlashBlockSizes.for_dtype(dtype) if block_sizes is None else block_sizes
    if not isinstance(bs, FlashBlockSizes):
        raise ValueError(f"{block_sizes=} must be a FlashBlockSizes or None")
    dp = padded_head_dim(head_dim)
    return FlashStatic(
        q_len=q_len, kv_len=kv_len, groups=groups, causal=bool(causal), window=window, has_lengths=has_lengths,
        sm_scale=float(head_dim ** -0.5 if sm_scale is None else sm_scale),
        block_q=fit_block(bs.block_q, q_len), block_k=fit_block(bs.block_k, kv_len),
        block_q_dkv=fit_block(bs.block_q_dkv, q_len), block_k_dkv=fit_block(bs.block_k_dkv, kv_len),
        block_q_dq=fit_block(bs.block_q_dq, q_len), block_k_dq=fit_block(bs.block_k_dq, kv_len),
        num_warps=bs.num_warps or (4 if dp <= 64 else 8), num_stages=bs.num_stages,
        num_stages_bwd=bs.num_stages_bwd, interpret=interpret, has_offsets=has_offsets, has_segments=has_segments,
        softcap=None if softcap is None else float(softcap), quantized=quantized)


def pad_inputs(q, k, v, st: FlashStatic):
    """Zero-pad lengths to every tile size used and head_dim to a power of two."""
    dp = padded_head_dim(q.shape[-1])
    t_pad = round_up(st.q_len, max(st.block_q, st.block_q_dkv, st.block_q_dq))
    s_pad = round_up(st.kv_len, max(st.block_k, st.block_k_dkv, st.block_k_dq))
    q = pad_axis(pad_axis(q, 3, dp), 1, t_pad)  # [b, t_pad, h, dp]
    k = pad_axis(pad_axis(k, 3, dp), 1, s_pad)  # [b, s_pad, k, dp]
    v = pad_axis(pad_axis(v, 3, dp), 1, s_pad)
    return q, k, v


def pad_segments(segment_ids, st: FlashStatic, key_segment_ids=None):
    """``(query segments [b, t_pad], key segments [b, s_pad])`` int32, or None; padded entries are masked anyway
    (padded keys by ``kv_len``, padded query rows are sliced off or hidden by ``row_valid``). ``key_segment_ids``:
    the keys' own ids when queries and keys are different chunks (a block of ring attention); default: the
    queries' (a self-attention)."""
    if segment_ids is None:
        return None
    seg = jnp.asarray(segment_ids, jnp.int32)
    key_seg = seg if key_segment_ids is None else jnp.asarray(key_segment_ids, jnp.int32)
    t_pad = round_up(st.q_len, max(st.block_q, st.block_q_dkv, st.block_q_dq))
    s_pad = round_up(st.kv_len, max(st.block_k, st.block_k_dkv, st.block_k_dq))
    return pad_axis(seg, 1, t_pad), pad_axis(key_seg, 1, s_pad)


def _div0(x, n: int):
    """floor(max(x, 0) / n) for traced int32 ``x`` (lax.div truncates; clamping first makes that a floor)."""
    return lax.div(jnp.maximum(x, 0), n)


def _cdiv0(x, n: int):
    """ceil(max(x, 0) / n)."""
    return lax.div(jnp.maximum(x, 0) + (n - 1), n)


def row_specs(st: FlashStatic, index_map) -> list[pl.BlockSpec]:
    """In_specs of the per-row ints that are given (``[b, k]`` kv lengths, then ``[b, k]`` query offsets, one per
    batch row and KV head): 0-d blocks at ``index_map(*program_ids) = (batch row, kv head)``, read in the kernel as
    ``ref[()]`` by :func:`split_row_refs`."""
    return [pl.BlockSpec((None, None), index_map)] * (int(st.has_lengths) + int(st.has_offsets))


def row_args(st: FlashStatic, lens, offs) -> list:
    """The arrays matching :func:`row_specs`."""
    return ([lens] if st.has_lengths else []) + ([offs] if st.has_offsets else [])


def split_row_refs(st: FlashStatic, refs):
    """Peel the refs of :func:`row_specs` and :func:`segment_specs` off a kernel's refs: ``(kv_len_b or None, off,
    (query segment ref, key segment ref) or None, other refs)``.

    ``off`` is the traced query offset of this batch row and KV head, or the static ``st.offset`` (a Python int, so the
    no-offsets kernels are exactly the end-aligned ones)."""
    kv_len_b, off, segs = None, st.offset, None
    if st.has_lengths:
        kv_len_b, refs = refs[0][()], refs[1:]
    if st.has_offsets:
        off, refs = refs[0][()], refs[1:]
    if st.has_segments:
        segs, refs = (refs[0], refs[1]), refs[2:]
    return kv_len_b, off, segs, refs


def segment_specs(st: FlashStatic, q_block: int, k_block: int, q_index, k_index) -> list[pl.BlockSpec]:
    """In_specs of the query and key segment ids (``[b, t_pad]`` and ``[b, s_pad]`` int32) when ``st.has_segments``:
    1-d blocks of ``q_block`` / ``k_block`` entries at ``q_index(*ids)`` / ``k_index(*ids)`` = (batch row, tile)."""
    if not st.has_segments:
        return []
    return [pl.BlockSpec((None, q_block), q_index), pl.BlockSpec((None, k_block), k_index)]


def tile_mask(st: FlashStatic, rows, cols, kv_len_b, *, row_valid: bool = False, off=None, segs=None):
    """``[len(rows), len(cols)]`` bool: query index ``rows`` may see key index ``cols``; ``off`` None = static;
    ``segs``: the segment ids ``(of rows, of cols)`` when ``st.has_segments``."""
    off = st.offset if off is None else off
    pos = rows[:, None] + off  # [bq, 1] key-space position of each query
    key = cols[None, :]  # [1, bk]
    mask = key < st.kv_len
    if st.causal:
        mask = mask & (key <= pos)
    if st.window is not None:
        mask = mask & (key > pos - st.window)
    if kv_len_b is not None:
        mask = mask & (key < kv_len_b)
    if row_valid:
        mask = mask & (rows[:, None] < st.q_len)
    if segs is not None:
        mask = mask & (segs[0][:, None] == segs[1][None, :])
    return jnp.broadcast_to(mask, (rows.shape[0], cols.shape[0]))


def key_block_ranges(st: FlashStatic, q0, block_q: int, block_k: int, n_kb: int, kv_len_b, off=None):
    """Key-tile ranges for query rows ``[q0, q0 + block_q)``: ``lo <= lo_full <= hi_full <= hi`` in ``[0, n_kb]``.

    Tiles in ``[lo_full, hi_full)`` are fully visible to every row; the rest of ``[lo, hi)`` needs the mask.
    """
    off = st.offset if off is None else off
    hi = jnp.int32(n_kb)
    hi_full = jnp.int32(st.kv_len // block_k)
    lo = jnp.int32(0)
    lo_full = jnp.int32(0)
    if st.causal:  # last row sees keys <= q0 + block_q - 1 + off; first row sees keys <= q0 + off
        hi = jnp.minimum(hi, _cdiv0(q0 + block_q + off, block_k))
        hi_full = jnp.minimum(hi_full, _div0(q0 + off + 1, block_k))
    if kv_len_b is not None:
        hi = jnp.minimum(hi, _cdiv0(kv_len_b, block_k))
        hi_full = jnp.minimum(hi_full, _div0(kv_len_b, block_k))
    if st.window is not None:  # first row sees keys > q0 + off - window; last row keys > q0 + block_q - 1 + off - w
        lo = _div0(q0 + off - st.window + 1, block_k)
        lo_full = _cdiv0(q0 + block_q + off - st.window, block_k)
    lo = jnp.minimum(lo, hi)
    lo_full = jnp.clip(lo_full, lo, hi)
    hi_full = jnp.clip(hi_full, lo_full, hi)
    return _segmented(st, (lo, lo_full, hi_full, hi))


def _segmented(st: FlashStatic, ranges):
    """With segment ids no tile is known to be fully visible: every visible tile runs the masked loop."""
    lo, lo_full, hi_full, hi = ranges
    return (lo, hi, hi, hi) if st.has_segments else ranges


def query_block_ranges(st: FlashStatic, k0, block_q: int, block_k: int, n_qb: int, kv_len_b, off=None):
    """Query-tile ranges that see keys ``[k0, k0 + block_k)``, split like :func:`key_block_ranges`."""
    off = st.offset if off is None else off
    lo = jnp.int32(0)
    hi = jnp.int32(n_qb)
    lo_full = jnp.int32(0)
    hi_full = jnp.int32(st.q_len // block_q)  # a tile with padded rows must mask them
    if st.causal:  # row r sees key c iff r + off >= c
        lo = jnp.minimum(_div0(k0 - off, block_q), hi)
        lo_full = _cdiv0(k0 + block_k - 1 - off, block_q)
    if st.window is not None:  # row r sees key c iff r + off - window < c
        hi = jnp.minimum(hi, _cdiv0(k0 + block_k + st.window - off - 1, block_q))
        hi_full = jnp.minimum(hi_full, _div0(k0 + st.window - off, block_q))
    keys_full = k0 + block_k <= st.kv_len
    if kv_len_b is not None:
        hi = jnp.where(k0 < kv_len_b, hi, lo)  # a tile wholly past the length gets no gradient
        keys_full = keys_full & (k0 + block_k <= kv_len_b)
    hi = jnp.maximum(hi, lo)
    lo_full = jnp.where(keys_full, jnp.clip(lo_full, lo, hi), hi)
    hi_full = jnp.clip(hi_full, lo_full, hi)
    return _segmented(st, (lo, lo_full, hi_full, hi))


def three_loops(body, ranges, carry, masked: bool):
    """Run ``body(i, carry, masked=...)`` over the edge tiles with masks and the inner tiles without."""
    lo, lo_full, hi_full, hi = ranges
    if not masked:
        return lax.fori_loop(lo, hi, functools.partial(body, masked=False), carry)
    carry = lax.fori_loop(lo, lo_full, functools.partial(body, masked=True), carry)
    carry = lax.fori_loop(lo_full, hi_full, functools.partial(body, masked=False), carry)
    return lax.fori_loop(hi_full, hi, functools.partial(body, masked=True), carry)


__all__ = ["FlashBlockSizes", "FlashStatic", "key_block_ranges", "make_static", "pad_inputs", "pad_segments",
           "query_block_ranges", "row_args", "row_specs", "segment_specs", "split_row_refs", "three_loops",
           "tile_mask"]
