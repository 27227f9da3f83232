"""The ``cudnn`` row of the attention backend table (issue 62): lcx's causal contract mapped onto
``jax.nn.dot_product_attention`` (checked on CPU through its ``xla`` implementation against the reference), the
layers cuDNN cannot run routed to the Pallas flash kernel, ``auto`` / ``cudnn`` resolved per machine and refused at
setup where there is no NVIDIA GPU, the CUDA lowering's cuDNN custom call, and one bf16 comparison on a lent GPU."""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lcx
from lcx import kernels
from lcx.config import ConfigError, load_config
from lcx.kernels import backends
from lcx.kernels.cudnn import cuda_gpu, cudnn_arguments, cudnn_causal, cudnn_refusal, cudnn_supports, max_head_dim
from lcx.kernels.reference import attention_reference
from lcx.model.attention_choice import announce_attention, attention_line
from lcx.model.config import AttentionSpec

SHAPES = {"mha": (4, 4, 32), "smollm2": (9, 3, 64), "gemma3": (4, 1, 256)}  # query heads, KV heads, head_dim
CUDA = cuda_gpu()


def _qkv(h, kv, d, t=17, b=2, dtype=jnp.float32, seed=0):
    kq, kk, kv_ = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(kq, (b, t, h, d), dtype), jax.random.normal(kk, (b, t, kv, d), dtype),
            jax.random.normal(kv_, (b, t, kv, d), dtype))


def _mapped(q, k, v, *, implementation="xla", **settings):
    return jax.nn.dot_product_attention(q, k, v, **cudnn_arguments(**settings), implementation=implementation)


# ------------------------------------------------------------------------------------------------ (a) the mapping
@pytest.mark.parametrize("model", list(SHAPES))
@pytest.mark.parametrize("window", [None, 5, 17, 40])  # 17, 40: a window as long as / longer than t = 17
def test_cudnn_mapping_run_by_xla_equals_the_reference(model, window):
    h, kv, d = SHAPES[model]
    q, k, v = _qkv(h, kv, d)
    scale = d ** -0.5 * 0.7  # not the default: the scale must be passed through
    with jax.default_matmul_precision("highest"):
        got = _mapped(q, k, v, sm_scale=scale, window=window)
        want = attention_reference(q, k, v, causal=True, sm_scale=scale, window=window)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_cudnn_mapping_names_the_window_as_jax_counts_it():
    """lcx's window counts the query itself; jax's left window does not (cuDNN then keeps ``(pos - window, pos]``)."""
    assert cudnn_arguments(sm_scale=0.5) == {"is_causal": True, "scale": 0.5}
    assert cudnn_arguments(sm_scale=0.5, window=5)["local_window_size"] == (4, 0)
    assert cudnn_arguments(sm_scale=0.5, window=1)["local_window_size"] == (0, 0)  # only itself
    with pytest.raises(ValueError, match=r"window=0 is invalid: .*window >= 1"):
        cudnn_arguments(sm_scale=0.5, window=0)


def test_cudnn_causal_runs_the_mapping_for_bf16_layers_and_agrees_with_the_reference():
    h, kv, d = SHAPES["smollm2"]
    q, k, v = _qkv(h, kv, d, dtype=jnp.bfloat16)
    run = lambda q, k, v: cudnn_causal(q, k, v, sm_scale=d ** -0.5, window=5, implementation="xla")  # noqa: E731
    assert "pallas_call" not in str(jax.make_jaxpr(run)(q, k, v))  # dot_product_attention, not the flash kernel
    want = attention_reference(*(x.astype(jnp.float32) for x in (q, k, v)), causal=True, sm_scale=d ** -0.5,
                               window=5)
    np.testing.assert_allclose(run(q, k, v).astype(jnp.float32), want, rtol=2e-2, atol=2e-2)  # bf16 output


