"""The long-term store off the device: blocks of keys and values in host memory (NumPy) or on disk (memory-mapped
files), appended between jitted calls and read from inside them by a host callback.

Shape letters: L layers, b batch, N block capacity, n blocks, j tokens per block, k kv heads, d head dim, K recalled
blocks per KV head.

Layout per layer: ``k, v [b, N, j, k, d]`` in the blocks' format (``lcx.cache.memory.formats``: a float dtype or
int8 codes; int4 / int2: ``[b, N, j, k, d * bits / 8]`` uint8 codes), ``pos [b, N, j, k]`` (the original positions,
per KV head since clustered blocks differ per head), and what the format keeps beside them (``extra``: int8's scale
per block and KV head, bit-packed blocks' float16 group scales and zeros, ``blocks.quantize_lowbit``). A store is
registered under an integer id that the cache state carries as an array, so the compiled generation functions serve
any store: :func:`fetch` is the callback the attention calls with ``(store id, layer, block ids [b, k, K])`` and
returns the recalled keys and values, dequantized to float32 in NumPy by the format.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np

from lcx.cache.memory.formats import block_format
from lcx.config_base import ConfigError

_STORES: dict[int, "BlockStore"] = {}
_IDS = itertools.count()


class BlockStore:
    """Blocks of one generation request: ``n_layers x batch x max_blocks`` slots of ``block`` tokens."""

    def __init__(self, n_layers: int, batch: int, max_blocks: int, block: int, kv_heads: int, head_dim: int,
                 dtype: str, directory: str | Path | None = None, value_group: int = 64):
        self.shape = (n_layers, batch, max_blocks, block, kv_heads, head_dim)
        self.dtype = dtype
        self.directory = None if directory is None else Path(directory)
        self.value_group = min(value_group, head_dim)
        self.format = block_format(dtype, self.value_group)
        np_dtype, stored = self.format.host_dtype, self.format.host_shape(self.shape)
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
        self._layout = self.format.host_arrays(self.shape)  # scales / groups, kept in host memory
        self.extra = {name: spec.new() for name, spec in self._layout.items()}
        self.n_blocks = np.zeros((batch,), np.int64)  # blocks written per row (the same for every layer)

    # ------------------------------------------------------------------------------------------- writing
    def append(self, k: np.ndarray, v: np.ndarray, pos: np.ndarray, new: np.ndarray,
               scale: np.ndarray | None = None, groups: dict | None = None) -> None:
        """Write ``new[b]`` blocks per row from ``k, v [L, b, n, j, k, d]``, ``pos [L, b, n, j, k]`` (``scale [2, L,
        b, n, k]`` for int8: keys, values; ``groups`` for int4 / int2: ``quantize_lowbit``'s scales and zeros) after
        the blocks each row already holds."""
        given = {"scale": scale, **(groups or {})}  # the format's encode, as the spill hands it over
        missing = sorted(name for name in self.extra if given.get(name) is None)
        if missing:
            raise ValueError(f"{self.dtype} blocks keep {missing} beside their codes (what their format's encode "
                             f"gives a spill); append got none")
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
            for name, spec in self._layout.items():
                self.extra[name][spec.blocks(row, slice(lo, hi))] = given[name][spec.blocks(row, slice(0, count))]
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
            x = self.format.host_dequantize(which, x, self.extra, layer, rows, safe, head)
            x = np.where((ids >= 0)[..., None, None], x, 0.0)
            out.append(np.ascontiguousarray(x.transpose(0, 2, 3, 1, 4).reshape(b, topk * self.shape[3], heads,
                                                                                 self.shape[5])))
        return out[0], out[1]

    def nbytes(self) -> int:
        """Bytes of the blocks written (keys, values, positions, scales): the format's count per token and block."""
        n_layers, _, _, block, kv_heads, head_dim = self.shape
        per_block = kv_heads * (block * self.format.token_bytes(head_dim) + self.format.block_bytes(head_dim))
        return int(self.n_blocks.sum()) * n_layers * per_block

    # ------------------------------------------------------------------------------------------- persistence
    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        meta = {"shape": list(self.shape), "dtype": self.dtype, "n_blocks": self.n_blocks.tolist(),
                "value_group": self.value_group}
        (path / "store.json").write_text(json.dumps(meta))
        used = slice(0, int(self.n_blocks.max(initial=0)))
        arrays = {"k": self.k[:, :, used], "v": self.v[:, :, used], "pos": self.pos[:, :, used]}
        arrays |= {name: self.extra[name][spec.blocks(blocks=used)] for name, spec in self._layout.items()}
        for name, x in arrays.items():
            np.save(path / f"{name}.npy", np.asarray(x))

    @classmethod
    def load(cls, path: str | Path, directory: str | Path | None = None) -> "BlockStore":
        path = Path(path)
        meta = json.loads((path / "store.json").read_text())
        store = cls(*meta["shape"], dtype=meta["dtype"], directory=directory,
                    value_group=meta.get("value_group", 64))
        used = slice(0, int(max(meta["n_blocks"], default=0)))
        # .npy keeps bfloat16 as raw 2-byte records (``|V2``): read them back as the format's dtype
        store.k[:, :, used] = np.load(path / "k.npy").view(store.k.dtype)
        store.v[:, :, used] = np.load(path / "v.npy").view(store.v.dtype)
        store.pos[:, :, used] = np.load(path / "pos.npy")
        for name, spec in store._layout.items():
            store.extra[name][spec.blocks(blocks=used)] = np.load(path / f"{name}.npy")
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
