"""The small trained model the notebooks share: the quickstart's recipe (a text corpus mixed with passkey retrieval,
see experiments/configs/quickstart.yaml) at a size that trains in about a minute on 2 CPU cores.

``trained_model()`` returns, in this order: the lcx run named by ``LCX_NOTEBOOK_RUN``; the quickstart's model if
the README's main command has produced it (``runs/quickstart/train`` at the repository root: 3 layers, trained 1200
steps, it retrieves passkeys); else this tiny model, trained once into ``notebooks/runs/tiny-<steps>`` and loaded
from there afterwards. The tiny one models text but has not learned retrieval in 300 steps: the notebooks then show
the mechanics, the quickstart's model shows the phenomena. ``LCX_NOTEBOOK_STEPS`` trains it longer.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import lcx
from lcx.train import DataConfig, TrainConfig, load_checkpoint, run_training

# CI executes every notebook with LCX_NOTEBOOK_SMOKE=1: each cell runs, at the smallest sizes that exercise it.
SMOKE = os.environ.get("LCX_NOTEBOOK_SMOKE") == "1"
RUNS = Path(__file__).resolve().parent / "runs"
QUICKSTART = Path(__file__).resolve().parents[1] / "runs" / "quickstart" / "train"
MODEL = lcx.ModelConfig(vocab_size=260, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128,
                        max_position_embeddings=128)
DATA = DataConfig(task="mixture", prompt_loss_weight=0.1, params={"parts": [
    {"task": "corpus", "weight": 0.4, "loss_weight": 0.15, "params": {"bos": True}},
    {"task": "passkey", "weight": 0.6,
     "params": {"instruction": False, "template": "compact", "filler_min": 0, "offset": True}},
]})


def trained_model(steps: int | None = None) -> tuple[lcx.ModelConfig, dict]:
    """``(config, params)`` of ``LCX_NOTEBOOK_RUN``, else the quickstart's model, else the tiny model after ``steps``
    training steps (default 300, or LCX_NOTEBOOK_STEPS)."""
    chosen = os.environ.get("LCX_NOTEBOOK_RUN") or (str(QUICKSTART) if (QUICKSTART / "checkpoints").is_dir() else "")
    if chosen:
        print(f"model: the lcx run {chosen}")
        return load_checkpoint(chosen)
    steps = steps or int(os.environ.get("LCX_NOTEBOOK_STEPS", "30" if SMOKE else "300"))
    train = TrainConfig(steps=steps, batch_size=16, seq_len=128, lr=3e-3, warmup_steps=min(30, steps),
                        compute_dtype="float32", save_every=steps, log_every=max(1, steps // 6))
    run_dir = RUNS / f"tiny-{steps}"
    run_dir.mkdir(parents=True, exist_ok=True)
    # Two notebooks started together (or the test workers) must not train into one directory at once: the first
    # trains, the others wait for it and load.
    with open(RUNS / f"tiny-{steps}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        run_training(MODEL, train, DATA, run_dir, progress=True)
    return load_checkpoint(run_dir)
