"""KeyDiff (arXiv 2504.15364; kvpress ``KeyDiffPress``): keep the keys least like the average key direction.

Shapes: b batch, C slots, j KV heads sharing the slots, d head dim.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from lcx.cache.observes import Observes
from lcx.cache.policy import ScoredPolicy, register, unit


@register
@dataclasses.dataclass(frozen=True)
class KeyDiff(ScoredPolicy):
    """KeyDiff: a key scores its negative cosine similarity to the *anchor*, the mean of the live keys' unit vectors
    (per KV head); tokens whose keys point where most keys point are evicted first, distinctive ones stay.
    Attention-free: it reads the cached keys only (``Observes(kv=True)``), so it needs no attention weights and runs
    with any attention kernel. Per KV head by default (as kvpress scores), with a shared keep set the heads' scores
    averaged; ``head_budget`` spreads budgets over heads as for any scored policy.

    kvpress scores the prompt's keys once after prefill (with the cache's keys, rotated at their positions); the
    paper compresses block by block (kvpress ``BlockPress``) - lcx's decode-time evictions every ``interval`` tokens
    rescore the live keys the same way, the anchor taken over them."""

    name: ClassVar[str] = "keydiff"
    observes: ClassVar[Observes] = Observes(kv=True)

    def scores(self, view, budget):
        keys = view.keys()  # [b, C, j, d] float32
        live = view.valid[:, :, None, None]
        count = jnp.maximum(jnp.sum(view.valid, axis=1), 1)[:, None, None]  # [b, 1, 1]
        anchor = jnp.sum(jnp.where(live, unit(keys), 0.0), axis=1) / count  # [b, j, d] mean unit key
        cosine = jnp.sum(unit(keys) * unit(anchor)[:, None], axis=-1)  # [b, C, j]
        return -jnp.mean(cosine, axis=-1)


__all__ = ["KeyDiff"]
