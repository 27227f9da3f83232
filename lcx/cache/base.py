"""The cache contract: what every cache type implements, so generation and the model never branch on the type.

A cache type is two objects:

- a *kind*: a frozen dataclass (hashable, static under jit) holding everything fixed for a run - the model shape the
  cache stores, the storage dtype, the policy and its budgets - and the behaviour (:class:`CacheKind`);
- a *state*: a ``flax.struct`` pytree of the buffers the kind declares (:class:`CacheState`), with the kind as a
  static field, threaded through the model and the decode loop as argument and return value.

Call sites and what they call:

    Generator (host)        kind.plan -> kind.create -> kind.open -> [chunks] -> kind.end_prefill -> [decode
                            segments]; kind.sync between jitted calls (host-side work such as moving blocks to a
                            store); kind.close when the next request starts
    prefill/decode (jit)    kind.make_room(state, n) before each model call; the model call itself
    model layer (scan)      kind.attend(layer, q, k, v, ...): write the new keys/values, attend, update statistics
    eviction (jit)          kind.evict(state) -> (state, left): ``left`` is what was removed, for a store to take

Adding a cache type: subclass :class:`CacheKind` and :class:`CacheState`, and register a policy whose
``cache_kind`` builds the kind (``lcx.cache.policy``). ``lcx.generate`` needs no change.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from lcx.parallel import sharding
from lcx.cache import schema
from lcx.cache.policy import registered_where
from lcx.cache.schema import Field
from lcx.config_base import ConfigError, name_registry

AUTO_PREFILL_CHUNK = 2048  # the most prompt tokens per prefill call when cache.prefill_chunk is auto


def round_chunk(n: int) -> int:
    """``n`` rounded up to a multiple of a quarter of the largest power of two below it (a power of two up to 64)."""
    if n <= 64:
        return 1 << max(n - 1, 0).bit_length()
    step = (1 << (n - 1).bit_length()) // 8  # a quarter of the largest power of two below n
    return -(-n // step) * step


class CacheCapacityError(ConfigError):
    """The requested generation does not fit the cache budget or the memory limit."""


class CacheState:
    """Base of the pytrees of cache types (subclasses are ``flax.struct`` dataclasses with a static ``kind``).

    Every cache type has a ``lengths [batch]`` buffer: the tokens each sequence has consumed (its next position),
    and reports the ``capacity`` it was created with (``kind.create(batch, capacity)`` rebuilds its shape).
    """

    kind: Any
    lengths: jax.Array

    @property
    def capacity(self) -> int:
        raise NotImplementedError(f"{type(self).__name__} must report its capacity")

    def layers(self) -> "CacheState":
        """The per-layer buffers (first axis ``layers``), the others removed: what the model's layer scan slices."""
        fields = self.kind.fields()
        return self.replace(**{n: None for n, f in fields.items() if not f.per_layer})

    def with_layers(self, layers: "CacheState", lengths: jax.Array) -> "CacheState":
        """This state with the per-layer buffers of ``layers`` and new ``lengths``."""
        fields = self.kind.fields()
        return layers.replace(lengths=lengths, **{n: getattr(self, n) for n, f in fields.items()
                                                   if not f.per_layer and n != "lengths"})

    # Per-layer buffers come in two forms. Stacked (``[L, ...]`` arrays): how a state is created, stored, evicted,
    # sharded and passed between jitted calls. Split (a tuple of L arrays per buffer): what the unrolled decoder
    # carries through a decode loop, so each layer reads and writes its own buffers in place - indexing a layer out
    # of a stacked buffer copies it on XLA:CPU (and every layer's K and V per token is most of decoding's traffic).

    def _per_layer(self) -> list[str]:
        return [n for n, f in self.kind.fields().items() if f.per_layer and getattr(self, n) is not None]

    @property
    def split(self) -> bool:
        """True when the per-layer buffers are tuples of one array per layer (``split_layers``)."""
        names = self._per_layer()
        return bool(names) and isinstance(getattr(self, names[0]), tuple)

    def split_layers(self) -> "CacheState":
        """This state with every per-layer buffer as a tuple of its L layers (a copy; see ``stack_layers``)."""
        if self.split:
            return self
        return self.replace(**{n: tuple(getattr(self, n)[i] for i in range(getattr(self, n).shape[0]))
                               for n in self._per_layer()})

    def stack_layers(self) -> "CacheState":
        """The inverse of ``split_layers``: ``[L, ...]`` arrays again."""
        if not self.split:
            return self
        return self.replace(**{n: jnp.stack(getattr(self, n)) for n in self._per_layer()})

    def stacked(self, fn: Callable[["CacheState"], "CacheState"]) -> "CacheState":
        """``fn`` (written for stacked buffers) applied to this state, the result in this state's form."""
        if not self.split:
            return fn(self)
        return fn(self.stack_layers()).split_layers()

    def shape_of(self, name: str) -> tuple[int, ...]:
        """The stacked shape of buffer ``name`` in either form."""
        x = getattr(self, name)
        return (len(x),) + tuple(x[0].shape) if isinstance(x, tuple) else tuple(x.shape)

    def layer(self, i) -> "CacheState":
        """Layer ``i``'s view (the per-layer buffers without their layer axis; ``i`` may be traced when stacked)."""
        names = self._per_layer()
        if self.split:
            return self.replace(**{n: getattr(self, n)[i] for n in names})
        return self.replace(**{n: jax.lax.dynamic_index_in_dim(getattr(self, n), i, 0, keepdims=False)
                               for n in names})

    def set_layer(self, i, layer: "CacheState") -> "CacheState":
        """This state with layer ``i`` replaced by ``layer`` (in place under jit)."""
        names = self._per_layer()
        if self.split:
            return self.replace(**{n: tuple(getattr(layer, n).astype(a.dtype) if j == i else a
                                             for j, a in enumerate(getattr(self, n))) for n in names})
        return self.replace(**{n: jax.lax.dynamic_update_index_in_dim(
            getattr(self, n), getattr(layer, n).astype(getattr(self, n).dtype), i, 0) for n in names})

    def buffers(self) -> dict[str, jax.Array]:
        return {n: getattr(self, n) for n in self.kind.fields()}

    def kv_bytes(self) -> int:
        """Bytes of the key/value buffers held on the device (the ``kv`` role)."""
        fields = self.kind.fields()
        return int(sum(x.size * x.dtype.itemsize for n, x in self.buffers().items() if fields[n].role == "kv"))

    def held_bytes(self) -> int:
        """Bytes of key/value storage the state holds now: its arrays (a paged state: the pages in use, which an
        eviction gives back - ``lcx.cache.paged``)."""
        return self.kv_bytes()

    def metadata_bytes(self) -> int:
        fields = self.kind.fields()
        return int(sum(x.size * x.dtype.itemsize for n, x in self.buffers().items() if fields[n].role != "kv"))


