"""One layer of attention over the memory tiers: working memory and recalled long-term blocks, merged exactly.

Einsum legend / shapes: b batch, t new tokens, W working slots, N blocks, K recalled blocks per KV head, j tokens per
block, h query heads, k kv heads, g query heads per kv head, d head dim.

1. Write the new keys and values into the working memory (packed after the occupied slots).
2. Attend the queries to the working memory (causal, per-row offsets: the backend's ``chunk`` or ``decode``) and
   keep the residuals (row max, sum of exponentials).
3. Route: the router scores the long-term blocks with the pooled query (the mean of the chunk's real queries, or the
   one decode query) per KV head; the top ``topk`` blocks are recalled - read from the device store, or from the
   host / disk store by a host callback - into a fixed-size buffer ``[b, K * j, k, d]``. With ``lexical: L``, up to
   ``L`` of them are instead the blocks sharing the most rare token ids with the last ``lexical_tokens`` read
   (``lexical_scores``; the ids are written beside the keys and spilled with them), the same in every head.
4. Attend to the recalled tokens (all older than the queries: no causal mask) and merge the two partial attentions
   with ``lcx.kernels.merge_partials``. A learned router's gate can drop the recalled part per KV head.

Positions: ``original`` - keys are stored rotated at their true positions and queries rotated at theirs, so with
every block recalled the result equals full attention. ``local`` (InfLLM-style) - keys are stored unrotated; the
sinks sit at positions ``0 .. sinks-1``, the recalled tokens (blocks in position order) right after them at
``sinks .. sinks + K*j - 1``, then the window in slot order, queries at their slot: no position exceeds sinks +
topk * block + window + the room of one call, whatever the context. Routing compares queries and keys as stored
(rotated in ``original`` mode, unrotated in ``local`` mode).

Routing pools the last ``route_queries`` real queries (SnapKV's observation window: at the end of a prompt those are
the question's), kept across calls in a small buffer, so a decode step routes with its query and the ones before.
"""

from __future__ import annotations

import functools

import einops
import jax
import jax.numpy as jnp

from lcx import kernels
from lcx.cache.storage import FloatKV, namespace
from lcx.cache.kv_view import KVView, attend_view, packed_valid
from lcx.cache.memory.learned import PARAM_NAMES
from lcx.cache.memory.store import fetch as host_fetch
from lcx.kernels import Attended
from lcx.model.config import AttentionSpec
from lcx.model.rope import apply_rope, rope_tables


def _write(layer, k, v, positions, ok, storage):
    """Append ``k, v [b, t, k, d]`` at ``positions [b, t]`` where ``ok``: after the occupied working slots, as the
    working ``storage`` holds them (values, or 8-bit codes and per-token scales)."""
    capacity = layer.k.shape[1]
    rank = jnp.cumsum(ok.astype(jnp.int32), axis=1) - 1
    slot = jnp.where(ok, layer.count[:, None] + rank, capacity)  # [b, t]; padding goes out of range
    rows = jnp.arange(k.shape[0])[:, None]
    put = lambda buf, x: buf.at[rows, slot].set(x.astype(buf.dtype), mode="drop")  # noqa: E731
    layer = storage.write(layer, k, v, ok, put)
    out = layer.replace(
        pos=layer.pos.at[rows, slot].set(positions.astype(jnp.int32), mode="drop"),
        valid=layer.valid.at[rows, slot].set(True, mode="drop"),
        count=layer.count + jnp.sum(ok, axis=1, dtype=jnp.int32))
    if layer.received is not None:  # a new slot has received no attention yet
        heads = jnp.arange(layer.received.shape[1])[None, :, None]
        out = out.replace(received=out.received.at[rows[:, :, None], heads, slot[:, None, :]].set(0.0, mode="drop"))
    if layer.tok is not None:  # lexical recall: the ids beside the keys (routing appends them to the last read)
        out = out.replace(tok=layer.tok.at[rows, slot].set(layer.new_tok[:, :k.shape[1]], mode="drop"))
    return out


