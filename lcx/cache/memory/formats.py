"""How the memory tier's long-term blocks are stored: one value per format, which the tier asks instead of branching.

``block_format(name, value_group)``: ``name`` is ``cache.memory_dtype``, else what the cache's storage gives its
blocks (``KVStorage.block_name``: the cache dtype for floats, ``int8`` under an 8-bit working cache, the bit-packed
``kv_dtype`` itself). Each format declares its device buffers (``store: device``), quantizes the blocks a spill
forms (:meth:`encode`; the host store takes the same arrays), reads recalled blocks back on the device
(:meth:`recall`) and counts the bytes a host store will hold. For the host store (``store.py``) it declares the same
in NumPy (the ``host_*`` methods): the codes' dtype and shape, the arrays kept beside keys, values and positions
(:class:`HostArray`: int8's scales, bit-packed blocks' groups; what ``save`` writes) and how recalled blocks are
dequantized, on the host inside a compiled call (``jax.pure_callback``), which must not call back into JAX. The
quantizers are ``lcx.kernels.quant`` (int8: one float32 scale per block and KV head) and ``lcx.kernels.lowbit``
(KIVI's groups, ``blocks.quantize_lowbit``).

Shapes: L layers, b batch, N blocks, n new blocks, j tokens per block, k KV heads, d head dim, K recalled blocks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import einops
import jax
import jax.numpy as jnp
import numpy as np

from lcx.cache import lowbit_slots
from lcx.cache.memory.blocks import GROUPS, dequantize_lowbit, quantize, quantize_lowbit
from lcx.cache.schema import Field
from lcx.config_base import canonical_dtype
from lcx.kernels.lowbit import LOWBIT

STORE_AXES = ("layers", "batch", "blocks", "block", "kv_heads", "head_dim")


@dataclasses.dataclass(frozen=True)
class HostArray:
    """An array a host store keeps beside its blocks' keys, values and positions: ``[*lead, L, b, N, ...]``, saved
    as ``<name>.npy``."""

    shape: tuple[int, ...]
    dtype: str
    fill: float = 0.0
    lead: int = 0  # axes before the layers (int8's scale: keys, values)

    def new(self) -> np.ndarray:
        """An empty store's array (int8's scales 1, groups 0: what unwritten blocks read as)."""
        return np.full(self.shape, self.fill, self.dtype)

    def blocks(self, row=slice(None), blocks=slice(None)) -> tuple:
        """The index of ``blocks`` of ``row`` in every layer (a view: basic slicing only)."""
        return (slice(None),) * (self.lead + 1) + (row, blocks)


def host_unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    """Bit-packed codes ``[..., n]`` uint8 (the first in the low bits, ``lcx.kernels.lowbit.pack``) -> ``[..., n * 8
    / bits]`` float32: NumPy's twin of ``lcx.kernels.lowbit.unpack`` for the host-side recall."""
    shifts = np.arange(8 // bits, dtype=np.uint8) * bits
    codes = (packed[..., None] >> shifts) & np.uint8(2**bits - 1)
    return codes.reshape(*packed.shape[:-1], -1).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class FloatBlocks:
    """Blocks in a float dtype (``name``)."""

    name: str
    value_group: int = 64

    @property
    def stored(self) -> str:
        return canonical_dtype(self.name)

    def fields(self) -> Mapping[str, Field]:
        """The device store's buffers (``store: device``)."""
        return {"store_k": Field(STORE_AXES, self.stored, role="kv"), "store_v": Field(STORE_AXES, self.stored,
                                                                                       role="kv")}

    def sizes(self, head_dim: int) -> dict[str, int]:
        return {}

    def check(self, head_dim: int) -> None:
        """Raise ``ValueError`` when a model's ``head_dim`` cannot be stored in this format."""

    def encode(self, bk: jax.Array, bv: jax.Array) -> dict:
        """Blocks ``bk, bv [..., n, j, k, d]`` float32 as stored: ``k``, ``v`` and what the host store's ``append``
        takes beside them (``scale`` / ``groups``)."""
        dtype = jnp.dtype(self.stored)
        return {"k": bk.astype(dtype), "v": bv.astype(dtype)}

    def device(self, left: dict) -> dict[str, jax.Array]:
        """:meth:`encode`'s arrays under the device buffers' names."""
        return {"store_k": left["k"], "store_v": left["v"]}

    def recall(self, layer, rows, safe, head, dtype) -> tuple[jax.Array, jax.Array]:
        """The device store's blocks ``safe [b, k, K]`` of each KV head ``head`` as ``[b, K * j, k, d]`` each."""
        parts = [self._scaled(buf[rows, safe, :, head, :], layer, which, rows, safe, head)  # [b, k, K, j, d]
                 for which, buf in enumerate((layer.store_k, layer.store_v))]
        return tuple(einops.rearrange(x, "b k K j d -> b (K j) k d").astype(dtype) for x in parts)

    def _scaled(self, x, layer, which, rows, safe, head):
        return x

    def token_bytes(self, head_dim: int) -> int:
        """Bytes per token and KV head in a host store: keys, values and a position."""
        return 2 * head_dim * np.dtype(jnp.dtype(self.stored)).itemsize + 4

    def block_bytes(self, head_dim: int) -> int:
        """Bytes per block and KV head beside its tokens' (scales)."""
        return 0

    # ------------------------------------------------------------------------------------------- host store
    @property
    def host_dtype(self) -> np.dtype:
        """The NumPy dtype of a host store's keys and values (codes)."""
        return np.dtype(jnp.dtype(self.stored))

    def host_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """A host store's keys (and values) ``[L, b, N, j, k, d']`` for blocks of ``shape`` ``[L, b, N, j, k, d]``."""
        return tuple(shape)

    def host_arrays(self, shape: tuple[int, ...]) -> dict[str, HostArray]:
        """What a host store of blocks ``shape`` keeps beside keys, values and positions, by the name ``append``
        takes it under (``scale``, or one of ``groups``) and ``save`` writes it as."""
        return {}

    def host_dequantize(self, which: int, x: np.ndarray, arrays: dict[str, np.ndarray], layer: int, rows, safe,
                        head) -> np.ndarray:
        """Recalled blocks ``x [b, k, K, j, d']`` of keys (``which`` 0) or values (1) of ``layer`` -> float32
        ``[b, k, K, j, d]``; ``arrays`` are :meth:`host_arrays`' and ``rows, safe, head`` index them as ``x``."""
        return x.astype(np.float32)


@dataclasses.dataclass(frozen=True)
class Int8Blocks(FloatBlocks):
    """int8 codes with one float32 scale per block and KV head (``lcx.kernels.quant``, ``blocks.quantize``)."""

    @property
    def stored(self) -> str:
        return "int8"

    def fields(self):
        scale = ("layers", "batch", "blocks", "kv_heads")
        return {**super().fields(), "store_scale_k": Field(scale, "float32", 1.0),
                "store_scale_v": Field(scale, "float32", 1.0)}

    def encode(self, bk, bv):
        (k, scale_k), (v, scale_v) = quantize(bk), quantize(bv)
        return {"k": k, "v": v, "scale": jnp.stack([scale_k, scale_v])}  # [2, L, b, n, k]

    def device(self, left):
        return {**super().device(left), "store_scale_k": left["scale"][0], "store_scale_v": left["scale"][1]}

    def _scaled(self, x, layer, which, rows, safe, head):
        scale = (layer.store_scale_k, layer.store_scale_v)[which]
        return x.astype(jnp.float32) * scale[rows, safe, head][..., None, None]

    def token_bytes(self, head_dim):
        return 2 * head_dim + 4

    def block_bytes(self, head_dim):
        return 8

    def host_arrays(self, shape):  # one scale per block and KV head, for keys and for values: [2, L, b, N, k]
        return {"scale": HostArray((2,) + tuple(shape[:3]) + (shape[4],), "float32", 1.0, lead=1)}

    def host_dequantize(self, which, x, arrays, layer, rows, safe, head):
        return x.astype(np.float32) * arrays["scale"][which, layer][rows, safe, head][..., None, None]


@dataclasses.dataclass(frozen=True)
class PackedBlocks(FloatBlocks):
    """Bit-packed codes along ``head_dim`` (``name`` int4 / int2): a block's keys per channel over its tokens,
    values per token over ``value_group`` channels, float16 scales and zeros (``blocks.quantize_lowbit``)."""

    @property
    def stored(self) -> str:
        return "uint8"

    def fields(self):
        axes = STORE_AXES[:-1] + ("packed_dim",)
        out = {"store_k": Field(axes, "uint8", role="kv"), "store_v": Field(axes, "uint8", role="kv")}
        per_block, per_token = ("layers", "batch", "blocks", "kv_heads", "head_dim"), \
            ("layers", "batch", "blocks", "block", "kv_heads", "value_groups")
        for name in GROUPS:
            out[f"store_{name}"] = Field(per_block if name.startswith("k") else per_token, "float16", 0.0, role="kv")
        return out

    def sizes(self, head_dim):
        return {"packed_dim": head_dim * LOWBIT[self.name] // 8, "value_groups": head_dim // self.value_group}

    @property
    def group(self) -> int:
        return self.value_group  # (a block's keys are one group: its tokens)

    def check(self, head_dim):
        lowbit_slots.check(self, head_dim)

    def encode(self, bk, bv):
        codes = quantize_lowbit(bk, bv, self.name, self.value_group)
        return {"k": codes["k"], "v": codes["v"], "groups": {name: codes[name] for name in GROUPS}}

    def device(self, left):
        return {**super().device(left), **{f"store_{n}": x for n, x in left["groups"].items()}}

    def recall(self, layer, rows, safe, head, dtype):
        # each recalled block as a block of one KV head: codes [b, k, K, j, 1, d'], key groups [b, k, K, 1, d],
        # value groups [b, k, K, j, 1, d / G] (the layout blocks.dequantize_lowbit reads)
        per_token = lambda x: x[rows, safe, :, head][..., None, :]  # noqa: E731
        codes = {"k": per_token(layer.store_k), "v": per_token(layer.store_v),
                 "k_scale": layer.store_k_scale[rows, safe, head][..., None, :],
                 "k_zero": layer.store_k_zero[rows, safe, head][..., None, :],
                 "v_scale": per_token(layer.store_v_scale), "v_zero": per_token(layer.store_v_zero)}
        k, v = dequantize_lowbit(codes, self.name)  # [b, k, K, j, 1, d]
        flat = lambda x: einops.rearrange(x[..., 0, :], "b k K j d -> b (K j) k d")  # noqa: E731
        return flat(k).astype(dtype), flat(v).astype(dtype)

    def token_bytes(self, head_dim):  # codes, a position, a float16 scale and zero per value group
        return 2 * head_dim * LOWBIT[self.name] // 8 + 4 + 4 * (head_dim // self.value_group)

    def block_bytes(self, head_dim):  # a float16 scale and zero per channel for the block's keys
        return 4 * head_dim

    def host_shape(self, shape):
        return tuple(shape[:5]) + (self.sizes(shape[5])["packed_dim"],)

    def host_arrays(self, shape):
        # keys' scales and zeros per block, KV head and channel; values' per token and channel group
        per_block, per_token = tuple(shape[:3]) + (shape[4], shape[5]), \
            tuple(shape[:5]) + (self.sizes(shape[5])["value_groups"],)
        return {name: HostArray(per_block if name.startswith("k") else per_token, "float16") for name in GROUPS}

    def host_dequantize(self, which, x, arrays, layer, rows, safe, head):
        # blocks.dequantize_lowbit in NumPy: keys per channel over the block, values per token and channel group
        x = host_unpack(x, LOWBIT[self.name])
        scale = arrays["kv"[which] + "_scale"][layer].astype(np.float32)
        zero = arrays["kv"[which] + "_zero"][layer].astype(np.float32)
        if which == 0:  # [b, k, K, d]
            s, z = scale[rows, safe, head], zero[rows, safe, head]
            return x * s[..., None, :] + z[..., None, :]
        s, z = scale[rows, safe, :, head, :], zero[rows, safe, :, head, :]  # [b, k, K, j, d / G]
        xg = x.reshape(*x.shape[:-1], s.shape[-1], self.value_group)
        return (xg * s[..., None] + z[..., None]).reshape(x.shape)


FORMATS: dict[str, type[FloatBlocks]] = {"int8": Int8Blocks, **{name: PackedBlocks for name in LOWBIT}}


def block_format(name: str, value_group: int = 64) -> FloatBlocks:
    """The long-term blocks' format of ``name`` (``cache.memory_dtype``'s values: a float dtype, int8, int4,
    int2)."""
    return FORMATS.get(name, FloatBlocks)(name=name, value_group=value_group)


__all__ = ["FORMATS", "FloatBlocks", "HostArray", "Int8Blocks", "PackedBlocks", "STORE_AXES", "block_format",
           "host_unpack"]
