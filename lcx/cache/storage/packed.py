"""Bit-packed storage (``cache.kv_dtype: int4 | int2``): KIVI's grouped codes and a float window.

The layout and its arithmetic live in ``lcx.cache.lowbit_slots`` (slots) and ``lcx.cache.lowbit_pages`` (pages),
the codes in ``lcx.kernels.lowbit``; this class is what the kinds see of them. Unlike a per-token format a key
group spans ``kv_group`` slots, so: a write stages the window and flushes whole groups; a decode step (and a
pallas chunk without statistics) reads the codes, other calls the layer dequantized; an eviction scores and
compacts the dequantized slots and requantizes the survivors; a paged row keeps its float window outside the pool
and writes back only the pages a flush may have changed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import ClassVar

import jax
import jax.numpy as jnp

from lcx.cache import lowbit_pages, lowbit_slots
from lcx.cache.schema import Field
from lcx.cache.storage.base import KVStorage
from lcx.cache.storage.views import FloatKV, PackedKV
from lcx.config_base import ConfigError, check
from lcx.kernels import backend
from lcx.kernels.lowbit import LOWBIT


@dataclasses.dataclass(frozen=True)
class PackedStorage(KVStorage):
    """``name``: ``int4`` / ``int2``; ``group``: ``cache.kv_group`` (slots per key scale, channels per value scale);
    ``residual``: ``cache.kv_residual`` (recent tokens kept in floats)."""

    group: int = 64
    residual: int = 0

    settings: ClassVar[tuple[str, ...]] = ("kv_group", "kv_residual")
    cache_types: ClassVar[tuple[str, ...]] = ("slots", "memory")
    windowed_models: ClassVar[bool] = False

    @classmethod
    def from_settings(cls, name, dtype, group=64, residual=0) -> "PackedStorage":
        return cls(name=name, dtype=dtype, group=group, residual=residual)

    @property
    def bits(self) -> int:
        return LOWBIT[self.name]

    def check_config(self, cache, policy, formats) -> None:
        per_byte = 8 // self.bits  # keys are packed along the slots: a key group fills whole bytes
        check(cache.kv_group >= per_byte, "cache.kv_group", cache.kv_group,
              f"must be >= {per_byte} with cache.kv_dtype={cache.kv_dtype!r} (a key group fills whole bytes of "
              f"{per_byte} codes)")
        if policy.cache_type not in self.cache_types:
            raise ConfigError(f"cache.kv_dtype={cache.kv_dtype!r} with cache.policy={cache.policy!r}: the bit-packed "
                              "cache is built for the slot cache (full and every eviction policy, layout "
                              "'contiguous' or 'paged') and the memory tier's long-term blocks; allowed here: "
                              f"kv_dtype {[d for d, f in formats.items() if not f.settings]} or null")
        if policy.cache_type == "memory" and cache.kv_residual:
            raise ConfigError(f"cache.kv_residual={cache.kv_residual} is invalid with cache.policy='memory': the "
                              "memory tier's working window is its float residual (cache.window); the bit-packed "
                              "codes are its long-term blocks; allowed: kv_residual 0")
        if cache.layout == "paged" and policy.cache_type == "slots":  # whole key groups per page
            check(cache.page_size % cache.kv_group == 0, "cache.page_size", cache.page_size,
                  f"must be a multiple of cache.kv_group={cache.kv_group} with cache.kv_dtype={cache.kv_dtype!r} and "
                  "layout 'paged' (a page holds whole key groups): raise page_size (e.g. "
                  f"{max(cache.kv_group, cache.page_size) // cache.kv_group * cache.kv_group}) or lower kv_group to a "
                  f"divisor of {cache.page_size} (>= {per_byte})")

    def check(self, head_dim: int) -> None:
        lowbit_slots.check(self, head_dim)

    # ------------------------------------------------------------------------------------------- declaration
    def slot_fields(self) -> Mapping[str, Field]:
        return lowbit_slots.FIELDS

    def page_fields(self) -> Mapping[str, Field]:
        return lowbit_pages.POOL_FIELDS

    def row_fields(self) -> Mapping[str, Field]:
        return {n: lowbit_slots.FIELDS[n] for n in lowbit_pages.WINDOW}

    def sizes(self, head_dim: int, capacity: int) -> dict[str, int]:
        return lowbit_slots.sizes(self, head_dim, capacity)

    def page_sizes(self, head_dim: int, page: int) -> dict[str, int]:
        return lowbit_pages.sizes(self, page)

    def working(self) -> KVStorage:
        return KVStorage(dtype=self.dtype)  # the memory tier's window is its float residual; blocks hold the codes

    @property
    def block_name(self) -> str:
        return self.name

    @property
    def period(self) -> int:
        return self.group

    @property
    def exponent_dtype(self) -> None:
        return None

    def describe(self, head_dim: int) -> str:
        return f"({head_dim} x {self.bits} bits + group scales and zeros), {self.name}"

    # ------------------------------------------------------------------------------------------- write and read
    def write(self, layer, k, v, ok, put):
        return lowbit_slots.write(layer, k, v, ok, self)

    def view(self, bufs, dtype, *, impl, queries, counted, codes):
        # on the codes: a decode step, or a chunk where the backend has the kernel (pallas) and no statistic is asked
        head_dim = bufs.v.shape[-1] * 8 // self.bits  # the value codes' bytes per token and KV head
        if codes and (queries == 1 or (backend(impl).lowbit_ops(head_dim)[1] is not None and not counted)):
            return PackedKV(k=bufs.k, v=bufs.v,
                            lowbit=lowbit_slots.decode_view(bufs, self))
        return FloatKV(*self.float_kv(bufs, dtype))  # one layer dequantized, the window overlaid

    def float_kv(self, layer, dtype):
        return lowbit_slots.float_kv(layer, self, dtype)

    def readable(self, layer, dtype):
        k, v = self.float_kv(layer, dtype)
        return KVStorage(dtype=self.dtype), layer.replace(k=k, v=v, **{n: None for n in lowbit_slots.STORED[2:]})

    def paged_decode(self, backend, q, pools, **kw):
        raise ValueError("a bit-packed paged cache is read through the slot view (lcx.cache.paged_slots), whose rows "
                         "keep their float window")

    def rewind(self, layer, before, after):
        return lowbit_slots.rewind(layer, before, after, self)

    # ------------------------------------------------------------------------------------------- eviction
    def evict(self, kind, state, budgets, compact):
        """Policies score and compact the dequantized slots; the survivors are quantized again. A policy that picks
        per layer does it one layer at a time, so only one layer is ever in float; a policy that pools budgets across
        layers (cross_layer) dequantizes them all. ``left`` holds the removed slots' codes as stored."""
        if kind.policy.cross_layer:
            out, left = self._evict_floats(kind, state, budgets, compact)
            return out, left.replace(k=state.k, v=state.v)
        names = [n for n, f in kind.fields().items() if f.per_layer]

        def one(xs):
            layer = state.replace(**{n: x[None] for n, x in xs["buffers"].items()})
            out, left = self._evict_floats(kind, layer, xs["budget"][None], compact)
            # what left, without its float keys and values (the codes as stored take their place)
            return {n: getattr(out, n)[0] for n in names}, jax.tree.map(lambda x: x[0], left.replace(k=None, v=None))

        buffers, left = jax.lax.map(one, {"buffers": {n: getattr(state, n) for n in names}, "budget": budgets})
        return state.replace(**buffers), left.replace(k=state.k, v=state.v)

    def _evict_floats(self, kind, state, budgets, compact):
        """``compact`` over the dequantized slots of ``state`` (stacked), the survivors re-quantized."""
        k, v = lowbit_slots.float_layers(state, self, self.dtype)
        floats = state.replace(k=k, v=v, **{n: None for n in lowbit_slots.STORED[2:]})
        out, left = compact(kind.policy, floats, budgets)
        stored = state.replace(**{n: getattr(out, n) for n in ("pos", "valid", "count", "score")})
        return lowbit_slots.requantize_layers(stored, out.k, out.v, self), left

    def quantized_slots(self, count):
        return lowbit_slots.quantized_slots(count, self)

    # ------------------------------------------------------------------------------------------- pages
    def gather(self, layer, table, length):
        lengths = lowbit_pages.view_lengths(self, layer.k.shape[-2], length)
        return {n: lowbit_pages.view(getattr(layer, n), table, n, lengths[n]) for n in lowbit_pages.POOL_FIELDS}

    def put_new(self, layer, slots, *, count, ok, page):
        """The pages a group flush may have written, from the page of the first unquantized slot (a fixed count)."""
        index = lowbit_pages.flushed_pages(count, layer.k.shape[1], ok.shape[1], self, page)
        units = lowbit_pages.per_page(self, page)
        return {n: lowbit_pages.put_pages(getattr(layer, n), getattr(slots, n), n, units[n], layer.table, index)
                for n in lowbit_pages.POOL_FIELDS}

    def put_evicted(self, state, after, cut, page):
        """Every page a cut row alone holds, from the re-quantized view. (A shared page the compaction leaves alone
        keeps its bytes: re-quantizing unchanged groups may round differently, and its sharers must read one page.)"""
        pool, row_pages = state.pool, state.table.shape[1]
        own = jnp.where(cut[:, None] & (pool.table >= 0) & (pool.refs[jnp.maximum(pool.table, 0)] == 1),
                        pool.table, -1)
        index = jnp.broadcast_to(jnp.arange(row_pages), (own.shape[0], state.k.shape[2], row_pages))
        units = lowbit_pages.per_page(self, page)
        return {n: jax.vmap(lambda p, x, n=n: lowbit_pages.put_pages(p, x, n, units[n], own, index))(
            getattr(state, n), getattr(after, n)) for n in lowbit_pages.POOL_FIELDS}


__all__ = ["PackedStorage"]
