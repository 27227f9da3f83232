"""Gemma 2 / Gemma 3 / Qwen3 / Mistral with a sliding window against transformers (random weights, prompts longer
than the window, generation crossing it), and the families' parameter tables against the model code."""

from __future__ import annotations

import jax
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from lcx import hf
from lcx.config import CacheConfig, ConfigError
from lcx.engine import Generator
from lcx.model import families
from lcx.model.decoder import abstract_params
from tests.conftest import hf_logits, random_hf_model

WINDOW = 8
SLIDING, FULL = "sliding_attention", "full_attention"
CASES = {
    "qwen3": ("qwen3", {"num_hidden_layers": 2}),
    "mistral_window": ("mistral", {"sliding_window": WINDOW}),
    # Gemma 2: local / global alternating, both soft-caps, a query scale other than head_dim
    "gemma2": ("gemma2", {"num_hidden_layers": 2, "attn_logit_softcapping": 4.0, "final_logit_softcapping": 3.0,
                          "query_pre_attn_scalar": 24, "hidden_activation": "gelu_pytorch_tanh"}),
    # Gemma 3: two local layers then a global one, each type with its own RoPE (the global one scaled)
    "gemma3": ("gemma3", {"num_hidden_layers": 3, "layer_types": [SLIDING, SLIDING, FULL],
                          "rope_parameters": {SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
                                              FULL: {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}}}),
}


def _model(case: str):
    family, overrides = CASES[case]
    return random_hf_model(family, std=0.15, eos_token_id=None, bos_token_id=None, pad_token_id=None,
                           max_position_embeddings=128, **overrides)


def _rel(ours, ref) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


@pytest.mark.slow
@pytest.mark.parity
@pytest.mark.parametrize("case", sorted(CASES))
def test_families_logits_tokens_and_roundtrip_equal_transformers(case, tmp_path):
    """Logits of a 3x-window prompt (rel <= 1e-4), greedy tokens of a generation 4x the window (chunked prefill and
    decode through the cache, whose sliding-window layers keep window - 1 + interval slots: evicting every 4 steps),
    the parameter count, and save_hf -> transformers."""
    import torch
    import transformers

    model = _model(case)
    model.save_pretrained(tmp_path / "hf")
    config, params = hf.load_hf(tmp_path / "hf")
    assert config.family == CASES[case][0]
    assert config.num_params() == model.num_parameters()

    ids = np.random.default_rng(0).integers(0, 128, (2, 3 * WINDOW))
    from lcx.model.decoder import Decoder

    ours = np.asarray(jax.jit(Decoder(config).apply)({"params": params}, ids))
    ref = hf_logits(model, ids)
    assert _rel(ours, ref) <= 1e-4, _rel(ours, ref)

    prompt = np.random.default_rng(1).integers(0, 128, (2, 11))
    n_new, interval = 4 * WINDOW, 4
    with torch.no_grad():
        expected = model.generate(torch.as_tensor(prompt), max_new_tokens=n_new, min_new_tokens=n_new,
                                  do_sample=False, pad_token_id=0)[:, prompt.shape[1]:].numpy()
    gen = Generator(config, params, max_new_tokens=n_new, cache=CacheConfig(prefill_chunk=4, interval=interval))
    state = gen.decode(gen.prefill(prompt))
    np.testing.assert_array_equal(np.asarray(state.tokens), expected)
    assert len(set(expected[0].tolist())) > 3  # a non-degenerate continuation, so equality means something
    n_local = config.types.count("sliding_attention")
    full = 2 * config.n_layers * 2 * config.n_kv_heads * config.head_dim * (11 + n_new) * 4  # every layer, all tokens
    if n_local:  # device KV of the local layers: window - 1 + interval slots, while the sequence is 43 long
        local = state.cache.loc
        assert local.k.shape == (n_local, 2, config.n_kv_heads, WINDOW - 1 + interval, config.head_dim)
        assert int(np.max(np.asarray(local.count))) <= WINDOW - 1 + interval
        glob_slots = (config.n_layers - n_local) * (11 + n_new)
        assert state.cache.kv_bytes() == full * (glob_slots + n_local * (WINDOW - 1 + interval)) // (
            config.n_layers * (11 + n_new))
    assert gen.result(state).cache_bytes == state.cache.kv_bytes() <= full
    if case == "gemma3":
        # the scanned decoder: one layer of each group per scan step, the spec switch picks
        scanned = Generator(config, params, max_new_tokens=n_new, unroll=False,
                            cache=CacheConfig(prefill_chunk=4, interval=interval))
        np.testing.assert_array_equal(np.asarray(scanned.decode(scanned.prefill(prompt)).tokens), expected)
        # an eviction policy on the global layer: it holds budget + interval slots, the local ones their window's
        small = Generator(config, params, max_new_tokens=n_new,
                          cache=CacheConfig(policy="streaming", budget=16, sinks=2, interval=interval))
        cache = small.decode(small.prefill(prompt)).cache
        # (no prefill_chunk given: the local layers' room is a window, so prompts are not prefilled 4 at a time)
        assert cache.glob.k.shape[3] == 16 + interval and cache.loc.k.shape[3] == WINDOW - 1 + WINDOW
        assert int(np.max(np.asarray(cache.glob.count))) <= 16 + interval

    hf.save_hf(config, params, tmp_path / "lcx")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "lcx", attn_implementation="eager")
    np.testing.assert_allclose(hf_logits(again.eval(), ids), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", sorted(CASES))
def test_families_tables_declare_the_model_code_shapes(case):
    """The one parameter table per family (load, save, num_params) and the shapes the Flax modules declare agree."""
    family, overrides = CASES[case]
    hf_cfg = {"architectures": [families.FAMILIES[family].architecture], "model_type": family,
              "vocab_size": 96, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "sliding_window": WINDOW}
    hf_cfg.update({k: v for k, v in overrides.items() if k not in ("num_hidden_layers", "layer_types")})
    config = hf.config_from_hf(hf_cfg)
    declared = {jax.tree_util.keystr(p): tuple(a.shape)
                for p, a in jax.tree_util.tree_flatten_with_path(abstract_params(config))[0]}
    table = {jax.tree_util.keystr(tuple(jax.tree_util.DictKey(k) for k in t.path)): t.shape
             for t in families.global_tensors(config)}
    table |= {jax.tree_util.keystr(tuple(jax.tree_util.DictKey(k) for k in ("layers", *t.path))):
              (config.n_layers, *t.shape) for t in families.layer_tensors(config)}
    assert declared == table


@pytest.mark.parametrize("changes, message", [
    ({"layer_types": ["full_attention", "local"]}, "model.layer_types[1]='local'"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "model.sliding_window is required"),
    ({"layer_types": ["full_attention"]}, "model.layer_types has 1 entries"),
    ({"attn_softcap": 0.0}, "model.attn_softcap=0.0"),
    ({"family": "gpt2"}, "model.family='gpt2'"),
])
def test_families_config_errors_name_the_field(changes, message):
    from lcx.model.config import ModelConfig

    base = dict(vocab_size=32, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=32)
    with pytest.raises(ConfigError) as err:
        ModelConfig(**base, **changes)
    assert message in str(err.value)


@pytest.mark.slow
def test_families_training_gradients_through_windows_and_caps_equal_the_reference():
    """A Gemma-2-shaped model (local / global layers, window 8, both soft-caps, QK-norm off) trained on packed
    documents: the loss gradients through the XLA path (blocked attention with window, cap and segments) equal the
    fp32 reference's. (The Pallas kernels' window / cap gradients: tests/kernels/test_kernels_spec.py.)"""
    import dataclasses

    import jax.numpy as jnp

    from lcx.model.config import AttentionConfig, ModelConfig
    from lcx.model.decoder import Decoder, init_params

    base = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, head_dim=8,
                       family="gemma2", layer_types=("sliding_attention", "full_attention"), sliding_window=8,
                       attn_softcap=3.0, final_softcap=5.0, query_scale=12.0, init_std=0.3)
    params = init_params(base, jax.random.key(0))
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, 64, (2, 32)))
    segments = jnp.asarray(np.repeat([[0] * 20 + [1] * 12, [0] * 9 + [1] * 23], 1, axis=0))
    positions = jnp.where(segments == 0, jnp.arange(32), jnp.arange(32) - jnp.argmax(segments, axis=1)[:, None])

    def loss(params, impl):
        cfg = dataclasses.replace(base, attention=AttentionConfig(impl))
        logits = Decoder(cfg).apply({"params": params}, ids[:, :-1], positions=positions[:, :-1],
                                    segment_ids=segments[:, :-1])
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1))

    want = jax.grad(loss)(params, "reference")
    got = jax.jit(jax.grad(loss), static_argnums=1)(params, "xla")
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6, err_msg=jax.tree_util.keystr(path))


