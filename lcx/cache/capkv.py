"""CAPKV (arXiv 2604.25975; kvpress ``CapPress``): keep the tokens whose values add the most *capacity* for the
queries to come - a query-weighted leverage score of each value.

Shapes: b batch, C slots, j KV heads sharing the slots, g query heads reading them, d / e head dim.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from lcx.cache.observes import Observes
from lcx.cache.policy import (PROTECT, ScoredPolicy, future_rotation, need_budget_above, need_original_positions,
                              register, unit)
from lcx.config_base import ConfigError


@register
@dataclasses.dataclass(frozen=True)
class CapKV(ScoredPolicy):
    """CAPKV: each query head's *anchor* is the mean of the queries seen so far (all but the first ``sinks``
    positions: the running mean the cache keeps, ``Observes(moments=1)``), rotated by RoPE averaged over the next
    ``horizon`` positions (as Expected Attention). A key's relevance is ``w = exp(tau x cos(anchor, key))`` (shifted
    by the row's largest); with the values as output directions, ``A = I + sum_i (w_i + epsilon) v_i v_i^T`` over the
    scored slots, and a token scores ``w_i x v_i^T A^-1 v_i`` (its value's leverage, weighted by relevance) - a
    token the likely queries reach whose value no other such token already spans. Averaged over a KV head's query
    group (per KV head by default; a shared keep set averages every head of the layer); the ``sinks`` first
    positions are always kept. Keys must stay at their original positions (the anchor is rotated to future ones).

    Parameters (kvpress's names): ``tau`` (5.0), ``horizon`` (``n_future_positions``, 512), ``sinks`` (``n_sink``,
    4), ``epsilon`` (1e-6).
    """

    name: ClassVar[str] = "capkv"
    tau: float = 5.0
    horizon: int = 512
    sinks: int = 4
    epsilon: float = 1e-6

    def __post_init__(self):
        super().__post_init__()
        if self.sinks < 0:
            raise ConfigError(f"cache.sinks={self.sinks} is invalid: must be >= 0")
        if self.horizon < 1:
            raise ConfigError(f"cache.horizon={self.horizon} is invalid: must be >= 1 (future positions averaged)")
        if self.tau <= 0 or self.epsilon < 0:
            raise ConfigError(f"cache.tau={self.tau} / cache.epsilon={self.epsilon} are invalid: tau > 0 (the "
                              "relevance temperature) and epsilon >= 0")
        need_original_positions(self, "it rotates the query mean to future original positions")

    @property
    def observes(self) -> Observes:  # the running query mean, sink queries left out as kvpress does
        return Observes(moments=1, moments_from=self.sinks, kv=True)

    def scores(self, view, budget):
        if view.q_mean is None:
            raise ValueError("capkv needs the query mean in its view (a slot cache built for it)")
        b, g, d = view.q_mean.shape
        group = g // view.k.shape[2]
        anchor = unit(future_rotation(view, self.horizon)(view.q_mean))  # [b, g, d]
        keys = jnp.repeat(unit(view.keys()), group, axis=2)  # [b, C, g, d] each query head's KV head
        values = jnp.repeat(view.values(), group, axis=2)
        scored = (view.valid & (view.pos >= self.sinks))[:, None, :]  # [b, 1, C]
        cosine = jnp.clip(jnp.einsum("bgd,bCgd->bgC", anchor, keys), -1.0, 1.0)
        logits = jnp.where(scored, self.tau * cosine, -jnp.inf)
        weights = jnp.where(scored, jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True)), 0.0)  # [b, g, C]
        mass = jnp.where(scored, weights + self.epsilon, 0.0)
        capacity = jnp.eye(d) + jnp.einsum("bgC,bCgd,bCge->bgde", mass, values, values)  # [b, g, d, e]
        solved = jnp.linalg.solve(capacity, jnp.einsum("bCgd->bgdC", values))  # A^-1 v for every slot
        leverage = jnp.einsum("bCgd,bgdC->bgC", values, solved)
        per_kv = jnp.mean((weights * leverage).reshape(b, -1, group, weights.shape[-1]), axis=2)  # [b, j, C]
        return jnp.mean(per_kv, axis=1) + jnp.where(view.valid & (view.pos < self.sinks), PROTECT, 0.0)

    def check(self, n_layers, budgets):
        need_budget_above(self.name, "cache.sinks", self.sinks, budgets)


__all__ = ["CapKV"]
