"""8-bit KV codes (``lcx.kernels.quant``): the round trip's error bound, and every backend op on codes + scales equal
to the same op on the values the codes stand for - the scales folded into logits and probabilities, per tile."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lcx.kernels import backends
from lcx.kernels.quant import dequantize, quantize
from tests.conftest import default_precision_atol

pytestmark = pytest.mark.pallas


def test_quantize_round_trip_error_is_half_a_step_and_zero_vectors_stay_zero():
    x = jax.random.normal(jax.random.key(0), (3, 7, 2, 32)) * jnp.array([0.01, 1.0, 40.0])[:, None, None, None]
    x = x.at[0, 0, 0].set(0.0)  # a zero vector: scale 0, codes 0, no NaN
    codes, scale = quantize(x, "int8")
    assert codes.dtype == jnp.int8 and scale.dtype == jnp.float16 and scale.shape == x.shape[:-1]
    assert int(jnp.max(jnp.abs(codes.astype(jnp.int32)))) == 127
    err = jnp.abs(dequantize(codes, scale) - x)
    step = scale.astype(jnp.float32)[..., None]
    assert bool(jnp.all(err <= 0.5 * step * (1 + 1e-3)))  # round to nearest of the stored scale
    assert float(scale[0, 0, 0]) == 0.0 and bool(jnp.all(codes[0, 0, 0] == 0))
    codes8, scale8 = quantize(x, "fp8")
    rel = jnp.abs(dequantize(codes8, scale8) - x) / jnp.max(jnp.abs(x), axis=-1, keepdims=True).clip(1e-30)
    assert codes8.dtype == jnp.float8_e4m3fn and float(jnp.max(rel)) <= 2.0 ** -4  # e4m3: 3 mantissa bits


# fp8 codes take the same path as int8 ones (widened to the query's dtype, then the same scaled products): one backend
@pytest.mark.slow
@pytest.mark.parametrize("impl, kv_dtype", [("reference", "int8"), ("xla", "int8"), ("pallas", "int8"), ("xla", "fp8")])
def test_backend_ops_on_codes_equal_the_ops_on_dequantized_values(impl, kv_dtype):
    b, k, g, s, d, t = 2, 2, 3, 40, 16, 8
    keys = jax.random.split(jax.random.key(1), 4)
    k_codes, k_scale = quantize(jax.random.normal(keys[0], (b, k, s, d)) * 2, kv_dtype)  # the decode layout
    v_codes, v_scale = quantize(jax.random.normal(keys[1], (b, k, s, d)), kv_dtype)
    k_val, v_val = dequantize(k_codes, k_scale), dequantize(v_codes, v_scale)
    op = backends.backend(impl)
    close = lambda a, r, atol=2e-6, rtol=2e-5: np.testing.assert_allclose(  # noqa: E731
        np.asarray(a), np.asarray(r), atol=atol, rtol=rtol)
    # xla's decode runs its dots at Precision.DEFAULT: TF32 on a GPU, where codes and values round apart
    # (tests/conftest.py); its chunk and column sums leave the precision to jax's default (HIGHEST in the tests)
    tf32 = impl == "xla"
    decode_tol = dict(atol=default_precision_atol(2e-6), rtol=default_precision_atol(2e-5)) if tf32 else {}

    # one decode query per row, holes in the cache, per-KV-head live masks; weights and residuals as well
    q1 = jax.random.normal(keys[2], (b, k * g, d))
    valid = (jnp.arange(s)[None, None] < jnp.array([[30, 40], [12, 25]])[:, :, None]) & (jnp.arange(s) % 7 != 3)
    ref = op.decode(q1, k_val, v_val, valid=valid, sm_scale=0.3, weights=True, residuals=True, softcap=5.0)
    got = op.decode(q1, k_codes, v_codes, valid=valid, sm_scale=0.3, weights=True, residuals=True, softcap=5.0,
                    k_scale=k_scale, v_scale=v_scale)
    for name in ("out", "weights", "m", "l"):
        close(getattr(got, name), getattr(ref, name), **decode_tol)

    # a chunk of t queries at per-row, per-KV-head offsets (the chunk layout [b, s, k, ...]), and its column sums
    qt = jax.random.normal(keys[3], (b, t, k * g, d))
    chunk_layout = lambda x: x.swapaxes(1, 2)  # noqa: E731
    off, lengths = jnp.array([[10, 3], [20, 0]]), jnp.array([[18, 11], [28, 8]])
    ref = op.chunk(qt, chunk_layout(k_val), chunk_layout(v_val), q_offsets=off, kv_lengths=lengths, sm_scale=0.3,
                   residuals=True, window=6)
    got = op.chunk(qt, chunk_layout(k_codes), chunk_layout(v_codes), q_offsets=off, kv_lengths=lengths,
                   sm_scale=0.3, residuals=True, window=6, k_scale=chunk_layout(k_scale),
                   v_scale=chunk_layout(v_scale))
    for name in ("out", "m", "l"):
        close(getattr(got, name), getattr(ref, name))
    counted = jnp.array([[1.0] * 5 + [0.0] * 3, [0.0] * 2 + [1.0] * 6])
    ref = op.column_sums(qt, chunk_layout(k_val), q_offsets=off, kv_lengths=lengths, query_weights=counted,
                         sm_scale=0.3)
    got = op.column_sums(qt, chunk_layout(k_codes), q_offsets=off, kv_lengths=lengths, query_weights=counted,
                         sm_scale=0.3, k_scale=chunk_layout(k_scale))
    close(got, ref)
