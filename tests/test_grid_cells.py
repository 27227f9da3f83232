"""Grids as persisted cells: a kill -9 loses only the running cells, shards split a grid and merge to the
one-process results, changed inputs recompute exactly the cells they touch, locks of dead workers are taken over."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lcx.cli import main
from lcx.config import ConfigError
from lcx.eval import read_csv
from lcx.eval.cells import Cell, CellStore, Shard, assign, try_lock

ROOT = Path(__file__).resolve().parents[1]

TRAIN = """
name: trained
runs_dir: {runs}
stages: [train]
model: {{vocab_size: 260, d_model: 32, n_layers: 2, n_heads: 2, n_kv_heads: 1, d_ff: 64,
        max_position_embeddings: 128, attention: {{impl: xla}}}}
train: {{steps: 2, batch_size: 2, seq_len: 128, lr: 1.0e-3, log_every: 1, save_every: 2, compute_dtype: float32}}
data: {{task: passkey, params: {{instruction: false}}}}
"""

GRID = """
name: {name}
runs_dir: {runs}
stages: [ablate]
model: {{vocab_size: 260, d_model: 32, n_layers: 2, n_heads: 2, n_kv_heads: 1, d_ff: 64,
        max_position_embeddings: 128, attention: {{impl: xla}}}}
eval: {{task: passkey, params: {{instruction: false}}, lengths: [128, 192], depths: [0.5], samples: 2, batch_size: 2,
       checkpoint: {checkpoint}, perplexity: {{task: corpus, samples: 2, batch_size: 2}}}}
ablate:
  policies: [full, {{policy: streaming, sinks: 2}}]
  budgets: [64]
  interval: 16
  prefill_chunk: 64
