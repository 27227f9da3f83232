"""Attention in tiles for XLA: an online softmax over key tiles that visits only the tiles a query block can see.

Einsum legend: b batch, t queries, s keys, k kv heads, g query heads per kv head, d head dim; Q / S query / key tile.

``tiled_attention`` is the ``xla`` backend's ``chunk`` (``tiled_column_sums`` its ``column_sums``): a prefill
chunk (or a whole prompt) against the packed slots of a cache, query i of row b at slot ``q_offsets[b] + i``. Dense
masked attention over the whole capacity computes ``t x capacity`` float32 scores however little of the cache is
filled, masks them and runs the softmax over all of them, one pass each through memory. Here an outer scan walks
the query blocks and, per block, two fori-loops with traced trip counts walk the key tiles up to the last one the
block can see - the causal bound and the filled length - so a chunk costs what its visible keys cost (the first
chunk of a prompt: the causal triangle, no more). The largest float32 score array is one ``[b, k, Q, g, S]`` tile;
the tiles below every query of the block (and below every row's length) take no mask at all, only the diagonal
ones do.

``k_scale, v_scale [b, s, k]`` (a cache of 8-bit codes, ``lcx.kernels.quant``): each key tile is widened in place and
its scales multiply the tile's logit columns; value scales multiply the probability columns before the product. No
float copy of the cache exists beyond one tile.

``window`` (a sliding-window layer) hides slots more than ``window - 1`` before a query's own: the walk starts at the
first tile some query of the block can see, and every visited tile takes the mask. ``softcap`` caps the scaled logits
(``softcap * tanh(z / softcap)``) in every tile.

Same values as the dense softmax up to float32 summation order (the running max and sum are rescaled per tile, the
flash-attention recurrence). Inference only: the loops' trip counts are traced, which reverse-mode autodiff cannot
differentiate; training's causal attention keeps its own path.
"""

from __future__ import annotations

import einops
import jax
import jax.numpy as jnp

from lcx.kernels.mode import target_backend

BLOCK_Q = 512  # queries per block of one row (times g query heads per KV head: the rows of one score tile) ...
BLOCK_K = 512  # ... by keys per tile: [k, 512 g, 512] float32 scores, 9 MiB for 3 KV heads x 3 query heads each
_LOW = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _rows(x: jax.Array) -> jax.Array:
    """Row ints ``[b]`` or ``[b, k]`` -> ``[b, k | 1, 1, 1, 1]``, broadcast against tiles ``[b, k, Q, g, S]``."""
    x = x.astype(jnp.int32)
    return (x[:, None] if x.ndim == 1 else x)[:, :, None, None, None]


def _product(legend: str, a: jax.Array, b: jax.Array) -> jax.Array:
    # XLA:CPU has no bf16 x bf16 -> f32 dot of its own (see ``reference._product``): widen there; exact in float32.
    if target_backend() == "cpu" and (a.dtype in _LOW or b.dtype in _LOW):
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return jnp.einsum(legend, a, b, preferred_element_type=jnp.float32)


