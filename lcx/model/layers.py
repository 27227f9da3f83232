"""Small building blocks of the decoder: RMSNorm and the SwiGLU MLP.

Einsum legend: b batch, t positions, e embed, f mlp hidden.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from lcx.model.config import ModelConfig
from lcx.model.params import as_dtype, declare, normal, ones


class RMSNorm(nn.Module):
    """RMSNorm with float32 statistics; the normalized value is cast back before the scale (as transformers)."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        scale = declare(self, "scale", (cfg.d_model,), ("norm",), ones, as_dtype(cfg.param_dtype))
        xf = x.astype(jnp.float32)
        var = jnp.mean(jnp.square(xf), axis=-1, keepdims=True)
        normed = (xf * jax.lax.rsqrt(var + cfg.norm_eps)).astype(cfg.dtype)
        return scale.astype(cfg.dtype) * normed


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        init, pdt, dt = normal(cfg.init_std), as_dtype(cfg.param_dtype), cfg.dtype
        w_gate = declare(self, "gate", (cfg.d_model, cfg.d_ff), ("embed", "mlp"), init, pdt)
        w_up = declare(self, "up", (cfg.d_model, cfg.d_ff), ("embed", "mlp"), init, pdt)
        w_down = declare(self, "down", (cfg.d_ff, cfg.d_model), ("mlp", "embed"), init, pdt)
        gate = jnp.einsum("bte,ef->btf", x, w_gate.astype(dt))  # [b, t, f]
        up = jnp.einsum("bte,ef->btf", x, w_up.astype(dt))  # [b, t, f]
        return jnp.einsum("btf,fe->bte", jax.nn.silu(gate) * up, w_down.astype(dt))  # [b, t, e]
