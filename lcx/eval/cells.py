"""Grid cells on disk: what makes an evaluation grid resumable, shardable and mergeable.

A grid (``lcx.eval.grid``) is a list of cells - one (setting, RoPE variant, task, length, depth, metric) each. A
finished cell is a directory ``cells/<cell>/`` holding ``cell.json`` (its rows, the inputs it was computed from -
settings, prompts' recipe, the checkpoint's step and content fingerprint - the host and the time) and
``outputs.jsonl`` (its prompts' generations), written under a temporary name and renamed into place, so a directory
is either complete or absent: ``kill -9`` loses only the cells running at that moment.

A cell is *done* when its ``cell.json`` records the inputs the grid would compute it from now: a rerun skips it,
a changed input (another checkpoint, more samples, another generation budget) recomputes exactly the cells whose
inputs it changed, and new policies, budgets or lengths add only their own cells.

Workers - several processes, or machines on a shared filesystem - split one grid with ``Shard(I, N)``: a
deterministic share of the cells each (``assign``: cells dealt largest first to the least loaded shard by an
estimated cost), then any cell nobody holds. A cell is run under a lock on ``cells/<cell>.lock``: an OS advisory
lock (``fcntl``, POSIX record locks, which NFS v4, Lustre and GPFS honour), which the kernel releases when its holder
dies - even under ``kill -9`` - so a dead worker's cell is taken over by the next worker that reaches it, and a live
worker's is left alone. The lock file names its holder (host, pid, start) for a human reading the directory; the
lock files go when the merge finds every cell done.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lcx.config_base import ConfigError


@dataclasses.dataclass(frozen=True)
class Shard:
    """Worker ``index`` of ``count`` (0-based: a SLURM array ``--array=0-3`` or a Kubernetes indexed job's
    ``JOB_COMPLETION_INDEX`` with ``count`` 4)."""

    index: int = 0
    count: int = 1

    def __post_init__(self):
        if not (isinstance(self.count, int) and isinstance(self.index, int) and self.count >= 1
                and 0 <= self.index < self.count):
            raise ConfigError(f"--shard {self.index}/{self.count} is invalid: I/N with N >= 1 and 0 <= I < N "
                              "(0-based: the first of 4 workers is 0/4)")

    @classmethod
    def parse(cls, text: str) -> "Shard":
        """``"I/N"`` -> ``Shard(I, N)``; anything else is one clear error naming the allowed form."""
        match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", str(text))
        if match is None:
            raise ConfigError(f"--shard {text!r} is invalid: I/N with integers, 0 <= I < N (e.g. 0/2 and 1/2 split "
                              "a grid over two workers)")
        return cls(int(match.group(1)), int(match.group(2)))

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


ONE = Shard()


@dataclasses.dataclass(frozen=True)
class Cell:
    """One cell of a grid: ``name`` (its directory: readable, unique), ``inputs`` (a JSON-able mapping of everything
    its results depend on) and ``cost`` (a relative estimate of its run time, for sharing cells out)."""

    name: str
    inputs: dict
    cost: float = 1.0

    def __post_init__(self):  # as JSON gives them back, so a stored record compares equal
        object.__setattr__(self, "inputs", normalized(self.inputs))


def cell_name(*parts: Any) -> str:
    """A directory name for a cell identified by ``parts``: the parts, made filesystem-safe and shortened, plus a
    digest of the parts themselves so two cells never share a directory."""
    text = "-".join(str(p) for p in parts if p not in (None, ""))
    slug = re.sub(r"[^A-Za-z0-9._=@-]+", "_", text).strip("_.")[:96]
    digest = hashlib.sha1(json.dumps([str(p) for p in parts]).encode()).hexdigest()[:8]
    return f"{slug}-{digest}"


def normalized(inputs: Any) -> Any:
    """``inputs`` as JSON would give them back (tuples -> lists, paths -> str), so a stored record compares equal."""
    return json.loads(json.dumps(inputs, default=str, sort_keys=True))


def assign(cells: Sequence[Cell], shard: Shard, groups: Sequence[str] | None = None) -> list[int]:
    """The indices (in grid order) of the cells ``shard`` owns: cells dealt largest estimated cost first to the
    least loaded shard (ties: the lower index) - the same share in every worker, whatever it has done. ``groups``:
    one key per cell (empty: none); the cells of one key are computed together (their prompts' prefill shared) and
    dealt as one unit of their summed cost."""
    if shard.count == 1:
        return list(range(len(cells)))
    units: dict[object, list[int]] = {}
    for i in range(len(cells)):
        units.setdefault(groups[i] if groups and groups[i] else i, []).append(i)
    loads = [0.0] * shard.count
    owner = [0] * len(cells)
    for unit in sorted(units.values(), key=lambda u: (-sum(cells[i].cost for i in u), u[0])):
        k = min(range(shard.count), key=lambda s: (loads[s], s))
        for i in unit:
            owner[i] = k
        loads[k] += sum(cells[i].cost for i in unit)
    return [i for i in range(len(cells)) if owner[i] == shard.index]


class CellStore:
    """The ``cells/`` directory of one grid."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def path(self, cell: Cell) -> Path:
        return self.root / cell.name

    def load(self, cell: Cell) -> dict | None:
        """The record of ``cell`` when it is done with its current inputs (``rows``, ``outputs``, ``inputs``, ...),
        else None. A record that cannot be read is not done (it is recomputed)."""
        record = self._read(cell)
        if record is None or record.get("inputs") != cell.inputs:
            return None
        outputs = self.path(cell) / "outputs.jsonl"
        try:
            record["outputs"] = [json.loads(line) for line in outputs.read_text().splitlines() if line.strip()]
        except (OSError, ValueError):
            return None
        return record

    def _read(self, cell: Cell) -> dict | None:
        try:
            record = json.loads((self.path(cell) / "cell.json").read_text())
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) else None

    def is_done(self, cell: Cell) -> bool:
        record = self._read(cell)
        return record is not None and record.get("inputs") == cell.inputs

    def stale(self, cell: Cell) -> bool:
        """Whether ``cell`` has a record computed from other inputs (it will be recomputed)."""
        record = self._read(cell)
        return record is not None and record.get("inputs") != cell.inputs

    def save(self, cell: Cell, rows: list[dict], outputs: list[dict], seconds: float) -> None:
        """Persist a finished cell atomically: written under a temporary name, then renamed into place (a record
        of older inputs is replaced)."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".tmp.{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        record = {"cell": cell.name, "inputs": cell.inputs, "rows": normalized(rows),
                  "seconds": round(seconds, 3), "host": socket.gethostname(), "pid": os.getpid(),
                  "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        _write(tmp / "outputs.jsonl", "".join(json.dumps(o) + "\n" for o in outputs))
        _write(tmp / "cell.json", json.dumps(record, indent=1))
        target = self.path(cell)
        if target.exists():  # computed from other inputs: moved aside, then deleted
            old = self.root / f".old.{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
            os.rename(target, old)
            shutil.rmtree(old, ignore_errors=True)
        os.rename(tmp, target)

    def clean(self) -> None:
        """Remove the temporary directories of killed workers (a cell being written when its worker died)."""
        if not self.root.is_dir():
            return
        for entry in self.root.iterdir():
            if entry.name.startswith((".tmp.", ".old.")) and _abandoned(entry):
                shutil.rmtree(entry, ignore_errors=True)

    def drop_locks(self) -> None:
        """Remove the cells' lock files (once every cell is done)."""
        for path in self.root.glob("*.lock"):
            if not path.name.startswith("."):
                path.unlink(missing_ok=True)

    @contextmanager
    def lock(self, cell: Cell) -> Iterator[bool]:
        """Try to take ``cell``'s lock without waiting: yields True when this process holds it (until the block
        ends), False when a live worker does."""
        with try_lock(self.root / f"{cell.name}.lock") as held:
            yield held

    def holder(self, cell: Cell) -> str:
        """Who holds (or last held) ``cell``'s lock, as its lock file says."""
        try:
            return (self.root / f"{cell.name}.lock").read_text().strip() or "unknown"
        except OSError:
            return "unknown"

    def merging(self):
        """Held while one worker writes the merged results (the others wait for it)."""
        return stage_lock(self.root / ".merge.lock")


