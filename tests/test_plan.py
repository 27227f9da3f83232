"""Tests for ``lcx plan``: the KV arithmetic against published numbers, the checkpoints, the CLI and bad inputs."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from lcx import cli
from lcx.config import CacheConfig, ConfigError, ModelConfig, load_dict, load_model_config
from lcx.cli.plan import load_model
from lcx.config import apply_model_overrides as apply_overrides
from lcx.config_base import dtype_bytes, format_bytes, parse_bytes
from lcx.plan import (
    Checkpoint,
    PlanInputs,
    checkpoints,
    kv_bytes_per_token,
    make_plan,
    max_context,
    render,
    valid_model_axis_sizes,
    weight_bytes,
)

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "experiments" / "configs"
MODELS = CONFIGS / "models"
GiB, MiB, KiB = 1024**3, 1024**2, 1024


def model(name: str) -> ModelConfig:
    return load_model_config(MODELS / f"{name}.yaml")


def plan_for(name: str, **kw):
    kw.setdefault("batch", 1)
    kw.setdefault("gpu_mem_bytes", 80 * GiB)
    return make_plan(PlanInputs(model=model(name), **kw))


def by_name(plan) -> dict[str, Checkpoint]:
    return {c.name: c for c in plan.checkpoints}


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    rc = cli.main(["plan", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out, err


# --------------------------------------------------------------------------------------------------- acceptance
def test_plan_llama2_7b_fp16_4096_tokens_is_2_gib():
    m = model("llama2-7b")
    assert kv_bytes_per_token(m, "fp16") == 512 * KiB
    plan = plan_for("llama2-7b", context=4096, gpu_mem_bytes=24 * GiB)
    assert plan.kv_dtype == "float16"  # default: the model's compute dtype
    assert plan.kv_bytes_total == 2 * GiB
    assert format_bytes(plan.kv_bytes_total) == "2.00 GiB"


def test_plan_llama3_70b_bf16_is_320_kib_per_token():
    assert kv_bytes_per_token(model("llama3-70b"), "bf16") == 320 * KiB
    plan = plan_for("llama3-70b", context=131072, devices=8)
    assert plan.kv_bytes_per_token == 320 * KiB
    assert format_bytes(plan.kv_bytes_per_token) == "320.00 KiB"
    assert plan.kv_bytes_total == 320 * KiB * 131072 == 40 * GiB
    assert plan.kv_heads_per_device == 1 and plan.kv_bytes_per_device == 5 * GiB


def test_plan_eight_kv_heads_on_six_devices_fails_b_listing_valid_sizes():
    b = by_name(plan_for("llama3-70b", context=8192, devices=6))["gqa_vs_tensor_parallel"]
    assert b.status == "fail"
    assert "8 KV heads cannot be split over a model axis of 6 devices" in b.reason
    assert "valid model-axis sizes: 1, 2, 4, 8" in b.reason
    assert "the largest on 6 devices is 4" in b.reason


# --------------------------------------------------------------------------------------------------- units
@pytest.mark.parametrize("text, expected", [
    ("80GiB", 80 * GiB), ("80 GiB", 80 * GiB), ("80gib", 80 * GiB), ("80GB", 80 * 10**9), ("24GB", 24 * 10**9),
    ("1.5TiB", 3 * 2**39), ("512MiB", 512 * MiB), ("512MB", 512 * 10**6), ("4KiB", 4096), ("4KB", 4000),
    ("1TB", 10**12), ("100B", 100), ("85899345920", 80 * GiB), (1024, 1024),
])
def test_parse_bytes_units(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text, fragment", [
    ("80XB", "unknown unit 'XB'"), ("80G", "unknown unit 'G'"), ("", "expected a positive number"),
    ("GiB", "expected a positive number"), ("-5GiB", "expected a positive number"), ("0", "expected a positive"),
    ("eighty", "expected a positive number"), (True, "expected a positive number"),
])
def test_parse_bytes_errors_name_the_flag(text, fragment):
    with pytest.raises(ConfigError) as err:
        parse_bytes(text)
    assert str(err.value).startswith(f"--gpu-mem={text!r} is invalid")
    assert fragment in str(err.value)
    assert "KiB, MiB, GiB, TiB" in str(err.value)


@pytest.mark.parametrize("n, text", [
    (0, "0 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (320 * KiB, "320.00 KiB"), (1536 * KiB, "1.50 MiB"),
    (2 * GiB, "2.00 GiB"), (3 * 2**40, "3.00 TiB"), (-2 * GiB, "-2.00 GiB"),
])
def test_format_bytes(n, text):
    assert format_bytes(n) == text


# --------------------------------------------------------------------------------------------------- arithmetic
def test_weight_bytes_is_params_times_dtype_size():
    m = model("llama2-7b")
    assert weight_bytes(m, "fp16") == 2 * m.num_params()
    assert weight_bytes(m, "fp32") == 4 * m.num_params()


@pytest.mark.parametrize("name, params", [
    ("llama2-7b", 6.74e9), ("llama3-70b", 70.6e9), ("llama3-8b", 8.03e9), ("mistral-7b", 7.25e9),
    ("qwen2-7b", 7.62e9), ("qwen3-8b", 8.19e9), ("gemma3-4b", 3.88e9),
])
def test_bundled_configs_parameter_counts(name, params):
    assert model(name).num_params() == pytest.approx(params, rel=0.01)


def test_plan_defaults_dtypes_from_model_and_flags_override_them():
    m = model("llama3-70b")
    inputs = PlanInputs(model=m, context=10, batch=1, gpu_mem_bytes=GiB)
    assert (inputs.kv_dtype, inputs.weight_dtype) == ("bfloat16", "bfloat16")
    inputs = PlanInputs(model=m, context=10, batch=1, gpu_mem_bytes=GiB, kv_dtype="fp32", weight_dtype="f16")
    assert (inputs.kv_dtype, inputs.weight_dtype) == ("float32", "float16")
    plan = make_plan(inputs)
    assert plan.kv_bytes_per_token == 640 * KiB and plan.weight_bytes == 2 * m.num_params()


def test_plan_kv_total_scales_with_batch_and_sharding_with_devices():
    one = plan_for("llama3-70b", context=4096, batch=3, devices=1)
    assert one.kv_bytes_total == 320 * KiB * 4096 * 3 == one.kv_bytes_per_device
    four = plan_for("llama3-70b", context=4096, batch=3, devices=4)
    assert four.kv_bytes_total == one.kv_bytes_total
    assert four.kv_bytes_per_device * 4 == one.kv_bytes_total  # 2 of 8 KV heads per device
    assert four.weight_bytes_per_device == _closed_form_weights_per_device(model("llama3-70b"), 2, 4)
    assert one.weight_bytes_per_device == one.weight_bytes


def _closed_form_weights_per_device(m, itemsize, model_axis):
    """lcx's placement: the vocabulary matrices (embedding, lm_head) and the norms are whole on every device, and so
    are the K/V projections when KV heads are replicated (model axis a multiple of kv_heads); every other parameter
    (attention and MLP projections) is split over the model axis (rounded up where it does not divide)."""
    whole = m.vocab_size * m.d_model * (1 if m.tie_embeddings else 2) + m.d_model * (2 * m.n_layers + 1)
    kv_proj = 2 * m.n_layers * m.d_model * m.n_kv_heads * m.head_dim
    if model_axis > m.n_kv_heads and model_axis % m.n_kv_heads == 0:
        whole += kv_proj
        kv_proj = 0
    q_o = 2 * m.n_layers * m.d_model * m.n_heads * m.head_dim
    mlp = 3 * m.n_layers * m.d_model * m.d_ff
    heads, kv_heads = -(-m.n_heads // model_axis), -(-m.n_kv_heads // model_axis)
    split = (m.n_layers * m.d_model * 2 * heads * m.head_dim
             + m.n_layers * m.d_model * 2 * kv_heads * m.head_dim * (kv_proj > 0)
             + m.n_layers * m.d_model * 3 * -(-m.d_ff // model_axis))
    bias = 0
    if m.qkv_bias:  # Qwen2: q bias split with the heads, k/v biases with the KV heads
        bias = m.n_layers * (m.n_heads + 2 * m.n_kv_heads) * m.head_dim
        split += m.n_layers * (heads + 2 * kv_heads) * m.head_dim
    assert whole + q_o + kv_proj + mlp + bias == m.num_params()
    return (whole + split) * itemsize


def _closed_form_max_context(m, *, batch, gpu, devices, kv_dtype, weight_dtype, util=0.9):
    heads_per_device = math.ceil(m.n_kv_heads / devices)
    per_token = 2 * m.n_layers * heads_per_device * m.head_dim * {"float16": 2, "bfloat16": 2, "float32": 4}[
        kv_dtype] * batch
    free = math.floor(gpu * util) - _closed_form_weights_per_device(
        m, {"float16": 2, "bfloat16": 2, "float32": 4}[weight_dtype], devices)
    return max(free, 0) // per_token


@pytest.mark.parametrize("name, gpu, devices, batch", [
    ("llama2-7b", 24 * GiB, 1, 1), ("llama2-7b", 24 * GiB, 2, 4), ("llama3-70b", 80 * GiB, 8, 1),
    ("llama3-70b", 80 * GiB, 16, 2), ("llama3-8b", 40 * GiB, 3, 1), ("qwen2-7b", 141 * GiB, 1, 8),
])
def test_max_context_matches_closed_form_and_is_the_fit_boundary(name, gpu, devices, batch):
    m = model(name)
    dt = m.dtype
    expected = _closed_form_max_context(m, batch=batch, gpu=gpu, devices=devices, kv_dtype=dt, weight_dtype=dt)
    got = max_context(m, batch=batch, gpu_mem_bytes=gpu, devices=devices, kv_dtype=dt, weight_dtype=dt)
    assert got == expected > 0
    fits = make_plan(PlanInputs(model=m, context=got, batch=batch, gpu_mem_bytes=gpu, devices=devices))
    over = make_plan(PlanInputs(model=m, context=got + 1, batch=batch, gpu_mem_bytes=gpu, devices=devices))
    assert fits.fits and fits.max_context == got
    assert not over.fits
    assert by_name(fits)["context_vs_memory"].status == "pass"
    assert by_name(over)["context_vs_memory"].status == "fail"


def test_max_context_brute_force_on_a_tiny_model():
    m = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64)
    gpu = 200_000
    for devices in (1, 2, 4):
        brute = 0
        while make_plan(PlanInputs(model=m, context=brute + 1, batch=3, gpu_mem_bytes=gpu, devices=devices)).fits:
            brute += 1
        assert max_context(m, batch=3, gpu_mem_bytes=gpu, devices=devices, kv_dtype="float32",
                           weight_dtype="float32") == brute > 0


def test_plan_gemma3_counts_the_sliding_layers_at_their_window(capsys):
    """Gemma-3-4B at 32K: 29 sliding-window layers hold window - 1 + a window's room = 2,047 slots (a prefill chunk
    of up to one window), 5 global layers every token - about 1/5 of an all-global cache; the longest context is set
    by the global layers alone; the brute-force boundary of ``fits`` is ``max_context`` on a tiny hybrid model;
    all-local models are unbounded."""
    plan = plan_for("gemma3-4b", context=32768)
    per_layer = 2 * 4 * 256 * 2  # K and V, 4 KV heads, head_dim 256, bf16
    assert plan.n_local_layers == 29 and plan.local_slots == 1023 + 1024
    assert plan.kv_bytes_total == per_layer * (5 * 32768 + 29 * 2047)
    assert 0.19 < plan.kv_bytes_total / (34 * per_layer * 32768) < 0.21
    small = plan_for("gemma3-4b", context=32768, cache=CacheConfig(prefill_chunk=64))  # room: the interval
    assert small.local_slots == 1023 + 64 and small.kv_bytes_total == per_layer * (5 * 32768 + 29 * 1087)
    rc, out, _ = run_cli(capsys, MODELS / "gemma3-4b.yaml", "--context", 32768, "--gpu-mem", "24GiB")
    assert rc == 0 and "29 sliding-window (window 1024: 2047 slots each for this context) + 5 global" in out
    tiny = ModelConfig(vocab_size=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=64, family="gemma3",
                       layer_types=("sliding_attention", "sliding_attention", "full_attention"), sliding_window=8)
    boundaries = []
    for gpu in (200_000, 400_000):  # below and above the local layers' 71 slots
        brute = 0
        while make_plan(PlanInputs(model=tiny, context=brute + 1, batch=2, gpu_mem_bytes=gpu)).fits:
            brute += 1
        assert max_context(tiny, batch=2, gpu_mem_bytes=gpu, devices=1, kv_dtype="float32",
                           weight_dtype="float32") == brute
        boundaries.append(brute)
    assert boundaries[0] < 7 + 64 < boundaries[1]
    local = dataclasses.replace(tiny, layer_types=("sliding_attention",) * 3)
    assert "unbounded" in render(make_plan(PlanInputs(model=local, context=100_000, batch=2, gpu_mem_bytes=400_000)))


def test_max_context_is_zero_when_weights_alone_do_not_fit():
    plan = plan_for("llama3-70b", context=1024, gpu_mem_bytes=80 * GiB, devices=1)
    assert plan.max_context == 0 and not plan.fits
    a = by_name(plan)["context_vs_memory"]
    assert a.status == "fail"
    assert "the weights alone (131.42 GiB per device) exceed 72.00 GiB" in a.reason
    assert "2 devices (tensor parallel 2) would fit" in a.reason


# --------------------------------------------------------------------------------------------------- checkpoint (a)
def test_checkpoint_a_fail_recommends_gqa_flash_budget_and_devices():
    plan = plan_for("llama2-7b", context=32768, gpu_mem_bytes=24 * GiB)
    assert not plan.fits and plan.kv_bytes_total == 16 * GiB
    a = by_name(plan)["context_vs_memory"]
    assert a.status == "fail"
    assert f"longest context that fits: {plan.max_context} tokens" in a.reason
    assert f"cache.policy=streaming cache.budget={plan.max_context}" in a.reason
    assert "GQA with 8 KV heads would shrink the cache 4x, saving 12.00 GiB of 16.00 GiB" in a.reason
    assert "attention.impl=pallas" in a.reason
    assert "2 devices (tensor parallel 2) would fit" in a.reason
    # the recommended budget really fits
    budgeted = plan_for("llama2-7b", context=32768, gpu_mem_bytes=24 * GiB, budget=plan.max_context)
    assert budgeted.fits_with_budget


def test_checkpoint_a_does_not_suggest_gqa_for_a_gqa_model():
    plan = plan_for("llama3-8b", context=1_000_000, gpu_mem_bytes=24 * GiB)
    a = by_name(plan)["context_vs_memory"]
    assert a.status == "fail" and "GQA" not in a.reason


def test_checkpoint_a_warns_when_only_the_eviction_budget_fits():
    plan = plan_for("llama2-7b", context=32768, gpu_mem_bytes=24 * GiB, budget=8192)
    assert not plan.fits and plan.fits_with_budget
    assert plan.cache_tokens == 8192 and plan.budget_kv_bytes_total == 4 * GiB
    assert plan.kv_bytes_total == 16 * GiB  # the full-cache numbers are still reported
    a = by_name(plan)["context_vs_memory"]
    assert a.status == "warn"
    assert "with the eviction budget of 8192 tokens the cache is 4.00 GiB per device and fits" in a.reason


def test_checkpoint_a_fails_when_even_the_budget_does_not_fit():
    plan = plan_for("llama2-7b", context=65536, gpu_mem_bytes=24 * GiB, budget=32768)
    assert not plan.fits and not plan.fits_with_budget
    assert by_name(plan)["context_vs_memory"].status == "fail"


def test_budget_above_context_holds_the_context():
    plan = plan_for("llama2-7b", context=4096, gpu_mem_bytes=24 * GiB, budget=100_000)
    assert plan.cache_tokens == 4096 and plan.budget_kv_bytes_total == plan.kv_bytes_total


# --------------------------------------------------------------------------------------------------- checkpoint (b)
def test_valid_model_axis_sizes():
    m70 = model("llama3-70b")  # 64 heads, 8 KV heads
    assert valid_model_axis_sizes(m70, 6) == [1, 2, 4, 8]
    assert valid_model_axis_sizes(m70, 24) == [1, 2, 4, 8, 16]  # 24 does not divide 64 query heads
    assert valid_model_axis_sizes(m70, 64) == [1, 2, 4, 8, 16, 32, 64]
    assert valid_model_axis_sizes(model("qwen2-7b"), 28) == [1, 2, 4, 28]  # 4 KV heads x 7 groups


@pytest.mark.parametrize("devices, status, fragment", [
    (1, "pass", "1 device: no tensor parallelism; all 8 KV heads on it"),
    (8, "pass", "one KV group (8 query heads) per device, attention needs no communication"),
    (4, "pass", "2 whole KV groups per device"),
    (16, "warn", "each KV head is replicated 2x (as vLLM does)"),
    (24, "fail", "n_heads=64 is not divisible by 24"),
    (3, "fail", "valid model-axis sizes: 1, 2, 4, 8"),
])
def test_checkpoint_b_topologies(devices, status, fragment):
    b = by_name(plan_for("llama3-70b", context=8192, devices=devices))["gqa_vs_tensor_parallel"]
    assert b.status == status and fragment in b.reason


def test_checkpoint_b_replication_reports_extra_memory():
    plan = plan_for("llama3-70b", context=8192, devices=16)
    assert plan.kv_replication == 2 and plan.kv_heads_per_device == 1
    assert plan.kv_bytes_per_device == 8192 * 80 * 2 * 128 * 2  # one head per device
    b = by_name(plan)["gqa_vs_tensor_parallel"]
    assert "the cache takes 5.00 GiB over all devices instead of 2.50 GiB (+2.50 GiB)" in b.reason


# --------------------------------------------------------------------------------------------------- checkpoint (c)
def test_checkpoint_c_passes_for_bf16_and_states_the_facts():
    c = by_name(plan_for("llama3-70b", context=131072, devices=8))["precision"]
    assert c.status == "pass"
    for fragment in ("RMSNorm statistics in float32", "norm_eps=1e-05", "no dropout at inference"):
        assert fragment in c.reason


def test_checkpoint_c_fp16_is_fine_at_4096_and_warns_beyond():
    short = by_name(plan_for("llama2-7b", context=4096))["precision"]
    assert short.status == "pass"
    long = by_name(plan_for("llama2-7b", context=4097))["precision"]
    assert long.status == "warn"
    assert "fp16 compute and KV cache: fp16 max 65504: attention logits/activations may overflow" in long.reason
    assert "use bf16" in long.reason


def test_checkpoint_c_warns_on_fp16_cache_for_a_bf16_model():
    c = by_name(plan_for("llama3-8b", context=1024, kv_dtype="fp16"))["precision"]
    assert c.status == "warn"
    assert "KV cache in float16 but the model was trained in bfloat16" in c.reason
    c = by_name(plan_for("llama2-7b", context=1024, kv_dtype="bf16"))["precision"]
    assert c.status == "warn" and "KV cache in bfloat16 but the model was trained in float16" in c.reason
    assert by_name(plan_for("llama3-8b", context=1024, kv_dtype="fp32"))["precision"].status == "pass"


def test_checkpoints_function_matches_plan():
    inputs = PlanInputs(model=model("llama3-70b"), context=8192, batch=1, gpu_mem_bytes=80 * GiB, devices=6)
    assert tuple(checkpoints(inputs)) == make_plan(inputs).checkpoints
    assert make_plan(inputs).status == "fail"


# --------------------------------------------------------------------------------------------------- cli
def test_cli_text_llama3_70b_128k_on_8_devices(capsys):
    rc, out, err = run_cli(capsys, MODELS / "llama3-70b.yaml", "--context", 131072, "--batch", 1,
                           "--gpu-mem", "80GiB", "--devices", 8)
    assert rc == 0 and err == ""
    for fragment in ("131.42 GiB total, 19.85 GiB per device", "320.00 KiB per token",
                     "40.00 GiB total for 131072 tokens x batch 1; 5.00 GiB per device",
                     "24.85 GiB of 72.00 GiB usable (90%): fits", "pass  (a) context vs memory",
                     "pass  (b) GQA vs tensor parallel", "pass  (c) precision",
                     "tensor parallel over all 8 device(s)", "batch not split",
                     "context 131072 > model.max_position_embeddings=8192"):
        assert fragment in out, fragment


def test_cli_text_llama2_7b_on_24gib(capsys):
    rc, out, _ = run_cli(capsys, MODELS / "llama2-7b.yaml", "--context", 4096, "--gpu-mem", "24GiB")
    assert rc == 0
    assert "2.00 GiB total for 4096 tokens x batch 1" in out
    assert "512.00 KiB per token" in out
    assert "fits" in out and "does NOT fit" not in out


def test_cli_budget_shows_full_and_budgeted(capsys):
    rc, out, _ = run_cli(capsys, MODELS / "llama2-7b.yaml", "--context", 32768, "--gpu-mem", "24GiB",
                         "--budget", 8192)
    assert rc == 0
    assert "16.00 GiB total for 32768 tokens" in out
    assert "eviction budget 8192 -> cache holds 8192 tokens: 4.00 GiB total" in out
    assert "does NOT fit" in out and "16.55 GiB: fits" in out
    assert "warn  (a) context vs memory" in out


def test_cli_paged_cache_counts_a_shared_prefix_once(capsys):
    """8 sequences of 8192 tokens that share their first 8000: 500 pages once + 12 per sequence, 128 KiB per token
    (Llama-3-8B, bf16) -> 596 x 16 x 128 KiB = 1.16 GiB instead of 8 GiB."""
    rc, out, _ = run_cli(capsys, MODELS / "llama3-8b.yaml", "--context", 8192, "--batch", 8, "--gpu-mem", "80GiB",
                         "--page-size", 16, "--shared-prefix", 8000, "--json")
    data = json.loads(out)
    assert rc == 0 and data["cache_pages"] == 500 + 8 * 12 and data["cache_page_size"] == 16
    assert data["cache_device_kv_bytes"] == 596 * 16 * 128 * KiB
    # 8-bit pages: 128 int8 codes + one float16 scale per KV head and layer, K and V: x 0.51 of bf16
    rc, out, _ = run_cli(capsys, MODELS / "llama3-8b.yaml", "--context", 8192, "--batch", 8, "--gpu-mem", "80GiB",
                         "--page-size", 16, "--shared-prefix", 8000, "--kv-dtype", "int8", "--json")
    assert rc == 0 and json.loads(out)["cache_device_kv_bytes"] == 596 * 16 * (2 * 32 * 8 * (128 + 2))
    # with an evicting policy each sequence holds the pages of its budget + interval (2048 + 64 slots): 132 pages
    rc, out, _ = run_cli(capsys, MODELS / "llama3-8b.yaml", "--context", 8192, "--batch", 8, "--gpu-mem", "80GiB",
                         "--page-size", 16, "--shared-prefix", 8000, "--cache-policy", "snapkv", "--budget", 2048)
    assert "1056 pages of 16 tokens in use at the full context (the policy's 2112 slots per sequence" in out
    with pytest.raises(ConfigError, match=r"shared_prefix=100 needs a paged cache to share pages: pass --page-size"):
        plan_for("llama3-8b", context=1024, shared_prefix=100)
    with pytest.raises(ConfigError, match=r"shared_prefix=2048 is invalid: must be an integer in \[0, 1024\]"):
        plan_for("llama3-8b", context=1024, shared_prefix=2048)


def test_cli_json(capsys):
    rc, out, _ = run_cli(capsys, MODELS / "llama3-70b.yaml", "--context", 8192, "--gpu-mem", "80GiB",
                         "--devices", 6, "--json")
    assert rc == 0
    data = json.loads(out)
    assert data["kv_bytes_per_token"] == 320 * KiB
    assert data["kv_bytes_total"] == 320 * KiB * 8192
    assert data["devices"] == 6 and data["kv_heads_per_device"] == 2
    assert [c["name"] for c in data["checkpoints"]] == ["context_vs_memory", "gqa_vs_tensor_parallel", "precision"]
    assert data["checkpoints"][1]["status"] == "fail"
    assert "valid model-axis sizes: 1, 2, 4, 8" in data["checkpoints"][1]["reason"]
    assert data["status"] == "fail" and data["fits"] is True
    assert isinstance(data["assumptions"], list) and data["assumptions"]


def test_cli_overrides(capsys):
    rc, out, _ = run_cli(capsys, MODELS / "llama2-7b.yaml", "model.n_kv_heads=8", "--context", 4096,
                         "--gpu-mem", "24GiB", "--json")
    assert rc == 0 and json.loads(out)["kv_bytes_total"] == GiB // 2


def test_render_matches_plan():
    plan = plan_for("llama3-70b", context=8192, devices=16)
    text = render(plan)
    assert "each replicated 2x" in text and "warn  (b)" in text


# --------------------------------------------------------------------------------------------------- bad inputs
BAD = [
    (["--context", "4096", "--gpu-mem", "80XB"], "--gpu-mem='80XB' is invalid: unknown unit 'XB'"),
    (["--context", "0", "--gpu-mem", "80GiB"],
     "context=0 is invalid: must be a positive integer number of tokens per sequence (--context)"),
    (["--context", "4096", "--batch", "-1", "--gpu-mem", "80GiB"],
     "batch=-1 is invalid: must be a positive integer number of sequences (--batch)"),
    (["--context", "4096", "--gpu-mem", "80GiB", "--devices", "0"],
     "devices=0 is invalid: must be a positive integer number of devices (--devices)"),
    (["--context", "4096", "--gpu-mem", "80GiB", "--budget", "0"], "budget=0 is invalid"),
    (["--context", "4096", "--gpu-mem", "80GiB", "--kv-dtype", "int3"],
     "--kv-dtype='int3' is not a dtype lcx supports; allowed: ['bf16', 'bfloat16', 'f16', 'f32', 'float16', "
     "'float32', 'fp16', 'fp32'], or quantized codes ['int8', 'fp8', 'int4', 'int2', 'fp4']"),
    (["--context", "4096", "--gpu-mem", "80GiB", "--weight-dtype", "fp8"],
     "--weight-dtype='fp8' is not a dtype lcx supports"),
    (["--context", "4096", "--gpu-mem", "80GiB", "--utilization", "1.5"],
     "utilization=1.5 is invalid: must be a fraction in (0, 1]"),
    (["model.n_kv_heads=5", "--context", "4096", "--gpu-mem", "80GiB"], "model.n_heads=32 is invalid"),
    (["n_kv_heads=8", "--context", "4096", "--gpu-mem", "80GiB"],
     "override 'n_kv_heads=8' is invalid: overrides are dotted model.key=value pairs"),
]


@pytest.mark.parametrize("argv, message", BAD)
def test_cli_bad_inputs_give_one_line_errors(capsys, argv, message):
    rc, out, err = run_cli(capsys, MODELS / "llama2-7b.yaml", *argv)
    assert rc == 2 and out == ""
    assert err.startswith("lcx plan: error: ") and err.count("\n") == 1
    assert message in err


def test_cli_missing_path(capsys, tmp_path):
    missing = tmp_path / "nope.yaml"
    rc, _, err = run_cli(capsys, missing, "--context", 4096, "--gpu-mem", "80GiB")
    assert rc == 2
    assert f"CONFIG_OR_HF_DIR={str(missing)!r} does not exist" in err


def test_cli_directory_without_config_json(capsys, tmp_path):
    rc, _, err = run_cli(capsys, tmp_path, "--context", 4096, "--gpu-mem", "80GiB")
    assert rc == 2 and "is a directory without config.json" in err


def test_cli_yaml_that_is_not_a_model_config(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  d_model: 64\n")
    rc, _, err = run_cli(capsys, bad, "--context", 4096, "--gpu-mem", "80GiB")
    assert rc == 2 and "missing required key(s)" in err


def test_plan_inputs_reject_bad_values_in_python():
    m = model("llama2-7b")
    with pytest.raises(ConfigError, match=r"context=1\.5 is invalid"):
        PlanInputs(model=m, context=1.5, batch=1, gpu_mem_bytes=GiB)
    with pytest.raises(ConfigError, match=r"gpu_mem_bytes=0 is invalid"):
        PlanInputs(model=m, context=1, batch=1, gpu_mem_bytes=0)
    with pytest.raises(ConfigError, match=r"batch=True is invalid"):
        PlanInputs(model=m, context=1, batch=True, gpu_mem_bytes=GiB)
    with pytest.raises(ConfigError, match=r"model=dict is invalid"):
        PlanInputs(model={}, context=1, batch=1, gpu_mem_bytes=GiB)


def test_apply_overrides_rejects_unknown_keys():
    with pytest.raises(ConfigError, match="unknown key 'model.n_kv_head'; did you mean 'n_kv_heads'"):
        apply_overrides(model("llama2-7b"), ["model.n_kv_head=8"])
    changed = apply_overrides(model("llama2-7b"), ["model.n_kv_heads=8"])
    assert changed == dataclasses.replace(model("llama2-7b"), n_kv_heads=8)


# --------------------------------------------------------------------------------------------------- configs
def test_every_experiment_yaml_loads_as_a_model_config():
    paths = sorted(CONFIGS.rglob("*.yaml")) + sorted(CONFIGS.rglob("*.yml"))
    assert {p.stem for p in MODELS.glob("*.yaml")} >= {"llama2-7b", "llama3-8b", "llama3-70b", "mistral-7b",
                                                        "qwen2-7b"}
    for path in paths:
        if "checkpoint" in load_dict(path):  # the model is the checkpoint's (tests/test_config.py loads these)
            continue
        m = load_model_config(path)
        assert isinstance(m, ModelConfig), path


# --------------------------------------------------------------------------------------------------- HF directory
LLAMA3_70B_CONFIG_JSON = {  # meta-llama/Meta-Llama-3-70B config.json
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 8192,
    "initializer_range": 0.02, "intermediate_size": 28672, "max_position_embeddings": 8192, "model_type": "llama",
    "num_attention_heads": 64, "num_hidden_layers": 80, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.40.0.dev0", "use_cache": True, "vocab_size": 128256,
}


@pytest.mark.parity
def test_plan_from_hf_directory_matches_the_yaml(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_70B_CONFIG_JSON))
    hf_model = load_model(tmp_path)
    yaml_model = model("llama3-70b")
    assert hf_model.num_params() == yaml_model.num_params()
    assert kv_bytes_per_token(hf_model, "bf16") == 320 * KiB
    assert load_model(tmp_path / "config.json").num_params() == yaml_model.num_params()
    rc, out, _ = run_cli(capsys, tmp_path, "--context", 4096, "--gpu-mem", "80GiB", "--devices", 8,
                         "--kv-dtype", "bf16", "--weight-dtype", "bf16", "--json")
    assert rc == 0
    data = json.loads(out)
    assert data["kv_bytes_per_token"] == 320 * KiB and data["num_params"] == yaml_model.num_params()


# --------------------------------------------------------------------------------------------------- data axis
def test_plan_data_axis_splits_the_batch_and_shrinks_the_model_axis():
    tp = plan_for("llama3-70b", context=8192, batch=4, devices=8)
    mixed = plan_for("llama3-70b", context=8192, batch=4, devices=8, data=2)  # mesh 2 x 4
    assert mixed.model_axis == 4 and mixed.kv_heads_per_device == 2
    # half the rows per device, twice the KV heads: the same KV bytes per device as 8-way tensor parallel
    assert mixed.kv_bytes_per_device == 320 * KiB * 8192 * 4 // 8 == tp.kv_bytes_per_device
    assert mixed.weight_bytes_per_device == _closed_form_weights_per_device(model("llama3-70b"), 2, 4)
    assert mixed.weight_bytes_per_device > tp.weight_bytes_per_device  # weights replicate over data
    assert "batch split over the data axis: ceil(batch / 2) sequences per device" in mixed.assumptions
    b = by_name(mixed)["gqa_vs_tensor_parallel"]
    assert b.status == "pass" and "2 whole KV groups per device" in b.reason


def test_plan_data_axis_must_divide_the_devices(capsys):
    rc, _, err = run_cli(capsys, MODELS / "llama3-70b.yaml", "--context", 4096, "--gpu-mem", "80GiB",
                         "--devices", 8, "--data", 3)
    assert rc == 2 and "data=3 is invalid: the data axis must divide --devices=8" in err
    rc, out, _ = run_cli(capsys, MODELS / "llama3-70b.yaml", "--context", 4096, "--gpu-mem", "80GiB",
                         "--devices", 8, "--data", 2)
    assert rc == 0 and "(mesh data=2 x model=4)" in out


def test_plan_uses_the_runtime_arithmetic():
    """One planner arithmetic: the KV bytes and the memory rule are the functions generation checks with."""
    from lcx.cache import kv_bytes
    from lcx.parallel.device_memory import usable_bytes

    m = model("llama3-8b")
    plan = plan_for("llama3-8b", context=1000, batch=2)
    assert plan.kv_bytes_total == kv_bytes(m, 1000, 2, m.dtype)
    assert plan.usable_bytes_per_device == usable_bytes(80 * GiB)


def test_plan_cache_section_counts_per_head_keep_sets_and_adaptive_slots():
    from lcx.cache.config import CacheConfig

    m = model("llama3-8b")  # 32 layers, 8 KV heads, head_dim 128

    def cache_plan(**cache):
        return plan_for("llama3-8b", context=32768, budget=1024,
                        cache=CacheConfig(budget=1024, interval=64, **cache))

    shared, per_head = cache_plan(policy="snapkv", heads="shared"), cache_plan(policy="snapkv")
    adaptive = cache_plan(policy="snapkv", head_budget="adaptive")
    slot_bytes = 2 * m.n_layers * m.n_kv_heads * m.head_dim * 2  # K and V, bfloat16
    assert shared.cache_slots == per_head.cache_slots == 1024 + 64
    assert shared.cache_device_kv_bytes == per_head.cache_device_kv_bytes == 1088 * slot_bytes
    # positions (int32), validity (bool), scores (float32) per slot and keep head; counts per keep head
    assert per_head.cache_device_meta_bytes - shared.cache_device_meta_bytes == m.n_layers * 7 * (9 * 1088 + 4)
    assert (shared.cache_keep_sets, per_head.cache_keep_sets) == ("per layer", "per KV head")
    # one head may take min(2 x budget, 8 x budget - 7 x floor(0.2 x budget)) of its layer's 8 x budget slots
    assert adaptive.cache_slots == min(2 * 1024, 8 * 1024 - 7 * 204) + 64


def test_plan_serve_prints_the_pool_lcx_serve_sizes(capsys):
    """``lcx plan --serve``: pages of a KV budget, sequences at max length; eviction bounds a sequence's pages."""
    config = MODELS / "llama2-7b.yaml"
    rc, out, _ = run_cli(capsys, config, "--serve", "--context", 4096, "--gpu-mem", "80GiB", "--kv-memory", "8GiB",
                         "--max-num-seqs", 8, "--page-size", 16, "--json")
    plan = json.loads(out)
    # Llama-2-7B in float16: 512 KiB per token, 8 MiB per page of 16; 8 GiB -> 1024 pages, 4 sequences of 4096
    assert rc == 0 and plan["page_bytes"] == 8 * 1024 * KiB and plan["pages"] == 1024
    assert plan["row_pages"] == 256 and plan["at_max_length"] == 4
    rc, out, _ = run_cli(capsys, config, "--serve", "--context", 32768, "--gpu-mem", "80GiB", "--kv-memory", "8GiB",
                         "--cache-policy", "streaming", "--cache-param", "budget=1024")
    assert rc == 0 and "one sequence holds at most 68 pages (1,088 tokens, policy 'streaming'" in out
    # 8 sequences of 68 pages are all the pool can ever use: 544 pages of the 1024 the budget buys
    assert "KV pool: 544 pages" in out and "capped at every sequence at its largest" in out
    assert "sequences at max length (32,768 tokens) at once: 8 (serving 8 of --max-num-seqs 8)" in out


