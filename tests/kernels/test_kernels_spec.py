"""A layer's attention spec in every backend op: sliding window and logit soft-capping against the fp32 reference -
the Pallas flash kernel forward and both backward kernels (window + cap, per-row offsets), the split-K decode kernel
with its weights, the tiled XLA chunk and column sums, and the XLA causal path (dense and blocked)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lcx.kernels import (BACKENDS, FlashBlockSizes, attention_column_sums_reference, attention_reference,
                         decode_attention, decode_attention_reference, flash_attention)
from lcx.kernels.reference import capped
from tests.conftest import default_precision_atol

pytestmark = pytest.mark.pallas

SMALL = FlashBlockSizes(block_q=16, block_k=16, block_q_dkv=16, block_k_dkv=16, block_q_dq=16, block_k_dq=16)
CAP = 2.0  # logits of the inputs below reach ~+-6: the cap bends them hard


def _qkv(b, t, s, h, kv, d, seed=0, spread=3.0):
    ks = jax.random.split(jax.random.key(seed), 3)
    q = spread * jax.random.normal(ks[0], (b, t, h, d), jnp.float32)
    return q, jax.random.normal(ks[1], (b, s, kv, d)), jax.random.normal(ks[2], (b, s, kv, d))


def test_capped_is_the_identity_without_a_cap_and_bounded_with_one():
    z = jnp.linspace(-50, 50, 11)
    np.testing.assert_array_equal(capped(z, None), z)
    assert float(jnp.max(jnp.abs(capped(z, CAP)))) <= CAP
    np.testing.assert_allclose(capped(jnp.asarray([1e-3]), CAP), [1e-3], rtol=1e-6)  # ~identity near 0


@pytest.mark.slow
@pytest.mark.parametrize("window, softcap, offsets", [(None, CAP, None), (20, CAP, [5, 30])])
def test_flash_window_and_softcap_forward_and_gradients(window, softcap, offsets):
    b, t, h, kv, d = 2, 40, 4, 2, 16
    s = t if offsets is None else 72
    q, k, v = _qkv(b, t, s, h, kv, d)
    extra = {} if offsets is None else {"q_offsets": jnp.asarray(offsets), "kv_lengths": jnp.asarray(offsets) + t}
    flash = functools.partial(flash_attention, window=window, softcap=softcap, block_sizes=SMALL, **extra)
    ref = functools.partial(attention_reference, window=window, softcap=softcap, **extra)
    np.testing.assert_allclose(jax.jit(flash)(q, k, v), ref(q, k, v), atol=2e-5)
    ct = jax.random.normal(jax.random.key(9), q.shape)
    loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v) * ct)  # noqa: E731
    got = jax.jit(jax.grad(loss(flash), argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(loss(ref), argnums=(0, 1, 2))(q, k, v)
    for name, a, b_ in zip("qkv", got, want):
        np.testing.assert_allclose(a, b_, atol=5e-5, err_msg=f"d{name}")
    if softcap is not None:  # the cap changes the result: the test can fail if the kernels ignore it
        uncapped = attention_reference(q, k, v, window=window, **extra)
        assert float(jnp.max(jnp.abs(uncapped - ref(q, k, v)))) > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["xla", "pallas", "reference"])
def test_backend_chunk_and_column_sums_take_the_spec(impl):
    """A prefill chunk written after 30 (row 0) / 50 (row 1) cached tokens, window 16, cap 2: the chunk output and
    the column sums (what eviction scores see) equal the reference."""
    b, t, s, h, kv, d = 2, 24, 80, 4, 2, 16
    q, k, v = _qkv(b, t, s, h, kv, d, seed=1)
    offsets = jnp.asarray([30, 50], jnp.int32)
    lengths = offsets + t
    spec = {"window": 16, "softcap": CAP}
    backend = BACKENDS[impl]
    out = backend.chunk(q, k, v, q_offsets=offsets, kv_lengths=lengths, sm_scale=0.25, **spec).out
    ref = attention_reference(q, k, v, q_offsets=offsets, kv_lengths=lengths, sm_scale=0.25, **spec)
    np.testing.assert_allclose(out, ref, atol=2e-5)
    weights = jnp.asarray(np.random.default_rng(0).random((b, t)) > 0.5, jnp.float32)
    sums = backend.column_sums(q, k, q_offsets=offsets, kv_lengths=lengths, query_weights=weights, sm_scale=0.25,
                               **spec)
    want = attention_column_sums_reference(q, k, q_offsets=offsets, kv_lengths=lengths, query_weights=weights,
                                           sm_scale=0.25, **spec)
    np.testing.assert_allclose(sums, want, atol=2e-5)
    hidden = np.asarray(want)[0, :, :30 + 1 - 16]  # before the first query's window: no attention at all
    assert np.all(hidden == 0) and np.all(np.asarray(sums)[0, :, :30 + 1 - 16] == 0)


@pytest.mark.slow
@pytest.mark.parametrize("t", [40, 256])  # dense and blocked (>= 4 query blocks) CPU paths
def test_xla_causal_takes_window_and_softcap(t):
    q, k, v = _qkv(1, t, t, 4, 2, 16, seed=2)
    out = BACKENDS["xla"].causal(q, k, v, sm_scale=0.25, window=24, softcap=CAP)
    # a window or cap takes the blocked path on every platform; its dots run at Precision.DEFAULT (TF32 on a GPU)
    np.testing.assert_allclose(out, attention_reference(q, k, v, sm_scale=0.25, window=24, softcap=CAP),
                               atol=default_precision_atol(2e-5))


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_decode_softcap_outputs_and_weights(impl):
    b, h, kv, s, d = 2, 4, 2, 48, 16
    q = 3.0 * jax.random.normal(jax.random.key(3), (b, h, d))
    k, v = (jax.random.normal(key, (b, kv, s, d)) for key in jax.random.split(jax.random.key(4)))
    valid = jnp.asarray(np.random.default_rng(1).random((b, s)) > 0.3)
    if impl == "pallas":
        out, w = decode_attention(q, k, v, valid=valid, sm_scale=0.25, softcap=CAP, return_weights=True)
    else:
        res = BACKENDS["xla"].decode(q, k, v, valid=valid, sm_scale=0.25, softcap=CAP, weights=True)
        out, w = res.out, res.weights
    ro, rw = decode_attention_reference(q, k, v, valid=valid, sm_scale=0.25, softcap=CAP, return_weights=True)
    atol = default_precision_atol(2e-5) if impl == "xla" else 2e-5  # xla's decode: TF32 on a GPU (tests/conftest.py)
    np.testing.assert_allclose(out, ro, atol=atol)
    np.testing.assert_allclose(w, rw, atol=atol)
