"""Per-row sampling: each row's own temperature / top-k / top-p, and a random stream keyed by its request.

The sets each row samples from equal the scalar filter's (``filter_logits``); a request with a seed gets the same
tokens alone or in any batch, in any row; greedy rows in a mixed batch equal greedy decoding; the server samples
a request exactly as the generator does alone."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lcx
from lcx.config import ConfigError
from lcx.engine import Generator, SamplingConfig, generate
from lcx.engine.sampling import filter_logits, filter_rows
from tests.test_generate import CFG, _prompts

HOT = SamplingConfig(temperature=0.9, top_k=20, top_p=0.95)
SHARED = dict(max_new_tokens=8, capacity=32)  # one cache shape: the tests share compiled programs


@pytest.fixture(scope="module")
def params():
    return lcx.init_params(CFG, jax.random.key(0))


@pytest.mark.parametrize("top_k, top_p", [(None, None), (5, None), (None, 0.7), (3, 0.5), (1, 0.99), (300, 1.0)])
def test_filter_rows_equals_the_scalar_filter_per_row(top_k, top_p):
    rng = np.random.default_rng(1)
    logits = rng.integers(-4, 5, (6, 257)).astype(np.float32)  # many ties at the cut
    logits[2] = rng.normal(size=257) * 3
    rows = filter_rows(jnp.asarray(logits), jnp.full((6,), top_k or 0, jnp.int32),
                       jnp.full((6,), 1.0 if top_p is None else top_p, jnp.float32))
    np.testing.assert_array_equal(rows, filter_logits(jnp.asarray(logits), top_k, top_p))


def test_filter_rows_applies_each_rows_own_setting():
    rng = np.random.default_rng(2)
    logits = jnp.asarray(rng.normal(size=(3, 64)).astype(np.float32))
    settings = [(4, None), (None, 0.5), (None, None)]
    got = filter_rows(logits, jnp.asarray([k or 0 for k, _ in settings], jnp.int32),
                      jnp.asarray([1.0 if p is None else p for _, p in settings], jnp.float32))
    for r, (k, p) in enumerate(settings):
        np.testing.assert_array_equal(got[r], filter_logits(logits[r:r + 1], k, p)[0])
    assert int(jnp.sum(jnp.isfinite(got[0]))) == 4 and bool(jnp.all(jnp.isfinite(got[2])))


@pytest.mark.slow
def test_a_seeded_request_gets_its_tokens_alone_or_in_any_row(params):
    prompts = _prompts([4, 6, 5], seed=7)
    gen = Generator(CFG, params, sampling=HOT, **SHARED)
    batch = gen.result(gen.decode(gen.prefill(prompts, seeds=[11, 12, 13])))
    for row, seed in ((1, 12), (2, 13)):
        alone = gen.result(gen.decode(gen.prefill([prompts[row]], seeds=[seed])))
        np.testing.assert_array_equal(batch.tokens[row], alone.tokens[0])
    moved = gen.result(gen.decode(gen.prefill([prompts[2], prompts[1]], seeds=[13, 12])))  # other rows
    np.testing.assert_array_equal(moved.tokens[::-1], batch.tokens[1:])
    other = gen.result(gen.decode(gen.prefill([prompts[1]], seeds=[99])))
    assert not np.array_equal(other.tokens[0], batch.tokens[1])  # the seed, not the row, picks the stream


def test_rows_mix_greedy_and_sampled_settings(params):
    prompts = _prompts([4, 6], seed=8)
    greedy = generate(CFG, params, prompts, max_new_tokens=8)
    gen = Generator(CFG, params, **SHARED)
    mixed = gen.result(gen.decode(gen.prefill(prompts, sampling=[SamplingConfig(), HOT], seeds=[1, 2])))
    np.testing.assert_array_equal(mixed.tokens[0], greedy.tokens[0])
    hot = Generator(CFG, params, sampling=HOT, **SHARED)
    alone = hot.result(hot.decode(hot.prefill(prompts[1:], seeds=[2])))
    np.testing.assert_array_equal(mixed.tokens[1], alone.tokens[0])


def test_one_seed_for_a_call_gives_each_prompt_its_own_stream(params):
    same = [_prompts([5], seed=9)[0]] * 2
    out = generate(CFG, params, same, max_new_tokens=12, temperature=1.5, seed=4)
    assert not np.array_equal(out.tokens[0], out.tokens[1])  # folded with the prompt's index
    np.testing.assert_array_equal(out.tokens, generate(CFG, params, same, max_new_tokens=12, temperature=1.5,
                                                       seed=4).tokens)


def test_sampled_decode_resumes_bit_identically(params):
    prompts = _prompts([4, 6], seed=10)
    gen = Generator(CFG, params, sampling=HOT, seed=3, **SHARED)
    whole = gen.result(gen.decode(gen.prefill(prompts)))
    state = gen.prefill(prompts)
    for _ in range(3):
        state = gen.decode(state, steps=3)
    np.testing.assert_array_equal(gen.result(state).tokens, whole.tokens)


def test_forks_sample_their_own_streams(params):
    gen = Generator(CFG, params, sampling=SamplingConfig(temperature=1.5), **SHARED)
    state = gen.fork(gen.prefill(_prompts([6], seed=11)), 2)
    out = gen.result(gen.decode(state))
    assert not np.array_equal(out.tokens[0], out.tokens[1])


@pytest.mark.parametrize("kwargs, message", [
    ({"seeds": [1]}, "prefill seeds=[1] is invalid: must hold one entry per prompt (2)"),
    ({"seeds": [1, 2.5]}, "seeds=[1, 2.5] is invalid: each seed must be an integer"),
    ({"sampling": [HOT]}, "must hold one entry per prompt (2)"),
    ({"sampling": [HOT, {"temperature": 1.0}]}, "each entry must be a lcx.SamplingConfig"),
])
def test_bad_per_row_settings_are_refused(params, kwargs, message):
    gen = Generator(CFG, params, max_new_tokens=2)
    with pytest.raises(ConfigError) as err:
        gen.prefill(_prompts([3, 4]), **kwargs)
    assert message in str(err.value)


@pytest.mark.slow
def test_server_samples_a_request_as_the_generator_does_alone(params):
    from lcx.engine.server import Server

    prompts = _prompts([5, 7, 6], seed=12)
    server = Server(CFG, params, max_num_seqs=2, max_len=32, segment=4)
    ids = [server.submit(p, max_new_tokens=8, sampling=HOT, seed=20 + i) for i, p in enumerate(prompts)]
    greedy_id = server.submit(prompts[0], max_new_tokens=8)
    out = server.run()
    gen = Generator(CFG, params, sampling=HOT, **SHARED)
    for i, p in enumerate(prompts):
        alone = gen.result(gen.decode(gen.prefill([p], seeds=[20 + i])))
        assert out[ids[i]] == alone.tokens[0].tolist()
    assert out[greedy_id] == generate(CFG, params, prompts[:1], max_new_tokens=8).tokens[0].tolist()
