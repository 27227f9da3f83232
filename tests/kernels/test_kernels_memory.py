"""Memory, from XLA's compiled memory analysis (not timing): flash forward + backward is linear in the sequence
length, the reference (which materialises the scores) is quadratic.

On CPU the kernels run in Pallas interpret mode, which lowers each kernel to an HLO loop over the grid with the
same operands as on GPU, so the temp buffers are the padded copies, residuals (o, lse, delta) and gradient
outputs: O(T). Measured on jax 0.10.2 (b=1, h=4, kv=2, d=64, fp32): flash 11.8 / 23.6 / 47.3 MB at 1k / 2k / 4k
tokens, the reference 86 / 340 / 1351 MB.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lcx.kernels import attention_reference, flash_attention
import pytest

pytestmark = pytest.mark.pallas


def _fwd_bwd_temp_bytes(attn, n: int) -> int:
    q = jax.ShapeDtypeStruct((1, n, 4, 64), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, n, 2, 64), jnp.float32)

    def grads(q, k, v):
        return jax.grad(lambda q, k, v: jnp.sum(attn(q, k, v)), (0, 1, 2))(q, k, v)

    return jax.jit(grads).lower(q, kv, kv).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.slow
def test_flash_temp_memory_is_linear_and_reference_quadratic():
    flash = [_fwd_bwd_temp_bytes(lambda q, k, v: flash_attention(q, k, v, causal=True), n) for n in (1024, 2048, 4096)]
    ref = [_fwd_bwd_temp_bytes(lambda q, k, v: attention_reference(q, k, v, causal=True), n)
           for n in (1024, 2048, 4096)]
    assert all(x > 0 for x in flash + ref)
    assert flash[2] / flash[0] < 6, flash  # 4x tokens: ~4x memory
    assert 1.5 < flash[1] / flash[0] < 3, flash
    assert ref[2] / ref[0] > 10, ref  # ~16x: the [b, h, T, T] scores and probabilities
    assert flash[2] < ref[2] / 10, (flash, ref)
