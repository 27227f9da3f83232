"""The unrolled decoder generation runs by default: per-layer params, a decode loop carrying the cache split per
layer. It must give what the scanned decoder gives, for every cache type, and must not copy weights per step."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lcx
from lcx.config import CacheConfig, ConfigError
from lcx.engine import Generator
from lcx.model import Decoder
from lcx.model.decoder import is_unrolled, unroll_params

# d_model 40 and d_ff 88: weight shapes no activation or cache buffer has, so the HLO check below finds copies.
CFG = lcx.ModelConfig(vocab_size=61, d_model=40, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=88, init_std=0.1,
                      max_position_embeddings=512)
PROMPTS = [np.random.default_rng(0).integers(0, 61, 70).tolist(), np.random.default_rng(1).integers(0, 61, 33).tolist()]


@pytest.fixture(scope="module")
def params():
    return lcx.init_params(CFG, jax.random.key(0))


def test_unroll_params_splits_the_layer_axis_and_keeps_the_logits(params):
    unrolled = unroll_params(params)
    assert is_unrolled(unrolled) and not is_unrolled(params)
    assert sorted(k for k in unrolled if k.startswith("layers_")) == [f"layers_{i}" for i in range(CFG.n_layers)]
    np.testing.assert_array_equal(unrolled["layers_2"]["mlp"]["up"], params["layers"]["mlp"]["up"][2])
    assert unroll_params(unrolled) is unrolled
    ids = jnp.asarray([PROMPTS[1]])
    scanned = Decoder(CFG).apply({"params": params}, ids)
    np.testing.assert_allclose(Decoder(CFG, unrolled=True).apply({"params": unrolled}, ids), scanned, atol=1e-5)


CACHES = {  # the full cache (the default): test_unrolled_decode_loop_reads_weights_in_place
    "streaming": CacheConfig(policy="streaming", budget=24, sinks=2, interval=8, prefill_chunk=32),  # evicts in-loop
    "h2o-per-head": CacheConfig(policy="h2o", budget=24, interval=8, heads="per_head"),  # statistics, keep heads
    "memory": CacheConfig(policy="memory", sinks=4, window=16, block=8, topk=64, interval=8, prefill_chunk=32),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CACHES))
def test_unrolled_generation_equals_scanned(params, name):
    """Same greedy tokens and final cache for each cache type, same teacher-forced log-probabilities."""
    cache = CACHES[name]
    runs = {}
    for unroll in (False, True):
        gen = Generator(CFG, params, max_new_tokens=20, cache=cache, unroll=unroll)
        assert gen.unrolled is unroll
        state = gen.decode(gen.prefill(PROMPTS), steps=12)
        assert not state.cache.split  # between calls a state is always stacked
        logprobs = 0.0
        if name == "streaming":  # teacher forcing through the split cache, with eviction (one cache type: CI time)
            state, logprobs = gen.score(state, np.asarray([[5, 6, 7], [8, 9, 10]]))
        final = gen.decode(state)
        runs[unroll] = (gen.result(final).tokens, logprobs, final.cache)
    np.testing.assert_array_equal(runs[True][0], runs[False][0])
    np.testing.assert_allclose(runs[True][1], runs[False][1], atol=1e-4)
    unrolled, scanned = runs[True][2].buffers(), runs[False][2].buffers()
    for name in set(unrolled) - {"store_id"}:  # store_id: each generator's own host-store handle
        np.testing.assert_allclose(np.asarray(unrolled[name], np.float32), np.asarray(scanned[name], np.float32),
                                   atol=1e-4, err_msg=name)


def test_split_and_stack_round_trip():
    kind = CacheConfig(policy="h2o", budget=16, heads="per_head").kind(CFG)
    state = kind.create(2, 20)
    state = state.replace(k=jax.random.normal(jax.random.key(1), state.k.shape))
    split = state.split_layers()
    assert split.split and len(split.k) == CFG.n_layers and split.k[1].shape == state.k.shape[1:]
    assert split.capacity == state.capacity == 20 and split.shape_of("pos") == state.pos.shape
    assert split.lengths is state.lengths  # not a per-layer buffer
    back = split.stack_layers()
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state)):
        np.testing.assert_array_equal(a, b)
    layer = split.layer(2)
    np.testing.assert_array_equal(layer.k, state.k[2])
    updated = split.set_layer(1, layer)
    np.testing.assert_array_equal(updated.k[1], state.k[2])
    np.testing.assert_array_equal(state.set_layer(1, state.layer(2)).k[1], state.k[2])


def _weight_copies(gen: Generator, state) -> list[str]:
    """Instructions of the compiled decode loop that produce an array shaped like a layer weight (a copy)."""
    text = gen.programs.decode_loop.lower(gen.params, state, jnp.int32(20), sampled=False).compile().as_text()
    shapes = {f"f32[{CFG.d_model},{CFG.d_ff}]", f"f32[{CFG.d_ff},{CFG.d_model}]",
              f"f32[{CFG.n_heads * CFG.head_dim},{CFG.d_model}]"}
    return [line.strip()[:120] for line in text.splitlines()
            if re.search(r"= (\S+) (fusion|copy|dynamic-slice|slice|transpose)\(", line)
            and re.search(r"= (\S+) ", line).group(1).split("{")[0] in shapes]


@pytest.mark.slow
def test_unrolled_decode_loop_reads_weights_in_place(params):
    """The point of unrolling: no per-step copy of any layer weight. The scanned loop copies (slices) them - the
    check can fail."""
    copies, tokens = {}, {}
    for unroll in (False, True):
        gen = Generator(CFG, params, max_new_tokens=20, unroll=unroll)
        state = gen.prefill(PROMPTS)
        copies[unroll] = _weight_copies(gen, state)
        tokens[unroll] = gen.result(gen.decode(state)).tokens
    np.testing.assert_array_equal(tokens[True], tokens[False])  # the full cache, the default
    assert copies[True] == [], copies[True]
    assert copies[False], "the scanned decode loop was expected to slice the stacked weights"


def test_unrolled_params_are_refused_on_a_mesh_and_by_unroll_false(params):
    mesh = lcx.parallel.sharding.make_mesh(1, 1)
    with pytest.raises(ConfigError, match="on a mesh pass the stacked params"):
        Generator(CFG, unroll_params(params), max_new_tokens=4, mesh=mesh)
    with pytest.raises(ConfigError, match="unroll=False needs stacked params"):
        Generator(CFG, unroll_params(params), max_new_tokens=4, unroll=False)
    assert Generator(CFG, unroll_params(params), max_new_tokens=4).unrolled  # auto: already unrolled


def test_fresh_generators_share_the_unrolled_copy_of_the_same_params(params):
    """A second Generator over the same arrays reuses the first one's per-layer copy; params that differ in any
    array - even one replaced in place in the dict - get their own (never stale weights)."""
    first = Generator(CFG, params, max_new_tokens=2, unroll=True)
    assert Generator(CFG, params, max_new_tokens=2).params is first.params
    changed = {**params, "layers": {**params["layers"], "mlp": {**params["layers"]["mlp"],
                                                               "up": params["layers"]["mlp"]["up"] * 2}}}
    other = Generator(CFG, changed, max_new_tokens=2)
    assert other.params is not first.params
    np.testing.assert_array_equal(other.params["layers_1"]["mlp"]["up"], 2 * params["layers"]["mlp"]["up"][1])
    np.testing.assert_array_equal(Generator(CFG, params, max_new_tokens=2).params["layers_1"]["mlp"]["up"],
                                  params["layers"]["mlp"]["up"][1])
