"""The page pool of the paged caches: which row holds which page, and how many holders each page has.

A paged state (``lcx.cache.paged``, ``lcx.cache.paged_slots``) keeps its keys and values in pages ``[L, P, ...]``
shared by its rows; this module is the bookkeeping over them, one small pytree and pure functions:

- ``table [b, T]``: row ``b``'s pages in position order (-1: none yet);
- ``refs [P]``: the holders of each page - rows, and anything else that keeps a page alive (the server's kept
  prompt prefixes, :func:`hold`); 0: free;
- ``peak []``: the most pages in use at once (what ``GenerateResult.cache_bytes`` reports);
- ``overflow []``: a :func:`grant` found too few free pages (raised on the host by :func:`check`).

Every operation keeps ``refs`` equal to the table's references plus the held ones, and takes free pages in index
order, so two pools given the same calls hold the same pages:

    grant / grant_upto      give rows free pages (``make_room``; copy-on-write's fresh pages)
    assign                  an empty row starts with given pages (the server: a kept prefix's pages)
    drop / trim / release   rows let go of pages (after an eviction; a finished or cancelled request)
    hold                    references that are not a row's (a kept prefix taking or releasing its pages)
    copy_on_write           a row about to write pages others hold gets fresh ones in their place
    fork                    (host) rows as several rows sharing their full pages; :func:`take_pages` moves the data

The device functions run under ``jit`` (the page contents are the caller's: a grant hands out pages as they are).

Shape letters: b rows, T pages per row, P pool pages.
"""

from __future__ import annotations

from collections.abc import Mapping

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from lcx.cache.base import CacheCapacityError
from lcx.cache.schema import Field

# The pool's buffers in a paged state's declaration (``CacheKind.fields``), with their empty values.
FIELDS: Mapping[str, Field] = {
    "table": Field(("batch", "row_pages"), "int32", -1),  # page ids in position order; -1: none yet
    "refs": Field(("pages",), "int32", 0),  # holders of each page; 0: free
    "peak": Field((), "int32", 0),  # the most pages in use at once
    "overflow": Field((), "bool", False),  # a grant found too few free pages (raised by check)
}


@flax.struct.dataclass
class PagePool:
    """The bookkeeping of one page pool (the buffers of ``FIELDS``)."""

    table: jax.Array  # [b, T] int32
    refs: jax.Array  # [P] int32
    peak: jax.Array  # [] int32
    overflow: jax.Array  # [] bool

    @property
    def n_pages(self) -> int:
        return self.refs.shape[0]

    @property
    def rows(self) -> int:
        return self.table.shape[0]

    def in_use(self) -> jax.Array:
        """Pages with a holder, ``[]`` int32."""
        return jnp.sum(self.refs > 0, dtype=jnp.int32)

    def free(self) -> jax.Array:
        """Pages without a holder, ``[]`` int32."""
        return jnp.sum(self.refs == 0, dtype=jnp.int32)


def empty(rows: int, row_pages: int, n_pages: int) -> PagePool:
    """A pool of ``n_pages`` free pages for ``rows`` rows of ``row_pages`` table entries."""
    return PagePool(table=jnp.full((rows, row_pages), -1, jnp.int32), refs=jnp.zeros((n_pages,), jnp.int32),
                    peak=jnp.zeros((), jnp.int32), overflow=jnp.zeros((), bool))


def _with_peak(pool: PagePool) -> PagePool:
    return pool.replace(peak=jnp.maximum(pool.peak, jnp.sum(pool.refs > 0)))


# --------------------------------------------------------------------------------------------------- taking pages
def grant(pool: PagePool, fill: jax.Array) -> PagePool:
    """``pool`` with a free page put in every table entry ``fill [b, T]`` marks (rows in order, each row's entries
    in order, free pages in index order); too few free pages set ``overflow`` (the entries past the free ones get
    arbitrary pages: :func:`check` raises before anything reads them). The peak follows."""
    table, refs = pool.table, pool.refs
    pages = refs.shape[0]
    new = jnp.sum(fill, axis=1)
    start = jnp.cumsum(new) - new  # [b] each row's first free page among the free ones
    index = jnp.arange(pages)
    free_first = jnp.argsort(jnp.where(refs == 0, index, pages + index))  # free pages first, in index order
    rank = jnp.cumsum(fill, axis=1) - 1  # [b, T] the entry's rank among its row's new pages
    table = jnp.where(fill, free_first[jnp.clip(start[:, None] + rank, 0, pages - 1)], table)
    refs = refs.at[jnp.where(fill, table, pages)].add(1, mode="drop")
    overflow = pool.overflow | (jnp.sum(new) > jnp.sum(pool.refs == 0))
    return _with_peak(pool.replace(table=table, refs=refs, overflow=overflow))


def grant_upto(pool: PagePool, want: jax.Array) -> PagePool:
    """``pool`` with row ``b`` holding its first ``want [b]`` table entries (capped at the table's width)."""
    j = jnp.arange(pool.table.shape[1])[None, :]
    want = jnp.minimum(want, pool.table.shape[1])[:, None]
    return grant(pool, (j < want) & (pool.table < 0))


def assign(pool: PagePool, row, pages: jax.Array) -> PagePool:
    """Row ``row`` (empty) starts with the pages ``pages [T]`` (-1: none), one more reference each."""
    refs = pool.refs.at[jnp.where(pages >= 0, pages, pool.n_pages)].add(1, mode="drop")
    return _with_peak(pool.replace(table=pool.table.at[row].set(pages), refs=refs))


