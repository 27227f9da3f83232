"""Context parallelism: one sequence's activations split over the mesh's ``seq`` axis, attention across it.

Einsum legend: b batch, t positions (a device's share), h query heads, k kv heads, d head dim; n the size of the
``seq`` axis, c = T / (2n) the chunk length of a sequence of T positions.

**Zig-zag assignment.** A row of T positions is cut into 2n chunks; device i holds chunks ``i`` and ``2n - 1 - i``
(:func:`zigzag_order`). Under a causal mask chunk j attends to j + 1 chunks, so every device's pair attends to
``2n + 1`` chunk pairs: equal work (:func:`attention_tiles` counts it), where contiguous shards would give the last
device 2n - 1 times the first's. The data pipeline lays rows out in this order before they reach the step
(:func:`layout_batch`: every ``[b, T]`` array permuted, positions added), so the model sees ordinary arrays
sharded ``("data", "seq")``; RoPE reads the permuted positions, the loss is a sum over tokens.

**Strategies** (``train.context_parallel``, or ``attention.context_parallel`` of the model config):

- ``ring``: each device keeps its queries and passes its keys and values (with their segment ids) around the ring
  with ``ppermute``; at step s device i holds the chunks of device ``i - s``. Of the four (query chunk, key chunk)
  pairs, ``(i, 2n-1-src)`` is always hidden and skipped; ``(2n-1-i, src)`` is always fully visible; of ``(i, src)``
  and ``(2n-1-i, 2n-1-src)`` one is visible (both diagonal at step 0) - two chunk pairs of work per step on every
  device. Blocks are ``lcx.kernels.blockwise`` ops (Pallas flash kernels on a GPU) merged exactly by log-sum-exp.
  The backward (a custom VJP) runs the ring again: each block's gradients from the whole attention's output and
  log-sum-exp (the flash backward kernels per block), dQ accumulated in place, dK / dV travelling with their keys
  and arriving home after n moves. Per device it holds two key chunks (plus their gradients) at a time, never the
  sequence's keys.
- ``all_gather``: keys, values and segment ids are all-gathered over ``seq`` (reordered to sequence order) and each
  local query chunk attends to them as one block; the backward's dK / dV are reduce-scattered back (the transpose
  of the gather). Simpler, and faster while the keys of one layer fit: one collective instead of n - 1 steps.

Packed documents: segment ids travel with their keys, and positions restart per document in the permuted
positions; a query's causal bound comes from the chunk structure (sequence order), its document from the ids.
GQA keeps KV heads on ``model``: the shard_map splits heads there and rows over ``data``, as ``per_shard`` does.

Inference prefill runs the same attention (a model call without a cache on a mesh with ``seq > 1``): the prompt's
logits come back in zig-zag order (:func:`unlayout` puts them back). The generator's caches are not sharded by
sequence: decode runs on a mesh without a ``seq`` axis.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lcx.parallel import sharding
from lcx.config_base import ConfigError
from lcx.kernels import blockwise
from lcx.kernels.backends import resolve

from lcx.parallel.names import STRATEGIES  # re-exported
AXIS = "seq"


# --------------------------------------------------------------------------------------------------- layout
def zigzag_order(length: int, n: int) -> np.ndarray:
    """The sequence index of each position of the laid-out row (device-major): device i holds chunks ``i`` and
    ``2n - 1 - i`` of ``2n``. ``length`` must be a multiple of ``2n``."""
    check_length(length, n)
    c = length // (2 * n)
    chunks = [j for i in range(n) for j in (i, 2 * n - 1 - i)]
    return np.concatenate([np.arange(j * c, (j + 1) * c) for j in chunks])


def contiguous_order(length: int, n: int) -> np.ndarray:
    """Plain shards (device i holds positions ``[i T/n, (i+1) T/n)``): the unbalanced baseline of the tile count."""
    return np.arange(length)


def check_length(length: int, n: int, key: str = "sequence length", axis_key: str = "mesh.seq") -> None:
    """``ConfigError`` unless ``length`` (named ``key``) splits into the ``2n`` equal chunks of ``n`` sequence
    shards: the one check of a run's ``train.seq_len``, the planner's ``--context`` and an attention's length."""
    if length % (2 * n):
        raise ConfigError(f"{key}={length} is invalid with {axis_key}={n}: context parallelism cuts each row into "
                          f"2 x seq = {2 * n} equal chunks, so it must be a multiple of {2 * n}")


def layout_batch(batch: Mapping[str, np.ndarray], n: int) -> dict[str, np.ndarray]:
    """A training batch of ``[b, T]`` arrays laid out for ``n`` sequence shards: ``positions`` added (0 .. T - 1)
    when absent, then every array permuted by :func:`zigzag_order`. The loss (a weighted sum over tokens) is
    unchanged; attention and RoPE read the permuted positions and segment ids."""
    batch = dict(batch)
    length = next(iter(batch.values())).shape[1]
    order = zigzag_order(length, n)
    if "positions" not in batch:
        rows = next(iter(batch.values())).shape[0]
        batch["positions"] = np.broadcast_to(np.arange(length, dtype=np.int32), (rows, length))
    return {name: np.ascontiguousarray(np.asarray(x)[:, order]) for name, x in batch.items()}


