"""The paged KV cache (``CacheConfig(layout="paged", page_size=16)``): a pool of fixed-size pages shared by the rows.

Per layer the keys and values live in one pool ``[P, k, page, d]`` (each page in the slot cache's ``[kv_head, slot,
head_dim]`` layout); a row's ``table [T]`` lists its pages in position order (-1: none yet), so position ``p`` of row
``b`` is slot ``p % page`` of page ``table[b, p // page]``. ``refs [P]`` counts the rows holding each page (0: free).
``make_room`` (jitted, before every model call) gives each row the pages its next tokens need, taking free pages in
index order; a request the pool cannot serve sets ``overflow``, which ``sync`` (on the host, after the call) raises
as a ``CacheCapacityError`` - the planner sizes the pool so that it never happens.

Rows that share a prefix share its pages: ``fork`` (``Generator.fork``) turns each row of a prefilled state into
``n`` rows whose tables point at the same full pages (their ``refs`` counting every holder); the last, partly filled
page is copied per row (copy-on-write at the fork: a row only ever writes into its own pages). The pool of a forked
state holds the pages in use plus what every row may still write, so eight questions of one long context store the
context once.

A decode step reads the pages through the backend's ``paged_decode`` (the Pallas kernel reads them in place from
the pool; XLA and the reference gather them); a prefill chunk gathers a row's pages into the slot cache's view
(``[b, k, T * page, d]``, packed in position order) and runs the one attention core (``lcx.cache.kv_view``).
Positions are the original ones (keys rotated before they are stored). This cache keeps every token (the ``full``
policy); evicting policies run on ``lcx.cache.paged_slots``, the slot cache's eviction over the same pool.

``GenerateResult.cache_bytes`` of a paged state is the peak bytes of the pages in use (``peak`` pages x the bytes of
one page in every layer, keys and values), not the pool's size.

``cache.kv_dtype: int8 | fp8`` stores the pool as 8-bit codes with one float16 scale per slot and KV head
(``k_scale, v_scale [L, P, k, page]``, pages of their own beside the codes: :data:`SCALE_FIELDS`): a token's keys
and values are quantized when written (keys after RoPE, as the slot cache does), the decode kernel folds a page's
scales into its logits and probabilities, and a prefill chunk's gathered view carries codes and scales to the
attention core. A page's bytes count the scales.

Shape letters: L layers, P pool pages, b batch, T pages per row, g slots per page, k kv heads, d head dim.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import ClassVar

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from lcx import kernels
from lcx.cache.base import CacheCapacityError, CacheKind, CacheState, register_kind
from lcx.cache.kv_cache import full_overflow
from lcx.cache.kv_view import KVView, attend_view
from lcx.cache.schema import Field
from lcx.config_base import ConfigError
from lcx.kernels.paged_decode import gather_pages
from lcx.kernels.quant import SCALE_DTYPE, quantize, storage_dtype
from lcx.model.config import AttentionSpec, ModelConfig
from lcx.model.rope import apply_rope

POOL = ("layers", "pages", "kv_heads", "page", "head_dim")
FIELDS: Mapping[str, Field] = {
    "k": Field(POOL, "kv", 0, role="kv"),
    "v": Field(POOL, "kv", 0, role="kv"),
    "table": Field(("batch", "row_pages"), "int32", -1),  # page ids in position order; -1: none yet
    "refs": Field(("pages",), "int32", 0),  # rows holding each page; 0: free
    "peak": Field((), "int32", 0),  # the most pages in use at once
    "overflow": Field((), "bool", False),  # a make_room found too few free pages (raised by sync)
    "lengths": Field(("batch",), "int32", 0),  # tokens consumed per row (its next position)
}
# An 8-bit pool's scales (cache.kv_dtype; lcx.kernels.quant): one per slot of every page and KV head, KV bytes.
SCALE_FIELDS: Mapping[str, Field] = {
    "k_scale": Field(("layers", "pages", "kv_heads", "page"), SCALE_DTYPE, 0.0, role="kv"),
    "v_scale": Field(("layers", "pages", "kv_heads", "page"), SCALE_DTYPE, 0.0, role="kv"),
}


def scales_of(layer) -> dict[str, jax.Array]:
    """The scale pools of an 8-bit paged state or layer (``{}`` for a float one)."""
    return {n: getattr(layer, n) for n in SCALE_FIELDS if getattr(layer, n, None) is not None}


class PagePool:
    """What every paged state (``PagedCache``, ``lcx.cache.paged_slots.PagedSlotCache``) derives from its pool and
    tables: the capacity, the pool's size, the per-layer view and the byte counts."""

    @property
    def capacity(self) -> int:
        return self.table.shape[1] * self.shape_of("k")[3]

    @property
    def n_pages(self) -> int:
        return self.shape_of("k")[1]

    def layers(self):
        # the layer scan's carry keeps the table and the lengths before the call: every layer writes at them
        return super().layers().replace(table=self.table, lengths=self.lengths)

    def kv_bytes(self) -> int:
        """Peak bytes of the pages in use (the contract of ``GenerateResult.cache_bytes`` for a paged cache)."""
        return int(self.peak) * self.kind.page_nbytes()

    def pool_bytes(self) -> int:
        """Bytes of the whole pool (what the device holds, in use or free)."""
        return super().kv_bytes()


