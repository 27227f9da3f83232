"""``KVStorage``: how a cache stores its keys and values - one value on every cache kind.

A cache kind decides *which* tokens it keeps and where (slots, pages, a working window); its storage decides *how*
their keys and values are held: as floats, as 8-bit codes with a scale per token and KV head, as bit-packed codes
with group scales and a float window, ... The storage owns everything that differs between those:

- its buffers' declarations, for the slot layout (``[L, b, k, C, ...]``, :meth:`slot_fields`) and the page layout
  (``[L, P, k, g, ...]``, :meth:`page_fields`; :meth:`row_fields`: what a row keeps outside the pool), the sizes of
  their extra axes and its byte count (:meth:`nbytes`, from those declarations);
- ``write``: the new tokens' keys and values into a layer's slots (:meth:`encode` per token, or its own rule);
- the view it hands attention (:meth:`view`: a payload of ``lcx.cache.storage.views``, which calls the backend
  op that reads it), and the paged decode (:meth:`paged_decode`);
- its float reconstruction (:meth:`float_kv`, :meth:`readable`), and what an eviction's compaction does to it
  (:meth:`evict`: per-token formats move codes and scales together; grouped ones requantize the survivors).

Kinds, ``slot_attention``, ``attend_view`` and ``CacheConfig`` ask the storage and never branch on what it is. This
base class is the per-token family's behaviour - a format whose every token's bytes stand alone (float, scaled
8-bit, fp4 blocks along ``head_dim``) only declares its buffers and says how to :meth:`encode` and :meth:`view`.

Registry: ``lcx.cache.storage.FORMATS`` maps each ``cache.kv_dtype`` name to its class; ``storage_for`` builds it.
Shapes: L layers, b batch, k KV heads, C slots, t new tokens, d head dim, P pool pages, g slots per page.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping
from typing import ClassVar

import einops
import jax
import jax.numpy as jnp

from lcx.cache import schema
from lcx.cache.schema import Field

SLOT_KV = ("layers", "batch", "kv_heads", "length", "head_dim")
POOL_KV = ("layers", "pages", "kv_heads", "page", "head_dim")


@dataclasses.dataclass(frozen=True)
class KVStorage:
    """One storage format. ``name``: its ``cache.kv_dtype`` (None: floats); ``dtype``: the cache's float dtype
    (what attention reads, and a grouped format's float window)."""

    name: str | None = None
    dtype: str = "float32"

    # What a format supports, for ``CacheConfig`` (checked at config load; the messages name the setting).
    settings: ClassVar[tuple[str, ...]] = ()  # the CacheConfig fields it reads beyond kv_dtype (kv_group, ...)
    cache_types: ClassVar[tuple[str, ...] | None] = None  # policies' cache types it serves (None: every one)
    windowed_models: ClassVar[bool] = True  # a model with sliding-window layers (a hybrid cache)

    @classmethod
    def from_settings(cls, name: str | None, dtype: str, group: int = 64, residual: int = 0) -> "KVStorage":
        return cls(name=name, dtype=dtype)

    def check_config(self, cache, policy, formats: Mapping[str, type]) -> None:
        """Raise a ``ConfigError`` naming the setting when ``cache`` (a ``CacheConfig``) cannot use this format
        (``formats``: the registry, for the messages' lists of what is allowed)."""

    def serves(self, cache_type: str, layout: str) -> bool:
        """Whether a policy's ``cache_type`` in ``layout`` can store its keys and values this way: floats everywhere;
        a quantized format its ``cache_types``, pages only for the slot cache."""
        return self.cache_types is None or (cache_type in self.cache_types
                                            and (layout == "contiguous" or cache_type == "slots"))

    def check(self, head_dim: int) -> None:
        """Raise ``ValueError`` when a model's ``head_dim`` cannot be stored this way."""

    # ------------------------------------------------------------------------------------------- declaration
    @property
    def buffer_dtype(self) -> str:
        """The dtype of the ``"kv"`` buffers (``schema.Field.dtype == "kv"``)."""
        return self.dtype

    def slot_fields(self) -> Mapping[str, Field]:
        """The key / value buffers in the slot layout (``k`` and ``v`` first)."""
        return {"k": Field(SLOT_KV, "kv", 0, role="kv"), "v": Field(SLOT_KV, "kv", 0, role="kv")}

    def page_fields(self) -> Mapping[str, Field]:
        """The key / value buffers in the page layout (every one with axes ``layers, pages, kv_heads, page``)."""
        return {"k": Field(POOL_KV, "kv", 0, role="kv"), "v": Field(POOL_KV, "kv", 0, role="kv")}

    def row_fields(self) -> Mapping[str, Field]:
        """Per-row key / value buffers a paged cache keeps outside its pool (none: every byte is in pages)."""
        return {}

    @property
    def pages_hold_rows(self) -> bool:
        """Whether a row's pages alone hold its keys and values - no per-row buffer beside the pool - so that its
        pages can be kept and shared as a prefix (a prefix cache, a page store)."""
        return not self.row_fields()

    def sizes(self, head_dim: int, capacity: int) -> dict[str, int]:
        """The logical axes of :meth:`slot_fields` beyond the slot cache's own."""
        return {}

    def page_sizes(self, head_dim: int, page: int) -> dict[str, int]:
        """The logical axes of :meth:`page_fields` beyond the pool's own."""
        return {}

    def nbytes(self, model, batch: int, capacity: int) -> int:
        """Bytes of ``batch`` rows of ``capacity`` slots of ``model``'s keys and values, from the declarations."""
        sizes = {"layers": model.n_layers, "batch": batch, "length": capacity, "kv_heads": model.n_kv_heads,
                 "head_dim": model.head_dim, **self.sizes(model.head_dim, capacity)}
        return schema.nbytes(self.slot_fields(), sizes, self.buffer_dtype, "kv")

    @property
    def period(self) -> int:
        """Tokens after which the bytes repeat - a grouped format's group, 1 for a per-token format."""
        return 1

    def bytes_per_token(self, model) -> int:
        """Bytes one more token of one sequence adds, every layer and KV head (a grouped format: one more group's,
        per token)."""
        n = self.period
        return (self.nbytes(model, 1, 2 * n) - self.nbytes(model, 1, n)) // n

    def bytes_per_row(self, model) -> int:
        """Bytes of one sequence that do not grow with its length (a grouped format's float window)."""
        return self.nbytes(model, 1, self.period) - self.period * self.bytes_per_token(model)

    @property
    def exponent_dtype(self) -> str | None:
        """The float dtype whose exponent range the stored values have, or None for values scaled per token or
        group."""
        return self.dtype

    def describe(self, head_dim: int) -> str:
        """One token of one KV head, in words (``lcx plan``)."""
        return f"{head_dim} x {jnp.dtype(self.dtype).itemsize} B, {self.dtype}"

    # ------------------------------------------------------------------------------------------- the memory tier
    def working(self) -> "KVStorage":
        """The storage of the memory tier's working window (``lcx.cache.memory``): this one."""
        return self

    @property
    def block_name(self) -> str:
        """What the memory tier's long-term blocks store by default, floats (``lcx.cache.memory.formats``)."""
        return self.dtype

    # ------------------------------------------------------------------------------------------- write and read
    def encode(self, k: jax.Array, v: jax.Array) -> dict[str, jax.Array]:
        """New tokens ``k, v [b, t, k, d]`` as the per-token buffers they add (name -> ``[b, t, k, ...]``)."""
        return {"k": k, "v": v}

    def write(self, layer, k: jax.Array, v: jax.Array, ok: jax.Array, put):
        """``layer`` with ``k, v [b, t, k, d]`` (where ``ok [b, t]``) appended; ``put(buffer, x [b, t, k, ...])``
        scatters per-token arrays into their slots. ``layer.count`` is the count before this call."""
        return layer.replace(**{n: put(getattr(layer, n), x) for n, x in self.encode(k, v).items()})

    def view(self, bufs, dtype, *, impl: str, queries: int, counted: bool, codes: bool):
        """The payload attention reads from ``bufs`` (a layer, or gathered pages, with this format's buffers):
        ``codes`` False when the caller needs values (keys rotated at read time); the others say what the call is
        (backend, number of queries, statistics asked) for a format whose codes only some ops read."""
        from lcx.cache.storage.views import FloatKV
        return FloatKV(k=bufs.k, v=bufs.v)

    def float_kv(self, layer, dtype) -> tuple[jax.Array, jax.Array]:
        """One layer's keys and values as values ``[b, k, C, d]`` in ``dtype``."""
        return layer.k.astype(dtype), layer.v.astype(dtype)

    def readable(self, layer, dtype):
        """``(storage, layer)`` a reconstruction pass reads through the chunk op: this format as it is, or (a format
        whose codes the ops cannot read in a chunk) the layer dequantized in floats."""
        return self, layer

    def float_keys(self, layer, take=lambda x: x) -> jax.Array:
        """Float32 keys ``[b, k, W, d]`` of the slots ``take`` cuts from each per-slot buffer ``[b, k, C, ...]``."""
        return take(layer.k).astype(jnp.float32)

    def paged_decode(self, backend, q, pools: Mapping[str, jax.Array], *, table, lengths, sm_scale, extra):
        """One query ``q [b, h, d]`` against a layer's pages (the backend's ``paged_decode``: Pallas reads them in
        place)."""
        scales = {n: x for n, x in pools.items() if n not in ("k", "v")}
        return backend.paged_decode(q, pools["k"], pools["v"], table=table, lengths=lengths, sm_scale=sm_scale,
                                    **extra, **scales)

    def rewind(self, layer, before: jax.Array, after: jax.Array) -> dict[str, jax.Array]:
        """The buffers to replace in ``layer`` when each row's newest tokens are forgotten (``count`` from ``before``
        to ``after``): none for a per-token format, whose forgotten slots are simply never read."""
        return {}

    # ------------------------------------------------------------------------------------------- eviction
    def evict(self, kind, state, budgets, compact):
        """``compact(policy, state, budgets)`` (``lcx.cache.schedule.evict_cache``) over ``state`` (stacked): a
        per-token format's codes and scales move with their slots."""
        return compact(kind.policy, state, budgets)

    def quantized_slots(self, count: jax.Array) -> jax.Array:
        """The slots whose stored bytes are final for ``count`` occupied ones (all of them, per token): what a fork
        may share."""
        return count

    # ------------------------------------------------------------------------------------------- pages
    def gather(self, layer, table: jax.Array, length: int) -> dict[str, jax.Array]:
        """One layer's pool buffers as the slot layout's ``[b, k, length, ...]`` (each row's pages in order)."""
        from lcx.kernels.paged_decode import gather_pages
        return {n: gather_pages(getattr(layer, n), table)[:, :, :length] for n in self.page_fields()}

    def put_new(self, layer, slots, *, count, ok, page: int) -> dict[str, jax.Array]:
        """The pool buffers of ``layer`` with the new tokens' slots of the slot view ``slots`` (after
        ``slot_attention.attend``) written into their pages; padding is dropped."""
        from lcx.cache.slot_attention import new_slots
        capacity = slots.pos.shape[-1]
        pools = {n: getattr(layer, n) for n in self.page_fields()}
        kv_heads, row_pages, n_pages = pools["k"].shape[1], layer.table.shape[1], pools["k"].shape[0]
        slot = new_slots(count, ok, capacity)  # [b, H, t]
        slot = jnp.minimum(einops.repeat(slot, "b H t -> b (H j) t", j=kv_heads // slot.shape[1]), capacity)
        ids = jnp.take_along_axis(layer.table, jnp.minimum(slot // page, row_pages - 1).reshape(slot.shape[0], -1),
                                  axis=1).reshape(slot.shape)
        ids = jnp.where((slot < capacity) & (ids >= 0), ids, n_pages)
        head = jnp.arange(kv_heads)[None, :, None]
        at = jnp.minimum(slot, capacity - 1)

        def new(x):  # [b, k, C, ...] -> the new tokens' slots [b, k, t, ...] (scales have no head dim)
            return jnp.take_along_axis(x, at.reshape(at.shape + (1,) * (x.ndim - 3)), axis=2)

        return {n: pool.at[ids, head, slot % page].set(new(getattr(slots, n)).astype(pool.dtype), mode="drop")
                for n, pool in pools.items()}

    def put_evicted(self, state, after, cut: jax.Array, page: int) -> dict[str, jax.Array]:
        """The pool buffers of ``state`` (stacked; its pool already trimmed and copied-on-write) with every page a
        row ``cut [b]`` marks holds written from the compacted slot view ``after``."""
        pools = {n: getattr(state, n) for n in self.page_fields()}
        n_pages = pools["k"].shape[1]
        ids = jnp.where(cut[:, None] & (state.table >= 0), state.table, n_pages)  # [b, T]
        pad = ((0, 0), (0, 0), (0, 0), (0, state.table.shape[1] * page - state.capacity))

        def write(pool, x):  # x [L, b, k, C, ...] -> every held page of every cut row (scales: no head dim)
            x = jnp.pad(x, (*pad, *[(0, 0)] * (x.ndim - 4)))
            x = einops.rearrange(x, "L b k (T g) ... -> L b T k g ...", g=page)
            return pool.at[:, ids].set(x.astype(pool.dtype), mode="drop")

        return {n: write(pool, getattr(after, n)) for n, pool in pools.items()}


def namespace(**buffers) -> types.SimpleNamespace:
    """Buffers by attribute (gathered pages handed to :meth:`KVStorage.view`)."""
    return types.SimpleNamespace(**buffers)


__all__ = ["KVStorage", "POOL_KV", "SLOT_KV", "namespace"]
