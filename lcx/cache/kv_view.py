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

import flax.struct
import jax
import jax.numpy as jnp

from lcx import kernels
from lcx.kernels import Attended
from lcx.kernels.lowbit_decode import LowbitKV
from lcx.model.config import AttentionSpec
from lcx.parallel.sharding import BK, BKS, BKSD, ROWS


@flax.struct.dataclass
class KVView:
    """Keys and values as one layer's queries see them.

    ``k, v [b, k, S, d]``: live slots packed in position order (rotated as the queries expect). ``lengths [b] |
    [b, k]``: the live slots are those below it. ``offsets [b] | [b, k]``: the slot of the call's first query
    (``causal``: query i sees slots ``<= offsets + i``; not causal: every live slot, e.g. recalled blocks older
    than every query). ``valid [b, S] | [b, k, S]``: the slots a single decode query sees (holes allowed; a window
    or the causal limit folded in) - needed only for one-query calls. ``k_scale, v_scale [b, k, S]``: ``k, v`` are
    8-bit codes with these per-slot scales (``lcx.kernels.quant``; None: ``k, v`` are values). ``lowbit``: ``k, v``
    are 4- or 2-bit packed codes with these group scales, zeros and float window (``lcx.kernels.lowbit_decode``;
    one-query calls only - a chunk reads the layer dequantized)."""

    k: jax.Array
    v: jax.Array
    lengths: jax.Array
    offsets: jax.Array
    valid: jax.Array | None = None
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None
    lowbit: LowbitKV | None = None
    causal: bool = flax.struct.field(pytree_node=False, default=True)

    def axes(self) -> "KVView":
        """The view's logical layout (for ``sharding.per_shard``): rows and KV heads shard, slots do not."""
        ints = ROWS if self.lengths.ndim == 1 else BK
        live = None if self.valid is None else (ROWS if self.valid.ndim == 2 else BKS)
        scales = lambda x: None if x is None else BKS  # noqa: E731
        lowbit = None if self.lowbit is None else self.lowbit.replace(
            k_scale=BKSD, k_zero=BKSD, v_scale=BKSD, v_zero=BKSD, k_win=BKSD, v_win=BKSD, win_start=BK)
        return self.replace(k=BKSD, v=BKSD, lengths=ints, offsets=ints, valid=live, k_scale=scales(self.k_scale),
                            v_scale=scales(self.v_scale), lowbit=lowbit)

    def scales(self, layout: str) -> dict:
        """The backend keywords of an 8-bit view: its scales in the op's layout (``decode``: ``[b, k, S]``;
        ``chunk``: ``[b, S, k]``); none for a float view, so a float cache calls the ops exactly as before."""
        out = {}
        for name in ("k_scale", "v_scale"):
            x = getattr(self, name)
            if x is not None:
                out[name] = x if layout == "decode" else x.swapaxes(1, 2)
        return out


def attend_view(impl: str, q: jax.Array, view: KVView, spec: AttentionSpec, *,
                stat_weights: jax.Array | None = None, residuals: bool = False) -> Attended:
    """Attend ``q [b, t, h, d]`` (rotated) to ``view`` under the layer's ``spec`` with backend ``impl``.

    Returns an ``Attended``: ``out [b, t, h, d]``; with ``stat_weights [b, t]`` (positive for queries that count)
    ``weights [b, k, S]`` float32, the probabilities the counted queries give each slot summed over queries and
    each KV group (H2O / TOVA / SnapKV statistics; soft-capped logits as the output sees them); with ``residuals``
    ``m, l [b, t, h]`` for :func:`lcx.kernels.merge_partials`. ``spec.window`` applies to the chunk path; a
    one-query call reads it from ``view.valid``, which the cache builds from its slots' positions."""
    backend = kernels.backend(impl)
    extra = kernels.spec_kwargs(spec)
    counted = stat_weights is not None
    lowbit_decode, lowbit_chunk = backend.lowbit_ops()
    if view.lowbit is not None and q.shape[1] != 1:
        if lowbit_chunk is None or counted:
            raise ValueError(f"a bit-packed KVView (lowbit) is read by one-query calls, and by the chunks of a backend "
                             f"with a lowbit_chunk op without statistics (pallas); a chunk of {q.shape[1]} queries on "
                             f"{backend.name!r} reads the layer dequantized (lcx.cache.lowbit_slots.float_kv)")
        return lowbit_chunk(q, view.k, view.v, view.lowbit, q_offsets=view.offsets, kv_lengths=view.lengths,
                                    sm_scale=spec.sm_scale, softcap=spec.softcap, residuals=residuals)
    if q.shape[1] == 1:
        if view.valid is None:
            raise ValueError("a one-query attend needs KVView.valid (the slots the query sees)")
        if view.lowbit is not None:  # on the codes: fused XLA, or the Pallas kernel (the backend's lowbit_decode)
            res = lowbit_decode(q[:, 0], view.k, view.v, view.lowbit, valid=view.valid,
                                sm_scale=spec.sm_scale, softcap=spec.softcap, weights=counted, residuals=residuals)
        else:
            res = backend.decode(q[:, 0], view.k, view.v, valid=view.valid, sm_scale=spec.sm_scale,
                                 weights=counted, residuals=residuals,
                                 **{n: x for n, x in extra.items() if n != "window"}, **view.scales("decode"))
        weights = res.weights * (stat_weights[:, :1, None] > 0) if counted else None
        expand = lambda x: None if x is None else x[:, None]  # noqa: E731
        return Attended(out=res.out[:, None], weights=weights, m=expand(res.m), l=expand(res.l))
    # the prefill kernels read [b, S, k, d]: one transpose per chunk
    k, v = view.k.swapaxes(1, 2), view.v.swapaxes(1, 2)
    scales = view.scales("chunk")
    res = backend.chunk(q, k, v, q_offsets=view.offsets, kv_lengths=view.lengths, sm_scale=spec.sm_scale,
                        causal=view.causal, residuals=residuals, **extra, **scales)
    if counted:
        if not view.causal:
            raise ValueError("attention statistics are defined for causal views (a cache's own slots)")
        sums = backend.column_sums(q, k, q_offsets=view.offsets, kv_lengths=view.lengths,
                                   query_weights=stat_weights, sm_scale=spec.sm_scale, **extra,
                                   **{n: x for n, x in scales.items() if n == "k_scale"})
        res = res.replace(weights=sums)
    return res


def packed_valid(lengths: jax.Array, slots: int) -> jax.Array:
    """The live mask ``[b, S]`` of a packed view whose first ``lengths [b]`` slots are live."""
    return jnp.arange(slots)[None, :] < lengths[:, None]


__all__ = ["KVView", "attend_view", "packed_valid"]
