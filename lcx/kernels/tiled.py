"""Attention in tiles for XLA: an online softmax over key tiles that visits only the tiles a query block can see.

Einsum legend: b batch, t queries, s keys, k kv heads, g query heads per kv head, d head dim; Q / S query / key tile.

``tiled_attention`` is the ``xla`` backend's ``chunk``: a prefill chunk (or a whole prompt) against the packed slots
of a cache, query i of row b at slot ``q_offsets[b] + i``. Dense masked attention over the whole capacity computes
``t x capacity`` float32 scores however little of the cache is filled, masks them and runs the softmax over all of
them, one pass each through memory. Here an outer scan walks the query blocks and, per block, two ``fori_loop``
s with traced trip counts walk the key tiles up to the last one the block can see - the causal bound and the
filled length - so a chunk costs what its visible keys cost (the first chunk of a prompt: the causal triangle,
no more). The largest float32 score array is one ``[b, k, Q, g, S]`` tile; the tiles below every query of the block
(and below every row's length) take no mask at all, only the diagonal ones do.

Same values as the dense softmax up to float32 summation order (the running max and sum are rescaled per tile, the
flash-attention recurrence). Inference only: the loops' trip counts are traced, which reverse-mode autodiff cannot
differentiate; training's causal attention keeps its own path.
"""

from __future__ import annotations

import functools

import einops
import jax
import jax.numpy as jnp

BLOCK_Q = 512  # queries per block of one row (times g query heads per KV head: the rows of one score tile) ...
BLOCK_K = 512  # ... by keys per tile: [k, 512 g, 512] float32 scores, 9 MiB for 3 KV heads x 3 query heads each
_LOW = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _rows(x: jax.Array) -> jax.Array:
    """Row ints ``[b]`` or ``[b, k]`` -> ``[b, k | 1, 1, 1, 1]``, broadcast against tiles ``[b, k, Q, g, S]``."""
    x = x.astype(jnp.int32)
    return (x[:, None] if x.ndim == 1 else x)[:, :, None, None, None]


def _product(legend: str, a: jax.Array, b: jax.Array) -> jax.Array:
    # XLA:CPU has no bf16 x bf16 -> f32 dot of its own (see ``reference._product``): widen there; exact in float32.
    if jax.default_backend() == "cpu" and (a.dtype in _LOW or b.dtype in _LOW):
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return jnp.einsum(legend, a, b, preferred_element_type=jnp.float32)


