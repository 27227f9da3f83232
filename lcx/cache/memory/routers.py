"""Memory routers: per layer and KV head, score the long-term blocks against the current queries.

Einsum legend: b batch, t queries, n blocks, j tokens of a block, k kv heads, g query heads per kv head, d head dim,
r representatives / router rank.

A router declares the per-block summary it needs (``summary_fields``), computes it when blocks are formed
(``summarize``, on the device, from the block's keys and the attention they received in the working memory) and
scores blocks (``score``) from the pooled query of the current step or prefill chunk: ``[b, k, n]``, higher is
recalled first. Scores are summed over the query heads of each KV group.

- ``quest``: element-wise min and max of the block's keys; score ``sum_d max(q_d min_d, q_d max_d)``, an upper
  bound of ``q . k`` over the block (Quest).
- ``infllm``: the ``representatives`` keys that received the most attention while in the working window; score
  ``max_r q . rep_r`` (InfLLM).
- ``learned``: a small trained router (``lcx.cache.memory.learned``): projections of the query and of the block's
  mean / min / max keys, and a gate deciding whether recalling is needed at all.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping
from typing import ClassVar

import einops
import jax
import jax.numpy as jnp

from lcx.cache.schema import Field
from lcx.config_base import name_registry

SUMMARY_AXES = ("layers", "batch", "blocks", "kv_heads")


def group_queries(q: jax.Array, kv_heads: int) -> jax.Array:
    """``[b, h, d]`` -> ``[b, k, g, d]`` (query heads grouped by their KV head)."""
    return einops.rearrange(q, "b (k g) d -> b k g d", k=kv_heads)


@dataclasses.dataclass(frozen=True)
class Router(abc.ABC):
    """Scores long-term memory blocks. ``representatives`` is used by routers that keep several keys per block."""

    name: ClassVar[str] = ""
    needs_attention: ClassVar[bool] = False  # whether summaries use the attention tokens received (InfLLM)
    representatives: int = 4

    @abc.abstractmethod
    def summary_fields(self) -> Mapping[str, Field]:
        """Per-block summary buffers (axes start with :data:`SUMMARY_AXES`)."""

    @abc.abstractmethod
    def summarize(self, keys: jax.Array, received: jax.Array) -> dict[str, jax.Array]:
        """Summaries of blocks: ``keys [b, n, j, k, d]``, ``received [b, n, j, k]`` (attention each token got in the
        working memory) -> ``{name: [b, n, k, ...]}``."""

    @abc.abstractmethod
    def score(self, q: jax.Array, summaries: Mapping[str, jax.Array], params: Mapping[str, jax.Array] | None
              ) -> jax.Array:
        """``q [b, h, d]`` (the pooled query, float32) against ``summaries {name: [b, n, k, ...]}`` -> ``[b, k, n]``."""

    def gate(self, q: jax.Array, params: Mapping[str, jax.Array] | None, kv_heads: int) -> jax.Array | None:
        """Whether to recall at all, ``[b, k]`` bool; None: always."""
        return None


_ROUTERS: dict[str, type[Router]] = {}


register_router = name_registry(_ROUTERS, "memory router")


def make_router(name: str, representatives: int = 4) -> Router:
    return _ROUTERS[name](representatives=representatives)


@register_router
@dataclasses.dataclass(frozen=True)
class Quest(Router):
    name: ClassVar[str] = "quest"

    def summary_fields(self):
        return {"kmin": Field(SUMMARY_AXES + ("head_dim",), "float32"),
                "kmax": Field(SUMMARY_AXES + ("head_dim",), "float32")}

    def summarize(self, keys, received):
        k = keys.astype(jnp.float32)
        return {"kmin": jnp.min(k, axis=2), "kmax": jnp.max(k, axis=2)}  # [b, n, k, d]

    def score(self, q, summaries, params):
        qg = group_queries(q, summaries["kmin"].shape[2])  # [b, k, g, d]
        lo = jnp.einsum("bkgd,bnkd->bkgnd", qg, summaries["kmin"])
        hi = jnp.einsum("bkgd,bnkd->bkgnd", qg, summaries["kmax"])
        return jnp.sum(jnp.maximum(lo, hi), axis=(2, 4))  # [b, k, n]


@register_router
@dataclasses.dataclass(frozen=True)
class InfLLM(Router):
    name: ClassVar[str] = "infllm"
    needs_attention: ClassVar[bool] = True

    def summary_fields(self):
        return {"reps": Field(SUMMARY_AXES + ("representatives", "head_dim"), "float32")}

    def summarize(self, keys, received):
        top = jax.lax.top_k(einops.rearrange(received, "b n j k -> b n k j"), self.representatives)[1]  # [b,n,k,r]
        k = einops.rearrange(keys.astype(jnp.float32), "b n j k d -> b n k j d")
        return {"reps": jnp.take_along_axis(k, top[..., None], axis=3)}  # [b, n, k, r, d]

    def score(self, q, summaries, params):
        qg = group_queries(q, summaries["reps"].shape[2])
        dots = jnp.einsum("bkgd,bnkrd->bkgnr", qg, summaries["reps"])
        return jnp.sum(jnp.max(dots, axis=-1), axis=2)  # [b, k, n]


@register_router
@dataclasses.dataclass(frozen=True)
class Learned(Router):
    """Score ``sum_g (q_g W_q) . (s W_s) / sqrt(r)`` with ``s`` the block's mean, min and max keys; gate
    ``sigmoid(mean_g(q_g) . w + c) > 1/2``. Parameters per layer come from ``lcx.cache.memory.learned``."""

    name: ClassVar[str] = "learned"

    def summary_fields(self):
        return {"kstats": Field(SUMMARY_AXES + ("stats", "head_dim"), "float32")}

    def summarize(self, keys, received):
        k = keys.astype(jnp.float32)
        return {"kstats": jnp.stack([jnp.mean(k, axis=2), jnp.min(k, axis=2), jnp.max(k, axis=2)], axis=3)}

    def score(self, q, summaries, params):
        stats = summaries["kstats"]  # [b, n, k, 3, d]
        qg = group_queries(q, stats.shape[2])  # [b, k, g, d]
        qp = jnp.einsum("bkgd,dr->bkr", qg, params["w_query"])  # summed over the group
        sp = jnp.einsum("bnksd,sdr->bnkr", stats, params["w_block"])
        return jnp.einsum("bkr,bnkr->bkn", qp, sp) * params["w_query"].shape[-1] ** -0.5

    def gate(self, q, params, kv_heads):
        qg = jnp.mean(group_queries(q, kv_heads), axis=2)  # [b, k, d]
        return jnp.einsum("bkd,d->bk", qg, params["gate_w"]) + params["gate_b"] > 0.0


__all__ = ["InfLLM", "Learned", "Quest", "Router", "SUMMARY_AXES", "group_queries", "make_router",
           "register_router"]