@pytest.mark.pallas
@pytest.mark.parametrize("extra", [{"softcap": 5.0}, {"segment_ids": True}], ids=["softcap", "packed"])
def test_cudnn_causal_routes_what_cudnn_cannot_express_to_flash(extra):
    """Soft-cap and packed documents take the Pallas flash kernel (interpreted here): the reference's values."""
    h, kv, d = SHAPES["smollm2"]
    q, k, v = _qkv(h, kv, d, dtype=jnp.bfloat16)
    if "segment_ids" in extra:
        extra = {"segment_ids": jnp.asarray([[0] * 7 + [1] * 10, [0] * 12 + [1] * 5], jnp.int32)}
    run = lambda q, k, v: cudnn_causal(q, k, v, sm_scale=d ** -0.5, implementation="xla", **extra)  # noqa: E731
    assert "pallas_call" in str(jax.make_jaxpr(run)(q, k, v))
    want = attention_reference(*(x.astype(jnp.float32) for x in (q, k, v)), causal=True, sm_scale=d ** -0.5, **extra)
    np.testing.assert_allclose(run(q, k, v).astype(jnp.float32), want, rtol=2e-2, atol=2e-2)


# ------------------------------------------------------------------------------------------------ (b) the predicate
def test_cudnn_supports_bf16_fp16_gqa_and_windows_not_softcap_float32_or_packed():
    spec = AttentionSpec(window=512, sm_scale=0.125)
    assert cudnn_supports(spec, jnp.bfloat16, 64) and cudnn_supports({"window": 5}, jnp.float16, 256)
    assert not cudnn_supports(dataclasses.replace(spec, softcap=50.0), jnp.bfloat16, 64)
    assert "soft-cap 50.0" in cudnn_refusal({"softcap": 50.0}, jnp.bfloat16, 64)
    assert not cudnn_supports({}, jnp.float32, 64) and "float32" in cudnn_refusal({}, jnp.float32, 64)
    assert not cudnn_supports({}, jnp.bfloat16, 64, packed=True)
    assert not cudnn_supports({}, jnp.bfloat16, 100)  # not a multiple of 8
    assert not cudnn_supports({}, jnp.bfloat16, 256, head_dim_max=128)  # Gemma 3's head_dim before Hopper
    assert (max_head_dim("9.0"), max_head_dim("10.0"), max_head_dim("8.9"), max_head_dim(None)) == (256, 256, 128, 128)


# ------------------------------------------------------------------------------------------------ (c) resolve
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU answers of auto and cudnn")
def test_cudnn_is_refused_on_cpu_naming_auto_and_xla():
    assert kernels.resolve("auto") == "xla"
    with pytest.raises(ValueError, match=r"attention.impl='cudnn' needs an NVIDIA GPU .*'auto' .*'xla'"):
        kernels.resolve("cudnn")
    h, kv, d = SHAPES["mha"]
    with pytest.raises(ValueError, match=r"needs an NVIDIA GPU"):  # the row itself, called directly
        kernels.BACKENDS["cudnn"].causal(*_qkv(h, kv, d, dtype=jnp.bfloat16), sm_scale=0.1)


@pytest.mark.parametrize("cuda, expected", [(True, "cudnn"), (False, "pallas")], ids=["nvidia", "rocm"])
def test_auto_is_cudnn_on_nvidia_gpus_and_pallas_on_others(monkeypatch, cuda, expected):
    from lcx.parallel.context import block_impl

    monkeypatch.setattr(backends, "target_backend", lambda: "gpu")
    monkeypatch.setattr(backends, "cuda_gpu", lambda: cuda)
    assert kernels.resolve("auto") == expected
    assert block_impl("auto") == "pallas"  # a ring's blocks: the flash kernels either way
    row = kernels.BACKENDS["cudnn"]
    pallas = kernels.BACKENDS["pallas"]
    assert [getattr(row, f.name) for f in dataclasses.fields(row) if f.name not in ("name", "causal")] == \
        [getattr(pallas, f.name) for f in dataclasses.fields(pallas) if f.name not in ("name", "causal")]


