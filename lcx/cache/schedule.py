"""When and how much to evict: per-layer budgets, and eviction over all layers of a ``KVCache``.

Budgets: one number for every layer; a list (one per layer); or the ``pyramid`` schedule (PyramidKV, arXiv
2406.02069), budgets shrinking linearly with depth from 1.5x to 0.5x the given number (same total).
The capacity of the cache is ``max(budgets) + interval``: decode appends ``interval`` tokens between compactions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lcx.cache.kv_cache import KVCache
from lcx.cache.policy import EvictionPolicy, SlotView, evict
from lcx.config import CacheConfig, ConfigError


def layer_budgets(cache: CacheConfig, n_layers: int) -> tuple[int, ...]:
    """Per-layer budgets for ``n_layers`` from ``cache.budget`` and ``cache.budget_schedule``."""
    budget = cache.budget
    if budget is None:
        raise ConfigError(f"cache.budget=None is invalid for cache.policy={cache.policy!r}: an evicting policy "
                          "needs a budget")
    if isinstance(budget, tuple):
        if len(budget) != n_layers:
            raise ConfigError(f"cache.budget has {len(budget)} per-layer values; the model has {n_layers} layers")
        return budget
    if cache.budget_schedule == "pyramid" and n_layers > 1:
        ramp = 1.5 - np.arange(n_layers) / (n_layers - 1)  # 1.5 .. 0.5, mean 1
        return tuple(max(1, int(round(budget * r))) for r in ramp)
    return (budget,) * n_layers


def _views(cache: KVCache) -> SlotView:
    n_layers = cache.k.shape[0]
    return SlotView(layer=jnp.arange(n_layers, dtype=jnp.int32), pos=cache.pos, valid=cache.valid,
                    count=cache.count, k=cache.k, v=cache.v, score=cache.score, n_layers=n_layers)


def evict_cache(policy: EvictionPolicy, cache: KVCache, budgets: jax.Array) -> KVCache:
    """Apply ``policy`` to every layer (``budgets [L]`` int32) and compact."""
    out = jax.vmap(lambda view, budget: evict(policy, view, budget))(_views(cache), budgets)
    return cache.replace(k=out.k, v=out.v, pos=out.pos, valid=out.valid, count=out.count, score=out.score)


def evict_if_needed(policy: EvictionPolicy, cache: KVCache, budgets: jax.Array, room) -> KVCache:
    """Evict when some layer has fewer than ``room`` free slots (every ``interval`` steps during decode)."""
    full = jnp.any(cache.count + room > cache.capacity)
    return jax.lax.cond(full, lambda c: evict_cache(policy, c, budgets), lambda c: c, cache)
