"""The caches' one attention core: a ``KVView`` attended through ``attend_view`` equals a masked softmax over the
slots it describes (chunk and decode, per-head offsets, window and soft-cap, statistics and residuals), partial views
merge exactly, and the backend ops' fixed return type refuses the old tuple unpacking with a message naming it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lcx import kernels
from lcx.cache.kv_view import KVView, attend_view, packed_valid
from lcx.cache.storage import FloatKV
from lcx.kernels import Attended
from lcx.kernels.reference import masked_attention_parts
from lcx.model.config import AttentionSpec

B, T, S, H, K, D = 2, 5, 24, 4, 2, 8
SPECS = {"plain": AttentionSpec(sm_scale=D ** -0.5),
         "window_softcap": AttentionSpec(layer_type="sliding_attention", window=6, softcap=2.0, sm_scale=0.5)}


def _qkv(t, seed):
    ks = jax.random.split(jax.random.key(seed), 3)
    q = 2.0 * jax.random.normal(ks[0], (B, t, H, D))
    k, v = (jax.random.normal(key, (B, K, S, D)) for key in ks[1:])
    return q, k, v


def _masked(q, k, v, mask, spec):
    """The oracle: one masked softmax over the view's slots, ``mask [b, k, t, S]`` per KV head."""
    mask = jnp.repeat(mask, H // K, axis=1)  # [b, h, t, S]
    k, v = (jnp.repeat(x.swapaxes(1, 2), H // K, axis=2) for x in (k, v))  # [b, S, h, d]
    head = lambda x, i: x[:, :, i:i + 1]  # noqa: E731
    outs = [masked_attention_parts(head(q, i), head(k, i), head(v, i), mask[:, i], softcap=spec.softcap,
                                   sm_scale=spec.sm_scale) for i in range(H)]
    return tuple(jnp.concatenate(parts, axis=2) for parts in zip(*outs))


@pytest.mark.slow
@pytest.mark.parametrize("spec", list(SPECS))
def test_attend_view_chunk_and_decode_equal_the_masked_softmax(spec):
    spec = SPECS[spec]
    q, k, v = _qkv(T, seed=1)
    offsets = jnp.asarray([[3, 9], [14, 12]], jnp.int32)  # per row and KV head: each head keeps its own slots
    view = KVView(kv=FloatKV(k, v), lengths=offsets + T, offsets=offsets)
    weights = jnp.asarray([[0, 0, 1, 1, 1], [1, 0, 0, 1, 1]], jnp.float32)
    got = attend_view("xla", q, view, spec, stat_weights=weights, residuals=True)
    i, j = jnp.arange(T)[:, None], jnp.arange(S)[None, :]
    slot = offsets[:, :, None, None] + i  # [b, k, t, 1]: each query's own slot
    mask = (j <= slot) & (j > slot - (spec.window or S))
    out, m, l = _masked(q, k, v, mask, spec)
    np.testing.assert_allclose(got.out, out, atol=2e-5)
    np.testing.assert_allclose(got.l * jnp.exp(got.m - m), l, rtol=2e-5)
    # statistics: each slot's probability from the counted queries, summed over queries and each KV group
    logits = jnp.einsum("bthd,bhsd->bhts", q, jnp.repeat(k, H // K, axis=1)) * spec.sm_scale
    if spec.softcap:
        logits = spec.softcap * jnp.tanh(logits / spec.softcap)
    p = jax.nn.softmax(jnp.where(jnp.repeat(mask, H // K, axis=1), logits, -jnp.inf), axis=-1)
    sums = jnp.einsum("bhts,bt->bhs", p, weights).reshape(B, K, H // K, S).sum(2)
    np.testing.assert_allclose(got.weights, sums, atol=2e-5)

    # one decode query at each row's last slot: the window folded into ``valid``, as the caches build it
    q1 = q[:, -1:]
    last = offsets + T - 1
    valid = (j[None] <= last[..., None]) & (j[None] > last[..., None] - (spec.window or S))  # [b, k, S]
    res = attend_view("xla", q1, view.replace(valid=valid), spec, stat_weights=jnp.ones((B, 1)), residuals=True)
    np.testing.assert_allclose(res.out[:, 0], got.out[:, -1], atol=2e-5)
    one, _, _ = _masked(q1, k, v, valid[:, :, None], spec)
    np.testing.assert_allclose(res.out, one, atol=2e-5)
    assert res.weights.shape == (B, K, S) and res.m.shape == (B, 1, H)
    np.testing.assert_allclose(res.weights.sum(-1), H // K, rtol=1e-5)  # each query head's probabilities sum to 1


def test_partial_views_merge_into_the_whole():
    """The memory tier's shape of use: a causal view of working slots and a non-causal view of recalled tokens
    (all older), attended separately with residuals and merged, equal one softmax over both."""
    q, k, v = _qkv(T, seed=2)
    spec = SPECS["plain"]
    work_len = jnp.asarray([10, 7], jnp.int32)
    work = KVView(kv=FloatKV(k[:, :, :12], v[:, :, :12]), lengths=work_len, offsets=work_len - T)
    n_rec = jnp.asarray([12, 4], jnp.int32)
    rec = KVView(kv=FloatKV(k[:, :, 12:], v[:, :, 12:]), lengths=n_rec, offsets=jnp.zeros_like(n_rec),
                 valid=packed_valid(n_rec, 12), causal=False)
    merged, _, _ = kernels.merge_partials(attend_view("xla", q, work, spec, residuals=True),
                                          attend_view("xla", q, rec, spec, residuals=True))
    i, j = jnp.arange(T)[:, None], jnp.arange(S)[None, :]
    in_work = (j < 12) & (j <= (work_len - T)[:, None, None] + i)
    in_rec = (j >= 12) & (j - 12 < n_rec[:, None, None])
    mask = jnp.broadcast_to((in_work | in_rec)[:, None], (B, K, T, S))
    whole, _, _ = _masked(q, k, v, mask, spec)
    np.testing.assert_allclose(merged, whole, atol=2e-5)


def test_backend_ops_return_one_type_and_refuse_tuple_unpacking():
    q, k, v = _qkv(T, seed=3)
    lengths = jnp.full((B,), S, jnp.int32)
    op = kernels.backend("xla")
    plain = op.chunk(q, k.swapaxes(1, 2), v.swapaxes(1, 2), q_offsets=lengths - T, kv_lengths=lengths, sm_scale=0.3)
    assert isinstance(plain, Attended) and plain.weights is None and plain.m is None and plain.out.shape == q.shape
    with pytest.raises(TypeError, match=r"return an lcx.kernels.Attended \(fields out, weights, m, l"):
        o, m, l = op.chunk(q, k.swapaxes(1, 2), v.swapaxes(1, 2), q_offsets=lengths - T, kv_lengths=lengths,
                           sm_scale=0.3, residuals=True)
    with pytest.raises(ValueError, match="residuals=True"):
        kernels.merge_partials(plain, plain)
    dec = op.decode(q[:, 0], k, v, valid=jnp.ones((B, S), bool), sm_scale=0.3, weights=True)
    assert dec.weights.shape == (B, K, S) and dec.m is None


@pytest.mark.parametrize("spec", list(SPECS))
def test_a_few_queries_attend_as_a_chunk_without_its_layout(spec):
    """``few``: a call of at most ``few`` queries (a speculative verification) reads the view in its own layout -
    the keys and values once (``FloatKV.few``, 8-bit codes with their scales too) or, for a payload without ``few``,
    through ``decode`` once per query - and gives the chunk op's outputs, statistics and residuals."""
    from lcx.cache.storage import ScaledKV
    from lcx.kernels.quant import quantize

    spec = SPECS[spec]
    q, k, v = _qkv(T, seed=2)
    offsets = jnp.asarray([[3, 9], [14, 12]], jnp.int32)
    weights = jnp.asarray([[0, 0, 1, 1, 1], [1, 0, 0, 1, 1]], jnp.float32)

    class DecodeOnly:  # a payload with no ``few`` of its own (as the bit-packed codes)
        def __init__(self, kv):
            self.kv, self.k = kv, kv.k

        def decode(self, *args, **kwargs):
            return self.kv.decode(*args, **kwargs)

    (k8, ks), (v8, vs) = quantize(k, "int8"), quantize(v, "int8")
    payloads = {"float": FloatKV(k, v), "int8": ScaledKV(k8, v8, k_scale=ks, v_scale=vs),
                "decode-only": DecodeOnly(FloatKV(k, v))}
    for name, kv in payloads.items():
        view = KVView(kv=kv, lengths=offsets + T, offsets=offsets)
        chunk_kv = kv.kv if name == "decode-only" else kv
        want = attend_view("xla", q, view.replace(kv=chunk_kv), spec, stat_weights=weights, residuals=True)
        got = attend_view("xla", q, view, spec, stat_weights=weights, residuals=True, few=T)
        for field in ("out", "weights", "m", "l"):
            np.testing.assert_allclose(getattr(got, field), getattr(want, field), atol=3e-5, err_msg=f"{name} {field}")
    shared = KVView(kv=FloatKV(k, v), lengths=offsets[:, 0] + T, offsets=offsets[:, 0])  # one keep set per row
    want = attend_view("xla", q, shared, spec)
    np.testing.assert_allclose(attend_view("xla", q, shared, spec, few=8).out, want.out, atol=3e-5)
