"""When and how much to evict: per-layer budgets, and eviction over all layers (and keep heads) of a slot cache.

Budgets: one number for every layer; a list (one per layer); or the ``pyramid`` schedule (PyramidKV, arXiv
2406.02069), budgets shrinking linearly with depth from 1.5x to 0.5x the given number (same total).
The capacity of the cache is ``max(budgets) + interval``: decode appends ``interval`` tokens between compactions.

Shapes: L layers, b batch, H keep heads (1 when a layer's KV heads share one set of tokens, kv_heads when each
keeps its own), C slots, k kv heads, d head dim. A policy sees one (layer, keep head) at a time: slots ``[b, C]``
with the keys and values of the KV heads that share them, ``[b, C, k / H, d]``.
"""

from __future__ import annotations

from typing import Any

import einops
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from lcx.cache.config import CacheConfig
from lcx.cache.policy import EvictionPolicy, SlotView, compact
from lcx.config_base import ConfigError


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


@flax.struct.dataclass
class Left:
    """What an eviction removed, in the slot layout before compaction: ``mask [L, b, H, C]`` marks the slots that
    left, with their positions and keys / values (``[L, b, C, k, d]``, as stored)."""

    mask: jax.Array
    pos: jax.Array
    k: jax.Array
    v: jax.Array


def _by_keep_head(x: jax.Array, heads: int) -> jax.Array:
    """``[L, b, C, k, d]`` -> ``[L, b, H, C, k / H, d]``."""
    return einops.rearrange(x, "L b C (H j) d -> L b H C j d", H=heads)


def evict_cache(policy: EvictionPolicy, cache: Any, budgets: jax.Array) -> tuple[Any, Left]:
    """Apply ``policy`` to every layer and keep head of a slot cache (``budgets [L]`` int32) and compact.

    Returns ``(cache, left)``."""
    n_layers, heads = cache.pos.shape[0], cache.pos.shape[2]
    views = SlotView(layer=jnp.arange(n_layers, dtype=jnp.int32), pos=cache.pos, valid=cache.valid,
                     count=cache.count, k=_by_keep_head(cache.k, heads), v=_by_keep_head(cache.v, heads),
                     score=cache.score, n_layers=n_layers)
    # vmap over layers (axis 0, the layer index too), then over keep heads (axis 1 of [b, H, ...]).
    one = lambda view, budget: compact(policy, view, budget)  # noqa: E731
    axes = SlotView(None, 1, 1, 1, 1, 1, 1, n_layers=n_layers)
    per_head = jax.vmap(one, in_axes=(axes, None), out_axes=(axes, 1))
    out, keep = jax.vmap(per_head)(views, budgets)  # keep [L, b, H, C]
    merge = lambda x: einops.rearrange(x, "L b H C j d -> L b C (H j) d")  # noqa: E731
    left = Left(mask=cache.valid & ~keep, pos=cache.pos, k=cache.k, v=cache.v)
    return cache.replace(k=merge(out.k), v=merge(out.v), pos=out.pos, valid=out.valid, count=out.count,
                         score=out.score), left


def evict_if_needed(policy: EvictionPolicy, cache: Any, budgets: jax.Array, room) -> Any:
    """Evict when some layer has fewer than ``room`` free slots (every ``interval`` steps during decode)."""
    full = jnp.any(cache.count + room > cache.pos.shape[-1])
    return jax.lax.cond(full, lambda c: evict_cache(policy, c, budgets)[0], lambda c: c, cache)


__all__ = ["Left", "evict_cache", "evict_if_needed", "layer_budgets"]
