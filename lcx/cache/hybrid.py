"""The cache of a model with sliding-window layers: a bounded cache for its local layers, the request's for the rest.

The global layers' cache is the requested policy's own cache type: the slot cache, or the memory tier (working
memory + long-term blocks, ``policy: memory``); host-side work (a host store's ``open`` / ``sync`` / ``close``,
saving and restoring it) is that cache's.

A sliding-window layer never reads a key ``window`` or more positions before its query, so it need not keep one:
the local layers get a slot cache of their own (``KVCache`` stacked over the local layers only) under the ``window``
policy with budget ``window - 1``. Before ``n`` new tokens go into a full one it keeps the ``window - 1`` newest,
compacted to the front, so it holds ``window - 1 + room`` slots (or the request, when that is shorter) however long
the sequence grows; ``room`` (``local_room``) is the larger of ``cache.interval`` and a prefill chunk of up to one
window, so prompts are prefilled in window-sized calls rather than interval-sized ones. The global layers keep a
slot cache under the requested policy (``full``: every token; an evicting policy: its budget, with the policy's
statistics - the local layers have none). A local layer's kept slots are consecutive positions in order, so the
kernels' slot-based window is the positional one.

Layer ``i`` of the model is entry ``where[i]`` of its group. In the unrolled decoder (a Python ``i``) a layer's view
holds its own group only; in the layer scan (a traced ``i``) it holds one layer of each group and both are written
back, and ``attend`` serves the group of the layer's spec, static in each branch of the spec switch.

Shape letters: L layers, b batch, C slots, k kv heads, d head dim.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from lcx.parallel import sharding
from lcx.cache.base import AUTO_PREFILL_CHUNK, CacheKind, CacheState, kind_class, register_kind
from lcx.cache.kv_cache import FIELDS, KVCache, SlotCacheKind
from lcx.cache.policy import make_policy
from lcx.cache.schema import Field
from lcx.model.config import ModelConfig

GLOBAL, LOCAL = "glob", "loc"


def local_budget(window: int) -> int:
    """The slots a sliding-window layer keeps after a compaction: what the next query sees besides itself."""
    return max(window - 1, 1)


def local_room(window: int, interval: int, prefill_chunk: int | None) -> int:
    """The slots a sliding-window layer keeps beyond ``window - 1``: the most tokens one call appends before it
    compacts. At least ``interval`` (decode steps between compactions) and, so that a long prompt is not prefilled
    in interval-sized calls, a prefill chunk of up to one window (``prefill_chunk``: the requested chunk; None:
    auto)."""
    return max(interval, min(window, prefill_chunk or AUTO_PREFILL_CHUNK))


@flax.struct.dataclass
class HybridCache(CacheState):
    """``glob``: the global layers' cache (a slot cache or the memory tier; None when every layer is local), ``loc``:
    the local layers' bounded slot cache; ``planned``: the capacity the request was planned for."""

    glob: CacheState | None
    loc: KVCache | None
    lengths: jax.Array | None  # [b] int32 (None in the per-layer view)
    kind: "HybridKind" = flax.struct.field(pytree_node=False, default=None)
    planned: int = flax.struct.field(pytree_node=False, default=0)

    @property
    def capacity(self) -> int:
        return self.planned

    def _groups(self, fn) -> dict[str, Any]:
        return {g: None if getattr(self, g) is None else fn(getattr(self, g)) for g in (GLOBAL, LOCAL)}

    def layers(self) -> "HybridCache":
        return self.replace(lengths=None, **self._groups(lambda c: c.layers()))

    def with_layers(self, layers: "HybridCache", lengths: jax.Array) -> "HybridCache":
        groups = {g: None if getattr(self, g) is None else getattr(self, g).with_layers(getattr(layers, g), lengths)
                  for g in (GLOBAL, LOCAL)}
        return self.replace(lengths=lengths, **groups)

    @property
    def split(self) -> bool:
        return any(c.split for c in (self.glob, self.loc) if c is not None)

    def split_layers(self) -> "HybridCache":
        return self.replace(**self._groups(lambda c: c.split_layers()))

    def stack_layers(self) -> "HybridCache":
        return self.replace(**self._groups(lambda c: c.stack_layers()))

    def _index(self, i) -> dict[str, Any]:
        """Model layer ``i`` -> its index in each group it touches: its own group only for a static ``i``, every
        present group for a traced one (0 in the group it is not in: read and written back unchanged)."""
        where = self.kind.where
        if isinstance(i, int):
            group, j = where[i]
            return {group: j}
        return {g: jnp.asarray([j if group == g else 0 for group, j in where], jnp.int32)[i]
                for g in (GLOBAL, LOCAL) if getattr(self, g) is not None}

    def layer(self, i) -> "HybridCache":
        """Layer ``i``'s view: its group's layer (static ``i``), or one layer of each group (traced ``i``)."""
        index = self._index(i)
        return self.replace(lengths=None, **{g: getattr(self, g).layer(index[g]) if g in index else None
                                             for g in (GLOBAL, LOCAL)})

    def set_layer(self, i, layer: "HybridCache") -> "HybridCache":
        return self.replace(**{g: getattr(self, g).set_layer(j, getattr(layer, g)) for g, j in self._index(i).items()})

    def buffers(self) -> dict[str, jax.Array]:
        out = {"lengths": self.lengths}
        for g in (GLOBAL, LOCAL):
            if getattr(self, g) is not None:
                out |= {f"{g}.{n}": x for n, x in getattr(self, g).buffers().items() if n != "lengths"}
        return out

    def kv_bytes(self) -> int:
        return sum(c.kv_bytes() for c in (self.glob, self.loc) if c is not None)

    def metadata_bytes(self) -> int:
        return sum(c.metadata_bytes() for c in (self.glob, self.loc) if c is not None)


