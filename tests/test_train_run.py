"""run_training end to end on a micro model: metrics, checkpoints, resume (bitwise), Ctrl-C, fine-tuning, errors.

Every run shares one model and train config, so the step compiles once for the module (``compile_train_step`` is
cached per config); the fine-tune test compiles a second, longer-context step.
"""

from __future__ import annotations

import dataclasses
import re
import shutil

import jax
import numpy as np
import pytest
import yaml

from lcx.config import AttentionConfig, ConfigError, ModelConfig, RopeConfig
from lcx.train import (CheckpointError, DataConfig, TrainConfig, finetune_config, initial_params, load_checkpoint,
                       read_metrics, run_training, source_config)

MODEL = ModelConfig(vocab_size=260, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64,
                    max_position_embeddings=64, attention=AttentionConfig(impl="xla"), init_std=0.05)
TRAIN = TrainConfig(steps=8, batch_size=4, seq_len=32, lr=1e-2, warmup_steps=1, log_every=1, save_every=3, keep=2)
DATA = DataConfig(task="mqar", params={"num_pairs": 3, "num_queries": 2})


def _same(a, b) -> bool:
    return all(jax.tree.leaves(jax.tree.map(lambda x, y: np.array_equal(np.asarray(x), np.asarray(y)), a, b)))


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    return run_training(MODEL, TRAIN, DATA, tmp_path_factory.mktemp("full"), progress=False)


