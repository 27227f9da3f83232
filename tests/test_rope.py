"""RoPE frequencies and attention factors against transformers' own rope init functions."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lcx.config import ModelConfig, RopeConfig
from lcx.model.rope import apply_rope, inv_freq_and_factor, inv_freq_for_length, rope_tables

transformers = pytest.importorskip("transformers")
pytest.importorskip("torch")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

pytestmark = pytest.mark.parity

HEAD_DIM = 64
MAX_POS = 4096

TYPES = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 4096},
    "yarn_no_truncate": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048,
                         "truncate": False},
    "yarn_mscale": {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                    "mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 24.0, "beta_slow": 2.0},
    "yarn_attention_factor": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 1024,
                              "attention_factor": 1.3},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 1024},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 1024, "factor": 4.0,
                 "short_factor": [1.0 + 0.05 * i for i in range(32)],
                 "long_factor": [1.0 + 0.5 * i for i in range(32)]},
}


def _hf_config(params: dict, theta: float, partial: float = 1.0):
    rope = dict(params, rope_theta=theta)
    if partial != 1.0:
        rope["partial_rotary_factor"] = partial
    return transformers.LlamaConfig(hidden_size=HEAD_DIM * 4, num_attention_heads=4, head_dim=HEAD_DIM,
                                    max_position_embeddings=MAX_POS, rope_parameters=rope)


def _ours(params: dict, theta: float, partial: float = 1.0) -> RopeConfig:
    fields = {k: (tuple(v) if isinstance(v, list) else v) for k, v in params.items() if k != "rope_type"}
    return RopeConfig(type=params["rope_type"], theta=theta, partial_rotary_factor=partial, **fields)


@pytest.mark.parametrize("name", sorted(TYPES))
@pytest.mark.parametrize("seq_len", [None, 1000, 3 * MAX_POS])
def test_rope_inv_freq_matches_transformers(name, seq_len):
    params = TYPES[name]
    theta = 500000.0 if name == "llama3" else 10000.0
    hf_inv, hf_m = ROPE_INIT_FUNCTIONS[params["rope_type"]](_hf_config(params, theta), None, seq_len=seq_len)
    inv, m = inv_freq_and_factor(_ours(params, theta), HEAD_DIM, MAX_POS, seq_len=seq_len)
    np.testing.assert_allclose(inv, hf_inv.numpy(), rtol=5e-7)  # within a few float32 ulps
    assert m == pytest.approx(hf_m, rel=1e-12)
    # The scaled frequencies really differ from the default ones (the test can fail).
    default, _ = inv_freq_and_factor(RopeConfig(theta=theta), HEAD_DIM, MAX_POS)
    if not (name == "dynamic" and (seq_len or 0) <= MAX_POS):
        assert np.max(np.abs(inv - default) / default) > 1e-3


@pytest.mark.parametrize("name", ["linear", "yarn", "llama3"])
def test_rope_partial_rotary_factor_matches_transformers(name):
    params = TYPES[name]
    hf_inv, _ = ROPE_INIT_FUNCTIONS[params["rope_type"]](_hf_config(params, 10000.0, 0.5), None)
    inv, _ = inv_freq_and_factor(_ours(params, 10000.0, 0.5), HEAD_DIM // 2, MAX_POS)
    assert inv.shape == (HEAD_DIM // 4,)
    np.testing.assert_allclose(inv, hf_inv.numpy(), rtol=5e-7)  # within a few float32 ulps


def test_rope_ntk_equals_dynamic_at_the_matching_length():
    # static NTK base b * s^(d/(d-2)) is dynamic NTK at T where s*T/M - (s-1) = s, i.e. T = M (2s - 1) / s
    s = 2.0
    hf_inv, _ = ROPE_INIT_FUNCTIONS["dynamic"](_hf_config({"rope_type": "dynamic", "factor": s}, 10000.0), None,
                                              seq_len=int(MAX_POS * (2 * s - 1) / s))
    inv, m = inv_freq_and_factor(RopeConfig(type="ntk", factor=s), HEAD_DIM, MAX_POS)
    np.testing.assert_allclose(inv, hf_inv.numpy(), rtol=5e-7)  # within a few float32 ulps
    assert m == 1.0


@pytest.mark.parametrize("seq_len", [100, MAX_POS, 3 * MAX_POS, 64 * MAX_POS])
def test_rope_dynamic_traced_length_matches_transformers(seq_len):
    """One compiled function serves every length: the traced frequencies equal transformers' per-length ones."""
    cfg = ModelConfig(vocab_size=8, d_model=256, n_layers=1, n_heads=4, n_kv_heads=4, d_ff=8,
                      max_position_embeddings=MAX_POS, rope=RopeConfig(type="dynamic", factor=4.0))
    traced = jax.jit(lambda n: inv_freq_for_length(cfg, n))(jnp.int32(seq_len))
    hf_inv, _ = ROPE_INIT_FUNCTIONS["dynamic"](_hf_config(TYPES["dynamic"], 10000.0), None, seq_len=seq_len)
    np.testing.assert_allclose(np.asarray(traced), hf_inv.numpy(), rtol=1e-6)


