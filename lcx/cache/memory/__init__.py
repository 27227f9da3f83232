"""The tiered working / long-term memory (``cache.policy: memory``): working memory on the device, long-term blocks
in host memory or on disk, a router that recalls the blocks a query needs.

``policy.py`` (settings), ``kind.py`` (the cache type and spilling), ``attend.py`` (attention over the tiers),
``routers.py`` (quest, infllm, learned), ``blocks.py`` (contiguous and clustered blocks, int8 storage), ``store.py``
(host and disk stores), ``learned.py`` (the learned router's parameters), ``inspect.py`` (which blocks were
recalled).
"""

from lcx.cache.memory.kind import MemoryCache, MemoryKind
from lcx.cache.memory.policy import MemoryPolicy
from lcx.cache.memory.routers import Router, make_router, register_router

__all__ = ["MemoryCache", "MemoryKind", "MemoryPolicy", "Router", "make_router", "register_router"]
