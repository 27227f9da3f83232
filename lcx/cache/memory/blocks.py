"""Forming long-term memory blocks from the tokens that leave the working memory, and their storage precision.

Shape letters: L layers, b batch, T tokens leaving (a multiple of the spill run), n blocks, j tokens per block,
k kv heads, d head dim, c clusters per run.

- contiguous: consecutive tokens form a block (every KV head stores the same positions);
- cluster: the keys of one run of ``cluster_blocks`` blocks are k-means clustered per KV head (``kmeans_iters``
  Lloyd iterations from evenly spaced seeds, cosine geometry); tokens are then ordered by cluster (ties by position)
  and cut into blocks of exactly ``block`` tokens, so a block gathers similar keys and every block is full. Each KV
  head keeps its own token order (positions per head).
- ``int8`` storage: symmetric quantization with one scale per block and KV head (max |x| / 127);
- ``int4`` / ``int2`` storage (:func:`quantize_lowbit`): bit-packed codes along ``head_dim`` with KIVI's asymmetric
  groups (``lcx.kernels.lowbit``) - a block's keys per channel (one float16 scale and zero per block, KV head and
  channel: the block is the key group), its values per token over ``value_group`` channels.
"""

from __future__ import annotations

import einops
import jax
import jax.numpy as jnp

from lcx.kernels import lowbit, quant


def kmeans_order(keys: jax.Array, clusters: int, iters: int) -> jax.Array:
    """A permutation of ``keys [T, d]`` that groups tokens by k-means cluster: ``[T]`` int32 (stable by position
    within a cluster)."""
    x = keys.astype(jnp.float32)
    x = x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-6)  # cosine geometry, as attention ranks
    t = x.shape[0]
    centroids = x[jnp.linspace(0, t - 1, clusters).astype(jnp.int32)]  # [c, d] evenly spaced seeds

    def lloyd(_, c):
        assign = jnp.argmax(x @ c.T, axis=-1)  # [T]
        one_hot = jax.nn.one_hot(assign, clusters, dtype=jnp.float32)  # [T, c]
        sums = one_hot.T @ x  # [c, d]
        counts = jnp.sum(one_hot, axis=0)[:, None]
        new = jnp.where(counts > 0, sums / jnp.maximum(counts, 1.0), c)
        return new / jnp.maximum(jnp.linalg.norm(new, axis=-1, keepdims=True), 1e-6)

    centroids = jax.lax.fori_loop(0, iters, lloyd, centroids)
    assign = jnp.argmax(x @ centroids.T, axis=-1)
    return jnp.argsort(assign, stable=True).astype(jnp.int32)


def form_blocks(k: jax.Array, v: jax.Array, pos: jax.Array, received: jax.Array, *, block: int, cluster_run: int,
                iters: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Tokens leaving one layer -> blocks.

    ``k, v [b, T, k, d]``, ``pos [b, T]``, ``received [b, T, k]`` -> ``k, v [b, n, j, k, d]``, ``pos [b, n, j, k]``,
    ``received [b, n, j, k]`` with ``n = T / block``. ``cluster_run``: tokens clustered together (0: contiguous).
    """
    b, t, heads, d = k.shape
    pos = jnp.broadcast_to(pos[:, :, None], (b, t, heads))
    if cluster_run:
        runs = t // cluster_run
        per_run = lambda x: einops.rearrange(x, "b (r s) k ... -> b r k s ...", s=cluster_run)  # noqa: E731
        order = jax.vmap(jax.vmap(jax.vmap(lambda keys: kmeans_order(keys, cluster_run // block, iters))))(
            per_run(k))  # [b, r, k, s]

        def regroup(x):
            grouped = per_run(x)  # [b, r, k, s, ...]
            idx = order.reshape(order.shape + (1,) * (grouped.ndim - 4))
            return einops.rearrange(jnp.take_along_axis(grouped, idx, axis=3), "b r k s ... -> b (r s) k ...",
                                    r=runs)

        k, v, pos, received = regroup(k), regroup(v), regroup(pos), regroup(received)
    blocks = lambda x: einops.rearrange(x, "b (n j) k ... -> b n j k ...", j=block)  # noqa: E731
    return blocks(k), blocks(v), blocks(pos), blocks(received)


def quantize(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``x [..., n, j, k, d]`` -> (int8 values, float32 scales ``[..., n, k]``): one scale per block and KV head
    (``lcx.kernels.quant``'s quantizer over the block's tokens and channels)."""
    return quant.quantize(x, "int8", axis=(-3, -1), scale_dtype="float32")


def dequantize(q: jax.Array, scale: jax.Array) -> jax.Array:
    """Inverse of :func:`quantize`: ``q [..., n, j, k, d]`` int8, ``scale [..., n, k]`` -> float32."""
    return quant.dequantize(q, scale, axis=(-3, -1))


GROUPS = ("k_scale", "k_zero", "v_scale", "v_zero")  # a bit-packed block's scales and zeros


def quantize_lowbit(k: jax.Array, v: jax.Array, kv_dtype: str, value_group: int) -> dict[str, jax.Array]:
    """Blocks ``k, v [..., n, j, k, d]`` -> their codes ``k, v [..., n, j, k, d * bits / 8]`` uint8 and
    :data:`GROUPS`: key scales and zeros ``[..., n, k, d]`` (per channel over the block's ``j`` tokens), value scales
    and zeros ``[..., n, j, k, d / value_group]`` (per token), float16."""
    j = k.shape[-3]
    kc, ks, kz = lowbit.quantize_channels(jnp.swapaxes(k, -3, -2), kv_dtype, j)  # [..., n, k, j, d'], [.., 1, d]
    vc, vs, vz = lowbit.quantize_tokens(v, kv_dtype, value_group)
    return {"k": jnp.swapaxes(kc, -3, -2), "v": vc, "k_scale": ks[..., 0, :], "k_zero": kz[..., 0, :],
            "v_scale": vs, "v_zero": vz}


def dequantize_lowbit(codes: dict, kv_dtype: str) -> tuple[jax.Array, jax.Array]:
    """The inverse of :func:`quantize_lowbit` (its dict, or any of its blocks): float32 ``k, v [..., n, j, k,
    d]``."""
    k = lowbit.dequantize_channels(jnp.swapaxes(codes["k"], -3, -2), codes["k_scale"][..., None, :],
                                   codes["k_zero"][..., None, :], kv_dtype)
    v = lowbit.dequantize_tokens(codes["v"], codes["v_scale"], codes["v_zero"], kv_dtype)
    return jnp.swapaxes(k, -3, -2), v


__all__ = ["GROUPS", "dequantize", "dequantize_lowbit", "form_blocks", "kmeans_order", "quantize",
           "quantize_lowbit"]