def _abandoned(path: Path, seconds: float = 3600.0) -> bool:
    """Whether a temporary directory's writer is gone: a dead process of this host, or (another host's) an hour
    old - writing a cell takes milliseconds."""
    parts = path.name[5:].rsplit(".", 2)
    host, pid = (parts[0], parts[1]) if len(parts) == 3 else ("", "")
    if host == socket.gethostname() and pid.isdigit():
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
    try:
        return time.time() - path.stat().st_mtime > seconds
    except OSError:
        return False


@contextmanager
def try_lock(path: Path) -> Iterator[bool]:
    """A non-blocking exclusive POSIX lock on ``path`` (created if needed): yields whether this process got it. The
    lock file records the holder; the kernel drops the lock when the holder exits or dies."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno not in (errno.EACCES, errno.EAGAIN):
                raise
            yield False
            return
        os.ftruncate(fd, 0)
        os.write(fd, f"host {socket.gethostname()} pid {os.getpid()} since {time.strftime('%H:%M:%S')}\n".encode())
        yield True
    finally:
        os.close(fd)


@contextmanager
def stage_lock(path: Path) -> Iterator[None]:
    """An exclusive POSIX lock on ``path``, waiting for it: one worker of a sharded run trains while the others
    wait, then find the stage done."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def write_atomic(path: Path, text: str) -> None:
    """Write ``path`` through a temporary file and a rename: readers see the old or the new file, never half."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    _write(tmp, text)
    os.replace(tmp, path)


def order(owned: Sequence[int], total: int) -> list[int]:
    """The order a worker visits cells in: its own share in grid order (cells of one setting share compiled
    programs), then everyone else's from the end (so a helper meets an owner's queue from the other side)."""
    mine = set(owned)
    return list(owned) + [i for i in reversed(range(total)) if i not in mine]


def count_done(store: CellStore, cells: Iterable[Cell]) -> int:
    return sum(store.is_done(c) for c in cells)


__all__ = ["Cell", "CellStore", "ONE", "Shard", "assign", "cell_name", "count_done", "normalized", "order",
           "stage_lock", "try_lock", "write_atomic"]
