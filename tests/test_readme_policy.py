"""The README's custom-policy example, run exactly as written: registered, loaded from YAML, used to generate."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import jax
import numpy as np

import lcx

README = Path(__file__).resolve().parents[1] / "README.md"


def _blocks():
    text = README.read_text()
    section = text.split("<!-- custom-policy:start -->")[1].split("<!-- custom-policy:end -->")[0]
    python = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    yaml = re.search(r"```yaml\n(.*?)```", section, re.S).group(1)
    return python, yaml


def test_readme_custom_policy_registers_loads_and_generates(tmp_path, monkeypatch):
    python, yaml = _blocks()
    assert len(python.strip().splitlines()) <= 25  # "about 20 lines"
    (tmp_path / "my_policies.py").write_text(python)
    (tmp_path / "experiment.yaml").write_text(yaml)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_policies", None)
    cfg = lcx.load_config(tmp_path / "experiment.yaml")
    assert cfg.cache.policy == "vnorm" and cfg.cache.params == {"sinks": 4}
    params = lcx.init_params(cfg.model, jax.random.key(0))
    prompt = np.random.default_rng(0).integers(0, 260, (1, 40))
    gen = lcx.Generator(cfg.model, params, max_new_tokens=30, cache=cfg.cache)
    state = gen.decode(gen.prefill(prompt))
    assert state.cache.capacity == 40  # budget 32 + interval 8
    kept = np.asarray(state.cache.pos[0, 0][state.cache.valid[0, 0]])
    assert kept[:4].tolist() == [0, 1, 2, 3]  # the sinks survived 30 steps of eviction
    assert int(state.step) == 30
