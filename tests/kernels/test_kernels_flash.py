"""flash_attention (Pallas, interpret mode on CPU) against the fp32 HIGHEST reference on a sampled grid."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lcx.kernels import FlashBlockSizes, attention, attention_reference, flash_attention
from tests.conftest import interpreter_blocks, tiered

pytestmark = pytest.mark.pallas

# Small tiles so every length below spans several tiles and ragged tails (17, 333 are not multiples of 16/32). On a
# GPU (compiled with Triton) the kernels' default tiles instead - the ones a GPU run uses; 333 still spans several
# with a ragged tail. The tile-boundary cases (offsets, segments) keep their 16-row tiles everywhere.
SMALL = interpreter_blocks(
    FlashBlockSizes(block_q=32, block_k=16, block_q_dkv=16, block_k_dkv=32, block_q_dq=32, block_k_dq=16))
TOL = {jnp.float32: 1e-4, jnp.bfloat16: 2e-2, jnp.float16: 2e-2}


def _inputs(b, t, s, h, kv, d, dtype, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (b, t, h, d), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (b, s, kv, d), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (b, s, kv, d), jnp.float32).astype(dtype)
    ct = jax.random.normal(ks[3], (b, t, h, d), jnp.float32)
    return q, k, v, ct


def _err(x, y):
    return float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32))))


# (batch, q_len, kv_len, q_heads, kv_heads, head_dim, causal, window, kv_lengths, dtype)
FWD_CASES = [
    (1, 1, 1, 2, 1, 64, True, None, None, jnp.float32),
    (2, 17, 17, 4, 4, 64, True, None, None, jnp.float32),
    (1, 128, 128, 4, 2, 128, True, None, None, jnp.float32),
    (1, 333, 333, 8, 1, 64, False, None, None, jnp.float32),
    (2, 17, 333, 8, 2, 80, True, None, None, jnp.float32),
    (1, 128, 333, 4, 1, 96, True, 64, None, jnp.float32),
    (2, 333, 333, 2, 2, 64, True, None, (333, 100), jnp.float32),
    (2, 128, 128, 4, 2, 64, False, None, (1, 128), jnp.float32),
    (1, 333, 17, 2, 1, 64, True, None, None, jnp.float32),
    (1, 333, 333, 4, 2, 128, True, None, None, jnp.bfloat16),
    (2, 17, 128, 8, 8, 64, False, 16, None, jnp.float16),
    (1, 128, 128, 8, 1, 80, True, 32, (100,), jnp.bfloat16),
]


@pytest.mark.parametrize("b,t,s,h,kv,d,causal,window,lens,dtype", tiered(FWD_CASES, fast={1, 4, 6, 11}))
def test_flash_forward_matches_reference(b, t, s, h, kv, d, causal, window, lens, dtype):
    q, k, v, _ = _inputs(b, t, s, h, kv, d, dtype)
    kl = None if lens is None else jnp.array(lens)
    out = jax.jit(functools.partial(flash_attention, causal=causal, window=window, block_sizes=SMALL))(
        q, k, v, kv_lengths=kl)
    ref = jax.jit(functools.partial(attention_reference, causal=causal, window=window))(q, k, v, kv_lengths=kl)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert not jnp.isnan(out).any()
    assert _err(out, ref) <= TOL[dtype]


GRAD_CASES = [
    (2, 17, 17, 4, 4, 64, True, None, None, jnp.float32),
    (1, 128, 128, 8, 1, 128, True, None, None, jnp.float32),
    (2, 17, 333, 4, 1, 80, True, None, None, jnp.float32),
    (1, 128, 333, 4, 2, 96, True, 64, None, jnp.float32),
    (2, 333, 333, 4, 2, 64, True, None, (0, 150), jnp.float32),
    (1, 128, 128, 8, 2, 64, False, None, (77,), jnp.float32),
    (1, 333, 17, 2, 1, 64, True, None, None, jnp.float32),
    (1, 128, 128, 4, 2, 128, True, None, None, jnp.bfloat16),
]


@pytest.mark.parametrize("b,t,s,h,kv,d,causal,window,lens,dtype", tiered(GRAD_CASES, fast={0, 3}))
def test_flash_gradients_match_reference(b, t, s, h, kv, d, causal, window, lens, dtype):
    q, k, v, ct = _inputs(b, t, s, h, kv, d, dtype, seed=1)
    kl = None if lens is None else jnp.array(lens)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * ct)

    flash = loss(lambda q, k, v: flash_attention(q, k, v, causal=causal, window=window, kv_lengths=kl,
                                                 block_sizes=SMALL))
    ref = loss(lambda q, k, v: attention_reference(q, k, v, causal=causal, window=window, kv_lengths=kl))
    got = jax.jit(jax.grad(flash, (0, 1, 2)))(q, k, v)
    want = jax.jit(jax.grad(ref, (0, 1, 2)))(q, k, v)
    for name, g, w in zip("qkv", got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        assert not jnp.isnan(g).any(), name
        scale = max(1.0, float(jnp.max(jnp.abs(w.astype(jnp.float32)))))
        assert _err(g, w) <= TOL[dtype] * scale, (name, _err(g, w), scale)


def test_flash_fully_masked_rows_are_zero_without_nan():
    # Sequence 0 has no keys at all; with q_len > kv_len the first queries precede every key.
    q, k, v, ct = _inputs(2, 40, 20, 2, 1, 64, jnp.float32, seed=2)
    kl = jnp.array([0, 20])
    out = flash_attention(q, k, v, causal=True, kv_lengths=kl, block_sizes=SMALL)
    np.testing.assert_array_equal(np.asarray(out[0]), 0.0)
    np.testing.assert_array_equal(np.asarray(out[1, :20]), 0.0)  # query i sits at key position i - 20
    grads = jax.grad(lambda q, k, v: jnp.sum(flash_attention(q, k, v, causal=True, kv_lengths=kl,
                                                             block_sizes=SMALL) * ct), (0, 1, 2))(q, k, v)
    for g in grads:
        assert jnp.isfinite(g).all()
    np.testing.assert_array_equal(np.asarray(grads[0][0]), 0.0)
    np.testing.assert_array_equal(np.asarray(grads[1][0]), 0.0)


def test_flash_default_blocks_and_scale():
    # Default (GPU) tiles, clipped to the length; an explicit sm_scale.
    q, k, v, _ = _inputs(1, 333, 333, 4, 2, 64, jnp.float32, seed=3)
    out = flash_attention(q, k, v, causal=True, sm_scale=0.3)
    assert _err(out, attention_reference(q, k, v, causal=True, sm_scale=0.3)) <= 1e-4


def test_attention_dispatch_pallas_matches_reference():
    q, k, v, _ = _inputs(1, 40, 40, 4, 2, 32, jnp.float32, seed=4)
    want = attention(q, k, v, impl="reference", causal=True)
    assert _err(attention(q, k, v, impl="pallas", causal=True), want) <= 1e-4
    assert _err(attention(q, k, v, impl="xla", causal=True), want) <= 1e-4
    with pytest.raises(ValueError, match="impl='flash'"):
        attention(q, k, v, impl="flash")


def test_flash_input_errors():
    q, k, v, _ = _inputs(1, 8, 8, 3, 2, 16, jnp.float32)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        flash_attention(q, k, v)
    q, k, v, _ = _inputs(1, 8, 8, 4, 2, 16, jnp.float32)
    with pytest.raises(ValueError, match="window"):
        flash_attention(q, k, v, window=0)
    with pytest.raises(ValueError, match="kv_lengths.shape"):
        flash_attention(q, k, v, kv_lengths=jnp.array([1, 2]))
    with pytest.raises(ValueError, match=r"q, k, v must be \[batch"):
        flash_attention(q[0], k, v)
    with pytest.raises(ValueError, match="power of two"):
        FlashBlockSizes(block_q=24)
    with pytest.raises(ValueError, match="power of two"):
        FlashBlockSizes(block_k=8)
