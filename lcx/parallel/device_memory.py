"""How much memory a device offers, and the share lcx plans with: one rule for the runtime and ``lcx plan``.

``UTILIZATION`` (90%) of a device's memory is usable; the rest is left to the runtime (CUDA context, compiled
programs, fragmentation), as serving stacks do. Generation checks the KV cache against that share less the weights
before anything runs (``lcx.engine.plan_capacity``), and the planner reports the same numbers.
"""

from __future__ import annotations

import math
import os

import jax

UTILIZATION = 0.9


def usable_bytes(total_bytes: int, utilization: float = UTILIZATION) -> int:
    """The bytes of a device of ``total_bytes`` that lcx plans to use."""
    return math.floor(total_bytes * utilization)


def _stats() -> dict | None:
    """The first local device's ``memory_stats()`` when it reports a limit, else None."""
    try:
        stats = jax.local_devices()[0].memory_stats()
    except Exception:  # some backends do not implement memory_stats
        return None
    return stats if stats and "bytes_limit" in stats else None


def device_memory_bytes() -> int | None:
    """The memory limit the first local device reports; on the CPU backend, which reports none, the host's
    available memory (its arrays live there); None where neither is known."""
    stats = _stats()
    if stats is not None:
        return int(stats["bytes_limit"])
    return host_memory_bytes() if jax.default_backend() == "cpu" else None


def free_bytes() -> int | None:
    """Memory the first local device has free now (limit less bytes in use); on the CPU backend the host's
    available memory; None where unknown."""
    stats = _stats()
    if stats is not None:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    return host_memory_bytes() if jax.default_backend() == "cpu" else None


def host_memory_bytes() -> int | None:
    """Available host memory: ``MemAvailable`` of ``/proc/meminfo`` (Linux), else the physical memory size."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


__all__ = ["UTILIZATION", "device_memory_bytes", "free_bytes", "host_memory_bytes", "usable_bytes"]
