"""Small building blocks of the decoder: RMSNorm and the gated MLP.

Einsum legend: b batch, t positions, e embed, f mlp hidden.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from lcx.model.config import ModelConfig
from lcx.model.params import as_dtype, declare, normal, ones, zeros

ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


class RMSNorm(nn.Module):
    """RMSNorm with float32 statistics over the last axis (``dim``: default d_model; QK-norm: head_dim).

    Llama style (as transformers): the normalized value is cast back before the scale. Gemma style
    (``family.norm_offset``): the scale is ``1 + w`` (weights start at 0), applied in float32 before the cast."""

    config: ModelConfig
    dim: int | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        offset = cfg.block.norm_offset
        scale = declare(self, "scale", (self.dim or cfg.d_model,), ("norm",), zeros if offset else ones,
                        as_dtype(cfg.param_dtype))
        xf = x.astype(jnp.float32)
        var = jnp.mean(jnp.square(xf), axis=-1, keepdims=True)
        normed = xf * jax.lax.rsqrt(var + cfg.norm_eps)
        if offset:
            return (normed * (1.0 + scale.astype(jnp.float32))).astype(cfg.dtype)
        return scale.astype(cfg.dtype) * normed.astype(cfg.dtype)


class MLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)); act is SiLU (SwiGLU) or tanh-GELU (GeGLU) by family."""

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
        act = ACTIVATIONS[cfg.block.activation]
        return jnp.einsum("btf,fe->bte", act(gate) * up, w_down.astype(dt))  # [b, t, e]
