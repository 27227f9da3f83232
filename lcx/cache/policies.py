"""The built-in eviction policies: full, window, StreamingLLM, H2O, TOVA, SnapKV, K-norm, random (the LaCache ladder
is in ``ladder.py``). Each scores one layer's slots; ``evict`` does the rest.

Slots are packed at the front in position order, so slot rank ``j`` counts tokens from the oldest live one and
``count - 1 - j`` from the newest.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from lcx.cache.policy import EvictionPolicy, SlotView, register
from lcx.config_base import ConfigError

_PROTECT = 1e30  # score of slots a policy always keeps (sinks, recent window); finite so ties still sort by age


def _slot_rank(view: SlotView) -> jax.Array:
    return jnp.broadcast_to(jnp.arange(view.pos.shape[-1]), view.pos.shape)


def _newest(view: SlotView, n: int | jax.Array) -> jax.Array:
    """Mask of the ``n`` newest live slots of each row."""
    return view.valid & (_slot_rank(view) >= view.count[:, None] - n)


def _need_budget_above(name: str, what: str, amount: int, budgets: tuple[int, ...]) -> None:
    small = [b for b in budgets if b <= amount]
    if small:
        raise ConfigError(f"cache.budget={min(small)} is invalid for cache.policy={name!r}: it must exceed {what}"
                          f"={amount} (the budget would hold nothing else)")


@register
@dataclasses.dataclass(frozen=True)
class Full(EvictionPolicy):
    """Keep everything: the cache grows to prompt + new tokens, and that size is checked before running."""

    name: ClassVar[str] = "full"
    evicts: ClassVar[bool] = False

    def select(self, view, budget):
        return view.valid, view.score


@register
@dataclasses.dataclass(frozen=True)
class Window(EvictionPolicy):
    """The ``budget`` most recent tokens (local attention)."""

    name: ClassVar[str] = "window"

    def scores(self, view, budget):
        return view.pos.astype(jnp.float32)


@register
@dataclasses.dataclass(frozen=True)
class Streaming(EvictionPolicy):
    """StreamingLLM: ``sinks`` first tokens (attention sinks) + the most recent ones; positions by slot rank."""

    name: ClassVar[str] = "streaming"
    position_mode: ClassVar[str] = "cache"
    sinks: int = 4

    def __post_init__(self):
        super().__post_init__()
        if self.sinks < 0:
            raise ConfigError(f"cache.sinks={self.sinks} is invalid: must be >= 0")

    def scores(self, view, budget):
        return view.pos.astype(jnp.float32) + jnp.where(view.pos < self.sinks, _PROTECT, 0.0)

    def check(self, n_layers, budgets):
        _need_budget_above(self.name, "cache.sinks", self.sinks, budgets)


@register
@dataclasses.dataclass(frozen=True)
class H2O(EvictionPolicy):
    """Heavy hitters: ``recent`` newest tokens + the highest accumulated attention (default recent = budget / 2)."""

    name: ClassVar[str] = "h2o"
    attention_stat: ClassVar[str | None] = "sum"
    recent: int | None = None

    def scores(self, view, budget):
        recent = budget // 2 if self.recent is None else self.recent
        return view.score + jnp.where(_newest(view, recent), _PROTECT, 0.0)

    def check(self, n_layers, budgets):
        if self.recent is not None:
            _need_budget_above(self.name, "cache.recent", self.recent, budgets)


@register
@dataclasses.dataclass(frozen=True)
class TOVA(EvictionPolicy):
    """Token omission via attention: evict the tokens the current query attends to least (summed over heads).

    With ``interval`` > 1 the ``interval`` lowest are evicted together, judged by the query of the step that
    overflows; ``interval: 1`` is the paper's one-token-per-step schedule.
    """

    name: ClassVar[str] = "tova"
    attention_stat: ClassVar[str | None] = "replace"
    prefill_queries: ClassVar[str] = "last"

    def scores(self, view, budget):
        return view.score


@register
@dataclasses.dataclass(frozen=True)
class SnapKV(EvictionPolicy):
    """SnapKV: attention of the last ``window`` prompt queries, pooled over ``kernel`` neighbouring positions;
    the window itself is kept. During decode the score keeps accumulating the new queries' attention."""

    name: ClassVar[str] = "snapkv"
    attention_stat: ClassVar[str | None] = "sum"
    prefill_queries: ClassVar[str] = "window"
    window: int = 32
    kernel: int = 7
    pooling: str = "max"

    def __post_init__(self):
        super().__post_init__()
        if self.window < 1:
            raise ConfigError(f"cache.window={self.window} is invalid: must be >= 1")
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise ConfigError(f"cache.kernel={self.kernel} is invalid: must be a positive odd integer")
        if self.pooling not in ("max", "avg"):
            raise ConfigError(f"cache.pooling={self.pooling!r} is invalid: must be 'max' or 'avg'")

    def scores(self, view, budget):
        s = jnp.where(view.valid, view.score, 0.0)
        dims, strides = (1, self.kernel), (1, 1)
        if self.pooling == "max":
            pooled = jax.lax.reduce_window(s, -jnp.inf, jax.lax.max, dims, strides, "SAME")
        else:
            pooled = jax.lax.reduce_window(s, 0.0, jax.lax.add, dims, strides, "SAME") / self.kernel
        return pooled + jnp.where(_newest(view, self.window), _PROTECT, 0.0)

    def check(self, n_layers, budgets):
        _need_budget_above(self.name, "cache.window", self.window, budgets)


@register
@dataclasses.dataclass(frozen=True)
class KNorm(EvictionPolicy):
    """Keep the keys with the smallest L2 norm (averaged over KV heads); attention-free."""

    name: ClassVar[str] = "knorm"

    def scores(self, view, budget):
        norms = jnp.sqrt(jnp.sum(jnp.square(view.k.astype(jnp.float32)), axis=-1))  # [b, C, k]
        return -jnp.mean(norms, axis=-1)


@register
@dataclasses.dataclass(frozen=True)
class Random(EvictionPolicy):
    """A uniformly random subset, reproducible: each (seed, layer, position) draws one fixed number."""

    name: ClassVar[str] = "random"
    seed: int = 0

    def scores(self, view, budget):
        key = jax.random.fold_in(jax.random.key(self.seed), view.layer)
        draw = jax.vmap(lambda p: jax.random.uniform(jax.random.fold_in(key, p)))
        return draw(view.pos.reshape(-1)).reshape(view.pos.shape)
