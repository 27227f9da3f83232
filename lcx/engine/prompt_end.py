"""The end of a served prompt under an evicting policy: the policy's one compression of the rows whose prompt was
just read - after KVzip's reconstruction passes (``lcx.cache.reconstruct``) when the policy scores by them - and the
pages such a row can still come to hold, which is all the server keeps reserved for it from then on.

A one-shot policy (SnapKV, TOVA, KVzip with ``interval`` >= the longest prompt - ``budget``) needs a row as large
as its whole prompt while it reads it; after the compression the row holds ``budget`` slots and grows by one per
generated token. Lowering the row's reservation to that (``pages_still_needed``) is what turns the compression into
more rows served at once in the same KV memory (the pages past the last kept slot went back to the pool at the
compression: ``lcx.cache.paged_slots``).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from lcx.cache.reconstruct import Reconstruction
from lcx.engine import rows


def pl2(n: int) -> int:
    """The power of two at or above ``n`` (the sub-batch sizes a call compiles for)."""
    return 1 << max(n - 1, 0).bit_length()


def compress_rows(kind, programs, params, sub, ending: list[int], prompts: list[np.ndarray],
                  reconstruction: Reconstruction | None):
    """``sub`` (a sub-batch of the server's rows) with its rows ``ending`` (whose prompts ``prompts`` were just
    read) compressed by the policy's end of prefill; with ``reconstruction`` the rows are first scored by its passes
    (a batch of those rows only, padded to a power of two with empty rows: one compiled program per size)."""
    batch = sub.table.shape[0]
    at = jnp.asarray(ending + [batch] * (pl2(len(ending)) - len(ending)), jnp.int32)
    ended = rows.gather(sub, at)
    if reconstruction is not None:
        lengths = np.zeros(int(at.shape[0]), np.int32)
        lengths[:len(prompts)] = [p.size for p in prompts]
        ids = np.zeros((lengths.size, max(1, int(lengths.max()))), np.int32)
        for i, p in enumerate(prompts):
            ids[i, :p.size] = p
        for tokens, ok, lo, hi in reconstruction.passes(ids, lengths, kind.policy.chunk):
            ended = programs.probe_chunk(params, ended, jnp.asarray(tokens), jnp.asarray(ok), jnp.asarray(lo),
                                         jnp.asarray(hi))
    ended = kind.sync(programs.end_prefill(ended))
    return rows.scatter(rows.rows_of(sub), ended, at, len(ending))


def pages_still_needed(table_row: np.ndarray, new_tokens: int, page: int, row_pages: int) -> int:
    """The most pages a row holding the pages ``table_row`` (-1: none) after its compression can come to hold while
    it generates ``new_tokens`` more: what it holds, plus a page per ``page`` tokens, never past its table."""
    held = int(np.count_nonzero(table_row >= 0))
    return min(row_pages, held + -(-new_tokens // page))


__all__ = ["compress_rows", "pages_still_needed", "pl2"]