class CacheKind(abc.ABC):
    """The behaviour of a cache type (subclasses are frozen dataclasses). See the module docstring.

    ``name`` is the ``cache_type`` policies refer to; ``from_config`` builds the kind for a model and a
    ``CacheConfig`` (and its instantiated policy).
    """

    name: ClassVar[str] = ""
    state_type: ClassVar[type]

    @classmethod
    @abc.abstractmethod
    def from_config(cls, model, cache, policy) -> "CacheKind":
        """The kind for ``model`` (the KV heads the cache stores), ``cache`` (a ``CacheConfig``) and ``policy``."""

    # ------------------------------------------------------------------------------------------- declaration
    @abc.abstractmethod
    def fields(self) -> Mapping[str, Field]:
        """The buffers, once: name -> :class:`Field` (must include ``lengths`` with axes ``("batch",)``)."""

    @abc.abstractmethod
    def sizes(self, batch: int, capacity: int) -> Mapping[str, int]:
        """The size of every logical axis the fields use."""

    @property
    @abc.abstractmethod
    def kv_dtype(self) -> str:
        """Storage dtype of the ``"kv"`` buffers."""

    # ------------------------------------------------------------------------------------------- capabilities
    # What this kind can do for a policy's declaration (``Observes``): ``check_runs`` compares them, so the
    # Generator never names a policy or a cache type. A kind that can more says so by overriding them.
    @property
    def reconstructable(self) -> bool:
        """Whether a reconstruction pass (``lcx.cache.reconstruct``) can score this cache's slots in place."""
        return False

    @property
    def calibratable(self) -> bool:
        """Whether a policy measured on the model (``Observes.calibrates``) runs here: the Generator rebuilds the
        kind with the measured policy (``dataclasses.replace(kind, policy=...)``)."""
        return False

    @property
    def prefill_across_seq(self) -> bool:
        """Whether ``write_prompt`` takes a prompt whose attention ran across a mesh's ``seq`` axis, whole."""
        return False

    @property
    def shares_pages(self) -> bool:
        """Whether rows can point at the same pages, so a prompt prefix is stored once (``Generator.prefill``
        shares the whole pages consecutive prompts start with; ``lcx plan`` counts them once)."""
        return False

    @property
    def shardable(self) -> bool:
        """Whether this cache runs on a device mesh (``shardings`` splits its buffers: batch over data, KV heads
        over model)."""
        return False

    def check_mesh(self, mesh) -> None:
        """Raise ``ConfigError`` when this kind cannot split its buffers over ``mesh``'s axes (a shardable kind may
        still refuse one axis). Default: every axis its fields' logical axes name."""

    def check_runs(self, policy, *, seq: int = 1) -> None:
        """Raise ``ConfigError`` when ``policy`` (a ``CachePolicy``) observes what this kind cannot give it: a
        reconstruction pass, a calibration or - on a mesh whose ``seq`` axis has ``seq`` > 1 devices - anything
        while prefilling. A pure function of the kind, the policy's declaration (``policy.observes``) and ``seq``."""
        check_runs(self, policy, seq)

    # ------------------------------------------------------------------------------------------- host planning
    @abc.abstractmethod
    def plan(self, batch: int, max_prompt: int, max_new_tokens: int) -> int:
        """Slots per layer and sequence for this request (the ``capacity``); ``CacheCapacityError`` if impossible."""

    def prefill_chunk(self, requested: int, max_len: int, capacity: int) -> int:
        """Tokens per prefill chunk: the request, or the prompt rounded up to a power of two when shorter."""
        return min(requested, 1 << (max_len - 1).bit_length())

    def prefill_weights(self, lengths: np.ndarray, width: int) -> np.ndarray | None:
        """Which prompt queries feed attention statistics, ``[batch, width]`` float32; None: no statistics."""
        return None

    decode_segment: ClassVar[int | None] = None  # decode steps per jitted call before ``sync`` (None: no limit)

    # Teacher forcing (``Generator.score``) in chunks: a chunk of given tokens goes through the cache like a prefill
    # chunk, so a cache type that allows it must give every token the attention - and the eviction schedule - it
    # would get from one-token decode steps.
    def score_width(self, tokens: int) -> int | None:
        """The compiled width of teacher-forcing calls for a continuation of ``tokens`` tokens; None: this cache
        type scores one token per step (the decode step, in a compiled scan)."""
        return None

    def score_room(self, state: CacheState) -> int | None:
        """The most tokens the next teacher-forcing call may append so that evictions fall where one-token steps
        would put them (read on the host before each call); None: no limit."""
        return None

    def score_weights(self, n: int, width: int, batch: int) -> np.ndarray | None:
        """Which of a teacher-forcing chunk's ``n`` real queries (of ``width``) feed attention statistics, ``[batch,
        width]`` float32, so that the statistic after the chunk is the one after ``n`` decode steps; None: none."""
        return None

    def scoring(self) -> "CacheKind":
        """The kind whose ``attend`` runs a teacher-forcing chunk (same buffers; e.g. the memory tier routes every
        query on its own there, as a decode step would). Default: this one."""
        return self

    # ------------------------------------------------------------------------------------------- derived
    def abstract(self, batch: int, capacity: int) -> CacheState:
        return self.state_type(kind=self, **schema.abstract(self.fields(), self.sizes(batch, capacity),
                                                            self.kv_dtype))

    def create(self, batch: int, capacity: int) -> CacheState:
        """An empty cache of ``capacity`` slots per layer and sequence."""
        if capacity <= 0 or batch <= 0:
            raise ValueError(f"{capacity=} and {batch=} must be positive")
        return self.state_type(kind=self, **schema.empty(self.fields(), self.sizes(batch, capacity), self.kv_dtype))

    def nbytes(self, batch: int, capacity: int, role: str | None = "kv") -> int:
        """Bytes of the buffers of ``role`` for ``batch`` x ``capacity`` (None: all buffers)."""
        return schema.nbytes(self.fields(), self.sizes(batch, capacity), self.kv_dtype, role)

    def shardings(self, state: CacheState, mesh) -> CacheState:
        """``state`` (possibly abstract) with a ``NamedSharding`` per buffer, from the fields' logical axes."""
        def one(name: str, field: Field):
            x = getattr(state, name)
            if isinstance(x, tuple):  # split: one sharding per layer
                return tuple(sharding.named_sharding(field.axes[1:], a.shape, mesh, f"cache {name}") for a in x)
            return sharding.named_sharding(field.axes, x.shape, mesh, f"cache {name}")

        return state.replace(**{n: one(n, f) for n, f in self.fields().items()})

    def layer_axes(self) -> CacheState:
        """The per-layer buffers' logical axes (the layout ``per_shard`` gives kernels inside the layer scan)."""
        return self.state_type(kind=self, **{n: (f.axes[1:] if f.per_layer else None)
                                             for n, f in self.fields().items()})

    # ------------------------------------------------------------------------------------------- in the model
    @abc.abstractmethod
    def attend(self, layer: CacheState, q: jax.Array, key: jax.Array, val: jax.Array, *, cos: jax.Array,
               sin: jax.Array, positions: jax.Array, ok: jax.Array, stat_weights: jax.Array | None,
               spec=None) -> tuple[jax.Array, CacheState]:
        """One layer: append ``key, val [b, t, k, d]`` (unrotated, where ``ok [b, t]``) at ``positions [b, t]`` and
        attend ``q [b, t, h, d]`` (unrotated; ``cos, sin`` are the RoPE tables of ``positions``) to the cache.
        ``stat_weights [b, t]``: the queries whose attention feeds eviction statistics (None: none). ``spec``: the
        layer's ``AttentionSpec`` (window, soft-cap, scale, RoPE), passed only for models whose attention is not plain
        (``ModelConfig.plain_attention``), so kinds that predate it keep working on Llama-style models.
        Returns ``(out [b, t, h, d], layer)``."""

    # ------------------------------------------------------------------------------------------- between calls
    def evict(self, state: CacheState) -> tuple[CacheState, Any]:
        """Compact to the budget: ``(state, left)``, ``left`` what was removed (None for caches that keep all)."""
        return state, None

    def make_room(self, state: CacheState, n: jax.Array) -> CacheState:
        """Called (jitted) before ``n`` more tokens per row are appended (a scalar for every row, or ``[b]``);
        evicting caches compact here, a paged cache allocates pages."""
        return state

    def observe_tokens(self, state: CacheState, input_ids: jax.Array, ok: jax.Array) -> CacheState:
        """Called (traced) by the model with a call's token ids ``[b, t]`` before its layers run: a cache that keys
        anything on the tokens themselves (the memory tier's ``lexical`` recall) stages them here."""
        return state

    def end_prefill(self, state: CacheState) -> CacheState:
        """Called (jitted) once the prompt is in the cache (compress-after-prefill policies act here)."""
        return state

    def sync(self, state: CacheState) -> CacheState:
        """Host-side work between jitted calls (e.g. moving evicted blocks to a host store)."""
        return state

    @property
    def can_fork(self) -> bool:
        """Whether ``fork`` is implemented (a cache type overrides it)."""
        return type(self).fork is not CacheKind.fork

    def fork(self, state: CacheState, n) -> CacheState:
        """Each row of ``state`` as ``n`` consecutive rows that continue independently (``Generator.fork``); ``n``
        an int for every row, or a numpy array of one count per row."""
        raise ConfigError(f"cache type {self.name!r} cannot fork a state (slots, hybrid and paged caches can)")

    # ------------------------------------------------------------------------------------------- host resources
    def open(self, state: CacheState) -> tuple[CacheState, Any]:
        """Attach host resources (e.g. a host / disk store) to a freshly created state: ``(state, handle)``, the
        handle (None: nothing attached) for ``close``."""
        return state, None

    def close(self, handle: Any) -> None:
        """Release what ``open`` (or ``restore_host``) attached (called when the generator starts its next
        request)."""

    def store_bytes(self, state: CacheState) -> int:
        """Bytes held off the device (host memory or disk) for ``state``."""
        return 0

    def store_nbytes(self, batch: int, capacity: int) -> int:
        """Bytes a full store holds off the device for ``batch`` x ``capacity`` (the planner's figure)."""
        return 0

    def save_host(self, state: CacheState, path) -> None:
        """Write what lives off the device next to a saved state (``Generator.save``)."""

    def restore_host(self, state: CacheState, path) -> tuple[CacheState, Any]:
        """Reattach what ``save_host`` wrote to a restored state (``Generator.restore``): ``(state, handle)``."""
        return state, None


