"""Training metrics: one JSON object per logged step in ``metrics.jsonl``, the same scalars as TensorBoard event
files in ``tensorboard/`` next to it (``tensorboard --logdir runs``), and a tqdm bar with rate and ETA.

Device metrics are fetched only at log steps (fetching every step would stall the asynchronous dispatch); a logged
row averages the steps since the previous log. On resume the file is cut back to the restored step, so an interrupted
and resumed run ends with the same rows as an uninterrupted one (TensorBoard purges the events past it likewise).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from tensorboardX import SummaryWriter
from tqdm.auto import tqdm


def jsonl_rows(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """``(line, object)`` of every intact JSON-object line of a JSONL file (a line cut short by a crash is skipped);
    empty when the file does not exist."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            out.append((line, row))
    return out


def truncate_metrics(path: Path, step: int) -> None:
    """Drop rows with ``step`` greater than ``step`` (written after the checkpoint a run resumes from)."""
    if not path.exists():
        return
    kept = [line for line, row in jsonl_rows(path) if row.get("step", 0) <= step]
    path.write_text("".join(line + "\n" for line in kept))


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


class MetricsLogger:
    """Collects per-step device metrics; every ``log_every`` steps writes a row: each metric's mean over the window
    (``lr``: the last step's), ``tokens_per_s`` (input tokens of the window / its wall time) and ``time``."""

    def __init__(self, path: Path, *, log_every: int, tokens_per_step: int, total_steps: int, start_step: int,
                 progress: bool):
        self.path, self.log_every, self.tokens_per_step = path, log_every, tokens_per_step
        self.pending: list[dict] = []
        self.window_start = time.perf_counter()  # created after compiling: tokens/s measures training only
        self.bar = tqdm(total=total_steps, initial=start_step, disable=not progress, unit="step",
                        dynamic_ncols=True, desc="train")
        self.file = path.open("a")
        # purge_step: events a crashed run wrote after the checkpoint it resumes from are dropped, as in the JSONL.
        self.board = SummaryWriter(str(path.parent / "tensorboard"), purge_step=start_step + 1, flush_secs=30)

    def add(self, step: int, metrics: dict, force: bool = False) -> dict[str, Any] | None:
        """Record the metrics of the step that made ``step`` steps done; returns the logged row, if any."""
        self.pending.append(metrics)
        self.bar.update(1)
        if step % self.log_every and not force:
            return None
        host = jax.device_get(self.pending)
        elapsed = time.perf_counter() - self.window_start
        row: dict[str, Any] = {"step": step}
        for key in host[0]:
            values = np.asarray([m[key] for m in host], np.float64)
            row[key] = float(values[-1] if key == "lr" else values.mean())
        row["tokens_per_s"] = len(host) * self.tokens_per_step / max(elapsed, 1e-9)
        row["time"] = time.time()
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        for key, value in row.items():
            if key not in ("step", "time"):
                self.board.add_scalar(f"train/{key}", value, step)
        self.bar.set_postfix(loss=f"{row['loss']:.4f}", acc=f"{row['accuracy']:.3f}", lr=f"{row['lr']:.2e}")
        self.pending, self.window_start = [], time.perf_counter()
        return row

    def close(self) -> None:
        self.bar.close()
        self.file.close()
        self.board.close()


__all__ = ["MetricsLogger", "read_metrics", "truncate_metrics"]
