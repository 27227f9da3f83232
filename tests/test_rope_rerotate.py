"""Re-rotating dynamic NTK (``rope: {type: dynamic, factor: F, rerotate: true}``, issue 65): a cache that stores
keys before rotation and rotates every key with the current length's base gives what the whole sequence in one
pass gives (dynamic NTK as published), where the default cache - each key keeps the base of the chunk that wrote it,
as transformers' cache does - does not; and the settings it cannot serve are refused, naming the field."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lcx
from lcx.config import CacheConfig, ConfigError, RopeConfig

MAX_POS = 48
# one layer: the keys and values a cache holds are the tokens' own projections, so re-rotating them is all a one-pass
# forward does differently (deeper, the earlier tokens' hidden states were computed at their own time's base)
CFG = lcx.ModelConfig(vocab_size=61, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=64, init_std=0.1,
                      max_position_embeddings=MAX_POS, rope=RopeConfig(type="dynamic", factor=4.0, rerotate=True))
CACHED = dataclasses.replace(CFG, rope=RopeConfig(type="dynamic", factor=4.0))  # transformers' cached dynamic NTK
LENGTH, CHUNK = 150, 32  # three times the trained length, read 32 tokens at a time


@pytest.fixture(scope="module")
def params():
    return lcx.init_params(CFG, jax.random.key(0))


@pytest.fixture(scope="module")
def ids():
    return np.random.default_rng(0).integers(0, CFG.vocab_size, (2, LENGTH)).astype(np.int32)


def _one_pass(config, params, ids):
    """Logits ``[b, t, V]`` of the whole sequence in one call without a cache: every position at one base."""
    out = lcx.Decoder(config).apply({"params": params}, jnp.asarray(ids))
    return np.asarray(out[0] if isinstance(out, tuple) else out)


def test_chunked_scoring_equals_the_whole_sequence_in_one_pass(params, ids):
    """The last chunk's queries and every cached key at the base of length 150: the one pass's logits there. The
    default cache's first chunks were rotated at shorter lengths' bases, and its logits move away."""
    want = _one_pass(CFG, params, ids)
    got = {}
    for name, config in (("rerotate", CFG), ("cached", CACHED)):
        gen = lcx.Generator(config, params, max_new_tokens=1, cache=CacheConfig(prefill_chunk=CHUNK), unroll=False)
        logits = gen.prefill(ids).logits  # the last position's, after 5 chunks
        got[name] = np.asarray(logits)
    np.testing.assert_allclose(got["rerotate"], want[:, -1], rtol=2e-4, atol=2e-4)
    assert np.max(np.abs(got["cached"] - want[:, -1])) > 50 * np.max(np.abs(got["rerotate"] - want[:, -1]))


def test_greedy_decoding_equals_one_pass_per_step(params, ids):
    """Each decode step re-rotates the whole cache at the new length: every greedy token is the argmax of the one-pass
    logits of the sequence so far."""
    prompt = ids[:1, :100]
    out = lcx.generate(CFG, params, prompt, max_new_tokens=6, cache=CacheConfig(prefill_chunk=CHUNK))
    seq = prompt
    for _ in range(6):
        seq = np.concatenate([seq, _one_pass(CFG, params, seq)[:, -1:].argmax(-1).astype(np.int32)], axis=1)
    np.testing.assert_array_equal(out.tokens[0], seq[0, 100:])


def test_a_rope_variant_with_rerotate_parses_and_bad_settings_name_the_field():
    from lcx.eval.config import RopeVariant

    variant = RopeVariant.from_mapping({"name": "ntk-r", "type": "dynamic", "factor": 4.0, "rerotate": True},
                                       "ablate.ropes[0]")
    assert variant.apply(CACHED).rope == CFG.rope
    with pytest.raises(ConfigError, match="rope.rerotate=True is invalid with rope.type='yarn'"):
        RopeConfig(type="yarn", factor=4.0, rerotate=True)
    with pytest.raises(ConfigError, match="rope.rerotate"):
        RopeConfig(type="dynamic", factor=4.0, rerotate="yes")
    with pytest.raises(ConfigError, match="rope.rerotate=True with cache.policy='snapkv'"):
        CacheConfig(policy="snapkv", budget=32).kind(CFG)
    with pytest.raises(ConfigError, match="layout='paged'"):
        CacheConfig(layout="paged").kind(CFG)
    CacheConfig(policy="streaming", budget=32, positions="cache").kind(CFG)  # keys re-rotated by rank already
    from lcx.hf import config_to_hf
    with pytest.raises(ConfigError, match="no transformers config.json form"):
        config_to_hf(CFG)


def test_a_rows_rotations_never_depend_on_its_batch_mates(params, ids):
    """Each row re-rotates at its own length: a 150- and a 100-token prompt prefilled together give each row the
    logits it gets alone (transformers' cached dynamic NTK takes the batch's longest row instead)."""
    gen = lcx.Generator(CFG, params, max_new_tokens=1, cache=CacheConfig(prefill_chunk=CHUNK), unroll=False)
    prompts = [ids[0].tolist(), ids[1, :100].tolist()]
    together = np.asarray(gen.prefill(prompts).logits)
    for row, prompt in enumerate(prompts):
        alone = np.asarray(gen.prefill([prompt]).logits)[0]
        np.testing.assert_allclose(together[row], alone, rtol=1e-5, atol=1e-5)


def test_a_speculative_draft_of_a_rerotating_target_is_not_unrotated_twice(params, ids):
    """A rank-rotating draft (StreamingLLM, positions: cache) keeps its keys unrotated; the re-rotating target stores
    them so already. Inside the trained length both targets are raw RoPE, so the draft must accept as the cached
    one's does (un-rotating them again would turn them by minus their positions)."""
    from lcx.engine.speculative import SpeculativeConfig

    spec = SpeculativeConfig(draft=CacheConfig(policy="streaming", budget=16, sinks=2, interval=8), k=3,
                             min_context=0)
    prompts = ids[:, :36]
    runs = [lcx.generate(config, params, prompts, max_new_tokens=8, speculative=spec) for config in (CFG, CACHED)]
    np.testing.assert_array_equal(runs[0].tokens, runs[1].tokens)
    np.testing.assert_array_equal(runs[0].speculative.accepted, runs[1].speculative.accepted)


def test_a_padded_chunks_padding_does_not_grow_the_dynamic_base(params, ids):
    """Inside the trained length dynamic NTK is raw RoPE, even when a 36-token prompt is read in a chunk padded to
    64 positions (past the 48 trained): the length counts the real tokens only, as transformers counts them."""
    raw = dataclasses.replace(CFG, rope=RopeConfig())
    got = [np.asarray(lcx.Generator(c, params, max_new_tokens=1, cache=CacheConfig(prefill_chunk=64), unroll=False)
                      .prefill(ids[:, :36]).logits) for c in (CACHED, raw)]
    np.testing.assert_allclose(got[0], got[1], rtol=1e-5, atol=1e-5)


def test_the_default_decoder_is_the_scanned_one(params):
    """Rotating the whole cache each step costs the unrolled decoder more than the scanned one on XLA:CPU
    (docs/benchmarks.md): ``unroll=None`` picks the scanned decoder, even after another Generator kept an unrolled
    copy of the same weights; an explicit ``unroll=True`` is kept."""
    assert lcx.Generator(CACHED, params, max_new_tokens=1).unrolled  # the unrolled copy is kept for these weights
    assert not lcx.Generator(CFG, params, max_new_tokens=1).unrolled
    assert lcx.Generator(CFG, params, max_new_tokens=1, unroll=True).unrolled
