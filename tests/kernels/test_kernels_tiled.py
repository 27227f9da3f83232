"""``lcx.kernels.tiled.tiled_attention`` (the ``xla`` backend's ``chunk``): an online softmax over the key tiles a
query block can see, against the masked dense reference - outputs and residuals, per-row and per-KV-head offsets
and lengths, causal and not, empty rows, several tiles in both the unmasked and the masked loop."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lcx.kernels.reference import attention_mask, masked_attention_parts
from lcx.kernels.tiled import tiled_attention

CASES = {
    # b, t, s, heads, kv heads, q_offsets, kv_lengths, causal; tiles of 8 queries x 16 keys
    "first chunk (causal triangle)": (2, 40, 40, 4, 2, [0, 0], [40, 33], True),
    "later chunk per row": (2, 20, 100, 6, 2, [0, 70], [20, 90], True),
    "per KV head": (2, 20, 100, 6, 2, [[0, 5], [70, 41]], [[20, 25], [90, 61]], True),
    "not causal, an empty row": (3, 7, 50, 4, 1, [0, 0, 0], [0, 33, 50], False),
    "queries past the keys' tiles": (1, 24, 30, 2, 2, [6], [30], True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tiled_attention_equals_masked_reference(case):
    b, t, s, h, k, offsets, lengths, causal = CASES[case]
    rng = np.random.default_rng(len(case))
    q, key, val = (jnp.asarray(rng.normal(size=shape), jnp.float32)
                   for shape in ((b, t, h, 16), (b, s, k, 16), (b, s, k, 16)))
    offsets, lengths = jnp.asarray(offsets, jnp.int32), jnp.asarray(lengths, jnp.int32)
    o, m, l = tiled_attention(q, key, val, q_offsets=offsets, kv_lengths=lengths, sm_scale=0.3, causal=causal,
                              residuals=True, block_q=8, block_k=16)
    mask = attention_mask(t, s, causal=causal, kv_lengths=lengths, batch=b, q_offsets=offsets)
    ro, rm, rl = masked_attention_parts(q, key, val, mask, sm_scale=0.3)
    np.testing.assert_allclose(o, ro, atol=2e-6)
    np.testing.assert_array_equal(np.isfinite(m), np.isfinite(rm))  # empty rows: -inf in both
    seen = np.isfinite(rm)
    np.testing.assert_allclose(np.where(seen, m, 0), np.where(seen, rm, 0), atol=2e-6)
    np.testing.assert_allclose(l * np.exp(np.where(seen, m - rm, 0)), rl, rtol=2e-6)  # the same sum at either max
    plain = tiled_attention(q, key, val, q_offsets=offsets, kv_lengths=lengths, sm_scale=0.3, causal=causal,
                            block_q=8, block_k=16)
    np.testing.assert_array_equal(plain, o)


def test_tiled_attention_bfloat16_inputs_accumulate_in_float32():
    rng = np.random.default_rng(0)
    q, key, val = (jnp.asarray(rng.normal(size=shape), jnp.bfloat16) for shape in ((1, 12, 4, 16), (1, 30, 2, 16),
                                                                                    (1, 30, 2, 16)))
    offsets, lengths = jnp.asarray([18]), jnp.asarray([30])
    out = tiled_attention(q, key, val, q_offsets=offsets, kv_lengths=lengths, sm_scale=0.25, block_q=4, block_k=8)
    assert out.dtype == jnp.bfloat16
    mask = attention_mask(12, 30, causal=True, kv_lengths=lengths, batch=1, q_offsets=offsets)
    ref = masked_attention_parts(q, key, val, mask, sm_scale=0.25)[0]
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, atol=2e-2)


def test_tiled_attention_visits_only_the_filled_tiles():
    """Keys past every row's length are never read: NaN there changes nothing (a dense softmax over the whole
    capacity would multiply them by 0 and return NaN)."""
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.normal(size=(2, 8, 4, 16)), jnp.float32)
    key, val = (jnp.asarray(rng.normal(size=(2, 64, 2, 16)), jnp.float32) for _ in range(2))
    poisoned_k, poisoned_v = key.at[:, 32:].set(jnp.nan), val.at[:, 32:].set(jnp.nan)
    args = dict(q_offsets=jnp.asarray([10, 20]), kv_lengths=jnp.asarray([18, 28]), sm_scale=0.25, block_q=4,
                block_k=16)
    out = jax.jit(lambda k, v: tiled_attention(q, k, v, **args))(poisoned_k, poisoned_v)
    np.testing.assert_array_equal(out, tiled_attention(q, key, val, **args))
