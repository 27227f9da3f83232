"""The attention backend table: one row per implementation, the list of valid ``attention.impl`` values derived from
it, ``auto`` resolving to XLA on CPU, and every row agreeing with the reference on the four functions."""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lcx
from lcx import kernels
from lcx.config import ConfigError
from tests.conftest import default_precision_atol

pytestmark = pytest.mark.pallas


def test_backends_impls_derive_from_the_table():
    assert kernels.IMPLS == ("auto", *kernels.BACKENDS)
    assert set(kernels.BACKENDS) == {"reference", "xla", "pallas", "cudnn"}
    with pytest.raises(ConfigError, match=r"attention.impl='flash3' is invalid: must be one of \['auto', "):
        lcx.AttentionConfig(impl="flash3")
    assert lcx.AttentionConfig().impl == "auto"


def test_backends_auto_is_xla_on_cpu_and_cudnn_or_pallas_on_gpu():
    from lcx.kernels.cudnn import cuda_gpu

    # this suite also runs on a GPU machine: cuDNN (and the Pallas kernels) on NVIDIA, the Pallas kernels elsewhere
    expected = ("cudnn" if cuda_gpu() else "pallas") if jax.default_backend() == "gpu" else "xla"
    assert kernels.resolve("auto") == expected and kernels.backend("auto") is kernels.BACKENDS[expected]


def test_backends_bit_packed_kernels_run_compiled_at_power_of_two_head_dims_else_take_the_xla_ops(monkeypatch):
    """The Pallas kernels on the codes run interpreted at any head dim; compiled (Triton, a GPU) at the head dims
    Triton takes (powers of two: tests/kernels/test_cuda_lowering.py lowers them), and a model with another head dim
    takes the fused XLA decode and dequantizes a chunk's layer."""
    from lcx.kernels import backends
    from lcx.kernels.lowbit_decode import decode_lowbit
    from lcx.kernels.lowbit_pallas import chunk_lowbit_tiles, decode_lowbit_tiles

    pallas = kernels.BACKENDS["pallas"]
    monkeypatch.setattr(backends, "resolve_interpret", lambda interpret: True)
    assert pallas.lowbit_ops(80) == (decode_lowbit_tiles, chunk_lowbit_tiles)
    monkeypatch.setattr(backends, "resolve_interpret", lambda interpret: False)
    assert pallas.lowbit_ops(64) == pallas.lowbit_ops(256) == (decode_lowbit_tiles, chunk_lowbit_tiles)
    assert pallas.lowbit_ops(80) == (decode_lowbit, None)
    assert kernels.BACKENDS["xla"].lowbit_ops(64) == (decode_lowbit, None)


@pytest.mark.cpu_only  # on a GPU the default is the compiled kernels
def test_backends_default_generation_on_cpu_runs_no_pallas_kernel():
    cfg = lcx.ModelConfig(vocab_size=40, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=32)
    params = lcx.init_params(cfg, jax.random.key(0))
    cache = lcx.CacheConfig().kind(cfg).create(1, 8)
    step = lambda p, ids, c: lcx.Decoder(cfg).apply({"params": p}, ids, cache=c)  # noqa: E731
    default = str(jax.make_jaxpr(step)(params, jnp.ones((1, 1), jnp.int32), cache))
    assert "pallas_call" not in default
    cfg_p = dataclasses.replace(cfg, attention=lcx.AttentionConfig(impl="pallas"))
    forced = str(jax.make_jaxpr(lambda p, ids, c: lcx.Decoder(cfg_p).apply({"params": p}, ids, cache=c))(
        params, jnp.ones((1, 1), jnp.int32), lcx.CacheConfig().kind(cfg_p).create(1, 8)))
    assert "pallas_call" in forced  # the check can fail


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_backends_rows_agree_with_the_reference(impl):
    ks = jax.random.split(jax.random.key(1), 4)
    b, t, s, h, kv, d = 2, 6, 40, 4, 2, 16
    q = jax.random.normal(ks[0], (b, t, h, d))
    k = jax.random.normal(ks[1], (b, s, kv, d))
    v = jax.random.normal(ks[2], (b, s, kv, d))
    off, lens = jnp.array([3, 30]), jnp.array([9, 36])
    weights = jnp.array([[0, 0, 1, 1, 1, 1], [1, 0, 1, 0, 1, 1]], jnp.float32)
    valid = jax.random.uniform(ks[3], (b, s)) < 0.7
    ref, got = kernels.BACKENDS["reference"], kernels.BACKENDS[impl]
    scale = d ** -0.5
    # the xla row's decode runs its dots at Precision.DEFAULT: TF32 on a GPU (tests/conftest.py, TF32_ATOL); its
    # chunk, column sums and causal leave the precision to jax's default (HIGHEST in the tests) on every platform
    decode_tol = default_precision_atol(2e-5) if impl == "xla" else 2e-5
    for name, args in (("chunk", dict(q_offsets=off, kv_lengths=lens)),):
        chex.assert_trees_all_close(getattr(got, name)(q, k, v, sm_scale=scale, **args),
                                    getattr(ref, name)(q, k, v, sm_scale=scale, **args), atol=2e-5, rtol=2e-5)
    k_c, v_c = k.swapaxes(1, 2), v.swapaxes(1, 2)  # decode reads the cache's [b, k, s, d]
    chex.assert_trees_all_close(got.decode(q[:, 0], k_c, v_c, valid=valid, sm_scale=scale, weights=True),
                                ref.decode(q[:, 0], k_c, v_c, valid=valid, sm_scale=scale, weights=True),
                                atol=decode_tol, rtol=decode_tol)
    chex.assert_trees_all_close(
        got.column_sums(q, k, q_offsets=off, kv_lengths=lens, query_weights=weights, sm_scale=scale),
        ref.column_sums(q, k, q_offsets=off, kv_lengths=lens, query_weights=weights, sm_scale=scale),
        atol=2e-5, rtol=2e-5)
    causal = got.causal(q, k[:, :t], v[:, :t], sm_scale=scale)
    np.testing.assert_allclose(np.asarray(causal), np.asarray(ref.causal(q, k[:, :t], v[:, :t], sm_scale=scale)),
                               atol=2e-5)


