"""The memory tier's lexical recall (``cache.lexical``): blocks sharing rare tokens with the last ones read."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lcx
from lcx.cache.memory.attend import lexical_scores, recent_tokens, recent_tokens_per_query
from lcx.config import ConfigError
from lcx.model.config import ModelConfig

CFG = lcx.ModelConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                      max_position_embeddings=2048)
SINKS, BLOCK, NEEDLE = 4, 8, 5  # the needle fills block 5: positions 44 .. 51


def memory(**kw) -> lcx.CacheConfig:
    spec = dict(policy="memory", sinks=SINKS, window=16, block=BLOCK, topk=2, interval=8, prefill_chunk=32)
    spec.update(kw)
    return lcx.CacheConfig(**spec)


def needle_prompt(seed: int = 0, length: int = 150) -> list[int]:
    """Filler ids below 50; ids 50 .. 57 fill the needle's block and are asked for again at the end."""
    ids = np.random.default_rng(seed).integers(0, 50, length)
    start = SINKS + NEEDLE * BLOCK
    ids[start:start + BLOCK] = np.arange(50, 58)
    ids[-6:] = [7, 51, 53, 55, 57, 9]
    return ids.tolist()


def test_lexical_scores_equal_a_python_reference():
    rng = np.random.default_rng(0)
    block_tok = rng.integers(0, 12, (2, 6, 5))
    asked = rng.integers(-1, 12, (2, 7))
    n_blocks = np.array([6, 4])
    got = np.asarray(lexical_scores(jnp.asarray(block_tok), jnp.asarray(n_blocks), jnp.asarray(asked)))
    for row in range(2):
        n = int(n_blocks[row])
        blocks = [set(block_tok[row, i].tolist()) for i in range(n)]
        for i in range(block_tok.shape[1]):
            want = 0.0
            if i < n:  # blocks not yet written score nothing
                for t in {int(t) for t in asked[row] if t >= 0} & blocks[i]:
                    want += math.log(n / sum(t in b for b in blocks))
            assert got[row, i] == pytest.approx(want, rel=1e-5, abs=1e-6), (row, i)


def test_recent_tokens_keep_the_last_real_ids_in_order():
    recent = jnp.asarray([[-1, -1, 5, 6], [1, 2, 3, 4]])
    new = jnp.asarray([[7, 8, 9], [5, 6, 7]])
    ok = jnp.asarray([[True, False, True], [True, True, False]])
    assert np.asarray(recent_tokens(recent, new, ok)).tolist() == [[5, 6, 7, 9], [3, 4, 5, 6]]


def test_recent_tokens_per_query_are_the_last_real_ids_up_to_each_query():
    """Teacher forcing's ids per query: the last R real ones up to and including the query's own - the ids a decode
    step at it matches (``recent_tokens`` after appending it)."""
    recent = jnp.asarray([[-1, 4, 5], [1, 2, 3]])
    new = jnp.asarray([[7, 8, 9, 10], [5, 6, 7, 8]])
    ok = jnp.asarray([[True, False, True, True], [True, True, True, False]])
    got = np.asarray(recent_tokens_per_query(recent, new, ok))
    for row in range(2):
        seen = [int(t) for t in np.asarray(recent[row]) if t >= 0]
        for i in range(new.shape[1]):
            if ok[row, i]:
                seen.append(int(new[row, i]))
            want = sorted(seen[-3:])
            assert sorted(int(t) for t in got[row, i] if t >= 0) == want, (row, i)
            buffer = recent_tokens(recent[row:row + 1], new[row:row + 1, :i + 1], ok[row:row + 1, :i + 1])
            assert sorted(int(t) for t in np.asarray(buffer)[0] if t >= 0) == want


@pytest.mark.parametrize("unroll", [False, True])
def test_lexical_recall_puts_the_block_sharing_the_last_tokens_in_every_layer_and_head(unroll):
    """After a prefill the needle's block - the only one holding the ids the prompt ends with - is recalled in every
    layer and KV head, and each block's ids are the prompt's at the block's positions; decoding (one id at a time,
    staged for every layer in both decoder forms) keeps recalling it."""
    params = lcx.init_params(CFG, jax.random.key(3))
    prompt = needle_prompt()
    # the last 8 ids: the window is 16 tokens, and ids older than the window are in blocks (refused below)
    gen = lcx.Generator(CFG, params, max_new_tokens=4, cache=memory(lexical=1, lexical_tokens=8), unroll=unroll)
    state = gen.prefill([prompt])
    cache = state.cache
    assert np.all(np.any(np.asarray(cache.recalled)[:, 0] == NEEDLE, axis=-1))  # [L, k]
    pos = gen.kind.block_positions(cache)[:, 0, ..., 0]  # [L, N, j]
    block_tok = np.asarray(cache.block_tok if not isinstance(cache.block_tok, tuple)
                           else jnp.stack(cache.block_tok))[:, 0]
    written = pos >= 0
    assert written.sum() >= CFG.n_layers * 10 * BLOCK
    np.testing.assert_array_equal(block_tok[written], np.asarray(prompt)[pos[written]])
    assert np.all(block_tok[~written] == -1)
    state = gen.decode(state, steps=1)
    assert np.all(np.any(np.asarray(state.cache.recalled)[:, 0] == NEEDLE, axis=-1))
    assert np.asarray(state.cache.recent_tok)[:, 0, -1].tolist() == [int(np.asarray(state.tokens)[0, 0])] * CFG.n_layers
    gen.close()


