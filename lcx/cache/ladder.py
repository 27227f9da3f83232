"""LaCache ladder-shaped KV cache (arXiv 2507.14204), as an eviction policy.

Tokens between the sinks and the dense recent tail are grouped into runs of ``G = 1 + ceil((n - S) / (S - O))``
(n layers, span S, overlap O); laddering a run keeps ``A = min(ceil(S / (S - O)), G)`` consecutive tokens of it,
layer ``i`` starting at offset ``i mod (G - A + 1)``, so across layers the kept tokens form a staircase and every
old token survives in some layer. Nothing is evicted below the budget; on overflow just enough of the oldest runs
are laddered to free it. The per-slot score holds each token's ladder level (how often it was laddered): runs are
formed from the lowest level present, oldest first, so once the whole region has been laddered it is laddered
again with a larger stride ("start over") and older tokens become geometrically sparser.

Difference from the paper's cursor: after a start-over, newly exposed dense tokens (level 0) are laddered before
the pass over older level-1 tokens continues; the paper's cursor would finish the level-1 pass first. Both keep
the staircase and the older-is-sparser shape.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp

from lcx.cache.policy import EvictionPolicy, SlotView, register
from lcx.config_base import ConfigError

MAX_ROUNDS = 8  # ladder levels processed per compaction; each level thins by G / A


def ladder_shape(n_layers: int, span: int, overlap: int) -> tuple[int, int]:
    """(G, A): run length and tokens kept per run per layer."""
    run = 1 + math.ceil(max(n_layers - span, 0) / (span - overlap))
    kept = min(math.ceil(span / (span - overlap)), run)
    return run, kept


@register
@dataclasses.dataclass(frozen=True)
class Ladder(EvictionPolicy):
    name: ClassVar[str] = "ladder"
    position_mode: ClassVar[str] = "cache"
    sinks: int = 4
    span: int = 8
    overlap: int = 4
    recent: int | None = None  # dense tail; default: the layer count

    def __post_init__(self):
        super().__post_init__()
        if self.span <= self.overlap:
            raise ConfigError(f"cache.span={self.span} is invalid: must be > cache.overlap={self.overlap}")
        if self.overlap < 0 or self.sinks < 0:
            raise ConfigError(f"cache.overlap={self.overlap} and cache.sinks={self.sinks} must be >= 0")
        if self.recent is not None and self.recent < 0:
            raise ConfigError(f"cache.recent={self.recent} is invalid: must be >= 0")

    def check(self, n_layers, budgets):
        run, kept = ladder_shape(n_layers, self.span, self.overlap)
        if run <= kept:
            valid = [(s, o) for s in range(n_layers - 1, 0, -1) for o in range(s)
                     if ladder_shape(n_layers, s, o)[0] > ladder_shape(n_layers, s, o)[1]]
            hint = f"e.g. span={valid[0][0]}, overlap={valid[0][1]}" if valid else "a model with more layers"
            raise ConfigError(
                f"cache.policy='ladder' with span={self.span}, overlap={self.overlap} on {n_layers} layers cannot "
                f"reduce anything (runs of G={run} keep A={kept} tokens per layer); the span must be below the "
                f"layer count and G > A: {hint}")
        floor = self.sinks + self._recent(n_layers) + run
        small = [b for b in budgets if b < floor]
        if small:
            raise ConfigError(f"cache.budget={min(small)} is invalid for cache.policy='ladder': it must be at least "
                              f"sinks + recent + one run = {self.sinks} + {self._recent(n_layers)} + {run} = {floor}")

    def _recent(self, n_layers: int) -> int:
        return n_layers if self.recent is None else self.recent

    def select(self, view: SlotView, budget: jax.Array):
        run, kept = ladder_shape(view.n_layers, self.span, self.overlap)
        offset = view.layer % (run - kept + 1)
        fn = lambda pos, valid, level, count: _ladder_row(  # noqa: E731
            valid, level, count, budget, offset, sinks=self.sinks, recent=self._recent(view.n_layers), run=run,
            kept=kept)
        return jax.vmap(fn)(view.pos, view.valid, view.score, view.count)


def _ladder_row(valid, level, count, budget, offset, *, sinks: int, recent: int, run: int, kept: int):
    """One row (slots packed in position order): free ``count - budget`` slots by laddering the oldest runs."""
    j = jnp.arange(valid.shape[0])
    candidate = valid & (j >= sinks) & (j < count - recent)
    keep = valid
    need = jnp.maximum(count - budget, 0)
    freed = jnp.int32(0)
    floor = jnp.float32(-1.0)
    for _ in range(MAX_ROUNDS):
        alive = candidate & keep
        lvl = jnp.min(jnp.where(alive & (level > floor), level, jnp.inf))  # lowest level not yet processed
        members = alive & (level == lvl)
        index = jnp.cumsum(members) - 1  # position among this level's members, oldest first
        full_runs = jnp.sum(members) // run
        runs = jnp.clip(-(-(need - freed) // (run - kept)), 0, full_runs)
        laddered = members & (index // run < runs)
        within = index % run
        stays = (within >= offset) & (within < offset + kept)
        keep = keep & ~(laddered & ~stays)
        level = jnp.where(laddered & stays, lvl + 1, level)
        freed = freed + runs * (run - kept)
        floor = jnp.where(jnp.isfinite(lvl), lvl, floor)
    # Safety net (budgets the config checks make unreachable): drop the oldest non-sinks still over budget.
    excess = jnp.sum(keep) - budget
    droppable = keep & (j >= sinks)
    keep = keep & ~(droppable & (jnp.cumsum(droppable) - 1 < excess))
    return keep, level
