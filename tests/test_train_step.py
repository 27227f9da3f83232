"""The train step: masked loss, gradient accumulation and remat equivalence, mixed precision, the optimizer."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lcx.config import AttentionConfig, ModelConfig
from lcx.data import BatchSource, make_task
from lcx.model.decoder import Decoder, abstract_params
from lcx.train import TrainConfig, init_state, initial_params, lr_schedule, make_optimizer, train_step
from lcx.train.optim import decay_mask
from lcx.train.step import token_loss

MODEL = ModelConfig(vocab_size=260, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64,
                    max_position_embeddings=64, attention=AttentionConfig(impl="xla"), init_std=0.05)


def _batch(seq_len=32, batch_size=4, prompt_loss_weight=0.0):
    task = make_task("mqar", {"num_pairs": 3, "num_queries": 2})
    return BatchSource(task, seq_len=seq_len, batch_size=batch_size, seed=0, prompt_loss_weight=prompt_loss_weight)(0)


def test_train_step_loss_is_mean_over_masked_tokens():
    params = initial_params(MODEL, None, 0)
    batch = _batch(prompt_loss_weight=0.25)
    logits = jax.jit(lambda p, x: Decoder(MODEL).apply({"params": p}, x))(params, batch["inputs"])
    logits = np.asarray(logits, np.float64)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0]
    w, answer = batch["weights"], batch["answer"]
    assert set(np.unique(w)) == {0.0, 0.25, 1.0} and np.array_equal(answer, w == 1.0)
    expected = (nll * w).sum() / w.sum()
    loss, stats = jax.jit(functools.partial(token_loss, MODEL))(params, batch, jnp.float32(w.sum()))
    np.testing.assert_allclose(float(loss), expected, rtol=1e-5)
    np.testing.assert_allclose(float(stats[0]), (nll * answer).sum(), rtol=1e-5)  # answer-only nll
    correct = (logits.argmax(-1) == batch["targets"]) * answer
    assert float(stats[1]) == correct.sum()


def _one_step(model, train, params, batch):
    optimizer = make_optimizer(train)
    step = jax.jit(functools.partial(train_step, model=model, grad_accum=train.grad_accum, optimizer=optimizer,
                                     schedule=lr_schedule(train)))
    return step(init_state(params, optimizer, 0), batch)


@pytest.mark.slow
def test_train_step_grad_accum_and_remat_match_full_batch():
    params = initial_params(MODEL, None, 0)
    batch = _batch(prompt_loss_weight=0.1)
    train = TrainConfig(steps=10, batch_size=4, seq_len=32, lr=1e-3, compute_dtype="float32", grad_clip=None)
    full, m_full = _one_step(MODEL, train, params, batch)
    accum, m_accum = _one_step(dataclasses.replace(MODEL, remat=True),
                               dataclasses.replace(train, grad_accum=2), params, batch)
    np.testing.assert_allclose(m_accum["loss"], m_full["loss"], rtol=1e-5)
    np.testing.assert_allclose(m_accum["grad_norm"], m_full["grad_norm"], rtol=1e-4)
    np.testing.assert_allclose(m_accum["accuracy"], m_full["accuracy"], rtol=1e-6)
    np.testing.assert_allclose(m_accum["answer_loss"], m_full["answer_loss"], rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), accum.params, full.params)
    assert int(full.step) == 1 and float(m_full["lr"]) == pytest.approx(1e-3 / max(train.warmup_steps, 1))


def test_optim_schedule_warmup_then_cosine_to_floor():
    train = TrainConfig(steps=100, warmup_steps=10, lr=1e-2, min_lr_ratio=0.1)
    lr = lr_schedule(train)
    np.testing.assert_allclose([float(lr(s)) for s in (0, 4, 9)], [1e-3, 5e-3, 1e-2], rtol=1e-6)
    np.testing.assert_allclose(float(lr(10)), 1e-2, rtol=1e-6)
    np.testing.assert_allclose(float(lr(55)), 1e-3 + 0.5 * 9e-3, rtol=1e-5)
    np.testing.assert_allclose([float(lr(100)), float(lr(500))], [1e-3, 1e-3], rtol=1e-6)
    values = [float(lr(s)) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_optim_weight_decay_skips_norms_and_biases():
    mask = decay_mask(abstract_params(dataclasses.replace(MODEL, qkv_bias=True)))
    assert mask["embed"] and mask["lm_head"] and mask["layers"]["attn"]["q"] and mask["layers"]["mlp"]["up"]
    assert not mask["final_norm"]["scale"] and not mask["layers"]["attn_norm"]["scale"]
    assert not mask["layers"]["attn"]["q_bias"]
