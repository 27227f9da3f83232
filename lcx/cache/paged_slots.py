"""Eviction on the paged cache (``CacheConfig(layout="paged", policy=<an evicting policy>)``): the slot cache's
policies, position modes and budget schedules, with the keys and values in pages.

The slot cache (``lcx.cache.kv_cache``) gives each row and keep head the slots ``0 .. C-1``, live ones packed at the
front in position order; an eviction compacts the survivors to the front. This cache has exactly that slot space,
but slot ``s`` of row ``b`` lives in slot ``s % g`` of page ``table[b, s // g]`` of the pool the rows share
(``lcx.cache.paged``); the small per-slot metadata (positions, live mask, counts, statistics) stays per row. So it
decides, keeps and generates exactly what the contiguous layout does:

- a layer call gathers each row's pages into the slot view, runs the slot cache's attention on it (write, position
  modes, statistics; ``lcx.cache.slot_attention``) and writes only the new tokens back into their pages;
- ``make_room`` evicts as the slot cache does (on the gathered view) the rows that would overflow, and only those,
  then hands every row the pages its next tokens need;
- after an eviction the pages past a row's last occupied slot (in every layer and keep head: one table serves all
  layers) return to the pool, and a shared page whose slots the compaction changes is first copied for the row
  (copy-on-write). Rows forked from one compressed context (``Generator.fork`` after a one-shot SnapKV) share its
  pages until an eviction rewrites them.

The pool of a forked state is planned for the worst case, every row rewriting every page it holds, so it never runs
out; ``GenerateResult.cache_bytes`` reports the peak of pages in use. Decode steps read the gathered view (the
paged decode kernel takes one length per row; evicting policies keep per-head sets and "cache"-mode policies rotate
keys by rank at read time).

The pages hold what the kind's storage declares (``KVStorage.page_fields``; an 8-bit cache's codes and scale
pages, a bit-packed one's codes and group scales, its rows' float windows beside the pool): the storage gathers
them into the slot view (``gather``), writes back what a call wrote (``put_new``) and what an eviction compacted
(``put_evicted``).

Shape letters: L layers, P pool pages, b batch, T pages per row, g slots per page, C slots per row (the slot cache's
capacity, at most T * g), H keep heads, k kv heads, d head dim, t new tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import ClassVar

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from lcx.cache import page_pool, paged, slot_attention
from lcx.cache.base import register_kind
from lcx.cache.kv_cache import FIELDS as SLOT_FIELDS, QUERY_FIELDS, KVCache, SlotCacheKind
from lcx.cache import schema
from lcx.cache.schedule import Left
from lcx.cache.schema import Field
from lcx.cache.storage import namespace
from lcx.config_base import ConfigError

METADATA = ("pos", "valid", "count", "score")  # the slot cache's per-row buffers, kept as they are
PER_SLOT = ("pos", "valid", "score")  # those with a slot axis (the last)
FIELDS: Mapping[str, Field] = {**paged.FIELDS, **{n: SLOT_FIELDS[n] for n in METADATA}}


@flax.struct.dataclass
class PagedSlotCache(paged.PagedState):
    """The buffers of ``FIELDS``: the pages and pool of ``paged.PagedState`` and the slot cache's metadata."""

    pos: jax.Array  # [L, b, H, C] int32
    valid: jax.Array  # [L, b, H, C] bool
    count: jax.Array  # [L, b, H] int32
    score: jax.Array  # [L, b, H, C] float32
    lengths: jax.Array | None  # [b] int32
    q_count: jax.Array | None = None  # the policy's query moments (QUERY_FIELDS), when it declares them
    q_mean: jax.Array | None = None
    q_m2: jax.Array | None = None
    # the storage's other buffers (kind.storage.page_fields() / row_fields()): an 8-bit cache's scale pages [L, P,
    # k, g]; a bit-packed one's (lcx.cache.lowbit_pages) codes and group scales and zeros in its own page layout,
    # and each row's float window [L, b, k, R + G, d]
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None
    k_zero: jax.Array | None = None
    v_zero: jax.Array | None = None
    k_res: jax.Array | None = None
    v_res: jax.Array | None = None
    kind: "PagedSlotKind" = flax.struct.field(pytree_node=False, default=None)

    @property
    def capacity(self) -> int:
        return self.shape_of("pos")[-1]


