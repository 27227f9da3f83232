"""flash_attention with per-row ``q_offsets``: a ragged prefill chunk attending into a KV cache.

Row b's queries sit at key positions ``q_offsets[b] + i``; ``kv_lengths[b]`` ends its keys. Checked against the fp32
HIGHEST reference (forward and gradients), against the default end alignment (bit-identical), and the tile ranges
exhaustively against the element mask for offsets before, inside and past the keys.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lcx.kernels import FlashBlockSizes, attention_mask, attention_reference, flash_attention
from lcx.kernels.flash import make_static
from lcx.kernels.flash_masks import key_block_ranges, query_block_ranges, tile_mask
from tests.conftest import tiered

pytestmark = pytest.mark.pallas

B16 = FlashBlockSizes(block_q=16, block_k=16, block_q_dkv=16, block_k_dkv=16, block_q_dq=16, block_k_dq=16)
TOL = {jnp.float32: 1e-4, jnp.bfloat16: 2e-2}
# A chunk of 17 queries appended at slots [n_b, n_b + 17) of a 64-slot cache with 17, 12 and 3 real tokens.
OFFSETS = jnp.array([0, 5, 37], jnp.int32)
LENGTHS = OFFSETS + jnp.array([17, 12, 3], jnp.int32)


def _inputs(h, kv, d, dtype, *, b=3, t=17, s=64, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (b, t, h, d), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (b, s, kv, d), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (b, s, kv, d), jnp.float32).astype(dtype)
    return q, k, v, jax.random.normal(ks[3], (b, t, h, d), jnp.float32)


def _err(x, y):
    return float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32))))


def _grads(fn, q, k, v, ct):
    return jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * ct), (0, 1, 2)))(q, k, v)


# (causal, window, q_heads, kv_heads, head_dim, dtype)
CASES = [(True, None, 4, 4, 64, jnp.float32), (True, 8, 4, 1, 80, jnp.float32), (False, 6, 4, 1, 64, jnp.float32),
         (True, None, 8, 2, 80, jnp.bfloat16)]


@pytest.mark.parametrize("causal,window,h,kv,d,dtype", tiered(CASES, fast={1}))
def test_flash_offsets_forward_and_gradients_match_reference(causal, window, h, kv, d, dtype):
    q, k, v, ct = _inputs(h, kv, d, dtype)
    kw = dict(causal=causal, window=window, kv_lengths=LENGTHS, q_offsets=OFFSETS)
    flash = functools.partial(flash_attention, block_sizes=B16, **kw)
    ref = functools.partial(attention_reference, **kw)
    out, want = jax.jit(flash)(q, k, v), jax.jit(ref)(q, k, v)
    assert out.shape == q.shape and out.dtype == q.dtype and not jnp.isnan(out).any()
    assert _err(out, want) <= TOL[dtype]
    if dtype != jnp.float32:
        return
    for name, g, w in zip("qkv", _grads(flash, q, k, v, ct), _grads(ref, q, k, v, ct)):
        assert g.shape == w.shape and not jnp.isnan(g).any(), name
        assert _err(g, w) <= TOL[dtype] * max(1.0, float(jnp.max(jnp.abs(w)))), (name, _err(g, w))


def test_flash_offsets_row_that_sees_nothing_is_zero():
    q, k, v, ct = _inputs(2, 1, 64, jnp.float32, seed=1)
    kw = dict(causal=True, kv_lengths=jnp.array([0, 17, 40]), q_offsets=jnp.array([0, 0, 30]))
    flash = functools.partial(flash_attention, block_sizes=B16, **kw)
    out = flash(q, k, v)
    np.testing.assert_array_equal(np.asarray(out[0]), 0.0)
    assert _err(out, attention_reference(q, k, v, **kw)) <= 1e-4
    dq, dk, dv = _grads(flash, q, k, v, ct)
    for g in (dq, dk, dv):
        assert jnp.isfinite(g).all()
    np.testing.assert_array_equal(np.asarray(dq[0]), 0.0)
    np.testing.assert_array_equal(np.asarray(dk[0]), 0.0)
    np.testing.assert_array_equal(np.asarray(dv[0]), 0.0)


@pytest.mark.parametrize("window,lengths", [(None, None), (7, (64, 50, 20))])
def test_flash_end_aligned_offsets_equal_default(window, lengths):
    q, k, v, ct = _inputs(4, 2, 64, jnp.float32, seed=2)
    kl = None if lengths is None else jnp.array(lengths)
    flash = functools.partial(flash_attention, causal=True, window=window, kv_lengths=kl, block_sizes=B16)
    end = functools.partial(flash, q_offsets=jnp.full((3,), 64 - 17))
    np.testing.assert_array_equal(np.asarray(jax.jit(end)(q, k, v)), np.asarray(jax.jit(flash)(q, k, v)))
    for g, w in zip(_grads(end, q, k, v, ct), _grads(flash, q, k, v, ct)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("causal,window", [(True, None), (True, 5), (True, 20), (False, 5), (False, None)])
@pytest.mark.parametrize("bq,bk", [(16, 16), (32, 16), (16, 32)])
def test_flash_tile_ranges_never_skip_a_visible_key(causal, window, bq, bk):
    # q_len 17, kv_len 61: ragged last tiles on both sides. Offsets from before the first key to past the last.
    t, s = 17, 61
    st = make_static(t, s, 1, 64, jnp.float32, causal=causal, sm_scale=None, window=window, has_lengths=True,
                     block_sizes=B16, interpret=True, has_offsets=True)
    n_qb, n_kb = -(-t // bq), -(-s // bk)
    rows, cols = jnp.arange(n_qb * bq), jnp.arange(n_kb * bk)

    @jax.jit
    @jax.vmap
    def ranges(off, kl):
        fwd = jax.vmap(lambda i: jnp.stack(key_block_ranges(st, i * bq, bq, bk, n_kb, kl, off)))(jnp.arange(n_qb))
        bwd = jax.vmap(lambda i: jnp.stack(query_block_ranges(st, i * bk, bq, bk, n_qb, kl, off)))(jnp.arange(n_kb))
        return fwd, bwd, tile_mask(st, rows, cols, kl, off=off), tile_mask(st, rows, cols, kl, row_valid=True, off=off)

    offs, kls = (a.ravel() for a in np.meshgrid(np.arange(-25, 90), [0, 1, 16, 30, 61]))
    fwd, bwd, vis, vis_rows = (np.asarray(x) for x in ranges(jnp.asarray(offs), jnp.asarray(kls)))
    for fr, br, m, mr in zip(fwd, bwd, vis, vis_rows):
        for tiles, rng, n in ((m.reshape(n_qb, bq, n_kb, bk).transpose(0, 2, 1, 3), fr, n_kb),
                              (mr.reshape(n_qb, bq, n_kb, bk).transpose(2, 0, 1, 3), br, n_qb)):
            for i, (lo, lo_full, hi_full, hi) in enumerate(rng):  # tiles[i]: [n, ...] the tiles of loop i
                assert 0 <= lo <= lo_full <= hi_full <= hi <= n
                idx = np.arange(n)
                assert not tiles[i][(idx < lo) | (idx >= hi)].any()
                assert tiles[i][(idx >= lo_full) & (idx < hi_full)].all()


def test_attention_mask_offsets():
    mask = attention_mask(3, 6, causal=True, window=2, kv_lengths=jnp.array([6, 2]), batch=2,
                          q_offsets=jnp.array([3, 0]))
    want = np.zeros((2, 3, 6), bool)
    for i in range(3):
        want[0, i, max(0, 3 + i - 1):3 + i + 1] = True  # positions 3, 4, 5: two keys back
        want[1, i, max(0, i - 1):min(i + 1, 2)] = True  # positions 0, 1, 2; only keys < 2
    np.testing.assert_array_equal(np.asarray(mask), want)
    end = attention_mask(3, 6, causal=True, window=2, batch=2, q_offsets=jnp.array([3, 3]))
    np.testing.assert_array_equal(np.asarray(end), np.asarray(attention_mask(3, 6, causal=True, window=2, batch=2)))


def test_flash_offsets_input_errors():
    q, k, v, _ = _inputs(2, 1, 16, jnp.float32, b=2)
    with pytest.raises(ValueError, match=r"q_offsets.shape=\(3,\) must be \(2,\)"):
        flash_attention(q, k, v, q_offsets=jnp.array([0, 1, 2]))
    with pytest.raises(ValueError, match="q_offsets.dtype=float32 must be an integer"):
        flash_attention(q, k, v, q_offsets=jnp.array([0.0, 1.0]))


def test_flash_offsets_lower_to_triton():
    from jax._src.pallas.triton import lowering

    built, original = [], lowering.lower_jaxpr_to_triton_module

    def verified(*a, **kw):
        result = original(*a, **kw)
        assert result.module.operation.verify()
        built.append(result)
        return result

    def grads(q, k, v, kl, offs):
        loss = lambda q, k, v: jnp.sum(flash_attention(q, k, v, window=256, kv_lengths=kl, q_offsets=offs,  # noqa
                                                       interpret=False).astype(jnp.float32))
        return jax.grad(loss, (0, 1, 2))(q, k, v)

    q = jax.ShapeDtypeStruct((2, 200, 8, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 1000, 2, 128), jnp.bfloat16)
    ints = jax.ShapeDtypeStruct((2,), jnp.int32)
    lowering.lower_jaxpr_to_triton_module = verified
    try:
        text = jax.jit(grads).trace(q, k, k, ints, ints).lower(lowering_platforms=("cuda",)).as_text()
    except Exception as e:  # noqa: BLE001
        if built and "compile" in repr(e).lower():
            pytest.skip(f"this jaxlib compiles Triton to PTX at lowering, which needs a GPU: {e!r:.200}")
        raise
    finally:
        lowering.lower_jaxpr_to_triton_module = original
    assert "triton" in text and len(built) == 3  # forward, dQ, dK/dV
