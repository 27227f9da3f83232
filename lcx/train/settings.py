"""Settings history of a run: what it was trained with, segment by segment.

``run_dir/settings.jsonl`` holds one line per segment of steps: ``{"from_step", "train", "data"}``. A fresh run
writes the first segment. Resuming with different ``train`` / ``data`` settings is refused with the list of changed
keys - the loss curve would no longer be the one the first settings give - unless the caller allows changes
(``lcx train ... --allow-changes``): then a new segment records the new settings from the resumed step, and the
schedule (a function of the step and the settings) continues from there. Settings that only say how a run is
logged or saved (``OPERATIONAL``) may change freely.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lcx.config_base import ConfigError
from lcx.train.metrics import jsonl_rows

HISTORY = "settings.jsonl"
OPERATIONAL = frozenset({"log_every", "save_every", "keep", "async_save", "profile_steps", "resume"})


def segments(run_dir: str | Path) -> list[dict[str, Any]]:
    """The recorded segments, oldest first (empty for runs written before the history existed)."""
    return [row for _, row in jsonl_rows(Path(run_dir) / HISTORY) if "from_step" in row]


def changed_keys(before: dict[str, dict], after: dict[str, dict]) -> list[str]:
    """``section.key: old -> new`` for every setting that differs (operational train keys excepted)."""
    out = []
    for section in ("train", "data"):
        old, new = before.get(section) or {}, after.get(section) or {}
        for key in sorted(set(old) | set(new)):
            if section == "train" and key in OPERATIONAL:
                continue
            if old.get(key) != new.get(key):
                out.append(f"{section}.{key}: {old.get(key)!r} -> {new.get(key)!r}")
    return out


def record(run_dir: str | Path, step: int, current: dict[str, dict], *, allow_changes: bool,
           previous: dict[str, dict] | None = None) -> list[str]:
    """Check ``current`` settings against the run's latest segment when resuming at ``step`` (``previous``: the
    settings of runs without a history, from their config.yaml); append a segment when they changed and
    ``allow_changes``, else raise ``ConfigError`` naming the changed keys. Returns the changes."""
    run_dir = Path(run_dir)
    history = segments(run_dir)
    before = history[-1] if history else previous
    if before is None:  # a fresh run: its first segment
        _append(run_dir, {"from_step": step, **current})
        return []
    changes = changed_keys(before, current)
    if changes and not allow_changes:
        raise ConfigError(f"run directory {str(run_dir)!r} was trained to step {step} with other settings ("
                          + "; ".join(changes) + "); resume with the same settings, pass --allow-changes "
                          "(run_training(..., allow_changes=True)) to continue with the new ones from step "
                          f"{step} (recorded in {HISTORY}), or start a new run directory")
    if changes or not history:
        _append(run_dir, {"from_step": step, **current, **({"changed": changes} if changes else {})})
    return changes


def _append(run_dir: Path, row: dict[str, Any]) -> None:
    with open(run_dir / HISTORY, "a") as f:
        f.write(json.dumps(row, sort_keys=True, default=str) + "\n")


__all__ = ["HISTORY", "OPERATIONAL", "changed_keys", "record", "segments"]