@flax.struct.dataclass
class PagedCache(PagePool, CacheState):
    """The buffers of :data:`FIELDS` (in the per-layer view ``k, v`` are one layer's pool; the table and lengths
    stay, read-only, so each layer can write and gather its pages)."""

    k: jax.Array  # [L, P, k, g, d]
    v: jax.Array
    table: jax.Array  # [b, T] int32
    refs: jax.Array | None  # [P] int32
    peak: jax.Array | None  # [] int32
    overflow: jax.Array | None  # [] bool
    lengths: jax.Array | None  # [b] int32
    k_scale: jax.Array | None = None  # [L, P, k, g] float16 (SCALE_FIELDS; None unless cache.kv_dtype is set)
    v_scale: jax.Array | None = None
    kind: "PagedKind" = flax.struct.field(pytree_node=False, default=None)


def refuse_windows(model: ModelConfig) -> None:
    """A ``ConfigError`` for a model with sliding-window layers: paged caches hold global layers only, for now."""
    windowed = [i for i, s in enumerate(model.attention_specs()) if s.window is not None]
    if windowed:
        raise ConfigError(f"cache.layout='paged' on a model with sliding-window layers {windowed[:8]}: not "
                          "supported yet; allowed: layout 'contiguous' (its sliding layers keep their window)")


def check_pool(state, page: int):
    """``state`` on the host after a call: a ``CacheCapacityError`` if a ``make_room`` found too few free pages."""
    if bool(state.overflow):
        raise CacheCapacityError(
            f"the paged cache ran out of pages: its pool holds {state.n_pages} pages of {page} tokens and "
            f"{int(jnp.sum(state.refs > 0))} are in use; plan the request with more pages (fork plans the pool from "
            "the tokens each row may still write)")
    return state


def grant(state, fill: jax.Array):
    """``state`` with a free page (in index order) put in every table entry ``fill [b, T]`` marks; too few free pages
    set ``overflow`` (raised by ``sync``). The peak of pages in use follows."""
    table, refs = state.table, state.refs
    pages = refs.shape[0]
    new = jnp.sum(fill, axis=1)
    start = jnp.cumsum(new) - new  # [b] each row's first free page among the free ones
    index = jnp.arange(pages)
    free_first = jnp.argsort(jnp.where(refs == 0, index, pages + index))  # free pages first, in index order
    rank = jnp.cumsum(fill, axis=1) - 1  # [b, T] the entry's rank among its row's new pages
    table = jnp.where(fill, free_first[jnp.clip(start[:, None] + rank, 0, pages - 1)], table)
    refs = refs.at[jnp.where(fill, table, pages)].add(1, mode="drop")
    overflow = state.overflow | (jnp.sum(new) > jnp.sum(state.refs == 0))
    return state.replace(table=table, refs=refs, peak=jnp.maximum(state.peak, jnp.sum(refs > 0)), overflow=overflow)


