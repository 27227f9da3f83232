"""The KV cache: an immutable pytree of fixed capacity, threaded through the model as argument and return value.

Per layer and sequence it holds ``capacity`` slots of keys and values, the original token position of each slot,
and a live-slot mask; ``count`` is the number of occupied slots (occupied slots are packed at the front; eviction
compacts survivors back to the front), ``lengths`` the number of tokens each sequence has consumed (its next
position). Shapes are static under jit: eviction changes masks and contents, never shapes.

Einsum legend / shape letters: L layers, b batch, C capacity (slots), t new tokens, k kv heads, d head dim.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from lcx.config import ModelConfig, canonical_dtype


@flax.struct.dataclass
class LayerCache:
    """One layer's slice of the cache (what a scanned block sees)."""

    k: jax.Array  # [b, C, k, d]
    v: jax.Array  # [b, C, k, d]
    pos: jax.Array  # [b, C] int32 original token position; -1 in empty slots
    valid: jax.Array  # [b, C] bool live slots
    count: jax.Array  # [b] int32 occupied slots
    score: jax.Array  # [b, C] float32 per-slot statistic owned by the eviction policy (attention mass, level)


@flax.struct.dataclass
class KVCache:
    k: jax.Array  # [L, b, C, k, d]
    v: jax.Array  # [L, b, C, k, d]
    pos: jax.Array  # [L, b, C] int32
    valid: jax.Array  # [L, b, C] bool
    count: jax.Array  # [L, b] int32
    score: jax.Array  # [L, b, C] float32 policy statistic per slot
    lengths: jax.Array  # [b] int32 tokens consumed per sequence

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    def layers(self) -> LayerCache:
        """The per-layer view, stacked on the leading axis (``nn.scan`` slices it)."""
        return LayerCache(self.k, self.v, self.pos, self.valid, self.count, self.score)

    def with_layers(self, layers: LayerCache, lengths: jax.Array | None = None) -> "KVCache":
        lengths = self.lengths if lengths is None else lengths
        return KVCache(layers.k, layers.v, layers.pos, layers.valid, layers.count, layers.score, lengths)

    def kv_bytes(self) -> int:
        """Bytes of the key and value buffers: 2 x layers x kv_heads x head_dim x capacity x bytes x batch."""
        return int(self.k.size * self.k.dtype.itemsize + self.v.size * self.v.dtype.itemsize)

    def metadata_bytes(self) -> int:
        return int(sum(x.size * x.dtype.itemsize for x in (self.pos, self.valid, self.count, self.score, self.lengths)))


def kv_bytes(config: ModelConfig, capacity: int, batch: int, dtype: str) -> int:
    """Bytes of K and V for ``capacity`` slots: 2 x layers x kv_heads x head_dim x capacity x bytes x batch."""
    itemsize = np.dtype(jnp.dtype(canonical_dtype(dtype))).itemsize
    return 2 * config.n_layers * config.n_kv_heads * config.head_dim * capacity * itemsize * batch


def init_cache(config: ModelConfig, batch: int, capacity: int, dtype: str | None = None) -> KVCache:
    """An empty cache of ``capacity`` slots per layer and sequence."""
    if capacity <= 0 or batch <= 0:
        raise ValueError(f"{capacity=} and {batch=} must be positive")
    dt = jnp.dtype(canonical_dtype(dtype or config.dtype, "cache.dtype"))
    shape = (config.n_layers, batch, capacity, config.n_kv_heads, config.head_dim)
    return KVCache(
        k=jnp.zeros(shape, dt),
        v=jnp.zeros(shape, dt),
        pos=jnp.full(shape[:3], -1, jnp.int32),
        valid=jnp.zeros(shape[:3], bool),
        count=jnp.zeros(shape[:2], jnp.int32),
        score=jnp.zeros(shape[:3], jnp.float32),
        lengths=jnp.zeros((batch,), jnp.int32),
    )


def write(layer: LayerCache, k: jax.Array, v: jax.Array, positions: jax.Array, ok: jax.Array) -> LayerCache:
    """Append new tokens ``k, v [b, t, k, d]`` at ``positions [b, t]`` where ``ok [b, t]`` (padding is skipped).

    Tokens are appended after the occupied slots; the caller guarantees room (the capacity is planned on the host
    before anything runs, and eviction compacts before it would overflow). Slots past the capacity are dropped by
    the scatter, never wrapped.
    """
    capacity = layer.k.shape[1]
    rank = jnp.cumsum(ok.astype(jnp.int32), axis=1) - 1  # [b, t] rank among this call's real tokens
    slot = jnp.where(ok, layer.count[:, None] + rank, capacity)  # [b, t]; padding goes out of range
    rows = jnp.arange(k.shape[0])[:, None]  # [b, 1]
    return LayerCache(
        k=layer.k.at[rows, slot].set(k.astype(layer.k.dtype), mode="drop"),
        v=layer.v.at[rows, slot].set(v.astype(layer.v.dtype), mode="drop"),
        pos=layer.pos.at[rows, slot].set(positions.astype(jnp.int32), mode="drop"),
        valid=layer.valid.at[rows, slot].set(True, mode="drop"),
        count=layer.count + jnp.sum(ok, axis=1, dtype=jnp.int32),
        score=layer.score.at[rows, slot].set(0.0, mode="drop"),
    )
