"""``cache.policy: memory`` - the tiered working / long-term memory, its settings and their validation.

    cache: {policy: memory, sinks: 4, window: 1024, block: 64, topk: 8, router: quest, interval: 64}

- working memory: the ``sinks`` first tokens and the newest ``window`` tokens, on the device, full precision;
- long-term memory: tokens leaving the working memory are packed into blocks of ``block`` tokens (``blocks:
  contiguous`` - consecutive tokens - or ``cluster`` - the keys of a run of ``cluster_blocks`` blocks k-means
  clustered per KV head, so a block gathers similar keys), each with a small summary for routing, and stored in
  ``store: host`` (NumPy), ``disk`` (memory-mapped files under ``store_dir``) or ``device``; ``memory_dtype``
  (``bfloat16``, ``int8`` with a scale per block and head, ``int4`` / ``int2`` bit-packed in KIVI's groups - a
  block's keys per channel, its values per token over ``kv_group`` channels - or the cache dtype) is their
  precision there;
- a router (``quest``, ``infllm``, ``learned``) scores the blocks per layer and KV head against the current queries
  and recalls the top ``topk`` of them; attention covers working memory and recalled blocks, merged exactly.

``lexical: L`` gives ``L`` of the ``topk`` recalled blocks to the blocks sharing the most rare tokens with the last
``lexical_tokens`` tokens read (each shared token weighted by ``log(n / df)`` over the ``n`` blocks in the store,
``df`` the blocks holding it; a block sharing none is not forced), the same for every layer and KV head; the router
picks the rest. Why: on numbers hidden in prose the question's query vectors rank the needle's block low, while the
words the question repeats from the needle put it first (docs/real_model, "The memory tier on numbers in prose").
Contiguous blocks and one-level routing only. Under teacher forcing each query matches the tokens up to itself.

``route_groups: G`` routes in two levels for long stores: Quest scores groups of G blocks (their min / max keys
bound every block in them), then the blocks of the ``route_candidates`` best groups - the cost per step grows with
the number of groups, not of blocks.

``positions: original`` rotates every token at its true position (exact when every block is recalled);
``local`` (InfLLM-style) places the recalled tokens just before the working window and the window after them, so no
position exceeds ``sinks + topk * block + window`` plus the room of one call. ``route_queries``: how many of a
prefill chunk's last queries route it. ``budget`` (instead of ``window``) is the device KV budget
per layer and sequence: ``window = budget - sinks - topk * block``, so ablations compare policies at equal device
memory.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from lcx.cache.policy import CachePolicy, register
from lcx.config_base import ConfigError

ROUTERS = ("quest", "infllm", "learned")
BLOCKS = ("contiguous", "cluster")
STORES = ("host", "disk", "device")
POSITIONS = ("original", "local")
MEMORY_DTYPES = (None, "float32", "bfloat16", "float16", "int8", "int4", "int2")


@register
@dataclasses.dataclass(frozen=True)
class MemoryPolicy(CachePolicy):
    name: ClassVar[str] = "memory"
    cache_type: ClassVar[str] = "memory"
    evicts: ClassVar[bool] = True
    needs_budget: ClassVar[bool] = False  # the budget may set the window instead

    sinks: int = 4
    window: int | None = None
    block: int = 64
    topk: int = 8
    router: str = "quest"
    blocks: str = "contiguous"
    cluster_blocks: int = 4
    kmeans_iters: int = 8
    representatives: int = 4
    memory_dtype: str | None = None
    positions: str = "original"
    store: str = "host"
    store_dir: str | None = None
    router_path: str | None = None
    gate: bool = True
    route_queries: int = 8
    route_heads: str = "per_head"
    route_groups: int = 0
    route_candidates: int = 4
    lexical: int = 0
    lexical_tokens: int = 64

    def __post_init__(self):
        def positive(name, value, minimum=1):
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise ConfigError(f"cache.{name}={value!r} is invalid: must be an integer >= {minimum}")

        positive("sinks", self.sinks, 0)
        positive("block", self.block)
        positive("topk", self.topk)
        positive("representatives", self.representatives)
        positive("cluster_blocks", self.cluster_blocks)
        positive("kmeans_iters", self.kmeans_iters)
        positive("route_queries", self.route_queries)
        positive("route_groups", self.route_groups, 0)
        positive("route_candidates", self.route_candidates)
        positive("lexical", self.lexical, 0)
        positive("lexical_tokens", self.lexical_tokens)
        if self.window is not None:
            positive("window", self.window)
        for name, value, allowed in (("router", self.router, ROUTERS), ("blocks", self.blocks, BLOCKS),
                                     ("route_heads", self.route_heads, ("per_head", "shared")),
                                     ("store", self.store, STORES), ("positions", self.positions, POSITIONS)):
            if value not in allowed:
                raise ConfigError(f"cache.{name}={value!r} is invalid: must be one of {list(allowed)}")
        if self.memory_dtype not in MEMORY_DTYPES:
            names = [d for d in MEMORY_DTYPES if d]
            raise ConfigError(f"cache.memory_dtype={self.memory_dtype!r} is invalid: must be one of {names} or "
                              "null (the cache dtype)")
        if self.representatives > self.block:
            raise ConfigError(f"cache.representatives={self.representatives} is invalid: a block of {self.block} "
                              f"tokens has at most {self.block} representative keys")
        if self.store == "disk" and not self.store_dir:
            raise ConfigError("cache.store='disk' needs cache.store_dir: the directory for the memory-mapped blocks")
        if self.router == "learned" and not self.router_path:
            raise ConfigError("cache.router='learned' needs cache.router_path: the directory of trained router "
                              "parameters (lcx train-router CONFIG writes one)")
        if self.route_groups and self.router != "quest":
            raise ConfigError(f"cache.route_groups={self.route_groups} is invalid for cache.router={self.router!r}: "
                              f"two-level routing bounds groups of blocks with Quest's min / max keys; use "
                              f"router: quest or route_groups: 0")
        if self.lexical > self.topk:
            raise ConfigError(f"cache.lexical={self.lexical} is invalid: at most cache.topk={self.topk} of the "
                              f"recalled blocks can be chosen by shared tokens")
        if self.lexical and self.blocks != "contiguous":
            raise ConfigError(f"cache.lexical={self.lexical} is invalid with cache.blocks={self.blocks!r}: a block's "
                              f"tokens are matched as the consecutive tokens it holds; use blocks: contiguous")
        if self.lexical and self.route_groups:
            raise ConfigError(f"cache.lexical={self.lexical} is invalid with cache.route_groups="
                              f"{self.route_groups}: token matching scores every block, which two-level routing "
                              f"exists to avoid; use route_groups: 0")
        if self.blocks == "cluster" and self.cluster_blocks < 2:
            raise ConfigError(f"cache.cluster_blocks={self.cluster_blocks} is invalid for cache.blocks='cluster': "
                              f"k-means needs a run of at least 2 blocks ({2 * self.block} tokens) to form "
                              f"{self.block}-token blocks of similar keys")

    def resolve_window(self, budget: int | None) -> int:
        """The working window: ``window``, or what a device ``budget`` leaves after sinks and recalled blocks."""
        if self.window is not None:
            if budget is not None and budget != self.sinks + self.window + self.topk * self.block:
                raise ConfigError(f"cache.budget={budget} and cache.window={self.window} disagree for "
                                  f"cache.policy='memory': the device budget is sinks + window + topk * block = "
                                  f"{self.sinks + self.window + self.topk * self.block}; give one of them")
            return self.window
        if budget is None:
            raise ConfigError("cache.policy='memory' needs cache.window (the working window) or cache.budget (the "
                              "device KV budget: sinks + window + topk * block)")
        window = budget - self.sinks - self.topk * self.block
        if window < 1:
            raise ConfigError(f"cache.budget={budget} is invalid for cache.policy='memory': it must exceed sinks + "
                              f"topk * block = {self.sinks} + {self.topk} * {self.block} = "
                              f"{self.sinks + self.topk * self.block} (the rest is the working window)")
        return window

    @property
    def spill_tokens(self) -> int:
        """Tokens leaving the working memory together: one block, or a clustering run of ``cluster_blocks``."""
        return self.block * (self.cluster_blocks if self.blocks == "cluster" else 1)


__all__ = ["BLOCKS", "MEMORY_DTYPES", "MemoryPolicy", "POSITIONS", "ROUTERS", "STORES"]