def grant_upto(state, want: jax.Array):
    """``state`` with row ``b`` holding its first ``want [b]`` table entries (capped at the table's width)."""
    j = jnp.arange(state.table.shape[1])[None, :]
    want = jnp.minimum(want, state.table.shape[1])[:, None]
    return grant(state, (j < want) & (state.table < 0))


def fork_pages(state, n, full: np.ndarray, reserve: np.ndarray):
    """The page pool of ``state`` (stacked) with each row ``r`` as ``n[r]`` consecutive rows (``n``: an int for every
    row, or one count per row): row ``r``'s first ``full[r]`` pages shared by its copies (``refs`` counting every
    holder), its other pages copied per copy (copy-on-write at the fork: a row only ever writes into its own pages),
    and ``reserve[r]`` pages per copy (its copies included) that the pool keeps for what it may still write. Returns
    the state with ``k, v, table, refs, peak, overflow, lengths`` replaced."""
    table = np.asarray(state.table)
    rows = table.shape[0]
    counts = np.broadcast_to(np.asarray(n, np.int64), (rows,))
    used = sorted({int(p) for r in range(rows) for p in table[r, :full[r]]})
    shared_pages = len(used)
    total = shared_pages + int(np.sum(counts * reserve))
    remap = np.full(state.n_pages + 1, -1, np.int64)
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
    gather = np.asarray(used + copies_src, np.int32)

    def pool(x):  # [L, P, ...] -> the shared pages, the private copies, then zeroed free pages
        kept = jnp.take(x, jnp.asarray(gather), axis=1)
        pad = jnp.zeros((x.shape[0], total - kept.shape[1], *x.shape[2:]), x.dtype)
        return jnp.concatenate([kept, pad], axis=1)

    stacked = state.stack_layers()
    lengths = np.repeat(np.asarray(state.lengths), counts).astype(np.int32)
    scales = {n: pool(x) for n, x in scales_of(stacked).items()}
    return stacked.replace(k=pool(stacked.k), v=pool(stacked.v), table=jnp.asarray(new_table), **scales,
                           refs=jnp.asarray(refs), lengths=jnp.asarray(lengths),
                           peak=jnp.asarray(np.int32((refs > 0).sum())), overflow=jnp.asarray(False))