class _Tiles:
    """The tiling of one call: queries ``[b, k, t_pad, g, d]`` in blocks, keys in tiles, and which tiles each query
    block visits. ``walk(i, init, step)`` runs ``step(carry, j, scores)`` over query block ``i``'s visible key tiles
    ``j`` with their scaled logits ``[b, k, Q, g, S]`` (-inf where hidden)."""

    def __init__(self, q, k, *, q_offsets, kv_lengths, sm_scale, causal, block_q, block_k, window=None, softcap=None,
                 k_scale=None):
        b, t, h, d = q.shape
        s, kv_heads = k.shape[1], k.shape[2]
        if h % kv_heads:
            raise ValueError(f"{h} query heads must be a multiple of {kv_heads} key/value heads")
        self.b, self.t, self.s, self.kv_heads, self.g, self.d = b, t, s, kv_heads, h // kv_heads, d
        # Larger tiles run the dots closer to a GEMM's speed (2,048 tokens, 9 / 3 heads, 2-core CPU: 42 ms per layer
        # with 512 x 512 tiles, 58 ms with 128 x 512); a batch shares the tile's memory, so its query block shrinks.
        self.block_q = min(max(64, block_q // b), t)
        self.block_k = min(block_k, s)
        self.n_q, n_k = -(-t // self.block_q), -(-s // self.block_k)
        # Pad queries and keys to whole tiles; padded keys lie past every length, padded queries are dropped.
        qg = einops.rearrange(q, "b t (k g) d -> b k t g d", k=kv_heads)
        self.qg = jnp.pad(qg, ((0, 0), (0, 0), (0, self.n_q * self.block_q - t), (0, 0), (0, 0)))
        self.pad_keys = lambda x: jnp.pad(x, ((0, 0), (0, n_k * self.block_k - s), (0, 0), (0, 0)))
        self.kt = self.pad_keys(k)
        self.pad_scales = lambda x: None if x is None else jnp.pad(x, ((0, 0), (0, n_k * self.block_k - s), (0, 0)))
        self.k_scale = self.pad_scales(k_scale)
        self.dtype = q.dtype if q.dtype in _LOW else jnp.float32
        self.sm_scale, self.causal, self.window, self.softcap = sm_scale, causal, window, softcap
        offsets = jnp.broadcast_to(jnp.asarray(q_offsets, jnp.int32), jnp.shape(q_offsets))
        lengths = jnp.minimum(jnp.asarray(kv_lengths, jnp.int32), s)
        self.first_q, self.lens = _rows(offsets), _rows(lengths)
        self.lo_len, self.hi_len = jnp.min(lengths), jnp.max(lengths)
        self.lo_off, self.hi_off = jnp.min(offsets), jnp.max(offsets)

    def query_slots(self, i):
        """``[b, k | 1, Q, 1, 1]``: the key slot of each query of block ``i``."""
        return self.first_q + i * self.block_q + jnp.arange(self.block_q)[None, None, :, None, None]

    def scores(self, j, q_blk, q_slot, masked: bool):
        k_blk = jax.lax.dynamic_slice_in_dim(self.kt, j * self.block_k, self.block_k, axis=1)  # [b, S, k, d]
        scores = _product("bkqgd,bskd->bkqgs", q_blk, k_blk.astype(q_blk.dtype))  # [b, k, Q, g, S]
        if self.k_scale is not None:
            scores = scores * self.scale_tile(self.k_scale, j)
        if self.softcap is not None:
            scores = self.softcap * jnp.tanh(scores / self.softcap)
        if masked:
            k_slot = j * self.block_k + jnp.arange(self.block_k)[None, None, None, None, :]
            visible = k_slot < self.lens
            if self.causal:
                visible &= k_slot <= q_slot
            if self.window is not None:
                visible &= k_slot > q_slot - self.window
            scores = jnp.where(visible, scores, -jnp.inf)
        return scores

    def scale_tile(self, scales, j):
        """Key tile ``j`` of per-slot scales ``[b, s_pad, k]`` as ``[b, k, 1, 1, S]`` float32 (against score tiles)."""
        tile = jax.lax.dynamic_slice_in_dim(scales, j * self.block_k, self.block_k, axis=1)
        return einops.rearrange(tile.astype(jnp.float32), "b S k -> b k 1 1 S")

    def walk(self, i, init, step):
        q_blk = jax.lax.dynamic_slice_in_dim(self.qg, i * self.block_q, self.block_q, axis=2)
        q_blk = q_blk.astype(self.dtype) * self.sm_scale  # [b, k, Q, g, d]
        q_slot = self.query_slots(i)
        # Tiles [0, free) are visible to every query of the block in every row: no mask. Tiles [free, end) hold the
        # causal diagonal or the end of some row's keys; nothing past `end` is visible to any query of the block.
        bq, bk = self.block_q, self.block_k
        see_all = jnp.minimum(self.lo_len, self.lo_off + i * bq + 1) if self.causal else self.lo_len
        see_any = jnp.minimum(self.hi_len, self.hi_off + (i + 1) * bq) if self.causal else self.hi_len
        free = jnp.maximum(see_all, 0) // bk
        end = jnp.maximum(-(-see_any // bk), free)
        start = 0
        if self.window is not None:  # the first key the block's earliest query sees; every tile takes the mask
            start = jnp.clip((self.lo_off + i * bq - self.window + 1) // bk, 0, end)
            free = start
        carry = jax.lax.fori_loop(start, free, lambda j, c: step(c, j, self.scores(j, q_blk, q_slot, False)), init)
        return jax.lax.fori_loop(free, end, lambda j, c: step(c, j, self.scores(j, q_blk, q_slot, True)), carry)

    def rows(self, x):
        """Per query row ``[n_q, b, k, Q, g, ...]`` -> ``[b, t, h, ...]``."""
        return einops.rearrange(x, "n b k q g ... -> b (n q) (k g) ...")[:, :self.t]


def _online_softmax_step(carry, scores, v_blk=None, v_scale=None, dtype=None):
    """One key tile of the flash recurrence: running max, sum and (with ``v_blk [b, S, k, d]``) output; ``v_scale
    [b, k, 1, 1, S]``: the tile holds 8-bit codes, widened to ``dtype``, whose scales weigh the probabilities."""
    m, l, acc = carry  # [b, k, Q, g], [b, k, Q, g], [b, k, Q, g, d] float32 (acc None without values)
    m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
    safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # a row that saw only masked keys: exp(-inf) = 0
    p = jnp.exp(scores - safe[..., None])
    alpha = jnp.exp(m - safe)
    if v_blk is not None:
        if v_scale is not None:
            pv = _product("bkqgs,bskd->bkqgd", (p * v_scale).astype(dtype), v_blk.astype(dtype))
        else:
            pv = _product("bkqgs,bskd->bkqgd", p.astype(v_blk.dtype) if v_blk.dtype in _LOW else p, v_blk)
        acc = alpha[..., None] * acc + pv
    return m_new, alpha * l + jnp.sum(p, axis=-1), acc


def tiled_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, q_offsets: jax.Array, kv_lengths: jax.Array,
                    sm_scale: float, causal: bool = True, residuals: bool = False, block_q: int = BLOCK_Q,
                    block_k: int = BLOCK_K, window: int | None = None, softcap: float | None = None,
                    k_scale: jax.Array | None = None, v_scale: jax.Array | None = None):
    """``q [b, t, h, d]`` against ``k, v [b, s, k, d]``: query i of row b sits at key slot ``q_offsets[b] + i`` and
    sees the slots ``<= q_offsets[b] + i`` (``causal``) and ``< kv_lengths[b]``; ``q_offsets`` / ``kv_lengths`` are
    ``[b]`` or, per KV head, ``[b, k]``. Returns ``out [b, t, h, d]`` in ``q``'s dtype, or with ``residuals``
    ``(out float32, m, l)``: each row's logit max and sum of exponentials ``[b, t, h]`` (empty rows: 0, -inf, 0),
    as :func:`lcx.kernels.merge_partials` takes them. ``window`` / ``softcap`` / ``k_scale, v_scale``: see the
    module docstring."""
    tiles = _Tiles(q, k, q_offsets=q_offsets, kv_lengths=kv_lengths, sm_scale=sm_scale, causal=causal,
                   block_q=block_q, block_k=block_k, window=window, softcap=softcap, k_scale=k_scale)
    vt, vs = tiles.pad_keys(v), tiles.pad_scales(v_scale)
    b, kv, bq, g = tiles.b, tiles.kv_heads, tiles.block_q, tiles.g

    def step(carry, j, scores):
        v_blk = jax.lax.dynamic_slice_in_dim(vt, j * tiles.block_k, tiles.block_k, axis=1)
        if vs is None:
            return _online_softmax_step(carry, scores, v_blk)
        return _online_softmax_step(carry, scores, v_blk, tiles.scale_tile(vs, j), tiles.dtype)

    def query_block(_, i):
        init = (jnp.full((b, kv, bq, g), -jnp.inf), jnp.zeros((b, kv, bq, g)), jnp.zeros((b, kv, bq, g, tiles.d)))
        m, l, acc = tiles.walk(i, init, step)
        return None, (acc / jnp.where(l > 0, l, 1.0)[..., None], m, l)

    _, (out, m, l) = jax.lax.scan(query_block, None, jnp.arange(tiles.n_q))  # [n_q, b, k, Q, g, ...]
    out = tiles.rows(out)
    if not residuals:
        return out.astype(q.dtype)
    return out, tiles.rows(m), tiles.rows(l)


def tiled_column_sums(q: jax.Array, k: jax.Array, *, q_offsets: jax.Array, kv_lengths: jax.Array, sm_scale: float,
                      query_weights: jax.Array | None = None, causal: bool = True, block_q: int = BLOCK_Q,
                      block_k: int = BLOCK_K, window: int | None = None, softcap: float | None = None,
                      k_scale: jax.Array | None = None) -> jax.Array:
    """The attention each key receives from the queries with ``query_weights [b, t] > 0`` (None: all), summed over
    the queries and each KV head's query group: ``[b, k, s]`` float32 (masks as :func:`tiled_attention`).

    Two walks over the visible tiles: the first finds each row's max and sum of exponentials, the second adds up
    the normalized probabilities per key tile - the dense formulation's ``[b, k, g, t, s]`` probabilities never
    exist at once."""
    tiles = _Tiles(q, k, q_offsets=q_offsets, kv_lengths=kv_lengths, sm_scale=sm_scale, causal=causal,
                   block_q=block_q, block_k=block_k, window=window, softcap=softcap, k_scale=k_scale)
    b, kv, bq, g, bk = tiles.b, tiles.kv_heads, tiles.block_q, tiles.g, tiles.block_k
    t_pad = tiles.n_q * bq
    counted = jnp.ones((b, tiles.t), bool) if query_weights is None else jnp.asarray(query_weights) > 0
    counted = jnp.pad(counted, ((0, 0), (0, t_pad - tiles.t)))  # [b, t_pad]

    def query_block(sums, i):
        init = (jnp.full((b, kv, bq, g), -jnp.inf), jnp.zeros((b, kv, bq, g)), None)
        m, l, _ = tiles.walk(i, init, lambda c, j, scores: _online_softmax_step(c, scores))
        rows = jax.lax.dynamic_slice_in_dim(counted, i * bq, bq, axis=1)[:, None, :, None]  # [b, 1, Q, 1]
        # 1 / l of the counted rows that saw a key, 0 elsewhere: their probabilities drop out of the sums.
        inv = jnp.where(rows & (l > 0), 1.0 / jnp.where(l > 0, l, 1.0), 0.0)
        safe = jnp.where(jnp.isfinite(m), m, 0.0)

        def add(sums, j, scores):
            p = jnp.exp(scores - safe[..., None]) * inv[..., None]  # [b, k, Q, g, S]
            part = jnp.sum(p, axis=(2, 3))  # [b, k, S]
            old = jax.lax.dynamic_slice_in_dim(sums, j * bk, bk, axis=2)
            return jax.lax.dynamic_update_slice_in_dim(sums, old + part, j * bk, axis=2)

        return tiles.walk(i, sums, add), None

    sums, _ = jax.lax.scan(query_block, jnp.zeros((b, kv, tiles.kt.shape[1]), jnp.float32), jnp.arange(tiles.n_q))
    return sums[:, :, :tiles.s]


__all__ = ["BLOCK_K", "BLOCK_Q", "tiled_attention", "tiled_column_sums"]
