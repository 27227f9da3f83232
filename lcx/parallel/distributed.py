"""Multi-process (multi-host) runs: ``jax.distributed.initialize`` driven by config or the environment.

JAX is the distributed engine: after :func:`initialize`, ``jax.devices()`` lists the devices of every process, a
mesh over them (``lcx.parallel.sharding.make_mesh``) is global, and each process runs the same program on its own
shards.
Call it once per process, before anything touches a JAX device.

Environment (each variable falls back to JAX's own name):
    LCX_COORDINATOR   (JAX_COORDINATOR_ADDRESS)  host:port of process 0's coordinator
    LCX_NUM_PROCESSES (JAX_NUM_PROCESSES)        number of processes
    LCX_PROCESS_ID    (JAX_PROCESS_ID)           this process, 0 .. n-1
On CPU the cross-process collectives use gloo (``jax_cpu_collectives_implementation``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

import jax

# The module, not its names: lcx.config may import DistributedConfig from here.
from lcx.config_base import ConfigError

_ENV = {"coordinator": ("LCX_COORDINATOR", "JAX_COORDINATOR_ADDRESS"),
        "num_processes": ("LCX_NUM_PROCESSES", "JAX_NUM_PROCESSES"),
        "process_id": ("LCX_PROCESS_ID", "JAX_PROCESS_ID")}


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """``distributed: {coordinator: "host:port", num_processes: N, process_id: i}``; all None: one process."""

    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    initialization_timeout: int = 300

    def __post_init__(self):
        given = [f.name for f in dataclasses.fields(self)
                 if f.name != "initialization_timeout" and getattr(self, f.name) is not None]
        if given and len(given) != 3:
            missing = sorted({"coordinator", "num_processes", "process_id"} - set(given))
            raise ConfigError(f"distributed.{missing[0]}=None is invalid: a multi-process run needs "
                                      f"coordinator, num_processes and process_id together (given: {given})")
        if self.coordinator is not None:
            host, _, port = str(self.coordinator).rpartition(":")
            if not host or not port.isdigit():
                raise ConfigError(f"distributed.coordinator={self.coordinator!r} is invalid: must be "
                                          f"'host:port'")
        if self.num_processes is not None and (not isinstance(self.num_processes, int) or self.num_processes < 1):
            raise ConfigError(f"distributed.num_processes={self.num_processes!r} is invalid: must be an "
                                      f"integer >= 1")
        if self.process_id is not None and not (isinstance(self.process_id, int)
                                                and 0 <= self.process_id < self.num_processes):
            raise ConfigError(f"distributed.process_id={self.process_id!r} is invalid: must be an integer in "
                                      f"[0, num_processes={self.num_processes})")

    @property
    def enabled(self) -> bool:
        return self.coordinator is not None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "DistributedConfig":
        env = os.environ if env is None else env
        values = {}
        for field, names in _ENV.items():
            value = next((env[n] for n in names if env.get(n)), None)
            if value is not None and field != "coordinator":
                if not value.strip().isdigit():
                    raise ConfigError(f"{names[0]}={value!r} is invalid: must be a non-negative integer")
                value = int(value)
            values[field] = value
        return cls(**values)


def initialize(config: DistributedConfig) -> bool:
    """Join the multi-process run ``config`` describes; returns False (nothing done) for a single process."""
    if not config.enabled or config.num_processes == 1:
        return False
    if "jax_cpu_collectives_implementation" in jax.config.values:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=config.coordinator, num_processes=config.num_processes,
                               process_id=config.process_id,
                               initialization_timeout=config.initialization_timeout)
    return True


def initialize_from_env(env: Mapping[str, str] | None = None) -> bool:
    """:func:`initialize` from ``LCX_*`` (or ``JAX_*``) environment variables; False when they are not set."""
    return initialize(DistributedConfig.from_env(env))


def is_main_process() -> bool:
    """True in process 0 (the one that prints and writes files)."""
    return jax.process_index() == 0


__all__ = ["DistributedConfig", "initialize", "initialize_from_env", "is_main_process"]