def test_rope_tables_use_the_sequence_length_for_dynamic():
    cfg = ModelConfig(vocab_size=8, d_model=256, n_layers=1, n_heads=4, n_kv_heads=4, d_ff=8,
                      max_position_embeddings=MAX_POS, rope=RopeConfig(type="dynamic", factor=4.0))
    short_cos, _ = rope_tables(cfg, jnp.arange(10)[None])
    long_cos, _ = rope_tables(cfg, jnp.arange(3 * MAX_POS)[None])
    # same position 9, but the long sequence rescales the base
    assert not np.allclose(np.asarray(short_cos[0, 9]), np.asarray(long_cos[0, 9]))
    inv, _ = inv_freq_and_factor(cfg.rope, HEAD_DIM, MAX_POS, seq_len=10)
    np.testing.assert_allclose(np.asarray(short_cos[0, 9, : HEAD_DIM // 2]), np.cos(9 * inv), atol=1e-6)


def test_rope_apply_rotates_half_split_pairs_and_keeps_norm():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(1, 3, 2, 8)), jnp.float32)
    cos = jnp.cos(jnp.full((1, 3, 8), 0.3))
    sin = jnp.sin(jnp.full((1, 3, 8), 0.3))
    y = np.asarray(apply_rope(x, cos, sin))
    xn = np.asarray(x)
    # pair (i, i + d/2) is a 2-D rotation by the angle
    np.testing.assert_allclose(y[..., 0], xn[..., 0] * math.cos(0.3) - xn[..., 4] * math.sin(0.3), rtol=1e-6)
    np.testing.assert_allclose(y[..., 4], xn[..., 4] * math.cos(0.3) + xn[..., 0] * math.sin(0.3), rtol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(xn, axis=-1), rtol=1e-6)


def test_rope_partial_leaves_tail_untouched():
    x = jnp.asarray(np.random.default_rng(1).normal(size=(1, 2, 1, 8)), jnp.float32)
    cos = jnp.cos(jnp.full((1, 2, 4), 1.0))
    sin = jnp.sin(jnp.full((1, 2, 4), 1.0))
    y = apply_rope(x, cos, sin)
    np.testing.assert_array_equal(np.asarray(y[..., 4:]), np.asarray(x[..., 4:]))
    assert not np.allclose(np.asarray(y[..., :4]), np.asarray(x[..., :4]))


def test_rope_registry_one_entry_serves_config_tables_and_hf_export():
    """A scaling type registered from outside lcx is validated by the config, used by the RoPE tables and written
    to config.json by its registry entry alone."""
    from lcx.hf import config_to_hf
    from lcx.model import rope_scaling

    @rope_scaling.register("halved_base", required=("factor",), hf_fields=("factor",), hf_name="linear")
    def _halved(rope, dim, max_pos, original, seq_len):
        return rope_scaling.base_inv_freq(rope.theta, dim) / rope.factor, 1.0

    try:
        with pytest.raises(Exception, match="rope.factor is required for rope.type='halved_base'"):
            RopeConfig(type="halved_base")
        cfg = ModelConfig(vocab_size=8, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=8,
                          rope=RopeConfig(type="halved_base", factor=2.0))
        linear = ModelConfig(vocab_size=8, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=8,
                             rope=RopeConfig(type="linear", factor=2.0))
        positions = jnp.arange(12)[None]
        for got, want in zip(rope_tables(cfg, positions), rope_tables(linear, positions)):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert config_to_hf(cfg)["rope_parameters"] == {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
    finally:
        rope_scaling._REGISTRY.pop("halved_base")
