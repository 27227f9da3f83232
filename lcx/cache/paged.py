"""The paged KV cache (``CacheConfig(layout="paged", page_size=16)``): a pool of fixed-size pages shared by the rows.

Per layer the keys and values live in one pool ``[P, k, page, d]`` (each page in the slot cache's ``[kv_head, slot,
head_dim]`` layout); a row's ``table [T]`` lists its pages in position order (-1: none yet), so position ``p`` of row
``b`` is slot ``p % page`` of page ``table[b, p // page]``. ``refs [P]`` counts the holders of each page (0: free).
The bookkeeping (table, refs, peak, overflow) is a ``lcx.cache.page_pool.PagePool`` (``state.pool``), and every
change to it goes through that module's functions. ``make_room`` (jitted, before every model call) gives each row the
pages its next tokens need, taking free pages in index order; a request the pool cannot serve sets ``overflow``,
which ``sync`` (on the host, after the call) raises as a ``CacheCapacityError`` - the planner sizes the pool so that
it never happens.

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
(``k_scale, v_scale [L, P, k, page]``, pages beside the codes: ``ScaledStorage.page_fields``): a token's keys
and values are quantized when written (keys after RoPE, as the slot cache does), the decode kernel folds a page's
scales into its logits and probabilities, and a prefill chunk's gathered view carries codes and scales to the
attention core. A page's bytes count the scales.

Shape letters: L layers, P pool pages, b batch, T pages per row, g slots per page, k kv heads, d head dim.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import ClassVar

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from lcx import kernels
from lcx.cache import page_pool, schema
from lcx.cache.base import CacheKind, CacheState, register_kind
from lcx.cache.kv_cache import full_overflow
from lcx.cache.kv_view import KVView, attend_view
from lcx.cache.schema import Field
from lcx.cache.storage import KVStorage, namespace, storage_of
from lcx.config_base import ConfigError
from lcx.kernels.paged_decode import gather_pages
from lcx.model.config import AttentionSpec, ModelConfig
from lcx.model.rope import apply_rope
from lcx.parallel import sharding
from lcx.parallel.sharding import BSKD, BT, BTHD, per_shard

FIELDS: Mapping[str, Field] = {
    **KVStorage().page_fields(),  # float pages (the storage declares its own)
    **page_pool.FIELDS,  # table, refs, peak, overflow: the pool's bookkeeping
    "lengths": Field(("batch",), "int32", 0),  # tokens consumed per row (its next position)
}
POOL_META = ("table", "refs", "peak", "overflow", "lengths")  # beside the storage's pages


@flax.struct.dataclass
class PagedState(CacheState):
    """The buffers every paged state (``PagedCache``, ``lcx.cache.paged_slots.PagedSlotCache``) starts with - the
    pages and the pool's bookkeeping (``lcx.cache.page_pool``) - and what derives from them: the capacity, the pool's
    size, the per-layer view and the byte counts. Subclasses add ``lengths``, their own buffers and ``kind`` (after
    these fields, so the pytree's leaves keep their order)."""

    k: jax.Array  # [L, P, k, g, d]
    v: jax.Array
    table: jax.Array  # [b, T] int32
    refs: jax.Array | None  # [P] int32 (None in the per-layer view, as are peak and overflow)
    peak: jax.Array | None  # [] int32
    overflow: jax.Array | None  # [] bool

    @property
    def pool(self) -> page_pool.PagePool:
        """The pool's bookkeeping (table, refs, peak, overflow) as one ``PagePool``."""
        return page_pool.PagePool(**{n: getattr(self, n) for n in page_pool.FIELDS})

    def with_pool(self, pool: page_pool.PagePool):
        """This state with the bookkeeping of ``pool`` (the pages' contents unchanged)."""
        return self.replace(**{n: getattr(pool, n) for n in page_pool.FIELDS})

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
        """Peak bytes of the pages in use (the contract of ``GenerateResult.cache_bytes`` for a paged cache), and
        the key / value buffers each row holds outside the pool (a bit-packed cache's float window)."""
        return int(self.peak) * self.kind.page_nbytes() + self._row_kv_bytes()

    def held_bytes(self) -> int:
        """Bytes of the pages held now (a shared page once) and the rows' buffers outside the pool: what a context
        compressed once (KVzip, then ``fork``) keeps, where ``kv_bytes`` reports the peak of its prefill."""
        return int(self.pool.in_use()) * self.kind.page_nbytes() + self._row_kv_bytes()

    def _row_kv_bytes(self) -> int:
        fields = self.kind.fields()
        return int(sum(x.size * x.dtype.itemsize for n, x in self.buffers().items()
                       if fields[n].role == "kv" and "pages" not in fields[n].axes))

    def pool_bytes(self) -> int:
        """Bytes of the whole pool (what the device holds, in use or free)."""
        return super().kv_bytes()


@flax.struct.dataclass
class PagedCache(PagedState):
    """The buffers of ``FIELDS`` (in the per-layer view ``k, v`` are one layer's pool; the table and lengths
    stay, read-only, so each layer can write and gather its pages)."""

    lengths: jax.Array | None  # [b] int32
    k_scale: jax.Array | None = None  # [L, P, k, g] float16 (an 8-bit storage's scale pages)
    v_scale: jax.Array | None = None
    kind: "PagedKind" = flax.struct.field(pytree_node=False, default=None)


def refuse_windows(model: ModelConfig) -> None:
    """A ``ConfigError`` for a model with sliding-window layers: paged caches hold global layers only, for now."""
    windowed = [i for i, s in enumerate(model.attention_specs()) if s.window is not None]
    if windowed:
        raise ConfigError(f"cache.layout='paged' on a model with sliding-window layers {windowed[:8]}: not "
                          "supported yet; allowed: layout 'contiguous' (its sliding layers keep their window)")


def check_pool_mesh(mesh) -> None:
    """Raise ``ConfigError`` for a mesh a paged cache cannot use: rows over ``data`` would write the pages of one
    pool from several devices (a pool per data shard is not built yet); KV heads over ``model`` is what it does."""
    data = sharding.axis_size(mesh, "data")
    if data > 1:
        raise ConfigError(f"mesh data={data}: a paged cache (cache.layout='paged') splits its pool by KV head over "
                          "'model' only; use data=1 with model = the device count (tensor parallel), or the "
                          "contiguous layout to split rows over data")


def create(kind: CacheKind, batch: int, capacity: int, pages: int) -> PagedState:
    """An empty paged state of ``batch`` rows of ``capacity`` slots over a pool of ``pages`` pages (``kind.create``
    sizes the pool at every row's whole capacity; the server sizes it on its own)."""
    if min(batch, capacity, pages) <= 0:
        raise ConfigError(f"paged create: batch={batch}, capacity={capacity} and pages={pages} must be positive")
    sizes = {**kind.sizes(batch, capacity), "pages": pages}
    return kind.state_type(kind=kind, **schema.empty(kind.fields(), sizes, kind.kv_dtype))


def fork_pages(state: PagedState, n, full: np.ndarray, reserve: np.ndarray):
    """``state`` (stacked) with each row ``r`` as ``n[r]`` consecutive rows (``page_pool.fork``: its first
    ``full[r]`` pages shared, the others copied per copy, ``reserve[r]`` pages per copy planned) and the pages moved
    to the new pool. Returns the state with every pool buffer (``k, v``, scales), the pool and ``lengths``
    replaced."""
    pool, source = page_pool.fork(state.pool, n, full, reserve)
    stacked = state.stack_layers()
    move = lambda x: page_pool.take_pages(x, source, pool.n_pages)  # noqa: E731
    counts = np.broadcast_to(np.asarray(n, np.int64), (state.table.shape[0],))
    lengths = np.repeat(np.asarray(state.lengths), counts).astype(np.int32)
    pooled = [n for n, f in state.kind.fields().items() if f.axes[:2] == ("layers", "pages")]  # k, v, scales
    return stacked.replace(**{n: move(getattr(stacked, n)) for n in pooled},
                           lengths=jnp.asarray(lengths)).with_pool(pool)


@register_kind
@dataclasses.dataclass(frozen=True)
class PagedKind(CacheKind):
    """A paged cache that keeps every token. ``page``: slots per page; ``limit``: the most tokens per row
    (``cache.budget``), None for no limit; ``storage``: how the pages hold keys and values
    (``lcx.cache.storage``; None: floats in ``dtype``)."""

    name: ClassVar[str] = "paged"
    state_type: ClassVar[type] = PagedCache

    model: ModelConfig
    page: int = 16
    dtype: str = "float32"
    limit: int | None = None
    storage: KVStorage | None = None

    def __post_init__(self):
        if self.storage is None:
            object.__setattr__(self, "storage", KVStorage(dtype=self.dtype))
        self.storage.check(self.model.head_dim)

    @classmethod
    def from_config(cls, model, cache, policy) -> "PagedKind":
        if policy.evicts:
            raise ConfigError(f"PagedKind with cache.policy={cache.policy!r}: this kind keeps every token; allowed: "
                              "policy 'full' (CacheConfig(layout='paged').kind gives evicting policies a "
                              "lcx.cache.paged_slots.PagedSlotKind)")
        refuse_windows(model)
        dtype = cache.dtype or model.dtype
        return cls(model=model, page=cache.page_size, dtype=dtype, limit=cache.max_budget,
                   storage=storage_of(cache, dtype))

    # ------------------------------------------------------------------------------------------- declaration
    def fields(self) -> Mapping[str, Field]:
        return {**self.storage.page_fields(), **{n: FIELDS[n] for n in POOL_META}}

    def sizes(self, batch: int, capacity: int) -> dict[str, int]:
        m, row_pages = self.model, -(-capacity // self.page)
        return {"layers": m.n_layers, "pages": batch * row_pages, "kv_heads": m.n_kv_heads, "page": self.page,
                "head_dim": m.head_dim, "batch": batch, "row_pages": row_pages,
                **self.storage.page_sizes(m.head_dim, self.page)}

    @property
    def kv_dtype(self) -> str:
        return self.storage.buffer_dtype

    @property
    def shares_pages(self) -> bool:
        return True  # rows' tables may name the same full pages (reference counts in ``refs``)

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
    @property
    def shardable(self) -> bool:
        return True  # the pool's pages split by KV head over "model"; ``check_mesh`` refuses a "data" axis

    def check_mesh(self, mesh) -> None:
        check_pool_mesh(mesh)

    def layer_axes(self) -> PagedCache:
        # the per-layer view keeps the table and the lengths (``PagedState.layers``): they enter the shard too
        return super().layer_axes().replace(table=FIELDS["table"].axes, lengths=FIELDS["lengths"].axes)

    def attend(self, layer: PagedCache, q, key, val, *, cos, sin, positions, ok, stat_weights,
               spec: AttentionSpec | None = None):
        spec = spec or self.model.attention_specs()[0]
        q, key = apply_rope(q, cos, sin), apply_rope(key, cos, sin)
        # on a mesh: once per shard of KV heads (each device writes and reads its heads' pages, no collective)
        axes = self.layer_axes()
        core = functools.partial(self._attend_pages, spec=spec)
        core.__name__ = "paged_attend"
        return per_shard(core, (axes, BTHD, BSKD, BSKD, BT, BT), (BTHD, axes))(layer, q, key, val, positions, ok)

    def _attend_pages(self, layer: PagedCache, q, key, val, positions, ok, *, spec: AttentionSpec):
        pages, page = layer.k.shape[0], self.page
        # write: position p of row b -> slot p % g of page table[b, p // g]; padding goes out of range (dropped)
        ids = jnp.take_along_axis(layer.table, jnp.clip(positions // page, 0, layer.table.shape[1] - 1), axis=1)
        ids = jnp.where(ok & (ids >= 0), ids, pages)  # [b, t]
        slot = positions % page
        put = lambda pool, x: pool.at[ids, :, slot].set(x.astype(pool.dtype), mode="drop")  # noqa: E731
        # each token's buffers (codes and their scales, or values) into its page slot
        pools = {n: put(getattr(layer, n), x) for n, x in self.storage.encode(key, val).items()}
        before = layer.lengths
        after = before + jnp.sum(ok, axis=1, dtype=jnp.int32)
        impl = self.model.attention.impl
        if q.shape[1] == 1:  # decode: the backend reads the pages (Pallas: in place; others: gathered)
            extra = {n: x for n, x in kernels.spec_kwargs(spec).items() if n != "window"}
            out = self.storage.paged_decode(kernels.backend(impl), q[:, 0], pools, table=layer.table, lengths=after,
                                            sm_scale=spec.sm_scale, extra=extra).out[:, None]
        else:  # a prefill chunk: each row's pages gathered in position order, the slot cache's [b, k, T * g, d]
            gathered = namespace(**{n: gather_pages(x, layer.table) for n, x in pools.items()})
            kv = self.storage.view(gathered, q.dtype, impl=impl, queries=q.shape[1], counted=False, codes=True)
            out = attend_view(impl, q, KVView(kv=kv, lengths=after, offsets=before), spec).out
        return out, layer.replace(**pools)

    # ------------------------------------------------------------------------------------------- between calls
    def make_room(self, state: PagedCache, n) -> PagedCache:
        """Give every row the pages its next ``n`` tokens need (free pages in index order)."""
        return state.with_pool(page_pool.grant_upto(state.pool, -(-(state.lengths + n) // self.page)))

    def sync(self, state: PagedCache) -> PagedCache:
        page_pool.check(state.pool, self.page)
        return state

    # ------------------------------------------------------------------------------------------- sharing
    def fork(self, state: PagedCache, n: int) -> PagedCache:
        """Each row of ``state`` as ``n`` consecutive rows sharing its full pages; see the module docstring. The
        new pool holds the pages in use and every page the rows may still fill (up to the table's width)."""
        full = np.asarray(state.lengths) // self.page  # pages every copy shares; a partly filled last one is copied
        return fork_pages(state, n, full, state.table.shape[1] - full)


__all__ = ["FIELDS", "POOL_META", "PagedCache", "PagedKind", "PagedState", "check_pool_mesh", "create",
           "fork_pages",
           "refuse_windows"]