def hold(pool: PagePool, pages: jax.Array, delta) -> PagePool:
    """``delta`` more references (negative: fewer) to each of ``pages [n]`` that no row's table counts (-1: none,
    padding)."""
    return _with_peak(pool.replace(refs=pool.refs.at[jnp.where(pages >= 0, pages, pool.n_pages)].add(delta,
                                                                                                    mode="drop")))


# --------------------------------------------------------------------------------------------------- letting go
def drop(pool: PagePool, mask: jax.Array) -> PagePool:
    """The table entries ``mask [b, T]`` marks let go of their pages (a reference less each; the entries -1)."""
    mask = mask & (pool.table >= 0)
    refs = pool.refs.at[jnp.where(mask, pool.table, pool.n_pages)].add(-1, mode="drop")
    return pool.replace(table=jnp.where(mask, -1, pool.table), refs=refs)


def trim(pool: PagePool, keep: jax.Array) -> PagePool:
    """Row ``b`` keeps its first ``keep [b]`` table entries and lets go of the others."""
    j = jnp.arange(pool.table.shape[1])[None, :]
    return drop(pool, j >= keep[:, None])


def release(pool: PagePool, row) -> PagePool:
    """Row ``row`` lets go of every page it holds (its table empty)."""
    return drop(pool, (jnp.arange(pool.rows) == row)[:, None])


# --------------------------------------------------------------------------------------------------- sharing
def copy_on_write(pool: PagePool, write: jax.Array) -> PagePool:
    """``pool`` with every entry ``write [b, T]`` marks whose page has other holders given a fresh page of its own
    (the shared page a reference less): after it a row writes only pages it alone holds. The fresh pages' contents
    are the caller's to fill (the replaced pages are ``pool.table`` where the new table differs)."""
    table, refs = pool.table, pool.refs
    copy = write & (table >= 0) & (refs[jnp.maximum(table, 0)] > 1)
    refs = refs.at[jnp.where(copy, table, pool.n_pages)].add(-1, mode="drop")
    return grant(pool.replace(table=jnp.where(copy, -1, table), refs=refs), copy)


def fork(pool: PagePool, n, full: np.ndarray, reserve: np.ndarray) -> tuple[PagePool, np.ndarray]:
    """(Host.) Each row ``r`` as ``n[r]`` consecutive rows (``n``: an int for every row, or one count per row): its
    first ``full[r]`` pages shared by its copies (``refs`` counting every holder), its other pages copied per copy
    (copy-on-write at the fork), and ``reserve[r]`` pages per copy (its copies included) kept free for what it may
    still write. Returns the new pool - the shared pages first, then the copies, then the free ones - and
    ``source [n]``: the old page each of its first ``n`` pages holds (:func:`take_pages` moves the data). Holders
    other than rows are not carried over."""
    table = np.asarray(pool.table)
    rows = table.shape[0]
    counts = np.broadcast_to(np.asarray(n, np.int64), (rows,))
    used = sorted({int(p) for r in range(rows) for p in table[r, :full[r]]})
    shared_pages = len(used)
    total = shared_pages + int(np.sum(counts * reserve))
    remap = np.full(pool.n_pages + 1, -1, np.int64)
    remap[used] = np.arange(shared_pages)
    new_table = np.full((int(counts.sum()), table.shape[1]), -1, np.int32)
    copies_src = []
    row = 0
    for r in range(rows):
        private = [int(p) for p in table[r, full[r]:] if p >= 0]
        for _ in range(counts[r]):
            new_table[row, :full[r]] = remap[table[r, :full[r]]]
            start = shared_pages + len(copies_src)
            new_table[row, full[r]:full[r] + len(private)] = np.arange(start, start + len(private))
            copies_src += private
            row += 1
    refs = np.zeros(total, np.int32)
    for held in new_table:
        refs[held[held >= 0]] += 1
    new = PagePool(table=jnp.asarray(new_table), refs=jnp.asarray(refs), peak=jnp.asarray(np.int32((refs > 0).sum())),
                   overflow=jnp.asarray(False))
    return new, np.asarray(used + copies_src, np.int32)


def take_pages(x: jax.Array, source: np.ndarray, n_pages: int) -> jax.Array:
    """Pages ``x [L, P, ...]`` as a pool of ``n_pages``: page ``i`` holds ``x[:, source[i]]``, the rest zeros."""
    kept = jnp.take(x, jnp.asarray(source), axis=1)
    pad = jnp.zeros((x.shape[0], n_pages - kept.shape[1], *x.shape[2:]), x.dtype)
    return jnp.concatenate([kept, pad], axis=1)


# --------------------------------------------------------------------------------------------------- host checks
def check(pool: PagePool, page: int) -> None:
    """(Host, after a call.) A ``CacheCapacityError`` if a grant found too few free pages; ``page``: tokens per
    page, for the message."""
    if bool(pool.overflow):
        raise CacheCapacityError(
            f"the paged cache ran out of pages: its pool holds {pool.n_pages} pages of {page} tokens and "
            f"{int(jnp.sum(pool.refs > 0))} are in use; plan the request with more pages (fork plans the pool from "
            "the tokens each row may still write)")


__all__ = ["FIELDS", "PagePool", "assign", "check", "copy_on_write", "drop", "empty", "fork", "grant", "grant_upto",
           "hold", "release", "take_pages", "trim"]
