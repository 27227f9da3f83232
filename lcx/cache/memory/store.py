"""The long-term store off the device: blocks of keys and values in host memory (NumPy) or on disk (memory-mapped
files), appended between jitted calls and read from inside them by a host callback.

Shape letters: L layers, b batch, N block capacity, n blocks, j tokens per block, k kv heads, d head dim, K recalled
blocks per KV head.

Layout per layer: ``k, v [b, N, j, k, d]`` in the storage dtype (float32 / bfloat16 / float16 or int8 with
``scale [b, N, k]``; int4 / int2: ``[b, N, j, k, d * bits / 8]`` uint8 codes with float16 group scales and zeros,
``lcx.cache.memory.blocks.quantize_lowbit``, kept in host memory beside the codes), ``pos [b, N, j, k]`` (the
original positions, per KV head since clustered blocks differ per head). A store is registered under an integer id that the cache state carries as an array, so the compiled
generation functions serve any store: :func:`fetch` is the callback the attention calls with ``(store id, layer,
block ids [b, k, K])`` and returns the recalled keys and values, dequantized to float32.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import ml_dtypes
import numpy as np

from lcx.config_base import ConfigError
from lcx.kernels.names import LOWBIT_DTYPES  # bits per code of the bit-packed storage

_STORES: dict[int, "BlockStore"] = {}
_IDS = itertools.count()
_NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "int8": np.int8,
                 **{name: np.uint8 for name in LOWBIT_DTYPES}}


def _unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    """Bit-packed codes ``[..., n]`` uint8 (the first in the low bits, ``lcx.kernels.lowbit.pack``) -> ``[..., n * 8
    / bits]`` float32. NumPy's twin of ``lcx.kernels.lowbit.unpack``: the recall callback runs on the host inside a
    jitted call (``jax.pure_callback``), which must not call back into JAX."""
    shifts = np.arange(8 // bits, dtype=np.uint8) * bits
    codes = (packed[..., None] >> shifts) & np.uint8(2**bits - 1)
    return codes.reshape(*packed.shape[:-1], -1).astype(np.float32)


class BlockStore:
    """Blocks of one generation request: ``n_layers x batch x max_blocks`` slots of ``block`` tokens."""

    def __init__(self, n_layers: int, batch: int, max_blocks: int, block: int, kv_heads: int, head_dim: int,
                 dtype: str, directory: str | Path | None = None, value_group: int = 64):
        self.shape = (n_layers, batch, max_blocks, block, kv_heads, head_dim)
        self.dtype = dtype
        self.directory = None if directory is None else Path(directory)
        self.quantized = dtype == "int8"
        self.bits = LOWBIT_DTYPES.get(dtype)  # int4 / int2: codes plus group scales and zeros (``groups``)
        self.value_group = min(value_group, head_dim)
        np_dtype = _NUMPY_DTYPES[dtype]
        stored = self.shape if self.bits is None else self.shape[:5] + (head_dim * self.bits // 8,)
        if self.directory is None:
            self.k = np.zeros(stored, np_dtype)
            self.v = np.zeros(stored, np_dtype)
        else:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
                self.k = np.lib.format.open_memmap(self.directory / "k.npy", "w+", np_dtype, stored)
                self.v = np.lib.format.open_memmap(self.directory / "v.npy", "w+", np_dtype, stored)
            except OSError as err:
                raise ConfigError(f"cache.store_dir={str(self.directory)!r} cannot hold the long-term store: "
                                  f"{err.strerror or err}") from err
        self.pos = np.full(self.shape[:4] + (kv_heads,), -1, np.int32)
        # int8: one scale per block and KV head, for keys and for values: [2, L, b, N, k]
        self.scale = np.ones((2,) + self.shape[:3] + (kv_heads,), np.float32) if self.quantized else None
        # int4 / int2: keys' scales and zeros per block, KV head and channel; values' per token and channel group
        per_block, per_token = self.shape[:3] + (kv_heads, head_dim), self.shape[:5] + (head_dim // self.value_group,)
        self.groups = {} if self.bits is None else {
            name: np.zeros(per_block if name.startswith("k") else per_token, np.float16)
            for name in ("k_scale", "k_zero", "v_scale", "v_zero")}
        self.n_blocks = np.zeros((batch,), np.int64)  # blocks written per row (the same for every layer)

    # ------------------------------------------------------------------------------------------- writing
    def append(self, k: np.ndarray, v: np.ndarray, pos: np.ndarray, new: np.ndarray,
               scale: np.ndarray | None = None, groups: dict | None = None) -> None:
        """Write ``new[b]`` blocks per row from ``k, v [L, b, n, j, k, d]``, ``pos [L, b, n, j, k]`` (``scale [2, L,
        b, n, k]`` for int8: keys, values; ``groups`` for int4 / int2: ``quantize_lowbit``'s scales and zeros) after
        the blocks each row already holds."""
        for row in range(self.shape[1]):
            count = int(new[row])
            if not count:
                continue
            lo, hi = int(self.n_blocks[row]), int(self.n_blocks[row]) + count
            if hi > self.shape[2]:
                raise ConfigError(f"the long-term store holds {self.shape[2]} blocks per sequence; row {row} needs "
                                  f"{hi}: plan the generation with a longer context")
            self.k[:, row, lo:hi] = k[:, row, :count]
            self.v[:, row, lo:hi] = v[:, row, :count]
            self.pos[:, row, lo:hi] = pos[:, row, :count]
            if self.quantized:
                self.scale[:, :, row, lo:hi] = scale[:, :, row, :count]
            for name, buf in self.groups.items():
                buf[:, row, lo:hi] = groups[name][:, row, :count]
            self.n_blocks[row] = hi

    # ------------------------------------------------------------------------------------------- reading
    def fetch(self, layer: int, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Recalled keys and values of ``ids [b, k, K]`` (block indices per KV head) in ``layer``:
        ``[b, K * j, k, d]`` float32 each (blocks a row does not hold yet read as zeros)."""
        b, heads, topk = ids.shape
        rows = np.arange(b)[:, None, None]
        head = np.arange(heads)[None, :, None]
        safe = np.clip(ids, 0, self.shape[2] - 1)
        out = []
        for which, buf in enumerate((self.k, self.v)):
            x = np.asarray(buf[layer][rows, safe, :, head, :])  # [b, k, K, j, d] (d': packed codes)
            if self.bits is not None:
                x = self._dequantize("kv"[which], x, layer, rows, safe, head)
            x = x.astype(np.float32)
            if self.quantized:
                x = x * self.scale[which, layer][rows, safe, head][..., None, None]
            x = np.where((ids >= 0)[..., None, None], x, 0.0)
            out.append(np.ascontiguousarray(x.transpose(0, 2, 3, 1, 4).reshape(b, topk * self.shape[3], heads,
                                                                                 self.shape[5])))
        return out[0], out[1]

    def _dequantize(self, which: str, codes: np.ndarray, layer: int, rows, safe, head) -> np.ndarray:
        """Recalled bit-packed blocks ``codes [b, k, K, j, d']`` of keys (``which`` "k") or values ("v") -> float32
        ``[b, k, K, j, d]`` (``lcx.cache.memory.blocks.dequantize_lowbit``, in NumPy)."""
        x = _unpack(codes, self.bits)
        scale = self.groups[f"{which}_scale"][layer].astype(np.float32)
        zero = self.groups[f"{which}_zero"][layer].astype(np.float32)
        if which == "k":  # per channel over the block: [b, k, K, d]
            s, z = scale[rows, safe, head], zero[rows, safe, head]
            return x * s[..., None, :] + z[..., None, :]
        s, z = scale[rows, safe, :, head, :], zero[rows, safe, :, head, :]  # [b, k, K, j, d / G]
        xg = x.reshape(*x.shape[:-1], s.shape[-1], self.value_group)
        return (xg * s[..., None] + z[..., None]).reshape(x.shape)

    def nbytes(self) -> int:
        """Bytes of the blocks written (keys, values, positions, scales)."""
        elements = self.k[0, 0, 0].size  # one block's keys (codes) of one layer
        per_block = (2 * np.dtype(self.k.dtype).itemsize * elements + 4 * self.shape[3] * self.shape[4]
                     + (8 * self.shape[4] if self.quantized else 0)
                     + sum(x[0, 0, 0].nbytes for x in self.groups.values()))
        return int(self.n_blocks.sum()) * self.shape[0] * per_block

    # ------------------------------------------------------------------------------------------- persistence
    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        meta = {"shape": list(self.shape), "dtype": self.dtype, "n_blocks": self.n_blocks.tolist(),
                "value_group": self.value_group}
        (path / "store.json").write_text(json.dumps(meta))
        used = int(self.n_blocks.max(initial=0))
        arrays = {"k": self.k[:, :, :used], "v": self.v[:, :, :used], "pos": self.pos[:, :, :used]}
        if self.quantized:
            arrays["scale"] = self.scale[:, :, :, :used]
        arrays |= {name: x[:, :, :used] for name, x in self.groups.items()}
        for name, x in arrays.items():
            np.save(path / f"{name}.npy", np.asarray(x))

    @classmethod
    def load(cls, path: str | Path, directory: str | Path | None = None) -> "BlockStore":
        path = Path(path)
        meta = json.loads((path / "store.json").read_text())
        store = cls(*meta["shape"], dtype=meta["dtype"], directory=directory,
                    value_group=meta.get("value_group", 64))
        used = int(max(meta["n_blocks"], default=0))
        store.k[:, :, :used] = np.load(path / "k.npy")
        store.v[:, :, :used] = np.load(path / "v.npy")
        store.pos[:, :, :used] = np.load(path / "pos.npy")
        if store.quantized:
            store.scale[:, :, :, :used] = np.load(path / "scale.npy")
        for name, x in store.groups.items():
            x[:, :, :used] = np.load(path / f"{name}.npy")
        store.n_blocks = np.asarray(meta["n_blocks"], np.int64)
        return store


# --------------------------------------------------------------------------------------------------- registry
def register_store(store: BlockStore) -> int:
    sid = next(_IDS)
    _STORES[sid] = store
    return sid


def get_store(sid: int) -> BlockStore | None:
    return _STORES.get(int(sid))


def release_store(sid: int) -> None:
    _STORES.pop(int(sid), None)


def fetch(sid, layer, ids, *, block: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """The host side of recall (``jax.pure_callback``): zeros when the store is gone or not yet open."""
    store = get_store(int(sid))
    ids = np.asarray(ids)
    if store is None:
        b, heads, topk = ids.shape
        zeros = np.zeros((b, topk * block, heads, head_dim), np.float32)
        return zeros, zeros
    return store.fetch(int(layer), ids)


__all__ = ["BlockStore", "fetch", "get_store", "register_store", "release_store"]
