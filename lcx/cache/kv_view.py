"""The attention core every cache shares: a view of keys and values, and one function that attends queries to it.

Einsum legend / shapes: b batch, t queries, S slots of the view, h query heads, k kv heads, d head dim.

A cache stores keys and values its own way (the slot cache per keep head, the memory tier's working window per row
and its long-term blocks in a store) and writes and rotates them by its own position rules. To attend it builds a
:class:`KVView` - slots packed in position order, in the slot cache's ``[b, k, S, d]`` layout - and calls
:func:`attend_view`, which picks the backend op (``decode`` for one query, ``chunk`` otherwise), applies the layer's
``AttentionSpec`` (scale, soft-cap, window) and computes, when asked, the attention statistics of eviction (column
sums of the counted queries) and the residuals that merge partial attentions. A change to a mask, a statistic or a
backend signature is made here once.

Row ints (``lengths``, ``offsets``) and the live mask (``valid``) are per row, or per row and KV head when each KV
head keeps its own slots.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from lcx import kernels
from lcx.kernels import Attended
from lcx.model.config import AttentionSpec
from lcx.parallel.sharding import BK, BKS, ROWS


@flax.struct.dataclass
class KVView:
    """Keys and values as one layer's queries see them.

    ``kv``: the storage's payload (``lcx.cache.storage.views``: float keys and values, 8-bit codes with per-slot
    scales, or bit-packed codes with group scales and a float window), its slots ``[b, k, S, ...]`` packed in
    position order (rotated as the queries expect); it calls the backend op that reads it. ``lengths [b] | [b,
    k]``: the live slots are those below it. ``offsets [b] | [b, k]``: the slot of the call's first query
    (``causal``: query i sees slots ``<= offsets + i``; not causal: every live slot, e.g. recalled blocks older
    than every query). ``valid [b, S] | [b, k, S]``: the slots a single decode query sees (holes allowed; a window
    or the causal limit folded in) - needed only for one-query calls."""

    kv: Any
    lengths: jax.Array
    offsets: jax.Array
    valid: jax.Array | None = None
    causal: bool = flax.struct.field(pytree_node=False, default=True)

    def axes(self) -> "KVView":
        """The view's logical layout (for ``sharding.per_shard``): rows and KV heads shard, slots do not."""
        ints = ROWS if self.lengths.ndim == 1 else BK
        live = None if self.valid is None else (ROWS if self.valid.ndim == 2 else BKS)
        return self.replace(kv=self.kv.axes(), lengths=ints, offsets=ints, valid=live)


def attend_view(impl: str, q: jax.Array, view: KVView, spec: AttentionSpec, *,
                stat_weights: jax.Array | None = None, residuals: bool = False, few: int = 0) -> Attended:
    """Attend ``q [b, t, h, d]`` (rotated) to ``view`` under the layer's ``spec`` with backend ``impl``.

    Returns an ``Attended``: ``out [b, t, h, d]``; with ``stat_weights [b, t]`` (positive for queries that count)
    ``weights [b, k, S]`` float32, the probabilities the counted queries give each slot summed over queries and
    each KV group (H2O / TOVA / SnapKV statistics; soft-capped logits as the output sees them); with ``residuals``
    ``m, l [b, t, h]`` for :func:`lcx.kernels.merge_partials`. ``spec.window`` applies to the chunk path; a
    one-query call reads it from ``view.valid``, which the cache builds from its slots' positions. The payload
    ``view.kv`` picks the op that reads its arrays (``decode`` / ``chunk`` / ``column_sums``, or the codes' ops).

    ``few``: a causal call of at most this many queries runs the ``decode`` op once per query over the view's own
    ``[b, k, S, d]`` layout (``_few_queries``) instead of ``chunk``, whose kernels read ``[b, S, k, d]`` - a
    transposed copy of the whole cache per call, which for a speculative verification of 5 tokens cost more than
    the attention (XLA backend only: a Pallas decode kernel is not vmapped)."""
    backend = kernels.backend(impl)
    extra = kernels.spec_kwargs(spec)
    counted = stat_weights is not None
    if 1 < q.shape[1] <= few and view.causal and backend.name == "xla":
        return _few_queries(backend, q, view, spec, extra, stat_weights, residuals)
    if q.shape[1] == 1:
        if view.valid is None:
            raise ValueError("a one-query attend needs KVView.valid (the slots the query sees)")
        res = view.kv.decode(backend, q[:, 0], valid=view.valid, sm_scale=spec.sm_scale, weights=counted,
                             residuals=residuals, extra=extra)
        weights = res.weights * (stat_weights[:, :1, None] > 0) if counted else None
        expand = lambda x: None if x is None else x[:, None]  # noqa: E731
        return Attended(out=res.out[:, None], weights=weights, m=expand(res.m), l=expand(res.l))
    return view.kv.chunk(backend, q, q_offsets=view.offsets, kv_lengths=view.lengths, sm_scale=spec.sm_scale,
                         causal=view.causal, residuals=residuals, extra=extra, stat_weights=stat_weights)


def _few_queries(backend, q, view: KVView, spec: AttentionSpec, extra, stat_weights, residuals) -> Attended:
    """``attend_view`` of a few causal queries: query i sees the packed slots below ``min(offsets + i + 1,
    lengths)`` (and, with a window, above its slot minus the window) - the ``chunk`` op's mask - through the payload's
    ``few`` (the keys and values read once) or, for a payload without one (bit-packed codes), its ``decode`` once
    per query. Same values up to float32 summation order."""
    t, slots = q.shape[1], view.kv.k.shape[2]
    own = view.offsets[..., None] + jnp.arange(t)  # [b, (k,) t]: each query's slot
    valid = jnp.arange(slots) < jnp.minimum(own + 1, view.lengths[..., None])[..., None]  # [b, (k,) t, S]
    if spec.window is not None:
        valid &= jnp.arange(slots) > own[..., None] - spec.window
    count = None if stat_weights is None else stat_weights > 0
    if hasattr(view.kv, "few"):
        return view.kv.few(q, valid=valid, sm_scale=spec.sm_scale, count=count, residuals=residuals, extra=extra)

    def one(q_i, valid_i):
        return view.kv.decode(backend, q_i, valid=valid_i, sm_scale=spec.sm_scale, weights=count is not None,
                              residuals=residuals, extra=extra)

    res = jax.vmap(one, in_axes=(1, valid.ndim - 2), out_axes=0)(q, valid)  # [t, b, ...]
    weights = None if count is None else jnp.einsum("tbks,bt->bks", res.weights, count.astype(res.weights.dtype))
    move = lambda x: None if x is None else jnp.moveaxis(x, 0, 1)  # noqa: E731
    return Attended(out=move(res.out), weights=weights, m=move(res.m), l=move(res.l))


def packed_valid(lengths: jax.Array, slots: int) -> jax.Array:
    """The live mask ``[b, S]`` of a packed view whose first ``lengths [b]`` slots are live."""
    return jnp.arange(slots)[None, :] < lengths[:, None]


__all__ = ["KVView", "attend_view", "packed_valid"]