def tiled_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, q_offsets: jax.Array, kv_lengths: jax.Array,
                    sm_scale: float, causal: bool = True, residuals: bool = False, block_q: int = BLOCK_Q,
                    block_k: int = BLOCK_K):
    """``q [b, t, h, d]`` against ``k, v [b, s, k, d]``: query i of row b sits at key slot ``q_offsets[b] + i`` and
    sees the slots ``<= q_offsets[b] + i`` (``causal``) and ``< kv_lengths[b]``; ``q_offsets`` / ``kv_lengths`` are
    ``[b]`` or, per KV head, ``[b, k]``. Returns ``out [b, t, h, d]`` in ``q``'s dtype, or with ``residuals``
    ``(out float32, m, l)``: each row's logit max and sum of exponentials ``[b, t, h]`` (empty rows: 0, -inf, 0),
    as :func:`lcx.kernels.merge_partials` takes them."""
    b, t, h, d = q.shape
    s, kv_heads = k.shape[1], k.shape[2]
    if h % kv_heads:
        raise ValueError(f"{h} query heads must be a multiple of {kv_heads} key/value heads")
    g = h // kv_heads
    # Larger tiles run the dots closer to a GEMM's speed (2,048 tokens, 9 / 3 heads, 2-core CPU: 42 ms per layer with
    # 512 x 512 tiles, 58 ms with 128 x 512); a batch shares the tile's memory, so its query block shrinks.
    block_q = min(max(64, block_q // b), t)
    block_k = min(block_k, s)
    n_q, n_k = -(-t // block_q), -(-s // block_k)
    # Pad queries and keys to whole tiles; padded keys lie past every length, padded queries are dropped.
    qg = jnp.pad(einops.rearrange(q, "b t (k g) d -> b k t g d", k=kv_heads), ((0, 0),) * 2 + ((0, n_q * block_q - t),)
                 + ((0, 0),) * 2)
    kt = jnp.pad(k, ((0, 0), (0, n_k * block_k - s), (0, 0), (0, 0)))
    vt = jnp.pad(v, ((0, 0), (0, n_k * block_k - s), (0, 0), (0, 0)))
    offsets = jnp.broadcast_to(jnp.asarray(q_offsets, jnp.int32), jnp.shape(q_offsets))
    lengths = jnp.minimum(jnp.asarray(kv_lengths, jnp.int32), s)
    first_q, lens = _rows(offsets), _rows(lengths)
    lo_len, hi_len = jnp.min(lengths), jnp.max(lengths)
    lo_off, hi_off = jnp.min(offsets), jnp.max(offsets)

    def tile(carry, j, q_blk, q_slot, masked: bool):
        m, l, acc = carry  # [b, k, Q, g], [b, k, Q, g], [b, k, Q, g, d] float32
        k_blk = jax.lax.dynamic_slice_in_dim(kt, j * block_k, block_k, axis=1)  # [b, S, k, d]
        v_blk = jax.lax.dynamic_slice_in_dim(vt, j * block_k, block_k, axis=1)
        scores = _product("bkqgd,bskd->bkqgs", q_blk, k_blk.astype(q_blk.dtype))  # [b, k, Q, g, S]
        if masked:
            k_slot = j * block_k + jnp.arange(block_k)[None, None, None, None, :]
            visible = k_slot < lens
            if causal:
                visible &= k_slot <= q_slot
            scores = jnp.where(visible, scores, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
        safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # a row that saw only masked keys: exp(-inf) = 0
        p = jnp.exp(scores - safe[..., None])
        alpha = jnp.exp(m - safe)
        pv = _product("bkqgs,bskd->bkqgd", p.astype(v_blk.dtype) if v_blk.dtype in _LOW else p, v_blk)
        return m_new, alpha * l + jnp.sum(p, axis=-1), alpha[..., None] * acc + pv

    def query_block(_, i):
        q_blk = jax.lax.dynamic_slice_in_dim(qg, i * block_q, block_q, axis=2).astype(
            jnp.float32 if q.dtype not in _LOW else q.dtype) * sm_scale  # [b, k, Q, g, d]
        q_slot = first_q + i * block_q + jnp.arange(block_q)[None, None, :, None, None]  # [b, k|1, Q, 1, 1]
        # Tiles [0, free) are visible to every query of the block in every row: no mask. Tiles [free, end) hold the
        # causal diagonal or the end of some row's keys; nothing past `end` is visible to any query of the block.
        see_all = jnp.minimum(lo_len, lo_off + i * block_q + 1) if causal else lo_len
        see_any = jnp.minimum(hi_len, hi_off + (i + 1) * block_q) if causal else hi_len
        free = jnp.maximum(see_all, 0) // block_k
        end = jnp.maximum(-(-see_any // block_k), free)
        carry = (jnp.full((b, kv_heads, block_q, g), -jnp.inf), jnp.zeros((b, kv_heads, block_q, g)),
                 jnp.zeros((b, kv_heads, block_q, g, d)))
        carry = jax.lax.fori_loop(0, free, lambda j, c: tile(c, j, q_blk, q_slot, False), carry)
        m, l, acc = jax.lax.fori_loop(free, end, lambda j, c: tile(c, j, q_blk, q_slot, True), carry)
        out = acc / jnp.where(l > 0, l, 1.0)[..., None]
        return None, (out, m, l)

    _, (out, m, l) = jax.lax.scan(query_block, None, jnp.arange(n_q))  # [n_q, b, k, Q, g, ...]
    out = einops.rearrange(out, "n b k q g d -> b (n q) (k g) d")[:, :t]
    if not residuals:
        return out.astype(q.dtype)
    rows = functools.partial(einops.rearrange, pattern="n b k q g -> b (n q) (k g)")
    return out, rows(m)[:, :t], rows(l)[:, :t]


__all__ = ["BLOCK_K", "BLOCK_Q", "tiled_attention"]
