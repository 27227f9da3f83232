"""Logit parity with Hugging Face transformers (torch CPU, float32) on random-weight checkpoints."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import lcx
from lcx import hf
from tests.conftest import hf_logits, random_hf_model

pytestmark = pytest.mark.parity


def _lcx_logits(path, ids):
    config, params = hf.load_hf(path)
    return config, np.asarray(jax.jit(lcx.Decoder(config).apply)({"params": params}, jnp.asarray(ids, jnp.int32)))


def assert_logits_close(actual, expected, rel=1e-4):
    """Max abs error within ``rel`` of the logits' scale (elementwise rtol is meaningless near zero)."""
    scale = float(np.max(np.abs(expected)))
    err = float(np.max(np.abs(actual - expected)))
    assert err <= rel * scale, f"max |lcx - hf| = {err:.3g} > {rel} x logit scale {scale:.3g}"


def _ids(batch, seq, vocab=128, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, size=(batch, seq))


CASES = {
    "llama_gqa": ("llama", {}),
    "llama_mha_tied_bias": ("llama", {"num_key_value_heads": 4, "tie_word_embeddings": True,
                                      "attention_bias": True}),
    "qwen2_bias_mqa": ("qwen2", {"num_key_value_heads": 1}),
    "mistral": ("mistral", {"head_dim": 32}),
    "rope_linear": ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}}),
    "rope_dynamic_beyond_max": ("llama", {"max_position_embeddings": 16,
                                          "rope_parameters": {"rope_type": "dynamic", "factor": 2.0,
                                                              "rope_theta": 10000.0}}),
    "rope_yarn": ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 8.0, "rope_theta": 10000.0,
                                                "original_max_position_embeddings": 16}}),
    "rope_yarn_no_truncate_mscale": ("llama", {"rope_parameters": {
        "rope_type": "yarn", "factor": 4.0, "rope_theta": 50000.0, "original_max_position_embeddings": 16,
        "truncate": False, "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16.0, "beta_slow": 2.0}}),
    "rope_llama3": ("llama", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 500000.0,
                                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                  "original_max_position_embeddings": 16}}),
    "rope_longrope_long": ("llama", {"max_position_embeddings": 64, "rope_parameters": {
        "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 16,
        "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [1.5 + 0.5 * i for i in range(8)]}}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_hf_parity_logits(case, tmp_path):
    family, overrides = CASES[case]
    model = random_hf_model(family, **overrides)
    model.save_pretrained(tmp_path)
    seq = 40  # longer than the 16-token original context of the scaled-rope cases
    ids = _ids(2, seq)
    config, ours = _lcx_logits(tmp_path, ids)
    assert ours.dtype == np.float32 and ours.shape == (2, seq, 128)
    assert_logits_close(ours, hf_logits(model, ids))


def test_hf_parity_longrope_short_branch(tmp_path):
    family, overrides = CASES["rope_longrope_long"]
    model = random_hf_model(family, **overrides)
    model.save_pretrained(tmp_path)
    ids = _ids(1, 12)  # within the original context: short factors
    _, ours = _lcx_logits(tmp_path, ids)
    assert_logits_close(ours, hf_logits(model, ids))


def test_hf_parity_ntk_matches_default_with_enlarged_base(tmp_path):
    """transformers has no static NTK type; lcx's ``ntk`` must equal default RoPE with base b * s^(d/(d-2))."""
    import dataclasses

    model = random_hf_model("llama")
    model.save_pretrained(tmp_path)
    config, params = hf.load_hf(tmp_path)
    ntk = dataclasses.replace(config, rope=lcx.RopeConfig(type="ntk", theta=10000.0, factor=4.0))
    hf.save_hf(ntk, params, tmp_path / "ntk")
    saved = json.loads((tmp_path / "ntk" / "config.json").read_text())["rope_parameters"]
    d = config.head_dim
    assert saved["rope_type"] == "default"
    assert saved["rope_theta"] == pytest.approx(10000.0 * 4.0 ** (d / (d - 2)))
    import transformers

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ntk", attn_implementation="eager")
    ids = _ids(2, 24)
    ours = np.asarray(lcx.Decoder(ntk).apply({"params": params}, jnp.asarray(ids, jnp.int32)))
    assert_logits_close(ours, hf_logits(reloaded, ids))


@pytest.mark.parametrize("case", ["llama_gqa", "qwen2_bias_mqa", "rope_yarn", "rope_llama3"])
def test_hf_save_roundtrip_transformers_loads(case, tmp_path):
    import transformers

    family, overrides = CASES[case]
    model = random_hf_model(family, **overrides)
    model.save_pretrained(tmp_path / "src")
    config, params = hf.load_hf(tmp_path / "src")
    hf.save_hf(config, params, tmp_path / "out")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager")
    assert type(reloaded).__name__ == type(model).__name__
    ids = _ids(2, 30)
    assert_logits_close(hf_logits(reloaded, ids), hf_logits(model, ids), rel=1e-6)
    again, params2 = hf.load_hf(tmp_path / "out")
    assert again == config
    jax.tree.map(np.testing.assert_array_equal, params, params2)


def test_hf_save_sharded_roundtrip(tmp_path):
    model = random_hf_model("llama")
    model.save_pretrained(tmp_path / "src")
    config, params = hf.load_hf(tmp_path / "src")
    hf.save_hf(config, params, tmp_path / "out", max_shard_bytes=20_000)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    _, params2 = hf.load_hf(tmp_path / "out")
    jax.tree.map(np.testing.assert_array_equal, params, params2)


def test_hf_legacy_config_layout_loads(tmp_path):
    """Released Llama 3.x / Qwen2 configs: top-level rope_theta and rope_scaling {"type" or "rope_type", ...}."""
    model = random_hf_model("llama", rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 500000.0,
                                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 16})
    model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    rope["type"] = rope.pop("rope_type")  # the oldest spelling
    cfg["rope_scaling"] = rope
    cfg["torch_dtype"] = cfg.pop("dtype", "float32")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    config, ours = _lcx_logits(tmp_path, _ids(1, 40))
    assert config.rope.type == "llama3" and config.rope.theta == 500000.0
    assert config.rope.original_max_position_embeddings == 16
    assert_logits_close(ours, hf_logits(model, _ids(1, 40)))


def test_hf_legacy_qwen2_rope_scaling_yarn(tmp_path):
    model = random_hf_model("qwen2", rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                                                      "original_max_position_embeddings": 16})
    model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = rope
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    config, ours = _lcx_logits(tmp_path, _ids(1, 40))
    assert config.rope.type == "yarn" and config.rope.theta == 1e6 and config.qkv_bias and not config.o_bias
    assert_logits_close(ours, hf_logits(model, _ids(1, 40)))
