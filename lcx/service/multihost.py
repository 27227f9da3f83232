"""``lcx serve`` across processes (multi-host): every process runs ``lcx serve`` with the same flags and
``LCX_COORDINATOR`` / ``LCX_NUM_PROCESSES`` / ``LCX_PROCESS_ID`` (``lcx.parallel.distributed``); each builds the same
``Server`` on a mesh over every process's devices; process 0 serves HTTP and drives the steps
(``lcx.engine.lockstep.Lockstep``), the others follow them (``lcx.engine.lockstep.follow``) and serve nothing.

What must agree before the first step is checked or made to agree here: the mesh holds every process's devices
(``--tensor-parallel-size`` = all devices), no process writes a ``--kv-store`` of its own (refused: a store each
process read and wrote apart would make their steps differ), and the pool has one size (the smallest any process
planned: free device memory differs between hosts).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from lcx.config_base import ConfigError

HEARTBEAT_S = 1.0  # idle process 0 tells the followers every second that it is alive (they wait in a collective)


def spans() -> bool:
    """This ``lcx serve`` runs across processes."""
    return jax.process_count() > 1


def leads() -> bool:
    """This process serves HTTP and drives the steps (process 0, or the only one)."""
    return jax.process_index() == 0


def check(config) -> None:
    """Refuse, before the model loads, what cannot run across processes (errors name the flag)."""
    if not spans():
        return
    n, devices = jax.process_count(), jax.device_count()
    if config.tensor_parallel_size != devices:
        raise ConfigError(f"--tensor-parallel-size={config.tensor_parallel_size} is invalid across {n} processes: "
                          f"the mesh must hold every process's devices (allowed: {devices}, all of them)")
    if config.data_parallel_size != 1:
        raise ConfigError(f"--data-parallel-size={config.data_parallel_size} is invalid across {n} processes: the "
                          "processes step one server together (allowed: 1)")
    if config.kv_store is not None:
        raise ConfigError(f"--kv-store={config.kv_store!r} is not served across processes yet: each process would "
                          "read and write its own copy and their steps would differ (allowed: none; the host "
                          "memory store is kept the same on every process)")


def agreed(setup):
    """``setup`` with the pool every process can hold: the smallest of the processes' planned page counts."""
    if not spans():
        return setup
    from jax.experimental import multihost_utils

    pages = int(np.min(multihost_utils.process_allgather(np.int32(setup.pages))))
    if pages == setup.pages:
        return setup
    plan = setup.plan
    if plan is not None and dataclasses.is_dataclass(plan) and hasattr(plan, "pages"):
        plan = dataclasses.replace(plan, pages=pages)
    return dataclasses.replace(setup, pages=pages, plan=plan)


def lead(server):
    """What process 0's engine drives: ``server`` itself on one process, its ``Lockstep`` across several."""
    if not spans():
        return server
    from lcx.engine.lockstep import Lockstep

    return Lockstep(server)


def follow(server) -> int:
    """A follower's life (processes 1 ..): the steps process 0 drives, until it closes; the number of steps."""
    from lcx.engine.lockstep import follow as follow_

    return follow_(server)


__all__ = ["HEARTBEAT_S", "agreed", "check", "follow", "lead", "leads", "spans"]
