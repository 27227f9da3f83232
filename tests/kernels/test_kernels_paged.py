"""The Pallas paged decode kernel against the gather-path reference: shuffled page tables, ragged lengths (a row
ending mid-page, an empty row, pages listed past the length), splits, GQA groups, soft-cap and residuals; and it
lowers to Triton for CUDA."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lcx.kernels.paged_decode import gather_pages, paged_decode_attention, paged_decode_reference
from tests.conftest import default_precision_atol
from tests.kernels.test_kernels_mode import _lower_for_cuda

pytestmark = pytest.mark.pallas

B, H, KV, PAGE, D, POOL, ROW_PAGES = 3, 8, 2, 16, 32, 13, 5


def _case(seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    q = 2.0 * jax.random.normal(ks[0], (B, H, D))
    k, v = (jax.random.normal(key, (POOL, KV, PAGE, D)) for key in ks[1:])
    perm = np.random.default_rng(seed).permutation(POOL)  # rows' pages scattered over the pool, shared page 0
    table = np.stack([perm[:ROW_PAGES], np.r_[perm[0], perm[5:9]], perm[8:13]]).astype(np.int32)
    table[2, 1:] = -1  # row 2 has one page
    lengths = np.asarray([70, 37, 0], np.int32)  # mid-page, mid-page (pages 3 and 4 listed, unused), empty
    return q, k, v, jnp.asarray(table), jnp.asarray(lengths)


@pytest.mark.slow
@pytest.mark.parametrize("split, softcap", [(None, None), (1, 3.0), (2, None)])
def test_paged_decode_equals_the_gather_reference(split, softcap):
    q, k, v, table, lengths = _case()
    got, m, l = paged_decode_attention(q, k, v, table=table, lengths=lengths, softcap=softcap, pages_per_split=split,
                                       return_residuals=True)
    want, m_ref, l_ref = paged_decode_reference(q, k, v, table=table, lengths=lengths, softcap=softcap,
                                                return_residuals=True)
    np.testing.assert_allclose(got, want, atol=2e-5)
    assert np.all(np.asarray(got[2]) == 0) and np.all(np.isneginf(m[2])) and np.all(l[2] == 0)  # the empty row
    seen = np.isfinite(m_ref)
    np.testing.assert_allclose(np.where(seen, m, 0), np.where(seen, m_ref, 0), atol=2e-5)
    np.testing.assert_allclose(l, l_ref, rtol=2e-5)


def test_gather_pages_is_the_rows_positions_in_order():
    _, k, _, table, _ = _case()
    view = gather_pages(k, table)  # [b, k, T * c, d]
    np.testing.assert_array_equal(view[1, :, PAGE:2 * PAGE], k[table[1, 1]])  # position 16.. of row 1


def test_paged_decode_lowers_to_triton_for_cuda():
    from lcx.kernels.quant import quantize

    q, k, v, table, lengths = _case()
    fn = lambda q, k, v, t, n: paged_decode_attention(q, k, v, table=t, lengths=n, interpret=False)  # noqa: E731
    assert _lower_for_cuda(fn, q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), table,
                           lengths) == 1
    (kc, ks), (vc, vs) = quantize(k, "int8"), quantize(v, "int8")  # an 8-bit pool: codes and scales per page
    fn8 = lambda q, k, v, ks, vs, t, n: paged_decode_attention(q, k, v, table=t, lengths=n, k_scale=ks,  # noqa
                                                               v_scale=vs, interpret=False)
    assert _lower_for_cuda(fn8, q.astype(jnp.bfloat16), kc, vc, ks, vs, table, lengths) == 1


@pytest.mark.parametrize("impl", ["reference", "xla", "pallas"])
@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_every_backend_row_reads_pages(impl, kv_dtype):
    """The paged cache's decode op: Pallas reads the pool in place, the others gather; one ``Attended``. An 8-bit
    pool (codes and per-slot scales ``[P, k, c]``) gives the attention of the values its codes stand for."""
    from lcx.kernels import BACKENDS
    from lcx.kernels.quant import dequantize, quantize

    q, k, v, table, lengths = _case(seed=1)
    scales = {}
    if kv_dtype is not None:
        (k, k_scale), (v, v_scale) = quantize(k, kv_dtype), quantize(v, kv_dtype)
        scales = dict(k_scale=k_scale, v_scale=v_scale)
    res = BACKENDS[impl].paged_decode(q, k, v, table=table, lengths=lengths, sm_scale=0.2, residuals=True, **scales)
    values = (k, v) if kv_dtype is None else (dequantize(k, scales["k_scale"]), dequantize(v, scales["v_scale"]))
    want, m_ref, _ = paged_decode_reference(q, *values, table=table, lengths=lengths, sm_scale=0.2,
                                            return_residuals=True)
    # xla gathers into its decode, whose dots run at Precision.DEFAULT: TF32 on a GPU (tests/conftest.py)
    np.testing.assert_allclose(res.out, want, atol=default_precision_atol(2e-5) if impl == "xla" else 2e-5)
    assert res.m.shape == m_ref.shape and res.weights is None
