"""Attention of new tokens against the KV cache: write, mask by position, optional rank positions and statistics.

Einsum legend / shapes: b batch, t new tokens, C cache slots, h query heads, k kv heads, d head dim.

Position modes (``EvictionPolicy.position_mode``):
- "original": keys are rotated at their true positions before they are stored; queries at theirs.
- "cache": keys are stored unrotated; at attention time slot j is rotated at its rank among the live slots and
  each query at its own rank, so the model sees positions 0 .. count-1 however far decoding has gone
  (StreamingLLM / LaCache). Slots are packed in position order, so rank = cumulative count of live slots.

Attention statistics (for H2O / TOVA / SnapKV): with ``stat_weights [b, t]`` (1 for queries that count), the
probabilities those queries give each slot, summed over queries and heads, are added to (``"sum"``) or replace
(``"replace"``) the slot's score.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from lcx import kernels
from lcx.cache.kv_cache import LayerCache, write
from lcx.config import ModelConfig
from lcx.model.rope import apply_rope, rope_tables
from lcx.sharding import BHD, BKS, BSKD, BTHD, LAYER_CACHE_AXES, ROWS, per_shard


def _decode(q, k, v, valid, return_weights=False):
    return kernels.decode_attention(q, k, v, valid=valid, return_weights=return_weights)


def _xla(q, k, v, mask, scale):
    return jax.nn.dot_product_attention(q, k.astype(q.dtype), v.astype(q.dtype), scale=scale, mask=mask[:, None])


def _flash_chunk(q, k, v, q_offsets, kv_lengths, scale):
    return kernels.flash_attention(q, k, v, causal=True, sm_scale=scale, kv_lengths=kv_lengths, q_offsets=q_offsets)


def _attend(q, k, v, mask, impl: str, stat_weights, q_offsets, kv_lengths):
    """``out [b, t, h, d]`` and, with ``stat_weights [b, t]``, the attention mass per slot ``[b, C]`` given by the
    queries whose weight is positive (summed over queries and heads).

    Live slots are packed in position order, so a chunk's query i (slot ``q_offsets + i``) sees slots
    ``<= q_offsets + i`` and ``< kv_lengths``: the flash kernel's causal mask with per-row offsets, the same set as
    ``mask`` - a prefill chunk never materializes the chunk x capacity matrix.
    """
    scale = q.shape[-1] ** -0.5
    stats = None
    if impl == "pallas" and q.shape[1] == 1:
        if stat_weights is not None:
            decode = functools.partial(_decode, return_weights=True)
            out, weights = per_shard(decode, (BHD, BSKD, BSKD, ROWS), (BHD, BKS))(q[:, 0], k, v, mask[:, 0])
            stats = jnp.sum(weights, axis=1) * (stat_weights[:, :1] > 0)  # [b, C]
        else:
            out = per_shard(_decode, (BHD, BSKD, BSKD, ROWS), BHD)(q[:, 0], k, v, mask[:, 0])
        return out[:, None], stats
    if impl == "pallas":
        flash = functools.partial(_flash_chunk, scale=scale)
        out = per_shard(flash, (BTHD, BSKD, BSKD, ROWS, ROWS), BTHD)(q, k, v, q_offsets, kv_lengths)
    elif impl == "xla":
        out = per_shard(functools.partial(_xla, scale=scale), (BTHD, BSKD, BSKD, ROWS), BTHD)(q, k, v, mask)
    else:
        reference = functools.partial(kernels.masked_attention_reference, sm_scale=scale)
        out = per_shard(reference, (BTHD, BSKD, BSKD, ROWS), BTHD)(q, k, v, mask)
    if stat_weights is not None:
        # Recomputes the probabilities of the counted queries only (a prefill chunk is bounded by its size).
        stat_mask = mask & (stat_weights[:, :, None] > 0)
        column_sums = functools.partial(kernels.masked_column_sums_reference, sm_scale=scale)
        stats = jnp.sum(per_shard(column_sums, (BTHD, BSKD, ROWS), BKS)(q, k, stat_mask), axis=1)  # [b, C]
    return out, stats


def attend_cache(config: ModelConfig, q, key, val, cos, sin, cache: LayerCache, positions, ok, *,
                 position_mode: str = "original", stat_update: str | None = None, stat_weights=None):
    """Append ``key, val [b, t, k, d]`` (unrotated) to ``cache`` and attend ``q [b, t, h, d]`` (unrotated) to it.

    ``cos, sin`` are the tables of ``positions`` (used in "original" mode). Returns ``(out, cache)``.
    """
    if position_mode == "original":
        q, key = apply_rope(q, cos, sin), apply_rope(key, cos, sin)
    layout = LayerCache(**LAYER_CACHE_AXES)  # each shard writes its rows and KV heads
    q_offsets = cache.count  # [b] the chunk's first slot
    cache = per_shard(write, (layout, BSKD, BSKD, ROWS, ROWS), layout)(cache, key, val, positions, ok)
    mask = cache.valid[:, None, :] & (cache.pos[:, None, :] <= positions[:, :, None])  # [b, t, C]
    k_att = cache.k
    if position_mode == "cache":
        ranks = jnp.maximum(jnp.cumsum(cache.valid, axis=1, dtype=jnp.int32) - 1, 0)  # [b, C]
        k_cos, k_sin = rope_tables(config, ranks)
        k_att = apply_rope(cache.k, k_cos, k_sin)
        q_rank = jnp.maximum(jnp.sum(mask, axis=-1, dtype=jnp.int32) - 1, 0)  # [b, t]
        q_cos, q_sin = rope_tables(config, q_rank)
        q = apply_rope(q, q_cos, q_sin)
    if stat_update is None:
        stat_weights = None
    out, stats = _attend(q, k_att, cache.v, mask, config.attention.impl, stat_weights, q_offsets, cache.count)
    if stats is not None:
        score = cache.score + stats if stat_update == "sum" else stats
        cache = cache.replace(score=jnp.where(cache.valid, score, 0.0))
    return out, cache
