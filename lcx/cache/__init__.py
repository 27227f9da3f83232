"""Caches behind one contract (``base``), the eviction policies that plug into the slot cache, and simulation.

Importing this package registers the built-in cache types and policies.
"""

# register the built-in policies and cache types
from lcx.cache import capkv, keydiff, ladder, memory, paged, paged_slots, policies  # noqa: F401
from lcx.cache.base import CacheCapacityError, CacheKind, CacheState, kind_class, register_kind
from lcx.cache.config import CacheConfig
from lcx.cache.hybrid import HybridCache, HybridKind
from lcx.cache.kv_cache import KVCache, SlotCacheKind, full_kind, init_cache, kv_bytes
from lcx.cache.observes import Observes
from lcx.cache.paged import PagedCache, PagedKind
from lcx.cache.paged_slots import PagedSlotCache, PagedSlotKind
from lcx.cache.policy import (CachePolicy, EvictionPolicy, ScoredPolicy, SlotView, adaptive_keep, compact, evict,
                              make_policy, register, registered, top_budget)
from lcx.cache.schedule import Left, evict_cache, layer_budgets
from lcx.cache.schema import Field
from lcx.cache.simulate import simulate

__all__ = ["CacheCapacityError", "CacheConfig", "CacheKind", "CachePolicy", "CacheState", "EvictionPolicy", "Field",
           "HybridCache", "HybridKind", "KVCache", "Left", "Observes", "PagedCache", "PagedKind", "PagedSlotCache",
           "PagedSlotKind", "ScoredPolicy", "SlotCacheKind", "SlotView", "adaptive_keep", "compact", "evict",
           "evict_cache", "full_kind", "init_cache", "kind_class", "kv_bytes", "layer_budgets", "make_policy",
           "register", "register_kind", "registered", "simulate", "top_budget"]
