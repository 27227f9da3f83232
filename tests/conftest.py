"""Shared test fixtures. torch and transformers are imported lazily: only the parity tests need them."""

from __future__ import annotations

import os
import tempfile
from typing import TYPE_CHECKING

# Tests compare against float32 references; keep XLA's CPU matmuls at full precision.
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
# Many tests compile the same small programs (in both pytest-xdist workers and in the multi-device subprocesses,
# which inherit this environment): JAX's persistent compilation cache compiles each once per run.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "lcx-tests-jax-cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# The suite is mostly XLA compile time on small programs: skipping LLVM's optimization passes compiles about 30%
# faster (tests/test_memory.py: 97 s -> 68 s cold); the programs compute the same values, they just run slower.
# Appended, so a caller's own XLA_FLAGS (e.g. a fake device count) stay.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
# XLA's older CPU fusion emitters compile the suite's small programs faster again: 54 s -> 33 s cold for
# tests/test_paged.py + test_policies.py + kernels/test_kernels_flash.py (fast tier), same values to the tests'
# tolerances. An XLA that no longer knows the flag would abort at start-up, so the controller probes it once in a
# throwaway process; the workers and subprocesses inherit the result through XLA_FLAGS.
FAST_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
if "xla_cpu_use_fusion_emitters" not in os.environ.get("XLA_FLAGS", ""):
    import subprocess
    import sys

    _flags = f"{os.environ['XLA_FLAGS']} {FAST_EMITTERS}"
    _probe = subprocess.run([sys.executable, "-c", "import jax.numpy as jnp; jnp.zeros(2).sum().block_until_ready()"],
                            env={**os.environ, "XLA_FLAGS": _flags, "JAX_PLATFORMS": "cpu"}, capture_output=True,
                            timeout=300)
    if _probe.returncode == 0:
        os.environ["XLA_FLAGS"] = _flags

import pytest

if TYPE_CHECKING:
    import numpy as np


def pytest_configure(config):
    """Byte-compile lcx once, in the controller, before any worker starts: where the environment sets
    PYTHONDONTWRITEBYTECODE (the development machines do), nothing caches the compiled modules of an editable
    install, so every test worker and every subprocess (multi-device scenarios, fresh-process resumes, the CLI)
    would compile lcx's sources again (about 0.5 s each); Python still reads .pyc files that exist."""
    if not hasattr(config, "workerinput"):
        import compileall
        from pathlib import Path

        compileall.compile_dir(Path(__file__).resolve().parents[1] / "lcx", quiet=1)


def pytest_collection_modifyitems(config, items):
    """Skip the ``cpu_only`` tests where jax's default backend is not the CPU: they check XLA:CPU's own code paths
    (e.g. the ``xla`` backend's query blocks, taken on CPU only) or the CPU's defaults, which a GPU run does not
    have - run there they fail on the platform, not on lcx."""
    marked = [item for item in items if item.get_closest_marker("cpu_only")]
    if not marked:
        return
    import jax  # lazily: collecting tests that are not marked needs no backend

    platform = jax.default_backend()
    if platform == "cpu":
        return
    skip = pytest.mark.skip(reason=f"cpu_only: checks behaviour of jax's CPU backend; this run's is {platform!r}")
    for item in marked:
        item.add_marker(skip)


def on_gpu() -> bool:
    """Whether jax runs on a GPU: the Pallas kernels are then compiled with Triton, not interpreted."""
    import jax

    return jax.default_backend() == "gpu"


def interpreter_blocks(small):
    """The block sizes a kernel test passes: ``small`` on CPU, where the Pallas interpreter runs them and small
    tiles make short inputs span several tiles with ragged tails; None (the kernel's default tiles, those a GPU run
    compiles) on a GPU, where the test then checks the kernel as it is used - the inputs' lengths, not multiples of
    the default tiles either, still leave ragged tails."""
    return None if on_gpu() else small


# XLA:GPU computes a float32 dot at Precision.DEFAULT in TF32 (10 explicit mantissa bits: each operand rounded by up
# to 2^-11 = 4.9e-4 of itself); XLA:CPU in full float32. The ``xla`` backend's decode and blocked causal attention
# pass Precision.DEFAULT explicitly, and jax's ``default_matmul_precision`` (JAX_DEFAULT_MATMUL_PRECISION=highest
# above) only fills in dots whose precision is None (jax/_src/lax/lax.py, ``canonicalize_precision``) - so on a GPU
# those ops stay TF32 in the tests too. TF32 emulated on CPU (each dot's operands rounded to 10 bits), 200 draws of
# the shapes of tests/kernels' comparisons against the reference: at most 2.1e-3 (paged decode, queries x2, head dim
# 32); an H200 measured 4.4e-4 on tests/kernels/test_kernels_backends.py's row comparison. 5e-3 leaves 2.4x.
TF32_ATOL = 5e-3


