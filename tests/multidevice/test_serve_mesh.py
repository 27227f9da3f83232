"""``lcx serve --tensor-parallel-size M``: the Server's page pool split by KV head over the model axis of 8 fake CPU
devices gives one device's greedy tokens (full, an evicting policy, an 8-bit pool; SmolLM2's 3 KV heads on 3
devices), each device holds 1/M of the pool's bytes, the planner's pool is the one the server allocates, and the
compiled decode segment neither copies a layer's pages nor moves them between devices. With
``--data-parallel-size 2`` (tensor parallel 4 x data 2): two replicas, each with its pool on its own 4 devices, give
the same tokens.

Fake devices prove correctness and layout only: they share two CPU cores, so no speed is measured here."""

from __future__ import annotations

import re

import pytest

from tests.multidevice.test_sharding_hlo import collectives, shapes_of

CASES = [
    dict(name="full_tp4", impl="pallas", n_kv_heads=4, n_heads=8, d_model=64, model_axis=4, cache={}),
    # two KV heads per device: with one, XLA:CPU relays out the evicting pool's size-1 head axis at every step -
    # copies of each layer's pages that one device holding one KV head shows as well (not the mesh's; a GPU unseen)
    dict(name="h2o_tp2", impl="xla", n_kv_heads=4, n_heads=8, d_model=64, model_axis=2,
         cache={"policy": "h2o", "budget": 16, "interval": 8}),
    dict(name="int8_tp4", impl="xla", n_kv_heads=4, n_heads=8, d_model=64, model_axis=4, cache={"kv_dtype": "int8"}),
    # SmolLM2-135M's grouping: 9 query heads over 3 KV heads, one KV head per device
    dict(name="smollm2_tp3", impl="xla", n_kv_heads=3, n_heads=9, d_model=72, d_ff=96, model_axis=3, cache={}),
]
NAMES = [c["name"] for c in CASES]
_COPY = re.compile(r"=\s*(.+?)\s+copy(?:-start)?\(")


@pytest.fixture(scope="module")
def served(run_worker, once):
    return once("serve_mesh", lambda directory: run_worker("serve_mesh", cases=CASES, directory=str(directory))[0])


@pytest.mark.parametrize("name", NAMES)
def test_serve_mesh_tokens_equal_one_device(served, name):
    assert served[name]["tokens"] == served[name]["ref_tokens"]


@pytest.mark.parametrize("name", NAMES)
def test_serve_mesh_each_device_holds_its_kv_heads_part_of_every_page(served, name):
    case = next(c for c in CASES if c["name"] == name)
    m = case["model_axis"]
    for buf in served[name]["pool"].values():
        layers, pages, heads, *rest = buf["global"]
        assert pages == served[name]["pages"] and buf["spec"][2] == "model"
        assert buf["shard"] == [layers, pages, heads // m, *rest]  # every page, 1/M of its heads
        assert buf["shard_bytes"] * m == buf["bytes"]


@pytest.mark.parametrize("name", NAMES)
def test_serve_mesh_planner_pool_is_what_the_server_allocates(served, name):
    got = served[name]
    assert got["plan_pages"] == got["pages"]
    per_device = sum(buf["shard_bytes"] for buf in got["pool"].values())
    assert per_device == got["plan_pages"] * got["plan_page_bytes"]  # the planner's bytes, from the arrays


@pytest.mark.parametrize("name", NAMES)
def test_serve_mesh_decode_segment_copies_and_moves_no_pages(served, name):
    with open(served[name]["hlo"]) as f:
        hlo = f.read()
    pool = served[name]["pool"]
    whole = {tuple(b["shard"]) for b in pool.values()}
    per_layer = {tuple(b["shard"][1:]) for b in pool.values()}
    copies = [line.strip()[:200] for line in hlo.splitlines()
              if (m := _COPY.search(line)) and {d for _, d in shapes_of(m.group(1))} & (whole | per_layer)]
    assert not copies, "copies of a pool-sized buffer in the decode segment:\n" + "\n".join(copies)
    for c in collectives(hlo):
        touched = {d for _, d in c["result"] + c["operand_shapes"]}
        assert not touched & (whole | per_layer), f"collective on the pages: {c['line']}"


def test_serve_mesh_refuses_a_size_that_cannot_split_the_kv_heads():
    from lcx.config_base import ConfigError
    from lcx.plan.serving import tensor_parallel_mesh
    from tests.multidevice.worker import tiny

    with pytest.raises(ConfigError, match=r"--tensor-parallel-size=4 .*allowed \[1, 3, 9\]"):
        tensor_parallel_mesh(tiny("xla", 3, 9, 72), 4)


def test_serve_mesh_tensor_parallel_4_by_data_parallel_2_gives_one_devices_tokens(run_worker):
    got = run_worker("serve_replicas", data=2, model=4)[0]
    assert got["tokens"] == got["ref_tokens"]
    assert got["devices"] == [[0, 1, 2, 3], [4, 5, 6, 7]]  # a pool per data shard, on its own devices
    assert all(n > 0 for n in got["served"])  # both replicas served requests

