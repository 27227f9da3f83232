"""Experiments end to end on a micro config: train -> finetune -> eval -> ablate, reruns, and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from lcx.cli import main
from lcx.config import ConfigError
from lcx.data import make_task
from lcx.eval import grade, markdown_table, read_csv
from lcx.experiment import finetune_sections, load_experiment
from lcx.engine import CacheCapacityError

MICRO = """
name: micro
runs_dir: {runs}
stages: [train, finetune, eval, ablate]
model: {{vocab_size: 260, d_model: 32, n_layers: 2, n_heads: 2, n_kv_heads: 1, d_ff: 64,
        max_position_embeddings: 128, attention: {{impl: xla}}}}
train: {{steps: 3, batch_size: 2, seq_len: 128, lr: 1.0e-3, log_every: 1, save_every: 2, compute_dtype: float32}}
data: {{task: passkey, params: {{instruction: false}}}}
finetune:
  rope: {{type: yarn, factor: 2.0, original_max_position_embeddings: 128}}
  max_position_embeddings: 256
  train: {{steps: 2, seq_len: 256}}
eval: {{task: passkey, params: {{instruction: false}}, lengths: [128], depths: [0.5], samples: 2, batch_size: 2,
       perplexity: {{task: corpus, samples: 2, batch_size: 2}}}}
ablate:
  policies: [full, {{policy: streaming, sinks: 2}}]
  budgets: [64]
  interval: 16
  prefill_chunk: 64
"""


@pytest.fixture
def micro(tmp_path) -> Path:
    path = tmp_path / "micro.yaml"
    path.write_text(MICRO.format(runs=tmp_path / "runs"))
    return path


@pytest.mark.slow
def test_experiment_all_stages_then_rerun_reuses_outputs(micro, tmp_path, capsys):
    assert main(["run", str(micro), "--no-progress"]) == 0
    run = tmp_path / "runs" / "micro"
    for stage in ("train", "finetune"):
        assert (run / stage / "metrics.jsonl").is_file() and (run / stage / "checkpoints").is_dir()
    for stage in ("eval", "ablate"):
        assert {"results.csv", "results.md", "accuracy_vs_length.png", "perplexity_vs_length.png", "done.json"} <= {
            p.name for p in (run / stage).iterdir()}
    rows = read_csv(run / "ablate" / "results.csv")
    assert {(r["policy"], r["budget"]) for r in rows} == {("full", ""), ("streaming", "64")}
    # both metrics for every setting, each with its 95% interval; settings name their non-default parameters
    assert {(r["setting"], r["metric"]) for r in rows} == {
        (s, m) for s in ("full", "streaming @64 sinks=2") for m in ("accuracy", "perplexity")}
    for r in rows:
        assert r["lo"] <= r["value"] <= r["hi"]
        assert 0.0 <= r["value"] <= 1.0 if r["metric"] == "accuracy" else r["value"] > 1.0
    md = (run / "ablate" / "results.md").read_text()
    assert "| streaming @64 sinks=2 |" in md and "(perplexity, 95% interval)" in md
    assert (run / "config.yaml").is_file()
    capsys.readouterr()
    mtime = (run / "ablate" / "results.csv").stat().st_mtime
    assert main(["run", str(micro), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "up to date" in err and (run / "ablate" / "results.csv").stat().st_mtime == mtime
    train_rows = [json.loads(x) for x in (run / "train" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in train_rows] == [1, 2, 3]  # the rerun trained nothing more


@pytest.mark.slow
def test_eval_reruns_when_its_checkpoint_changed(micro, tmp_path, capsys):
    """More training on a finished run: eval's done.json names the checkpoint it evaluated, so it reruns."""
    def args(*more):
        return ["run", str(micro), "stages=[train,eval]", "eval.perplexity=null", *more, "--no-progress"]

    assert main(args()) == 0
    md = tmp_path / "runs" / "micro" / "eval" / "results.md"
    assert "Model: checkpoint `train/checkpoints/3` (step 3, content " in md.read_text()
    capsys.readouterr()
    assert main(args("train.steps=5")) == 2  # changed settings need --allow-changes
    assert "train.steps: 3 -> 5" in capsys.readouterr().err
    assert main(args("train.steps=5", "--allow-changes")) == 0
    assert "inputs changed since the last run (now checkpoint" in capsys.readouterr().err
    assert "Model: checkpoint `train/checkpoints/5` (step 5, content " in md.read_text()
    done = json.loads((md.parent / "done.json").read_text())
    assert done["checkpoint"]["step"] == 5 and len(done["checkpoint"]["fingerprint"]) == 16
    assert main(args("train.steps=5")) == 0  # nothing changed now: up to date
    assert "is up to date with checkpoint" in capsys.readouterr().err


def test_experiment_finetune_sections_change_rope_and_length(micro):
    cfg = load_experiment(micro)
    model, train, data = finetune_sections(cfg)
    assert model.rope.type == "yarn" and model.max_position_embeddings == 256
    assert train.seq_len == 256 and train.steps == 2 and train.init_from.endswith("runs/micro/train")
    assert data == cfg.data


