"""Teacher forcing in chunks (``Generator.score``) gives the log-probabilities of one token per step, for every
policy family: the chunks follow the cache's eviction schedule and accumulate the same attention statistics.
Also the prefill's automatic chunk size."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import lcx
from lcx.cache.base import round_chunk
from lcx.cache.kv_cache import SlotCacheKind
from lcx.cache.memory.kind import MemoryKind
from lcx.engine import Generator, auto_prefill_chunk

CFG = lcx.ModelConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                      max_position_embeddings=512)
POLICIES = {  # budget 24 + interval 8: the 40-token prompt is compressed while it streams in, then every 8 tokens
    "full": {},
    "streaming": dict(policy="streaming", budget=24, sinks=4),  # keys rotated by cache rank
    "ladder": dict(policy="ladder", budget=24, sinks=2, span=1, overlap=0, recent=4),
    "h2o": dict(policy="h2o", budget=24),  # summed attention, a keep set per KV head
    "observed": dict(policy="observed", budget=24, heads="shared"),
    "snapkv": dict(policy="snapkv", budget=24, window=4, head_budget="adaptive"),
    "tova": dict(policy="tova", budget=24),  # the last query's attention replaces the score
    # the memory tier: blocks spill between chunks, every query routes and recalls on its own
    "memory": dict(policy="memory", sinks=2, window=8, block=4, topk=2, prefill_chunk=16),
    "memory local infllm device": dict(policy="memory", sinks=2, window=8, block=4, topk=2, prefill_chunk=16,
                                       positions="local", router="infllm", store="device"),
    "memory two-level": dict(policy="memory", sinks=2, window=8, block=4, topk=2, prefill_chunk=16, route_groups=2,
                             route_candidates=1, route_heads="shared"),
}
SLOT_FIELDS = ("pos", "valid", "count")
MEMORY_FIELDS = ("pos", "valid", "count", "n_blocks", "recalled", "recalls", "skips", "recent_n")


@pytest.fixture(scope="module")
def params():
    return lcx.init_params(CFG, jax.random.key(1))


@pytest.mark.slow
@pytest.mark.parametrize("policy", list(POLICIES))
def test_score_in_chunks_equals_one_token_per_step(policy, params, monkeypatch):
    rng = np.random.default_rng(0)
    prompt, tokens = rng.integers(0, 97, (2, 40)), rng.integers(0, 97, (2, 70))
    cache = lcx.CacheConfig(interval=8, **POLICIES[policy])
    gen = Generator(CFG, params, max_new_tokens=75, cache=cache)
    chunked_state, chunked = gen.score(gen.prefill(prompt), tokens)
    kind = type(gen.kind)
    monkeypatch.setattr(kind, "score_width", lambda self, n: None)  # the decode step, one token at a time
    other = Generator(CFG, params, max_new_tokens=75, cache=cache)  # its own request (a memory tier's own store)
    stepped_state, stepped = other.score(other.prefill(prompt), tokens)
    np.testing.assert_allclose(chunked, stepped, atol=1e-5)
    # The same tokens survive, in the same slots (the memory tier: the same blocks spilled and recalled).
    for name in MEMORY_FIELDS if kind is MemoryKind else SLOT_FIELDS:
        np.testing.assert_array_equal(getattr(chunked_state.cache, name), getattr(stepped_state.cache, name))
    np.testing.assert_allclose(chunked_state.logits, stepped_state.logits, atol=1e-5)
    # The last logits continue decoding as after the steps: a further segment scores the same.
    np.testing.assert_allclose(gen.score(chunked_state, tokens[:, :5])[1],
                               other.score(stepped_state, tokens[:, :5])[1], atol=1e-5)


@pytest.mark.slow
def test_score_in_chunks_fails_when_the_schedule_is_ignored(params, monkeypatch):
    """The equality above is not automatic: chunks wider than the room an eviction frees evict elsewhere, and a
    memory tier that routes a chunk once (as a prefill does) recalls other blocks than each step would."""
    rng = np.random.default_rng(0)
    prompt, tokens = rng.integers(0, 97, (2, 40)), rng.integers(0, 97, (2, 70))
    gen = Generator(CFG, params, max_new_tokens=70, cache=lcx.CacheConfig(interval=8, **POLICIES["h2o"]))
    monkeypatch.setattr(SlotCacheKind, "score_width", lambda self, n: 11)
    monkeypatch.setattr(SlotCacheKind, "score_room", lambda self, state: None)
    _, wrong = gen.score(gen.prefill(prompt), tokens)
    monkeypatch.setattr(SlotCacheKind, "score_width", lambda self, n: None)
    _, stepped = gen.score(gen.prefill(prompt), tokens)
    assert np.abs(wrong - stepped).max() > 1e-3
    monkeypatch.setattr(MemoryKind, "scoring", lambda self: self)
    # sinks=3: a kind no other test compiled (compiled steps are cached per kind, with the kind scoring() gave then)
    memory = lcx.CacheConfig(interval=8, **{**POLICIES["memory"], "sinks": 3})
    gen = Generator(CFG, params, max_new_tokens=70, cache=memory)
    _, pooled = gen.score(gen.prefill(prompt), tokens)
    monkeypatch.setattr(MemoryKind, "score_width", lambda self, n: None)
    gen = Generator(CFG, params, max_new_tokens=70, cache=memory)
    _, stepped = gen.score(gen.prefill(prompt), tokens)
    assert np.abs(pooled - stepped).max() > 1e-3


@pytest.mark.slow
def test_prefill_chunk_auto_is_one_call_with_little_padding(params):
    assert [round_chunk(n) for n in (5, 64, 65, 100, 1000, 2048, 2049, 3000)] == [8, 64, 80, 112, 1024, 2048, 2560,
                                                                                   3072]
    assert auto_prefill_chunk(CFG, 1, 2049) == 1280  # two chunks of 1,280 (2,560 tokens), not two of 2,048
    assert auto_prefill_chunk(CFG, 1, 300) == 320
    prompt = np.random.default_rng(2).integers(0, 97, (2, 90))
    auto = Generator(CFG, params, max_new_tokens=1).prefill(prompt)
    fixed = Generator(CFG, params, max_new_tokens=1, cache=lcx.CacheConfig(prefill_chunk=32)).prefill(prompt)
    np.testing.assert_allclose(auto.logits, fixed.logits, atol=1e-5)
    with pytest.raises(lcx.ConfigError, match=r"cache.prefill_chunk=0 is invalid.*positive integer or null"):
        lcx.CacheConfig(prefill_chunk=0)
