"""Split-K decode attention over a paged KV cache, in Pallas: one query per row against the pages its table lists.

Einsum legend: b batch, P pool pages, T pages per row, c slots per page, h query heads, k kv heads, g query heads per
kv head, n splits of a row's pages, r rows of one program (g zero-padded to >= 16 for the Triton dot), d head dim.

The pool ``k, v [P, k, c, d]`` is read in place (never gathered into a per-row copy): program (split, b, kv head)
walks the pages ``table[b, split * T_n : (split + 1) * T_n]`` that hold tokens (``< lengths[b]``), reading page
``table[b, j]`` directly from the pool with an online softmax over all g heads of the group, and writes its partial
``(acc, m, l)``; XLA merges the splits as in ``lcx.kernels.decode``. Slots at or past the row's length are masked,
so a page table may list pages beyond it (or -1, never read).

An 8-bit pool (``cache.kv_dtype``, ``lcx.kernels.quant``) passes its scales ``k_scale, v_scale [P, k, c]`` (one
per slot of every page and KV head): the kernel reads each page's codes and scales and folds the scales into the
page's logits and probabilities, as the contiguous decode kernel does.

The reference is the gather path: the row's pages gathered into the contiguous ``[b, k, T * c, d]`` view and
``decode_attention_reference`` over it (``paged_decode_reference``).
"""

from __future__ import annotations

import dataclasses
import functools

import einops
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from lcx.kernels.common import (LN2, combine_splits, online_softmax, online_update, pad_axis, padded_head_dim,
                                scaled_logits)
from lcx.kernels.mode import pallas_call_kwargs
from lcx.kernels.quant import dequantize
from lcx.kernels.reference import decode_attention_reference


@dataclasses.dataclass(frozen=True)
class _Static:
    page: int
    pages_per_split: int
    sm_scale: float
    softcap: float | None
    quantized: bool = False  # the pools hold 8-bit codes; two more refs carry their scales


def gather_pages(pool: jax.Array, table: jax.Array) -> jax.Array:
    """Row ``b``'s pages ``table [b, T]`` of ``pool [P, k, c, ...]`` in order: ``[b, k, T * c, ...]`` (-1: page 0, to
    be masked by the row's length; ``...``: the head dim of keys and values, none for an 8-bit pool's scales)."""
    return einops.rearrange(pool[jnp.maximum(table, 0)], "b T k c ... -> b k (T c) ...")


def paged_decode_reference(q, k_pages, v_pages, *, table, lengths, sm_scale=None, softcap=None,
                           return_residuals=False, precision=jax.lax.Precision.HIGHEST, k_scale=None, v_scale=None):
    """The oracle: the gathered view and ``decode_attention_reference`` (slots below ``lengths [b]`` live); 8-bit
    pools are dequantized after the gather."""
    k, v = gather_pages(k_pages, table), gather_pages(v_pages, table)
    if k_scale is not None:
        k, v = dequantize(k, gather_pages(k_scale, table)), dequantize(v, gather_pages(v_scale, table))
    valid = jnp.arange(k.shape[2])[None, :] < lengths[:, None]
    return decode_attention_reference(q, k, v, valid=valid, sm_scale=sm_scale, softcap=softcap,
                                      return_residuals=return_residuals, precision=precision)


def _kernel(*refs, st: _Static):
    """Refs: lens [] of this row, table [T_n] of this split, q [r, d], the whole pools k, v [P, k, c, d], [their
    scales [P, k, c] when 8-bit] -> acc [r, d], m [r], l [r]."""
    len_ref, table_ref, q_ref, k_ref, v_ref = refs[:5]
    ks_ref, vs_ref = refs[5:7] if st.quantized else (None, None)
    acc_ref, m_ref, l_ref = refs[-3:]
    c, tn = st.page, st.pages_per_split
    kv_head = pl.program_id(2)
    first = pl.program_id(0) * tn  # this split's first page of the row
    length = len_ref[()]
    q = q_ref[...]
    pages = table_ref[...]  # [T_n]: loaded once; element i picked by a masked sum (no scalar load from a ref)
    hi = jnp.clip(lax.div(jnp.maximum(length - first * c, 0) + c - 1, c), 0, tn)  # pages holding tokens

    def body(i, carry):  # carry: acc [r, d], m [r], l [r]
        page = jnp.maximum(jnp.sum(jnp.where(jnp.arange(tn) == i, pages, 0)), 0)
        live = (first + i) * c + jnp.arange(c) < length  # [c]
        scale = (lambda ref: ref[page, kv_head, :]) if st.quantized else (lambda ref: None)  # noqa: E731
        s = scaled_logits(q, k_ref[page, kv_head, :, :], st.sm_scale, st.softcap, scale(ks_ref))  # [r, c]
        return online_update(carry, s, live, v_ref[page, kv_head, :, :], scale(vs_ref), q.dtype)

    online_softmax(body, hi, q, acc_ref, m_ref, l_ref)