def test_experiment_grid_too_large_for_cache_is_refused_before_running(micro, tmp_path):
    with pytest.raises(CacheCapacityError, match=r"eval grid cell \(policy full, length 128\) does not fit"):
        cfg = load_experiment(micro, ["cache.max_bytes=1000", "stages=[eval]"])
        from lcx.eval.grid import run_eval
        import jax
        import lcx

        params = lcx.init_params(cfg.model, jax.random.key(0))
        run_eval(cfg.model, params, cfg.eval, cfg.cache, tmp_path / "out", progress=False)


@pytest.mark.parametrize("override, message", [
    (["stages=[train, evaluate]"], "'evaluate' is not a stage"),
    (["eval.task=passkee"], "did you mean 'passkey'"),
    (["ablate.policies=[{policy: h2oo}]"], "cache.policy='h2oo' is not a registered eviction policy"),
    (["ablate.policies=[{policy: streaming, budget: 8}]"], "budgets come from ablate.budgets"),
    (["eval.depths=[1.5]"], "eval.depths=[1.5] is invalid"),
    (["eval.samples=3"], "eval.samples=3 is invalid: must be a multiple of eval.batch_size=2"),
    (["ablate.policies=[{policy: ladder, span: 2, overlap: 0}]"], "cannot reduce anything"),
    (["finetune.rope.type=yarnn"], "rope.type='yarnn' is invalid"),
    (["train.seq_len=300"], "train.seq_len=300 is invalid: must be <= model.max_position_embeddings=128"),
])
def test_experiment_bad_config_fails_at_load(micro, override, message):
    with pytest.raises(ConfigError) as err:
        load_experiment(micro, override)
    assert message in str(err.value)


def test_experiment_missing_section_for_stage(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("stages: [train]\nmodel: {vocab_size: 260, d_model: 32, n_layers: 1, n_heads: 2, n_kv_heads: 1, "
                    "d_ff: 64}\n")
    with pytest.raises(ConfigError, match=r"stage 'train' needs the config section\(s\) \['train', 'data'\]"):
        load_experiment(path)


def test_experiment_eval_without_checkpoint_is_a_clear_error(micro, capsys):
    assert main(["eval", str(micro), "--no-progress"]) == 2
    assert "nothing to evaluate: no checkpoint" in capsys.readouterr().err


def test_eval_grading():
    passkey = make_task("passkey")
    ex = passkey.examples(0, 0, 1, 400)[0]
    assert grade(passkey, f" {ex.answer}. The pass key", ex) == 1.0
    assert grade(passkey, f" 1{ex.answer}", ex) == 0.0  # the first integer must be the key
    niah = make_task("niah", {"num_keys": 3, "num_queries": 2})
    ex = niah.examples(0, 0, 1, 600)[0]
    assert len(ex.references) == 2
    assert grade(niah, ex.references[0], ex) == 0.5 and grade(niah, ", ".join(ex.references), ex) == 1.0


def test_eval_markdown_table_layout():
    rows = [{"policy": "full", "budget": "", "rope": "trained", "length": n, "depth": d, "metric": "accuracy",
             "value": v} for n, d, v in [(64, 0.0, 1.0), (64, 1.0, 0.5), (128, 0.0, 0.0), (128, 1.0, 0.0)]]
    table = markdown_table(rows, "t")
    assert "| setting | 64 tokens | 128 tokens |" in table and "| full | 75% | 0% |" in table
    # and where the needle was lost: a column per (length, depth)
    assert "| setting | 64 @ 0% | 64 @ 100% | 128 @ 0% | 128 @ 100% |" in table
    assert "| full | 100% | 50% | 0% | 0% |" in table
    assert np.isclose(0.75, np.mean([1.0, 0.5]))


@pytest.mark.slow
def test_eval_perplexity_under_eviction_equals_full_when_budget_covers(tmp_path):
    import jax

    import lcx
    from lcx.config import CacheConfig
    from lcx.eval import perplexity

    model = lcx.ModelConfig(vocab_size=260, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64, init_std=0.3,
                            attention=lcx.AttentionConfig(impl="xla"))
    params = lcx.init_params(model, jax.random.key(0))
    for i in range(4):
        (tmp_path / f"m{i}.py").write_text(f"def f{i}(x):\n    return x + {i}\n" * 40)
    task = make_task("corpus", {"path": str(tmp_path), "val_fraction": 0.5})
    kw = dict(length=48, samples=2, batch_size=2, seed=0, prefix=16)
    full = perplexity(model, params, task, cache=CacheConfig(), **{**kw, "seed": 0})
    roomy = perplexity(model, params, task, cache=CacheConfig(policy="streaming", budget=64, interval=8), **kw)
    tight = perplexity(model, params, task, cache=CacheConfig(policy="streaming", budget=12, sinks=2, interval=4),
                       **kw)
    assert np.isclose(full, roomy, rtol=1e-4) and 1.0 < full
    assert not np.isclose(full, tight, rtol=1e-3)
