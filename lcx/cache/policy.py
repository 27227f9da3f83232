"""The policy plug point: ``CachePolicy`` (what ``cache.policy`` names), the ``EvictionPolicy`` ABC, their
registry, and the shared compaction.

``cache.policy`` names a registered ``CachePolicy``; its ``cache_type`` says which cache type implements it (the
slot cache ``"slots"`` for eviction policies, ``"memory"`` for the tiered working/long-term memory, or a type a
plugin registers, see ``lcx.cache.base``).

An eviction policy is a frozen dataclass (its fields are the policy's parameters, set from ``CacheConfig``)
registered by name. It is pure and jit-compatible: given one layer's slots (positions, live mask, keys, values, the
per-slot statistic), the layer index and its budget, it scores the slots (``scores``) or picks the survivors directly
(``select``); ``evict`` - shared by every policy - keeps the survivors and compacts them, in position order, to the
front of the fixed capacity.

When it runs (``lcx.generate``): after prefill (the prompt was attended in full, then compressed), between prefill
chunks if the prompt exceeds the capacity, and during decode whenever a layer's cache would overflow
``budget + interval`` slots - i.e. every ``interval`` steps, which amortizes the gather.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, ClassVar

import flax.struct
import jax
import jax.numpy as jnp

from lcx.config_base import ConfigError, from_dict

_REGISTRY: dict[str, type["CachePolicy"]] = {}
POSITION_MODES = ("original", "cache")


@flax.struct.dataclass
class SlotView:
    """What a policy sees of one layer of one batch: slots ``[b, C]``, packed at the front in position order."""

    layer: jax.Array  # int32 scalar: layer index (traced under the layer vmap)
    pos: jax.Array  # [b, C] original token positions, -1 in empty slots
    valid: jax.Array  # [b, C] live slots
    count: jax.Array  # [b] live slots
    k: jax.Array  # [b, C, k, d] (zero heads in simulations of attention-free policies)
    v: jax.Array  # [b, C, k, d]
    score: jax.Array  # [b, C] the per-slot statistic (attention mass for attention-based policies)
    n_layers: int = flax.struct.field(pytree_node=False, default=1)


@dataclasses.dataclass(frozen=True)
class CachePolicy(abc.ABC):
    """What ``cache.policy`` names: a frozen dataclass of the policy's parameters, registered with ``@register``.

    Class attributes: ``name`` (the registry key), ``cache_type`` (the registered cache type that implements it,
    see ``lcx.cache.base``), ``evicts`` (whether the device holds a bounded part of the context; ``full`` keeps
    everything), ``needs_budget`` (whether ``cache.budget`` is required).
    """

    name: ClassVar[str] = ""
    cache_type: ClassVar[str] = "slots"
    evicts: ClassVar[bool] = True
    needs_budget: ClassVar[bool] = True  # an evicting policy without cache.budget is refused at load

    def check(self, n_layers: int, budgets: tuple[int, ...]) -> None:
        """Raise ``ConfigError`` for settings that cannot work with this model (called before anything runs)."""


@dataclasses.dataclass(frozen=True)
class EvictionPolicy(CachePolicy):
    """Base class of eviction policies. Subclasses are frozen dataclasses registered with ``@register``.

    Class attributes:
    - ``position_mode``: "original" - keys are rotated at their true positions (H2O, SnapKV, TOVA); "cache" - keys
      are stored unrotated and rotated by slot rank at attention time (StreamingLLM, LaCache), which lets decoding
      continue far past the trained context. The ``positions`` field overrides it per config.
    - ``attention_stat``: None, or how decode steps update the per-slot score from attention weights: "sum"
      (accumulate, H2O) or "replace" (the current query's weights, TOVA). Prefill always sums over the queries the
      generator selects with ``prefill_queries``.
    - ``prefill_queries``: which prompt queries feed the score: "all", "last" or "window" (``self.window``).
    """

    position_mode: ClassVar[str] = "original"
    attention_stat: ClassVar[str | None] = None
    prefill_queries: ClassVar[str] = "all"

    positions: str | None = None  # override of position_mode

    @property
    def mode(self) -> str:
        return self.positions or self.position_mode

    def scores(self, view: SlotView, budget: jax.Array) -> jax.Array:
        """Per-slot keep scores ``[b, C]``: the ``budget`` highest are kept (ties: newer first)."""
        raise NotImplementedError(f"{type(self).__name__} must implement scores() or select()")

    def select(self, view: SlotView, budget: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Survivors ``keep [b, C]`` and the updated per-slot score. Default: the top ``budget`` of ``scores``."""
        return top_budget(self.scores(view, budget), view, budget), view.score

    def __post_init__(self):
        if self.positions is not None and self.positions not in POSITION_MODES:
            raise ConfigError(f"cache.positions={self.positions!r} is invalid: must be one of {list(POSITION_MODES)}")


def top_budget(scores: jax.Array, view: SlotView, budget: jax.Array) -> jax.Array:
    """Mask of the ``budget`` highest-scoring live slots per row; ties go to the newer token."""
    s = jnp.where(view.valid, scores.astype(jnp.float32), -jnp.inf)
    order = jnp.lexsort((-view.pos, -s), axis=-1)  # primary key last: score descending, then newest first
    rank = jnp.argsort(order, axis=-1)  # inverse permutation: each slot's rank
    return view.valid & (rank < budget)


def compact(policy: EvictionPolicy, view: SlotView, budget: jax.Array) -> tuple[SlotView, jax.Array]:
    """Apply ``policy`` to one layer: ``(view, keep)`` - the survivors compacted to the front in position order, and
    the mask ``keep [b, C]`` of the survivors in the slot layout before compaction."""
    keep, score = policy.select(view, budget)
    keep = keep & view.valid
    big = jnp.iinfo(jnp.int32).max
    order = jnp.argsort(jnp.where(keep, view.pos, big), axis=-1, stable=True)  # [b, C] kept first, by position

    def gather(x):
        idx = order.reshape(order.shape + (1,) * (x.ndim - 2))
        return jnp.take_along_axis(x, idx, axis=1)

    valid = gather(keep)
    out = view.replace(pos=jnp.where(valid, gather(view.pos), -1), valid=valid,
                       count=jnp.sum(keep, axis=-1, dtype=jnp.int32), k=gather(view.k), v=gather(view.v),
                       score=jnp.where(valid, gather(score), 0.0))
    return out, keep


def evict(policy: EvictionPolicy, view: SlotView, budget: jax.Array) -> SlotView:
    """Apply ``policy`` to one layer: keep its survivors and compact them to the front, in position order."""
    return compact(policy, view, budget)[0]


def register(cls: type[CachePolicy]) -> type[CachePolicy]:
    """Class decorator: make ``cls`` available under ``cls.name`` in ``CacheConfig(policy=...)``."""
    if not cls.name:
        raise TypeError(f"{cls.__name__} needs a class attribute name")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise TypeError(f"a cache policy named {cls.name!r} is already registered ({_REGISTRY[cls.name]})")
    _REGISTRY[cls.name] = cls
    return cls


def registered() -> list[str]:
    """The registered policy names (the built-ins are registered by ``lcx.cache``, which imports them)."""
    return sorted(_REGISTRY)


def make_policy(name: str, params: dict[str, Any] | None = None) -> CachePolicy:
    """Instantiate policy ``name`` with ``params``; unknown names or parameters raise ``ConfigError``."""
    import difflib

    if name not in _REGISTRY:
        close = difflib.get_close_matches(name, registered(), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"cache.policy={name!r} is not a registered eviction policy{hint} (allowed: {registered()})")
    cls = _REGISTRY[name]
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(params or {}) - fields)
    if unknown:
        raise ConfigError(f"cache.{unknown[0]} is not a parameter of cache.policy={name!r} "
                          f"(its parameters: {sorted(fields)})")
    return from_dict(cls, params or {}, prefix="cache")
