"""KV cache and eviction."""

from lcx.cache.kv_cache import KVCache, LayerCache, init_cache, kv_bytes

__all__ = ["KVCache", "LayerCache", "init_cache", "kv_bytes"]