def recent_tokens(recent: jax.Array, new: jax.Array, ok: jax.Array) -> jax.Array:
    """The last ``R`` token ids read: ``recent [b, R]`` (-1: empty, the newest at the end), then ``new [b, t]``
    where ``ok``; the result right-aligned the same way."""
    ids = jnp.concatenate([recent, jnp.where(ok, new, -1)], axis=1)
    order = jnp.argsort(jnp.where(ids >= 0, jnp.arange(ids.shape[1]), -1), axis=1, stable=True)
    return jnp.take_along_axis(ids, order[:, -recent.shape[1]:], axis=1)


def recent_tokens_per_query(recent: jax.Array, new: jax.Array, ok: jax.Array) -> jax.Array:
    """For each token of ``new [b, t]``, the last ``R`` real ids up to and including it (``recent``'s, then
    ``new``'s where ``ok``), as ``[b, t, R + t]`` ids with -1 for the others: what a decode step at it matches."""
    ids = jnp.concatenate([recent, jnp.where(ok, new, -1)], axis=1)  # [b, J]
    chosen = last_per_query(ids >= 0, recent.shape[1], recent.shape[1])
    return jnp.where(chosen, ids[:, None, :], -1)


def lexical_scores(block_tok: jax.Array, n_blocks: jax.Array, asked: jax.Array) -> jax.Array:
    """``block_tok [b, N, j]`` (the first ``n_blocks [b]`` blocks written) against the ids ``asked [b, Q]`` (-1:
    none) -> ``[b, N]``: the distinct asked ids each block holds, each weighted ``log(n / df)`` with ``df`` the
    blocks holding it - an id every block holds weighs nothing, one only the needle's block holds the most."""
    repeated = jnp.any(jnp.tril(asked[:, :, None] == asked[:, None, :], k=-1), axis=2)  # seen earlier in `asked`
    keep = (asked >= 0) & ~repeated  # [b, Q]
    present = jnp.arange(block_tok.shape[1])[None, :] < n_blocks[:, None]  # [b, N]
    match = (jnp.any(block_tok[:, :, :, None] == asked[:, None, None, :], axis=2)
             & present[:, :, None] & keep[:, None, :])  # [b, N, Q]
    df = jnp.sum(match, axis=1)  # [b, Q]
    idf = jnp.where(df > 0, jnp.log(n_blocks[:, None].astype(jnp.float32) / jnp.maximum(df, 1)), 0.0)
    return jnp.einsum("bnq,bq->bn", match.astype(jnp.float32), idf)


def _local_positions(slots: jax.Array, sinks: int, recalled: int) -> jax.Array:
    """Working slot -> local position: the sinks keep theirs, the window moves up past the ``recalled`` tokens."""
    return jnp.where(slots >= sinks, slots + recalled, slots)


