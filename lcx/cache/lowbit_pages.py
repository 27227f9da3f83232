"""The bit-packed cache (``cache.kv_dtype: int4 | int2``, ``lcx.cache.lowbit_slots``) in pages
(``cache.layout: paged``; ``lcx.cache.paged_slots`` runs it, for the full policy as for the evicting ones).

A row's slot ``s`` lives in slot ``s % g`` of page ``table[b, s // g]``, as in every paged cache; what a page holds
is the bit-packed store's share of its ``g`` slots, every buffer in the store's own layout with the slot axis cut
into pages:

- ``k [L, P, k, d, g * bits / 8]``: the keys' codes, channel-major (a page's slots are whole bytes of each channel);
- ``k_scale, k_zero [L, P, k, g / G, d]``: the key groups of the page (``g`` a multiple of ``G = kv_group``, so a
  group never straddles two pages and a page can be shared or freed alone);
- ``v [L, P, k, g, d * bits / 8]``, ``v_scale, v_zero [L, P, k, g, d / Gv]``: the values' codes and scales.

The float window (``k_res, v_res [L, b, k, R + G, d]``: the ``R = kv_residual`` most recent tokens and the key group
still filling) is per row, not paged: it is what a row alone holds, and it moves with the row (fork repeats it).
Pages are handed out for every slot up to the row's count, window or not, so the slot space is exactly the
contiguous cache's and tokens equal it.

A layer call gathers a row's pages into the contiguous store's arrays (:func:`view`), runs the slot cache's
attention on them, and writes back only the pages a group flush may have changed - those from the one holding the
first quantized slot before the call, a fixed count per call (:func:`flushed_pages`). Shape letters: L layers, P
pool pages, b batch, T pages per row, g slots per page, k KV heads, d head dim, G slots per key group.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp

from lcx.cache import lowbit_slots
from lcx.cache.schema import Field
from lcx.kernels.lowbit import LOWBIT

_SCALE = "float16"
_POOL = ("layers", "pages", "kv_heads")
POOL_FIELDS: Mapping[str, Field] = {
    "k": Field((*_POOL, "head_dim", "packed_page"), "uint8", 0, role="kv"),
    "v": Field((*_POOL, "page", "packed_dim"), "uint8", 0, role="kv"),
    "k_scale": Field((*_POOL, "page_groups", "head_dim"), _SCALE, 0.0, role="kv"),
    "k_zero": Field((*_POOL, "page_groups", "head_dim"), _SCALE, 0.0, role="kv"),
    "v_scale": Field((*_POOL, "page", "value_groups"), _SCALE, 0.0, role="kv"),
    "v_zero": Field((*_POOL, "page", "value_groups"), _SCALE, 0.0, role="kv"),
}
WINDOW = ("k_res", "v_res")  # per row, lowbit_slots' declaration
FIELDS: Mapping[str, Field] = {**POOL_FIELDS, **{n: lowbit_slots.FIELDS[n] for n in WINDOW}}
# The slot axis of each pool buffer in one layer's pool [P, k, ...] (and in the gathered view [b, k, ...]).
SLOT_AXIS = {"k": 3, "v": 2, "k_scale": 2, "k_zero": 2, "v_scale": 2, "v_zero": 2}


def sizes(fmt, page: int) -> dict[str, int]:
    """The pool axes beyond the slot cache's own (``lowbit_slots.sizes`` gives the rest); ``fmt``: the format
    (``lcx.cache.storage.PackedStorage``)."""
    return {"packed_page": page * LOWBIT[fmt.name] // 8, "page_groups": page // fmt.group}


def per_page(fmt, page: int) -> dict[str, int]:
    """How long one page is along each buffer's slot axis: bytes of key codes, key groups, or slots."""
    units = sizes(fmt, page)
    return {"k": units["packed_page"], "k_scale": units["page_groups"], "k_zero": units["page_groups"],
            "v": page, "v_scale": page, "v_zero": page}


def view_lengths(fmt, head_dim: int, capacity: int) -> dict[str, int]:
    """The contiguous store's length along each buffer's slot axis for ``capacity`` slots."""
    s = lowbit_slots.sizes(fmt, head_dim, capacity)
    return {"k": s["packed_length"], "k_scale": s["key_groups"], "k_zero": s["key_groups"], "v": capacity,
            "v_scale": capacity, "v_zero": capacity}


def view(pool: jax.Array, table: jax.Array, name: str, length: int) -> jax.Array:
    """One layer's pool buffer ``name`` (``[P, k, ...]``) as the contiguous store's ``[b, k, ...]``: each row's
    pages in order along the slot axis, cut to ``length``."""
    axis = SLOT_AXIS[name]
    x = pool[jnp.maximum(table, 0)]  # [b, T, k, ...]
    x = jnp.moveaxis(x, 1, axis)  # T just before the slot axis (which moves one on)
    x = x.reshape(*x.shape[:axis], x.shape[axis] * x.shape[axis + 1], *x.shape[axis + 2:])
    return jax.lax.slice_in_dim(x, 0, length, axis=axis)


def pages_of(x: jax.Array, name: str, unit: int, row_pages: int) -> jax.Array:
    """A gathered view ``[b, k, ...]`` cut back into its ``row_pages`` pages: ``[b, k, T, <one page of the
    pool>]`` (past the view's end: zeros, slots nobody reads)."""
    axis = SLOT_AXIS[name]
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, row_pages * unit - x.shape[axis])
    x = jnp.pad(x, pad)
    x = x.reshape(*x.shape[:axis], row_pages, unit, *x.shape[axis + 1:])
    return jnp.moveaxis(x, axis, 2)


def put_pages(pool: jax.Array, x: jax.Array, name: str, unit: int, table: jax.Array, index: jax.Array) -> jax.Array:
    """One layer's ``pool`` with the pages ``index [b, k, n]`` (a row's page numbers; past its table: dropped) of
    the view ``x`` written where the row's table puts them, per KV head."""
    row_pages, n_pages = table.shape[1], pool.shape[0]
    pages = pages_of(x, name, unit, row_pages)  # [b, k, T, ...]
    at = jnp.clip(index, 0, row_pages - 1)
    content = jnp.take_along_axis(pages, at.reshape(at.shape + (1,) * (pages.ndim - 3)), axis=2)
    ids = jnp.take_along_axis(table[:, None, :], at, axis=2)  # [b, k, n]
    ids = jnp.where((index < row_pages) & (ids >= 0), ids, n_pages)
    heads = jnp.arange(pool.shape[1])[None, :, None]
    return pool.at[ids, heads].set(content.astype(pool.dtype), mode="drop")


def flushed_pages(count: jax.Array, kv_heads: int, new: int, fmt, page: int) -> jax.Array:
    """The page numbers ``[b, k, n]`` a call appending ``new`` tokens may write codes into, per KV head: from the
    page of the first slot not yet quantized (``count [b, H]``: the slots before the call) over the most slots one
    call flushes (the window and the new tokens, in whole groups)."""
    start = lowbit_slots.quantized_slots(lowbit_slots.per_kv(count, kv_heads), fmt)  # [b, k]
    flushed = -(-(fmt.residual + fmt.group + new) // fmt.group) * fmt.group
    n = -(-(flushed + page - fmt.group) // page)  # start is a multiple of G, not of g
    return start[..., None] // page + jnp.arange(n)


__all__ = ["FIELDS", "POOL_FIELDS", "SLOT_AXIS", "WINDOW", "flushed_pages", "pages_of", "per_page", "put_pages",
           "sizes", "view", "view_lengths"]
