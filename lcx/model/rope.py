"""Rotary position embeddings in the Hugging Face half-split ("rotate_half") layout: tables and rotation.

The frequencies and attention factor of every scaling type come from its registry entry
(``lcx.model.rope_scaling``). Static types are computed once in numpy (float64, rounded to float32 like
transformers' buffers); length-dependent types (dynamic NTK, LongRoPE) are computed from a traced length, so one
compiled function serves every length.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lcx.model import rope_scaling
from lcx.model.config import ModelConfig, RopeConfig


def inv_freq_and_factor(rope: RopeConfig, dim: int, max_position_embeddings: int,
                        seq_len: int | None = None) -> tuple[np.ndarray, float]:
    """Inverse frequencies ``[dim // 2]`` (float32) and attention factor for a sequence of ``seq_len`` tokens.

    ``seq_len`` only matters for the length-dependent types; None means "at most max_position_embeddings".
    """
    original = rope.original_max_position_embeddings or max_position_embeddings
    inv, m = rope_scaling.get(rope.type).inv_freq(rope, dim, max_position_embeddings, original, seq_len)
    return np.asarray(inv).astype(np.float32), float(m)


def inv_freq_for_length(config: ModelConfig, seq_len: jax.Array, rope: RopeConfig | None = None) -> jax.Array:
    """Inverse frequencies ``[rotary_dim // 2]`` for a traced ``seq_len`` (``rope``: default ``config.rope``)."""
    rope = rope or config.rope
    dim = int(config.head_dim * rope.partial_rotary_factor)
    kind = rope_scaling.get(rope.type)
    if kind.traced is None:
        return jnp.asarray(inv_freq_and_factor(rope, dim, config.max_position_embeddings)[0])
    original = rope.original_max_position_embeddings or config.max_position_embeddings
    return kind.traced(rope, dim, config.max_position_embeddings, original, seq_len)


def rope_tables(config: ModelConfig, positions: jax.Array, rope: RopeConfig | None = None,
                seq_len: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """cos and sin ``[b, t, rotary_dim]`` (float32, attention factor applied) for int ``positions [b, t]``, of
    ``rope`` (default ``config.rope``; a sliding-window layer's may differ, ``AttentionSpec.rope``).

    For length-dependent types the sequence length is ``seq_len``: by default ``max(positions) + 1`` over the
    whole batch, as in transformers; a cache that re-rotates its keys (``rope.rerotate``) passes each row's own
    ``[b]``, so that a row's rotations never depend on its batch-mates.
    """
    rope = rope or config.rope
    dim = int(config.head_dim * rope.partial_rotary_factor)
    inv, m = inv_freq_and_factor(rope, dim, config.max_position_embeddings)
    inv = jnp.asarray(inv, jnp.float32)
    if rope_scaling.get(rope.type).length_dependent:
        if seq_len is None or jnp.ndim(seq_len) == 0:
            inv = inv_freq_for_length(config, jnp.max(positions) + 1 if seq_len is None else seq_len, rope)
        else:  # per row: [b, 1, d/2], broadcast over the row's positions
            inv = inv_freq_for_length(config, jnp.asarray(seq_len)[:, None], rope)[:, None, :]
    freqs = positions.astype(jnp.float32)[..., None] * inv  # [b, t, d/2]
    angles = jnp.concatenate([freqs, freqs], axis=-1)  # [b, t, d]
    return jnp.cos(angles) * m, jnp.sin(angles) * m


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate ``x [b, t, heads, head_dim]``: the first ``rotary_dim`` dims in half-split pairs, the rest unchanged.

    ``cos, sin``: ``[b, t, rotary_dim]`` (one position per token) or ``[b, t, heads, rotary_dim]`` (per head).
    Computed in float32 (positions of long sequences need the mantissa), returned in ``x.dtype``.
    """
    if cos.ndim == 3:
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    dim = cos.shape[-1]
    xf = x.astype(jnp.float32)
    rot, rest = xf[..., :dim], xf[..., dim:]
    half = dim // 2
    rotated_half = jnp.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    out = rot * cos + rotated_half * sin
    if rest.shape[-1]:
        out = jnp.concatenate([out, rest], axis=-1)
    return out.astype(x.dtype)


__all__ = ["apply_rope", "inv_freq_and_factor", "inv_freq_for_length", "rope_tables"]
