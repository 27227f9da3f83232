"""The 8-bit working cache (``cache.kv_dtype``): real bytes, the write path's rounding, decode equal to prefill over
the same codes, eviction carrying codes and scales together, and errors at config load."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import lcx
from lcx.config import CacheConfig, ConfigError, ModelConfig
from lcx.engine import Generator
from tests.conftest import assert_kept_slots_hold
from lcx.kernels.quant import dequantize

CFG = ModelConfig(vocab_size=61, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=48, init_std=0.1)
PROMPT = np.random.default_rng(5).integers(0, 61, 45).tolist()


@pytest.fixture(scope="module")
def params():
    return lcx.init_params(CFG, jax.random.key(0))


@pytest.mark.slow
def test_int8_cache_bytes_rounding_and_decode_equal_to_prefill(params):
    """Keys and values take 1 byte per element plus a 2-byte scale per token and KV head: x (d + 2) / 2d of
    bfloat16. Layer 0's keys (which no earlier attention shapes) are the float cache's within half a step of their
    scale. Decode steps over the codes give the logits of a prefill over the same tokens (the scales are folded
    into the decode op's products exactly as into the chunk op's tiles; one capacity, so one compiled prefill)."""
    runs = {}
    for kv_dtype in (None, "int8"):
        gen = Generator(CFG, params, max_new_tokens=3, cache=CacheConfig(kv_dtype=kv_dtype), capacity=64)
        runs[kv_dtype] = gen, gen.decode(gen.prefill([PROMPT]))
    d, capacity = CFG.head_dim, runs["int8"][1].cache.capacity
    bf16_bytes = CacheConfig(dtype="bfloat16").kind(CFG).nbytes(1, capacity)  # from the buffer declarations
    assert runs["int8"][1].cache.kv_bytes() * 2 * d == bf16_bytes * (d + 2)
    fl, q8 = runs[None][1].cache, runs["int8"][1].cache
    assert q8.k.dtype == np.int8 and q8.k_scale.dtype == np.float16
    n = len(PROMPT)
    keys = np.asarray(dequantize(q8.k[0, :, :, :n], q8.k_scale[0, :, :, :n]))
    step = np.asarray(q8.k_scale[0, :, :, :n], np.float32)[..., None]
    assert np.all(np.abs(keys - np.asarray(fl.k[0, :, :, :n])) <= 0.5 * step * 1.001 + 1e-6)

    gen, state = runs["int8"]
    fed = [PROMPT + [int(t) for t in state.tokens[0]]]  # every token the decode steps read
    np.testing.assert_allclose(np.asarray(state.logits), np.asarray(gen.prefill(fed).logits), atol=2e-5)


@pytest.mark.slow
def test_eviction_moves_codes_and_scales_together(params):
    """After a compression and decode-time evictions, every kept slot of layer 0 holds the codes and scale the
    uncompressed 8-bit cache holds at that position (layer 0's keys depend on the token alone). SnapKV keeps its own
    positions per KV head; "cache" positions store the keys unrotated and dequantize them to rotate at attention."""
    gen = Generator(CFG, params, max_new_tokens=12, cache=CacheConfig(kv_dtype="int8", budget=16, interval=8,
                                                                      policy="snapkv", window=4, positions="cache"))
    state = gen.decode(gen.prefill([PROMPT]))
    full = Generator(CFG, params, max_new_tokens=1, cache=CacheConfig(kv_dtype="int8", positions="cache"))
    ref = full.prefill([PROMPT + [int(t) for t in state.tokens[0]]]).cache
    c = state.cache
    assert int(c.count.max()) <= 16 + 8 and c.pos.shape[2] == CFG.n_kv_heads
    kept = [set(np.asarray(c.pos[0, 0, h])[np.asarray(c.valid[0, 0, h])].tolist()) for h in range(CFG.n_kv_heads)]
    assert kept[0] != kept[1]  # the heads keep different positions
    assert_kept_slots_hold(c, ref, len(PROMPT))


@pytest.mark.parametrize("cache, message", [
    (dict(kv_dtype="int3"), "cache.kv_dtype='int3' is invalid: must be one of ['int8', 'fp8', 'int4', 'int2', "
                            "'fp4'] or null"),
    (dict(kv_dtype="int8", policy="memory", layout="paged"), "cache.kv_dtype='int8' with cache.policy='memory' "
                                                             "and cache.layout='paged'"),
])
def test_kv_dtype_errors_name_the_field_and_what_is_allowed(cache, message):
    with pytest.raises(ConfigError) as err:
        CacheConfig(**cache)
    assert message in str(err.value)
    assert CacheConfig.from_mapping({"kv_dtype": "int8"}).to_dict()["kv_dtype"] == "int8"
    assert "kv_dtype" not in CacheConfig().to_dict()  # configs written before it stay equal
