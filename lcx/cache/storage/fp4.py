"""fp4 storage (``cache.kv_dtype: fp4``): e2m1 codes with one float16 scale per 16 values, as NVFP4 blocks them.

Each token's head vector (``head_dim`` values of one KV head) is cut into blocks of :data:`BLOCK` = 16 channels;
a block keeps ``scale = max |x| / 6`` (6: e2m1's largest magnitude) in float16 and each value as a 4-bit code -
a sign bit over three bits indexing the e2m1 magnitudes ``0, 0.5, 1, 1.5, 2, 3, 4, 6`` - two codes per byte along
``head_dim`` (the first in the low bits, as ``lcx.kernels.lowbit.pack``). So a token of one KV head and tensor
takes ``d / 2 + d / 8`` bytes: 40 for ``d = 64``, 0.31x of bfloat16 and 0.61x of ``int8`` (``d + 2``).
(NVFP4 keeps e4m3 block scales under a second, per-tensor float32 scale; one float16 scale per block needs no
tensor-wide pass and covers the same range.)

Rounding is to the nearest magnitude (ties to the smaller one), so a value is off by at most a quarter of the gap
around it: ``|x - x'| <= max(scale, |x|) / 4``. Every token's bytes stand alone, so compaction moves them as they
are; an eviction scores the dequantized slots (policies read values) and stores the survivors again - re-encoding
decoded blocks gives back the same codes and scales (the block's largest value decodes to ``6 * scale`` exactly),
so nothing drifts. The backend ops read values: attention reads one layer dequantized (no kernel of
``lcx.kernels`` takes these codes).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import ClassVar

import jax
import jax.numpy as jnp

from lcx.cache.schema import Field
from lcx.cache.storage.base import POOL_KV, SLOT_KV, KVStorage, namespace
from lcx.cache.storage.views import FloatKV

BLOCK = 16  # values per scale
TOP = 6.0  # e2m1's largest magnitude
MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # e2m1's non-negative values, by their 3 low bits
SCALE_DTYPE = "float16"


def encode(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``x [..., d]`` -> ``(codes [..., d / 2] uint8, scale [..., d / 16] float16)``."""
    *lead, d = x.shape
    xb = x.astype(jnp.float32).reshape(*lead, d // BLOCK, BLOCK)
    scale = (jnp.max(jnp.abs(xb), axis=-1) / TOP).astype(SCALE_DTYPE)  # rounded first: codes use the stored scale
    s = scale.astype(jnp.float32)[..., None]
    y = jnp.clip(jnp.abs(xb) / jnp.where(s > 0, s, 1.0), 0.0, TOP)
    index = jnp.argmin(jnp.abs(y[..., None] - jnp.asarray(MAGNITUDES)), axis=-1).astype(jnp.uint8)  # nearest
    sign = jnp.where((xb < 0) & (index > 0), 8, 0).astype(jnp.uint8)  # one zero (+0): decode, encode is the identity
    codes = (index | sign).reshape(*lead, d // 2, 2)
    return codes[..., 0] | (codes[..., 1] << 4), scale


def decode(codes: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
    """The inverse of :func:`encode`: ``codes [..., d / 2]``, ``scale [..., d / 16]`` -> ``[..., d]`` in ``dtype``."""
    *lead, half = codes.shape
    nibbles = jnp.stack([codes & 15, codes >> 4], axis=-1).reshape(*lead, half * 2)
    value = jnp.asarray(MAGNITUDES)[nibbles & 7] * jnp.where(nibbles >= 8, -1.0, 1.0)
    value = value.reshape(*lead, half * 2 // BLOCK, BLOCK) * scale.astype(jnp.float32)[..., None]
    return value.reshape(*lead, half * 2).astype(dtype)


@dataclasses.dataclass(frozen=True)
class Fp4Storage(KVStorage):
    """e2m1 codes and a float16 scale per 16 channels of a token and KV head; slot caches, both layouts."""

    cache_types: ClassVar[tuple[str, ...]] = ("slots",)

    def check(self, head_dim: int) -> None:
        if head_dim % BLOCK:
            raise ValueError(f"cache.kv_dtype='fp4' keeps one scale per {BLOCK} channels: head_dim must be a multiple "
                             f"of {BLOCK}; the model's head_dim is {head_dim}")

    def slot_fields(self) -> Mapping[str, Field]:
        codes, scales = (*SLOT_KV[:-1], "fp4_codes"), (*SLOT_KV[:-1], "fp4_blocks")
        return {"k": Field(codes, "uint8", 0, role="kv"), "v": Field(codes, "uint8", 0, role="kv"),
                "k_scale": Field(scales, SCALE_DTYPE, 0.0, role="kv"),
                "v_scale": Field(scales, SCALE_DTYPE, 0.0, role="kv")}

    def page_fields(self) -> Mapping[str, Field]:
        codes, scales = (*POOL_KV[:-1], "fp4_codes"), (*POOL_KV[:-1], "fp4_blocks")
        return {"k": Field(codes, "uint8", 0, role="kv"), "v": Field(codes, "uint8", 0, role="kv"),
                "k_scale": Field(scales, SCALE_DTYPE, 0.0, role="kv"),
                "v_scale": Field(scales, SCALE_DTYPE, 0.0, role="kv")}

    def sizes(self, head_dim: int, capacity: int) -> dict[str, int]:
        return {"fp4_codes": head_dim // 2, "fp4_blocks": head_dim // BLOCK}

    def page_sizes(self, head_dim: int, page: int) -> dict[str, int]:
        return self.sizes(head_dim, page)

    @property
    def exponent_dtype(self) -> None:
        return None

    def describe(self, head_dim: int) -> str:
        return f"({head_dim} x 4 bits + a 2 B scale per {BLOCK}), fp4"

    def encode(self, k, v):
        (k, k_scale), (v, v_scale) = encode(k), encode(v)
        return {"k": k, "v": v, "k_scale": k_scale, "v_scale": v_scale}

    def view(self, bufs, dtype, *, impl, queries, counted, codes):
        return FloatKV(*self.float_kv(bufs, dtype))

    def float_kv(self, layer, dtype):
        return decode(layer.k, layer.k_scale, dtype), decode(layer.v, layer.v_scale, dtype)

    def readable(self, layer, dtype):
        k, v = self.float_kv(layer, dtype)
        return KVStorage(dtype=self.dtype), layer.replace(k=k, v=v, k_scale=None, v_scale=None)

    def paged_decode(self, backend, q, pools, *, table, lengths, sm_scale, extra):
        from lcx.kernels.paged_decode import gather_pages
        k, v = self.float_kv(namespace(**{n: gather_pages(x, table) for n, x in pools.items()}), q.dtype)
        valid = jnp.arange(k.shape[2])[None, :] < lengths[:, None]
        return backend.decode(q, k, v, valid=valid, sm_scale=sm_scale, **extra)

    def evict(self, kind, state, budgets, compact):
        """Policies score the dequantized slots (their ``SlotView`` holds values); the survivors are encoded again,
        which gives back their codes and scales."""
        k, v = self.float_kv(state, jnp.float32)
        out, left = compact(kind.policy, state.replace(k=k, v=v, k_scale=None, v_scale=None), budgets)
        stored = self.encode(out.k, out.v)
        return state.replace(pos=out.pos, valid=out.valid, count=out.count, score=out.score, **stored), \
            left.replace(k=state.k, v=state.v)


__all__ = ["BLOCK", "Fp4Storage", "decode", "encode"]
