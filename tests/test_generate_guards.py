"""Generation guards (issue: run integrity): bad sampling inputs, out-of-vocabulary EOS, malformed prompts, positions
past the trained range, and requests that cannot fit in memory are refused or flagged before anything runs."""

from __future__ import annotations

import warnings

import jax
import numpy as np
import pytest

import lcx
from lcx.config import ConfigError
from lcx.engine import CacheCapacityError, Generator, PositionRangeWarning

CFG = lcx.ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64,
                      max_position_embeddings=32, attention=lcx.AttentionConfig("xla"))


@pytest.fixture(scope="module")
def params():
    return lcx.init_params(CFG, jax.random.key(0))


@pytest.mark.parametrize("kw,match", [
    ({"temperature": float("nan")}, r"temperature=nan is invalid: must be a finite number >= 0"),
    ({"temperature": float("inf")}, r"temperature=inf is invalid"),
    ({"temperature": -1.0}, r"temperature=-1.0 is invalid"),
    ({"top_p": float("nan")}, r"top_p=nan is invalid"),
    ({"top_k": 2.5}, r"top_k=2.5 is invalid"),
    ({"eos_id": 64}, r"eos_id=64 is invalid: must be a token id in \[0, 64\)"),
    ({"eos_id": -1}, r"eos_id=-1 is invalid"),
    ({"max_new_tokens": 1e9}, r"max_new_tokens=1000000000.0 is invalid: must be a positive integer"),
])
def test_bad_sampling_inputs_are_refused(params, kw, match):
    args = {"max_new_tokens": 4, **kw}
    with pytest.raises(ConfigError, match=match):
        lcx.generate(CFG, params, [[1, 2, 3]], **args)


@pytest.mark.parametrize("prompt,match", [
    ([1, 2, 3], r"prompt_ids is a flat list of 3 ids: expected a list of prompts.*wrap one prompt as \[ids\]"),
    ([[1.0, 2.0]], r"prompt_ids\[0\] holds 1.0 \(float\): token ids must be integers"),
    (np.array([1, 2, 3]), r"shape \(3,\).*one prompt of shape \[len\] is written ids\[None\]"),
    (np.array([[1.5, 2.0]]), r"dtype float64: expected a non-empty int array"),
    ("hello", r"prompt_ids='hello' is invalid: expected a list of token-id lists"),
    ([[]], r"no empty prompt"),
    ([[1, 99]], r"prompt token id 99 is outside the vocabulary \[0, 64\)"),
])
def test_malformed_prompts_are_refused(params, prompt, match):
    with pytest.raises(ConfigError, match=match):
        lcx.generate(CFG, params, prompt, max_new_tokens=2)


@pytest.mark.slow
def test_positions_past_the_trained_range_warn_or_fail_when_strict(params):
    long_prompt = [list(range(1, 31))]  # 30 + 8 new tokens > max_position_embeddings = 32
    # the check runs at prefill, before anything is compiled for decoding
    with pytest.warns(PositionRangeWarning, match=r"positions reach 38 .* past model.max_position_embeddings=32"):
        Generator(CFG, params, max_new_tokens=8).prefill(long_prompt)
    with pytest.raises(ConfigError, match=r"positions reach 38"):
        Generator(CFG, params, max_new_tokens=8, strict=True).prefill(long_prompt)
    with warnings.catch_warnings():  # an eviction policy or a RoPE scaling handles it: no warning
        warnings.simplefilter("error", PositionRangeWarning)
        Generator(CFG, params, max_new_tokens=8,
                  cache=lcx.CacheConfig(policy="streaming", budget=16, sinks=2)).prefill(long_prompt)
        Generator(CFG, params, max_new_tokens=8).prefill([[1, 2]])


def test_a_request_larger_than_host_memory_is_refused_with_the_bytes_needed(params):
    """The CPU backend reports no memory limit: the planner checks against host memory instead of letting XLA fail
    allocating it."""
    gen = Generator(CFG, params, max_new_tokens=10 ** 9, cache=lcx.CacheConfig())
    with pytest.raises(CacheCapacityError, match=r"the KV cache needs .* more than 90% of cpu memory less the "
                                                 r"weights = .*; at most \d+ tokens fit"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PositionRangeWarning)
            gen.prefill([[1, 2, 3]])