@register_kind
@dataclasses.dataclass(frozen=True)
class PagedSlotKind(SlotCacheKind):
    """The slot cache's eviction over a page pool; ``page``: slots per page. Planning, chunk sizes and statistics
    are the slot cache's (so are the tokens)."""

    name: ClassVar[str] = "paged_slots"
    state_type: ClassVar[type] = PagedSlotCache

    page: int = 16

    @classmethod
    def from_config(cls, model, cache, policy) -> "PagedSlotKind":
        if policy.cache_type != "slots":
            raise ConfigError(f"cache.layout='paged' with cache.policy={cache.policy!r}: that policy keeps its own "
                              f"cache type ({policy.cache_type!r}); allowed: the slot policies (full, streaming, "
                              "h2o, snapkv, ...), or layout 'contiguous'")
        paged.refuse_windows(model)
        slots = SlotCacheKind.from_config(model, cache, policy)
        return cls(**{f.name: getattr(slots, f.name) for f in dataclasses.fields(slots)}, page=cache.page_size)

    @property
    def reconstructable(self) -> bool:
        return True  # a pass scores the gathered view (``_probe``); only the per-row scores change

    @property
    def slots(self) -> SlotCacheKind:
        """The contiguous kind with the same policy and budgets (whose attention and eviction run on the views)."""
        return SlotCacheKind(**{f.name: getattr(self, f.name) for f in dataclasses.fields(SlotCacheKind)})

    # ------------------------------------------------------------------------------------------- declaration
    def fields(self) -> Mapping[str, Field]:
        return {**FIELDS, **{n: f for n, f in self.slots.fields().items() if n in QUERY_FIELDS},
                **self.storage.page_fields(), **self.storage.row_fields()}

    def _metadata(self) -> tuple[str, ...]:
        """The slot cache's buffers this kind keeps as they are, per row: positions, masks, scores (and query
        moments; a bit-packed cache's float window)."""
        return METADATA + tuple(n for n in self.slots.fields() if n in QUERY_FIELDS) + tuple(self.storage.row_fields())

    def sizes(self, batch: int, capacity: int) -> dict[str, int]:
        row_pages = -(-capacity // self.page)
        return {**super().sizes(batch, capacity), "pages": batch * row_pages, "page": self.page,
                "row_pages": row_pages, **self.storage.page_sizes(self.model.head_dim, self.page)}

    def pages_for(self, batch: int, tokens: int, shared: int = 0) -> int:
        """Pages ``batch`` sequences of ``tokens`` tokens hold at most: the slots the policy plans for them, in whole
        pages per sequence (a shared prefix is not counted once: an eviction after a fork copies what it rewrites)."""
        return batch * -(-self.plan(batch, tokens, 0) // self.page)

    def page_nbytes(self) -> int:
        """Bytes of one page in every layer, keys and values (and their scales; not a row's float window)."""
        pooled = {n: f for n, f in self.fields().items() if "pages" in f.axes}
        return schema.nbytes(pooled, self.sizes(1, self.page), self.kv_dtype, "kv")

    @property
    def shardable(self) -> bool:
        return True  # the pool and the per-slot metadata split by KV head over "model" (no "data": check_mesh)

    def check_mesh(self, mesh) -> None:
        paged.check_pool_mesh(mesh)

    # ------------------------------------------------------------------------------------------- attention
    def attend(self, layer: PagedSlotCache, q, key, val, *, cos, sin, positions, ok, stat_weights, spec=None,
               probe=None):
        if probe is not None:
            return self._probe(layer, q, key, val, cos=cos, sin=sin, ok=ok, spec=spec, probe=probe)
        # A table cut short (the server reads only the pages its rows can hold, lcx.engine.server) is the slot cache
        # of that many slots: the per-slot metadata is cut with it and put back after.
        width = min(layer.pos.shape[-1], layer.table.shape[1] * self.page)
        metadata = {n: getattr(layer, n)[..., :width] if n in PER_SLOT else getattr(layer, n)
                    for n in self._metadata()}
        slots = KVCache(**self.storage.gather(layer, layer.table, width), lengths=None, kind=self.slots, **metadata)
        out, slots = slot_attention.attend(self.slots, slots, q, key, val, cos=cos, sin=sin, positions=positions,
                                           ok=ok, stat_weights=stat_weights, spec=spec)
        # what the call wrote back into its pages (the new tokens' slots, or the pages a group flush wrote)
        pools = self.storage.put_new(layer, slots, count=layer.count, ok=ok, page=self.page)
        return out, layer.replace(**pools, **{
            n: getattr(layer, n).at[..., :width].set(getattr(slots, n)) if n in PER_SLOT else getattr(slots, n)
            for n in self._metadata()})

    def _probe(self, layer: PagedSlotCache, q, key, val, *, cos, sin, ok, spec, probe):
        """A reconstruction pass (KVzip, ``lcx.cache.reconstruct``): the slot cache's pass on the gathered view -
        it appends nothing, so only the slots' scores come back (per row, not paged)."""
        capacity = layer.pos.shape[-1]
        metadata = {n: getattr(layer, n) for n in self._metadata()}
        slots = KVCache(**self.storage.gather(layer, layer.table, capacity), lengths=None, kind=self.slots,
                        **metadata)
        out, scored = self.slots.attend(slots, q, key, val, cos=cos, sin=sin, positions=None, ok=ok,
                                        stat_weights=None, spec=spec, probe=probe)
        return out, layer.replace(score=scored.score)

    # ------------------------------------------------------------------------------------------- between calls
    def evict(self, state: PagedSlotCache, rows: jax.Array | None = None) -> tuple[PagedSlotCache, Left]:
        """The slot cache's eviction on the gathered view, then the pages: those past each row's last occupied slot
        freed, shared ones the compaction rewrites copied for the row, and every page a row holds written from the
        compacted view (unchanged shared pages with the values they hold). ``rows [b]``: only the rows it marks
        (``make_room``: those that would overflow; None: every row) - the others keep their metadata, their pages
        and every byte in them."""
        if self.budgets is None:  # the full policy (a bit-packed paged cache keeps every token here)
            return state, None
        cut = jnp.ones(state.table.shape[:1], bool) if rows is None else rows  # [b]
        metadata = {n: getattr(state, n) for n in self._metadata()}
        stored = jax.vmap(lambda layer: self.storage.gather(namespace(**layer), state.table, state.capacity))(
            {n: getattr(state, n) for n in self.storage.page_fields()})  # [L, b, k, C, ...]
        before = KVCache(**stored, lengths=state.lengths, kind=self.slots, **metadata)
        after, left = self.slots.evict(before, rows)  # the storage's compaction (requantized, where it must)
        state = self._repage(state, before, after, cut)
        pools = self.storage.put_evicted(state, after, cut, self.page)
        return state.replace(**pools, pos=after.pos, valid=after.valid, count=after.count, score=after.score,
                             **{n: getattr(after, n) for n in self.storage.row_fields()}), left

    def _repage(self, state: PagedSlotCache, before: KVCache, after: KVCache, cut: jax.Array) -> PagedSlotCache:
        """``state``'s pool after the eviction ``before -> after`` (stacked views) of the rows ``cut [b]`` marks:
        their pages past the last occupied slot back to the pool, and the shared pages the compaction rewrites
        copied for the row (copy-on-write). Other rows keep every page (``after`` equals ``before`` there)."""
        page, row_pages = self.page, state.table.shape[1]
        need = jnp.where(cut, -(-jnp.max(after.count, axis=(0, 2)) // page), row_pages)  # [b] pages each row holds
        pad = ((0, 0), (0, 0), (0, 0), (0, row_pages * page - state.capacity))
        moved = jnp.pad((after.pos != before.pos) | (after.valid != before.valid), pad)
        changed = jnp.any(moved.reshape(*moved.shape[:3], row_pages, page), axis=(0, 2, 4))  # [b, T]
        return state.with_pool(page_pool.copy_on_write(page_pool.trim(state.pool, need), changed))

    def make_room(self, state: PagedSlotCache, n) -> PagedSlotCache:
        """Evict the rows that would overflow (the slot cache's rule, per row), then give every row the pages for its
        next ``n`` slots in every layer and keep head."""
        state = super().make_room(state, n)
        count = jnp.stack(state.count) if state.split else state.count  # [L, b, H]
        return state.with_pool(page_pool.grant_upto(state.pool, -(-(jnp.max(count, axis=(0, 2)) + n) // self.page)))

    def sync(self, state: PagedSlotCache) -> PagedSlotCache:
        page_pool.check(state.pool, self.page)
        return state

    def fork(self, state: PagedSlotCache, n: int) -> PagedSlotCache:
        """Each row of ``state`` as ``n`` consecutive rows: the pages every layer and keep head has filled shared,
        the others copied, the metadata repeated. The pool holds the shared pages and, per row, its whole table's
        worth (an eviction may copy every shared page it rewrites)."""
        stacked = state.stack_layers()
        filled = self.storage.quantized_slots(stacked.count)  # [L, b, H]: only final bytes (not a float window)
        full = np.asarray(jnp.min(filled, axis=(0, 2))) // self.page
        out = paged.fork_pages(stacked, n, full, np.full(full.shape, stacked.table.shape[1]))
        counts = np.broadcast_to(np.asarray(n), full.shape)
        return out.replace(**{name: jnp.repeat(getattr(stacked, name), counts, axis=1) for name in self._metadata()})


__all__ = ["FIELDS", "PagedSlotCache", "PagedSlotKind"]
