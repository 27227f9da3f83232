"""Interpret-vs-compiled selection, and the compiled (Triton) GPU path built as far as a CPU-only machine allows.

Lowering for the "cuda" platform on CPU runs the whole Pallas -> Triton IR lowering of every kernel (tile shapes,
power-of-two sizes, supported primitives, dot shapes) and we verify each Triton module; only PTX generation and a
run need a GPU. Skipped where this jax cannot lower for CUDA without a GPU (newer jaxlibs compile to PTX at lowering).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from lcx.kernels import attention_column_sums, decode_attention, flash_attention, resolve_interpret
from lcx.kernels.mode import pallas_call_kwargs, triton_compiler_params

pytestmark = pytest.mark.pallas


def test_interpret_is_chosen_from_the_backend():
    assert resolve_interpret(None) is (jax.default_backend() != "gpu")
    assert resolve_interpret(True) is True and resolve_interpret(False) is False
    with pytest.raises(ValueError, match="interpret="):
        resolve_interpret("yes")
    assert pallas_call_kwargs(True, num_warps=4, num_stages=2) == {"interpret": True, "compiler_params": None}
    compiled = pallas_call_kwargs(False, num_warps=8, num_stages=3)
    assert compiled["interpret"] is False
    params = compiled["compiler_params"]
    assert type(params).__module__.startswith("jax._src.pallas.triton")  # Triton, not Mosaic GPU
    assert (params.num_warps, params.num_stages) == (8, 3)
    with pytest.raises(ValueError, match="num_warps"):
        triton_compiler_params(num_warps=3, num_stages=2)


def _lower_for_cuda(fn, *args):
    """Lower ``fn`` for CUDA; return how many Triton modules were built, each verified."""
    from jax._src.pallas.triton import lowering

    built = []
    original = lowering.lower_jaxpr_to_triton_module

    def verified(*a, **kw):
        result = original(*a, **kw)
        assert result.module.operation.verify()
        built.append(result)
        return result

    lowering.lower_jaxpr_to_triton_module = verified
    try:
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    except Exception as e:  # noqa: BLE001
        if built and "compile" in repr(e).lower():
            pytest.skip(f"this jaxlib compiles Triton to PTX at lowering, which needs a GPU: {e!r:.200}")
        raise
    finally:
        lowering.lower_jaxpr_to_triton_module = original
    assert "triton" in text
    return len(built)


@pytest.mark.parametrize("d,dtype,window,lens,g", [(128, jnp.bfloat16, None, False, 4),
                                                   (80, jnp.float16, 256, True, 1),
                                                   (64, jnp.float32, None, True, 8)])
def test_flash_lowers_to_triton(d, dtype, window, lens, g):
    q = jax.ShapeDtypeStruct((2, 1000, 8, d), dtype)
    k = jax.ShapeDtypeStruct((2, 1000, 8 // g, d), dtype)
    kl = jax.ShapeDtypeStruct((2,), jnp.int32) if lens else None

    def grads(q, k, v, kl):
        loss = lambda q, k, v: jnp.sum(flash_attention(q, k, v, window=window, kv_lengths=kl,  # noqa: E731
                                                       interpret=False).astype(jnp.float32))
        return jax.grad(loss, (0, 1, 2))(q, k, v)

    assert _lower_for_cuda(grads, q, k, k, kl) == 3  # forward, dQ, dK/dV


@pytest.mark.parametrize("h,kv,d,weights", [(32, 8, 128, True), (6, 2, 80, True), (8, 8, 64, False)])
def test_decode_and_column_sums_lower_to_triton(h, kv, d, weights):
    q = jax.ShapeDtypeStruct((2, h, d), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, kv, 4096, d), jnp.bfloat16)  # decode: the cache's [b, k, s, d]
    valid = jax.ShapeDtypeStruct((2, 4096), jnp.bool_)
    lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
    fn = lambda q, k, v, m, n: decode_attention(q, k, v, valid=m, lengths=n, return_weights=weights,  # noqa: E731
                                                interpret=False)
    assert _lower_for_cuda(fn, q, k, k, valid, lengths) == 1
    qw = jax.ShapeDtypeStruct((2, 32, h, d), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 4096, kv, d), jnp.bfloat16)  # column sums: [b, s, k, d]
    assert _lower_for_cuda(lambda q, k: attention_column_sums(q, k, interpret=False), qw, k) == 2
