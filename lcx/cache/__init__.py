"""KV cache and eviction: the cache pytree, the policy plug point and registry, built-in policies, simulation."""

from lcx.cache import policies  # noqa: F401  (registers the built-in policies)
from lcx.cache.kv_cache import KVCache, LayerCache, init_cache, kv_bytes
from lcx.cache.policy import EvictionPolicy, SlotView, evict, make_policy, register, registered, top_budget
from lcx.cache.schedule import evict_cache, evict_if_needed, layer_budgets
from lcx.cache.simulate import simulate

__all__ = ["EvictionPolicy", "KVCache", "LayerCache", "SlotView", "evict", "evict_cache", "evict_if_needed",
           "init_cache", "kv_bytes", "layer_budgets", "make_policy", "register", "registered", "simulate",
           "top_budget"]