def unlayout(x, n: int, axis: int = 1):
    """``x`` laid out by :func:`zigzag_order` along ``axis`` back in sequence order (e.g. a prefill's logits)."""
    inverse = np.argsort(zigzag_order(x.shape[axis], n))
    return jnp.take(x, inverse, axis=axis)


def attention_tiles(order: np.ndarray, n: int, tile: int) -> np.ndarray:
    """Per device, the ``(query tile, key tile)`` pairs of a causal attention that hold a visible entry, for rows
    laid out by ``order`` (sequence index per position) over ``n`` devices: the work a tiled kernel does for its
    query tiles against the sequence's key tiles. Key tile ``j`` (keys ``[j tile, (j + 1) tile)``) is visible to a
    query tile when its latest query is at or past ``j tile``."""
    share = len(order) // n
    counts = np.zeros(n, np.int64)
    for i in range(n):
        queries = order[i * share:(i + 1) * share]
        for lo in range(0, share, tile):
            counts[i] += int(queries[lo:lo + tile].max()) // tile + 1
    return counts


# --------------------------------------------------------------------------------------------------- ring
def _halves(x):
    c = x.shape[1] // 2
    return x[:, :c], x[:, c:]


def _permute(x, n: int):
    return lax.ppermute(x, AXIS, [(i, (i + 1) % n) for i in range(n)])


def _pairs(r, src, n: int, c: int):
    """``(query half, key half, offset)`` of the three blocks of a ring step that can hold visible keys."""
    mine, theirs = (r, 2 * n - 1 - r), (src, 2 * n - 1 - src)
    return [(a, b, (mine[a] - theirs[b]) * c) for a, b in ((0, 0), (1, 0), (1, 1))]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _ring(spec: blockwise.BlockSpec, n: int, q, k, v, seg):
    return _ring_forward(spec, n, q, k, v, seg)[0]


def _ring_forward(spec, n, q, k, v, seg):
    r = lax.axis_index(AXIS)
    c = q.shape[1] // 2
    qs, q_segs = _halves(q), (None, None) if seg is None else _halves(seg)

    def compute(s, acc, kv):
        k, v, kseg = kv
        ks, vs, k_segs = _halves(k), _halves(v), (None, None) if kseg is None else _halves(kseg)
        acc = list(acc)
        for a, b, off in _pairs(r, (r - s) % n, n, c):
            part = blockwise.forward(spec, qs[a], ks[b], vs[b], off, q_segs[a], k_segs[b])
            acc[a] = blockwise.merge(acc[a], part)
        return tuple(acc)

    def step(s, carry):
        acc, kv = carry
        return compute(s, acc, kv), jax.tree.map(lambda x: _permute(x, n), kv)

    acc = (blockwise.empty(qs[0]), blockwise.empty(qs[1]))
    acc, kv = lax.fori_loop(0, n - 1, step, (acc, (k, v, seg)))
    (o0, l0), (o1, l1) = compute(n - 1, acc, kv)
    o, lse = jnp.concatenate([o0, o1], axis=1), jnp.concatenate([l0, l1], axis=1)
    return o.astype(q.dtype), lse


def _ring_fwd(spec, n, q, k, v, seg):
    o, lse = _ring_forward(spec, n, q, k, v, seg)
    return o, (q, k, v, seg, o, lse)


def _ring_bwd(spec, n, res, do):
    q, k, v, seg, o, lse = res
    r = lax.axis_index(AXIS)
    c = q.shape[1] // 2
    qs, os_, lses, dos = _halves(q), _halves(o), _halves(lse), _halves(do)
    q_segs = (None, None) if seg is None else _halves(seg)

    def step(s, carry):
        dq, (k, v, kseg), (dk, dv) = carry
        ks, vs, k_segs = _halves(k), _halves(v), (None, None) if kseg is None else _halves(kseg)
        dq, dk, dv = list(_halves(dq)), list(_halves(dk)), list(_halves(dv))
        for a, b, off in _pairs(r, (r - s) % n, n, c):
            gq, gk, gv = blockwise.backward(spec, qs[a], ks[b], vs[b], off, q_segs[a], k_segs[b], os_[a], lses[a],
                                            dos[a])
            dq[a], dk[b], dv[b] = dq[a] + gq, dk[b] + gk, dv[b] + gv
        dq, dk, dv = (jnp.concatenate(x, axis=1) for x in (dq, dk, dv))
        # the keys move on; their gradients travel with them and after n moves are back on their own device
        kv, grads = jax.tree.map(lambda x: _permute(x, n), ((k, v, kseg), (dk, dv)))
        return dq, kv, grads

    zeros = lambda x: jnp.zeros(x.shape, jnp.float32)  # noqa: E731
    dq, _, (dk, dv) = lax.fori_loop(0, n, step, (zeros(q), (k, v, seg), (zeros(k), zeros(v))))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_ring.defvjp(_ring_fwd, _ring_bwd)


