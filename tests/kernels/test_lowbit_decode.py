"""A decode query on the bit-packed codes (lcx.kernels.lowbit_decode) against the float reference: the same output,
slot weights and residuals as ``decode_attention_reference`` over the layer dequantized (lowbit_slots.float_kv), with
a float window, a partial last key group, holes, per-KV-head slot counts and a soft-cap."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lcx.cache import lowbit_slots
from lcx.kernels import decode_attention_reference
from lcx.kernels.lowbit_decode import decode_lowbit
from lcx.kernels.lowbit_pallas import decode_lowbit_tiles

B, KV, HEADS, C, D, G = 2, 2, 6, 45, 16, 8  # 45 slots: the last key group (of 8) is partial


def _fmt(quant, group, residual):
    """The bit-packed format the store's functions take (``lcx.cache.storage.PackedStorage``)."""
    from lcx.cache.storage import PackedStorage
    return PackedStorage(name=quant, group=group, residual=residual)


def _layer(quant, residual, count, group=G):
    """A stored layer (codes, scales, window) holding random float keys and values in its first ``count [b, H]``
    slots, and the float keys / values attention should see."""
    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.standard_normal((B, KV, C, D)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, KV, C, D)), jnp.float32)
    k = k.at[..., 3].multiply(8.0)  # an outlier key channel
    stored = lowbit_slots.requantize(count, k, v, _fmt(quant, group, residual), -(-C // group), jnp.float32)
    layer = types.SimpleNamespace(count=count, **stored)
    return layer, lowbit_slots.float_kv(layer, _fmt(quant, group, residual), jnp.float32)


# the fused XLA formulation (every backend but pallas) and the Pallas kernel (interpret mode here: compiled on a GPU;
# num_splits 2 cuts the 6 key groups into 2 splits of 3)
DECODERS = {"xla": decode_lowbit, "pallas": lambda *a, **kw: decode_lowbit_tiles(*a, **kw, num_splits=2)}


@pytest.mark.parametrize("decoder", ["xla", pytest.param("pallas", marks=pytest.mark.pallas)])
@pytest.mark.parametrize("quant, residual, softcap, per_head, group", [
    ("int4", 0, None, False, G), ("int4", 5, 20.0, True, G),
    ("int2", 16, None, True, 4)])  # int2's smallest group: one byte of codes per channel and group
def test_decode_on_codes_equals_the_reference_over_the_dequantized_layer(quant, residual, softcap, per_head, group,
                                                                        decoder):
    count = jnp.asarray([[45, 38], [29, 12]] if per_head else [[45], [29]], jnp.int32)
    layer, (k, v) = _layer(quant, residual, count, group)
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((B, HEADS, D)), jnp.float32)
    live = jnp.arange(C)[None, None, :] < lowbit_slots.per_kv(count, KV)[..., None]  # [b, k, C]
    valid = live & jnp.asarray(rng.random((B, KV, C)) > 0.2)  # holes, as eviction leaves them
    if not per_head:
        valid = valid[:, 0]
    want = decode_attention_reference(q, k, v, valid=valid, sm_scale=0.3, softcap=softcap, return_weights=True,
                                      return_residuals=True)
    got = jax.jit(lambda q, layer_k, layer_v, kv, valid: DECODERS[decoder](
        q, layer_k, layer_v, kv, valid=valid, sm_scale=0.3, softcap=softcap, weights=True, residuals=True))(
        q, layer.k, layer.v, lowbit_slots.decode_view(layer, _fmt(quant, group, residual)), valid)
    for name, w, g in zip(("out", "weights", "m", "l"), want, (got.out, got.weights, got.m, got.l)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5, err_msg=name)
    # the window really is read in float: the quantized slots differ from the float keys by a quantization step
    start = int(lowbit_slots.quantized_slots(count[0, 0], _fmt(quant, group, residual)))
    assert start < int(count[0, 0]) and np.abs(np.asarray(layer.k_res[0, 0, 0]) - np.asarray(k[0, 0, start])).max() == 0


@pytest.mark.parametrize("decoder", [pytest.param("xla"), pytest.param("pallas", marks=pytest.mark.pallas)])
def test_a_row_that_sees_no_slot_gives_zeros_not_nan(decoder):
    count = jnp.asarray([[20], [0]], jnp.int32)
    layer, _ = _layer("int4", 0, count)
    valid = jnp.arange(C)[None, :] < count
    got = DECODERS[decoder](jnp.ones((B, HEADS, D)), layer.k, layer.v,
                            lowbit_slots.decode_view(layer, _fmt("int4", G, 0)), valid=valid, sm_scale=0.25,
                            residuals=True, weights=True)
    assert np.all(np.isfinite(np.asarray(got.out))) and np.all(np.asarray(got.out[1]) == 0)
    assert np.all(np.asarray(got.l[1]) == 0) and np.all(np.asarray(got.weights[1]) == 0)


def test_a_chunk_cannot_read_a_bit_packed_view():
    from lcx.cache.kv_view import KVView, attend_view
    from lcx.cache.storage import PackedKV
    from lcx.model.config import AttentionSpec

    count = jnp.asarray([[20], [9]], jnp.int32)
    layer, _ = _layer("int4", 0, count)
    view = KVView(kv=PackedKV(k=layer.k, v=layer.v, lowbit=lowbit_slots.decode_view(layer, _fmt("int4", G, 0))),
                  lengths=count[:, 0], offsets=count[:, 0])
    with pytest.raises(ValueError, match="a chunk of 2 queries on .xla. reads the layer dequantized"):
        attend_view("xla", jnp.zeros((B, 2, HEADS, D)), view, AttentionSpec(sm_scale=0.25))


@pytest.mark.pallas
@pytest.mark.parametrize("quant, residual, softcap, per_head, group", [
    ("int4", 5, 20.0, True, G), ("int2", 16, None, False, 4)])
def test_prefill_chunk_on_codes_equals_the_reference_over_the_dequantized_layer(quant, residual, softcap, per_head,
                                                                                group):
    """A prefill chunk on the codes (``chunk_lowbit_tiles``, interpret mode): 9 queries at the end of the filled
    slots - their own keys partly flushed into codes, partly in the float window - see the slots up to theirs; the
    output and residuals equal the reference chunk attention over the dequantized layer."""
    from lcx.kernels import BACKENDS
    from lcx.kernels.lowbit_pallas import chunk_lowbit_tiles

    count = jnp.asarray([[45, 38], [29, 12]] if per_head else [[45], [29]], jnp.int32)
    layer, (k, v) = _layer(quant, residual, count, group)
    t = 9
    lengths = lowbit_slots.per_kv(count, KV)  # [b, k]: the chunk's 9 queries are the last 9 filled slots
    offsets = lengths - t
    q = jnp.asarray(np.random.default_rng(2).standard_normal((B, t, HEADS, D)), jnp.float32)
    want = BACKENDS["reference"].chunk(q, k.swapaxes(1, 2), v.swapaxes(1, 2), q_offsets=offsets, kv_lengths=lengths,
                                       sm_scale=0.3, softcap=softcap, residuals=True)
    got = jax.jit(lambda q, kc, vc, kv: chunk_lowbit_tiles(
        q, kc, vc, kv, q_offsets=offsets, kv_lengths=lengths, sm_scale=0.3, softcap=softcap, residuals=True,
        block_q=4))(q, layer.k, layer.v, lowbit_slots.decode_view(layer, _fmt(quant, group, residual)))
    for name, w, g in (("out", want.out, got.out), ("m", want.m, got.m), ("l", want.l, got.l)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5, err_msg=name)