@register_kind
@dataclasses.dataclass(frozen=True)
class HybridKind(CacheKind):
    """What ``CacheConfig.kind`` builds for a slot-cache or memory policy on a model with sliding-window layers (see
    the module docstring): the policy runs on the global layers, the local ones keep their window."""

    name: ClassVar[str] = "hybrid"
    state_type: ClassVar[type] = HybridCache

    model: ModelConfig
    glob: CacheKind | None  # the policy's own cache type over the global layers (slots or memory)
    loc: SlotCacheKind
    where: tuple[tuple[str, int], ...]  # per model layer: (group, index in the group)

    @classmethod
    def from_config(cls, model, cache, policy) -> "HybridKind":
        specs = model.attention_specs()
        where, counts = [], {GLOBAL: 0, LOCAL: 0}
        for spec in specs:
            group = GLOBAL if spec.window is None else LOCAL
            where.append((group, counts[group]))
            counts[group] += 1
        windows = {s.window for s in specs if s.window is not None}
        sub = lambda n: dataclasses.replace(model, n_layers=n, layer_types=None, sliding_window=None,  # noqa: E731
                                            local_rope=None)
        glob = (kind_class(policy.cache_type).from_config(sub(counts[GLOBAL]), cache, policy) if counts[GLOBAL]
                else None)
        budget = local_budget(max(windows))
        loc = SlotCacheKind(model=sub(counts[LOCAL]), policy=make_policy("window"), budgets=(budget,) * counts[LOCAL],
                            dtype=cache.dtype or model.dtype,
                            interval=local_room(max(windows), cache.interval, cache.prefill_chunk))
        return cls(model=model, glob=glob, loc=loc, where=tuple(where))

    # ------------------------------------------------------------------------------------------- declaration
    def fields(self) -> Mapping[str, Field]:
        return FIELDS  # each group's; the state is composed in ``abstract`` / ``create``

    def sizes(self, batch: int, capacity: int) -> Mapping[str, int]:
        return self.loc.sizes(batch, self.local_capacity(capacity))

    @property
    def kv_dtype(self) -> str:
        return self.loc.kv_dtype

    def local_capacity(self, capacity: int) -> int:
        """The local layers' slots for a request planned at ``capacity``: the window's share, or the request when it
        is shorter (known only when the global layers keep everything: then ``capacity`` is the request)."""
        share = max(self.loc.head_budgets) + self.loc.interval
        # a slot cache with a budget plans its budget, not the request; the memory tier plans the request
        bounded = isinstance(self.glob, SlotCacheKind) and self.glob.budgets is not None
        return share if bounded else min(capacity, share)

    @property
    def decode_segment(self) -> int | None:
        return None if self.glob is None else self.glob.decode_segment

    # ------------------------------------------------------------------------------------------- planning
    def plan(self, batch: int, max_prompt: int, max_new_tokens: int) -> int:
        self.loc.plan(batch, max_prompt, max_new_tokens)
        if self.glob is None:
            return max_prompt + max_new_tokens
        return self.glob.plan(batch, max_prompt, max_new_tokens)

    # Both groups' limits hold: a chunk fits the room an eviction frees in either.
    def prefill_chunk(self, requested: int, max_len: int, capacity: int) -> int:
        chunk = self.loc.prefill_chunk(requested, max_len, self.local_capacity(capacity))
        return chunk if self.glob is None else min(chunk, self.glob.prefill_chunk(requested, max_len, capacity))

    def prefill_weights(self, lengths: np.ndarray, width: int) -> np.ndarray | None:
        return None if self.glob is None else self.glob.prefill_weights(lengths, width)

    @staticmethod
    def _least(*values):
        known = [v for v in values if v is not None]
        return min(known) if known else None

    def score_width(self, tokens: int) -> int | None:
        return self._least(self.loc.score_width(tokens), self.glob and self.glob.score_width(tokens))

    def score_room(self, state: HybridCache) -> int | None:
        return self._least(self.loc.score_room(state.loc), self.glob and self.glob.score_room(state.glob))

    def score_weights(self, n: int, width: int, batch: int) -> np.ndarray | None:
        return None if self.glob is None else self.glob.score_weights(n, width, batch)

    # ------------------------------------------------------------------------------------------- derived
    def _compose(self, make, batch: int, capacity: int, lengths) -> HybridCache:
        glob = None if self.glob is None else make(self.glob, batch, capacity)
        return HybridCache(glob=glob, loc=make(self.loc, batch, self.local_capacity(capacity)), lengths=lengths,
                           kind=self, planned=capacity)

    def abstract(self, batch: int, capacity: int) -> HybridCache:
        return self._compose(lambda k, b, c: k.abstract(b, c), batch, capacity,
                             jax.ShapeDtypeStruct((batch,), jnp.int32))

    def create(self, batch: int, capacity: int) -> HybridCache:
        if capacity <= 0 or batch <= 0:
            raise ValueError(f"{capacity=} and {batch=} must be positive")
        return self._compose(lambda k, b, c: k.create(b, c), batch, capacity, jnp.zeros((batch,), jnp.int32))

    def nbytes(self, batch: int, capacity: int, role: str | None = "kv") -> int:
        glob = 0 if self.glob is None else self.glob.nbytes(batch, capacity, role)
        return glob + self.loc.nbytes(batch, self.local_capacity(capacity), role)

    def shardings(self, state: HybridCache, mesh) -> HybridCache:
        lengths = sharding.named_sharding(("batch",), state.lengths.shape, mesh, "cache lengths")
        return state.replace(lengths=lengths, **{g: None if getattr(state, g) is None else
                                                 getattr(self, g).shardings(getattr(state, g), mesh)
                                                 for g in (GLOBAL, LOCAL)})

    def layer_axes(self) -> HybridCache:
        return HybridCache(glob=None if self.glob is None else self.glob.layer_axes(), loc=self.loc.layer_axes(),
                           lengths=None, kind=self)

    @property
    def shardable(self) -> bool:
        return True

    @property
    def reconstructable(self) -> bool:
        """The global layers' slots are scored by the pass; the local ones read it into a padded copy (``attend``)."""
        return self.glob is not None and self.glob.reconstructable

    @property
    def policy(self):
        """The requested policy - the global layers' (the local ones keep their window)."""
        return self.loc.policy if self.glob is None else self.glob.policy

    # ------------------------------------------------------------------------------------------- in the model
    def attend(self, layer: HybridCache, q, key, val, *, cos, sin, positions, ok, stat_weights, spec=None,
               probe=None):
        """The layer's group attends (and appends). With a ``probe`` (a reconstruction pass, ``lcx.cache
        .reconstruct``) a global layer scores its slots without appending, and a local layer reads its window and
        the pass as a prefill chunk would, into a copy with room for the pass: the local slots stay as they were."""
        if spec is None:
            raise ValueError("a hybrid (sliding-window) cache needs the layer's AttentionSpec")
        group = GLOBAL if spec.window is None else LOCAL
        if probe is not None and group == LOCAL:
            out, _ = self.loc.attend(with_room(getattr(layer, LOCAL), q.shape[1]), q, key, val, cos=cos, sin=sin,
                                     positions=positions, ok=ok, stat_weights=None, spec=spec)
            return out, layer
        extra = {} if probe is None else {"probe": probe}
        out, new = getattr(self, group).attend(getattr(layer, group), q, key, val, cos=cos, sin=sin,
                                               positions=positions, ok=ok, stat_weights=stat_weights, spec=spec,
                                               **extra)
        return out, layer.replace(**{group: new})

    # ------------------------------------------------------------------------------------------- between calls
    def _each(self, state: HybridCache, fn) -> HybridCache:
        return state.replace(**{g: None if getattr(state, g) is None else fn(getattr(self, g), getattr(state, g))
                                for g in (GLOBAL, LOCAL)})

    def evict(self, state: HybridCache):
        if self.glob is None:
            return state.replace(loc=self.loc.evict(state.loc)[0]), None
        glob, left = self.glob.evict(state.glob)  # what the global layers removed (a store takes it)
        return state.replace(glob=glob, loc=self.loc.evict(state.loc)[0]), left

    def make_room(self, state: HybridCache, n) -> HybridCache:
        return self._each(state, lambda k, s: k.make_room(s, n))

    def observe_tokens(self, state: HybridCache, input_ids, ok) -> HybridCache:
        return self._each(state, lambda k, s: k.observe_tokens(s, input_ids, ok))

    def end_prefill(self, state: HybridCache) -> HybridCache:
        return self._each(state, lambda k, s: k.end_prefill(s))

    @property
    def can_fork(self) -> bool:
        return all(getattr(self, g) is None or getattr(self, g).can_fork for g in (GLOBAL, LOCAL))

    def fork(self, state: HybridCache, n: int) -> HybridCache:
        return state.replace(lengths=jnp.repeat(state.lengths, n), **{
            g: None if getattr(state, g) is None else getattr(self, g).fork(getattr(state, g), n)
            for g in (GLOBAL, LOCAL)})

    def scoring(self) -> "HybridKind":
        return self if self.glob is None else dataclasses.replace(self, glob=self.glob.scoring())

    # ------------------------------------------------------------------------------------------- host resources
    # The local layers' slot cache has none: these are the global cache's (a memory tier's host or disk store).
    def sync(self, state: HybridCache) -> HybridCache:
        return state if self.glob is None else state.replace(glob=self.glob.sync(state.glob))

    def open(self, state: HybridCache):
        if self.glob is None:
            return state, None
        glob, handle = self.glob.open(state.glob)
        return state.replace(glob=glob), handle

    def close(self, handle) -> None:
        if self.glob is not None:
            self.glob.close(handle)

    def store_bytes(self, state: HybridCache) -> int:
        return 0 if self.glob is None else self.glob.store_bytes(state.glob)

    def store_nbytes(self, batch: int, capacity: int) -> int:
        return 0 if self.glob is None else self.glob.store_nbytes(batch, capacity)

    def save_host(self, state: HybridCache, path) -> None:
        if self.glob is not None:
            self.glob.save_host(state.glob, path)

    def restore_host(self, state: HybridCache, path):
        if self.glob is None:
            return state, None
        glob, handle = self.glob.restore_host(state.glob, path)
        return state.replace(glob=glob), handle


def with_room(layer: KVCache, n: int) -> KVCache:
    """One layer's view of a slot cache (no ``layers`` axis) with ``n`` empty slots after its own: every buffer
    with a ``length`` axis padded with its declared empty value."""
    fields = layer.kind.fields()  # the storage's buffers and the slots' metadata
    grown = {}
    for name, field in fields.items():
        x = getattr(layer, name, None)
        if x is None or "length" not in field.axes:
            continue
        widths = [(0, 0)] * x.ndim
        widths[field.axes.index("length") - 1] = (0, n)  # the per-layer view drops the leading "layers" axis
        grown[name] = jnp.pad(x, widths, constant_values=field.fill)
    return layer.replace(**grown)


__all__ = ["HybridCache", "HybridKind", "local_budget", "local_room", "with_room"]
