"""The decoder on its own: shapes, dtypes, parameter declarations, numerics."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lcx
from lcx.model import abstract_params, init_params, param_axes

CFG = lcx.ModelConfig(vocab_size=97, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96, init_std=0.05)


def _ids(b, t, vocab=97, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, (b, t)), jnp.int32)


def _logits(cfg, params, ids, **kw):
    return lcx.Decoder(cfg).apply({"params": params}, ids, **kw)


def test_model_logits_shape_and_dtype():
    params = init_params(CFG, jax.random.key(0))
    out = _logits(CFG, params, _ids(3, 7))
    assert out.shape == (3, 7, 97) and out.dtype == jnp.float32


def test_model_params_are_plain_dict_with_declared_axes():
    params = init_params(CFG, jax.random.key(0))
    axes = param_axes(CFG)
    shapes = abstract_params(CFG)
    flat_p = jax.tree_util.tree_leaves_with_path(params)
    assert all(isinstance(v, jax.Array) for _, v in flat_p)
    spec_leaves = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    assert len(spec_leaves) == len(flat_p)
    for (path, value), spec, shape in zip(flat_p, spec_leaves, jax.tree.leaves(shapes)):
        assert len(spec) == value.ndim, path
        assert value.shape == shape.shape
    assert axes["layers"]["attn"]["q"] == jax.sharding.PartitionSpec("layers", "embed", "heads", "head_dim")
    assert axes["layers"]["attn"]["k"] == jax.sharding.PartitionSpec("layers", "embed", "kv_heads", "head_dim")
    assert params["layers"]["attn"]["q"].shape == (2, 64, 4, 16)
    assert sum(x.size for x in jax.tree.leaves(params)) == CFG.num_params()


@pytest.mark.parametrize("changes", [{"tie_embeddings": True}, {"qkv_bias": True, "o_bias": True},
                                     {"n_kv_heads": 1}, {"n_kv_heads": 4}])
def test_model_num_params_matches_declarations(changes):
    cfg = dataclasses.replace(CFG, **changes)
    assert sum(x.size for x in jax.tree.leaves(abstract_params(cfg))) == cfg.num_params()


def test_model_default_rope_is_relative():
    """With default RoPE the logits depend on relative positions only: shifting all positions changes nothing."""
    params = init_params(CFG, jax.random.key(1))
    ids = _ids(2, 9)
    pos = jnp.broadcast_to(jnp.arange(9), (2, 9))
    a = _logits(CFG, params, ids, positions=pos)
    b = _logits(CFG, params, ids, positions=pos + 1000)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-4)


def test_model_is_causal():
    params = init_params(CFG, jax.random.key(2))
    ids = _ids(1, 10)
    changed = ids.at[0, 6].set((ids[0, 6] + 1) % 97)
    a, b = _logits(CFG, params, ids), _logits(CFG, params, changed)
    np.testing.assert_array_equal(np.asarray(a[:, :6]), np.asarray(b[:, :6]))
    assert not np.allclose(np.asarray(a[:, 6:]), np.asarray(b[:, 6:]))


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["full", "dots", "dots_no_batch"])
def test_model_remat_same_logits_and_grads(policy):
    params = init_params(CFG, jax.random.key(3))
    ids = _ids(2, 8)
    remat = dataclasses.replace(CFG, remat=True, remat_policy=policy)

    def loss(p, cfg):
        return jnp.mean(jax.nn.log_softmax(_logits(cfg, p, ids))[..., 0])

    g1 = jax.grad(loss)(params, CFG)
    g2 = jax.grad(loss)(params, remat)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7),
                 g1, g2)


def test_model_bf16_compute_close_to_fp32():
    params = init_params(CFG, jax.random.key(4))
    ids = _ids(2, 16)
    ref = _logits(CFG, params, ids)
    bf16 = dataclasses.replace(CFG, dtype="bf16")
    out = _logits(bf16, params, ids)
    assert out.dtype == jnp.float32
    assert float(jnp.max(jnp.abs(out - ref))) < 0.05 * float(jnp.max(jnp.abs(ref)))


@pytest.mark.slow
def test_model_fp16_forward_4096_tokens_is_finite():
    cfg = dataclasses.replace(CFG, dtype="fp16", param_dtype="fp16", n_layers=1,
                              rope=lcx.RopeConfig(type="yarn", factor=4.0, original_max_position_embeddings=1024),
                              max_position_embeddings=4096)
    params = init_params(cfg, jax.random.key(5))
    assert params["layers"]["attn"]["q"].dtype == jnp.float16
    out = jax.jit(lambda p, i: _logits(cfg, p, i))(params, _ids(1, 4096))
    assert out.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(out)))


def test_model_rejects_bad_input_rank():
    params = init_params(CFG, jax.random.key(0))
    with pytest.raises(ValueError, match=r"input_ids must be \[batch, seq\]"):
        _logits(CFG, params, jnp.zeros((4,), jnp.int32))