"""
N_CELLS = 8  # 2 settings x 2 lengths x (passkey + perplexity)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("trained")
    cfg = root / "train.yaml"
    cfg.write_text(TRAIN.format(runs=root / "runs"))
    assert main(["run", str(cfg), "--no-progress"]) == 0
    return root / "runs" / "trained" / "train"


def _grid(tmp_path: Path, trained: Path, name: str = "grid") -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(GRID.format(name=name, runs=tmp_path / "runs", checkpoint=trained))
    return path


def _records(stage: Path) -> dict[str, dict]:
    return {d.name: json.loads((d / "cell.json").read_text()) for d in sorted((stage / "cells").iterdir())
            if d.is_dir() and not d.name.startswith(".")}


def _table(stage: Path) -> list[dict]:
    """results.csv without the wall time (the only column two runs of one cell may differ in)."""
    return [{k: v for k, v in row.items() if k != "seconds"} for row in read_csv(stage / "results.csv")]


def _lcx(*args: str) -> subprocess.Popen:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "lcx", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_kill_9_mid_grid_then_rerun_computes_only_the_missing_cells(trained, tmp_path, capsys):
    cfg = _grid(tmp_path, trained)
    stage = tmp_path / "runs" / "grid" / "ablate"
    worker = _lcx("ablate", str(cfg), "--no-progress")
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline and len(_records(stage) if (stage / "cells").is_dir() else {}) < 2:
            assert worker.poll() is None, worker.stdout.read()
            time.sleep(0.2)
    finally:
        worker.send_signal(signal.SIGKILL)
        worker.wait(timeout=30)
    before = _records(stage)
    assert 2 <= len(before) < N_CELLS and not (stage / "done.json").exists()
    capsys.readouterr()
    assert main(["ablate", str(cfg), "--no-progress"]) == 0
    assert f"{len(before)} of {N_CELLS} cells already done" in capsys.readouterr().err
    after = _records(stage)
    assert len(after) == N_CELLS
    assert {k: after[k] for k in before} == before  # the finished cells were not recomputed
    assert {r["pid"] for k, r in after.items() if k not in before} == {os.getpid()}
    assert not [p for p in (stage / "cells").iterdir()
                if p.name.startswith(".tmp.") or p.name.endswith(".lock") and not p.name.startswith(".")]
    assert (stage / "done.json").is_file() and len(read_csv(stage / "results.csv")) == N_CELLS

    # The grid grows: a new budget runs only its own cells
    capsys.readouterr()
    assert main(["ablate", str(cfg), "ablate.budgets=[64,96]", "--no-progress"]) == 0
    grown = _records(stage)
    assert len(grown) == N_CELLS + 4 and {k: grown[k] for k in after} == after
    assert len(read_csv(stage / "results.csv")) == N_CELLS + 4
    # A changed input recomputes exactly the cells it touches: perplexity windows, not the passkey cells
    # (other windows of the same shape: the compiled programs are reused)
    assert main(["ablate", str(cfg), "ablate.budgets=[64,96]", "eval.perplexity.params={bos: true}",
                 "--no-progress"]) == 0
    changed = _records(stage)
    kept = {k for k in grown if changed[k] == grown[k]}
    assert kept == {k for k, r in grown.items() if r["inputs"]["metric"] == "accuracy"} and len(kept) == 6
    assert all(r["inputs"]["perplexity"]["params"] == {"bos": True} for k, r in changed.items() if k not in kept)

    # --merge on demand with a cell missing: the tables of the rest, saying so; no done.json
    victim = next(iter(sorted(changed)))
    import shutil

    shutil.rmtree(stage / "cells" / victim)
    (stage / "done.json").unlink()
    capsys.readouterr()
    assert main(["ablate", str(cfg), "ablate.budgets=[64,96]", "eval.perplexity.params={bos: true}",
                 "--merge"]) == 0
    md = (stage / "results.md").read_text()
    assert f"Partial: {N_CELLS + 3} of {N_CELLS + 4} cells done" in md and not (stage / "done.json").exists()
    assert len(read_csv(stage / "results.csv")) == N_CELLS + 3


@pytest.mark.slow
def test_two_shards_split_the_grid_and_merge_to_the_one_process_results(trained, tmp_path):
    one = _grid(tmp_path, trained, "one")
    assert main(["run", str(one), "--no-progress"]) == 0
    two = _grid(tmp_path, trained, "two")
    workers = [_lcx("run", str(two), "--shard", f"{i}/2", "--no-progress") for i in range(2)]
    logs = [w.communicate(timeout=600)[0] for w in workers]
    assert [w.returncode for w in workers] == [0, 0], logs
    stage = tmp_path / "runs" / "two" / "ablate"
    records = _records(stage)
    assert len(records) == N_CELLS
    pids = {w.pid for w in workers}
    assert {r["pid"] for r in records.values()} == pids  # both workers computed cells
    assert _table(stage) == _table(tmp_path / "runs" / "one" / "ablate")
    merged = [json.loads(x) for x in (stage / "outputs.jsonl").read_text().splitlines()]
    assert merged == [json.loads(x) for x in
                      (tmp_path / "runs" / "one" / "ablate" / "outputs.jsonl").read_text().splitlines()]
    assert (stage / "done.json").is_file() and "(shard " in "".join(logs)
    # every cell's own record: its rows, outputs, inputs and the checkpoint's fingerprint
    record = next(iter(records.values()))
    assert record["inputs"]["checkpoint"]["fingerprint"] and record["rows"] and record["host"]


def test_lock_of_a_live_worker_is_respected_and_of_a_killed_one_taken_over(tmp_path):
    path = tmp_path / "cells" / "c.lock"
    code = ("import sys, time; from pathlib import Path; from lcx.eval.cells import try_lock\n"
            f"with try_lock(Path({str(path)!r})) as held:\n    print(held, flush=True); time.sleep(600)\n")
    holder = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "True"
        with try_lock(path) as held:
            assert not held
        assert f"pid {holder.pid}" in path.read_text()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    with try_lock(path) as held:
        assert held and f"pid {os.getpid()}" in path.read_text()


def test_store_persists_whole_cells_and_refuses_other_inputs(tmp_path):
    store = CellStore(tmp_path / "cells")
    cell = Cell("a-1", {"x": (1, 2), "p": Path("/p")})
    assert store.load(cell) is None
    store.save(cell, [{"value": 0.5}], [{"output": "7"}], 1.0)
    record = store.load(cell)
    assert record["rows"] == [{"value": 0.5}] and record["outputs"] == [{"output": "7"}]
    assert store.load(Cell("a-1", {"x": (1, 3), "p": Path("/p")})) is None  # other inputs: not done
    (store.path(cell) / "outputs.jsonl").write_text("{broken")
    assert store.load(cell) is None  # an unreadable record is recomputed, never served
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    import socket

    orphan = store.root / f".tmp.{socket.gethostname()}.{dead.stdout.strip()}.abcd"
    orphan.mkdir()
    store.clean()
    assert not orphan.exists()


def test_shards_partition_the_cells_deterministically():
    cells = [Cell(f"c{i}", {}, cost=float(1 + i % 5)) for i in range(23)]
    shares = [assign(cells, Shard(i, 3)) for i in range(3)]
    assert sorted(i for s in shares for i in s) == list(range(23))
    assert shares == [assign(cells, Shard(i, 3)) for i in range(3)]
    loads = [sum(cells[i].cost for i in s) for s in shares]
    assert max(loads) - min(loads) <= 5


@pytest.mark.parametrize("text", ["2/2", "1", "-1/2", "a/b", "0/0"])
def test_bad_shard_is_one_clear_error(text, tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"--shard .* is invalid: I/N"):
        Shard.parse(text)
    cfg = tmp_path / "x.yaml"
    cfg.write_text("name: x\nstages: [eval]\neval: {task: passkey}\n")
    assert main(["run", str(cfg), f"--shard={text}"]) == 2
    assert "--shard" in capsys.readouterr().err


def test_policy_entries_choose_their_ropes_lengths_and_samples():
    from lcx.eval.config import AblateConfig, EvalConfig
    from lcx.eval.grid import _cells

    ablate = AblateConfig.from_mapping({
        "ropes": [{"name": "trained"}, {"name": "yarn", "type": "yarn", "factor": 2.0}],
        "policies": [{"policy": "full", "ropes": ["trained"]},
                     {"policy": "full", "ropes": ["yarn"], "lengths": [256], "samples": 1},
                     {"policy": "streaming", "ropes": ["trained"], "samples": 3}],
        "budgets": [64]})
    ev = EvalConfig(task="passkey", lengths=(128, 256), samples=2, batch_size=1)
    cells = [(s.policy, s.samples, v.name, n) for s, v, _, n, _, _ in _cells(ablate.settings(), ablate.ropes,
                                                                          {"passkey": None}, ev)]
    assert cells == [("full", None, "trained", 128), ("full", None, "trained", 256), ("full", 1, "yarn", 256),
                     ("streaming", 3, "trained", 128), ("streaming", 3, "trained", 256)]
    for entry, message in (({"policy": "full", "ropes": ["ntk"]}, r"ropes=\['ntk'\] is invalid: .*\['trained'\]"),
                           ({"policy": "full", "samples": 0}, r"samples=0 is invalid: a positive integer"),
                           ({"policy": "full", "lengths": "256"}, r"lengths='256' is invalid")):
        with pytest.raises(ConfigError, match=message):
            AblateConfig.from_mapping({"policies": [entry]})


def test_a_full_entry_limited_to_short_lengths_gets_a_cache_for_those():
    """One compiled capacity per full-cache setting: sized for the longest length the entry runs, not the grid's
    (a full entry stopped at 16k of a 32k grid computed attention over 32k slots)."""
    from lcx.config import ModelConfig
    from lcx.eval.config import AblateConfig, EvalConfig
    from lcx.eval.grid import _plan

    model = ModelConfig(vocab_size=260, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64,
                        max_position_embeddings=128)
    ablate = AblateConfig.from_mapping({"policies": [{"policy": "full", "lengths": [128]}, {"policy": "full",
                                                     "dtype": "float32"}]})
    ev = EvalConfig(task="passkey", params={"instruction": False}, lengths=(128, 512), samples=1, batch_size=1)
    grid = _plan({"trained": (model, None)}, ev, ablate.settings(), ablate.ropes, None, {})
    short, every = ablate.settings()
    assert grid.capacities[(short, "trained", 128)] < 512 <= grid.capacities[(every, "trained", 128)]


def test_one_setting_in_two_entries_at_other_lengths_is_one_row_of_the_grid(monkeypatch):
    from lcx.eval import grid
    from lcx.eval.config import AblateConfig, EvalConfig

    ev = EvalConfig(task="passkey", lengths=(128, 256), samples=2, batch_size=1)
    monkeypatch.setattr(grid, "_run", lambda *a, **k: [])
    split = AblateConfig.from_mapping({"policies": [{"policy": "streaming", "lengths": [128], "samples": 1},
                                                    {"policy": "streaming", "lengths": [256]}]})
    assert grid.run_ablate(None, None, ev, split, Path("unused")) == []
    overlap = AblateConfig.from_mapping({"policies": [{"policy": "streaming", "samples": 1},
                                                      {"policy": "streaming", "lengths": [256]}]})
    with pytest.raises(ConfigError, match=r"settings \['streaming @64'\] appear twice"):
        grid.run_ablate(None, None, ev, overlap, Path("unused"))
    # the layout is a setting of its own (its bytes differ): both layouts of one policy are two rows, not a clash
    layouts = AblateConfig.from_mapping({"policies": [{"policy": "streaming"},
                                                      {"policy": "streaming", "layout": "paged", "page_size": 64}]})
    assert grid.run_ablate(None, None, ev, layouts, Path("unused")) == []
    assert [grid.setting_label(s.cache(128)) for s in layouts.settings()] == [
        "streaming @64", "streaming @64 layout=paged page_size=64"]
