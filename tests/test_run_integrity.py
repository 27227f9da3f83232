"""Run integrity: one writer per run directory, verified checkpoints, failures that end runs cleanly, Ctrl-C that
saves, settings changes refused or recorded, and one-line errors at the edges (HF directories, run directories,
config files). Each test reproduces a fault a user met and asserts the behaviour lcx promises instead."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from lcx.config import AttentionConfig, ConfigError, ModelConfig
from lcx.train import (CheckpointSaveError, DataConfig, TrainConfig, TrainingInterrupted, load_checkpoint,
                       read_metrics, run_training)
from lcx.train.checkpoint import load_checkpoint_info
from lcx.train.run_lock import RunLock, RunLockedError

MODEL = ModelConfig(vocab_size=260, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64,
                    max_position_embeddings=64, attention=AttentionConfig(impl="xla"), init_std=0.05)
TRAIN = TrainConfig(steps=8, batch_size=2, seq_len=32, lr=1e-2, warmup_steps=1, log_every=1, save_every=2, keep=3)
DATA = DataConfig(task="mqar", params={"num_pairs": 3, "num_queries": 2})
ROOT = Path(__file__).resolve().parents[1]


def _curve(path: Path) -> list[tuple]:
    return [(r["step"], r["loss"], r["lr"]) for r in read_metrics(path)]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    return run_training(MODEL, TRAIN, DATA, tmp_path_factory.mktemp("full"), progress=False)


def _lcx(*args, cwd: Path, timeout: float = 120, **popen):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "lcx", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, **popen)


def _config(tmp_path: Path, **train) -> Path:
    doc = {"name": "r", "runs_dir": str(tmp_path / "runs"), "stages": ["train"],
           "model": {"vocab_size": 260, "d_model": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "d_ff": 64,
                     "max_position_embeddings": 64, "attention": {"impl": "xla"}},
           "train": {"steps": 8, "batch_size": 2, "seq_len": 32, "lr": 0.01, "log_every": 1, "save_every": 2,
                     **train},
           "data": {"task": "mqar", "params": {"num_pairs": 3, "num_queries": 2}}}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


# ------------------------------------------------------------------------------------------ one writer per run dir
@pytest.mark.slow
def test_second_trainer_is_refused_and_a_stale_lock_is_taken_over(tmp_path, capfd):
    with RunLock(tmp_path):  # a live trainer holds the run directory
        owner = json.loads((tmp_path / "lock.json").read_text())
        assert owner["pid"] == os.getpid() and owner["host"] == socket.gethostname()
        with pytest.raises(RunLockedError, match=rf"is in use by pid {os.getpid()} on host .* wait for that run"):
            run_training(MODEL, TRAIN, DATA, tmp_path, progress=False)
    assert not (tmp_path / "lock.json").exists()
    assert not (tmp_path / "metrics.jsonl").exists()  # the refused trainer wrote nothing
    # a lock file left by a process killed with -9 (its flock died with it) is stale: taken over, with a note
    (tmp_path / "lock.json").write_text(json.dumps({"pid": 999999, "host": socket.gethostname(), "started": "x"}))
    run_training(MODEL, dataclasses.replace(TRAIN, steps=2), DATA, tmp_path, progress=False)
    assert "taking over the stale lock of pid 999999" in capfd.readouterr().err


# ------------------------------------------------------------------------------------------ checkpoint integrity
def test_corrupted_newest_checkpoint_resumes_from_the_previous_one_with_identical_losses(full_run, tmp_path, capfd):
    run = tmp_path / "run"
    shutil.copytree(full_run.run_dir, run)
    shutil.rmtree(run / "checkpoints" / "8")  # as if the run had stopped after saving step 6
    # damage step 6's parameter data in place (one flipped byte region), keep its size
    data = max((p for p in (run / "checkpoints" / "6" / "params").rglob("*") if p.is_file()),
               key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2: len(raw) // 2 + 64] = bytes(b ^ 0xFF for b in raw[len(raw) // 2: len(raw) // 2 + 64])
    data.write_bytes(bytes(raw))
    resumed = run_training(MODEL, TRAIN, DATA, run, progress=False)
    err = capfd.readouterr().err
    assert "checkpoints/6 failed verification (file params/" in err and "does not match its SHA-256" in err
    assert (run / "checkpoints" / "6.corrupt").is_dir()  # moved aside, never deleted
    assert _curve(resumed.metrics_path) == _curve(full_run.metrics_path)  # resumed from step 4: the same curve
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == ["4", "6", "8"]
    _, _, info = load_checkpoint_info(run)
    assert info.step == 8 and len(info.fingerprint) == 16


# ------------------------------------------------------------------------------------------ failures end runs
def test_a_save_that_fails_mid_run_stops_the_run_at_once(tmp_path):
    seen = []

    def break_checkpoints(step, row):
        seen.append(step)
        if step == 3:  # the directory vanishes under the run (like a full or unmounted disk)
            time.sleep(2)  # after step 2's background write finished
            shutil.rmtree(tmp_path / "checkpoints")
            (tmp_path / "checkpoints").write_text("not a directory")

    t0 = time.perf_counter()
    with pytest.raises(CheckpointSaveError, match=r"saving checkpoint '.*checkpoints/4' failed: NotADirectoryError"):
        run_training(MODEL, TRAIN, DATA, tmp_path, progress=False, callback=break_checkpoints)
    assert time.perf_counter() - t0 < 60 and max(seen) <= 5  # surfaced right after step 4, not at the next save


@pytest.mark.slow
def test_cli_save_failure_exits_2_in_seconds_with_one_line(tmp_path):
    cfg = _config(tmp_path)
    (tmp_path / "runs" / "r" / "train").mkdir(parents=True)
    (tmp_path / "runs" / "r" / "train" / "checkpoints").write_text("a file where the checkpoints go")
    t0 = time.perf_counter()
    out = _lcx("train", str(cfg), "--no-progress", cwd=tmp_path, timeout=120)
    assert out.returncode == 2 and time.perf_counter() - t0 < 60
    errors = [line for line in out.stderr.splitlines() if "error" in line.lower() or "Traceback" in line]
    assert errors == [f"lcx train: error: checkpoints cannot be written to "
                      f"'{tmp_path / 'runs' / 'r' / 'train' / 'checkpoints'}': it is a file, not a directory; move "
                      "it away or choose another run directory"]


def test_ctrl_c_saves_the_current_step_and_resumes(full_run, tmp_path):
    def interrupt(step, row):
        if step == 5:
            raise KeyboardInterrupt

    with pytest.raises(TrainingInterrupted, match=r"interrupted after step 5 \(checkpoint .*checkpoints/5\)"):
        run_training(MODEL, TRAIN, DATA, tmp_path, progress=False, callback=interrupt)
    assert (tmp_path / "checkpoints" / "5").is_dir()  # not a save step: saved because of the interrupt
    resumed = run_training(MODEL, TRAIN, DATA, tmp_path, progress=False)
    assert _curve(resumed.metrics_path) == _curve(full_run.metrics_path)


@pytest.mark.slow
def test_cli_sigint_finishes_the_step_saves_and_exits_130(tmp_path):
    cfg = _config(tmp_path, steps=100000, save_every=100000)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "lcx", "train", str(cfg), "--no-progress"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "runs" / "r" / "train" / "metrics.jsonl"
    deadline = time.time() + 90
    while time.time() < deadline and (not metrics.is_file() or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("lcx train: interrupted after step ") and "rerun the same command to resume" in last
    step = int(last.split("after step ")[1].split()[0])
    assert step >= 3 and (tmp_path / "runs" / "r" / "train" / "checkpoints" / str(step)).is_dir()
    assert "Traceback" not in err


# ------------------------------------------------------------------------------------------ settings history
@pytest.mark.slow
def test_changed_settings_are_refused_or_recorded(full_run, tmp_path):
    run = tmp_path / "run"
    run_training(MODEL, TRAIN, DATA, run, progress=False, max_steps=4)
    longer = dataclasses.replace(TRAIN, steps=12, lr=2e-2)
    with pytest.raises(ConfigError, match=r"trained to step 4 with other settings \(train.lr: 0.01 -> 0.02; "
                                          r"train.steps: 8 -> 12\); .*--allow-changes"):
        run_training(MODEL, longer, DATA, run, progress=False)
    assert yaml.safe_load((run / "config.yaml").read_text())["train"]["steps"] == 8  # the original kept
    # operational settings may change freely
    run_training(MODEL, dataclasses.replace(TRAIN, log_every=2, keep=5), DATA, run, progress=False, max_steps=4)
    result = run_training(MODEL, longer, DATA, run, progress=False, allow_changes=True)
    segments = [json.loads(x) for x in (run / "settings.jsonl").read_text().splitlines()]
    assert [s["from_step"] for s in segments] == [0, 4]
    assert segments[0]["train"]["lr"] == 0.01 and segments[1]["train"]["lr"] == 0.02
    assert segments[1]["changed"] == ["train.lr: 0.01 -> 0.02", "train.steps: 8 -> 12"]
    rows = read_metrics(result.metrics_path)
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert rows[3]["lr"] == read_metrics(full_run.metrics_path)[3]["lr"]  # steps 1-4 ran the first schedule
    from lcx.train import lr_schedule

    assert np.isclose(rows[4]["lr"], float(lr_schedule(longer)(4)))  # the new schedule from step 4 on


# ------------------------------------------------------------------------------------------ edges: one line, exit 2
def _hf_dir(tmp_path: Path, sharded: bool = False) -> Path:
    import jax

    from lcx import hf
    from lcx.model import init_params

    path = tmp_path / "hf"
    hf.save_hf(MODEL, init_params(MODEL, jax.random.key(0)), path,
                max_shard_bytes=20_000 if sharded else 4 * 1024 ** 3)
    return path


@pytest.mark.parametrize("fault,message", [
    ("missing_shard", r"lists shard\(s\) \['model-00001-of-.*'\] that are missing from"),
    ("truncated", r"model.safetensors is not a readable safetensors file .*truncated or damaged"),
    ("no_hidden_size", r"config.json: the required key\(s\) \['hidden_size'\] are missing"),
    ("not_a_dict", r"config.json holds a JSON list, not an object of model settings"),
    ("broken_index", r"model.safetensors.index.json is not a valid safetensors index"),
])
def test_broken_hf_directories_fail_with_one_line(tmp_path, capsys, fault, message):
    from lcx.cli import main

    path = _hf_dir(tmp_path, sharded=fault in ("missing_shard", "broken_index"))
    if fault == "missing_shard":
        next(path.glob("model-00001-of-*.safetensors")).unlink()
    elif fault == "truncated":
        data = (path / "model.safetensors").read_bytes()
        (path / "model.safetensors").write_bytes(data[: len(data) // 3])
    elif fault == "broken_index":
        (path / "model.safetensors.index.json").write_text("{\"weight_map\": ")
    else:
        cfg = json.loads((path / "config.json").read_text())
        del cfg["hidden_size"]
        (path / "config.json").write_text(json.dumps(cfg if fault == "no_hidden_size" else [cfg]))
    assert main(["generate", "--model", str(path), "--ids", "1,2", "--max-new-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("lcx generate: error: ") and __import__("re").search(message, err), err


def test_unwritable_run_directory_and_malformed_yaml_fail_with_one_line(tmp_path, capsys):
    from lcx.cli import main

    (tmp_path / "blocker").write_text("a file where a directory should be")
    cfg = _config(tmp_path)
    assert main(["train", str(cfg), f"runs_dir={tmp_path / 'blocker' / 'runs'}", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("lcx train: error: run directory ") and "cannot be created: Not a directory" in err[-1]
    (tmp_path / "list.yaml").write_text("- model\n- train\n")
    assert main(["train", str(tmp_path / "list.yaml")]) == 2
    assert "must hold a mapping of sections" in capsys.readouterr().err
    assert load_checkpoint  # the public loader stays importable from lcx.train
