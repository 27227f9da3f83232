"""When and how much to evict: per-layer budgets, and eviction over all layers (and keep heads) of a slot cache.

Budgets: one number for every layer; a list (one per layer); or the ``pyramid`` schedule (PyramidKV, arXiv
2406.02069), budgets shrinking linearly with depth from ``2 - 1 / beta`` to ``1 / beta`` times the given number (same
total; ``cache.pyramid_beta``, default 2: 1.5x to 0.5x; PyramidKV's reference code and kvpress use 20).
The capacity of the cache is ``max(budgets) + interval``: decode appends ``interval`` tokens between compactions.

Shapes: L layers, b batch, H keep heads (1 when a layer's KV heads share one set of tokens, kv_heads when each
keeps its own), C slots, k kv heads, d head dim. A policy sees one (layer, keep head) at a time: slots ``[b, C]``
with the keys and values of the KV heads that share them, ``[b, C, k / H, d]`` (the policy API's layout; the cache
stores ``[b, k, C, d]``, so an eviction transposes them once - every ``interval`` steps, not every step).
"""

from __future__ import annotations

from typing import Any

import einops
import flax.struct
import jax
import jax.numpy as jnp

from lcx.cache.config import CacheConfig
from lcx.cache.policy import EvictionPolicy, SlotView, adaptive_keep, compact
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
        # PyramidKV's reference code: the deepest layer keeps budget / beta, the first 2 x budget - that, linear
        low = budget / cache.pyramid_beta
        high = 2 * budget - low
        step = (high - low) / (n_layers - 1)
        return tuple(max(1, int(round(high - layer * step))) for layer in range(n_layers))
    return (budget,) * n_layers


@flax.struct.dataclass
class Left:
    """What an eviction removed, in the slot layout before compaction: ``mask [L, b, H, C]`` marks the slots that
    left, with their positions and keys / values (``[L, b, k, C, d]``, as stored)."""

    mask: jax.Array
    pos: jax.Array
    k: jax.Array
    v: jax.Array


def _by_keep_head(x: jax.Array | None, heads: int) -> jax.Array | None:
    """``[L, b, k, C, ...]`` (stored; ``...``: the head dim, none for scales) -> ``[L, b, H, C, k / H, ...]`` (the
    policies' view)."""
    return None if x is None else einops.rearrange(x, "L b (H j) C ... -> L b H C j ...", H=heads)


def _per_layer_and_head(fn, head_out: Any, views: SlotView):
    """``fn(view, budget, *per_slot)`` mapped over layers (``views [L, b, H, ...]``, budgets ``[L]``) and keep heads
    (axis 1 of ``[b, H, ...]``); ``head_out``: the keep-head axis of each output (None: not per head)."""
    head_axes, layer_axes = views.vmap_axes("keep_heads"), views.vmap_axes("layers")  # as SlotView declares them

    def mapped(views, budgets, *per_slot):
        inner = jax.vmap(fn, in_axes=(head_axes, None, *[1] * len(per_slot)), out_axes=head_out)
        return jax.vmap(inner, in_axes=(layer_axes, 0, *[0] * len(per_slot)))(views, budgets, *per_slot)

    return mapped


def evict_cache(policy: EvictionPolicy, cache: Any, budgets: jax.Array) -> tuple[Any, Left]:
    """Apply ``policy`` to every layer and keep head of a slot cache (``budgets [L]`` int32) and compact.

    Returns ``(cache, left)``."""
    n_layers, heads = cache.pos.shape[0], cache.pos.shape[2]
    by_head = lambda x: None if x is None else einops.rearrange(x, "L b (H g) ... -> L b H g ...", H=heads)  # noqa
    views = SlotView(layer=jnp.arange(n_layers, dtype=jnp.int32), pos=cache.pos, valid=cache.valid,
                     count=cache.count, k=_by_keep_head(cache.k, heads), v=_by_keep_head(cache.v, heads),
                     score=cache.score, head=jnp.arange(heads, dtype=jnp.int32), lengths=cache.lengths,
                     k_scale=_by_keep_head(getattr(cache, "k_scale", None), heads),
                     v_scale=_by_keep_head(getattr(cache, "v_scale", None), heads),
                     q_count=getattr(cache, "q_count", None), q_mean=by_head(getattr(cache, "q_mean", None)),
                     q_m2=by_head(getattr(cache, "q_m2", None)), n_layers=n_layers,
                     model=getattr(cache.kind, "model", None))
    if policy.cross_layer:  # every (layer, head) of a row shares the pooled budgets: score all, pick jointly
        scores = _per_layer_and_head(policy.scores, 1, views)(views, budgets)  # [L, b, H, C]
        pool = lambda x: einops.rearrange(x, "L b H C -> b (L H) C")  # noqa: E731
        per_head = jnp.repeat(budgets, heads)  # [L x H]
        keep = jax.vmap(lambda s, ok, pos: adaptive_keep(policy, s, ok, pos, per_head))(
            pool(scores), pool(cache.valid), pool(cache.pos))
        keep, score = einops.rearrange(keep, "b (L H) C -> L b H C", H=heads), cache.score
    elif policy.adaptive and heads > 1:  # the heads of a layer share its budget: score them, then pick jointly
        scores = _per_layer_and_head(policy.scores, 1, views)(views, budgets)  # [L, b, H, C]
        rows = jax.vmap(lambda s, ok, pos, budget: adaptive_keep(policy, s, ok, pos, budget), in_axes=(0, 0, 0, None))
        keep, score = jax.vmap(rows)(scores, cache.valid, cache.pos, budgets), cache.score  # over layers
    else:
        keep, score = _per_layer_and_head(policy.select, (1, 1), views)(views, budgets)  # [L, b, H, C] each

    def pack(view, budget, keep, score):
        out = compact(view, keep, score)
        return out.pos, out.valid, out.count, out.k, out.v, out.score, out.k_scale, out.v_scale

    packed = _per_layer_and_head(pack, (1,) * 8, views)(views, budgets, keep, score)
    pos, valid, count, k, v, score, k_scale, v_scale = packed
    merge = lambda x: einops.rearrange(x, "L b H C j ... -> L b (H j) C ...")  # noqa: E731
    scales = jax.tree.map(merge, dict(k_scale=k_scale, v_scale=v_scale))  # a storage's per-slot scales, if any
    left = Left(mask=cache.valid & ~keep, pos=cache.pos, k=cache.k, v=cache.v)
    return cache.replace(k=merge(k), v=merge(v), pos=pos, valid=valid, count=count, score=score, **scales), left


__all__ = ["Left", "evict_cache", "layer_budgets"]
