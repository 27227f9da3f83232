"""The eviction plug point: the ``EvictionPolicy`` ABC and its registry.

A policy is a frozen dataclass (its fields are the policy's parameters, set from ``CacheConfig``) registered by
name. It is pure and jit-compatible: given one layer's slots (positions, live mask, keys, values), the layer index
and optional attention statistics, it scores the slots; shared code keeps the best ``budget`` and compacts them
into the fixed capacity. When it runs (see ``lcx.generate``): once after prefill, and during decode whenever the
cache would overflow ``budget + interval`` slots, i.e. every ``interval`` steps.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, ClassVar

import flax.struct
import jax

from lcx.config import ConfigError

_REGISTRY: dict[str, type["EvictionPolicy"]] = {}


@flax.struct.dataclass
class SlotView:
    """What a policy sees of one layer: slots ``[b, C]`` and, if the policy asks for them, attention statistics."""

    layer: jax.Array  # int32 scalar: layer index (traced under the layer scan)
    pos: jax.Array  # [b, C] original token positions, -1 in empty slots
    valid: jax.Array  # [b, C] live slots
    k: jax.Array  # [b, C, k, d]
    v: jax.Array  # [b, C, k, d]
    lengths: jax.Array  # [b] tokens consumed so far
    attention: jax.Array | None = None  # [b, k, C] attention mass per slot (policy-defined accumulation)


@dataclasses.dataclass(frozen=True)
class EvictionPolicy(abc.ABC):
    """Base class of eviction policies. Subclasses are frozen dataclasses registered with ``@register``.

    ``position_mode``: "original" - keys are rotated at their true positions (H2O, SnapKV, TOVA); "cache" - keys
    are rotated by slot rank at attention time (StreamingLLM, LaCache), letting decoding run past the trained
    context. ``needs_attention``: the policy scores slots from attention statistics.
    """

    name: ClassVar[str] = ""
    position_mode: ClassVar[str] = "original"
    needs_attention: ClassVar[bool] = False
    evicts: ClassVar[bool] = True

    @abc.abstractmethod
    def scores(self, view: SlotView, budget: jax.Array) -> jax.Array:
        """Per-slot keep scores ``[b, C]`` (higher is kept first); ``budget`` is this layer's budget (int32)."""

    def check(self, n_layers: int, budget: int | None) -> None:
        """Raise ``ConfigError`` for settings that cannot work with this model; called at config/plan time."""


def register(cls: type[EvictionPolicy]) -> type[EvictionPolicy]:
    """Class decorator: make ``cls`` available under ``cls.name`` in ``CacheConfig(policy=...)``."""
    if not cls.name:
        raise TypeError(f"{cls.__name__} needs a class attribute name")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise TypeError(f"an eviction policy named {cls.name!r} is already registered ({_REGISTRY[cls.name]})")
    _REGISTRY[cls.name] = cls
    return cls


def registered() -> list[str]:
    return sorted(_REGISTRY)


def make_policy(name: str, params: dict[str, Any] | None = None) -> EvictionPolicy:
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
                          f"(its parameters: {sorted(fields) or 'none'})")
    from lcx.config import from_dict

    return from_dict(cls, params or {}, prefix="cache")


@register
@dataclasses.dataclass(frozen=True)
class Full(EvictionPolicy):
    """Keep everything: the cache grows to prompt + new tokens, and that size is checked before running."""

    name: ClassVar[str] = "full"
    evicts: ClassVar[bool] = False

    def scores(self, view: SlotView, budget: jax.Array) -> jax.Array:
        return view.valid.astype(jax.numpy.float32)
