"""Which positions an attention-free policy keeps, layer by layer, without running a model.

``simulate({"policy": "ladder", "budget": 64, "sinks": 4, "span": 4, "overlap": 0}, n_layers=16, length=512)``
decodes ``length`` tokens one at a time through the slot cache that generation uses (its write and eviction code,
with a one-element key per token) and returns ``kept [n_layers, length]``: True where position p is still cached at
the end. ``interval`` defaults to 1 here (compact at every step, the policy's exact shape); pass ``interval`` to see
the schedule generation uses. With ``kv_heads`` > 1 and a policy that keeps a set per KV head (``heads:
per_head``), the result is ``kept [n_layers, kv_heads, length]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lcx.cache.config import CacheConfig
from lcx.cache.slot_attention import write
from lcx.config_base import ConfigError
from lcx.model.config import ModelConfig


def simulate(policy: dict, n_layers: int, length: int, kv_heads: int = 1) -> np.ndarray:
    """Boolean ``[n_layers, length]`` (``[n_layers, kv_heads, length]`` for per-head keep sets): positions
    remaining in each layer's (and KV head's) cache after ``length`` decode steps."""
    spec = dict(policy)
    spec.setdefault("interval", 1)
    cache_cfg = CacheConfig.from_mapping(spec)
    pol = cache_cfg.make_policy()
    if not pol.observes.model_free or pol.cache_type != "slots":  # what it observes needs a model (Observes)
        raise ConfigError(f"cache.policy={pol.name!r} scores tokens from attention or keys; simulate() covers the "
                          "attention-free policies (full, window, streaming, ladder, random)")
    per_head = pol.evicts and pol.per_head and kv_heads > 1
    if not pol.evicts:
        return np.ones((n_layers, length), bool)
    # The smallest model the cache can hold: what is simulated is which slots survive, not their contents.
    model = ModelConfig(vocab_size=1, d_model=2 * kv_heads, n_layers=n_layers, n_heads=kv_heads,
                        n_kv_heads=kv_heads, d_ff=1, head_dim=2)
    kind = cache_cfg.kind(model)
    capacity = max(kind.budgets) + cache_cfg.interval
    kept = np.asarray(_jit_run(kind, capacity, length))  # [L, H, length]
    return kept if per_head else kept[:, 0]


def _run(kind, capacity: int, length: int) -> jax.Array:
    cache = kind.create(1, capacity)
    n_layers, heads = cache.k.shape[0], cache.pos.shape[2]
    zeros = jnp.zeros((1, 1, cache.k.shape[2], 2), cache.k.dtype)  # one new token [b, t, k, d]
    write_all = jax.vmap(write, in_axes=(0, None, None, None, None))

    def step(cache, p):
        cache = kind.make_room(cache, 1)
        layers = write_all(cache.layers(), zeros, zeros, jnp.full((1, 1), p, jnp.int32), jnp.ones((1, 1), bool))
        return cache.with_layers(layers, cache.lengths + 1), None

    cache, _ = jax.lax.scan(step, cache, jnp.arange(length, dtype=jnp.int32))
    pos = jnp.where(cache.valid[:, 0], cache.pos[:, 0], length)  # [L, H, C]; empty slots point past the end
    layer = jnp.broadcast_to(jnp.arange(n_layers)[:, None, None], pos.shape)
    head = jnp.broadcast_to(jnp.arange(heads)[None, :, None], pos.shape)
    return jnp.zeros((n_layers, heads, length), bool).at[layer, head, pos].set(True, mode="drop")


_jit_run = jax.jit(_run, static_argnums=(0, 1, 2))

__all__ = ["simulate"]