# --------------------------------------------------------------------------------------------------- all-gather
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _block(spec: blockwise.BlockSpec, q, k, v, offset, q_seg, k_seg):
    return blockwise.forward(spec, q, k, v, offset, q_seg, k_seg)[0].astype(q.dtype)


def _block_fwd(spec, q, k, v, offset, q_seg, k_seg):
    o, lse = blockwise.forward(spec, q, k, v, offset, q_seg, k_seg)
    o = o.astype(q.dtype)
    return o, (q, k, v, offset, q_seg, k_seg, o, lse)


def _block_bwd(spec, res, do):
    q, k, v, offset, q_seg, k_seg, o, lse = res
    dq, dk, dv = blockwise.backward(spec, q, k, v, offset, q_seg, k_seg, o, lse, do)
    return dq, dk, dv, None, None, None


_block.defvjp(_block_fwd, _block_bwd)


def _sequence_order(x, n: int):
    """An all-gathered ``[b, 2n c, ...]`` (device-major zig-zag chunks) in sequence order."""
    b, total = x.shape[:2]
    c = total // (2 * n)
    chunks = x.reshape(b, 2 * n, c, *x.shape[2:])
    at = [2 * j if j < n else 2 * (2 * n - 1 - j) + 1 for j in range(2 * n)]  # gathered index of sequence chunk j
    return jnp.take(chunks, np.asarray(at), axis=1).reshape(x.shape)


def _all_gather(spec: blockwise.BlockSpec, n: int, q, k, v, seg):
    r = lax.axis_index(AXIS)
    c = q.shape[1] // 2
    gather = lambda x: _sequence_order(lax.all_gather(x, AXIS, axis=1, tiled=True), n)  # noqa: E731
    keys, values = gather(k), gather(v)
    key_seg = None if seg is None else gather(seg)
    q_segs = (None, None) if seg is None else _halves(seg)
    outs = [_block(spec, qh, keys, values, start * c, qs, key_seg)
            for qh, qs, start in zip(_halves(q), q_segs, (r, 2 * n - 1 - r))]
    return jnp.concatenate(outs, axis=1)


# --------------------------------------------------------------------------------------------------- entry
def block_impl(impl: str) -> str:
    """The block ops of an ``attention.impl``: the Pallas flash kernels for ``pallas`` and ``cudnn`` (``auto`` on a
    GPU; a ring's blocks need the residuals cuDNN's causal op does not return), dense jnp blocks otherwise."""
    return "pallas" if resolve(impl) in ("pallas", "cudnn") else "jnp"


def sequence_axis() -> int:
    """Size of the context mesh's ``seq`` axis (1 without a mesh or inside a manual region)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or any(t == jax.sharding.AxisType.Manual for t in mesh.axis_types):
        return 1
    return sharding.axis_size(mesh, AXIS)


def attend(q, k, v, segment_ids=None, *, strategy: str, impl: str, sm_scale: float, window: int | None = None,
           softcap: float | None = None):
    """Causal attention of laid-out rows split over the context mesh's ``seq`` axis: ``q [b, T, h, d]``, ``k, v [b,
    T, k, d]``, ``segment_ids [b, T]`` or None, all in :func:`zigzag_order` -> ``[b, T, h, d]`` (same order)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"context_parallel={strategy!r} is invalid: must be one of {list(STRATEGIES)}")
    mesh = jax.sharding.get_abstract_mesh()
    n = sharding.axis_size(mesh, AXIS)
    check_length(q.shape[1], n)
    spec = blockwise.BlockSpec(sm_scale=float(sm_scale), window=window, softcap=softcap, impl=block_impl(impl))
    inner = functools.partial(_ring if strategy == "ring" else _all_gather, spec, n)
    tokens = ("batch", "sequence", "heads", "head_dim")
    kv = ("batch", "sequence", "kv_heads", "head_dim")
    what = f"context-parallel attention ({strategy})"
    specs = [sharding.spec_for(tokens, q.shape, mesh, what), sharding.spec_for(kv, k.shape, mesh, what),
             sharding.spec_for(kv, v.shape, mesh, what)]
    args = [q, k, v]
    if segment_ids is not None:
        specs.append(sharding.spec_for(("batch", "sequence"), segment_ids.shape, mesh, what))
        args.append(segment_ids)
        fn = inner
    else:
        fn = lambda q, k, v: inner(q, k, v, None)  # noqa: E731
    return jax.shard_map(fn, mesh=mesh, in_specs=tuple(specs), out_specs=specs[0], check_vma=False)(*args)


__all__ = ["AXIS", "STRATEGIES", "attend", "attention_tiles", "block_impl", "check_length", "contiguous_order",
           "layout_batch", "sequence_axis", "unlayout", "zigzag_order"]
