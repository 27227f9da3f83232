"""Bit-packed 4- and 2-bit KV codes (lcx.kernels.lowbit) against plain numpy: the packing layout, round trips, the
quantization error each grouping promises, the bytes, and bad settings."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lcx.kernels import lowbit

DTYPES = ["int4", "int2"]


@pytest.mark.parametrize("kv_dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 12])  # 64: unpacked as 32-bit words; 12 (3 or 6 bytes): byte by byte
def test_pack_round_trips_and_puts_the_first_code_in_the_low_bits(kv_dtype, d):
    bits = lowbit.LOWBIT[kv_dtype]
    codes = np.random.default_rng(0).integers(0, 2**bits, (3, 5, d)).astype(np.uint8)
    packed = lowbit.pack(jnp.asarray(codes), kv_dtype)
    assert packed.dtype == jnp.uint8 and packed.shape == (3, 5, d * bits // 8)
    np.testing.assert_array_equal(np.asarray(lowbit.unpack(packed, kv_dtype)), codes)
    np.testing.assert_array_equal(np.asarray(lowbit.unpack(packed, kv_dtype, jnp.float32)), codes.astype(np.float32))
    per = 8 // bits
    first = sum(int(codes[0, 0, i]) << (i * bits) for i in range(per))  # the first byte, built by hand
    assert int(packed[0, 0, 0]) == first


@pytest.mark.parametrize("kv_dtype", DTYPES)
def test_values_per_token_are_within_half_a_step_of_their_group(kv_dtype):
    top = 2 ** lowbit.LOWBIT[kv_dtype] - 1
    x = np.random.default_rng(1).standard_normal((2, 7, 64)).astype(np.float32) * 3
    packed, scale, zero = jax.jit(lowbit.quantize_tokens, static_argnums=(1, 2))(jnp.asarray(x), kv_dtype, 16)
    assert scale.shape == zero.shape == (2, 7, 4) and scale.dtype == jnp.float16
    back = np.asarray(lowbit.dequantize_tokens(packed, scale, zero, kv_dtype))
    groups = x.reshape(2, 7, 4, 16)
    step = (groups.max(-1) - groups.min(-1)) / top  # per token and group of 16 channels
    err = np.abs(back - x).reshape(2, 7, 4, 16).max(-1)
    assert np.all(err <= 0.5 * step + 2e-3 * np.abs(groups).max(-1))  # + float16 rounding of scale and zero
    assert err.max() > 0.1 * step.max()  # really quantized, not passed through


@pytest.mark.parametrize("kv_dtype", DTYPES)
def test_keys_per_channel_keep_an_outlier_channel_from_spoiling_the_others(kv_dtype):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 32, 16)).astype(np.float32)
    x[..., 5] *= 50.0  # an outlier channel, as keys have
    packed, scale, zero = lowbit.quantize_channels(jnp.asarray(x), kv_dtype, 8)
    assert scale.shape == (3, 4, 16)
    back = np.asarray(lowbit.dequantize_channels(packed, scale, zero, kv_dtype))
    top = 2 ** lowbit.LOWBIT[kv_dtype] - 1
    groups = x.reshape(3, 4, 8, 16)
    step = (groups.max(-2) - groups.min(-2)) / top  # per group of 8 tokens and channel
    err = np.abs(back - x).reshape(3, 4, 8, 16).max(-2)
    assert np.all(err <= 0.5 * step + 2e-3 * np.abs(groups).max(-2))
    # the normal channels' error stays at their own scale, ~50x below the outlier's
    assert err[..., 5].mean() > 10 * np.delete(err, 5, axis=-1).mean()


def test_a_constant_group_is_exact_and_bytes_are_the_arrays():
    x = jnp.full((4, 32), 1.5)
    packed, scale, zero = lowbit.quantize_tokens(x, "int2", 32)
    np.testing.assert_array_equal(np.asarray(lowbit.dequantize_tokens(packed, scale, zero, "int2")), 1.5)
    k = lowbit.quantize_channels(jnp.zeros((64, 128)), "int4", 32)
    v = lowbit.quantize_tokens(jnp.zeros((64, 128)), "int4", 32)
    arrays = sum(a.size * a.dtype.itemsize for a in (*k, *v))
    assert arrays == lowbit.lowbit_bytes(64, 128, "int4", 32) == 64 * 128 + 2 * 2 * (2 * 128 + 64 * 4)
    # against bfloat16 keys and values: 4-bit codes with groups of 32 are 0.31 of the bytes, 2-bit 0.19
    bf16 = 2 * 64 * 128 * 2
    assert lowbit.lowbit_bytes(64, 128, "int4", 32) / bf16 == pytest.approx(0.3125)
    assert lowbit.lowbit_bytes(64, 128, "int2", 32) / bf16 == pytest.approx(0.1875)


@pytest.mark.parametrize("call, message", [
    (lambda: lowbit.pack(jnp.zeros((2, 8), jnp.uint8), "int3"), "kv_dtype='int3' is not a bit-packed dtype"),
    (lambda: lowbit.pack(jnp.zeros((2, 7), jnp.uint8), "int4"), "head_dim=7 must be a positive multiple of 2"),
    (lambda: lowbit.quantize_tokens(jnp.zeros((2, 64)), "int4", 24), "head_dim=64 must be a positive multiple of 24"),
    (lambda: lowbit.quantize_channels(jnp.zeros((20, 64)), "int2", 8), "tokens=20 must be a positive multiple of 8"),
])
def test_bad_settings_name_the_value_and_what_is_allowed(call, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        call()


@pytest.mark.parametrize("kv_dtype", DTYPES)
def test_attention_over_codes_equals_attention_over_the_dequantized_cache(kv_dtype):
    """The scales folded into the query (keys) and the probabilities (values) give what attending to the
    dequantized keys and values gives: the oracle the cache's attention paths are held to."""
    rng = np.random.default_rng(3)
    n, d, group = 48, 32, 16
    k, v = (jnp.asarray(rng.standard_normal((n, d)).astype(np.float32)) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((2, 3, d)).astype(np.float32))  # e.g. [query heads of a group, t, d]
    kq = lowbit.quantize_channels(k, kv_dtype, group)
    vq = lowbit.quantize_tokens(v, kv_dtype, group)
    k_hat = lowbit.dequantize_channels(*kq, kv_dtype)
    v_hat = lowbit.dequantize_tokens(*vq, kv_dtype)
    logits = jax.jit(lowbit.key_logits, static_argnums=4)(q, *kq, kv_dtype)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(q @ k_hat.T), rtol=1e-5, atol=1e-4)
    p = jax.nn.softmax(logits / np.sqrt(d), axis=-1)
    out = jax.jit(lowbit.value_mix, static_argnums=4)(p, *vq, kv_dtype)
    np.testing.assert_allclose(np.asarray(out), np.asarray(p @ v_hat), rtol=1e-5, atol=1e-5)
    # and the quantization error stays visible against the float cache (the codes are not the floats)
    assert float(jnp.max(jnp.abs(out - p @ v))) > 1e-4
