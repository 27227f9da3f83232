"""What a KV storage hands attention: one payload per view, which calls the backend op that reads it.

A :class:`lcx.cache.kv_view.KVView` carries one of these (``view.kv``) beside its row ints and masks. Each payload
knows which op of the backend table reads its arrays and with which explicit arguments - float keys and values,
8-bit codes with their per-slot scales, bit-packed codes with their group scales and float window - so
``attend_view`` never asks what the cache stores. The kernels keep their explicit scale / code arguments (vLLM's
practice); a payload only chooses the call.

Shapes: b batch, t queries, S slots, h query heads, k KV heads, d head dim.
"""

from __future__ import annotations

import flax.struct
import jax

from lcx.kernels import Attended
from lcx.kernels.few import few_query_attention
from lcx.kernels.lowbit_decode import LowbitKV
from lcx.kernels.quant import dequantize
from lcx.parallel.sharding import BK, BKS, BKSD


@flax.struct.dataclass
class FloatKV:
    """Keys and values ``[b, k, S, d]`` as values (any float dtype)."""

    k: jax.Array
    v: jax.Array

    def axes(self) -> "FloatKV":
        """The logical layout (``sharding.per_shard``): rows and KV heads shard, slots do not."""
        return self.replace(k=BKSD, v=BKSD)

    def _scales(self, layout: str, names=("k_scale", "v_scale")) -> dict:
        """The backend keywords beside ``k, v`` (none for float arrays: the ops are called exactly as before)."""
        return {}

    def float_keys(self, dtype) -> jax.Array:
        """The keys as values in ``dtype`` (to rotate them whole, "cache" positions)."""
        return self.k

    def with_keys(self, k: jax.Array) -> "FloatKV":
        """This payload with float keys ``k`` in place of the stored ones (their scales dropped)."""
        return self.replace(k=k)

    def decode(self, backend, q, *, valid, sm_scale, weights, residuals, extra):
        """One query ``q [b, h, d]`` against the slots ``valid [b, (k,) S]`` shows (the backend's ``decode``)."""
        return backend.decode(q, self.k, self.v, valid=valid, sm_scale=sm_scale, weights=weights, residuals=residuals,
                              **{n: x for n, x in extra.items() if n != "window"}, **self._scales("decode"))

    def few(self, q, *, valid, sm_scale, count, residuals, extra) -> Attended:
        """A few queries ``q [b, t, h, d]`` in this layout, the keys and values read once
        (``lcx.kernels.few.few_query_attention``; ``valid [b, (k,) t, S]``; ``count [b, t]``: the queries whose
        probabilities are summed into ``weights``, None for none)."""
        out, weights, m, l = few_query_attention(q, self.k, self.v, valid=valid, sm_scale=sm_scale,
                                                 softcap=extra.get("softcap"), count=count, residuals=residuals,
                                                 **self._scales("decode"))
        return Attended(out=out, weights=weights, m=m, l=l)

    def chunk(self, backend, q, *, q_offsets, kv_lengths, sm_scale, causal, residuals, extra, stat_weights=None):
        """Queries ``q [b, t, h, d]`` (the backend's ``chunk``; the prefill kernels read ``[b, S, k, d]``: one
        transpose per chunk), and with ``stat_weights`` the column sums of eviction statistics."""
        k, v = self.k.swapaxes(1, 2), self.v.swapaxes(1, 2)
        scales = self._scales("chunk")
        res = backend.chunk(q, k, v, q_offsets=q_offsets, kv_lengths=kv_lengths, sm_scale=sm_scale, causal=causal,
                            residuals=residuals, **extra, **scales)
        if stat_weights is None:
            return res
        if not causal:
            raise ValueError("attention statistics are defined for causal views (a cache's own slots)")
        sums = backend.column_sums(q, k, q_offsets=q_offsets, kv_lengths=kv_lengths, query_weights=stat_weights,
                                   sm_scale=sm_scale, **extra, **self._scales("chunk", ("k_scale",)))
        return res.replace(weights=sums)


@flax.struct.dataclass
class ScaledKV(FloatKV):
    """8-bit codes ``k, v [b, k, S, d]`` with one scale per slot and KV head ``k_scale, v_scale [b, k, S]``
    (``lcx.kernels.quant``); the ops fold the scales into their logits and probabilities tile by tile. A key scale
    of None: the keys are values (rotated at read time)."""

    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None

    def axes(self) -> "ScaledKV":
        scales = lambda x: None if x is None else BKS  # noqa: E731
        return self.replace(k=BKSD, v=BKSD, k_scale=scales(self.k_scale), v_scale=scales(self.v_scale))

    def _scales(self, layout: str, names=("k_scale", "v_scale")) -> dict:
        """The scales ``names`` in the op's layout (``decode``: ``[b, k, S]``; ``chunk``: ``[b, S, k]``)."""
        out = {}
        for name in names:
            x = getattr(self, name)
            if x is not None:
                out[name] = x if layout == "decode" else x.swapaxes(1, 2)
        return out

    def float_keys(self, dtype) -> jax.Array:
        return dequantize(self.k, self.k_scale, dtype)

    def with_keys(self, k: jax.Array) -> "ScaledKV":
        return self.replace(k=k, k_scale=None)


@flax.struct.dataclass
class PackedKV:
    """4- or 2-bit packed codes ``k, v`` with their group scales, zeros and float window (``lowbit``,
    ``lcx.kernels.lowbit_decode``): read by the backend's ``lowbit_decode`` op and, where it has one and no
    statistic is asked (pallas), its ``lowbit_chunk`` op."""

    k: jax.Array
    v: jax.Array
    lowbit: LowbitKV

    def axes(self) -> "PackedKV":
        return self.replace(k=BKSD, v=BKSD, lowbit=self.lowbit.replace(
            k_scale=BKSD, k_zero=BKSD, v_scale=BKSD, v_zero=BKSD, k_win=BKSD, v_win=BKSD, win_start=BK))

    def float_keys(self, dtype) -> jax.Array:
        raise ValueError("a bit-packed KVView is read on its codes; a caller that rotates keys reads the layer "
                         "dequantized (KVStorage.view(..., codes=False))")

    def decode(self, backend, q, *, valid, sm_scale, weights, residuals, extra):
        lowbit_decode, _ = backend.lowbit_ops(q.shape[-1])  # fused XLA, or the Pallas kernel
        return lowbit_decode(q, self.k, self.v, self.lowbit, valid=valid, sm_scale=sm_scale,
                             softcap=extra.get("softcap"), weights=weights, residuals=residuals)

    def chunk(self, backend, q, *, q_offsets, kv_lengths, sm_scale, causal, residuals, extra, stat_weights=None):
        _, lowbit_chunk = backend.lowbit_ops(q.shape[-1])
        if lowbit_chunk is None or stat_weights is not None:
            raise ValueError(f"a bit-packed KVView (lowbit) is read by one-query calls, and by the chunks of a backend "
                             f"with a lowbit_chunk op without statistics (pallas); a chunk of {q.shape[1]} queries on "
                             f"{backend.name!r} reads the layer dequantized (lcx.cache.lowbit_slots.float_kv)")
        return lowbit_chunk(q, self.k, self.v, self.lowbit, q_offsets=q_offsets, kv_lengths=kv_lengths,
                            sm_scale=sm_scale, softcap=extra.get("softcap"), residuals=residuals)


__all__ = ["FloatKV", "PackedKV", "ScaledKV"]
