"""Attention kernels. ``attention`` dispatches on the implementation name from ``AttentionConfig.impl``.

- ``flash_attention``: Pallas FlashAttention forward + backward (GQA, causal/window/lengths masks).
- ``decode_attention``: Pallas split-K decode over a KV cache with holes, optional per-slot weights (H2O, TOVA).
- ``attention_column_sums``: attention received by each key from a window of queries (SnapKV), Pallas.
- ``reference``: the pure-jnp oracles. ``mode``: the one place that picks interpreted vs compiled Pallas.
"""

from __future__ import annotations

import jax

from lcx.kernels.decode import DecodeBlockSizes, decode_attention
from lcx.kernels.flash import FlashBlockSizes, flash_attention
from lcx.kernels.mode import resolve_interpret
from lcx.kernels.reference import (attention_column_sums_reference, attention_mask, attention_reference,
                                   decode_attention_reference, masked_attention_reference,
                                   masked_column_sums_reference)
from lcx.kernels.window_stats import attention_column_sums

IMPLS = ("pallas", "xla", "reference")


def _xla(q, k, v, *, causal, sm_scale):
    # jax.nn.dot_product_attention handles GQA itself (K/V heads broadcast over query groups); cuDNN on GPU.
    return jax.nn.dot_product_attention(q, k, v, scale=sm_scale, is_causal=causal)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, impl: str = "reference", causal: bool = True,
              sm_scale: float | None = None) -> jax.Array:
    """Self-attention over a whole sequence: ``q [b, t, h, d]``, ``k, v [b, t, k, d]`` -> ``[b, t, h, d]``."""
    if impl == "pallas":
        return flash_attention(q, k, v, causal=causal, sm_scale=sm_scale)
    if impl == "reference":
        return attention_reference(q, k, v, causal=causal, sm_scale=sm_scale)
    if impl == "xla":
        return _xla(q, k, v, causal=causal, sm_scale=sm_scale)
    raise ValueError(f"attention impl={impl!r} is not available; allowed: {list(IMPLS)}")


__all__ = ["DecodeBlockSizes", "FlashBlockSizes", "IMPLS", "attention", "attention_column_sums",
           "attention_column_sums_reference", "attention_mask", "attention_reference", "decode_attention",
           "decode_attention_reference", "flash_attention", "masked_attention_reference", "masked_column_sums_reference",
           "resolve_interpret"]
