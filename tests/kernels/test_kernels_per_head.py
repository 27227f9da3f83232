"""Per-KV-head masks in every kernel: ``q_offsets`` / ``kv_lengths`` ``[b, k]`` and decode ``valid [b, k, s]``.

A cache whose KV heads keep different tokens gives each head its own fill level, chunk offset and holes. The oracle
is independent of the per-head code path: each KV head (with the query heads of its group) is run alone through the
per-row ``[b]`` version, and the results are stacked.
"""

from __future__ import annotations

import functools

import einops
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lcx.kernels import (BACKENDS, DecodeBlockSizes, FlashBlockSizes, attention_column_sums, attention_reference,
                         decode_attention, decode_attention_reference, flash_attention)

pytestmark = pytest.mark.pallas

B16 = FlashBlockSizes(block_q=16, block_k=16, block_q_dkv=16, block_k_dkv=16, block_q_dq=16, block_k_dq=16)
B, T, S, H, KV, D = 2, 17, 48, 4, 2, 32
OFFSETS = jnp.array([[0, 9], [20, 3]], jnp.int32)  # [b, k]: each head's chunk starts at its own fill level
LENGTHS = OFFSETS + jnp.array([[17, 17], [5, 5]], jnp.int32)  # row 1 has 5 real tokens


def _qkv(seed=0, t=T):
    ks = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(ks[0], (B, t, H, D)), jax.random.normal(ks[1], (B, S, KV, D)),
            jax.random.normal(ks[2], (B, S, KV, D)))


def _per_head(fn, q, k, *rest, heads_axis_out=2):
    """Run ``fn`` on KV head j alone (its query-head group, its row ints) for every j and stack the outputs."""
    g = H // KV
    outs = [fn(q[..., j * g:(j + 1) * g, :], k[:, :, j:j + 1], *(x[:, :, j:j + 1] for x in rest), j)
            for j in range(KV)]
    return jnp.concatenate(outs, axis=heads_axis_out)


@pytest.mark.slow
def test_flash_per_head_offsets_forward_and_gradients():
    q, k, v = _qkv()
    per_head = functools.partial(flash_attention, causal=True, kv_lengths=LENGTHS, q_offsets=OFFSETS,
                                 block_sizes=B16)

    def oracle(q, k, v):
        return _per_head(lambda q, k, v, j: attention_reference(q, k, v, causal=True, kv_lengths=LENGTHS[:, j],
                                                                q_offsets=OFFSETS[:, j]), q, k, v)

    np.testing.assert_allclose(np.asarray(jax.jit(per_head)(q, k, v)), np.asarray(oracle(q, k, v)), atol=1e-4)
    ct = jax.random.normal(jax.random.key(5), q.shape)
    grad = lambda fn: jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a) * ct), (0, 1, 2)))(q, k, v)  # noqa: E731
    for got, want in zip(grad(per_head), grad(oracle)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-4)


@pytest.mark.parametrize("impl", ["reference", "xla"])
def test_backend_chunk_per_head_offsets(impl):
    q, k, v = _qkv(seed=1)
    got = BACKENDS[impl].chunk(q, k, v, q_offsets=OFFSETS, kv_lengths=LENGTHS, sm_scale=D ** -0.5).out
    want = _per_head(lambda q, k, v, j: attention_reference(q, k, v, causal=True, kv_lengths=LENGTHS[:, j],
                                                            q_offsets=OFFSETS[:, j]), q, k, v)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4)


def test_column_sums_per_head_offsets():
    q, k, _ = _qkv(seed=2)
    weights = (jnp.arange(T)[None, :] >= jnp.array([[10], [0]])).astype(jnp.float32)  # a window of queries per row
    kw = dict(q_offsets=OFFSETS, kv_lengths=LENGTHS, query_weights=weights, sm_scale=D ** -0.5)
    got = jax.jit(functools.partial(attention_column_sums, block_sizes=B16, **{k: v for k, v in kw.items()
                                                                                if k != "sm_scale"}))(q, k)
    ref = BACKENDS["reference"].column_sums(q, k, **kw)
    want = _per_head(lambda q, k, j: BACKENDS["reference"].column_sums(
        q, k, q_offsets=OFFSETS[:, j], kv_lengths=LENGTHS[:, j], query_weights=weights, sm_scale=D ** -0.5),
        q, k, heads_axis_out=1)
    np.testing.assert_allclose(np.asarray(ref), np.asarray(want), atol=1e-5)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4)


def test_decode_per_head_holes_and_lengths():
    q, k, v = _qkv(seed=3, t=1)
    q, k, v = q[:, 0], k.swapaxes(1, 2), v.swapaxes(1, 2)  # decode reads the cache's [b, k, s, d]
    valid = jax.random.bernoulli(jax.random.key(4), 0.6, (B, KV, S))
    lengths = jnp.array([[48, 30], [7, 40]], jnp.int32)
    got, w = jax.jit(functools.partial(decode_attention, return_weights=True,
                                       block_sizes=DecodeBlockSizes(block_k=16, num_splits=3)))(
        q, k, v, valid=valid, lengths=lengths)
    ref, ref_w = decode_attention_reference(q, k, v, valid=valid, lengths=lengths, return_weights=True)
    g = H // KV
    heads = [decode_attention_reference(q[:, j * g:(j + 1) * g], k[:, j:j + 1], v[:, j:j + 1],
                                        valid=valid[:, j], lengths=lengths[:, j], return_weights=True)
             for j in range(KV)]
    want = jnp.concatenate([o for o, _ in heads], axis=1)
    want_w = jnp.concatenate([w_ for _, w_ in heads], axis=1)
    np.testing.assert_allclose(np.asarray(ref), np.asarray(want), atol=1e-6)
    np.testing.assert_allclose(np.asarray(ref_w), np.asarray(want_w), atol=1e-6)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4)
    np.testing.assert_allclose(np.asarray(w), np.asarray(want_w), atol=1e-4)
    live = np.asarray(valid) & (np.arange(S) < np.asarray(lengths)[..., None])
    assert float(np.max(np.where(live, 0.0, np.asarray(w)))) == 0.0  # no weight on another head's slots


def test_per_head_shapes_are_checked():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"q_offsets.shape=\(2, 3\) must be \(2,\) or \(2, 2\)"):
        flash_attention(q, k, v, q_offsets=jnp.zeros((2, 3), jnp.int32))
    with pytest.raises(ValueError, match=r"valid.shape"):
        decode_attention(q[:, 0], k.swapaxes(1, 2), v.swapaxes(1, 2), valid=jnp.ones((B, 3, S), bool))
    # the [b] form is the [b, k] form with every head alike
    one = flash_attention(q, k, v, q_offsets=OFFSETS[:, 0], kv_lengths=LENGTHS[:, 0], block_sizes=B16)
    both = flash_attention(q, k, v, q_offsets=einops.repeat(OFFSETS[:, 0], "b -> b k", k=KV),
                           kv_lengths=einops.repeat(LENGTHS[:, 0], "b -> b k", k=KV), block_sizes=B16)
    np.testing.assert_array_equal(np.asarray(one), np.asarray(both))
