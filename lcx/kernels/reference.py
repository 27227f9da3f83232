"""Pure-jnp attention: the oracle every kernel is tested against, and the ``reference`` model implementation.

Einsum legend: b batch, t query positions, s key positions, k kv heads, g query heads per kv head, d head dim.
Query head h = k * g + g_index, i.e. heads are grouped by KV head (the Hugging Face ``repeat_kv`` order).
Everything is computed in float32 at HIGHEST precision; the output has the dtype of ``q``.
``softcap`` (Gemma 2): the scaled logits ``z`` become ``softcap * tanh(z / softcap)`` before masking and softmax.
"""

from __future__ import annotations

import einops
import jax
import jax.numpy as jnp

from lcx.kernels.mode import target_backend

_HI = jax.lax.Precision.HIGHEST
_LOW = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _product(legend: str, a: jax.Array, b: jax.Array, precision) -> jax.Array:
    """``einsum(legend, a, b)`` accumulated in float32.

    On CPU, bfloat16 / float16 operands are widened to float32 first. XLA:CPU has no low-precision -> float32 dot
    of its own (``DotThunk: Unsupported element type ... BF16 x BF16 = F32``); only the layouts its YNNPACK
    fusions take run, and which layout a product gets depends on the surrounding program (a batch-2, 256-token
    bfloat16 prefill crashed). Widening changes no value: the product of two bfloat16 / float16 numbers is exact in
    float32, so the dot is the same float32 accumulation of the same products."""
    if target_backend() == "cpu" and (a.dtype in _LOW or b.dtype in _LOW):
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return jnp.einsum(legend, a, b, precision=precision, preferred_element_type=jnp.float32)


def attention_mask(q_len: int, kv_len: int, *, causal: bool, window: int | None = None,
                   kv_lengths: jax.Array | None = None, batch: int = 1,
                   q_offsets: jax.Array | None = None, segment_ids: jax.Array | None = None) -> jax.Array:
    """Boolean mask ``[batch, q_len, kv_len]``, True where a query may attend to a key; ``[batch, kv_heads, q_len,
    kv_len]`` when ``kv_lengths`` or ``q_offsets`` is given per row and KV head (``[batch, kv_heads]``).

    Causal alignment puts the queries at the end of the keys: query i sits at key position ``kv_len - q_len + i``
    (a prefill chunk attending to the cache plus itself), or at ``q_offsets[b] + i`` when ``q_offsets [batch]`` is
    given (a chunk written at slot ``q_offsets[b]`` of a cache). ``window`` keeps that many keys back, the query's
    own position included. ``kv_lengths [batch]`` marks keys at or past the length as padding. ``segment_ids
    [batch, len]`` (self-attention, ``q_len == kv_len``): a query sees only keys of its own segment - documents
    packed into one row never attend to each other.
    """
    per_head = any(x is not None and jnp.ndim(x) == 2 for x in (kv_lengths, q_offsets))

    def rows(x):  # [batch] or [batch, kv_heads] -> [batch, heads, 1, 1]
        x = jnp.asarray(x)
        return (x[:, None] if x.ndim == 1 else x)[:, :, None, None]

    if q_offsets is None:
        q_pos = jnp.arange(q_len)[None, None, :, None] + (kv_len - q_len)  # [1, 1, t, 1]
    else:
        q_pos = jnp.arange(q_len)[None, None, :, None] + rows(q_offsets)  # [b, K, t, 1]
    k_pos = jnp.arange(kv_len)[None, None, None, :]  # [1, 1, 1, s]
    mask = jnp.ones((1, 1, q_len, kv_len), bool)
    if causal:
        mask &= k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    if kv_lengths is not None:
        mask &= k_pos < rows(kv_lengths)
    if segment_ids is not None:
        seg = jnp.asarray(segment_ids)
        if seg.shape != (batch, q_len) or q_len != kv_len:
            raise ValueError(f"segment_ids.shape={seg.shape} must be (batch, len) = ({batch}, {q_len}) of a "
                             f"self-attention (q_len={q_len} == kv_len={kv_len})")
        mask = mask & (seg[:, None, :, None] == seg[:, None, None, :])
    if per_head:
        return jnp.broadcast_to(mask, (batch, mask.shape[1], q_len, kv_len))
    return jnp.broadcast_to(mask[:, 0], (batch, q_len, kv_len))


def _head_mask(mask: jax.Array) -> jax.Array:
    """A mask ``[b, t, s]`` (every KV head) or ``[b, k, t, s]`` (per KV head) as ``[b, k | 1, 1, t, s]``, broadcast
    against scores ``[b, k, g, t, s]``."""
    return mask[:, None, None] if mask.ndim == 3 else mask[:, :, None]


def capped(scores: jax.Array, softcap: float | None) -> jax.Array:
    """``softcap * tanh(scores / softcap)``, or ``scores`` when ``softcap`` is None."""
    return scores if softcap is None else softcap * jnp.tanh(scores / softcap)


