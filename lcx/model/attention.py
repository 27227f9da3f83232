"""Grouped-query attention: projections -> RoPE -> attention implementation -> output projection.

Einsum legend: b batch, t positions, e embed, h query heads, k kv heads, d head dim.
Query heads are ordered by KV group (head h belongs to KV head h // n_groups), the Hugging Face order, so that
sharding "heads" and "kv_heads" contiguously over the same mesh axis keeps each query head with its KV head.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from lcx import kernels
from lcx.cache.kv_cache import LayerCache, write
from lcx.config import ModelConfig
from lcx.model.params import as_dtype, declare, normal, zeros
from lcx.model.rope import apply_rope


def cached_attention(q: jax.Array, cache: LayerCache, positions: jax.Array, impl: str) -> jax.Array:
    """Queries ``q [b, t, h, d]`` at ``positions [b, t]`` against every live cache slot at or before them.

    The mask comes from the slots' original positions and the live mask, so it is right for any slot order and for
    caches with holes (evicted slots).
    """
    mask = cache.valid[:, None, :] & (cache.pos[:, None, :] <= positions[:, :, None])  # [b, t, C]
    scale = q.shape[-1] ** -0.5
    if impl == "pallas" and q.shape[1] == 1:
        return kernels.decode_attention(q[:, 0], cache.k, cache.v, valid=mask[:, 0])[:, None]
    if impl == "xla":
        return jax.nn.dot_product_attention(q, cache.k.astype(q.dtype), cache.v.astype(q.dtype), scale=scale,
                                            mask=mask[:, None])
    return kernels.masked_attention_reference(q, cache.k, cache.v, mask, sm_scale=scale)


class Attention(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, cache: LayerCache | None = None,
                 positions: jax.Array | None = None, ok: jax.Array | None = None):
        """Self-attention over ``x [b, t, e]``; returns ``(out [b, t, e], cache)``.

        Without a cache the sequence attends causally to itself. With one, the new keys and values are appended
        (where ``ok``) and the queries attend to the cache by original position.
        """
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

        with jax.named_scope("rope"):
            q = apply_rope(q, cos, sin)
            key = apply_rope(key, cos, sin)
        with jax.named_scope(f"attention_{cfg.attention.impl}"):
            if cache is None:
                out = kernels.attention(q, key, val, impl=cfg.attention.impl, causal=True, sm_scale=d ** -0.5)
            else:
                cache = write(cache, key, val, positions, ok)
                out = cached_attention(q, cache, positions, cfg.attention.impl)
        out = jnp.einsum("bthd,hde->bte", out.astype(dt), wo.astype(dt))  # [b, t, e]
        if cfg.o_bias:
            out = out + declare(self, "o_bias", (e,), ("embed",), zeros, pdt).astype(dt)
        return out, cache
