"""Scaled 8-bit storage (``cache.kv_dtype: int8 | fp8``): codes with one float16 scale per token and KV head.

``lcx.kernels.quant`` holds the quantizer (int8: ``max |x| / 127``; fp8 e4m3: ``max |x| / 448``). Codes and scales
are written together, compacted together (a token's bytes stand alone), and read on the codes: every backend op
takes ``k_scale, v_scale`` and folds them into its logits and probabilities tile by tile (``views.ScaledKV``), the
paged decode kernel reads the scale pages beside the code pages. Bytes: ``d`` + 2 per token, KV head and tensor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import ClassVar

import jax

from lcx.cache.schema import Field
from lcx.cache.storage.base import KVStorage
from lcx.cache.storage.views import ScaledKV
from lcx.kernels.quant import SCALE_DTYPE, dequantize, quantize, storage_dtype

SLOT_SCALE = ("layers", "batch", "kv_heads", "length")
POOL_SCALE = ("layers", "pages", "kv_heads", "page")


@dataclasses.dataclass(frozen=True)
class ScaledStorage(KVStorage):
    """8-bit codes (``name``: ``int8`` / ``fp8``) and a float16 scale per token and KV head."""

    cache_types: ClassVar[tuple[str, ...]] = ("slots", "memory")

    @property
    def buffer_dtype(self) -> str:
        return storage_dtype(self.name)

    def slot_fields(self) -> Mapping[str, Field]:
        return {**super().slot_fields(), "k_scale": Field(SLOT_SCALE, SCALE_DTYPE, 0.0, role="kv"),
                "v_scale": Field(SLOT_SCALE, SCALE_DTYPE, 0.0, role="kv")}

    def page_fields(self) -> Mapping[str, Field]:
        return {**super().page_fields(), "k_scale": Field(POOL_SCALE, SCALE_DTYPE, 0.0, role="kv"),
                "v_scale": Field(POOL_SCALE, SCALE_DTYPE, 0.0, role="kv")}

    @property
    def block_name(self) -> str:
        return "int8"  # the memory tier's blocks: one scale per block and KV head

    @property
    def exponent_dtype(self) -> None:
        return None

    def describe(self, head_dim: int) -> str:
        return f"({head_dim} x 1 B + a 2 B scale), {self.name}"

    def encode(self, k: jax.Array, v: jax.Array) -> dict[str, jax.Array]:
        (k, k_scale), (v, v_scale) = quantize(k, self.name), quantize(v, self.name)
        return {"k": k, "v": v, "k_scale": k_scale, "v_scale": v_scale}

    def view(self, bufs, dtype, *, impl, queries, counted, codes):
        return ScaledKV(k=bufs.k, v=bufs.v, k_scale=bufs.k_scale, v_scale=bufs.v_scale)

    def float_kv(self, layer, dtype):
        return dequantize(layer.k, layer.k_scale, dtype), dequantize(layer.v, layer.v_scale, dtype)

    def float_keys(self, layer, take=lambda x: x):
        return dequantize(take(layer.k), take(layer.k_scale))


__all__ = ["ScaledStorage"]
