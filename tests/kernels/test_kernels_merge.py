"""Partial attentions merge exactly: attention over keys A u B equals the log-sum-exp merge of the attention over A
and over B (the residuals the decode and flash kernels return), including empty and fully masked parts."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lcx.kernels import (DecodeBlockSizes, backend, decode_attention, decode_attention_reference, flash_attention,
                         masked_attention_parts, merge_partials)

pytestmark = pytest.mark.pallas

HI = jax.lax.Precision.HIGHEST


def _qkv(b=2, t=1, s=48, h=4, kv=2, d=32, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (b, t, h, d), jnp.float32)
    k = jax.random.normal(ks[1], (b, s, kv, d), jnp.float32)
    v = jax.random.normal(ks[2], (b, s, kv, d), jnp.float32)
    return q, k, v


def _split_masks(b, s, seed):
    """A random live-slot mask and a random split of the slots into parts A and B; row 1 of A is empty."""
    rng = np.random.default_rng(seed)
    live = rng.random((b, s)) < 0.8
    in_a = rng.random((b, s)) < 0.5
    in_a[1] = False  # part A sees nothing in row 1
    return jnp.asarray(live), jnp.asarray(live & in_a), jnp.asarray(live & ~in_a)


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_merge_decode_parts_equals_whole(impl):
    q, k, v = _qkv(seed=1)
    q, k, v = q[:, 0], k.swapaxes(1, 2), v.swapaxes(1, 2)  # decode reads the cache's [b, k, s, d]
    live, a, b_ = _split_masks(2, k.shape[2], 2)
    if impl == "pallas":
        decode = functools.partial(decode_attention, return_residuals=True, block_sizes=DecodeBlockSizes(block_k=16))
    else:
        decode = functools.partial(decode_attention_reference, return_residuals=True)
    whole, m_whole, l_whole = decode(q, k, v, valid=live)
    merged, m, l = merge_partials(decode(q, k, v, valid=a), decode(q, k, v, valid=b_))
    chex.assert_trees_all_close(merged, whole.astype(jnp.float32), atol=1e-5, rtol=1e-5)
    # the merged residuals are the whole attention's: same log-sum-exp
    chex.assert_trees_all_close(m + jnp.log(l), m_whole + jnp.log(l_whole), atol=1e-5, rtol=1e-5)


def test_merge_decode_residuals_match_the_reference():
    q, k, v = _qkv(b=2, s=40, seed=3)
    q, k, v = q[:, 0], k.swapaxes(1, 2), v.swapaxes(1, 2)
    live, _, _ = _split_masks(2, 40, 4)
    got = decode_attention(q, k, v, valid=live, return_residuals=True, block_sizes=DecodeBlockSizes(block_k=16))
    want = decode_attention_reference(q, k, v, valid=live, return_residuals=True)
    for g, w in zip(got, want):
        chex.assert_trees_all_close(g, w, atol=1e-5, rtol=1e-5)


def test_merge_with_both_parts_empty_is_zero_not_nan():
    q, k, v = _qkv(b=1, s=16, seed=5)
    q, k, v = q[:, 0], k.swapaxes(1, 2), v.swapaxes(1, 2)
    none = jnp.zeros((1, 16), bool)
    part = decode_attention_reference(q, k, v, valid=none, return_residuals=True)
    assert float(part[2].max()) == 0.0 and bool(jnp.all(jnp.isneginf(part[1])))
    out, m, l = merge_partials(part, part)
    assert not bool(jnp.any(jnp.isnan(out))) and float(jnp.abs(out).max()) == 0.0
    assert float(l.max()) == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["reference", "xla", "pallas"])
def test_merge_chunk_parts_equals_whole(impl):
    """A prefill chunk: causal part (the working slots, with per-row offsets) merged with a non-causal part (e.g.
    recalled blocks) equals one attention over both, every query row."""
    q, k, v = _qkv(b=2, t=8, s=40, seed=6)
    ka, va, kb, vb = k[:, :24], v[:, :24], k[:, 24:], v[:, 24:]
    chunk = functools.partial(backend(impl).chunk, sm_scale=32 ** -0.5, residuals=True)
    # B: 16 recalled keys, row 1 has only 5 of them; A: the working slots, the chunk written at slot 10 (row 0)
    # and 16 (row 1), causal.
    off_a, len_a = jnp.array([10, 16]), jnp.array([18, 24])
    len_b = jnp.array([16, 5])
    part_a = chunk(q, ka, va, q_offsets=off_a, kv_lengths=len_a)
    part_b = chunk(q, kb, vb, q_offsets=jnp.zeros(2, jnp.int32), kv_lengths=len_b, causal=False)
    merged, _, _ = merge_partials(part_a, part_b)
    # the whole attention as one masked softmax over the concatenated keys
    i = jnp.arange(8)[None, :, None]
    j = jnp.arange(40)[None, None, :]
    mask_a = (j < 24) & (j <= off_a[:, None, None] + i) & (j < len_a[:, None, None])
    mask_b = (j >= 24) & (j - 24 < len_b[:, None, None])
    whole, _, _ = masked_attention_parts(q, k, v, mask_a | mask_b, sm_scale=32 ** -0.5)
    chex.assert_trees_all_close(merged, whole, atol=2e-5, rtol=2e-5)


def test_flash_residuals_are_the_log_sum_exp():
    q, k, v = _qkv(b=1, t=20, s=20, seed=7)
    out, m, l = flash_attention(q, k, v, causal=True, return_residuals=True)
    ref, m_ref, l_ref = masked_attention_parts(q, k, v, jnp.tril(jnp.ones((20, 20), bool))[None])
    chex.assert_trees_all_close(out, ref, atol=1e-5, rtol=1e-5)
    chex.assert_trees_all_close(m + jnp.log(l), m_ref + jnp.log(l_ref), atol=1e-5, rtol=1e-5)
