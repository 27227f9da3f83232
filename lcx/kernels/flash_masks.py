"""Masks and tile ranges of the flash kernels (``flash.py``, ``window_stats.py``).

Positions: query row ``r`` of batch row ``b`` sits at key position ``r + off``. ``off`` is the static
``kv_len - q_len`` (queries aligned to the end of the keys) or, with ``q_offsets``, a traced int32 read in the kernel
from a 0-d block, one per batch row. Query ``r`` sees key ``c`` iff ``c < kv_len`` (padding), ``c < kv_len_b``
(``kv_lengths``), ``c <= r + off`` (``causal``) and ``c > r + off - window`` (``window``).

The range functions split the tiles of one loop into ``lo <= lo_full <= hi_full <= hi``: tiles outside ``[lo, hi)``
hold no visible entry and are skipped, tiles in ``[lo_full, hi_full)`` are visible everywhere and run without mask
arithmetic, the rest are masked. Every bound is clamped (negative positions floor to tile 0, positions past the end
to the tile count), so they hold for any offset, negative or past the keys; when in doubt a tile is masked, never
skipped.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

if TYPE_CHECKING:
    from lcx.kernels.flash import _Static


def _div0(x, n: int):
    """floor(max(x, 0) / n) for traced int32 ``x`` (lax.div truncates; clamping first makes that a floor)."""
    return lax.div(jnp.maximum(x, 0), n)


def _cdiv0(x, n: int):
    """ceil(max(x, 0) / n)."""
    return lax.div(jnp.maximum(x, 0) + (n - 1), n)


def row_specs(st: _Static, index_map) -> list[pl.BlockSpec]:
    """In_specs of the per-batch-row ints that are given (``[b]`` kv lengths, then ``[b]`` query offsets): 0-d
    blocks, read in the kernel as ``ref[()]`` by :func:`split_row_refs`."""
    return [pl.BlockSpec((None,), index_map)] * (int(st.has_lengths) + int(st.has_offsets))


def row_args(st: _Static, lens, offs) -> list:
    """The arrays matching :func:`row_specs`."""
    return ([lens] if st.has_lengths else []) + ([offs] if st.has_offsets else [])


def split_row_refs(st: _Static, refs):
    """Peel the refs of :func:`row_specs` off a kernel's refs: ``(kv_len_b or None, off, other refs)``.

    ``off`` is the traced query offset of this batch row, or the static ``st.offset`` (a Python int, so the
    no-offsets kernels are exactly the end-aligned ones)."""
    kv_len_b, off = None, st.offset
    if st.has_lengths:
        kv_len_b, refs = refs[0][()], refs[1:]
    if st.has_offsets:
        off, refs = refs[0][()], refs[1:]
    return kv_len_b, off, refs


def tile_mask(st: _Static, rows, cols, kv_len_b, *, row_valid: bool = False, off=None):
    """``[len(rows), len(cols)]`` bool: query index ``rows`` may see key index ``cols``; ``off`` None = static."""
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
    return jnp.broadcast_to(mask, (rows.shape[0], cols.shape[0]))


def key_block_ranges(st: _Static, q0, block_q: int, block_k: int, n_kb: int, kv_len_b, off=None):
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
    return lo, lo_full, hi_full, hi


def query_block_ranges(st: _Static, k0, block_q: int, block_k: int, n_qb: int, kv_len_b, off=None):
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
    return lo, lo_full, hi_full, hi


def three_loops(body, ranges, carry, masked: bool):
    """Run ``body(i, carry, masked=...)`` over the edge tiles with masks and the inner tiles without."""
    lo, lo_full, hi_full, hi = ranges
    if not masked:
        return lax.fori_loop(lo, hi, functools.partial(body, masked=False), carry)
    carry = lax.fori_loop(lo, lo_full, functools.partial(body, masked=True), carry)
    carry = lax.fori_loop(lo_full, hi_full, functools.partial(body, masked=False), carry)
    return lax.fori_loop(hi_full, hi, functools.partial(body, masked=True), carry)


__all__ = ["key_block_ranges", "query_block_ranges", "row_args", "row_specs", "split_row_refs", "three_loops",
           "tile_mask"]
