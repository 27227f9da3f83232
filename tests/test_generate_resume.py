"""Save the decode state at step t, restore it in a fresh process, continue: identical tokens."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

SCRIPT = textwrap.dedent("""
    import json, sys
    import jax, numpy as np, lcx
    from lcx.config import CacheConfig
    from lcx.engine import Generator
    mode, path = sys.argv[1], sys.argv[2]
    cfg = lcx.ModelConfig(vocab_size=97, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96, init_std=0.1)
    params = lcx.init_params(cfg, jax.random.key(0))
    gen = Generator(cfg, params, max_new_tokens=20, cache=CacheConfig(prefill_chunk=8),
                    sampling=lcx.SamplingConfig(temperature=0.8, top_k=30), seed=7)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 22]]
    if mode == "full":
        state = gen.decode(gen.prefill(prompts))
    elif mode == "save":
        state = gen.decode(gen.prefill(prompts), steps=9)
        gen.save(state, path)
    else:
        state = gen.restore(path)
        assert int(state.step) == 9, int(state.step)
        state = gen.decode(state)
    print(json.dumps(np.asarray(state.tokens).tolist()))
""")


def _run(tmp_path: Path, mode: str) -> list:
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    out = subprocess.run([sys.executable, str(script), mode, str(tmp_path / "ckpt")], capture_output=True,
                         text=True, cwd=Path(__file__).resolve().parents[1], timeout=300)
    if out.returncode:
        pytest.fail(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_generate_resume_in_fresh_process_gives_identical_tokens(tmp_path):
    full = _run(tmp_path, "full")
    partial = _run(tmp_path, "save")
    resumed = _run(tmp_path, "restore")
    assert resumed == full
    assert np.asarray(partial)[:, 9:].tolist() != np.asarray(full)[:, 9:].tolist()  # the save was mid-way


@pytest.mark.slow
def test_generate_restore_refuses_other_settings(tmp_path):
    import jax

    import lcx
    from lcx.config import ConfigError
    from lcx.engine import Generator

    cfg = lcx.ModelConfig(vocab_size=31, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32)
    params = lcx.init_params(cfg, jax.random.key(0))
    gen = Generator(cfg, params, max_new_tokens=5, seed=1)
    gen.save(gen.decode(gen.prefill([[1, 2, 3]]), steps=2), tmp_path / "s")
    other = Generator(cfg, params, max_new_tokens=5, seed=2)
    with pytest.raises(ConfigError, match="was saved with seed=1, this generator has seed=2"):
        other.restore(tmp_path / "s")
    with pytest.raises(ConfigError, match="is not a decode-state checkpoint"):
        gen.restore(tmp_path / "missing")
