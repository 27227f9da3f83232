"""decode_attention (Pallas split-K, interpret mode on CPU) against the fp32 reference: holes, lengths, weights."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lcx.kernels import DecodeBlockSizes, decode_attention, decode_attention_reference
from tests.conftest import tiered

pytestmark = pytest.mark.pallas

SMALL = DecodeBlockSizes(block_k=16, num_splits=3)


def _inputs(b, s, h, kv, d, dtype, seed=0, holes=0.0):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (b, h, d), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (b, kv, s, d), jnp.float32).astype(dtype)  # the slot cache's [b, k, s, d]
    v = jax.random.normal(ks[2], (b, kv, s, d), jnp.float32).astype(dtype)
    valid = ~jax.random.bernoulli(ks[3], holes, (b, s)) if holes else None
    return q, k, v, valid


def _err(x, y):
    return float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32))))


# (batch, cache_len, q_heads, kv_heads, head_dim, hole fraction, lengths, dtype, block sizes)
CASES = [
    (2, 100, 2, 2, 64, 0.4, None, jnp.float32, SMALL),
    (2, 96, 4, 2, 80, 0.0, (50, 1), jnp.float32, SMALL),
    (3, 333, 8, 2, 128, 0.3, (333, 17, 200), jnp.float32, SMALL),
    (1, 64, 8, 1, 64, 0.5, None, jnp.float32, DecodeBlockSizes(block_k=32, num_splits=1)),
    (2, 333, 6, 2, 96, 0.2, None, jnp.float32, None),  # g = 3: score rows padded to 4; default tiles
    (2, 256, 16, 2, 128, 0.3, (256, 130), jnp.bfloat16, None),
    (1, 17, 4, 4, 64, 0.0, None, jnp.float16, None),
]


@pytest.mark.parametrize("b,s,h,kv,d,holes,lens,dtype,bs", tiered(CASES, fast={1, 4}))
def test_decode_matches_reference_with_weights(b, s, h, kv, d, holes, lens, dtype, bs):
    q, k, v, valid = _inputs(b, s, h, kv, d, dtype, holes=holes)
    lengths = None if lens is None else jnp.array(lens)
    out, w = jax.jit(functools.partial(decode_attention, return_weights=True, block_sizes=bs))(
        q, k, v, valid=valid, lengths=lengths)
    ref_out, ref_w = jax.jit(functools.partial(decode_attention_reference, return_weights=True))(
        q, k, v, valid=valid, lengths=lengths)
    tol = 1e-4 if dtype == jnp.float32 else 2e-2
    assert out.shape == q.shape and out.dtype == q.dtype
    assert w.shape == (b, kv, s) and w.dtype == jnp.float32
    assert _err(out, ref_out) <= tol
    assert _err(w, ref_w) <= (1e-4 if dtype == jnp.float32 else 1e-2)
    # Weights only where a slot is live, and each of the g query heads contributes a distribution.
    live = jnp.ones((b, s), bool) if valid is None else valid
    if lengths is not None:
        live &= jnp.arange(s)[None] < lengths[:, None]
    assert float(jnp.max(jnp.where(live[:, None], 0.0, w))) == 0.0
    expected = np.where(np.asarray(live.any(-1))[:, None], h // kv, 0.0)  # [b, 1]
    np.testing.assert_allclose(np.asarray(w.sum(-1)), np.broadcast_to(expected, (b, kv)), rtol=1e-3)
    # The weights come for free: the attention output is the same with and without them.
    out_only = jax.jit(functools.partial(decode_attention, block_sizes=bs))(q, k, v, valid=valid, lengths=lengths)
    np.testing.assert_array_equal(np.asarray(out_only), np.asarray(out))


def test_decode_empty_cache_row_is_zero_without_nan():
    q, k, v, _ = _inputs(2, 48, 4, 2, 64, jnp.float32, seed=1)
    valid = jnp.ones((2, 48), bool).at[1].set(False)
    out, w = jax.jit(lambda q, k, v, m: decode_attention(q, k, v, valid=m, return_weights=True,
                                                         block_sizes=SMALL))(q, k, v, valid)
    assert jnp.isfinite(out).all() and jnp.isfinite(w).all()
    np.testing.assert_array_equal(np.asarray(out[1]), 0.0)
    np.testing.assert_array_equal(np.asarray(w[1]), 0.0)


def test_decode_input_errors():
    q, k, v, _ = _inputs(1, 32, 3, 2, 16, jnp.float32)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        decode_attention(q, k, v)
    q, k, v, _ = _inputs(1, 32, 4, 2, 16, jnp.float32)
    with pytest.raises(ValueError, match="valid.shape"):
        decode_attention(q, k, v, valid=jnp.ones((1, 31), bool))
    with pytest.raises(ValueError, match="lengths.shape"):
        decode_attention(q, k, v, lengths=jnp.array([3, 4]))
    with pytest.raises(ValueError, match=r"q must be \[batch, heads"):
        decode_attention(q[:, None], k, v)
    with pytest.raises(ValueError, match="block_k"):
        DecodeBlockSizes(block_k=48)


@pytest.mark.parametrize("per_head", [False, True])
def test_decode_reference_equals_masked_attention_over_the_sequence_layout(per_head):
    """The decode oracle reads ``[b, k, s, d]``; it must equal the general masked attention (and its column sums)
    over the same keys in ``[b, s, k, d]`` - an independent path through ``masked_attention_parts``."""
    from lcx.kernels.reference import masked_attention_parts, masked_column_sums_reference

    b, s, h, kv, d = 2, 40, 6, 2, 16
    q, k, v, _ = _inputs(b, s, h, kv, d, jnp.float32, seed=7)
    shape = (b, kv, s) if per_head else (b, s)
    valid = jax.random.bernoulli(jax.random.key(8), 0.7, shape).at[1].set(False)  # row 1: nothing live
    out, w, m, l = decode_attention_reference(q, k, v, valid=valid, return_weights=True, return_residuals=True)
    mask = valid[:, :, None, :] if per_head else valid[:, None, :]  # [b, k, 1, s] or [b, 1, s]
    k_seq, v_seq = k.swapaxes(1, 2), v.swapaxes(1, 2)
    want_out, want_m, want_l = masked_attention_parts(q[:, None], k_seq, v_seq, mask)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want_out[:, 0]), atol=1e-6)
    np.testing.assert_allclose(np.asarray(w), np.asarray(masked_column_sums_reference(q[:, None], k_seq, mask)),
                               atol=1e-6)
    # the same logits by two contractions: equal to the last bit on one CPU, 1 ulp apart on another (AMD EPYC)
    np.testing.assert_allclose(np.asarray(m), np.asarray(want_m[:, 0]), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(l), np.asarray(want_l[:, 0]), rtol=1e-6)
    assert float(jnp.abs(out[1]).max()) == 0.0 and bool(jnp.isneginf(m[1]).all())
