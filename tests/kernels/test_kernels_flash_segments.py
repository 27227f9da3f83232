"""flash_attention with ``segment_ids``: documents packed into one row never attend to each other.

Checked against the fp32 HIGHEST reference (forward and gradients, GQA, a length that is not a tile multiple) and
against the direct statement of the property: a packed row gives, per document, exactly what the document gives run
on its own (forward and gradients).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lcx.kernels import FlashBlockSizes, attention_mask, attention_reference, flash_attention

pytestmark = pytest.mark.pallas

B16 = FlashBlockSizes(block_q=16, block_k=16, block_q_dkv=16, block_k_dkv=16, block_q_dq=16, block_k_dq=16)
# Row 0: documents of 9, 20 and 14 tokens; row 1: one document of 40 tokens, then 3 padding tokens (segment 0).
DOCS = [(9, 20, 14), (40,)]
T = 43


def _segments() -> jnp.ndarray:
    rows = []
    for lengths in DOCS:
        row = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)])
        rows.append(np.pad(row, (0, T - len(row))))
    return jnp.asarray(np.stack(rows), jnp.int32)


def _inputs(h, kv, d, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (2, T, h, d), jnp.float32)
    k = jax.random.normal(ks[1], (2, T, kv, d), jnp.float32)
    v = jax.random.normal(ks[2], (2, T, kv, d), jnp.float32)
    return q, k, v, jax.random.normal(ks[3], (2, T, h, d), jnp.float32)


def _grads(fn, q, k, v, ct):
    return jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * ct), (0, 1, 2)))(q, k, v)


def _err(x, y):
    return float(jnp.max(jnp.abs(x - y)))


@pytest.mark.slow
@pytest.mark.parametrize("h,kv,d", [(4, 2, 48)])  # GQA and a head_dim the kernel pads
def test_flash_segments_match_reference_forward_and_gradients(h, kv, d):
    q, k, v, ct = _inputs(h, kv, d)
    seg = _segments()
    flash = functools.partial(flash_attention, segment_ids=seg, block_sizes=B16)
    ref = functools.partial(attention_reference, segment_ids=seg)
    assert _err(jax.jit(flash)(q, k, v), jax.jit(ref)(q, k, v)) <= 1e-4
    for name, g, w in zip("qkv", _grads(flash, q, k, v, ct), _grads(ref, q, k, v, ct)):
        assert _err(g, w) <= 2e-4, name
    # The mask really is applied: without segments the packed row's later documents see the earlier ones.
    plain = jax.jit(functools.partial(flash_attention, block_sizes=B16))(q, k, v)
    assert _err(plain, jax.jit(ref)(q, k, v)) > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["flash", "reference"])
def test_packed_documents_equal_documents_alone(impl):
    """Each document of the packed row 0, attended with segment ids, equals the document attended on its own."""
    q, k, v, ct = _inputs(4, 2, 32, seed=1)
    seg = _segments()
    fn = flash_attention if impl == "flash" else attention_reference
    kw = {"block_sizes": B16} if impl == "flash" else {}
    packed = functools.partial(fn, segment_ids=seg, **kw)
    out = jax.jit(packed)(q, k, v)
    grads = _grads(packed, q, k, v, ct)
    start = 0
    for n in DOCS[0]:
        piece = slice(start, start + n)
        alone = functools.partial(fn, **kw)
        sub = [x[:1, piece] for x in (q, k, v, ct)]
        assert _err(out[:1, piece], jax.jit(alone)(*sub[:3])) <= 1e-5
        for name, g, w in zip("qkv", grads, _grads(alone, *sub)):
            assert _err(g[:1, piece], w) <= 1e-5, (name, n)
        start += n


def test_segment_mask_and_errors():
    seg = jnp.asarray([[1, 1, 2, 2]], jnp.int32)
    mask = attention_mask(4, 4, causal=True, segment_ids=seg)
    want = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]], bool)
    np.testing.assert_array_equal(np.asarray(mask[0]), want)
    q = jnp.zeros((1, 4, 2, 16))
    with pytest.raises(ValueError, match="segment_ids.shape"):
        flash_attention(q, q, q, segment_ids=jnp.zeros((1, 3), jnp.int32))
    with pytest.raises(ValueError, match="segment_ids.shape"):
        flash_attention(q, jnp.zeros((1, 8, 2, 16)), jnp.zeros((1, 8, 2, 16)), segment_ids=seg)
