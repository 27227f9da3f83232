"""The GQA topology of tensor parallelism: how a model's KV heads meet the mesh's ``model`` axis, from the head counts
alone (no mesh, no model config: ``HeadCounts`` is what it reads of one).

- kv_heads a multiple of the model axis: "shard", each device owns kv_heads / model whole KV groups;
- model axis a multiple of kv_heads (and a divisor of n_heads): "replicate", each KV head is repeated
  r = model / kv_heads times after the K/V projection (``lcx.parallel.sharding.replicate_kv_heads``), so the cache
  holds kv_heads x r heads, one per device, each serving g / r query heads (as vLLM does). Cost: the cache and the
  K/V activations take r x the bytes of an unreplicated cache over all devices (per device: one head, as ``lcx plan``
  reports), and the K/V projection weights, whose kv_heads axis cannot be split, are replicated on every model
  device;
- neither: ``ConfigError`` naming kv_heads and the valid model-axis sizes.

``lcx.parallel.sharding`` applies it on a mesh (``mesh_topology``, ``cache_model_config``) and re-exports these
names.
"""

from __future__ import annotations

import logging
from typing import Protocol

from lcx.config_base import ConfigError

log = logging.getLogger("lcx")


class HeadCounts(Protocol):
    """What the parallel floor reads of a model config (``lcx.model.config.ModelConfig`` has both)."""

    @property
    def n_heads(self) -> int: ...

    @property
    def n_kv_heads(self) -> int: ...


def valid_model_axis_sizes(n_kv_heads: int, n_heads: int | None = None, limit: int | None = None) -> list[int]:
    """Model-axis sizes attention splits without communication: divisors of kv_heads, and multiples of kv_heads
    (up to ``limit``, default 8 x kv_heads) that divide n_heads (KV heads replicated)."""
    limit = 8 * n_kv_heads if limit is None else limit
    sizes = {m for m in range(1, n_kv_heads + 1) if n_kv_heads % m == 0}
    sizes |= {n_kv_heads * r for r in range(2, limit // n_kv_heads + 1)
              if n_heads is None or n_heads % (n_kv_heads * r) == 0}
    return sorted(sizes)


def check_topology(n_kv_heads: int, model_axis: int, n_heads: int | None = None) -> str:
    """``"shard"`` (kv_heads a multiple of the model axis) or ``"replicate"`` (the model axis a multiple of
    kv_heads: each KV head repeated model / kv_heads times); otherwise ``ConfigError`` naming the valid sizes."""
    if model_axis < 1:
        raise ConfigError(f"model axis={model_axis} is invalid: must be >= 1")
    if n_kv_heads % model_axis == 0:
        return "shard"
    valid = valid_model_axis_sizes(n_kv_heads, n_heads, max(model_axis, 8 * n_kv_heads))
    if model_axis % n_kv_heads == 0:
        if n_heads is None or n_heads % model_axis == 0:
            return "replicate"
        raise ConfigError(f"model axis={model_axis} is invalid for n_heads={n_heads}, "
                          f"kv_heads={n_kv_heads}: replicating KV heads {model_axis // n_kv_heads}x needs "
                          f"n_heads divisible by the model axis; valid model-axis sizes: {valid}")
    raise ConfigError(f"kv_heads={n_kv_heads} cannot be split over a model axis of {model_axis} devices: "
                      f"the model axis must divide kv_heads (whole KV groups per device) or be a multiple "
                      f"of it (KV heads replicated); valid model-axis sizes: {valid}")


def kv_replication(n_kv_heads: int, model_axis: int, n_heads: int | None = None) -> int:
    """Copies of each KV head over the model axis (1: sharded, no copies)."""
    if check_topology(n_kv_heads, model_axis, n_heads) == "shard":
        return 1
    return model_axis // n_kv_heads


_LOGGED: set[tuple[int, int]] = set()


def log_replication(n_kv_heads: int, model_axis: int) -> None:
    """Warn once per (kv_heads, model axis) that the KV heads are replicated, and what it costs."""
    if (n_kv_heads, model_axis) in _LOGGED:
        return
    _LOGGED.add((n_kv_heads, model_axis))
    r = model_axis // n_kv_heads
    log.warning("kv_heads=%d on a model axis of %d devices: each KV head is replicated %dx (as vLLM does); the KV "
                "cache takes %dx the memory of an unreplicated one over all devices (one head per device) and the "
                "K/V projection weights are whole on every model device. A model axis of %d (or a divisor of it) "
                "with a larger data axis avoids it.", n_kv_heads, model_axis, r, r, n_kv_heads)


__all__ = ["HeadCounts", "check_topology", "kv_replication", "log_replication", "valid_model_axis_sizes"]