@pytest.mark.slow
@pytest.mark.cpu_only  # the query blocks are XLA:CPU's path; a GPU takes jax.nn.dot_product_attention
@pytest.mark.parametrize("t, segments, max_blocks", [(300, False, 16), (300, True, 16), (300, False, 2)])
def test_backends_xla_causal_on_cpu_runs_query_blocks_and_agrees_with_the_reference(t, segments, max_blocks,
                                                                                  monkeypatch):
    """Long enough sequences take the CPU query-block path (300 tokens: 64-token blocks with a ragged last one; with
    at most 2 blocks, 150-token blocks: the cap longer sequences hit); values and gradients equal the reference's,
    packed segments included. Shorter ones keep the dense path."""
    from lcx.kernels import backends

    monkeypatch.setattr(backends, "CPU_MAX_BLOCKS", max_blocks)
    assert t >= backends.CPU_MIN_LENGTH
    ks = jax.random.split(jax.random.key(2), 5)
    q = jax.random.normal(ks[0], (2, t, 4, 16))
    k = jax.random.normal(ks[1], (2, t, 2, 16))
    v = jax.random.normal(ks[2], (2, t, 2, 16))
    seg = jnp.cumsum(jax.random.bernoulli(ks[3], 0.02, (2, t)), axis=1) if segments else None
    ref, xla = kernels.BACKENDS["reference"].causal, kernels.BACKENDS["xla"].causal
    jaxpr = str(jax.make_jaxpr(lambda q, k, v: xla(q, k, v, sm_scale=0.25, segment_ids=seg))(q, k, v))
    assert f"{t},{t}]" not in jaxpr and jaxpr.count("concatenate") == 1  # no [t, t] scores
    assert jaxpr.count("exp ") == -(-t // max(backends.CPU_QUERY_BLOCK, -(-t // max_blocks)))  # one softmax per block
    cot = jax.random.normal(ks[4], q.shape)
    loss = lambda fn: lambda q, k, v: jnp.sum(fn(q, k, v, sm_scale=0.25, segment_ids=seg) * cot)  # noqa: E731
    chex.assert_trees_all_close(xla(q, k, v, sm_scale=0.25, segment_ids=seg),
                                ref(q, k, v, sm_scale=0.25, segment_ids=seg), atol=1e-5, rtol=1e-5)
    grads = lambda fn: jax.jit(jax.grad(loss(fn), argnums=(0, 1, 2)))(q, k, v)  # noqa: E731
    chex.assert_trees_all_close(grads(xla), grads(ref), atol=1e-4, rtol=1e-4)
    short = str(jax.make_jaxpr(lambda q: xla(q, q[:, :, :2], q[:, :, :2], sm_scale=0.25))(q[:, :255]))
    assert "255,255]" in short and "concatenate" not in short  # dense [t, t] scores