def paged_decode_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, *, table: jax.Array,
                           lengths: jax.Array, sm_scale: float | None = None, softcap: float | None = None,
                           pages_per_split: int | None = None, interpret: bool | None = None,
                           return_residuals: bool = False, num_warps: int = 4, num_stages: int = 2,
                           k_scale: jax.Array | None = None, v_scale: jax.Array | None = None):
    """Attention of one new token per row over its pages.

    Args:
      q: ``[batch, q_heads, head_dim]``.
      k_pages, v_pages: ``[pages, kv_heads, page, head_dim]``, the pool (``lcx.cache.paged``); ``page`` a power of
        two >= 16 for the Triton dot (any size in interpret mode).
      table: ``[batch, row_pages]`` int32 page ids in position order (entries past the row's length are not read).
      lengths: ``[batch]`` tokens per row; slot ``p`` of the row is live when ``p < lengths``.
      pages_per_split: pages one program walks (None: a power of two giving ~4 splits per row).
      softcap, sm_scale, interpret, return_residuals: as :func:`lcx.kernels.decode_attention`.
      k_scale, v_scale: ``[pages, kv_heads, page]``: the pools hold 8-bit codes (``lcx.kernels.quant``) with these
        per-slot scales, folded into each page's logits and probabilities (never a float copy of a page).

    Returns ``out [batch, q_heads, head_dim]`` in ``q.dtype``; with ``return_residuals`` also ``(m, l)``.
    """
    if q.ndim != 3 or k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(f"q must be [batch, heads, head_dim], k_pages and v_pages equal [pages, kv_heads, page, "
                         f"head_dim]; got {q.shape=}, {k_pages.shape=}, {v_pages.shape=}")
    b, h, d = q.shape
    _, kvh, c, _ = k_pages.shape
    if k_pages.shape[3] != d or h % kvh:
        raise ValueError(f"{q.shape=} and {k_pages.shape=} must agree on head_dim, with q_heads a multiple of kv_heads")
    if table.ndim != 2 or table.shape[0] != b or lengths.shape != (b,):
        raise ValueError(f"table must be [{b}, row_pages] and lengths [{b}]; got {table.shape=}, {lengths.shape=}")
    quantized = k_scale is not None
    if quantized and (v_scale is None or k_scale.shape != k_pages.shape[:3] or v_scale.shape != k_pages.shape[:3]):
        raise ValueError(f"k_scale and v_scale must both be [pages, kv_heads, page] = {k_pages.shape[:3]}; got "
                         f"{k_scale.shape=}, {None if v_scale is None else v_scale.shape}")
    n_pages = table.shape[1]
    tn = pages_per_split or pl.next_power_of_2(max(1, -(-n_pages // 4)))
    n_splits = -(-n_pages // tn)
    g = h // kvh
    dp = padded_head_dim(d)
    rows = max(16, pl.next_power_of_2(g))
    st = _Static(page=c, pages_per_split=tn, sm_scale=float(d ** -0.5 if sm_scale is None else sm_scale),
                 softcap=None if softcap is None else float(softcap), quantized=quantized)
    table = jnp.pad(table.astype(jnp.int32), ((0, 0), (0, n_splits * tn - n_pages)), constant_values=-1)
    # 8-bit codes are widened to the query's dtype page by page (the query is not cast down to int8)
    qg = einops.rearrange(q if quantized else q.astype(k_pages.dtype), "b (k g) d -> b k g d", k=kvh)
    qg = pad_axis(pad_axis(qg, 3, dp), 2, rows)  # [b, k, r, dp]
    kp, vp = pad_axis(k_pages, 3, dp), pad_axis(v_pages if quantized else v_pages.astype(k_pages.dtype), 3, dp)
    whole = pl.BlockSpec(kp.shape, lambda n, bi, ki: (0, 0, 0, 0))  # the pool stays in place; pages read by id
    in_specs = [pl.BlockSpec((None,), lambda n, bi, ki: (bi,)),
                pl.BlockSpec((None, tn), lambda n, bi, ki: (bi, n)),
                pl.BlockSpec((None, None, rows, dp), lambda n, bi, ki: (bi, ki, 0, 0)),
                whole, whole]
    args = [lengths.astype(jnp.int32), table, qg, kp, vp]
    if quantized:
        in_specs += [pl.BlockSpec(k_scale.shape, lambda n, bi, ki: (0, 0, 0))] * 2
        args += [k_scale, v_scale]
    out_specs = [pl.BlockSpec((None, None, None, rows, dp), lambda n, bi, ki: (bi, ki, n, 0, 0)),
                 pl.BlockSpec((None, None, None, rows), lambda n, bi, ki: (bi, ki, n, 0)),
                 pl.BlockSpec((None, None, None, rows), lambda n, bi, ki: (bi, ki, n, 0))]
    out_shape = [jax.ShapeDtypeStruct((b, kvh, n_splits, rows, dp), jnp.float32),
                 jax.ShapeDtypeStruct((b, kvh, n_splits, rows), jnp.float32),
                 jax.ShapeDtypeStruct((b, kvh, n_splits, rows), jnp.float32)]
    with jax.named_scope("lcx_paged_decode"):
        acc, m, l = pl.pallas_call(
            functools.partial(_kernel, st=st), grid=(n_splits, b, kvh), in_specs=in_specs, out_specs=out_specs,
            out_shape=out_shape, name="lcx_paged_decode",
            **pallas_call_kwargs(interpret, num_warps=num_warps, num_stages=num_stages),
        )(*args)
        o, m_all, l_all, empty = combine_splits(acc, m, l)
        merge_heads = functools.partial(einops.rearrange, pattern="b k g ... -> b (k g) ...")
        out = merge_heads(o[:, :, :g, :d]).astype(q.dtype)
        if not return_residuals:
            return out
        m_nat = jnp.where(empty, -jnp.inf, m_all * LN2)[:, :, :g]
        return out, merge_heads(m_nat), merge_heads(l_all[:, :, :g])


__all__ = ["gather_pages", "paged_decode_attention", "paged_decode_reference"]