def check_runs(kind: CacheKind, policy, seq: int = 1) -> None:
    """``CacheKind.check_runs``: the capabilities of ``kind`` against what ``policy`` declares it observes."""
    name, observes = policy.name, policy.observes
    if observes.reconstructs and not kind.reconstructable:
        raise ConfigError(f"cache.policy={name!r} is scored by reconstruction passes, built for the contiguous slot "
                          f"cache (also as a sliding-window model's global layers); this configuration's cache type is "
                          f"{kind.name!r}, which is not reconstructable")
    if observes.calibrates and not kind.calibratable:
        raise ConfigError(f"cache.policy={name!r} is measured on the model, built for the contiguous slot cache of a "
                          f"model whose layers are all global; this configuration's cache type is {kind.name!r}, "
                          "which is not calibratable")
    if seq <= 1:
        return
    if not kind.prefill_across_seq:
        why = (f"its cache type is {kind.name!r}, which takes no prompt attended across seq (the contiguous slot "
               "cache of a model whose layers are all global does)")
    elif observes.prefill:
        quiet = registered_where(lambda p: p.cache_type == policy.cache_type and not p.observes.prefill)
        why = (f"it observes the prompt through {observes.describe()}; allowed: a policy that does not "
               f"({', '.join(quiet)})")
    else:
        return
    raise ConfigError(f"mesh.seq={seq} splits each prompt's prefill over the sequence axis, but cache.policy={name!r} "
                      f"cannot run that way: {why}; or use a mesh without seq")


_KINDS: dict[str, type[CacheKind]] = {}


# Class decorator: make cache type ``cls`` available as ``cache_type = cls.name`` of policies.
register_kind = name_registry(_KINDS, "cache type")


def kind_class(name: str) -> type[CacheKind]:
    if name not in _KINDS:
        raise ConfigError(f"cache type {name!r} is not registered (known: {sorted(_KINDS)})")
    return _KINDS[name]


__all__ = ["AUTO_PREFILL_CHUNK", "CacheCapacityError", "CacheKind", "CacheState", "check_runs", "kind_class",
           "register_kind", "round_chunk"]