def _recall(kind, layer, ids: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """Keys and values of blocks ``ids [b, k, K]`` (-1: none) -> ``[b, K * j, k, d]`` each."""
    p, m = kind.policy, kind.model
    b, heads, topk = ids.shape
    if p.store == "device":  # the blocks' format reads them back (dequantized where it stores codes)
        rows, head = jnp.arange(b)[:, None, None], jnp.arange(heads)[None, :, None]
        return kind.blocks.recall(layer, rows, head=head, safe=jnp.maximum(ids, 0), dtype=dtype)
    shape = jax.ShapeDtypeStruct((b, topk * p.block, heads, m.head_dim), jnp.float32)
    fetch = functools.partial(host_fetch, block=p.block, head_dim=m.head_dim)
    k, v = jax.pure_callback(fetch, (shape, shape), layer.store_id, layer.layer_id, ids, vmap_method="sequential")
    return k.astype(dtype), v.astype(dtype)


def _summaries(kind, layer) -> dict[str, jax.Array]:
    return {name: getattr(layer, name) for name in kind.router.summary_fields()}


def _params(layer) -> dict[str, jax.Array] | None:
    if layer.w_query is None:
        return None
    return {name: getattr(layer, name) for name in PARAM_NAMES}


def recent_queries(layer, q: jax.Array, ok: jax.Array, keep: int):
    """The last ``keep`` real queries before and in this call: the layer's buffer of earlier ones (``recent_q [b, R,
    h, d]``, its newest ``recent_n`` valid) followed by ``q [b, t, h, d]`` where ``ok``. Returns their mean ``[b, h,
    d]`` and the updated buffer and count."""
    buffer = layer.recent_q.shape[1]
    earlier = jnp.arange(buffer)[None, :] >= buffer - layer.recent_n[:, None]  # [b, R] the newest are at the end
    queries = jnp.concatenate([layer.recent_q, q.astype(jnp.float32)], axis=1)  # [b, R + t, h, d]
    valid = jnp.concatenate([earlier, ok], axis=1)
    rank_from_end = jnp.cumsum(valid[:, ::-1].astype(jnp.int32), axis=1)[:, ::-1]  # 1 for the newest
    chosen = valid & (rank_from_end <= keep)
    w = chosen.astype(jnp.float32)[:, :, None, None]
    pooled = jnp.sum(queries * w, axis=1) / jnp.maximum(jnp.sum(w, axis=1), 1.0)
    # The new buffer: the chosen queries in order, right-aligned.
    order = jnp.argsort(jnp.where(chosen, jnp.arange(valid.shape[1])[None, :], -1), axis=1)[:, -buffer:]
    new = jnp.take_along_axis(queries, order[:, :, None, None], axis=1)
    return pooled, new, jnp.minimum(jnp.sum(chosen, axis=1, dtype=jnp.int32), buffer)


def _group_candidates(kind, layer, pooled: jax.Array) -> jax.Array:
    """The blocks of the ``route_candidates`` best groups per KV head (Quest's bound over a group's min / max keys
    bounds every block in it): ``[b, k, S * G]`` block ids."""
    p = kind.policy
    groups = layer.gmin.shape[1]
    scores = kind.router.score(pooled, {"kmin": layer.gmin, "kmax": layer.gmax}, None)  # [b, k, NG]
    filled = jnp.arange(groups)[None, None, :] * p.route_groups < layer.n_blocks[:, None, None]
    _, best = jax.lax.top_k(jnp.where(filled, scores, -jnp.inf), min(p.route_candidates, groups))  # [b, k, S]
    ids = best[..., None] * p.route_groups + jnp.arange(p.route_groups)  # [b, k, S, G]
    return ids.reshape(ids.shape[:2] + (-1,)).astype(jnp.int32)


def last_per_query(valid: jax.Array, buffer: int, keep: int) -> jax.Array:
    """``valid [b, J]``: a buffer of ``buffer`` earlier entries, then a call's ``t = J - buffer``. For each of the
    call's entries, the last ``keep`` valid ones up to and including it, ``[b, t, J]``."""
    count = jnp.cumsum(valid.astype(jnp.int32), axis=1)  # valid entries up to each one
    upto = buffer + jnp.arange(valid.shape[1] - buffer)  # the call's entry i's index in the sequence
    j = jnp.arange(valid.shape[1])
    return (valid[:, None, :] & (j[None, None, :] <= upto[None, :, None])
            & (count[:, upto][:, :, None] - count[:, None, :] < keep))


def pooled_per_query(layer, q: jax.Array, ok: jax.Array, keep: int) -> jax.Array:
    """For each query of ``q [b, t, h, d]``, the mean of the last ``keep`` real queries up to and including it
    (the layer's buffer of earlier ones, then this call's where ``ok``): what a decode step at that query pools,
    ``[b, t, h, d]``. Teacher forcing routes each query with it, as one-token steps would."""
    buffer = layer.recent_q.shape[1]
    earlier = jnp.arange(buffer)[None, :] >= buffer - layer.recent_n[:, None]  # [b, R]
    queries = jnp.concatenate([layer.recent_q, q.astype(jnp.float32)], axis=1)  # [b, J = R + t, h, d]
    w = last_per_query(jnp.concatenate([earlier, ok], axis=1), buffer, keep).astype(jnp.float32)  # [b, t, J]
    return jnp.einsum("btj,bjhd->bthd", w, queries) / jnp.maximum(jnp.sum(w, axis=-1), 1.0)[..., None, None]


def route(kind, layer, q: jax.Array, ok: jax.Array):
    """Block ids ``[b, k, K]`` to recall, ascending (-1 last, where a row has fewer blocks), the gate ``[b, k]``
    (None: open) and the layer with its recent-query buffer updated, from the last ``route_queries`` real queries
    (this call's ``q [b, t, h, d]`` where ``ok``, after the ones before it): a decode step routes like the prompt's
    end, not on one query alone."""
    pooled, recent, recent_n = recent_queries(layer, q, ok, kind.policy.route_queries)
    layer = layer.replace(recent_q=recent, recent_n=recent_n)
    if kind.policy.lexical:  # this call's ids join the last ones read
        layer = layer.replace(recent_tok=recent_tokens(layer.recent_tok, layer.new_tok[:, :q.shape[1]], ok))
    ids, gate = rank_blocks(kind, layer, pooled)
    return ids, gate, layer


def rank_blocks(kind, layer, pooled: jax.Array, lexical: jax.Array | None = None):
    """The blocks a pooled query ``[b, h, d]`` recalls, ``ids [b, k, K]``, and the gate ``[b, k]`` (None: open).
    ``lexical [b, N]``: the blocks' lexical scores (``cache.lexical``; None: from the layer's last ids read)."""
    p = kind.policy
    params = _params(layer)
    summaries = _summaries(kind, layer)
    blocks = next(iter(summaries.values())).shape[1]
    if p.route_groups:  # two levels: the best groups of blocks first, then the blocks inside them
        candidates = _group_candidates(kind, layer, pooled)  # [b, k, C] block ids
        heads = candidates.shape[1]
        rows, head = jnp.arange(candidates.shape[0])[:, None, None], jnp.arange(heads)[None, None, :]
        safe = jnp.minimum(jnp.swapaxes(candidates, 1, 2), blocks - 1)  # [b, C, k]
        summaries = {name: x[rows, safe, head] for name, x in summaries.items()}  # [b, C, k, ...]
    else:
        candidates = jnp.broadcast_to(jnp.arange(blocks, dtype=jnp.int32), (pooled.shape[0], layer.k.shape[2],
                                                                              blocks))
    scores = kind.router.score(pooled, summaries, params)  # [b, k, C]
    if p.route_heads == "shared":  # one ranking per layer: the KV heads' scores summed
        scores = jnp.broadcast_to(jnp.sum(scores, axis=1, keepdims=True), scores.shape)
    if p.lexical:  # the blocks sharing the most rare tokens with the last ones read go first, in every head
        if lexical is None:
            lexical = lexical_scores(layer.block_tok, layer.n_blocks, layer.recent_tok)  # [b, N]
        best, chosen = jax.lax.top_k(lexical, min(p.lexical, blocks))
        rows = jnp.arange(lexical.shape[0])[:, None]
        forced = jnp.zeros(lexical.shape, bool).at[rows, chosen].set(best > 0)
        scores = jnp.where(forced[:, None, :], jnp.inf, scores)
    present = candidates < layer.n_blocks[:, None, None]
    topk = min(p.topk, candidates.shape[-1])
    _, pick = jax.lax.top_k(jnp.where(present, scores, -jnp.inf), topk)  # absent blocks rank last
    ids = jnp.take_along_axis(candidates, pick, axis=-1)
    ids = jnp.where(jnp.take_along_axis(present, pick, axis=-1), ids, blocks)
    ids = jnp.sort(ids, axis=-1)  # position order (local positions number recalled tokens in this order)
    ids = jnp.where(ids < blocks, ids, -1)
    if topk < p.topk:
        ids = jnp.pad(ids, ((0, 0), (0, 0), (0, p.topk - topk)), constant_values=-1)
    gate = kind.router.gate(pooled, params, layer.k.shape[2]) if p.gate else None
    return ids.astype(jnp.int32), gate


def attend(kind, layer, q, key, val, *, cos, sin, positions, ok, stat_weights, spec: AttentionSpec):
    """``MemoryKind.attend``: see the module docstring. ``q [b, t, h, d]``, ``key, val [b, t, k, d]`` unrotated;
    ``spec``: the layer's attention (scale, soft-cap, RoPE of ``local`` positions; ``MemoryKind`` refuses
    windows)."""
    p, config = kind.policy, kind.model
    local = p.positions == "local"
    if not local:
        q, key = apply_rope(q, cos, sin), apply_rope(key, cos, sin)
    q_route = q  # routing compares like with like: rotated (original) or unrotated (local) queries and keys
    q_offsets = layer.count
    working = kind.working
    layer = _write(layer, key, val, positions, ok, working)
    b, t = q.shape[:2]
    recall_tokens = p.topk * p.block
    # Working memory: causal in slot order (the slots are packed in position order), stored [b, W, k, ...]
    stored = namespace(**{n: getattr(layer, n).swapaxes(1, 2) for n in working.slot_fields()})  # [b, k, W, ...]
    kv = working.view(stored, q.dtype, impl=config.attention.impl, queries=t, counted=False, codes=not local)
    if local:  # keys rotated here, whole: 8-bit ones dequantized first (as the slot cache's "cache" positions)
        slots = jnp.broadcast_to(jnp.arange(layer.k.shape[1]), (b, layer.k.shape[1]))
        keys = kv.float_keys(q.dtype).swapaxes(1, 2)  # [b, W, k, d]
        kv = kv.with_keys(apply_rope(keys, *rope_tables(config, _local_positions(slots, p.sinks, recall_tokens),
                                                        spec.rope)).swapaxes(1, 2))
        q_slots = q_offsets[:, None] + jnp.arange(t)[None, :]
        q = apply_rope(q, *rope_tables(config, _local_positions(q_slots, p.sinks, recall_tokens), spec.rope))

    counted = stat_weights is not None and layer.received is not None
    work = KVView(kv=kv, lengths=layer.count, offsets=q_offsets, valid=layer.valid)
    res = attend_view(config.attention.impl, q, work, spec, stat_weights=stat_weights if counted else None,
                      residuals=True)
    if counted:
        layer = layer.replace(received=jnp.where(layer.valid[:, None, :], layer.received + res.weights, 0.0))

    # Long-term memory: route, recall, attend; no causal mask (every block is older than every query).
    if kind.route_each_query and t > 1:
        recalled, layer = _recall_each_query(kind, layer, q, q_route, ok, spec)
    else:
        recalled, layer = _recall_pooled(kind, layer, q, q_route, ok, spec)
    out, _, _ = kernels.merge_partials(res, recalled)
    return out.astype(q.dtype), layer


def _recalled_keys(kind, layer, ids, dtype, spec):
    """The recalled tokens of ``ids [b, k, K]`` as a view (not causal: every block is older than every query;
    rotated to their local positions in ``local`` mode) and their number per row ``[b]`` (the same for every
    head)."""
    p = kind.policy
    k_rec, v_rec = _recall(kind, layer, ids, dtype)
    if p.positions == "local":
        recall_tokens = p.topk * p.block
        before_window = jnp.broadcast_to(p.sinks + jnp.arange(recall_tokens), (ids.shape[0], recall_tokens))
        k_rec = apply_rope(k_rec, *rope_tables(kind.model, before_window, spec.rope))
    n_tokens = jnp.sum(ids[:, 0] >= 0, axis=-1, dtype=jnp.int32) * p.block
    view = KVView(kv=FloatKV(k=k_rec.swapaxes(1, 2), v=v_rec.swapaxes(1, 2)), lengths=n_tokens,
                  offsets=jnp.zeros_like(n_tokens), valid=packed_valid(n_tokens, k_rec.shape[1]), causal=False)
    return view, n_tokens


def _gated(l_r, gate, recalled):
    """Close the gated heads' recalled part (``l = 0``): ``(l_r, skipped [b], recalled [b])``."""
    if gate is None:
        return l_r, jnp.zeros_like(recalled), recalled
    h = l_r.shape[-1]
    open_heads = einops.repeat(gate, "b k -> b (k g)", g=h // gate.shape[-1])  # [b, h]
    return (jnp.where(open_heads[:, None, :], l_r, 0.0), recalled & ~jnp.any(gate, axis=1),
            recalled & jnp.any(gate, axis=1))


def _recall_pooled(kind, layer, q, q_route, ok, spec):
    """One recall for the whole call, routed by its pooled last queries: the ``Attended`` (with residuals) of the
    recalled tokens."""
    ids, gate, layer = route(kind, layer, q_route, ok)
    view, n_tokens = _recalled_keys(kind, layer, ids, q.dtype, spec)
    res = attend_view(kind.model.attention.impl, q, view, spec, residuals=True)
    l_r, skipped, recalled = _gated(res.l, gate, n_tokens > 0)
    layer = layer.replace(recalled=ids, recalls=layer.recalls + recalled.astype(jnp.int32),
                          skips=layer.skips + skipped.astype(jnp.int32))
    return res.replace(l=l_r), layer


def _recall_each_query(kind, layer, q, q_route, ok, spec):
    """Teacher forcing: every query routes and recalls on its own - the pooled queries a decode step at it would
    use - and attends to its own recalled tokens, so a chunk equals one-token steps. Counters count real queries;
    ``recalled`` keeps the last real query's blocks."""
    pooled = pooled_per_query(layer, q_route, ok, kind.policy.route_queries)  # [b, t, h, d]
    _, recent, recent_n = recent_queries(layer, q_route, ok, kind.policy.route_queries)
    layer = layer.replace(recent_q=recent, recent_n=recent_n)

    lexical = None
    if kind.policy.lexical:  # each query matches the ids up to itself, as its decode step would
        new = layer.new_tok[:, :q.shape[1]]
        asked = recent_tokens_per_query(layer.recent_tok, new, ok)  # [b, t, R + t]
        lexical = jax.vmap(lambda a: lexical_scores(layer.block_tok, layer.n_blocks, a), in_axes=1, out_axes=1)(asked)
        layer = layer.replace(recent_tok=recent_tokens(layer.recent_tok, new, ok))

    def one(pooled_i, q_i, lexical_i):  # one query: [b, h, d] each
        ids, gate = rank_blocks(kind, layer, pooled_i, lexical_i)
        view, n_tokens = _recalled_keys(kind, layer, ids, q.dtype, spec)
        res = attend_view(kind.model.attention.impl, q_i[:, None], view, spec, residuals=True)
        l_r, skipped, recalled = _gated(res.l, gate, n_tokens > 0)
        return res.out[:, 0], res.m[:, 0], l_r[:, 0], ids, skipped, recalled

    if lexical is None:
        o_r, m_r, l_r, ids, skipped, recalled = jax.vmap(lambda p_i, q_i: one(p_i, q_i, None), in_axes=(1, 1),
                                                         out_axes=1)(pooled, q)
    else:
        o_r, m_r, l_r, ids, skipped, recalled = jax.vmap(one, in_axes=(1, 1, 1), out_axes=1)(pooled, q, lexical)
    last = jnp.maximum(jnp.sum(ok, axis=1) - 1, 0)  # [b] the last real query
    layer = layer.replace(
        recalled=jnp.take_along_axis(ids, last[:, None, None, None], axis=1)[:, 0],
        recalls=layer.recalls + jnp.sum(recalled & ok, axis=1, dtype=jnp.int32),
        skips=layer.skips + jnp.sum(skipped & ok, axis=1, dtype=jnp.int32))
    return Attended(out=o_r, m=m_r, l=l_r), layer


__all__ = ["attend", "lexical_scores", "pooled_per_query", "rank_blocks", "recent_tokens", "recent_tokens_per_query",
           "route"]