@pytest.mark.slow
def test_train_run_writes_metrics_config_and_checkpoints(full_run):
    rows = read_metrics(full_run.metrics_path)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert {"loss", "answer_loss", "accuracy", "grad_norm", "lr", "tokens_per_s", "answer_tokens"} <= set(rows[0])
    assert rows[-1]["loss"] < rows[0]["loss"] and all(np.isfinite(r["loss"]) for r in rows)
    assert sorted(p.name for p in full_run.checkpoint_dir.iterdir() if p.name.isdigit()) == ["6", "8"]  # keep=2
    saved = yaml.safe_load((full_run.run_dir / "config.yaml").read_text())
    assert saved["model"]["dtype"] == "bfloat16" and saved["model"]["param_dtype"] == "float32"
    assert saved["train"]["steps"] == 8 and saved["data"]["task"] == "mqar"
    model, params = load_checkpoint(full_run.run_dir)
    assert model == full_run.model and full_run.step == 8
    assert _same(params, full_run.params)
    assert {x.dtype for x in jax.tree.leaves(params)} == {np.dtype("float32")}  # fp32 master weights
    _, params6 = load_checkpoint(full_run.checkpoint_dir / "6")
    assert not _same(params6, params)
    events = list((full_run.run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert events and b"train/loss" in events[0].read_bytes()  # TensorBoard scalars next to metrics.jsonl


@pytest.mark.parametrize("stop", ["interrupt@3", "interrupt@5", "max_steps@4"])
def test_train_resume_matches_uninterrupted_run(full_run, tmp_path, capfd, stop):
    how, at = stop.split("@")
    at = int(at)

    def interrupt(step, row):
        if step == at:
            raise KeyboardInterrupt  # at step 3 while the async save of step 3 is in flight

    if how == "interrupt":
        with pytest.raises(KeyboardInterrupt):
            run_training(MODEL, TRAIN, DATA, tmp_path, progress=False, callback=interrupt)
        assert len(read_metrics(tmp_path / "metrics.jsonl")) == at
        assert load_checkpoint(tmp_path)[0] == full_run.model  # the last checkpoint is complete and restorable
    else:
        first = run_training(MODEL, TRAIN, DATA, tmp_path, progress=False, max_steps=at)
        assert first.step == at
    resumed = run_training(MODEL, TRAIN, DATA, tmp_path, progress=True)
    bar = capfd.readouterr().err
    assert re.search(r"8/8 \[\d\d:\d\d<\d\d:\d\d, +[\d.]+ ?(step/s|s/step)", bar), bar[-300:]
    full = [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in read_metrics(full_run.metrics_path)]
    again = [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in read_metrics(resumed.metrics_path)]
    assert again == full  # bitwise: same params, optimizer state and batches
    assert _same(resumed.params, full_run.params)


def test_train_resume_refuses_a_different_model(full_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(full_run.run_dir, run)
    with pytest.raises(ConfigError, match=r"holds a checkpoint of a different model \(model.d_ff: 64 -> 96\)"):
        run_training(dataclasses.replace(MODEL, d_ff=96), TRAIN, DATA, run, progress=False)
    with pytest.raises(ConfigError, match=r"already holds checkpoints \(latest step 8\) and train.resume=false"):
        run_training(MODEL, dataclasses.replace(TRAIN, resume=False), DATA, run, progress=False)


def test_train_corrupt_and_missing_checkpoints(full_run, tmp_path, capfd):
    with pytest.raises(CheckpointError, match=r"checkpoint path '.*nope' does not exist"):
        load_checkpoint(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"no checkpoint in '.*empty'"):
        load_checkpoint(tmp_path / "empty")
    run = tmp_path / "run"
    shutil.copytree(full_run.run_dir, run)
    for f in (run / "checkpoints" / "8" / "params").rglob("*"):
        if f.is_file():
            f.write_bytes(b"garbage")
    # verified: the damaged newest step is skipped (and said so), an explicit request for it refused
    assert _same(load_checkpoint(run)[1], load_checkpoint(run / "checkpoints" / "6")[1])
    assert "checkpoints/8 failed verification (file params/" in capfd.readouterr().err
    with pytest.raises(CheckpointError, match=r"checkpoints/8' failed verification .*choose another step"):
        load_checkpoint(run, step=8)
    # without a manifest (a checkpoint from before lcx kept them) the damage shows when reading
    (run / "checkpoints" / "8" / "lcx_checksums.json").unlink()
    with pytest.raises(CheckpointError, match=r"checkpoint '.*run/checkpoints/8' has unreadable parameter metadata"):
        load_checkpoint(run)
    with pytest.raises(CheckpointError, match=r"checkpoint step 5 is not in .*available: \[6, 8\]"):
        load_checkpoint(run, step=5)


def test_train_init_from_shape_mismatch_names_parameter_and_shapes(full_run, tmp_path):
    wide = dataclasses.replace(MODEL, d_ff=96)
    pattern = r"parameter 'layers/mlp/down' has shape \(2, 64, 32\) in the checkpoint but \(2, 96, 32\) in the model"
    with pytest.raises(CheckpointError, match=pattern):
        initial_params(wide, full_run.run_dir, 0)
    with pytest.raises(CheckpointError, match=pattern):
        run_training(wide, dataclasses.replace(TRAIN, init_from=str(full_run.run_dir)), DATA, tmp_path,
                     progress=False)
    with pytest.raises(CheckpointError, match=r"is neither an lcx run/checkpoint directory"):
        initial_params(MODEL, tmp_path, 0)


def test_train_long_context_finetune_from_lcx_checkpoint(full_run, tmp_path):
    base = source_config(full_run.run_dir)
    rope = RopeConfig(type="yarn", factor=4.0, original_max_position_embeddings=32)  # trained at 32 tokens
    model = finetune_config(base, rope=rope, max_position_embeddings=128)
    train = dataclasses.replace(TRAIN, seq_len=128, steps=2, init_from=str(full_run.run_dir), compute_dtype="float32")
    with pytest.raises(ConfigError, match=r"train.seq_len=128 is invalid: must be <= model.max_position_embeddings=64"):
        run_training(dataclasses.replace(model, max_position_embeddings=64), train, DATA, tmp_path / "x")
    assert _same(initial_params(model, train.init_from, 0), full_run.params)
    data = DataConfig(task="passkey", params={"instruction": False, "key_max": 99})
    result = run_training(model, train, data, tmp_path / "ft", progress=False)
    rows = read_metrics(result.metrics_path)
    assert [r["step"] for r in rows] == [1, 2] and all(np.isfinite(r["loss"]) for r in rows)
    saved, params = load_checkpoint(result.run_dir)
    assert saved.rope.type == "yarn" and saved.rope.factor == 4.0 and saved.max_position_embeddings == 128
    assert not _same(params, full_run.params)


def test_train_init_from_hf_directory(tmp_path):
    from lcx.hf import save_hf

    params = initial_params(MODEL, None, 3)
    save_hf(MODEL, params, tmp_path / "hf")
    assert source_config(tmp_path / "hf").d_ff == MODEL.d_ff
    assert _same(initial_params(MODEL, tmp_path / "hf", 0), params)
    with pytest.raises(CheckpointError, match=r"parameter 'embed' has shape \(260, 32\) in the checkpoint but "
                                              r"\(300, 32\)"):
        initial_params(dataclasses.replace(MODEL, vocab_size=300), tmp_path / "hf", 0)


def test_train_empty_corpus_folder_error(tmp_path):
    (tmp_path / "corpus").mkdir()
    data = DataConfig(task="corpus", params={"path": str(tmp_path / "corpus")})
    with pytest.raises(ConfigError, match=r"has no files matching data.params.glob='\*\*/\*'"):
        run_training(MODEL, TRAIN, data, tmp_path / "run", progress=False)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parity
def test_export_writes_a_directory_transformers_loads_with_the_same_logits(full_run, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from lcx.cli import main
    from lcx.model import Decoder

    out = tmp_path / "hf"
    assert main(["export", str(full_run.run_dir), "--hf", str(out)]) == 0
    model, params = load_checkpoint(full_run.run_dir)
    ids = np.random.default_rng(0).integers(0, 260, (2, 12))
    ours = np.asarray(Decoder(dataclasses.replace(model, dtype="float32")).apply({"params": params}, ids))
    with torch.no_grad():
        ref = transformers.AutoModelForCausalLM.from_pretrained(out).eval()(torch.as_tensor(ids)).logits.numpy()
    np.testing.assert_allclose(ours, ref, atol=2e-4)
    assert main(["export", str(full_run.run_dir), "--hf", str(out)]) == 2  # no silent overwrite


def test_generate_cli_runs_an_lcx_run_directory(full_run, capsys):
    import lcx
    from lcx.cli import main

    assert main(["generate", "--model", str(full_run.run_dir), "--ids", "5,6,7", "--max-new-tokens", "5"]) == 0
    printed = [int(x) for x in capsys.readouterr().out.split()]
    model, params = load_checkpoint(full_run.run_dir)
    assert printed == lcx.generate(model, params, [[5, 6, 7]], max_new_tokens=5).tokens[0].tolist()


def test_train_profile_steps_write_a_trace(tmp_path):
    train = dataclasses.replace(TRAIN, steps=3, save_every=3, profile_steps=(2, 3))
    run_training(MODEL, train, DATA, tmp_path, progress=False)
    assert list((tmp_path / "profile").rglob("*.xplane.pb"))
    with pytest.raises(ConfigError, match=r"train\.profile_steps=\(2, 9\)"):
        dataclasses.replace(TRAIN, profile_steps=(2, 9))


def test_train_checks_batch_against_the_data_axis_and_remat_policy(tmp_path):
    mesh = jax.sharding.AbstractMesh((2, 4), ("data", "model"))
    with pytest.raises(ConfigError, match=r"train\.batch_size=3 .* mesh\.data=2"):
        run_training(MODEL, dataclasses.replace(TRAIN, batch_size=3), DATA, tmp_path, progress=False, mesh=mesh)
    with pytest.raises(ConfigError, match=r"train\.remat_policy='most'"):
        dataclasses.replace(TRAIN, remat_policy="most")


def test_train_resumes_a_run_written_before_a_model_field_existed(full_run, tmp_path):
    """config.yaml of an older lcx lacks fields added since (here remat_policy, train.fsdp, data.tokenizer and the
    settings history): they take their defaults, and only a real change (steps) needs allow_changes."""
    run = tmp_path / "old"
    shutil.copytree(full_run.run_dir, run)
    saved = yaml.safe_load((run / "config.yaml").read_text())
    del saved["model"]["remat_policy"], saved["train"]["fsdp"], saved["data"]["tokenizer"]
    (run / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    (run / "settings.jsonl").unlink()
    with pytest.raises(ConfigError, match=r"trained to step 8 with other settings \(train.steps: 8 -> 9\)"):
        run_training(MODEL, dataclasses.replace(TRAIN, steps=9), DATA, run, progress=False)
    resumed = run_training(MODEL, dataclasses.replace(TRAIN, steps=9), DATA, run, progress=False, allow_changes=True)
    assert resumed.step == 9