# ------------------------------------------------------------------------------------------------ (d) setup
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the refusal is the CPU's")
def test_a_config_asking_for_cudnn_on_cpu_is_refused_at_setup(tmp_path):
    """The config loads (multi-host runs read it before JAX starts, ``lcx plan`` reads GPU configs anywhere); the
    run's setup - a generator's ``build``, ``run_training`` - refuses it before anything is traced."""
    from lcx.engine import Generator
    from lcx.train import run_training
    from lcx.train.config import DataConfig, TrainConfig

    path = tmp_path / "c.yaml"
    path.write_text("model: {vocab_size: 32, d_model: 16, n_layers: 1, n_heads: 2, n_kv_heads: 1, d_ff: 32}\n")
    cfg = load_config(path, ["model.attention.impl=cudnn"])
    assert cfg.model.attention.impl == "cudnn"
    message = r"attention.impl='cudnn' needs an NVIDIA GPU \(cuDNN\).* use attention.impl='auto' .* or 'xla'"
    with pytest.raises(ConfigError, match=message):
        lcx.init_params(cfg.model, jax.random.key(0))
    auto = dataclasses.replace(cfg.model, attention=lcx.AttentionConfig(impl="auto"))
    with pytest.raises(ConfigError, match=message):
        Generator(cfg.model, lcx.init_params(auto, jax.random.key(0)), max_new_tokens=1)
    with pytest.raises(ConfigError, match=message):
        run_training(cfg.model, TrainConfig(), DataConfig(), tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_the_run_log_says_which_backend_runs_each_layer(caplog):
    llama = lcx.ModelConfig(vocab_size=40, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=32, dtype="bfloat16")
    assert attention_line(llama, "cudnn") == \
        "attention: auto -> cudnn (causal on cuDNN for all 4 layers; chunk/decode/statistics on Pallas)"
    gemma2 = dataclasses.replace(llama, family="gemma2", attn_softcap=50.0)
    assert attention_line(gemma2, "cudnn").startswith(
        "attention: auto -> cudnn (causal on Pallas for all 4 layers: soft-cap 50.0")
    gemma3 = dataclasses.replace(llama, family="gemma3", sliding_window=8, layer_types=("sliding_attention",) * 3
                                 + ("full_attention",))
    assert "causal on cuDNN for all 4 layers" in attention_line(gemma3, "cudnn")  # windows are cuDNN's too
    assert "Pallas for all 4 layers: packed documents" in attention_line(llama, "cudnn", packed=True)
    assert attention_line(llama, "xla") == "attention: auto -> xla"

    # a model whose layers differ in what cuDNN can run is said per layer
    class Mixed:
        attention, dtype, head_dim = lcx.AttentionConfig(), "bfloat16", 64

        def spec_table(self):
            plain, capped = AttentionSpec(), AttentionSpec(softcap=30.0)
            return (plain, capped), (0, 1, 0, 1)

    assert attention_line(Mixed(), "cudnn").startswith(
        "attention: auto -> cudnn (causal on cuDNN for layers 0, 2, on Pallas for layers 1, 3: soft-cap 30.0")
    with caplog.at_level(logging.INFO, logger="lcx"):
        line = announce_attention(llama)
    assert line in caplog.text and line.startswith("attention: auto -> ")


# ------------------------------------------------------------------------------------------------ (e) CUDA lowering
def _lower_for_cuda(f, *args) -> str:
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.skipif(CUDA, reason="with a CUDA runtime the version check passes")
def test_cudnn_lowering_on_cpu_stops_at_the_cudnn_version_check():
    """What stops the CUDA lowering on a CPU-only machine: ``check_cudnn_version`` in
    ``jax/_src/cudnn/fused_attention_stablehlo.py`` (no CUDA plugin: ``cuda_versions`` is None)."""
    from jax._src.cudnn import fused_attention_stablehlo as fused

    if fused.cuda_versions is not None:
        pytest.skip("this jaxlib has the CUDA plugin")
    q, k = jax.ShapeDtypeStruct((1, 64, 9, 64), jnp.bfloat16), jax.ShapeDtypeStruct((1, 64, 3, 64), jnp.bfloat16)
    with pytest.raises(RuntimeError, match="cuDNN is not detected"):
        _lower_for_cuda(lambda q, k, v: _mapped(q, k, v, sm_scale=0.125, implementation="cudnn"), q, k, k)


def test_cudnn_mapping_lowers_to_the_cudnn_custom_call(monkeypatch):
    """With the version check answered (cuDNN 9.10, what a GPU runtime reports), the mapping lowers for CUDA on this
    machine: the fused forward, the backward under ``jax.grad``, causal with lcx's window as cuDNN's length. Head dim
    64 (SmolLM2): the head-dim check reads the device's compute capability and allows <= 128 without a GPU."""
    from jax._src.cudnn import fused_attention_stablehlo as fused

    if not CUDA:
        monkeypatch.setattr(fused, "check_cudnn_version", lambda: 91000)
    h, kv, d = SHAPES["smollm2"]
    q, k = jax.ShapeDtypeStruct((1, 256, h, d), jnp.bfloat16), jax.ShapeDtypeStruct((1, 256, kv, d), jnp.bfloat16)
    forward = lambda q, k, v: _mapped(q, k, v, sm_scale=d ** -0.5, window=64, implementation="cudnn")  # noqa: E731
    text = _lower_for_cuda(forward, q, k, k)
    assert "__cudnn$fmhaSoftmax" in text
    assert '\\22mask_type\\22: \\22CAUSAL\\22' in text and '\\22sliding_window_length\\22: 64' in text
    backward = jax.grad(lambda q, k, v: forward(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    assert "__cudnn$fmhaSoftmaxBackward" in _lower_for_cuda(backward, q, k, k)


# ------------------------------------------------------------------------------------------------ on a lent GPU
@pytest.mark.skipif(not CUDA, reason="cuDNN runs only on an NVIDIA GPU")
@pytest.mark.parametrize("model, window", [("smollm2", None), ("smollm2", 64), ("gemma3", 128)])
def test_cudnn_on_gpu_agrees_with_the_reference_in_bf16(model, window):
    """bf16 inputs, the reference in float32 on the same (rounded) inputs: within 2e-2 (bf16's output rounding,
    2^-8 relative, with room for cuDNN's summation order); the backward's gradients too."""
    h, kv, d = SHAPES[model]
    q, k, v = _qkv(h, kv, d, t=512, dtype=jnp.bfloat16)
    run = jax.jit(lambda q, k, v: kernels.BACKENDS["cudnn"].causal(q, k, v, sm_scale=d ** -0.5, window=window))
    assert "__cudnn$fmha" in run.lower(q, k, v).as_text() or d > max_head_dim(jax.devices()[0].compute_capability)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    with jax.default_matmul_precision("highest"):
        want = attention_reference(*f32, causal=True, sm_scale=d ** -0.5, window=window)
    np.testing.assert_allclose(run(q, k, v).astype(jnp.float32), want, rtol=2e-2, atol=2e-2)
    loss = lambda f: lambda q, k, v: (f(q, k, v).astype(jnp.float32) ** 2).sum()  # noqa: E731
    got = jax.grad(loss(lambda q, k, v: kernels.BACKENDS["cudnn"].causal(q, k, v, sm_scale=d ** -0.5, window=window)),
                   argnums=(0, 1, 2))(q, k, v)
    ref = jax.grad(loss(lambda q, k, v: attention_reference(q, k, v, causal=True, sm_scale=d ** -0.5, window=window)),
                   argnums=(0, 1, 2))(*f32)
    for g, r in zip(got, ref):
        np.testing.assert_allclose(g.astype(jnp.float32), r, rtol=5e-2, atol=5e-2)
