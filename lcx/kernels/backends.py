"""The attention backend table: per implementation, the four functions the model and the caches call.

Einsum legend: b batch, t queries, s keys / cache slots, h query heads, k kv heads, d head dim.

=============  =====================================================================================================
``causal``      self-attention of a whole sequence: ``q [b, t, h, d]``, ``k, v [b, t, k, d]`` -> ``[b, t, h, d]``;
                ``segment_ids [b, t]`` (packed documents): a query sees only keys of its own segment
``chunk``       a prefill chunk against a cache whose live slots are packed in position order: query i of row b
                sits at slot ``q_offsets[b] + i`` and sees slots ``<= q_offsets[b] + i`` and ``< kv_lengths[b]``
                (``causal=False``: every slot below the length) -> ``Attended`` (``out``; ``m, l`` with
                ``residuals``)
``decode``      one query per row against slots with holes: ``q [b, h, d]``, ``k, v [b, k, s, d]`` (the slot
                cache's own layout, so a decode step reads it without a copy), ``valid [b, s]`` -> ``Attended``
                (``out``; ``weights [b, k, s]`` with ``weights``: probabilities summed over each KV group; ``m, l``
                with ``residuals``)
``column_sums`` attention each slot receives from the queries with ``query_weights [b, t] > 0`` of a chunk (masks as
                ``chunk``), summed over queries and each KV group -> ``[b, k, s]`` float32 (H2O / SnapKV scores)
``paged_decode`` one query per row against its pages of a paged cache: ``q [b, h, d]``, the pool ``k, v [P, k, c, d]``,
                ``table [b, T]`` page ids in position order, ``lengths [b]`` -> ``Attended`` (``out``; ``m, l``
                with ``residuals``). Pallas reads the pages in place; the others gather them into the ``decode``
                layout (a row that omits it gets that gather path)
=============  =====================================================================================================

``lowbit_decode`` is ``decode`` on a bit-packed cache (``int4`` / ``int2``): the codes, their group scales and the
float window (``lcx.kernels.LowbitKV``) instead of ``k, v`` values - the fused XLA formulation (``decode_lowbit``)
for ``reference`` and ``xla``, the split-K kernel that unpacks tile by tile for ``pallas``
(``lcx.kernels.lowbit_pallas``). ``lowbit_chunk`` is ``chunk`` on the codes (``pallas``: ``chunk_lowbit_tiles``);
a backend without it (None) gets the layer dequantized by its caller and its float ``chunk``.

``chunk``, ``decode``, ``column_sums`` and ``paged_decode`` also take ``k_scale, v_scale`` (``column_sums``: only
``k_scale``): ``k, v`` are then 8-bit codes of a quantized cache (``lcx.kernels.quant``) and the scales, one per slot
and KV head (``[b, s, k]`` in the chunk layout, ``[b, k, s]`` in the decode layout, ``[P, k, c]`` per page), are
folded into the logits and probabilities.

Every op also takes a layer's ``AttentionSpec`` settings (``spec_kwargs``): ``softcap`` (logits ``z`` -> ``softcap *
tanh(z / softcap)``, also in the statistics) and, for ``causal`` / ``chunk`` / ``column_sums``, ``window`` (a query
sees the ``window`` most recent positions, its own included). ``decode`` has no ``window``: its caller folds the
window into ``valid`` (the cache knows each slot's position).

``chunk`` and ``decode`` return one type whatever their flags, :class:`lcx.kernels.Attended` (fields ``out, weights,
m, l``, None when not asked for); the flags only choose what is computed. (Until the one-attention-core change they
returned tuples whose length followed the flags; unpacking an ``Attended`` raises a ``TypeError`` naming its
fields.) ``causal`` and ``column_sums`` return their one array.

Residuals ``(m, l)`` are each row's logit max and sum of exponentials (natural log base), which
:func:`lcx.kernels.merge_partials` combines exactly: a cache may attend its parts separately and merge.

Implementations: ``reference`` (pure jnp, float32 at HIGHEST precision: the oracle), ``xla`` (jnp / XLA attention at
default precision; ``causal`` through ``jax.nn.dot_product_attention``'s default implementation on GPU - XLA's, not
cuDNN -, query blocks that skip the upper triangle on CPU; ``chunk`` and ``column_sums`` in tiles that visit only
the keys a query block can see, ``kernels/tiled.py``), ``pallas`` (the flash, split-K decode and column-sum kernels:
compiled on GPU, interpreted elsewhere - a test path, slow by design), ``cudnn`` (NVIDIA GPUs only: ``causal``
through ``jax.nn.dot_product_attention(implementation="cudnn")`` - GQA, windows, training - for layers cuDNN can run,
the Pallas flash kernel for the rest (soft-cap, packed documents, float32; ``kernels/cudnn.py``); every other op is
the ``pallas`` row's: cuDNN has no form for statistics, bit-packed codes or pages). ``auto`` (the default of
``attention.impl``) is ``cudnn`` on an NVIDIA GPU, ``pallas`` on other GPUs (the kernels compile there) and ``xla``
elsewhere; ``cudnn`` without an NVIDIA GPU is a ``ValueError`` naming ``auto`` and ``xla``. The list of valid
``attention.impl`` values is this table's keys plus ``auto``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from lcx.kernels.mode import resolve_interpret, target_backend
from lcx.kernels.names import IMPLS
from lcx.kernels.attended import Attended, attended
from lcx.kernels.cudnn import cuda_gpu, cudnn_causal, require_cuda
from lcx.kernels.decode import decode_attention
from lcx.kernels.flash import flash_attention
from lcx.kernels.lowbit_decode import decode_lowbit
from lcx.kernels.lowbit_pallas import chunk_lowbit_tiles, decode_lowbit_tiles, triton_compiles
from lcx.kernels.paged_decode import gather_pages, paged_decode_attention
from lcx.kernels.quant import dequantize
from lcx.kernels.reference import (attention_column_sums_reference, attention_mask, attention_reference,
                                   decode_attention_reference, masked_attention_parts)
from lcx.kernels.tiled import tiled_attention, tiled_column_sums
from lcx.kernels.window_stats import attention_column_sums

_DEFAULT = jax.lax.Precision.DEFAULT


@dataclasses.dataclass(frozen=True)
class Backend:
    """One attention implementation (see the module docstring for the signatures)."""

    name: str
    causal: Callable
    chunk: Callable
    decode: Callable
    column_sums: Callable
    paged_decode: Callable | None = None  # None: gather the pages and call ``decode``
    lowbit_decode: Callable = decode_lowbit  # ``decode`` on a bit-packed cache's codes (default: fused XLA)
    lowbit_chunk: Callable | None = None  # ``chunk`` on the codes (None: the caller dequantizes the layer)
    # Whether the two ops above also run compiled (Triton, on a GPU) at a head dim; where not, a compiled run takes
    # the fused XLA decode and dequantizes a chunk's layer (``lowbit_ops``); the interpreter runs them at any
    lowbit_compiles: Callable[[int], bool] = lambda head_dim: True

    def __post_init__(self):
        if self.paged_decode is None:
            object.__setattr__(self, "paged_decode", _gathered_paged_decode(self.decode))

    def lowbit_ops(self, head_dim: int) -> tuple[Callable, Callable | None]:
        """``(decode on the codes, chunk on the codes or None)`` as they run here at ``head_dim`` (decided at trace
        time)."""
        if resolve_interpret(None) or self.lowbit_compiles(head_dim):
            return self.lowbit_decode, self.lowbit_chunk
        return decode_lowbit, None


def _compute_dtype(*xs):
    """XLA:CPU has no float16 dot with float32 accumulation: compute float16 inputs in float32 there."""
    if target_backend() == "cpu" and any(x.dtype == jnp.float16 for x in xs):
        return tuple(x.astype(jnp.float32) for x in xs)
    return xs


def spec_kwargs(spec) -> dict:
    """The backend keywords of an ``AttentionSpec``: only the settings it uses, so a plain global layer calls the
    ops exactly as before."""
    return {name: getattr(spec, name) for name in ("window", "softcap") if getattr(spec, name) is not None}


def _chunk_mask(q, k, q_offsets, kv_lengths, causal, window=None):
    return attention_mask(q.shape[1], k.shape[1], causal=causal, kv_lengths=kv_lengths, batch=q.shape[0],
                          q_offsets=q_offsets, window=window)


def _jnp_chunk(q, k, v, *, q_offsets, kv_lengths, sm_scale, causal=True, residuals=False, precision, window=None,
               softcap=None, k_scale=None, v_scale=None):
    dtype = q.dtype
    if k_scale is not None:  # the oracle: the values the codes stand for
        k, v = dequantize(k, k_scale), dequantize(v, v_scale)
    q, k, v = _compute_dtype(q, k, v)
    o, m, l = masked_attention_parts(q, k, v, _chunk_mask(q, k, q_offsets, kv_lengths, causal, window),
                                     sm_scale=sm_scale, precision=precision, softcap=softcap)
    o = o.astype(dtype)
    return (o, m, l) if residuals else o


def _xla_column_sums(q, k, *, q_offsets, kv_lengths, query_weights, sm_scale, window=None, softcap=None,
                     k_scale=None):
    # In float32 tiles (a prefill chunk's statistics over the whole cache would otherwise be a [b, k, g, t, C] float32
    # array); the same sums as the reference up to summation order. 8-bit codes are widened tile by tile.
    return tiled_column_sums(q.astype(jnp.float32), k if k_scale is not None else k.astype(jnp.float32),
                             q_offsets=q_offsets, kv_lengths=kv_lengths, query_weights=query_weights,
                             sm_scale=sm_scale, window=window, softcap=softcap, k_scale=k_scale)


def _jnp_column_sums(q, k, *, q_offsets, kv_lengths, query_weights, sm_scale, window=None, softcap=None,
                     k_scale=None):
    k = dequantize(k, k_scale) if k_scale is not None else k
    return attention_column_sums_reference(q, k, causal=True, sm_scale=sm_scale, kv_lengths=kv_lengths,
                                           q_offsets=q_offsets, query_weights=query_weights, window=window,
                                           softcap=softcap)


def _jnp_decode(q, k, v, *, valid, sm_scale, weights=False, residuals=False, precision, softcap=None, k_scale=None,
                v_scale=None):
    dtype = q.dtype
    q, k, v = _compute_dtype(q, k, v)
    out = decode_attention_reference(q, k, v, valid=valid, sm_scale=sm_scale, return_weights=weights,
                                     return_residuals=residuals, precision=precision, softcap=softcap,
                                     k_scale=k_scale, v_scale=v_scale)
    if isinstance(out, tuple):
        return (out[0].astype(dtype), *out[1:])
    return out.astype(dtype)


CPU_QUERY_BLOCK = 64  # the smallest query block of the CPU causal path
CPU_MAX_BLOCKS = 16  # longer sequences take larger blocks: the program is unrolled once per block
CPU_MIN_LENGTH = 4 * CPU_QUERY_BLOCK  # shorter sequences gain little and keep the dense path's exact sums


def _blocked_causal(q, k, v, *, sm_scale, segment_ids=None, window=None, softcap=None):
    """Causal self-attention one block of queries at a time, each block against the keys up to its own end.

    XLA:CPU's ``dot_product_attention`` materializes ``[b, h, t, t]`` float32 scores and masks half of them; here
    block i reads ``(i + 1)`` blocks of keys, so the upper triangle is never computed and each block's scores fit in
    cache: 8 x 512 tokens, 8 heads / 2 KV heads, head dim 32: 86 -> 40 ms per layer (2-core CPU). Same values up
    to float32 summation order (masked keys contribute exactly 0 either way). With a ``window`` a block reads only the
    keys from its first query's window on."""
    b, t = q.shape[:2]
    block = max(CPU_QUERY_BLOCK, -(-t // CPU_MAX_BLOCKS))
    outs = []
    for lo in range(0, t, block):
        hi = min(t, lo + block)
        first = 0 if window is None else max(0, lo - window + 1)  # keys before it are outside every window
        mask = attention_mask(hi - lo, hi - first, causal=True, batch=b, window=window)  # the last hi-lo keys
        if segment_ids is not None:
            mask = mask & (segment_ids[:, lo:hi, None] == segment_ids[:, None, first:hi])
        outs.append(masked_attention_parts(q[:, lo:hi], k[:, first:hi], v[:, first:hi], mask, sm_scale=sm_scale,
                                           precision=_DEFAULT, softcap=softcap)[0])
    return jnp.concatenate(outs, axis=1)


def _xla_causal(q, k, v, *, sm_scale, segment_ids=None, window=None, softcap=None):
    dtype = q.dtype
    q, k, v = _compute_dtype(q, k, v)
    # dot_product_attention has no soft-cap; the blocked path computes windows and caps on any backend
    if (target_backend() == "cpu" and q.shape[1] >= CPU_MIN_LENGTH) or window is not None or softcap is not None:
        return _blocked_causal(q, k, v, sm_scale=sm_scale, segment_ids=segment_ids, window=window,
                               softcap=softcap).astype(dtype)
    # jax.nn.dot_product_attention handles GQA itself (K/V heads broadcast over query groups); its default
    # implementation is XLA's on every backend (cuDNN only when asked: the ``cudnn`` row)
    mask = None
    if segment_ids is not None:  # [b, 1, t, s], broadcast over heads; combined with the causal mask
        mask = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
    return jax.nn.dot_product_attention(q, k, v, scale=sm_scale, is_causal=True, mask=mask).astype(dtype)


def _pallas_chunk(q, k, v, *, q_offsets, kv_lengths, sm_scale, causal=True, residuals=False, window=None,
                  softcap=None, k_scale=None, v_scale=None):
    return flash_attention(q, k, v, causal=causal, sm_scale=sm_scale, kv_lengths=kv_lengths, q_offsets=q_offsets,
                           return_residuals=residuals, window=window, softcap=softcap, k_scale=k_scale,
                           v_scale=v_scale)


def _pallas_decode(q, k, v, *, valid, sm_scale, weights=False, residuals=False, softcap=None, k_scale=None,
                   v_scale=None):
    return decode_attention(q, k, v, valid=valid, sm_scale=sm_scale, return_weights=weights,
                            return_residuals=residuals, softcap=softcap, k_scale=k_scale, v_scale=v_scale)


def _pallas_column_sums(q, k, *, q_offsets, kv_lengths, query_weights, sm_scale, window=None, softcap=None,
                        k_scale=None):
    return attention_column_sums(q, k, causal=True, sm_scale=sm_scale, kv_lengths=kv_lengths, q_offsets=q_offsets,
                                 query_weights=query_weights, window=window, softcap=softcap, k_scale=k_scale)


def _gathered_paged_decode(decode: Callable) -> Callable:
    """``paged_decode`` through ``decode``: each row's pages gathered into the contiguous ``[b, k, T * c, d]``."""
    def op(q, k_pages, v_pages, *, table, lengths, sm_scale, residuals: bool = False, k_scale=None, v_scale=None,
           **kwargs) -> Attended:
        k, v = gather_pages(k_pages, table), gather_pages(v_pages, table)
        valid = jnp.arange(k.shape[2])[None, :] < lengths[:, None]
        scales = {} if k_scale is None else dict(k_scale=gather_pages(k_scale, table),
                                                  v_scale=gather_pages(v_scale, table))
        return decode(q, k, v, valid=valid, sm_scale=sm_scale, residuals=residuals, **scales, **kwargs)
    return op


def _pallas_paged_decode(q, k_pages, v_pages, *, table, lengths, sm_scale, residuals: bool = False,
                         softcap=None, k_scale=None, v_scale=None) -> Attended:
    return attended(paged_decode_attention(q, k_pages, v_pages, table=table, lengths=lengths, sm_scale=sm_scale,
                                           softcap=softcap, return_residuals=residuals, k_scale=k_scale,
                                           v_scale=v_scale), residuals=residuals)


def _chunk_op(fn: Callable) -> Callable:
    """``fn`` (returning ``out`` or ``(out, m, l)``) as a ``chunk`` op returning an ``Attended``."""
    @functools.wraps(fn)
    def op(q, k, v, *, residuals: bool = False, **kwargs) -> Attended:
        return attended(fn(q, k, v, residuals=residuals, **kwargs), residuals=residuals)
    return op


def _decode_op(fn: Callable) -> Callable:
    """``fn`` (returning ``out [, weights] [, m, l]``) as a ``decode`` op returning an ``Attended``."""
    @functools.wraps(fn)
    def op(q, k, v, *, weights: bool = False, residuals: bool = False, **kwargs) -> Attended:
        return attended(fn(q, k, v, weights=weights, residuals=residuals, **kwargs), weights=weights,
                        residuals=residuals)
    return op


BACKENDS: dict[str, Backend] = {
    "reference": Backend(
        "reference",
        causal=lambda q, k, v, *, sm_scale, segment_ids=None, window=None, softcap=None: attention_reference(
            q, k, v, causal=True, sm_scale=sm_scale, segment_ids=segment_ids, window=window, softcap=softcap),
        chunk=_chunk_op(functools.partial(_jnp_chunk, precision=jax.lax.Precision.HIGHEST)),
        decode=_decode_op(functools.partial(_jnp_decode, precision=jax.lax.Precision.HIGHEST)),
        column_sums=_jnp_column_sums),
    # chunk: only the key tiles a query block can see - its cost follows the filled part of a cache, not its capacity
    "xla": Backend("xla", causal=_xla_causal, chunk=_chunk_op(tiled_attention),
                   decode=_decode_op(functools.partial(_jnp_decode, precision=_DEFAULT)),
                   column_sums=_xla_column_sums),
    "pallas": Backend("pallas", causal=lambda q, k, v, *, sm_scale, segment_ids=None, window=None, softcap=None:
                      flash_attention(q, k, v, causal=True, sm_scale=sm_scale, segment_ids=segment_ids, window=window,
                                      softcap=softcap),
                      chunk=_chunk_op(_pallas_chunk), decode=_decode_op(_pallas_decode),
                      column_sums=_pallas_column_sums, paged_decode=_pallas_paged_decode,
                      lowbit_decode=decode_lowbit_tiles, lowbit_chunk=chunk_lowbit_tiles,
                      # Triton takes the kernels at power-of-two head dims (tests/kernels/test_cuda_lowering.py lowers
                      # them for CUDA from a CPU); a model with another head dim decodes its codes in XLA
                      lowbit_compiles=triton_compiles),
}
# causal on cuDNN where it can run the layer; chunk, decode, statistics, pages and codes stay Pallas kernels (cuDNN's
# fused attention returns no column sums and reads neither bit-packed codes nor a page table)
BACKENDS["cudnn"] = dataclasses.replace(BACKENDS["pallas"], name="cudnn", causal=cudnn_causal)
if IMPLS != ("auto", *BACKENDS):  # the names config checks read (lcx.kernels.names) must list these backends
    raise RuntimeError(f"lcx.kernels.names.IMPLS={IMPLS} does not match the backends {list(BACKENDS)}")


def resolve(impl: str) -> str:
    """The backend ``impl`` names: ``auto`` is ``cudnn`` on an NVIDIA GPU (cuDNN's fused attention for ``causal``,
    the Pallas kernels compiled to Triton for the rest), ``pallas`` on other GPUs and ``xla`` elsewhere (on CPU the
    kernels would run in the Pallas interpreter). ``cudnn`` off an NVIDIA GPU is a ``ValueError``."""
    if impl == "auto":
        if target_backend() != "gpu":  # ``lowering_for("gpu")`` on a CPU: the GPU's choice, Pallas (no cuDNN here)
            return "xla"
        return "cudnn" if cuda_gpu() else "pallas"
    if impl not in BACKENDS:
        raise ValueError(f"attention impl={impl!r} is not available; allowed: {list(IMPLS)}")
    if impl == "cudnn":
        require_cuda(impl)
    return impl


def backend(impl: str) -> Backend:
    """The table row of ``impl`` (``auto`` resolved for the default JAX backend)."""
    return BACKENDS[resolve(impl)]


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, impl: str = "reference", causal: bool = True,
              sm_scale: float | None = None) -> jax.Array:
    """Self-attention over a whole sequence: ``q [b, t, h, d]``, ``k, v [b, t, k, d]`` -> ``[b, t, h, d]``."""
    sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    if causal:
        return backend(impl).causal(q, k, v, sm_scale=sm_scale)
    lengths = jnp.full((q.shape[0],), k.shape[1], jnp.int32)
    return backend(impl).chunk(q, k, v, q_offsets=jnp.zeros_like(lengths), kv_lengths=lengths, sm_scale=sm_scale,
                               causal=False).out


__all__ = ["Attended", "BACKENDS", "Backend", "IMPLS", "attention", "backend", "resolve", "spec_kwargs"]
