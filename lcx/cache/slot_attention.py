"""One layer of attention against the slot cache: write, position modes, backend dispatch, eviction statistics.

Einsum legend / shapes: b batch, t new tokens, C cache slots, H keep heads, h query heads, k kv heads, d head dim.
The cache stores keys and values ``[b, k, C, d]``; new tokens arrive, and prefill kernels read, ``[b, t, k, d]``.

Position modes (``EvictionPolicy.mode``):
- "original": keys are rotated at their true positions before they are stored; queries at theirs.
- "cache": keys are stored unrotated; at attention time slot j is rotated at its rank among the live slots and
  each query at its own rank, so the model sees positions 0 .. count-1 however far decoding has gone
  (StreamingLLM / LaCache). Slots are packed in position order, so rank = cumulative count of live slots.
- "original" with ``rope.rerotate`` (a length-dependent type: dynamic NTK): keys are stored unrotated; at each
  call every slot is rotated at its true position, and each query at its own, with the base of the length of the
  call's last real token - so no key keeps the base of the call that wrote it.

Live slots are packed in position order, so a chunk's query i (written at slot ``count + i``) sees exactly the slots
``<= count + i`` - the causal mask of the backend's ``chunk`` with per-row offsets: a prefill chunk never builds a
chunk x capacity mask for the Pallas kernel, and decode (one query) reads the live-slot mask. With a keep set per
KV head, offsets, lengths and live masks are per row and KV head; each query head uses its KV head's.

What the policy observes (``policy.observes``, ``lcx.cache.observes``) is computed here. Attention statistics (H2O /
TOVA / SnapKV): with ``stat_weights [b, t]`` (positive for queries that count), the probabilities those queries give
each slot, summed over queries and the query heads of each keep head, are added to (``"sum"``) or, in rows with a
counted query, replace (``"replace"``) the slot's score. Query moments (Expected Attention) are merged before RoPE.

The layer's ``AttentionSpec`` sets the logit scale, the soft-cap (kernels and statistics) and the RoPE of "cache"
mode; a sliding window hides slots whose position is ``window`` or more before the query's: in the decode mask
directly, and as the chunk kernels' ``window`` - exact because a sliding-window layer's cache (the ``window`` policy
of ``lcx.cache.hybrid``) holds a row's newest tokens in consecutive slots.
"""

from __future__ import annotations

import functools

import chex
import einops
import jax
import jax.numpy as jnp

from lcx.cache.kv_view import KVView, attend_view
from lcx.cache.observes import observe_queries
from lcx.kernels import Attended
from lcx.model.config import AttentionSpec
from lcx.model.rope import apply_rope, rope_tables
from lcx.parallel.sharding import BKS, BSKD, BTHD, ROWS, per_shard


def new_slots(count: jax.Array, ok: jax.Array, capacity: int) -> jax.Array:
    """The slots ``[b, H, t]`` a call's tokens go to: after the ``count [b, H]`` occupied ones, in order, skipping
    padding (``ok [b, t]`` False: slot ``capacity``, out of range)."""
    rank = jnp.cumsum(ok.astype(jnp.int32), axis=1) - 1  # [b, t] rank among this call's real tokens
    return jnp.where(ok[:, None, :], count[:, :, None] + rank[:, None, :], capacity)