def test_cli_kv_dtype_int4_and_int2_count_codes_scales_and_the_window(capsys):
    """``lcx plan --kv-dtype int4 | int2``: per token, the packed codes plus the key group's and the token's scales
    and zeros (groups of 64: Llama-2-7B's head dim 128 -> 64 + 4 + 4 bytes per head and K or V at int4, x 0.281
    of float16); per sequence, the float window of one key group (64 tokens in the model's dtype)."""
    from lcx.plan.inference import kv_bytes_for_context, kv_bytes_per_token

    model = load_model_config(MODELS / "llama2-7b.yaml")
    # per head and K or V: the codes, plus half of (the key group's 128 channel scales and zeros over 64 tokens
    # + the token's value scale and zero for each of 2 groups of 64 channels), 4 bytes per scale and zero pair
    scales = (128 * 4 // 64 + 2 * 4) // 2
    per_head = {"int4": 128 // 2 + scales, "int2": 128 // 4 + scales}
    for kv_dtype, head_bytes in per_head.items():
        want = 2 * model.n_layers * model.n_kv_heads * head_bytes
        assert kv_bytes_per_token(model, kv_dtype) == want
        window = 2 * model.n_layers * model.n_kv_heads * 64 * 128 * dtype_bytes(model.dtype)
        assert kv_bytes_for_context(model, kv_dtype, 4096) == 4096 * want + window
        rc, out, err = run_cli(capsys, MODELS / "llama2-7b.yaml", "--context", "4096", "--gpu-mem", "80GiB",
                               "--kv-dtype", kv_dtype)
        assert rc == 0 and f"{kv_dtype})" in out and "group scales and zeros" in out
    assert kv_bytes_per_token(model, "int4") / kv_bytes_per_token(model, "float16") == 72 / 256
