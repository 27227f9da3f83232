"""Self-speculative decoding with compressed-KV drafts (issue 64): greedy tokens equal plain decoding's for every
draft the engine derives, rows are independent of their batch, sampling keeps the target distribution (a two-sample
test that tells the draft's own distribution apart), rejected drafts are forgotten exactly, and bad settings get
one clear error."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as scipy_stats

import lcx
from lcx.cache.kv_cache import full_kind
from lcx.config import CacheConfig, ConfigError
from lcx.engine.spec_generator import SpeculativeGenerator
from lcx.engine.sampling import RowSampling, filter_rows
from lcx.engine.speculative import AUTO_MIN_CONTEXT, SpeculativeConfig, accept_greedy, row_probs

CFG = lcx.ModelConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, init_std=0.1)
LENGTHS = (40, 25, 60, 33)
NEW = 24
# every way a draft is derived: keys re-rotated by rank (streaming), statistics gathered while prefilling under the
# draft policy (TOVA; SnapKV, per KV head, in fp8 codes), 8-bit codes of every token (int8), grouped 4-bit codes
# whose float window a rejection sets back (int4: groups of 8 behind a 4-token residual, flushed every few drafts)
DRAFTS = {
    "int4": CacheConfig(kv_dtype="int4", kv_group=8, kv_residual=4),
    "streaming": CacheConfig(policy="streaming", budget=16, sinks=2, interval=8),
    "tova": CacheConfig(policy="tova", budget=16, interval=8),
    "int8": CacheConfig(kv_dtype="int8"),
    "snapkv-fp8": CacheConfig(policy="snapkv", budget=16, window=4, interval=8, kv_dtype="fp8"),
}


@pytest.fixture(scope="module")
def params():
    return lcx.init_params(CFG, jax.random.key(0))


def _prompts(lengths=LENGTHS, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, CFG.vocab_size, n).tolist() for n in lengths]


@pytest.fixture(scope="module")
def plain(params):
    return lcx.generate(CFG, params, _prompts(), max_new_tokens=NEW, eos_id=7)


@pytest.mark.parametrize("name", sorted(DRAFTS))
def test_greedy_tokens_equal_plain_decoding(params, plain, name):
    """EOS 7 stops some rows early: the emitted run is cut there, as plain decoding stops."""
    result = lcx.generate(CFG, params, _prompts(), max_new_tokens=NEW, eos_id=7,
                          speculative=SpeculativeConfig(draft=DRAFTS[name], k=3, min_context=0))
    np.testing.assert_array_equal(result.tokens, plain.tokens)
    np.testing.assert_array_equal(result.lengths, plain.lengths)
    stats = result.speculative
    assert np.all(stats.accepted <= stats.drafted)
    np.testing.assert_array_equal(stats.verifications > 0, plain.lengths > 1)  # a first token at EOS: no verification
    assert 1.0 <= stats.acceptance <= 4.0
    assert 0 < stats.draft_bytes < result.cache_bytes  # the draft reads less than the full cache
    if name == "int8":  # as good as the target: all k accepted at almost every verification, so the bonus token
        assert stats.accept_rate > 0.9  # and the 2-token catch-up of the draft run on most iterations


@pytest.mark.parametrize("name", ["streaming"])  # one draft: the adaptive path is the loop's, not the policy's
def test_adaptive_k_keeps_the_tokens_and_drafts_less(params, plain, name):
    """``confidence``: rows stop drafting where the draft is unsure (tokens still plain decoding's) and, on this
    random model, draft fewer tokens per verification than k."""
    fixed = lcx.generate(CFG, params, _prompts(), max_new_tokens=NEW, eos_id=7,
                         speculative=SpeculativeConfig(draft=DRAFTS[name], k=4, min_context=0))
    result = lcx.generate(CFG, params, _prompts(), max_new_tokens=NEW, eos_id=7,
                          speculative=SpeculativeConfig(draft=DRAFTS[name], k=4, min_context=0, confidence=0.3))
    np.testing.assert_array_equal(result.tokens, plain.tokens)
    np.testing.assert_array_equal(result.lengths, plain.lengths)
    adaptive, always = result.speculative, fixed.speculative
    assert np.all(adaptive.drafted <= 4 * adaptive.verifications)
    assert adaptive.drafted.sum() / adaptive.verifications.sum() < 4.0
    assert adaptive.accept_rate > always.accept_rate  # the drafts it skips were the unsure ones


def test_each_row_generates_what_it_generates_alone(params):
    """Greedy and sampled rows in one batch, with a policy that evicts per KV head while decoding: a sampled row's
    and a greedy row's tokens (and acceptance) are the ones each gets alone."""
    spec = SpeculativeConfig(draft=CacheConfig(policy="snapkv", budget=16, window=4, interval=8), k=3)
    prompts = _prompts()
    seeds = [11, 12, 13, 14]
    sampling = [lcx.SamplingConfig(temperature=t) for t in (0.0, 1.0, 0.0, 0.7)]
    gen = SpeculativeGenerator(CFG, params, max_new_tokens=NEW, speculative=spec, eos_id=7)
    batch, batch_stats = gen.generate(prompts, seeds=seeds, sampling=sampling)
    for i in (1, 2):  # a sampled row and a greedy one, each alone (every prompt length compiles its own prefill)
        alone, stats = gen.generate([prompts[i]], seeds=[seeds[i]], sampling=[sampling[i]])
        np.testing.assert_array_equal(batch.tokens[i], alone.tokens[0], err_msg=f"row {i}")
        assert batch_stats.accepted[i] == stats.accepted[0]


# ----------------------------------------------------------------------------------------------- sampling
SMALL = lcx.ModelConfig(vocab_size=6, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, init_std=0.5)
ROWS = 1500


def _pairs(tokens: np.ndarray) -> np.ndarray:
    """Counts of (token 1, token 2) per row: the joint distribution past the first token, which both samplers draw
    from the prefill's logits the same way."""
    index = tokens[:, 1] * SMALL.vocab_size + tokens[:, 2]
    return np.bincount(index, minlength=SMALL.vocab_size ** 2)


def _same_distribution(a: np.ndarray, b: np.ndarray) -> float:
    keep = (a + b) > 0
    return scipy_stats.chi2_contingency(np.stack([a[keep], b[keep]]))[1]


def test_sampling_keeps_the_target_distribution():
    """Speculative sampling against plain sampling over 1,500 rows: indistinguishable (chi-square p > 0.001), while
    sampling from the draft cache alone - what accepting every draft would give - is told apart (p < 0.001)."""
    params = lcx.init_params(SMALL, jax.random.key(1))
    prompt = np.random.default_rng(2).integers(0, SMALL.vocab_size, 48).tolist()
    prompts = [prompt] * ROWS
    draft = CacheConfig(policy="streaming", budget=4, sinks=1, interval=8)
    kw = dict(max_new_tokens=3, temperature=1.0, seed=5)
    plain = lcx.generate(SMALL, params, prompts, **kw).tokens
    spec = lcx.generate(SMALL, params, prompts, speculative=SpeculativeConfig(draft=draft, k=2, min_context=0),
                        **kw).tokens
    alone = lcx.generate(SMALL, params, prompts, cache=draft, **kw).tokens
    assert _same_distribution(_pairs(plain), _pairs(spec)) > 1e-3
    adaptive = lcx.generate(SMALL, params, prompts, speculative=SpeculativeConfig(
        draft=draft, k=2, min_context=0, confidence=0.4), **kw)  # some rows stop after one draft, some do not
    assert 1 < adaptive.speculative.drafted.sum() / adaptive.speculative.verifications.sum() < 2
    assert _same_distribution(_pairs(plain), _pairs(adaptive.tokens)) > 1e-3
    assert _same_distribution(_pairs(plain), _pairs(alone)) < 1e-3  # the test can fail


def test_draft_and_target_distributions_are_the_samplers_own():
    """``row_probs`` keeps exactly the tokens the sampler can draw: each row's top-k / top-p set at its temperature."""
    logits = jax.random.normal(jax.random.key(0), (3, 2, 50)) * 3
    rows = RowSampling.build([lcx.SamplingConfig(temperature=0.7, top_k=5), lcx.SamplingConfig(temperature=1.3,
                              top_p=0.6), lcx.SamplingConfig(temperature=1.0)], np.zeros((3, 2), np.uint32))
    probs = row_probs(logits, jax.tree.map(jnp.asarray, rows))
    t = np.asarray(rows.temperature)[:, None, None]
    expected = filter_rows((logits / t).reshape(6, 50), jnp.repeat(rows.top_k, 2), jnp.repeat(rows.top_p, 2))
    np.testing.assert_allclose(probs, jax.nn.softmax(expected, axis=-1).reshape(3, 2, 50), rtol=1e-6)
    assert np.all(np.sum(np.asarray(probs[0]) > 0, axis=-1) == 5)


def test_accept_greedy_takes_the_agreeing_prefix_and_the_targets_token():
    logits = jax.nn.one_hot(jnp.asarray([[3, 5, 2, 4], [1, 1, 1, 0]]), 8)  # the target's argmax per position
    drafts = jnp.asarray([[3, 5, 9], [2, 1, 1]])
    accepted, nxt = accept_greedy(logits, drafts)
    np.testing.assert_array_equal(accepted, [2, 0])
    np.testing.assert_array_equal(nxt, [2, 1])


# ----------------------------------------------------------------------------------------------- rollback
def test_truncate_forgets_the_newest_tokens_exactly(params):
    """A full cache that read 20 + 5 tokens and forgot the last 5 decodes as one that read 20."""
    kind = full_kind(CFG)
    gen = lcx.Generator(CFG, params, max_new_tokens=8, unroll=False)
    ids = _prompts((25, 25), seed=3)
    prefix = [p[:20] for p in ids]
    longer = gen.prefill(ids).cache
    shorter = gen.prefill(prefix).cache
    cut = kind.truncate(longer, jnp.asarray([20, 20], jnp.int32))
    np.testing.assert_array_equal(cut.count, shorter.count)
    np.testing.assert_array_equal(cut.lengths, [20, 20])
    slots = shorter.capacity
    for name in ("pos", "valid"):
        np.testing.assert_array_equal(getattr(cut, name)[..., :slots], getattr(shorter, name))
        assert not np.any(getattr(cut, name)[..., slots:] > 0)
    token = jnp.asarray([[3], [4]], jnp.int32)
    forward = jax.jit(lambda cache: lcx.Decoder(CFG).apply({"params": params}, token, cache=cache)[0])
    after_cut, after_fresh = forward(cut), forward(shorter)  # the next token sees the same context
    np.testing.assert_allclose(after_cut, after_fresh, rtol=1e-5, atol=1e-6)
    split = kind.truncate(longer.split_layers(), jnp.asarray([20, 20], jnp.int32)).stack_layers()
    for name in ("pos", "valid", "count", "lengths"):
        np.testing.assert_array_equal(getattr(split, name), getattr(cut, name))


@pytest.mark.parametrize("name", ["int4", "streaming"])
def test_a_draft_of_an_8_bit_target_is_derived_from_its_values(params, name):
    """The target's int8 codes are dequantized before the draft encodes (or un-rotates) them: tokens equal plain
    int8 decoding, and the draft accepts about as well as it does for the float target."""
    cache = CacheConfig(kv_dtype="int8")
    spec = SpeculativeConfig(draft=DRAFTS[name], k=3, min_context=0)
    plain8 = lcx.generate(CFG, params, _prompts(), max_new_tokens=NEW, eos_id=7, cache=cache)
    got = lcx.generate(CFG, params, _prompts(), max_new_tokens=NEW, eos_id=7, cache=cache, speculative=spec)
    np.testing.assert_array_equal(got.tokens, plain8.tokens)
    floats = lcx.generate(CFG, params, _prompts(), max_new_tokens=NEW, eos_id=7, speculative=spec)
    assert got.speculative.acceptance >= floats.speculative.acceptance - 0.5


@pytest.mark.parametrize("kv_dtype", ["int4", "int2"])
def test_truncate_sets_a_grouped_window_back(params, kv_dtype):
    """Grouped codes (KIVI, ``lcx.cache.lowbit_slots``): a cache that read 36 tokens in groups of 16 and forgot the
    last few reads its first slots as before, and holds what one that read only the prefix holds - the same window
    where no group was flushed by the forgotten tokens' writes (36 -> 33); where one was (36 -> 30) the window moves
    back to slot 16 and that group comes back dequantized, within its quantization step of the prefix's floats."""
    from lcx.cache import lowbit_slots
    gen = lcx.Generator(CFG, params, max_new_tokens=8, cache=CacheConfig(kv_dtype=kv_dtype, kv_group=16),
                        unroll=False)
    ids = _prompts((36, 36), seed=4)
    longer = gen.prefill(ids).cache
    kind, fmt = longer.kind, longer.kind.storage
    floats = lambda c, n: [np.asarray(x[..., :n, :]) for x in lowbit_slots.float_layers(c, fmt, jnp.float32)]  # noqa
    for n, moved in ((33, False), (30, True)):
        shorter = gen.prefill([p[:n] for p in ids]).cache
        for cut in (kind.truncate(longer, jnp.full((2,), n, jnp.int32)),
                    kind.truncate(longer.split_layers(), jnp.full((2,), n, jnp.int32)).stack_layers()):
            np.testing.assert_array_equal(cut.count, shorter.count)
            quantized = lowbit_slots.quantized_slots(cut.count, fmt)
            np.testing.assert_array_equal(quantized, np.full(quantized.shape, 16 if moved else 32))
            for got, before, want in zip(floats(cut, n), floats(longer, n), floats(shorter, n)):
                np.testing.assert_allclose(got, before, rtol=1e-6, atol=1e-7)  # the slots it keeps read the same
                step = max(np.max(np.asarray(longer.k_scale, np.float32)), np.max(np.asarray(longer.v_scale)))
                assert np.max(np.abs(got - want)) <= step  # the prefix's own cache, up to one quantization step
                if moved:  # the dequantized group is no longer the prefix's float window
                    assert np.max(np.abs(got[..., 16:, :] - want[..., 16:, :])) > 0


# ----------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("kwargs, message", [
    (dict(draft=CacheConfig(), k=4), "holds as much as its target"),
    (dict(draft=CacheConfig(policy="streaming", budget=8), k=0), "speculative.k=0 is invalid"),
    (dict(draft=CacheConfig(policy="streaming", budget=8), k=17), "must be an integer in [1, 16]"),
    (dict(draft=CacheConfig(policy="streaming", budget=8, layout="paged"), k=2),
     "speculative.draft.layout='paged' is invalid"),
    (dict(draft="streaming", k=2), "speculative.draft='streaming' is invalid"),
    (dict(draft=CacheConfig(policy="streaming", budget=8, interval=1), k=2), "speculative.draft.interval=1"),
    (dict(draft=CacheConfig(policy="streaming", budget=8), min_context=-1), "speculative.min_context=-1 is invalid"),
    (dict(draft=CacheConfig(policy="streaming", budget=8), confidence=1.0), "speculative.confidence=1.0 is invalid"),
])
def test_bad_settings_are_refused_at_construction(kwargs, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        SpeculativeConfig(**kwargs)


def test_bad_pairings_are_refused_before_anything_runs(params):
    spec = SpeculativeConfig(draft=CacheConfig(policy="streaming", budget=16, sinks=2, interval=8), k=2)
    with pytest.raises(ConfigError, match="holds the whole prompt"):
        lcx.generate(CFG, params, [[1] * 10], max_new_tokens=4, speculative=spec)
    with pytest.raises(ConfigError, match="the target must keep every token"):
        lcx.generate(CFG, params, [[1] * 40], max_new_tokens=4, speculative=spec,
                     cache=CacheConfig(policy="streaming", budget=16))
    with pytest.raises(ConfigError, match="speculative decoding runs on one device"):
        lcx.generate(CFG, params, [[1] * 40], max_new_tokens=4, speculative=spec, mesh=object())
    with pytest.raises(ConfigError, match="speculative.nope is not a key"):
        SpeculativeConfig.from_mapping({"draft": {"policy": "streaming", "budget": 8}, "nope": 1})


# ----------------------------------------------------------------------------------------------- surfaces
def test_text_api_and_cli_give_plain_decodings_text(tmp_path, capsys):
    """``lm.generate(texts, speculative=...)`` (a dict, its draft given as a compression) and ``lcx generate
    --speculative-draft`` print what plain decoding prints."""
    from tests.tiny_chat_model import write_model

    from lcx.cli import main

    folder = write_model(tmp_path / "model")
    lm = lcx.load(str(folder))
    texts = ["and again and again, here we go " * 6, "Say hi, user and assistant: " * 5]
    plain = lm.generate(texts, max_new_tokens=12)
    for draft in ({"policy": "snapkv", "compression": 0.75, "window": 4},
                  {"policy": "kvzip", "compression": 0.5}):  # KVzip: its repeat prompt from this tokenizer
        spec = {"draft": draft, "k": 3, "min_context": 0}
        assert lm.generate(texts, max_new_tokens=12, speculative=spec) == plain, draft["policy"]
    argv = ["generate", "--model", str(folder), "--prompt", texts[0], "--max-new-tokens", "12"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert main(argv + ["--speculative-draft", "streaming", "--speculative-param", "budget=16",
                        "--speculative-param", "sinks=2", "--speculative-k", "3",
                        "--speculative-min-context", "0", "--speculative-confidence", "0.3"]) == 0
    captured = capsys.readouterr()
    assert captured.out == printed
    assert "tokens per verification" in captured.err
    assert main(argv + ["--speculative-draft", "full"]) == 2
    assert "holds as much as its target" in capsys.readouterr().err
    assert main(argv + ["--speculative-draft", "streaming", "--speculative-param", "budget=16",
                        "--speculative-min-context", "100000"]) == 0  # too short to pay: decoded plainly
    captured = capsys.readouterr()
    assert captured.out == printed and "decodes plainly" in captured.err


def test_prompts_too_short_to_pay_decode_plainly(params, plain):
    """``min_context``: below it ``lcx.generate`` is plain decoding (``.speculative`` None); ``auto`` takes the
    platform's length - never on a CPU, where no measured context paid."""
    draft = DRAFTS["streaming"]
    short = lcx.generate(CFG, params, _prompts(), max_new_tokens=NEW, eos_id=7,
                         speculative=SpeculativeConfig(draft=draft, k=3, min_context=61))
    assert short.speculative is None
    np.testing.assert_array_equal(short.tokens, plain.tokens)
    auto = SpeculativeConfig(draft=draft)
    assert not auto.pays(prompt=10 ** 6, platform="cpu")
    least = AUTO_MIN_CONTEXT["gpu"]
    assert auto.pays(prompt=least, platform="gpu") and not auto.pays(prompt=least - 1, platform="gpu")
    assert SpeculativeConfig(draft=draft, min_context=0).pays(prompt=1, platform="cpu")
    by_default = lcx.generate(CFG, params, _prompts(), max_new_tokens=NEW, eos_id=7,
                              speculative=SpeculativeConfig(draft=draft, k=3))
    assert (by_default.speculative is None) == (jax.default_backend() == "cpu")


def test_plan_sizes_the_draft_beside_the_cache(tmp_path, capsys):
    """``lcx plan --speculative-draft``: the draft's bytes as the generator sizes it (budget + interval slots)."""
    import json

    from lcx.cli import main

    path = tmp_path / "m.yaml"
    path.write_text("model: {vocab_size: 61, d_model: 32, n_layers: 2, n_heads: 4, n_kv_heads: 2, d_ff: 64}\n")
    argv = ["plan", str(path), "--context", "4096", "--batch", "8", "--gpu-mem", "1GiB", "--json",
            "--speculative-draft", "streaming", "--speculative-param", "budget=256", "--speculative-param", "sinks=4"]
    assert main(argv) == 0
    draft = CacheConfig(policy="streaming", budget=256, sinks=4).kind(CFG)
    assert json.loads(capsys.readouterr().out)["speculative_draft_bytes"] == draft.nbytes(8, 256 + 64)
    assert main(argv[:-6] + ["--speculative-param", "budget=256"]) == 2
    assert "--speculative-param needs --speculative-draft" in capsys.readouterr().err
