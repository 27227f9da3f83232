"""The optimizer: learning-rate schedule (linear warmup + cosine) and AdamW with global-norm clipping.

Weight decay applies to weight matrices only: norm scales and biases are excluded (decaying a norm scale towards 0
fights the normalization it is part of). The optimizer state follows the params' dtype, float32 master weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from lcx.train.config import TrainConfig


def lr_schedule(train: TrainConfig) -> optax.Schedule:
    """``step -> lr``: ``lr * (step + 1) / warmup_steps`` during warmup, then cosine from ``lr`` to
    ``lr * min_lr_ratio`` at ``steps`` (constant after). Step 0 already gets a non-zero rate, so no step is wasted.
    """
    peak, floor = train.lr, train.lr * train.min_lr_ratio
    warmup, total = train.warmup_steps, train.steps

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        warm = peak * jnp.minimum(1.0, (step + 1.0) / max(warmup, 1))
        progress = jnp.clip((step - warmup) / max(total - warmup, 1), 0.0, 1.0)
        cosine = floor + 0.5 * (peak - floor) * (1.0 + jnp.cos(jnp.pi * progress))
        return jnp.where(step < warmup, warm, cosine)

    return schedule


def decay_mask(params) -> dict:
    """True for the leaves weight decay applies to: everything but norm scales and biases."""

    def decays(path, _leaf) -> bool:
        name = str(getattr(path[-1], "key", path[-1]))
        return not (name == "scale" or name.endswith("bias"))

    return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(train: TrainConfig) -> optax.GradientTransformation:
    """Clip the global gradient norm (if ``grad_clip``), then AdamW with ``lr_schedule``."""
    adamw = optax.adamw(lr_schedule(train), b1=train.b1, b2=train.b2, eps=train.eps,
                        weight_decay=train.weight_decay, mask=decay_mask)
    if train.grad_clip is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(train.grad_clip), adamw)


__all__ = ["decay_mask", "lr_schedule", "make_optimizer"]