def default_precision_atol(cpu_atol: float) -> float:
    """The absolute tolerance of a float32 comparison of an op computed at ``Precision.DEFAULT`` (the ``xla``
    backend's decode and blocked causal attention) against the HIGHEST reference: ``cpu_atol`` on CPU, where
    DEFAULT is full float32 (unchanged there), ``TF32_ATOL`` elsewhere (see above)."""
    import jax

    return cpu_atol if jax.default_backend() == "cpu" else max(cpu_atol, TF32_ATOL)


def tiered(cases, fast):
    """Parametrize ``cases`` with only the indices in ``fast`` in the fast tier; the others are marked ``slow``, so
    ``-m "not slow"`` runs a representative few (each kernel feature at least once) and the full suite all."""
    out = []
    for i, case in enumerate(cases):
        values = case if isinstance(case, tuple) else (case,)
        out.append(pytest.param(*values) if i in fast else pytest.param(*values, marks=pytest.mark.slow))
    return out


def random_hf_model(family: str, seed: int = 0, std: float = 0.08, **overrides):
    """A tiny random-weight transformers model of ``family`` (llama / mistral / qwen2 / qwen3 / gemma2 / gemma3),
    eager attention, fp32.

    Every parameter (biases and norm scales included) is redrawn with ``std`` well above the default init, so that
    a wrong transpose, bias or scale shows in the logits instead of hiding under tiny activations.
    """
    import torch
    import transformers

    base = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False,
                attn_implementation="eager")
    if family == "mistral":
        base["sliding_window"] = None
    if family.startswith("gemma"):  # transformers' Gemma defaults (head_dim 256, window 4096) are not tiny
        base.update(head_dim=16, sliding_window=8, query_pre_attn_scalar=16)
    base.update(overrides)
    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
           "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
           "gemma2": transformers.Gemma2Config, "gemma3": transformers.Gemma3TextConfig}[family]
    model_cls = {"llama": transformers.LlamaForCausalLM, "mistral": transformers.MistralForCausalLM,
                 "qwen2": transformers.Qwen2ForCausalLM, "qwen3": transformers.Qwen3ForCausalLM,
                 "gemma2": transformers.Gemma2ForCausalLM, "gemma3": transformers.Gemma3ForCausalLM}[family]
    config = cls(**base)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # Gemma's norms scale by (1 + w): their weights sit around 0
                p.copy_((0.0 if family.startswith("gemma") else 1.0) + 0.2 * torch.randn_like(p))
            else:
                p.copy_(std * torch.randn_like(p))
    return model


def hf_logits(model, ids) -> "np.ndarray":
    import numpy as np
    import torch

    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(ids), dtype=torch.long)).logits.float().numpy()


@pytest.fixture
def hf_factory():
    return random_hf_model


def assert_kept_slots_hold(cache, reference, prompt_len: int, names=("k", "v", "k_scale", "v_scale")) -> None:
    """After evictions, every live slot of layer 0 (row 0) of a slot ``cache`` holds the stored bytes (codes and
    scales) that ``reference`` (the same tokens, nothing evicted) holds at that slot's position - a per-token format
    moves its bytes unchanged when it compacts - and something was evicted."""
    import numpy as np

    for kv_head in range(cache.pos.shape[2]):
        live = np.asarray(cache.valid[0, 0, kv_head])
        pos = np.asarray(cache.pos[0, 0, kv_head])[live]
        assert len(pos) < prompt_len  # something was evicted
        for name in names:
            np.testing.assert_array_equal(np.asarray(getattr(cache, name)[0, 0, kv_head])[live],
                                          np.asarray(getattr(reference, name)[0, 0, kv_head])[pos], err_msg=name)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop jax's in-memory caches of compiled programs after each test module.

    XLA:CPU maps the code of every compiled program into memory regions of its own (~3 per kernel), and jax keeps
    every program alive in its caches: a pytest-xdist worker running half the suite crossed Linux's
    ``vm.max_map_count`` (65,530 regions; measured ~15,000 after its first 9 tests), the next mapping failed inside
    XLA and the worker died with a segfault in ``executable.serialize()`` - in a test that passes alone. Clearing the
    caches unmaps the programs no test holds any more (a later module that needs one again reads it back from the
    persistent compilation cache); it is done once a worker holds more than ``lcx.engine.MAX_MAPPINGS``, so
    programs that modules share stay compiled until then (``lcx.engine.release_compiled``, which evaluation grids
    call between cells for the same reason)."""
    yield
    from lcx.engine import release_compiled

    release_compiled()


