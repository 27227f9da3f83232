"""Every compiled entry point lowers for CUDA on a CPU-only machine (issue 62).

``jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))`` inside ``lcx.kernels.mode.lowering_for("gpu")``
runs Pallas' Triton lowering without a GPU runtime and makes every trace-time platform choice the GPU's, so a kernel
that a GPU would refuse to compile (an op Triton lacks, a block whose size is not a power of two) fails here, in CI:
the kernels one by one (flash forward / backward, split-K decode, paged decode, the bit-packed decode and chunk
kernels) and the programs that call them (a train step, a prefill chunk, a decode loop, a server segment, over the
full, an evicting, the paged and the int4 caches). Shapes are the real models' (SmolLM2-135M: 9 query / 3 KV heads,
head_dim 64; Gemma-3-270M: 4 / 1, head_dim 256), not only powers of two. Only abstract shapes are used: nothing is
allocated or run. What stays unproven without a GPU: Triton's own compilation to PTX (after this lowering) and the
numbers - those are ``experiments/bench/gpu_check.sh``'s.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from lcx.kernels.decode import decode_attention
from lcx.kernels.flash import flash_attention
from lcx.kernels.lowbit_pallas import chunk_lowbit_tiles, decode_lowbit_tiles
from lcx.kernels.mode import lowering_for
from lcx.kernels.paged_decode import paged_decode_attention

S = jax.ShapeDtypeStruct
SHAPES = {"smollm2": (9, 3, 64), "gemma3": (4, 1, 256)}  # query heads, KV heads, head_dim


def lower_for_cuda(f, *args, **kwargs) -> str:
    """The StableHLO text of ``f`` (a function, or one already jitted) lowered for CUDA as a GPU process would trace
    it (its Pallas calls through Triton)."""
    jitted = f if hasattr(f, "trace") else jax.jit(f)
    with lowering_for("gpu"):
        return jitted.trace(*args, **kwargs).lower(lowering_platforms=("cuda",)).as_text()


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


def _packed_layer(quant: str, kv: int, d: int, slots: int, group: int = 32, residual: int = 128):
    """Abstract codes, group scales and float window of one bit-packed layer (``lcx.cache.lowbit_slots``' layout)."""
    from lcx.kernels.lowbit import LOWBIT
    from lcx.kernels.lowbit_decode import LowbitKV

    bits, groups, b = LOWBIT[quant], -(-slots // group), 2
    per_group = S((b, kv, groups, d), jnp.bfloat16)
    per_token = S((b, kv, slots, d // 32), jnp.bfloat16)
    window = S((b, kv, residual + group, d), jnp.bfloat16)
    codes = (S((b, kv, d, groups * group * bits // 8), jnp.uint8), S((b, kv, slots, d * bits // 8), jnp.uint8))
    view = LowbitKV(quant=quant, group=group, k_scale=per_group, k_zero=per_group, v_scale=per_token,
                    v_zero=per_token, k_win=window, v_win=window, win_start=S((b, kv), jnp.int32))
    return codes, view


@pytest.mark.parametrize("quant", ["int4", "int2"])
@pytest.mark.parametrize("model", list(SHAPES))
def test_bit_packed_decode_and_chunk_kernels_lower_for_cuda(model, quant):
    """The kernels on int4 / int2 codes at the real head shapes (SmolLM2's 3 query heads per KV head are padded to 4
    rows per query in the chunk kernel), with slot weights, and a capacity that is no power of two: 1,500 slots =
    47 key groups of 32."""
    h, kv, d = SHAPES[model]
    (k, v), view = _packed_layer(quant, kv, d, slots=1500)
    decode = lambda q, k, v, view, valid: decode_lowbit_tiles(  # noqa: E731
        q, k, v, view, valid=valid, sm_scale=0.125, weights=True, residuals=True, interpret=False)
    assert _triton_calls(lower_for_cuda(decode, S((2, h, d), jnp.bfloat16), k, v, view, S((2, 1500), bool))) == 1
    chunk = lambda q, k, v, view, offsets, lengths: chunk_lowbit_tiles(  # noqa: E731
        q, k, v, view, q_offsets=offsets, kv_lengths=lengths, sm_scale=0.125, residuals=True, interpret=False)
    rows = S((2,), jnp.int32)
    assert _triton_calls(lower_for_cuda(chunk, S((2, 100, h, d), jnp.bfloat16), k, v, view, rows, rows)) == 1


# --------------------------------------------------------------------------------------------------- programs
def _smollm2_shaped(**attention) -> "lcx.ModelConfig":
    import lcx
    from lcx.model.config import AttentionConfig

    return lcx.ModelConfig(vocab_size=256, d_model=128, n_layers=2, n_heads=9, n_kv_heads=3, head_dim=64, d_ff=256,
                           dtype="bfloat16", attention=AttentionConfig(**attention))


def test_a_train_step_lowers_for_cuda_with_the_flash_kernels():
    from lcx.train.config import TrainConfig
    from lcx.train.optim import make_optimizer
    from lcx.train.step import batch_struct, jit_train_step, state_struct

    model, train = _smollm2_shaped(impl="pallas"), TrainConfig(batch_size=2, seq_len=256, steps=10)
    text = lower_for_cuda(jit_train_step(model, train), state_struct(model, make_optimizer(train)),
                          batch_struct(train))
    assert _triton_calls(text) >= 3  # the forward kernel, and the backward's dQ and dK / dV kernels


CACHES = {"full": {}, "h2o": dict(policy="h2o", budget=128), "paged": dict(layout="paged"),
          "int4": dict(kv_dtype="int4", kv_group=32)}


@pytest.mark.parametrize("cache", list(CACHES))
def test_prefill_decode_and_server_programs_lower_for_cuda_and_update_the_cache_in_place(cache):
    """The engine's programs (``lcx.engine.programs``) as the Generator and the Server call them, through the Pallas
    kernels; each donates its cache, and the lowered program aliases every cache buffer to an output - a missing
    donation would copy the whole cache each step."""
    from lcx.cache.config import CacheConfig
    from lcx.engine.planning import cache_kind
    from lcx.engine.programs import programs
    from lcx.engine.sampling import RowSampling
    from lcx.engine.state import DecodeState
    from lcx.model import abstract_params

    model = _smollm2_shaped(impl="pallas")
    kind = cache_kind(model, CacheConfig(**CACHES[cache]))
    progs, params, state = programs(model, 1, 0, kind), abstract_params(model), kind.abstract(2, 512)
    b, t, vocab = 2, 64, model.vocab_size
    rows, flags = S((b,), jnp.int32), S((b,), bool)
    sampling = RowSampling(temperature=S((b,), jnp.float32), top_k=rows, top_p=S((b,), jnp.float32),
                           keys=S((b, 2), jnp.uint32))
    buffers = len(jax.tree.leaves(state))

    prefill = lower_for_cuda(progs.prefill_chunk, params, state, S((b, t), jnp.int32), S((b, t), bool), rows,
                             S((b, vocab), jnp.float32), None)
    decode = lower_for_cuda(progs.decode_loop, params, DecodeState(
        cache=state, logits=S((b, vocab), jnp.float32), tokens=S((b, 16), jnp.int32), n_generated=rows, done=flags,
        step=S((), jnp.int32), sampling=sampling), S((), jnp.int32), sampled=True)
    segment = lower_for_cuda(progs.serve_segment, params, state, rows, flags, rows, flags, sampling, rows, n_steps=4)
    for name, text in (("prefill", prefill), ("decode", decode), ("segment", segment)):
        assert _triton_calls(text) >= 1, name  # the kernels, not an XLA fallback
        assert text.count("tf.aliasing_output") >= buffers, name  # every cache buffer updated in place


def test_the_speculative_loop_lowers_for_cuda_and_updates_both_caches_in_place():
    """Speculative decoding's loop (``lcx.engine.spec_loop``): the draft's steps and the verification through the
    Pallas kernels, greedy and sampled, fixed and adaptive k, and every buffer of both caches aliased to an output (donated, no copy)."""
    from lcx.cache.config import CacheConfig
    from lcx.engine.planning import cache_kind
    from lcx.engine.sampling import RowSampling
    from lcx.engine.spec_loop import SpecState, spec_program
    from lcx.model import abstract_params

    model = _smollm2_shaped(impl="pallas")
    target = cache_kind(model, CacheConfig())
    draft = cache_kind(model, CacheConfig(policy="snapkv", budget=128, window=16))
    b = 2
    rows, flags = S((b,), jnp.int32), S((b,), bool)
    sampling = RowSampling(temperature=S((b,), jnp.float32), top_k=rows, top_p=S((b,), jnp.float32),
                           keys=S((b, 2), jnp.uint32))
    state = SpecState(target=target.abstract(b, 512), draft=draft.abstract(b, 192), token=rows, extra=rows,
                      has_extra=flags, tokens=S((b, 16), jnp.int32), n_generated=rows, limit=rows, stops=flags,
                      done=flags, drafted=rows, accepted=rows, verifications=rows, step=S((), jnp.int32),
                      sampling=sampling)
    buffers = len(jax.tree.leaves(state.target)) + len(jax.tree.leaves(state.draft))
    for sampled, confidence in ((False, None), (True, None), (True, 0.5)):  # 0.5: adaptive k's draft loop
        text = lower_for_cuda(spec_program(model, 1, 0, target, draft, 4, False, confidence), abstract_params(model),
                              state, S((), jnp.int32), sampled=sampled)
        assert _triton_calls(text) >= 2, sampled  # the draft's and the verification's attention kernels
        assert text.count("tf.aliasing_output") >= buffers, sampled
