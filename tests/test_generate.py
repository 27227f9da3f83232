"""The decoding engine: cache arithmetic, prefill/decode parity, ragged batches, sampling, EOS, capacity errors."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lcx
from lcx.cache import init_cache, kv_bytes
from lcx.config import CacheConfig, ConfigError
from lcx.engine import CacheCapacityError, Generator, generate

CFG = lcx.ModelConfig(vocab_size=97, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96, init_std=0.1)


@pytest.fixture(scope="module")
def params():
    return lcx.init_params(CFG, jax.random.key(0))


def _prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, CFG.vocab_size, n).tolist() for n in lengths]


@pytest.mark.parametrize("dtype, itemsize", [("fp32", 4), ("bf16", 2), ("fp16", 2)])
def test_cache_memory_is_exactly_the_kv_formula(dtype, itemsize):
    cache = init_cache(CFG, batch=3, capacity=40, dtype=dtype)
    expected = 2 * CFG.n_layers * CFG.n_kv_heads * CFG.head_dim * 40 * itemsize * 3
    assert cache.kv_bytes() == expected == kv_bytes(CFG, 40, 3, dtype)
    assert cache.k.dtype == jnp.dtype({"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype])
    # metadata: position (int32), live flag (bool) and policy score (fp32) per slot, counts and lengths
    assert cache.metadata_bytes() == CFG.n_layers * 3 * 40 * (4 + 1 + 4) + CFG.n_layers * 3 * 4 + 3 * 4
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))
    assert total == cache.kv_bytes() + cache.metadata_bytes()


def test_generate_decode_logits_equal_full_forward(params):
    prompt = _prompts([7])[0]
    gen = Generator(CFG, params, max_new_tokens=6, cache=CacheConfig(prefill_chunk=4))
    state = gen.prefill([prompt])
    step_logits = [np.asarray(state.logits[0])]
    for _ in range(6):
        state = gen.decode(state, steps=1)
        step_logits.append(np.asarray(state.logits[0]))
    tokens = np.asarray(state.tokens[0])
    full = np.asarray(lcx.Decoder(CFG).apply({"params": params}, jnp.asarray([prompt + tokens.tolist()])))[0]
    for i, logits in enumerate(step_logits):  # logits after prompt + i generated tokens
        np.testing.assert_allclose(logits, full[len(prompt) - 1 + i], atol=1e-5, rtol=1e-5)
    # and greedy picked the argmax of each
    np.testing.assert_array_equal(tokens, np.argmax(np.stack(step_logits[:6]), axis=-1))


def test_generate_chunked_prefill_equals_one_chunk(params):
    prompts = _prompts([13, 5, 9])
    a = generate(CFG, params, prompts, max_new_tokens=5, cache=CacheConfig(prefill_chunk=4))
    b = generate(CFG, params, prompts, max_new_tokens=5, cache=CacheConfig(prefill_chunk=64))
    np.testing.assert_array_equal(a.tokens, b.tokens)


@pytest.mark.slow
def test_generate_ragged_batch_rows_equal_rows_alone(params):
    prompts = _prompts([3, 11, 6])
    batch = generate(CFG, params, prompts, max_new_tokens=8, cache=CacheConfig(prefill_chunk=4))
    for i, p in enumerate(prompts):
        alone = generate(CFG, params, [p], max_new_tokens=8, cache=CacheConfig(prefill_chunk=4))
        np.testing.assert_array_equal(batch.tokens[i], alone.tokens[0])


def test_generate_sampling_reproducible_for_a_seed(params):
    prompts = _prompts([4, 6])
    kw = dict(max_new_tokens=10, temperature=0.9, top_k=20, top_p=0.95)
    a = generate(CFG, params, prompts, seed=1, **kw)
    b = generate(CFG, params, prompts, seed=1, **kw)
    c = generate(CFG, params, prompts, seed=2, **kw)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert not np.array_equal(a.tokens, c.tokens)
    # a row sampled in a batch gets the same stream as alone
    alone = generate(CFG, params, prompts[:1], seed=1, **kw)
    np.testing.assert_array_equal(a.tokens[0], alone.tokens[0])


def test_generate_stops_at_eos_and_pads(params):
    prompts = _prompts([5, 8])
    free = generate(CFG, params, prompts, max_new_tokens=8)
    eos = int(free.tokens[0, 2])  # make row 0's third greedy token the EOS
    out = generate(CFG, params, prompts, max_new_tokens=8, eos_id=eos)
    first = int(np.argmax(free.tokens[0] == eos))
    assert out.lengths[0] == first + 1
    np.testing.assert_array_equal(out.tokens[0, : first + 1], free.tokens[0, : first + 1])
    assert np.all(out.tokens[0, first + 1:] == eos)
    if eos not in free.tokens[1]:
        assert out.lengths[1] == 8
        np.testing.assert_array_equal(out.tokens[1], free.tokens[1])


def test_generate_array_prompt_and_list_prompt_agree(params):
    prompts = _prompts([6, 6])
    a = generate(CFG, params, np.asarray(prompts), max_new_tokens=4)
    b = generate(CFG, params, prompts, max_new_tokens=4)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert a.tokens.shape == (2, 4) and a.tokens.dtype == np.int32


def test_generate_full_cache_beyond_budget_is_refused_before_running(params):
    with pytest.raises(CacheCapacityError) as err:
        generate(CFG, params, _prompts([100]), max_new_tokens=50, cache=CacheConfig(budget=128))
    msg = str(err.value)
    assert "needs 150 tokens per sequence" in msg and "cache.budget=128" in msg
    assert f"{kv_bytes(CFG, 150, 1, 'float32') / 1024:.2f} KiB" in msg
    assert "policy='streaming'" in msg


def test_generate_memory_limit_is_checked_before_running(params):
    with pytest.raises(CacheCapacityError, match=r"more than cache.max_bytes=10000 .* at most \d+ tokens fit"):
        generate(CFG, params, _prompts([30]), max_new_tokens=10, cache=CacheConfig(max_bytes=10_000))


@pytest.mark.parametrize("kwargs, message", [
    ({"max_new_tokens": 0}, "max_new_tokens=0 is invalid"),
    ({"max_new_tokens": 3, "temperature": -1.0}, "temperature=-1.0 is invalid"),
    ({"max_new_tokens": 3, "top_p": 1.5}, "top_p=1.5 is invalid"),
    ({"max_new_tokens": 3, "top_k": 0}, "top_k=0 is invalid"),
])
def test_generate_bad_arguments(params, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        generate(CFG, params, _prompts([3]), **kwargs)


def test_generate_bad_prompts(params):
    with pytest.raises(ConfigError, match="no empty prompt"):
        generate(CFG, params, [[1, 2], []], max_new_tokens=2)
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        generate(CFG, params, [[1, 200]], max_new_tokens=2)


def test_generate_cache_dtype_bf16_close_to_fp32(params):
    prompts = _prompts([9])
    gen = Generator(CFG, params, max_new_tokens=1, cache=CacheConfig(dtype="bf16"))
    state = gen.prefill(prompts)
    ref = Generator(CFG, params, max_new_tokens=1).prefill(prompts)
    assert state.cache.k.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(state.logits), np.asarray(ref.logits), atol=0.05)


@pytest.mark.slow
def test_generate_bfloat16_model_batched_long_prefill_close_to_fp32(params):
    # A bfloat16 model, batch 2, 256-token prompts: the shape at which XLA:CPU once picked a bf16 x bf16 -> f32 dot
    # it cannot run for the attention's value product ("Unsupported element type for DotThunk") and crashed.
    bf16 = dataclasses.replace(CFG, dtype="bfloat16", param_dtype="bfloat16")
    prompts = _prompts([256, 256], seed=3)
    state = Generator(bf16, jax.tree.map(lambda x: x.astype(jnp.bfloat16), params), max_new_tokens=1).prefill(prompts)
    ref = Generator(CFG, params, max_new_tokens=1).prefill(prompts)
    assert state.cache.k.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(state.logits), np.asarray(ref.logits), atol=0.05)


def test_generate_xla_and_reference_attention_agree(params):
    prompts = _prompts([5, 9])
    xla = dataclasses.replace(CFG, attention=lcx.AttentionConfig(impl="xla"))
    a = Generator(xla, params, max_new_tokens=4)
    b = Generator(CFG, params, max_new_tokens=4)
    sa, sb = a.decode(a.prefill(prompts)), b.decode(b.prefill(prompts))
    np.testing.assert_allclose(np.asarray(sa.logits), np.asarray(sb.logits), atol=1e-4)


def test_generate_score_equals_full_forward_log_probs(params):
    ids = np.random.default_rng(5).integers(0, CFG.vocab_size, (2, 20))
    with pytest.raises(CacheCapacityError, match="scoring 12 tokens needs 20 cache slots"):
        short = Generator(CFG, params, max_new_tokens=1)
        short.score(short.prefill(ids[:, :8]), ids[:, 8:])
    gen = Generator(CFG, params, max_new_tokens=12)
    state = gen.prefill(ids[:, :8])
    _, logprobs = gen.score(state, ids[:, 8:])
    full = jax.nn.log_softmax(lcx.Decoder(CFG).apply({"params": params}, jnp.asarray(ids)))
    expected = np.take_along_axis(np.asarray(full[:, 7:-1]), ids[:, 8:, None], axis=-1)[..., 0]
    np.testing.assert_allclose(logprobs, expected, atol=1e-5)


def test_greedy_equals_argmax_on_ties_infinities_and_nans():
    """The two-reduction greedy pick is jnp.argmax exactly: the first maximum, the first NaN of a row with one."""
    from lcx.engine.sampling import greedy

    rng = np.random.default_rng(0)
    x = rng.integers(-3, 4, (64, 257)).astype(np.float32)  # many ties
    x[1] = -np.inf
    x[2, 7] = x[2, 100] = np.inf
    x[3, 50] = x[3, 9] = np.nan
    x[4] = np.nan
    x = jnp.asarray(x)
    got = jax.jit(greedy)(x)
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(got, jnp.argmax(x, axis=-1))
    np.testing.assert_array_equal(got[:5], [np.argmax(np.asarray(x[0])), 0, 7, 9, 0])
