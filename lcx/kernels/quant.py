"""A quantized KV cache's storage: 8-bit keys and values with one scale per token and KV head.

``cache.kv_dtype``: ``int8`` (symmetric, ``x ~= q * scale`` with ``q`` in [-127, 127], ``scale = max |x| / 127``) or
``fp8`` (float8 e4m3, ``scale = max |x| / 448``, its largest finite value). Each stored vector (one token of one KV
head, ``head_dim`` numbers) has its own scale, kept in float16: 2 bytes per vector, so a bfloat16 head of 64 dims
(128 bytes) becomes 64 + 2 bytes, x 0.52 (x 0.51 at 128 dims).

Dequantization is folded into attention, never materialized as a float copy of the cache: a key scale multiplies
its logit column (``q . (s_j k_j) = s_j (q . k_j)``), a value scale its probability column before the product with
the values (``sum_j p_j s_j v_j``); the softmax's row sums take the unscaled probabilities. Kernels read the 8-bit
tiles, widen each tile to the compute dtype in registers, and apply the scales to the tile's logits and
probabilities. :func:`dequantize` is for the oracle and for the paths that rotate keys at attention time.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lcx.kernels.names import QUANT_DTYPES  # re-exported: the table lives with the other names configs check

# cache.kv_dtype -> (storage dtype, largest magnitude a stored element takes)
SCALE_DTYPE = "float16"


def storage_dtype(kv_dtype: str) -> str:
    """The array dtype of ``cache.kv_dtype`` (``int8`` -> int8, ``fp8`` -> float8_e4m3fn)."""
    return QUANT_DTYPES[kv_dtype][0]


def is_quantized(x: jax.Array) -> bool:
    """Whether ``x`` holds 8-bit cache codes (int8 or a float8 type), which need their scales."""
    return x.dtype == jnp.int8 or x.dtype.itemsize == 1


def quantize(x: jax.Array, kv_dtype: str, *, axis=-1, scale_dtype=SCALE_DTYPE) -> tuple[jax.Array, jax.Array]:
    """``x [..., d]`` -> ``(codes [..., d], scale [...] float16)`` with ``codes * scale ~= x``, per vector. ``axis``
    (an int or a tuple) and ``scale_dtype`` pick what one scale covers and how it is kept (the memory tier's
    blocks: one float32 scale per block and KV head, ``axis=(-3, -1)``)."""
    dtype, top = QUANT_DTYPES[kv_dtype]
    xf = x.astype(jnp.float32)
    scale = (jnp.max(jnp.abs(xf), axis=axis) / top).astype(scale_dtype)  # rounded first: codes use the stored scale
    s = jnp.expand_dims(scale.astype(jnp.float32), axis)
    y = xf / jnp.where(s > 0, s, 1.0)
    y = jnp.clip(jnp.round(y) if dtype == "int8" else y, -top, top)
    return y.astype(dtype), scale


def dequantize(codes: jax.Array, scale: jax.Array | None, dtype=jnp.float32, *, axis=-1) -> jax.Array:
    """``codes [..., d] * scale [...]`` in ``dtype`` (``scale`` None: ``codes`` are already values; ``axis``: the
    axes :func:`quantize` reduced)."""
    if scale is None:
        return codes.astype(dtype)
    return (codes.astype(jnp.float32) * jnp.expand_dims(scale.astype(jnp.float32), axis)).astype(dtype)


def widen(codes: jax.Array, dtype) -> jax.Array:
    """A tile of 8-bit codes as ``dtype`` for a dot (a float tile passes unchanged)."""
    return codes.astype(dtype) if is_quantized(codes) else codes


__all__ = ["QUANT_DTYPES", "SCALE_DTYPE", "dequantize", "is_quantized", "quantize", "storage_dtype", "widen"]
