"""attention_column_sums (SnapKV observation-window statistic) against the pure-jnp reference."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lcx.kernels import FlashBlockSizes, attention_column_sums, attention_column_sums_reference
from tests.conftest import tiered

pytestmark = pytest.mark.pallas

SMALL = FlashBlockSizes(block_q=16, block_k=16, block_q_dkv=16, block_k_dkv=32)


# (batch, window queries, kv_len, q_heads, kv_heads, head_dim, causal, window, kv_lengths, dtype)
CASES = [
    (1, 17, 100, 8, 2, 64, True, None, None, jnp.float32),
    (2, 32, 333, 4, 4, 80, True, 50, (333, 10), jnp.float32),
    (1, 20, 64, 6, 2, 64, False, None, None, jnp.float32),
    (2, 16, 128, 8, 1, 128, True, None, (128, 40), jnp.bfloat16),
]


@pytest.mark.parametrize("b,w,s,h,kv,d,causal,window,lens,dtype", tiered(CASES, fast={0, 1}))
def test_column_sums_match_reference(b, w, s, h, kv, d, causal, window, lens, dtype):
    ks = jax.random.split(jax.random.key(0), 2)
    q = jax.random.normal(ks[0], (b, w, h, d), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (b, s, kv, d), jnp.float32).astype(dtype)
    kl = None if lens is None else jnp.array(lens)
    got = jax.jit(functools.partial(attention_column_sums, causal=causal, window=window, block_sizes=SMALL))(
        q, k, kv_lengths=kl)
    want = jax.jit(functools.partial(attention_column_sums_reference, causal=causal, window=window))(
        q, k, kv_lengths=kl)
    assert got.shape == (b, kv, s) and got.dtype == jnp.float32
    assert float(jnp.max(jnp.abs(got - want))) <= (1e-4 if dtype == jnp.float32 else 2e-2)


def test_column_sums_of_last_queries_are_rows_of_full_attention():
    # SnapKV usage: the last w queries of a causal prefill scored against the whole prefix, default tiles. The
    # oracle is the explicit full 200 x 200 softmax, cut to its last w rows.
    ks = jax.random.split(jax.random.key(1), 2)
    q = jax.random.normal(ks[0], (1, 200, 4, 64))
    k = jax.random.normal(ks[1], (1, 200, 2, 64))
    w = 24
    got = jax.jit(attention_column_sums)(q[:, -w:], k)
    scores = jnp.einsum("btkgd,bskd->bkgts", q.reshape(1, 200, 2, 2, 64), k,
                        precision=jax.lax.Precision.HIGHEST) / 8.0  # [b, k, g, t, s]
    probs = jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((200, 200), bool)), scores, -jnp.inf), axis=-1)
    want = probs[:, :, :, -w:].sum(axis=(2, 3))  # [b, k, s]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4)
    np.testing.assert_allclose(float(got.sum()), w * 4, rtol=1e-5)  # every (query, head) row sums to 1
    assert float(got[0, :, :200 - w].sum()) > 0.0  # the window reaches back into the prefix


def test_column_sums_with_offsets_and_query_weights_match_reference():
    # A prefill chunk of 24 queries written at slots 9 (row 0) and 30 (row 1) of a 64-slot cache, with only the
    # last 5 real queries of each row counted (SnapKV's observation window inside the chunk).
    ks = jax.random.split(jax.random.key(2), 2)
    q = jax.random.normal(ks[0], (2, 24, 4, 32))
    k = jax.random.normal(ks[1], (2, 64, 2, 32))
    offsets, lengths = jnp.array([9, 30]), jnp.array([9 + 24, 30 + 20])  # row 1: 4 padded queries at the end
    weights = jnp.zeros((2, 24)).at[0, 19:].set(1.0).at[1, 15:20].set(1.0)
    kw = dict(q_offsets=offsets, kv_lengths=lengths, query_weights=weights)
    got = jax.jit(functools.partial(attention_column_sums, block_sizes=SMALL))(q, k, **kw)
    want = attention_column_sums_reference(q, k, **kw)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    np.testing.assert_allclose(np.asarray(got.sum(axis=(1, 2))), [5 * 4, 5 * 4], rtol=1e-5)  # 5 queries x 4 heads
