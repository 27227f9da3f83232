"""``eval.speculative`` (issue 64): a grid measures each setting's acceptance as the draft of self-speculative
decoding for the full cache, on the cell's own prompts, beside its accuracy; settings that cannot draft are named
with why and leave the columns empty; the YAML form parses and bad values name the key."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import lcx
from lcx.config import CacheConfig, ConfigError
from lcx.experiment.config import load_experiment as load_config
from lcx.eval.acceptance import acceptance, columns, draft_refusal
from lcx.eval.config import AblateConfig, EvalConfig
from lcx.eval.grid import run_ablate

CFG = lcx.ModelConfig(vocab_size=260, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64,
                      max_position_embeddings=256, init_std=0.1)
YAML = """
name: g
stages: [ablate]
model: {{vocab_size: 260, d_model: 32, n_layers: 2, n_heads: 2, n_kv_heads: 1, d_ff: 64}}
eval: {{task: passkey, params: {{instruction: false}}, lengths: [160], samples: 4, batch_size: 4,
       speculative: {speculative}}}
ablate: {{policies: [full, streaming], budgets: [64], interval: 16}}
"""


@pytest.fixture(scope="module")
def params():
    return lcx.init_params(CFG, jax.random.key(0))


def test_a_grid_reports_each_drafts_acceptance_beside_its_accuracy(params, tmp_path, capsys):
    ev = EvalConfig.from_mapping({"task": "passkey", "params": {"instruction": False}, "lengths": [160],
                                  "samples": 4, "batch_size": 4, "speculative": {"k": 3}})
    ablate = AblateConfig.from_mapping({"policies": [{"policy": "snapkv", "window": 8},
                                                     {"policy": "full", "kv_dtype": "int4", "kv_group": 16}],
                                        "budgets": [64, 192], "interval": 16, "prefill_chunk": 64})
    rows = run_ablate(CFG, params, ev, ablate, tmp_path, progress=False)
    by = {r["setting"]: r for r in rows}
    for name in ("snapkv @64 window=8", "full kv_dtype=int4 kv_group=16"):  # tokens per verification: 1 .. k + 1
        assert 1.0 <= by[name]["accept_lo"] <= by[name]["accept"] <= by[name]["accept_hi"] <= 4.0
    assert by["full kv_dtype=int4 kv_group=16"]["accept"] > 2.5  # 4-bit codes of every token: most drafts agree
    assert by["snapkv @192 window=8"].get("accept") in (None, "")  # a budget that holds the prompt cannot draft
    assert "holds the whole 160-token prompt" in capsys.readouterr().err  # named with why
    report = (tmp_path / "results.md").read_text()
    assert "Draft acceptance (eval.speculative)" in report and "snapkv" in report.split("Draft acceptance")[1]
    csv_text = (tmp_path / "results.csv").read_text().splitlines()[0]
    assert csv_text.endswith("accept,accept_lo,accept_hi")


def test_acceptance_is_k_plus_one_for_a_draft_as_good_as_the_target(params):
    """An 8-bit draft of every token picks the float cache's tokens: nearly every verification emits k + 1."""
    from lcx.data import make_task

    task = make_task("passkey", {"instruction": False})
    examples = task.examples(1234, 0, 4, 160, "validation")
    per = acceptance(CFG, params, task, examples, draft=CacheConfig(kv_dtype="int8"), k=3, batch_size=4,
                     max_new_tokens=12)
    assert per.shape == (4,) and np.nanmean(per) > 3.5
    got = columns(per, 3)
    assert got["accept_lo"] <= got["accept"] <= got["accept_hi"] <= 4.0 + 1e-9


def test_the_yaml_form_parses_and_bad_values_name_the_key(tmp_path):
    path = tmp_path / "g.yaml"
    path.write_text(YAML.format(speculative="{k: 3}"))
    assert load_config(path).eval.speculative.k == 3
    path.write_text(YAML.format(speculative="{}"))
    assert load_config(path).eval.speculative.k == 4
    for bad, match in (("{k: 0}", r"eval.speculative.k=0 is invalid"), ("{kk: 3}", "eval.speculative.kk")):
        path.write_text(YAML.format(speculative=bad))
        with pytest.raises(ConfigError, match=match):
            load_config(path)
    assert draft_refusal(CFG, CacheConfig(policy="streaming", budget=256), 160, "streaming", 4) is not None
    assert "one_shot" in draft_refusal(CFG, CacheConfig(policy="snapkv", budget=64), 160, "one_shot", 4)
    assert draft_refusal(CFG, CacheConfig(policy="snapkv", budget=64), 160, "streaming", 4) is None
