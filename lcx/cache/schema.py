"""One declaration per cache buffer: logical axes, dtype, fill value and what its bytes count as.

A cache type lists its buffers once (``CacheKind.fields()``) and says how big each logical axis is
(``CacheKind.sizes(batch, capacity)``); everything else derives from that: the arrays of an empty cache, their
abstract shapes (orbax restore targets), their shardings on a mesh (through the logical-axis rules of
``lcx.parallel.sharding``), the per-layer view the model's layer scan slices (buffers whose first axis is
``"layers"``), the
layouts kernels see inside ``per_shard``, and the byte counts the planner and ``GenerateResult`` report.

Logical axes of cache buffers: ``layers``, ``batch``, ``length`` (slots), ``kv_heads``, ``keep_heads`` (the KV heads
that keep their own set of tokens: 1 when all heads of a layer share one set, kv_heads when each head keeps its
own), ``head_dim``, and for block stores ``blocks``, ``block`` and ``topk``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

ROLES = ("kv", "meta")


@dataclasses.dataclass(frozen=True)
class Field:
    """One buffer: ``axes`` (logical names; sizes from the cache type), ``dtype`` (a numpy name, or ``"kv"`` for
    the cache's storage dtype), ``fill`` (the empty value) and ``role`` ("kv": key/value data, counted as KV bytes;
    "meta": positions, masks, scores, summaries)."""

    axes: tuple[str, ...]
    dtype: str = "kv"
    fill: Any = 0
    role: str = "meta"

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"Field.role={self.role!r} must be one of {ROLES}")

    def shape(self, sizes: Mapping[str, int]) -> tuple[int, ...]:
        missing = [a for a in self.axes if a not in sizes]
        if missing:
            raise ValueError(f"cache axes {missing} have no size; known: {sorted(sizes)}")
        return tuple(int(sizes[a]) for a in self.axes)

    def numpy_dtype(self, kv_dtype: str) -> np.dtype:
        return np.dtype(jnp.dtype(kv_dtype if self.dtype == "kv" else self.dtype))

    @property
    def per_layer(self) -> bool:
        """Sliced by the model's layer scan (first axis ``layers``)."""
        return self.axes[:1] == ("layers",)


def abstract(fields: Mapping[str, Field], sizes: Mapping[str, int], kv_dtype: str) -> dict[str, jax.ShapeDtypeStruct]:
    return {n: jax.ShapeDtypeStruct(f.shape(sizes), f.numpy_dtype(kv_dtype)) for n, f in fields.items()}


def empty(fields: Mapping[str, Field], sizes: Mapping[str, int], kv_dtype: str) -> dict[str, jax.Array]:
    return {n: jnp.full(f.shape(sizes), f.fill, f.numpy_dtype(kv_dtype)) for n, f in fields.items()}


def nbytes(fields: Mapping[str, Field], sizes: Mapping[str, int], kv_dtype: str, role: str | None = None) -> int:
    """Bytes of the buffers of ``role`` (None: all)."""
    return sum(int(np.prod(f.shape(sizes), dtype=np.int64)) * f.numpy_dtype(kv_dtype).itemsize
               for f in fields.values() if role is None or f.role == role)


__all__ = ["Field", "ROLES", "abstract", "empty", "nbytes"]
