"""Operations on the rows of a paged state that the server runs between its jitted steps: a sub-batch of rows
taken out and written back (``gather`` / ``scatter``: every per-row buffer the cache type declares, the pool
shared), a row started on given pages or on pages loaded from a store, a row released, references to kept pages.

The per-row buffers come from the cache type's field declarations (``lcx.cache.schema``: those with a ``batch``
axis), so the same code serves the full paged cache and the evicting one (``lcx.cache.paged_slots``, whose rows also
hold positions, masks and statistics).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from lcx.cache import page_pool
from lcx.cache.paged import PagedState


def row_fields(kind, names=None) -> dict[str, tuple[int, object]]:
    """The per-row buffers of cache type ``kind`` (those among ``names``): name -> (batch axis, empty value)."""
    return {n: (f.axes.index("batch"), f.fill) for n, f in kind.fields().items()
            if "batch" in f.axes and (names is None or n in names)}


def rows_of(state: PagedState) -> dict:
    """The per-row buffers of ``state`` (its table, lengths, and an evicting cache's positions and statistics)."""
    return {n: getattr(state, n) for n in row_fields(state.kind) if getattr(state, n, None) is not None}


def kv_names(state: PagedState) -> list[str]:
    """The pool buffers a page's contents live in (keys, values and, 8-bit, their scales)."""
    return [n for n, f in state.kind.fields().items() if f.axes[:2] == ("layers", "pages")
            and getattr(state, n, None) is not None]


def page_layout(state: PagedState) -> dict[str, tuple[str, tuple[int, ...]]]:
    """What one page's contents are (``kv_store.layout_of``): each pool buffer's name -> (dtype name, shape without
    the pages axis)."""
    return {n: (str(x.dtype), (x.shape[0],) + tuple(x.shape[2:]))
            for n in kv_names(state) for x in [getattr(state, n)]}


def gather(state: PagedState, index) -> PagedState:
    """``state`` with the rows ``index [n]`` of every per-row buffer (an index past the last row: an empty row);
    the pool (its pages) is the same arrays."""
    return state.replace(**_take_rows(state.kind, rows_of(state), index))


def scatter(full: dict, sub: PagedState, index, n: int) -> PagedState:
    """``sub`` (its pool current) with the per-row buffers ``full`` where rows ``index[:n]`` take ``sub``'s first
    ``n`` rows."""
    return sub.replace(**_put_rows(sub.kind, full, rows_of(sub), index, n))


@functools.partial(jax.jit, static_argnums=(0,))
def _take_rows(kind, rows: dict, index) -> dict:
    fields = row_fields(kind, rows)
    return {n: jnp.take(x, index, axis=fields[n][0], mode="fill", fill_value=fields[n][1]) for n, x in rows.items()}


@functools.partial(jax.jit, static_argnums=(0, 4), donate_argnums=(1,))
def _put_rows(kind, full: dict, sub: dict, index, n: int) -> dict:
    def put(name, x):
        axis = row_fields(kind, full)[name][0]
        return x.at[(slice(None),) * axis + (index[:n],)].set(jax.lax.slice_in_dim(sub[name], 0, n, axis=axis))

    return {name: put(name, x) for name, x in full.items()}


def reset_row(state: PagedState, row) -> PagedState:
    """Row ``row``'s per-row buffers (but its table) back to their empty values."""
    def reset(name, axis, fill):
        x = getattr(state, name)
        return x.at[(slice(None),) * axis + (row,)].set(jnp.asarray(fill, x.dtype))

    fields = row_fields(state.kind, rows_of(state))
    return state.replace(**{n: reset(n, axis, fill) for n, (axis, fill) in fields.items() if n != "table"})


@functools.partial(jax.jit, donate_argnums=(0,))
def assign(state: PagedState, row, table, length) -> PagedState:
    """Row ``row`` starts with the pages ``table [T]`` (-1: none) holding ``length`` tokens."""
    state = reset_row(state, row).with_pool(page_pool.assign(state.pool, row, table))
    return state.replace(lengths=state.lengths.at[row].set(length))


@functools.partial(jax.jit, donate_argnums=(0,))
def release(state: PagedState, row) -> PagedState:
    """Row ``row`` ends: its pages lose a reference, the row is empty."""
    return reset_row(state, row).with_pool(page_pool.release(state.pool, row))


@functools.partial(jax.jit, donate_argnums=(0,))
def hold(state: PagedState, pages, delta) -> PagedState:
    """``delta`` more references to ``pages`` (a kept prefix taking or releasing them)."""
    return state.with_pool(page_pool.hold(state.pool, pages, delta))


@functools.partial(jax.jit, donate_argnums=(0,))
def write_pages(state: PagedState, row, n, arrays: dict) -> PagedState:
    """Row ``row`` (empty) takes ``n`` free pages holding ``arrays`` (each ``[L, n, ...]``: the contents of ``n``
    pages in position order) and reads them as its first ``n * page`` tokens."""
    want = jnp.where(jnp.arange(state.table.shape[0]) == row, n, 0)
    state = state.with_pool(page_pool.grant_upto(state.pool, want))
    width = arrays["k"].shape[1]
    ids = jnp.where(jnp.arange(width) < n, jnp.pad(state.table[row], (0, width))[:width], state.n_pages)
    state = state.replace(**{name: getattr(state, name).at[:, ids].set(x.astype(getattr(state, name).dtype),
                                                                     mode="drop")
                             for name, x in arrays.items()})
    return state.replace(lengths=state.lengths.at[row].set(n * state.kind.page))


def padded(pages, fill: int = -1) -> jax.Array:
    """Page ids padded to a power of two (``fill``; -1: out of range, dropped): a few compiled shapes, not one per
    page count."""
    pages = list(pages)
    return jnp.asarray(pages + [fill] * ((1 << max(len(pages) - 1, 0).bit_length()) - len(pages)), jnp.int32)


take_pages = jax.jit(lambda pool, ids: jnp.take(pool, ids, axis=1))  # pool [L, P, ...] -> the pages ids [L, n, ...]


class StateRef:
    """The one paged state of a server, which its parts (``Scheduler``, ``PrefixCache``) replace in place: each
    operation is a pure function of the state, and the reference keeps the latest even when one raises after it."""

    def __init__(self, state: PagedState):
        self.state = state


def set_row(values: np.ndarray, row: int, value) -> np.ndarray:
    """A copy of the host array ``values`` with row ``row`` set to ``value``."""
    values = values.copy()
    values[row] = value
    return values


__all__ = ["assign", "gather", "hold", "kv_names", "page_layout", "release", "reset_row", "row_fields", "rows_of",
           "padded", "scatter", "set_row", "StateRef", "take_pages", "write_pages"]
