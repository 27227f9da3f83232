"""How much memory a device offers, and the share lcx plans with: one rule for the runtime and ``lcx plan``.

``UTILIZATION`` (90%) of a device's memory is usable; the rest is left to the runtime (CUDA context, compiled
programs, fragmentation), as serving stacks do. Generation checks the KV cache against that share less the weights
before anything runs (``lcx.generate.plan_capacity``), and the planner reports the same numbers.
"""

from __future__ import annotations

import math

import jax

UTILIZATION = 0.9


def usable_bytes(total_bytes: int, utilization: float = UTILIZATION) -> int:
    """The bytes of a device of ``total_bytes`` that lcx plans to use."""
    return math.floor(total_bytes * utilization)


def device_memory_bytes() -> int | None:
    """The memory limit the first local device reports (None where the backend reports none)."""
    try:
        stats = jax.local_devices()[0].memory_stats()
    except Exception:  # some backends do not implement memory_stats
        return None
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


__all__ = ["UTILIZATION", "device_memory_bytes", "usable_bytes"]
