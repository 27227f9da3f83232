"""The decoder with ``attention.impl="pallas"`` against ``"reference"``: logits, gradients, and a cached decode step."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from lcx.cache.kv_cache import init_cache
from lcx.config import AttentionConfig, ModelConfig
from lcx.model import Decoder, init_params
import pytest

pytestmark = pytest.mark.pallas


def _config(impl: str) -> ModelConfig:
    return ModelConfig(vocab_size=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96,
                       attention=AttentionConfig(impl=impl))


def _setup():
    cfg = _config("reference")
    params = init_params(cfg, jax.random.key(0))
    # Larger weights than the init so attention is far from uniform and a wrong kernel shows in the logits.
    params = jax.tree.map(lambda p: p * 8.0 if p.ndim == 3 else p, params)
    ids = jax.random.randint(jax.random.key(1), (2, 37), 0, cfg.vocab_size)
    return cfg, params, ids


@pytest.mark.slow
def test_model_logits_pallas_equal_reference():
    cfg, params, ids = _setup()
    run = lambda c: jax.jit(lambda p, x: Decoder(c).apply({"params": p}, x))(params, ids)  # noqa: E731
    ref = run(cfg)
    got = run(dataclasses.replace(cfg, attention=AttentionConfig(impl="pallas")))
    assert got.shape == (2, 37, 128)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_model_gradients_pallas_equal_reference():
    cfg, params, ids = _setup()

    def grads(c):
        def loss(p):
            logits = Decoder(c).apply({"params": p}, ids[:, :-1])
            return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), ids[:, 1:, None], axis=-1))

        return jax.jit(jax.grad(loss))(params)

    ref = grads(cfg)
    got = grads(dataclasses.replace(cfg, attention=AttentionConfig(impl="pallas")))
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(ref)):
        assert jnp.isfinite(g).all(), path
        scale = float(jnp.max(jnp.abs(r)))  # q/k gradients are ~1e-3 here: compare relative to each leaf's size
        assert scale > 0 and float(jnp.max(jnp.abs(g - r))) <= 1e-4 * scale, (jax.tree_util.keystr(path), scale)


@pytest.mark.slow
def test_model_cached_decode_step_pallas_equals_reference():
    # Prefill 20 tokens into a cache with 2 evicted slots (holes), then one decode step: the pallas model uses
    # decode_attention for it.
    cfg, params, ids = _setup()

    def step(c):
        cache = init_cache(c, batch=2, capacity=32)
        _, cache = Decoder(c).apply({"params": params}, ids[:, :20], cache=cache)
        cache = cache.replace(valid=cache.valid.at[:, :, 3].set(False).at[:, 1, 11].set(False))
        logits, _ = Decoder(c).apply({"params": params}, ids[:, 20:21], cache=cache)
        return logits

    ref = jax.jit(lambda: step(cfg))()
    got = jax.jit(lambda: step(dataclasses.replace(cfg, attention=AttentionConfig(impl="pallas"))))()
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-4, rtol=1e-4)
