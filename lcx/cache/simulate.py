"""Which positions an attention-free policy keeps, layer by layer, without running a model.

``simulate({"policy": "ladder", "budget": 64, "sinks": 4, "span": 4, "overlap": 0}, n_layers=16, length=512)``
decodes ``length`` tokens one at a time through the same eviction code that generation uses (a cache with no
key/value heads) and returns ``kept [n_layers, length]``: True where position p is still cached at the end.
``interval`` defaults to 1 here (compact at every step, the policy's exact shape); pass ``interval`` to see the
schedule generation uses.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lcx.cache.kv_cache import KVCache
from lcx.cache.schedule import evict_if_needed, layer_budgets
from lcx.config import CacheConfig, ConfigError


def simulate(policy: dict, n_layers: int, length: int) -> np.ndarray:
    """Boolean ``[n_layers, length]``: positions remaining in each layer's cache after ``length`` decode steps."""
    spec = dict(policy)
    spec.setdefault("interval", 1)
    cache_cfg = CacheConfig.from_mapping(spec)
    pol = cache_cfg.make_policy()
    if pol.attention_stat is not None or pol.name == "knorm":
        raise ConfigError(f"cache.policy={pol.name!r} scores tokens from attention or keys; simulate() covers the "
                          "attention-free policies (full, window, streaming, ladder, random)")
    if not pol.evicts:
        return np.ones((n_layers, length), bool)
    budgets = layer_budgets(cache_cfg, n_layers)
    pol.check(n_layers, budgets)
    capacity = max(budgets) + cache_cfg.interval
    return np.asarray(_jit_run(pol, jnp.asarray(budgets, jnp.int32), n_layers, capacity, length))


def _run(policy, budgets, n_layers: int, capacity: int, length: int) -> jax.Array:
    shape = (n_layers, 1, capacity)
    cache = KVCache(k=jnp.zeros(shape + (0, 1)), v=jnp.zeros(shape + (0, 1)), pos=jnp.full(shape, -1, jnp.int32),
                    valid=jnp.zeros(shape, bool), count=jnp.zeros(shape[:2], jnp.int32),
                    score=jnp.zeros(shape, jnp.float32), lengths=jnp.zeros((1,), jnp.int32))

    def step(cache: KVCache, p):
        cache = evict_if_needed(policy, cache, budgets, 1)
        slot = cache.count[:, 0]  # [L]: append after the occupied slots
        layers = jnp.arange(n_layers)
        cache = cache.replace(pos=cache.pos.at[layers, 0, slot].set(p), valid=cache.valid.at[layers, 0, slot].set(True),
                              score=cache.score.at[layers, 0, slot].set(0.0), count=cache.count + 1)
        return cache, None

    cache, _ = jax.lax.scan(step, cache, jnp.arange(length, dtype=jnp.int32))
    kept = jnp.zeros((n_layers, length), bool)
    rows = jnp.broadcast_to(jnp.arange(n_layers)[:, None], (n_layers, capacity))
    pos = jnp.where(cache.valid[:, 0], cache.pos[:, 0], length)  # empty slots point past the end: dropped
    return kept.at[rows, pos].set(True, mode="drop")


_jit_run = jax.jit(_run, static_argnums=(0, 2, 3, 4))
