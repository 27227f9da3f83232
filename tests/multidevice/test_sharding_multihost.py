"""Multi-host: 2 processes x 4 CPU devices on localhost (jax.distributed, gloo collectives) generate the same
greedy tokens as 1 process x 8 devices, on a mesh whose data axis spans the processes (2, 4) and on one whose
model axis does (1, 8) - the row-parallel all-reduces then cross processes. Attention impl "xla" to keep three
concurrent processes fast on a small CPU; the per-shard Pallas kernels are covered by test_sharding_parity/_hlo."""

from __future__ import annotations

import socket

import pytest

MESHES = [[2, 4], [1, 8]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs(spawn, once):
    def make(directory):
        port = _free_port()
        hosts = [spawn("generate_tokens", 4, env={"LCX_COORDINATOR": f"127.0.0.1:{port}", "LCX_NUM_PROCESSES": "2",
                                                  "LCX_PROCESS_ID": str(i)}, meshes=MESHES) for i in range(2)]
        single = spawn("generate_tokens", 8, meshes=MESHES)
        two = [wait() for wait in hosts]
        return {"two_processes": two[0][0], "one_process": single()[0]}

    return once("multihost_generate", make)


def test_sharding_multihost_sees_all_devices(runs):
    two = runs["two_processes"]
    assert (two["processes"], two["devices"], two["local_devices"]) == (2, 8, 4)
    one = runs["one_process"]
    assert (one["processes"], one["devices"], one["local_devices"]) == (1, 8, 8)


@pytest.mark.parametrize("mesh", ["2x4", "1x8"])
def test_sharding_multihost_tokens_equal_single_process(runs, mesh):
    assert runs["two_processes"]["tokens"][mesh] == runs["one_process"]["tokens"][mesh]
