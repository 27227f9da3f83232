"""A few queries per row against slots in the decode layout, in one pass over the keys and values.

Einsum legend: b batch, t queries, k kv heads, g query heads per kv head, s slots, d head dim.

A speculative verification scores ``k + 1`` tokens against the whole cache. The ``chunk`` kernels read keys
``[b, s, k, d]``, so a cache stored ``[b, k, s, d]`` (the slot cache's decode layout) would be transposed, a copy of
every layer's keys and values per call. The ``decode`` op reads that layout but takes one query, so vmapping it reads
the cache once per query. Here the ``t`` queries of a row are extra rows of the same product: each KV head's ``t x g``
queries against its slots, read once. Each query has its own live mask, its causal limit and window folded in by
the caller.

Same values as the ``decode`` op query by query, up to float32 summation order. ``k_scale, v_scale [b, k, s]`` (8-bit
codes): key scales multiply the logit columns, value scales the probability columns, as the other XLA ops fold them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lcx.kernels.tiled import _product


def few_query_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, valid: jax.Array, sm_scale: float,
                        softcap: float | None = None, count: jax.Array | None = None, residuals: bool = False,
                        k_scale: jax.Array | None = None, v_scale: jax.Array | None = None):
    """``q [b, t, h, d]`` against ``k, v [b, k, s, d]``; ``valid [b, t, s]`` or per KV head ``[b, k, t, s]``: the
    slots each query sees. Returns ``(out [b, t, h, d] in q's dtype, weights, m, l)``: ``weights [b, k, s]``
    float32, the probabilities the queries with ``count [b, t]`` True give each slot summed over them and each KV
    group (None without ``count``); ``m, l [b, t, h]`` each query's logit max and sum of exponentials with
    ``residuals`` (else None; a query that sees nothing: -inf, 0)."""
    b, t, h, d = q.shape
    kv = k.shape[1]
    qg = (q.reshape(b, t, kv, h // kv, d).astype(jnp.float32) * sm_scale).astype(q.dtype)
    scores = _product("btkgd,bksd->bktgs", qg, k.astype(q.dtype) if k_scale is not None else k)
    if k_scale is not None:
        scores = scores * k_scale[:, :, None, None, :].astype(jnp.float32)
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    mask = (valid[:, None] if valid.ndim == 3 else valid)[:, :, :, None, :]  # [b, k | 1, t, 1, s]
    scores = jnp.where(mask, scores, -jnp.inf)
    m = jnp.max(scores, axis=-1)  # [b, k, t, g]
    safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(scores - safe[..., None])
    l = jnp.sum(p, axis=-1)
    pv = p * v_scale[:, :, None, None, :].astype(jnp.float32) if v_scale is not None else p
    out = _product("bktgs,bksd->bktgd", pv.astype(q.dtype) if v.dtype != jnp.float32 else pv,
                   v.astype(q.dtype) if v_scale is not None else v)
    out = out / jnp.where(l > 0, l, 1.0)[..., None]
    to_rows = lambda x: jnp.moveaxis(x, 2, 1).reshape(b, t, h, *x.shape[4:])  # noqa: E731 - [b, k, t, g] -> [b, t, h]
    weights = None
    if count is not None:
        probs = p / jnp.where(l > 0, l, 1.0)[..., None]
        weights = jnp.einsum("bktgs,bt->bks", probs, count.astype(jnp.float32))
    return (to_rows(out).astype(q.dtype), weights, to_rows(m) if residuals else None,
            to_rows(l) if residuals else None)


__all__ = ["few_query_attention"]