@register_kind
@dataclasses.dataclass(frozen=True)
class PagedKind(CacheKind):
    """A paged cache that keeps every token. ``page``: slots per page; ``limit``: the most tokens per row
    (``cache.budget``), None for no limit; ``quant``: ``cache.kv_dtype`` (8-bit codes and per-slot scales)."""

    name: ClassVar[str] = "paged"
    state_type: ClassVar[type] = PagedCache

    model: ModelConfig
    page: int = 16
    dtype: str = "float32"
    limit: int | None = None
    quant: str | None = None

    @classmethod
    def from_config(cls, model, cache, policy) -> "PagedKind":
        if policy.evicts:
            raise ConfigError(f"PagedKind with cache.policy={cache.policy!r}: this kind keeps every token; allowed: "
                              "policy 'full' (CacheConfig(layout='paged').kind gives evicting policies a "
                              "lcx.cache.paged_slots.PagedSlotKind)")
        refuse_windows(model)
        return cls(model=model, page=cache.page_size, dtype=cache.dtype or model.dtype, limit=cache.max_budget,
                   quant=cache.kv_dtype)

    # ------------------------------------------------------------------------------------------- declaration
    def fields(self) -> Mapping[str, Field]:
        return {**FIELDS, **SCALE_FIELDS} if self.quant else FIELDS

    def sizes(self, batch: int, capacity: int) -> dict[str, int]:
        m, row_pages = self.model, -(-capacity // self.page)
        return {"layers": m.n_layers, "pages": batch * row_pages, "kv_heads": m.n_kv_heads, "page": self.page,
                "head_dim": m.head_dim, "batch": batch, "row_pages": row_pages}

    @property
    def kv_dtype(self) -> str:
        return self.dtype if self.quant is None else storage_dtype(self.quant)

    # ------------------------------------------------------------------------------------------- planning
    def plan(self, batch: int, max_prompt: int, max_new_tokens: int) -> int:
        needed = max_prompt + max_new_tokens
        if self.limit is not None and needed > self.limit:
            raise full_overflow(self.model, needed, self.limit, batch, max_prompt, max_new_tokens, self.dtype)
        return -(-needed // self.page) * self.page

    def pages_for(self, batch: int, tokens: int, shared: int = 0) -> int:
        """Pages ``batch`` sequences of ``tokens`` tokens hold when their first ``shared`` tokens are one prefix:
        its whole pages once, the rest per sequence (the planner's figure)."""
        common = shared // self.page
        return common + batch * (-(-tokens // self.page) - common)

    def page_nbytes(self) -> int:
        """Bytes of one page in every layer, keys and values."""
        return self.nbytes(1, self.page)

    # ------------------------------------------------------------------------------------------- attention
    def attend(self, layer: PagedCache, q, key, val, *, cos, sin, positions, ok, stat_weights,
               spec: AttentionSpec | None = None):
        spec = spec or self.model.attention_specs()[0]
        q, key = apply_rope(q, cos, sin), apply_rope(key, cos, sin)
        pages, page = layer.k.shape[0], self.page
        # write: position p of row b -> slot p % g of page table[b, p // g]; padding goes out of range (dropped)
        ids = jnp.take_along_axis(layer.table, jnp.clip(positions // page, 0, layer.table.shape[1] - 1), axis=1)
        ids = jnp.where(ok & (ids >= 0), ids, pages)  # [b, t]
        slot = positions % page
        put = lambda pool, x: pool.at[ids, :, slot].set(x.astype(pool.dtype), mode="drop")  # noqa: E731
        scales = {}
        if self.quant is not None:  # 8-bit codes, and each token's scale per KV head into the scale pages
            (key, k_scale), (val, v_scale) = quantize(key, self.quant), quantize(val, self.quant)
            scales = dict(k_scale=put(layer.k_scale, k_scale), v_scale=put(layer.v_scale, v_scale))
        k_pool, v_pool = put(layer.k, key), put(layer.v, val)
        # read: each row's pages gathered in position order, the slot cache's [b, k, T * g, d] view
        gather = lambda pool: gather_pages(pool, layer.table)  # noqa: E731
        before = layer.lengths
        after = before + jnp.sum(ok, axis=1, dtype=jnp.int32)
        impl = self.model.attention.impl
        if q.shape[1] == 1:  # decode: the backend reads the pages (Pallas: in place; others: gathered)
            extra = {n: x for n, x in kernels.spec_kwargs(spec).items() if n != "window"}
            out = kernels.backend(impl).paged_decode(q[:, 0], k_pool, v_pool, table=layer.table, lengths=after,
                                                     sm_scale=spec.sm_scale, **extra, **scales).out[:, None]
        else:  # a prefill chunk: the gathered view through the attention core
            view = KVView(k=gather(k_pool), v=gather(v_pool), lengths=after, offsets=before,
                          **{n: gather(x) for n, x in scales.items()})
            out = attend_view(impl, q, view, spec).out
        return out, layer.replace(k=k_pool, v=v_pool, **scales)

    # ------------------------------------------------------------------------------------------- between calls
    def make_room(self, state: PagedCache, n) -> PagedCache:
        """Give every row the pages its next ``n`` tokens need (free pages in index order)."""
        return grant_upto(state, -(-(state.lengths + n) // self.page))

    def sync(self, state: PagedCache) -> PagedCache:
        return check_pool(state, self.page)

    # ------------------------------------------------------------------------------------------- sharing
    def fork(self, state: PagedCache, n: int) -> PagedCache:
        """Each row of ``state`` as ``n`` consecutive rows sharing its full pages; see the module docstring. The
        new pool holds the pages in use and every page the rows may still fill (up to the table's width)."""
        full = np.asarray(state.lengths) // self.page  # pages every copy shares; a partly filled last one is copied
        return fork_pages(state, n, full, state.table.shape[1] - full)


__all__ = ["FIELDS", "SCALE_FIELDS", "PagePool", "PagedCache", "PagedKind", "check_pool", "fork_pages", "grant",
           "grant_upto", "refuse_windows", "scales_of"]
