"""The Pallas kernels lower for CUDA on a CPU-only machine (issue 62, first part).

``jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))`` runs Pallas' Triton lowering without a GPU runtime,
so a kernel that a GPU would refuse to compile (an op Triton lacks, a block whose size is not a power of two) fails
here, in CI. Shapes are the real models' (SmolLM2-135M: 9 query / 3 KV heads, head_dim 64; Gemma-3-270M: 4 / 1,
head_dim 256), not only powers of two. Only abstract shapes are used: nothing is allocated or run.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from lcx.kernels.decode import decode_attention
from lcx.kernels.flash import flash_attention
from lcx.kernels.paged_decode import paged_decode_attention

S = jax.ShapeDtypeStruct
SHAPES = {"smollm2": (9, 3, 64), "gemma3": (4, 1, 256)}  # query heads, KV heads, head_dim


def lower_for_cuda(f, *args) -> str:
    """The StableHLO text of ``f`` lowered for CUDA (its Pallas calls through Triton)."""
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _triton_calls(text: str) -> int:
    return text.count("__gpu$xla.gpu.triton")


@pytest.mark.parametrize("model", list(SHAPES))
def test_flash_forward_and_backward_lower_for_cuda(model):
    h, kv, d = SHAPES[model]
    q, k = S((1, 512, h, d), jnp.bfloat16), S((1, 512, kv, d), jnp.bfloat16)
    forward = lambda q, k, v: flash_attention(q, k, v, interpret=False)  # noqa: E731
    backward = jax.grad(lambda q, k, v: forward(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    assert _triton_calls(lower_for_cuda(forward, q, k, k)) >= 1
    assert _triton_calls(lower_for_cuda(backward, q, k, k)) >= 2  # the forward and the backward kernels


@pytest.mark.parametrize("model", list(SHAPES))
def test_decode_and_paged_decode_lower_for_cuda(model):
    h, kv, d = SHAPES[model]
    q, k = S((2, h, d), jnp.bfloat16), S((2, kv, 1024, d), jnp.bfloat16)
    lengths = S((2,), jnp.int32)
    decode = lambda q, k, v, n: decode_attention(q, k, v, lengths=n, interpret=False)  # noqa: E731
    assert _triton_calls(lower_for_cuda(decode, q, k, k, lengths)) >= 1
    pages, table = S((64, kv, 16, d), jnp.bfloat16), S((2, 32), jnp.int32)
    paged = lambda q, kp, vp, t, n: paged_decode_attention(q, kp, vp, table=t, lengths=n, interpret=False)  # noqa: E731
    assert _triton_calls(lower_for_cuda(paged, q, pages, pages, table, lengths)) >= 1


def test_a_kernel_triton_cannot_compile_fails_the_lowering():
    """The check can fail: a Pallas kernel whose block is not a power of two (what broke the bit-packed prefill chunk
    at SmolLM2's 16 queries x 3 heads) is refused by the CUDA lowering on this CPU."""
    from jax.experimental import pallas as pl

    from lcx.kernels.mode import triton_compiler_params

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2

    def broken(x):
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=False,
                              compiler_params=triton_compiler_params(num_warps=4, num_stages=1))(x)

    with pytest.raises(Exception, match="power of (2|two)"):
        lower_for_cuda(broken, S((48, 64), jnp.float32))
    assert _triton_calls(lower_for_cuda(broken, S((64, 64), jnp.float32))) == 1  # the same kernel at a power of two