def write(layer, k: jax.Array, v: jax.Array, positions: jax.Array, ok: jax.Array):
    """Append ``k, v [b, t, k, d]`` at ``positions [b, t]`` where ``ok [b, t]`` (padding is skipped).

    Tokens go after the occupied slots of each keep head; the caller guarantees room (capacity planned on the host,
    eviction compacts before it would overflow). Slots past the capacity are dropped by the scatter, never wrapped.
    """
    b, kv_heads = layer.k.shape[:2]
    heads, capacity = layer.pos.shape[1:]  # (a bit-packed cache's keys are channel-major: not [b, k, C, ...])
    slot = new_slots(layer.count, ok, capacity)  # [b, H, t]
    rows, keep = jnp.arange(b)[:, None, None], jnp.arange(heads)[None, :, None]
    slot_kv = einops.repeat(slot, "b H t -> b (H j) t", j=kv_heads // heads)  # [b, k, t]: each KV head its keep set's
    head = jnp.arange(kv_heads)[None, :, None]
    put = lambda buf, x: buf.at[rows, head, slot_kv].set(  # noqa: E731
        einops.rearrange(x, "b t k ... -> b k t ...").astype(buf.dtype), mode="drop")
    layer = layer.kind.storage.write(layer, k, v, ok, put)  # its own rule: per token, or staged in groups
    return layer.replace(
        pos=layer.pos.at[rows, keep, slot].set(positions[:, None, :].astype(jnp.int32), mode="drop"),
        valid=layer.valid.at[rows, keep, slot].set(True, mode="drop"),
        count=layer.count + jnp.sum(ok, axis=1, dtype=jnp.int32)[:, None],
        score=layer.score.at[rows, keep, slot].set(0.0, mode="drop"),
    )


def rotate_by_rank(config, x: jax.Array, ranks: jax.Array, *, cache_layout: bool = False, rope=None) -> jax.Array:
    """Rotate ``x [b, T, heads, d]`` (``cache_layout``: ``[b, heads, T, d]``) by per-keep-head positions ``ranks
    [b, H, T]`` (heads grouped by keep head), with ``rope`` (default ``config.rope``)."""
    b, heads, length = ranks.shape
    cos, sin = rope_tables(config, ranks.reshape(b, heads * length), rope)  # [b, H*T, r]
    if cache_layout:  # [b, H, T, r] broadcasts over x's heads: H is 1 (a shared keep set) or every KV head
        return apply_rope(x, cos.reshape(b, heads, length, -1), sin.reshape(b, heads, length, -1))
    if heads == 1:
        return apply_rope(x, cos, sin)
    per_head = lambda t: einops.repeat(t.reshape(b, heads, length, -1), "b H T r -> b T (H j) r",  # noqa: E731
                                       j=x.shape[2] // heads)
    return apply_rope(x, per_head(cos), per_head(sin))


def _keep_head_sums(weights: jax.Array, heads: int) -> jax.Array:
    """``[b, k, C]`` per-KV-head attention mass -> ``[b, H, C]`` summed over the KV heads sharing a keep set."""
    return einops.reduce(weights, "b (H j) C -> b H C", "sum", H=heads)


def attend(kind, layer, q, key, val, *, cos, sin, positions, ok, stat_weights, spec: AttentionSpec | None = None,
           key_tables=None):
    """``SlotCacheKind.attend``: append ``key, val [b, t, k, d]`` (unrotated) to ``layer`` and attend ``q [b, t, h,
    d]`` (unrotated) to it; ``cos, sin`` are the RoPE tables of ``positions`` (used in "original" mode);
    ``key_tables``: ``rope.rerotate``'s tables of the slot positions.

    A prefill chunk attends through the backend's ``chunk`` with per-row offsets: query i of row b at slot
    ``count_b + i`` sees the slots up to it, and the backend visits only the key tiles some query can see - a
    request's first chunk (an empty cache) costs its causal triangle, a later one the filled slots, never the whole
    capacity. Padding queries get outputs nobody reads. ``spec``: the layer's attention (default: the model's
    first layer's)."""
    config, policy = kind.model, kind.policy
    spec = spec or config.attention_specs()[0]
    chex.assert_rank([q, key, val], 4)
    chex.assert_equal_shape([key, val])
    chex.assert_equal_shape_prefix([q, key, positions, ok], 2)
    mode, observes = policy.mode, policy.observes
    if observes.moments:  # before RoPE: the policy rotates the moments to the positions it expects
        layer = observe_queries(layer, q, observes.counts_query(positions, ok), spec.sm_scale, observes.moments)
    # rope.rerotate (dynamic NTK as published): keys stored before rotation, every key rotated at each call with
    # the base of the current length, not of the call that wrote it
    rerotate = mode == "original" and spec.rope.rerotate
    if mode == "original" and not rerotate:
        q, key = apply_rope(q, cos, sin), apply_rope(key, cos, sin)
    heads, kv_heads = layer.pos.shape[1], layer.k.shape[1]
    q_offsets = layer.count  # [b, H] the chunk's first slot per keep head
    layout = kind.layer_axes()  # each shard writes its rows and KV heads
    layer = per_shard(write, (layout, BSKD, BSKD, ROWS, ROWS), layout)(layer, key, val, positions, ok)
    mask = layer.valid[:, :, None, :] & (layer.pos[:, :, None, :] <= positions[:, None, :, None])  # [b, H, t, C]
    if spec.window is not None:
        mask &= layer.pos[:, :, None, :] > positions[:, None, :, None] - spec.window
    counted = stat_weights is not None and observes.attention is not None
    # the storage's payload: on its codes where the op reads them, values where keys are rotated at read time
    kv = kind.storage.view(layer, q.dtype, impl=config.attention.impl, queries=q.shape[1], counted=counted,
                           codes=mode == "original" and not rerotate)
    if rerotate:  # ``cos, sin`` and the slots' ``key_tables [b, C, r]`` at each row's length (``spec_tables``)
        if key_tables is None:
            raise ValueError("rope.rerotate: the decoder passes the cache positions' RoPE tables (key_tables)")
        # slot j holds position j: the cache keeps every token in order (``CacheConfig.kind`` refuses an evicting
        # policy at original positions), so the tables broadcast over the heads without a gather
        k_cos, k_sin = (t[:, None] for t in key_tables)  # [b, 1, C, r]
        kv = kv.with_keys(apply_rope(kv.float_keys(q.dtype), k_cos, k_sin))
        q = apply_rope(q, cos, sin)
    if mode == "cache":  # keys rotated here, whole: stored codes are dequantized first (in the query's dtype)
        k_att = rotate_by_rank(config, kv.float_keys(q.dtype),
                               jnp.maximum(jnp.cumsum(layer.valid, axis=-1, dtype=jnp.int32) - 1, 0),
                               cache_layout=True, rope=spec.rope)
        kv = kv.with_keys(k_att)
        q = rotate_by_rank(config, q, jnp.maximum(jnp.sum(mask, axis=-1, dtype=jnp.int32) - 1, 0), rope=spec.rope)

    # The view's row ints and live masks: per row with one shared keep set, else per row and KV head.
    per_kv = (lambda x: x[:, 0]) if heads == 1 else (  # noqa: E731
        lambda x: einops.repeat(x, "b H ... -> b (H j) ...", j=kv_heads // heads))
    view = KVView(kv=kv, lengths=per_kv(layer.count), offsets=per_kv(q_offsets),
                  valid=per_kv(mask[:, :, 0]) if q.shape[1] == 1 else None)
    core = functools.partial(attend_view, config.attention.impl, spec=spec, few=getattr(kind, "few_queries", 0))
    if counted:
        res = per_shard(lambda q, view, w: core(q, view, stat_weights=w), (BTHD, view.axes(), ROWS),
                        Attended(out=BTHD, weights=BKS))(q, view, stat_weights)
    else:
        res = per_shard(lambda q, view: core(q, view), (BTHD, view.axes()), Attended(out=BTHD))(q, view)
    out = res.out
    if counted:
        layer = layer.replace(score=observes.merge_attention(layer.score, _keep_head_sums(res.weights, heads),
                                                             stat_weights, layer.valid))
    return out, layer


__all__ = ["attend", "new_slots", "observe_queries", "rotate_by_rank", "write"]