def test_lexical_recall_of_every_block_equals_the_full_cache():
    """With every block recalled (topk above the store's count, lexical picks first) generation equals the full cache:
    the forced blocks go through the same sorted recall as the router's."""
    params = lcx.init_params(CFG, jax.random.key(3))
    prompt = needle_prompt(1, 120)
    def run(cache):
        gen = lcx.Generator(CFG, params, max_new_tokens=12, cache=cache)
        out = gen.result(gen.decode(gen.prefill([prompt])))
        gen.close()
        return out.tokens

    np.testing.assert_array_equal(run(memory(topk=64, lexical=8, lexical_tokens=16)), run(None))


def test_lexical_recall_on_a_sliding_window_model_reads_the_tokens_through_its_global_layers():
    base = ModelConfig(vocab_size=61, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=48, head_dim=8,
                       family="gemma3", query_scale=12.0, init_std=0.3)
    hybrid = dataclasses.replace(base, layer_types=("sliding_attention", "sliding_attention", "full_attention"),
                                 sliding_window=8)
    gen = lcx.Generator(hybrid, lcx.init_params(hybrid, jax.random.key(1)), max_new_tokens=3,
                        cache=memory(lexical=1, lexical_tokens=8))
    state = gen.prefill([needle_prompt()])
    assert np.all(np.any(np.asarray(state.cache.glob.recalled)[:, 0] == NEEDLE, axis=-1))
    assert gen.result(gen.decode(state)).lengths.tolist() == [3]
    gen.close()


@pytest.mark.parametrize("kw, message", [
    (dict(lexical=3), "cache.lexical=3 is invalid: at most cache.topk=2 of the recalled blocks"),
    (dict(lexical=-1), "cache.lexical=-1 is invalid: must be an integer >= 0"),
    (dict(lexical=1, lexical_tokens=0), "cache.lexical_tokens=0 is invalid: must be an integer >= 1"),
    (dict(lexical=1, blocks="cluster"), "cache.lexical=1 is invalid with cache.blocks='cluster'"),
    (dict(lexical=1, route_groups=2), "cache.lexical=1 is invalid with cache.route_groups=2"),
    (dict(lexical=1), "cache.lexical_tokens=64 is invalid with a working window of 16 tokens"),
])
def test_lexical_bad_settings_fail_at_load(kw, message):
    with pytest.raises(ConfigError) as err:
        lcx.Config(model=CFG, cache=memory(**kw))
    assert message in str(err.value)


def test_lexical_teacher_forcing_routes_each_query_on_the_ids_up_to_it():
    """Scoring a continuation in one chunk, a query's blocks are chosen by the ids up to it: the first 4
    log-probabilities are the same whether the needle's ids follow them in the chunk or not (they would move if
    later ids chose earlier queries' blocks), and equal one-token calls'."""
    params = lcx.init_params(CFG, jax.random.key(3))
    prompt = needle_prompt(2)[:-6]  # the needle planted, not asked for
    head = [3, 51, 9, 14]  # one id at a time is matched: 51 (the needle's) chooses the block of its own query only
    gen = lcx.Generator(CFG, params, max_new_tokens=16, cache=memory(lexical=1, lexical_tokens=1))
    _, both = gen.score(gen.prefill([prompt]), [head + [50, 52, 54, 56]])
    _, alone = gen.score(gen.prefill([prompt]), [head])
    np.testing.assert_allclose(both[:, :4], alone, atol=1e-5)
    stepped = []
    state = gen.prefill([prompt])
    for token in head:  # one token per call: the decode step's routing
        state, lp = gen.score(state, [[token]])
        stepped.append(lp[0, 0])
    np.testing.assert_allclose(alone[0], stepped, atol=1e-5)
