"""Sharded forward and greedy generate equal one device on (data, model) meshes 1x8, 2x4 and 8x1 of 8 fake CPU
devices, for kv_heads = 8 (sharded), kv_heads = 4 on model = 8 (replicated 2x); kv_heads = 6 on model = 4 raises."""

from __future__ import annotations

import pytest

MESHES = [[1, 8], [2, 4], [8, 1]]  # all model, both, all data ((4, 2) splits as (2, 4) does)
NAMES = [f"{d}x{m}" for d, m in MESHES]


@pytest.fixture(scope="module")
def kv8(run_worker, once):
    return once("parity_kv8", lambda _: run_worker("parity", impl="pallas", n_kv_heads=8, meshes=MESHES)[0])


@pytest.fixture(scope="module")
def kv4_on_model8(run_worker, once):
    return once("parity_kv4_on_model8", lambda _: run_worker("parity", impl="pallas", n_kv_heads=4, meshes=[[1, 8]]))


@pytest.fixture(scope="module")
def kv8_per_head(run_worker, once):
    """SnapKV with per-KV-head keep sets and a head-adaptive budget (the heads of a layer share it), evicting, in an
    8-bit cache (codes and scales sharded with their KV heads)."""
    cache = {"policy": "snapkv", "budget": 4, "window": 2, "interval": 2, "head_budget": "adaptive", "kv_dtype": "int8"}
    return once("parity_kv8_per_head", lambda _: run_worker("parity", impl="pallas", n_kv_heads=8, meshes=[[2, 4]],
                                                           new_tokens=8, cache=cache)[0])


@pytest.fixture(scope="module")
def kv8_lowbit(run_worker, once):
    """The bit-packed int4 cache (keys channel-major, a float window) under SnapKV eviction: decode on the codes and
    eviction's re-quantization per shard."""
    cache = {"policy": "snapkv", "budget": 8, "window": 2, "interval": 4, "kv_dtype": "int4", "kv_group": 8,
             "kv_residual": 4}
    return once("parity_kv8_lowbit", lambda _: run_worker("parity", impl="xla", n_kv_heads=8, meshes=[[2, 4]],
                                                         new_tokens=8, cache=cache)[0])


@pytest.mark.parametrize("mesh", NAMES)
def test_sharding_forward_equals_single_device(kv8, mesh):
    assert kv8["meshes"][mesh]["forward_max_abs_diff"] <= 1e-5


@pytest.mark.parametrize("mesh", NAMES)
def test_sharding_generate_tokens_identical(kv8, mesh):
    assert kv8["meshes"][mesh]["tokens"] == kv8["ref_tokens"]
    assert kv8["meshes"][mesh]["ragged_tokens"] == kv8["ref_tokens"][:7]  # a batch the data axis does not divide


@pytest.mark.parametrize("mesh", NAMES)
def test_sharding_cache_batch_over_data_kv_heads_over_model(kv8, mesh):
    data, model = map(int, mesh.split("x"))
    got = kv8["meshes"][mesh]
    layers, batch, heads, capacity, head_dim = got["cache_k_shape"]  # [L, b, k, C, d]
    assert heads == 8
    assert got["cache_k_shard_shape"] == [layers, batch // data, heads // model, capacity, head_dim]
    spec = (got["cache_k_spec"] + [None] * 5)[:5]
    assert spec[0] is None and spec[3] is None and spec[4] is None
    assert spec[1] == "data" or (data == 1 and spec[1] is None)
    assert spec[2] == "model" or (model == 1 and spec[2] is None)
    assert kv8["lcx_warnings"] == []  # no replication anywhere


def test_sharding_per_head_keep_sets_split_with_their_kv_heads(kv8_per_head):
    got = kv8_per_head["meshes"]["2x4"]
    assert got["tokens"] == kv8_per_head["ref_tokens"]
    layers, batch, heads, capacity = got["cache_pos_shape"]
    assert heads == 8 and got["cache_pos_shard_shape"] == [layers, batch // 2, heads // 4, capacity]


def test_sharding_lowbit_cache_splits_codes_with_their_kv_heads(kv8_lowbit):
    got = kv8_lowbit["meshes"]["2x4"]
    assert got["tokens"] == kv8_lowbit["ref_tokens"]
    layers, batch, heads, head_dim, packed = got["cache_k_shape"]  # channel-major codes [L, b, k, d, C' / 2]
    assert heads == 8 and got["cache_k_shard_shape"] == [layers, batch // 2, heads // 4, head_dim, packed]


def test_sharding_replicated_kv_heads_forward_and_tokens(kv4_on_model8):
    result, _ = kv4_on_model8
    got = result["meshes"]["1x8"]
    assert got["forward_max_abs_diff"] <= 1e-5
    assert got["tokens"] == result["ref_tokens"]


def test_sharding_replicated_kv_heads_one_head_per_device(kv4_on_model8):
    got = kv4_on_model8[0]["meshes"]["1x8"]
    layers, batch, heads, capacity, head_dim = got["cache_k_shape"]  # [L, b, k, C, d]
    assert heads == 8  # 4 KV heads x 2 copies
    assert got["cache_k_shard_shape"] == [layers, batch, 1, capacity, head_dim]


def test_sharding_replication_logged_once(kv4_on_model8):
    result = kv4_on_model8[0]
    assert len(result["lcx_warnings"]) == 1  # forward, prefill and decode all traced; said once
    message = result["lcx_warnings"][0]
    assert "kv_heads=4" in message and "model axis of 8" in message and "replicated 2x" in message


def test_sharding_kv6_on_model4_raises_naming_valid_sizes(run_worker):
    errors = run_worker("topology_error", n_kv_heads=6, n_heads=12, mesh_shape=[2, 4])[0]["errors"]
    for entry, message in errors.items():
        assert message is not None, f"{entry} did not raise"
        assert "kv_heads=6" in message and "model axis of 4" in message, message
        assert "valid model-axis sizes: [1, 2, 3, 6, 12]" in message, message


def test_sharding_sliding_window_model_forward_gradients_and_bounded_cache(run_worker):
    """Gemma-3-shaped (local + global layer) on a 2 x 4 mesh: logits and loss gradients equal one device's, greedy
    tokens through the bounded cache are identical, and the local layer's slots (window - 1 + its room) split their
    batch over data and KV heads over model like the global layer's."""
    got = run_worker("hybrid_parity", mesh_shape=[2, 4])[0]
    assert got["forward_max_abs_diff"] <= 1e-5 and got["grad_max_abs_diff"] <= 1e-5
    assert got["tokens"] == got["ref_tokens"]
    assert got["local_k_shape"] == [1, 8, 4, 3 + 4, 8]  # [local layers, batch, kv heads, window - 1 + window, d]
    assert got["local_k_shard_shape"] == [1, 4, 1, 7, 8]
    assert got["global_k_shape"][3] == 7 + 12  # the longest prompt + new tokens
