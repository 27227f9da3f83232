"""Attention kernels and the backend table the model calls (``backends.py``).

- ``flash_attention``: Pallas FlashAttention forward + backward (GQA, causal/window/lengths/offsets masks).
- ``decode_attention``: Pallas split-K decode over a KV cache with holes, optional per-slot weights (H2O, TOVA) and
  residuals for merging partial attentions.
- ``attention_column_sums``: attention received by each key from a window of queries (SnapKV), Pallas.
- ``reference``: the pure-jnp oracles. ``mode``: the one place that picks interpreted vs compiled Pallas.
- ``Attended``: what the backend's ``chunk`` / ``decode`` return (output, optional weights and residuals).
- ``merge_partials``: exact log-sum-exp combine of attentions over disjoint key sets.
- ``quant``: 8-bit KV codes with per-token, per-head scales (``cache.kv_dtype``); the ops above take ``k_scale`` /
  ``v_scale`` and fold them into logits and probabilities.
- ``decode_lowbit`` / ``decode_lowbit_tiles`` / ``chunk_lowbit_tiles``: decode and prefill chunks on a bit-packed
  (int4 / int2) cache's codes, its groups and float window (``LowbitKV``) - fused XLA, and the Pallas kernels (the
  backend table's ``lowbit_decode`` / ``lowbit_chunk``).
"""

from __future__ import annotations

from lcx.kernels.attended import Attended
from lcx.kernels.backends import BACKENDS, IMPLS, Backend, attention, backend, resolve, spec_kwargs
from lcx.kernels.common import merge_partials
from lcx.kernels.decode import DecodeBlockSizes, decode_attention
from lcx.kernels.flash import flash_attention
from lcx.kernels.flash_masks import FlashBlockSizes
from lcx.kernels.lowbit_decode import LowbitKV, decode_lowbit
from lcx.kernels.lowbit_pallas import chunk_lowbit_tiles, decode_lowbit_tiles
from lcx.kernels.mode import resolve_interpret
from lcx.kernels.reference import (attention_column_sums_reference, attention_mask, attention_reference,
                                   decode_attention_reference, masked_attention_parts, masked_attention_reference,
                                   masked_column_sums_reference)
from lcx.kernels.window_stats import attention_column_sums

__all__ = ["Attended", "BACKENDS", "Backend", "DecodeBlockSizes", "FlashBlockSizes", "IMPLS", "LowbitKV", "attention",
           "attention_column_sums", "attention_column_sums_reference", "attention_mask", "attention_reference",
           "backend", "chunk_lowbit_tiles", "decode_attention", "decode_attention_reference", "decode_lowbit",
           "decode_lowbit_tiles",
           "flash_attention", "masked_attention_parts", "masked_attention_reference", "masked_column_sums_reference",
           "merge_partials", "resolve", "resolve_interpret", "spec_kwargs"]