@pytest.mark.slow
def test_families_teacher_forcing_through_the_bounded_cache_equals_one_forward_pass():
    """``Generator.score`` (what perplexity runs) on a Gemma-3-shaped model, 50 tokens after a 10-token prompt with
    the local layers keeping window - 1 + room slots (evicting as it goes; room: the interval with 4-token prefill
    chunks, else a window), under the full policy, under StreamingLLM whose budget holds every token and under the
    memory tier recalling every block (on the global layer): the log-probabilities of one forward pass."""
    from lcx.model.config import ModelConfig, RopeConfig
    from lcx.model.decoder import Decoder, init_params

    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=48, head_dim=8,
                      family="gemma3", layer_types=("sliding_attention", "sliding_attention", "full_attention"),
                      sliding_window=WINDOW, query_scale=12.0, local_rope=RopeConfig(theta=100.0), init_std=0.3)
    params = init_params(cfg, jax.random.key(0))
    ids = np.random.default_rng(0).integers(0, 64, (2, 60))
    logp = jax.nn.log_softmax(jax.jit(Decoder(cfg).apply)({"params": params}, ids)[:, 9:-1])
    want = np.take_along_axis(np.asarray(logp), ids[:, 10:, None], axis=-1)[..., 0]
    memory = CacheConfig(policy="memory", sinks=2, window=8, block=4, topk=64, interval=4)  # recalls every block
    for cache, local_slots in ((CacheConfig(interval=4, prefill_chunk=4), WINDOW - 1 + 4),
                               (CacheConfig(policy="streaming", budget=100, sinks=2, interval=4), WINDOW - 1 + WINDOW),
                               (memory, WINDOW - 1 + WINDOW)):
        gen = Generator(cfg, params, max_new_tokens=50, cache=cache)
        state, logprobs = gen.score(gen.prefill(ids[:, :10]), ids[:, 10:])
        np.testing.assert_allclose(np.asarray(logprobs), want, atol=2e-5)
        assert state.cache.loc.k.shape[3] == local_slots
    # the memory tier served the global layer: most of the context went to its long-term blocks
    assert int(state.cache.glob.n_blocks.max()) * 4 >= 40
