"""The slot cache: fixed-capacity key/value slots per layer with an eviction policy (``cache_type = "slots"``).

Per layer and sequence it holds ``capacity`` slots of keys and values; per layer, sequence and *keep head* the
original token position of each slot, a live-slot mask, a per-slot policy statistic and the number of occupied
slots. Occupied slots are packed at the front in position order (eviction compacts survivors back to the front);
``lengths`` counts the tokens each sequence has consumed (its next position). Shapes are static under jit: eviction
changes masks and contents, never shapes.

Keys and values are stored ``[b, k, C, d]`` (each KV head's slots contiguous): the decode step contracts over them
in that layout without a copy; with the slots before the heads XLA:CPU transposed every layer's keys and values on
every step (8 KV heads, 640 slots, batch 8: 2.96 -> 0.60 ms per layer).

Keep heads: the KV heads that keep their own set of tokens. With ``H = 1`` every KV head of a layer keeps the same
positions (structured policies such as StreamingLLM and the LaCache ladder); with ``H = kv_heads`` each head keeps
its own (per-head selection as in SnapKV and kvpress). Keys and values are always per KV head.

Shape letters: L layers, b batch, C capacity (slots), t new tokens, H keep heads, k kv heads, d head dim.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping
from typing import ClassVar

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from lcx.cache import reconstruct, slot_attention
from lcx.cache.base import (AUTO_PREFILL_CHUNK, CacheCapacityError, CacheKind, CacheState, register_kind,
                            round_chunk)
from lcx.cache.observes import QUERY_FIELDS  # noqa: F401 - re-exported: the buffers of the query moments
from lcx.cache.policy import EvictionPolicy, make_policy
from lcx.cache.schedule import evict_cache, layer_budgets
from lcx.cache.schema import Field
from lcx.cache.storage import KVStorage, storage_named, storage_of
from lcx.config_base import ConfigError, canonical_dtype, format_bytes
from lcx.model.config import ModelConfig
from lcx.parallel.sharding import BSKD, ROWS, per_shard

FIELDS: Mapping[str, Field] = {
    **KVStorage().slot_fields(),  # float keys and values (the storage declares its own)
    "pos": Field(("layers", "batch", "keep_heads", "length"), "int32", -1),  # original position; -1 when empty
    "valid": Field(("layers", "batch", "keep_heads", "length"), "bool", False),  # live slots
    "count": Field(("layers", "batch", "keep_heads"), "int32", 0),  # occupied slots
    "score": Field(("layers", "batch", "keep_heads", "length"), "float32", 0.0),  # the policy's statistic
    "lengths": Field(("batch",), "int32", 0),  # tokens consumed per sequence
}
METADATA = ("pos", "valid", "count", "score", "lengths")  # what every slot cache keeps beside its storage

@flax.struct.dataclass
class KVCache(CacheState):
    """The buffers of ``FIELDS`` (whole cache: ``[L, ...]``; inside the model's layer scan one layer's)."""

    k: jax.Array  # [L, b, k, C, d] (the storage's: values, 8-bit codes, or packed codes - see kind.storage)
    v: jax.Array  # [L, b, k, C, d]
    pos: jax.Array  # [L, b, H, C] int32
    valid: jax.Array  # [L, b, H, C] bool
    count: jax.Array  # [L, b, H] int32
    score: jax.Array  # [L, b, H, C] float32
    lengths: jax.Array | None  # [b] int32 (None in the per-layer view)
    # the storage's other buffers (None unless it declares them, ``kind.storage.slot_fields()``): an 8-bit cache's
    # scales [L, b, k, C]; a bit-packed one's (lcx.cache.lowbit_slots) key scales [L, b, k, C / G, d] and value
    # scales [L, b, k, C, d / G], their zeros and the float window
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None
    k_zero: jax.Array | None = None
    v_zero: jax.Array | None = None
    k_res: jax.Array | None = None  # [L, b, k, R + G, d] in cache.dtype
    v_res: jax.Array | None = None
    q_count: jax.Array | None = None  # [L, b] float32 (QUERY_FIELDS; None unless the policy observes them)
    q_mean: jax.Array | None = None  # [L, b, h, d] float32
    q_m2: jax.Array | None = None  # [L, b, h, d, d] float32
    kind: "SlotCacheKind" = flax.struct.field(pytree_node=False, default=None)

    @property
    def capacity(self) -> int:
        return self.shape_of("pos")[-1]  # (a bit-packed cache's keys are channel-major)

    @property
    def batch(self) -> int:
        return self.shape_of("pos")[-3]


@register_kind
@dataclasses.dataclass(frozen=True)
class SlotCacheKind(CacheKind):
    """Slots with an eviction policy. ``model``: the config whose KV heads the cache stores; ``budgets``: one per
    layer (None: the policy keeps everything, at most ``limit`` tokens when set); ``interval``: decode steps between
    compactions; ``dtype``: the float dtype attention reads; ``storage``: how keys and values are held
    (``lcx.cache.storage``: ``cache.kv_dtype``'s format; None: floats in ``dtype``)."""

    name: ClassVar[str] = "slots"
    state_type: ClassVar[type] = KVCache

    model: ModelConfig
    policy: EvictionPolicy
    budgets: tuple[int, ...] | None = None
    dtype: str = "float32"
    interval: int = 64
    limit: int | None = None
    storage: KVStorage | None = None
    few_queries: int = 0  # calls of up to this many queries attend query by query (kv_view.attend_view's few)

    def __post_init__(self):
        if self.storage is None:
            object.__setattr__(self, "storage", KVStorage(dtype=self.dtype))
        if self.storage.dtype != self.dtype:
            raise ValueError(f"SlotCacheKind: storage.dtype={self.storage.dtype!r} must be the kind's "
                             f"dtype={self.dtype!r} (the float dtype attention reads)")
        self.storage.check(self.model.head_dim)

    @classmethod
    def from_config(cls, model, cache, policy) -> "SlotCacheKind":
        """The slot cache of ``model``, whose layers must all be global (``CacheConfig.kind`` gives models with
        sliding-window layers a ``HybridKind``, ``lcx.cache.hybrid``, built on this one)."""
        windowed = [i for i, s in enumerate(model.attention_specs()) if s.window is not None]
        if windowed:
            raise ConfigError(f"model layers {windowed[:8]} use a sliding window: their cache is a HybridKind "
                              "(lcx.cache.hybrid; CacheConfig.kind builds it), not a SlotCacheKind")
        budgets = None
        if policy.evicts:
            budgets = layer_budgets(cache, model.n_layers)
            policy.check(model.n_layers, budgets)
        dtype = cache.dtype or model.dtype
        return cls(model=model, policy=policy, budgets=budgets, dtype=dtype, interval=cache.interval,
                   limit=None if policy.evicts else cache.max_budget, storage=storage_of(cache, dtype))

    # ------------------------------------------------------------------------------------------- declaration
    def fields(self) -> Mapping[str, Field]:
        """The storage's buffers, the slots' metadata and the statistics the policy observes (``Observes``)."""
        return {**self.storage.slot_fields(), **{n: FIELDS[n] for n in METADATA}, **self.policy.observes.fields()}

    @property
    def keep_heads(self) -> int:
        """1 when a layer's KV heads share one set of positions, the KV head count when each keeps its own."""
        return self.model.n_kv_heads if self.policy.per_head else 1

    @property
    def head_budgets(self) -> tuple[int, ...] | None:
        """The most slots one keep head holds after an eviction, per layer (the budgets, or more under a
        head-adaptive budget)."""
        if self.budgets is None:
            return None
        return tuple(self.policy.head_capacity(b, self.keep_heads) for b in self.budgets)

    def sizes(self, batch: int, capacity: int) -> dict[str, int]:
        m = self.model
        out = {"layers": m.n_layers, "batch": batch, "length": capacity, "kv_heads": m.n_kv_heads,
               "head_dim": m.head_dim, "keep_heads": self.keep_heads, "heads": m.n_heads}
        return out | self.storage.sizes(m.head_dim, capacity)

    # Capabilities (``CacheKind.check_runs``). Reconstruction passes (``attend`` with ``probe=``), ``write_prompt``
    # and a calibrated head split (the kind rebuilt with the measured policy) are written against this class's
    # contiguous slots: a subclass whose ``attend`` keeps them elsewhere (pages) does not inherit them.
    @property
    def _contiguous(self) -> bool:
        return type(self).attend is SlotCacheKind.attend

    @property
    def reconstructable(self) -> bool:
        return self._contiguous

    @property
    def calibratable(self) -> bool:
        return self._contiguous

    @property
    def prefill_across_seq(self) -> bool:
        return self._contiguous

    @property
    def shardable(self) -> bool:
        return self._contiguous

    @property
    def kv_dtype(self) -> str:
        return self.storage.buffer_dtype

    # ------------------------------------------------------------------------------------------- planning
    def plan(self, batch: int, max_prompt: int, max_new_tokens: int) -> int:
        needed = max_prompt + max_new_tokens
        if self.budgets is not None:
            return min(needed, max(self.head_budgets) + self.interval)
        if self.limit is not None and needed > self.limit:
            raise full_overflow(self.model, needed, self.limit, batch, max_prompt, max_new_tokens, self.dtype,
                                nbytes=self.nbytes(batch, needed))
        return needed

    def prefill_chunk(self, requested: int, max_len: int, capacity: int) -> int:
        chunk = super().prefill_chunk(requested, max_len, capacity)
        if max_len > capacity:  # chunks must fit in the room an eviction frees
            chunk = min(chunk, self.interval)
        return chunk

    def prefill_weights(self, lengths: np.ndarray, width: int) -> np.ndarray | None:
        """Which prompt queries feed the eviction score (``Observes.prefill_weights``), ``[b, width]`` float32."""
        return self.policy.observes.prefill_weights(lengths, width)

    # ------------------------------------------------------------------------------------------- teacher forcing
    def score_width(self, tokens: int) -> int:
        """A full cache takes the continuation in chunks as large as a prefill's; an evicting one at most
        ``interval`` tokens at a time (the room an eviction frees), and for a short continuation (a question after a
        one-shot compression) a power of two of at least 128: one compiled width for the questions of many tasks."""
        if self.budgets is None:
            return min(AUTO_PREFILL_CHUNK, round_chunk(tokens))
        return min(self.interval, max(128, 1 << max(tokens - 1, 1).bit_length()))

    def score_room(self, state: KVCache) -> int | None:
        """One-token steps evict a row when a step finds one of its layers full (``make_room(1)``, per row). A
        chunk that fills a row exactly, never past, leaves the same state; a row that starts the chunk full evicts
        first, as that step would, and then has at least ``interval`` free slots (the capacity is the largest budget
        + ``interval``). So the chunk is at most the room of the fullest row that is not full yet."""
        if self.budgets is None:
            return None
        free = state.capacity - np.max(np.asarray(state.count), axis=(0, 2))  # [b]
        return int(np.min(free[free > 0])) if np.any(free > 0) else self.interval

    def score_weights(self, n: int, width: int, batch: int) -> np.ndarray | None:
        """Every real query counts for a summed statistic (as every decode step adds its attention); for a
        replaced one (TOVA) only the last: after n steps the statistic is the last step's attention
        (``Observes.score_weights``)."""
        return self.policy.observes.score_weights(n, width, batch)

    # ------------------------------------------------------------------------------------------- attention
    def attend(self, layer, q, key, val, *, cos, sin, positions, ok, stat_weights, spec=None, probe=None,
               key_tables=None):
        """Append and attend (``slot_attention.attend``); with a ``probe`` (a reconstruction pass of a policy that
        observes ``reconstructs``, ``lcx.cache.reconstruct``) attend without appending and score the probed slots."""
        if probe is not None:  # the pass reads what the chunk op reads (codes, or the layer dequantized)
            storage, readable = self.storage.readable(layer, q.dtype)
            out, scored = reconstruct.attend(self, readable, q, key, val, cos=cos, sin=sin, ok=ok,
                                             spec=spec or self.model.attention_specs()[0], probe=probe,
                                             storage=storage)
            return out, layer.replace(score=scored.score)  # only the scores change
        return slot_attention.attend(self, layer, q, key, val, cos=cos, sin=sin, positions=positions, ok=ok,
                                     stat_weights=stat_weights, spec=spec, key_tables=key_tables)

    def write_prompt(self, layer, rotated, key, val, positions, ok):
        """Append a whole prompt's keys and values (``[b, t, k, d]`` in sequence order; ``rotated``: the keys at
        their positions) to an empty ``layer`` without attending: a prefill whose attention ran across the mesh's
        ``seq`` axis (``lcx.model.attention``). Only for policies that observe nothing while prefilling
        (``Observes.prefill``; ``check_runs`` refuses the others)."""
        keys = rotated if self.policy.mode == "original" and not self.model.rope.rerotate else key
        layout = self.layer_axes()
        return per_shard(slot_attention.write, (layout, BSKD, BSKD, ROWS, ROWS), layout)(layer, keys, val, positions,
                                                                                         ok)

    # ------------------------------------------------------------------------------------------- eviction
    def evict(self, state: KVCache, rows: jax.Array | None = None):
        """Compact to the budgets: every row (``rows`` None: after the prompt), or only the rows ``rows [b]`` marks
        (``make_room``: those that would overflow). The others keep every buffer as it was, to the bit - scores,
        codes and windows included - so a row's tokens never depend on its batch-mates. One compiled program: the
        eviction runs on every row and the unmarked rows take their old buffers back."""
        if self.budgets is None:
            return state, None
        out, left = self._evict_rows(state)
        if rows is None:
            return out, left
        return keep_rows(rows, out, state), left.replace(mask=left.mask & rows[None, :, None, None])

    def _evict_rows(self, state: KVCache):
        """Every row of ``state`` compacted to the budgets: ``(state, left)``."""
        return self.storage.evict(self, state, jnp.asarray(self.budgets, jnp.int32), evict_cache)

    def make_room(self, state: KVCache, n) -> KVCache:
        if self.budgets is None:
            return state
        count = jnp.stack(state.count) if state.split else state.count  # [L, b, H]
        n = jnp.asarray(n)
        # Per row: a row is cut when one of its layers / keep heads would overflow, and only then - a row alone
        # evicts at the same tokens as in any batch. No row over: the eviction is skipped (most decode steps).
        over = jnp.any(count + (n[None, :, None] if n.ndim == 1 else n) > state.capacity, axis=(0, 2))  # [b]
        return jax.lax.cond(jnp.any(over), lambda c: c.stacked(lambda s: self.evict(s, over)[0]), lambda c: c,
                            state)

    def end_prefill(self, state: KVCache) -> KVCache:
        return self.evict(state)[0]

    @property
    def truncatable(self) -> bool:
        """Whether ``truncate`` forgets a row's newest tokens exactly: a per-token storage (float, 8-bit, fp4 codes:
        each token's bytes stand alone). A grouped format (int4 / int2) forgets them too, but a key group they were
        flushed with comes back dequantized into the float window (a draft may be lossy; a target may not)."""
        return self.storage.period == 1

    def truncate(self, state: KVCache, lengths: jax.Array) -> KVCache:
        """Forget every token at position ``>= lengths [b]`` (the drafts a speculative verification rejected,
        ``lcx.engine.speculative``): their slots are emptied and the row's count and length set back. Slots stay
        packed in position order - the forgotten ones are each keep head's newest - so the next token is written
        where the first forgotten one was. Keys and values are not touched (an empty slot is never read), but a
        grouped format's float window is set back (``KVStorage.rewind``). Works on a stacked or a split state;
        statistics the forgotten tokens' queries added to other slots stay (a draft's eviction scores, never a full
        cache's attention)."""
        row = lengths[:, None, None]  # [b, 1, 1]: broadcasts over the trailing [b, H, C] of a stacked or split buffer

        def one(pos, valid, score):
            keep = valid & (pos < row)
            return jnp.where(keep, pos, -1), keep, jnp.sum(keep, axis=-1, dtype=jnp.int32), jnp.where(keep, score, 0.0)

        names = list(self.storage.slot_fields())
        rewind = lambda before, after, *bufs: self.storage.rewind(  # noqa: E731
            types.SimpleNamespace(**dict(zip(names, bufs))), before, after)
        if state.split:
            parts = [one(p, v, s) for p, v, s in zip(state.pos, state.valid, state.score)]
            pos, valid, count, score = (tuple(x) for x in zip(*parts))
            layers = [rewind(b, a, *(getattr(state, n)[i] for n in names))
                      for i, (b, a) in enumerate(zip(state.count, count))]
            window = {n: tuple(x[n] for x in layers) for n in layers[0]}
        else:
            pos, valid, count, score = one(state.pos, state.valid, state.score)
            window = jax.vmap(rewind)(state.count, count, *(getattr(state, n) for n in names))
        return state.replace(pos=pos, valid=valid, count=count, score=score, lengths=lengths.astype(jnp.int32),
                             **window)

    def fork(self, state: KVCache, n: int) -> KVCache:
        """Each row copied ``n`` times (its slots, positions and statistics): the rows continue independently."""
        return repeat_rows(state, n)


def keep_rows(rows: jax.Array, new: CacheState, old: CacheState) -> CacheState:
    """``new`` in the rows ``rows [b]`` marks and ``old`` in the others, buffer by buffer along the fields'
    ``batch`` axes (both stacked, of one kind)."""
    out = {}
    for name, field in old.kind.fields().items():
        a, b = getattr(new, name, None), getattr(old, name, None)
        if "batch" not in field.axes or a is None or a is b:
            continue
        shape = [1] * a.ndim
        shape[field.axes.index("batch")] = -1
        out[name] = jnp.where(rows.reshape(shape), a, b)
    return new.replace(**out)


def repeat_rows(state: CacheState, n) -> CacheState:
    """``state`` with every buffer that has a ``batch`` axis repeated ``n`` times along it (row i -> rows i*n ..
    i*n + n - 1; ``n`` may be a numpy array of one count per row), from the fields' declarations."""
    fields = state.kind.fields()
    stacked = state.stack_layers()
    return stacked.replace(**{name: jnp.repeat(getattr(stacked, name), n, axis=field.axes.index("batch"))
                              for name, field in fields.items() if "batch" in field.axes})


def full_kind(config: ModelConfig, dtype: str | None = None) -> SlotCacheKind:
    """A slot cache that keeps every token (the ``full`` policy)."""
    return SlotCacheKind(model=config, policy=make_policy("full"),
                         dtype=canonical_dtype(dtype or config.dtype, "cache.dtype"))


def init_cache(config: ModelConfig, batch: int, capacity: int, dtype: str | None = None) -> KVCache:
    """An empty ``full``-policy cache of ``capacity`` slots per layer and sequence."""
    return full_kind(config, dtype).create(batch, capacity)


def kv_bytes(config: ModelConfig, capacity: int, batch: int, dtype: str) -> int:
    """Bytes of K and V for ``capacity`` slots: 2 x layers x kv_heads x head_dim x capacity x bytes x batch (from the
    cache's own declaration); ``dtype`` ``int8`` / ``fp8``: 8-bit codes plus their float16 scales; ``int4`` /
    ``int2``: packed codes, group scales and zeros (``kv_group`` 64) and the float window (``kv_residual`` 0)."""
    return storage_named(dtype, config.dtype, "cache.dtype").nbytes(config, batch, capacity)


def full_overflow(config: ModelConfig, needed: int, budget: int, batch: int, max_prompt: int, max_new_tokens: int,
                  dtype: str, nbytes: int | None = None) -> CacheCapacityError:
    """The error for a ``full`` cache asked to hold more than its budget (``nbytes``: the KV bytes it would take;
    default: keys and values in ``dtype``)."""
    return CacheCapacityError(
        f"cache.policy='full' needs {needed} tokens per sequence (prompt {max_prompt} + max_new_tokens "
        f"{max_new_tokens}) = {format_bytes(nbytes or kv_bytes(config, needed, batch, dtype))} of KV cache for batch "
        f"{batch}, "
        f"but cache.budget={budget} tokens; keep the budget with an eviction policy, e.g. "
        f"CacheConfig(policy='streaming', budget={budget}, sinks=4), or shorten the request")


__all__ = ["FIELDS", "KVCache", "METADATA", "QUERY_FIELDS", "SlotCacheKind", "full_kind", "full_overflow",
           "init_cache", "keep_rows", "kv_bytes", "repeat_rows"]
