"""Grouped-query attention: projections -> RoPE -> attention implementation -> output projection.

Einsum legend: b batch, t positions, e embed, h query heads, k kv heads, d head dim.
Query heads are ordered by KV group (head h belongs to KV head h // n_groups), the Hugging Face order, so that
sharding "heads" and "kv_heads" contiguously over the same mesh axis keeps each query head with its KV head.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from lcx import kernels, sharding
from lcx.cache.kv_cache import LayerCache
from lcx.config import ModelConfig
from lcx.model.cached_attention import attend_cache
from lcx.model.params import as_dtype, declare, normal, zeros
from lcx.model.rope import apply_rope
from lcx.sharding import BSKD, BTHD


class Attention(nn.Module):
    """Self-attention over ``x [b, t, e]``; returns ``(out [b, t, e], cache)``.

    Without a cache the sequence attends causally to itself. With one, the new keys and values are appended (where
    ``ok``) and the queries attend to the cache (``lcx.model.cached_attention``).
    """

    config: ModelConfig
    position_mode: str = "original"
    stat_update: str | None = None

    @nn.compact
    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, cache: LayerCache | None = None,
                 positions: jax.Array | None = None, ok: jax.Array | None = None,
                 stat_weights: jax.Array | None = None):
        cfg = self.config
        e, h, k, d = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        init, pdt, dt = normal(cfg.init_std), as_dtype(cfg.param_dtype), cfg.dtype
        wq = declare(self, "q", (e, h, d), ("embed", "heads", "head_dim"), init, pdt)
        wk = declare(self, "k", (e, k, d), ("embed", "kv_heads", "head_dim"), init, pdt)
        wv = declare(self, "v", (e, k, d), ("embed", "kv_heads", "head_dim"), init, pdt)
        wo = declare(self, "o", (h, d, e), ("heads", "head_dim", "embed"), init, pdt)

        q = jnp.einsum("bte,ehd->bthd", x, wq.astype(dt))  # [b, t, h, d]
        key = jnp.einsum("bte,ekd->btkd", x, wk.astype(dt))  # [b, t, k, d]
        val = jnp.einsum("bte,ekd->btkd", x, wv.astype(dt))  # [b, t, k, d]
        if cfg.qkv_bias:
            q = q + declare(self, "q_bias", (h, d), ("heads", "head_dim"), zeros, pdt).astype(dt)
            key = key + declare(self, "k_bias", (k, d), ("kv_heads", "head_dim"), zeros, pdt).astype(dt)
            val = val + declare(self, "v_bias", (k, d), ("kv_heads", "head_dim"), zeros, pdt).astype(dt)
        key, val = sharding.replicate_kv_heads(key, val, n_heads=h)  # [b, t, k*r, d] when a mesh replicates

        with jax.named_scope(f"attention_{cfg.attention.impl}"):
            if cache is None:
                q, key = apply_rope(q, cos, sin), apply_rope(key, cos, sin)
                attend = functools.partial(kernels.attention, impl=cfg.attention.impl, causal=True, sm_scale=d ** -0.5)
                out = sharding.per_shard(attend, (BTHD, BSKD, BSKD), BTHD)(q, key, val)  # no communication
            else:
                out, cache = attend_cache(cfg, q, key, val, cos, sin, cache, positions, ok,
                                          position_mode=self.position_mode, stat_update=self.stat_update,
                                          stat_weights=stat_weights)
        out = jnp.einsum("bthd,hde->bte", out.astype(dt), wo.astype(dt))  # [b, t, e]
        if cfg.o_bias:
            out = out + declare(self, "o_bias", (e,), ("embed",), zeros, pdt).astype(dt)
        return out, cache