def _masked_scores(q, k, mask, sm_scale, precision, softcap=None):
    """Scaled (and capped) logits ``[b, k, g, t, s]`` (float32), -inf where ``mask [b, t, s]`` (or ``[b, k, t, s]``)
    is False."""
    b, t, h, d = q.shape
    kv_heads = k.shape[2]
    if h % kv_heads:
        raise ValueError(f"{h=} query heads must be a multiple of {kv_heads=} key/value heads")
    scale = d ** -0.5 if sm_scale is None else sm_scale
    qg = einops.rearrange(q, "b t (k g) d -> b t k g d", k=kv_heads)
    scores = capped(_product("btkgd,bskd->bkgts", qg, k.astype(q.dtype), precision) * scale, softcap)
    if mask is not None:
        scores = jnp.where(_head_mask(mask), scores, -jnp.inf)
    return scores


def _softmax_parts(scores):
    """``(p unnormalized, row max, row sum)``; a fully masked row has max -inf, p 0 and sum 0, never NaN."""
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    # Subtracting 0 instead of -inf in a fully masked row keeps exp(-inf) = 0 and the row sum 0.
    p = jnp.exp(scores - jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    return p, row_max[..., 0], jnp.sum(p, axis=-1)


def masked_probs(q: jax.Array, k: jax.Array, mask: jax.Array | None, *, sm_scale: float | None = None,
                 precision=_HI, softcap: float | None = None) -> jax.Array:
    """Softmax probabilities ``[b, k, g, t, s]`` (float32) of ``q [b, t, h, d]`` over ``k [b, s, k, d]`` with an
    explicit boolean ``mask [b, t, s]`` or ``[b, k, t, s]``; fully masked rows are all 0, never NaN."""
    if precision == _HI:
        q, k = q.astype(jnp.float32), k.astype(jnp.float32)
    p, _, denom = _softmax_parts(_masked_scores(q, k, mask, sm_scale, precision, softcap))
    return p / jnp.where(denom == 0, 1.0, denom)[..., None]


def masked_attention_parts(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None, *,
                           sm_scale: float | None = None, precision=_HI, softcap: float | None = None):
    """Softmax attention with ``mask [b, t, s]`` (or per KV head ``[b, k, t, s]``) as a partial: ``(o [b, t, h, d]
    float32, m [b, t, h], l [b, t, h])``, natural-log row max and sum of exponentials
    (``lcx.kernels.merge_partials``); empty rows: 0, -inf, 0.

    ``precision=HIGHEST`` computes in float32 (the oracle); the default precision keeps the input dtype for the
    products and accumulates in float32 (the XLA backend)."""
    b, t, h, d = q.shape
    if precision == _HI:
        q, k, v = q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32)
    p, m, l = _softmax_parts(_masked_scores(q, k, mask, sm_scale, precision, softcap))  # [b, k, g, t, s], [b, k, g, t]
    o = _product("bkgts,bskd->btkgd", p.astype(v.dtype) if precision != _HI else p, v.astype(q.dtype),
                 precision)  # [b, t, k, g, d]
    o = o / jnp.where(l == 0, 1.0, l).transpose(0, 3, 1, 2)[..., None]
    to_rows = lambda x: einops.rearrange(x, "b k g t -> b t (k g)")  # noqa: E731
    return einops.rearrange(o, "b t k g d -> b t (k g) d"), to_rows(m), to_rows(l)


def masked_attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None,
                               *, sm_scale: float | None = None, softcap: float | None = None) -> jax.Array:
    """Softmax attention with an explicit boolean ``mask [b, t, s]``; fully masked rows give 0, never NaN."""
    return masked_attention_parts(q, k, v, mask, sm_scale=sm_scale, softcap=softcap)[0].astype(q.dtype)


def attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True,
                        sm_scale: float | None = None, window: int | None = None,
                        kv_lengths: jax.Array | None = None, q_offsets: jax.Array | None = None,
                        segment_ids: jax.Array | None = None, softcap: float | None = None) -> jax.Array:
    """Reference for ``flash_attention``: ``q [b, t, h, d]``, ``k, v [b, s, k, d]`` -> ``[b, t, h, d]``; ``kv_lengths``,
    ``q_offsets [b]``, ``segment_ids [b, t]`` as in :func:`attention_mask`."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be [batch, len, heads, head_dim]; got {q.shape=}, {k.shape=}, {v.shape=}")
    mask = None
    if causal or window is not None or kv_lengths is not None or segment_ids is not None:
        mask = attention_mask(q.shape[1], k.shape[1], causal=causal, window=window, kv_lengths=kv_lengths,
                              batch=q.shape[0], q_offsets=q_offsets, segment_ids=segment_ids)
    return masked_attention_reference(q, k, v, mask, sm_scale=sm_scale, softcap=softcap)


def decode_attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, *, valid: jax.Array | None = None,
                               lengths: jax.Array | None = None, return_weights: bool = False,
                               sm_scale: float | None = None, return_residuals: bool = False, precision=_HI,
                               softcap: float | None = None, k_scale: jax.Array | None = None,
                               v_scale: jax.Array | None = None):
    """Reference for ``decode_attention``: ``q [b, h, d]``, ``k, v [b, k, s, d]`` (the slot cache's layout: each KV
    head's slots contiguous), ``valid [b, s]`` or ``[b, k, s]``, ``lengths [b]`` or ``[b, k]``.

    Returns ``out [b, h, d]``; with ``return_weights`` also ``weights [b, k, s]`` (the probabilities summed over the
    query heads of each KV head's group); with ``return_residuals`` then the row max and sum of exponentials
    ``m, l [b, h]``.

    Both products contract with K / V in their stored layout (batch dims b, k leading), which XLA runs without
    copying the cache: with ``[b, s, k, d]`` it transposed every layer's keys and values on every decode step.

    ``k_scale, v_scale [b, k, s]``: 8-bit ``k, v`` codes (``lcx.kernels.quant``); the scales multiply the logit and
    probability columns, so no float copy of the cache is made (the codes are widened inside the products).
    """
    b, kv_heads, s, d = k.shape
    mask = jnp.ones((b, 1, s), bool) if valid is None else valid.astype(bool).reshape(b, -1, s)  # [b, k | 1, s]
    if lengths is not None:
        lengths = jnp.asarray(lengths)
        lengths = lengths[:, None] if lengths.ndim == 1 else lengths
        mask = mask & (jnp.arange(s)[None, None, :] < lengths[:, :, None])
    if q.shape[1] % kv_heads:
        raise ValueError(f"{q.shape[1]} query heads must be a multiple of {kv_heads=} key/value heads")
    scale = d ** -0.5 if sm_scale is None else sm_scale
    dtype = q.dtype
    if precision == _HI:
        q, k, v = q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32)
    qg = einops.rearrange(q, "b (k g) d -> b k g d", k=kv_heads)
    scores = _product("bkgd,bksd->bkgs", qg, k.astype(q.dtype), precision) * scale
    if k_scale is not None:
        scores = scores * k_scale.astype(jnp.float32)[:, :, None, :]
    scores = jnp.where(mask[:, :, None, :], capped(scores, softcap), -jnp.inf)  # [b, k, g, s]
    p, m, l = _softmax_parts(scores)  # [b, k, g, s], [b, k, g], [b, k, g]
    pv = p if v_scale is None else p * v_scale.astype(jnp.float32)[:, :, None, :]
    low = v.dtype if v_scale is None else q.dtype  # 8-bit codes: the products run in the query's dtype
    o = _product("bkgs,bksd->bkgd", pv.astype(low) if precision != _HI else pv, v.astype(q.dtype), precision)
    denom = jnp.where(l == 0, 1.0, l)[..., None]
    to_heads = lambda x: einops.rearrange(x, "b k g ... -> b (k g) ...")  # noqa: E731
    results = [to_heads(o / denom).astype(dtype)]
    if return_weights:
        results.append(jnp.sum(p / denom, axis=2))  # [b, k, s]
    if return_residuals:
        results += [to_heads(m), to_heads(l)]
    return results[0] if len(results) == 1 else tuple(results)


def attention_column_sums_reference(q: jax.Array, k: jax.Array, *, causal: bool = True,
                                    sm_scale: float | None = None, window: int | None = None,
                                    kv_lengths: jax.Array | None = None, q_offsets: jax.Array | None = None,
                                    query_weights: jax.Array | None = None, softcap: float | None = None
                                    ) -> jax.Array:
    """Reference for ``attention_column_sums``: probabilities of ``q [b, t, h, d]`` over ``k [b, s, k, d]`` (masks as
    in ``attention_reference``; only queries with ``query_weights [b, t] > 0`` when given) summed over the queries
    and each KV head's query group -> ``[b, k, s]`` float32."""
    mask = attention_mask(q.shape[1], k.shape[1], causal=causal, window=window, kv_lengths=kv_lengths,
                          batch=q.shape[0], q_offsets=q_offsets)
    if query_weights is not None:
        counted = jnp.asarray(query_weights) > 0  # [b, t]
        mask &= counted[:, :, None] if mask.ndim == 3 else counted[:, None, :, None]
    return masked_column_sums_reference(q, k, mask, sm_scale=sm_scale, softcap=softcap)


def masked_column_sums_reference(q: jax.Array, k: jax.Array, mask: jax.Array | None, *,
                                 sm_scale: float | None = None, precision=_HI, softcap: float | None = None
                                 ) -> jax.Array:
    """Column sums with an explicit ``mask [b, t, s]`` (or ``[b, k, t, s]``): ``[b, k, s]`` float32; fully masked
    rows add 0."""
    probs = masked_probs(q, k, mask, sm_scale=sm_scale, precision=precision, softcap=softcap)
    return jnp.sum(probs, axis=(2, 3))  # [b, k, s]
