"""Checkpoint integrity: a SHA-256 manifest per saved step, verified before anything is restored.

Orbax writes a step to a temporary directory and renames it to ``<step>`` when complete, so a digit-named directory
is a finished write; it does not detect bytes that change afterwards (a bad disk, a partial copy, a flipped region).
lcx adds ``<step>/lcx_checksums.json`` - the size and SHA-256 of every file of the step - once the step is final
(orbax's post-finalization callback for async saves, right after a synchronous one).

``verify`` compares a step with its manifest; ``newest_good_step`` walks the steps newest first, moves each one that
fails verification aside to ``<step>.corrupt`` (never deleted: the user decides) and says so, and returns the newest
good step. A step without a manifest (written before lcx kept them, or interrupted between the rename and the
manifest) is restorable but reported as unverified. ``fingerprint`` names a checkpoint's content in one string, so a
stage can tell whether the checkpoint it evaluated has changed.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

MANIFEST = "lcx_checksums.json"
_CHUNK = 1 << 22


def _files(step_dir: Path) -> list[Path]:
    return sorted(p for p in step_dir.rglob("*") if p.is_file() and p.name != MANIFEST)


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(step_dir: str | Path) -> bool:
    """Hash every file of a finished step into its manifest (atomic); False when the step vanished meanwhile
    (retention may delete an old step while its manifest is being written)."""
    step_dir = Path(step_dir)
    try:
        files = {p.relative_to(step_dir).as_posix(): [p.stat().st_size, _digest(p)] for p in _files(step_dir)}
        tmp = step_dir / f".{MANIFEST}.tmp"
        tmp.write_text(json.dumps({"algorithm": "sha256", "files": files}, sort_keys=True))
        os.replace(tmp, step_dir / MANIFEST)
        return True
    except FileNotFoundError:
        return False


def step_dirs(root: str | Path) -> list[Path]:
    """The finished step directories of a checkpoint root, newest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: -int(p.name))


def write_missing_manifests(root: str | Path) -> None:
    """Give every finished step under ``root`` that has none a manifest."""
    for step_dir in step_dirs(root):
        if not (step_dir / MANIFEST).is_file():
            write_manifest(step_dir)


def verify(step_dir: str | Path) -> str | None:
    """None when the step matches its manifest, ``"unverified"`` when it has none, else what differs."""
    step_dir = Path(step_dir)
    try:
        manifest = json.loads((step_dir / MANIFEST).read_text())
    except FileNotFoundError:
        return "unverified"
    except (OSError, ValueError) as err:
        return f"its checksum manifest is unreadable ({err})"
    expected = manifest.get("files", {}) if isinstance(manifest, dict) else {}
    present = {p.relative_to(step_dir).as_posix() for p in _files(step_dir)}
    for rel, (size, digest) in sorted(expected.items()):
        path = step_dir / rel
        if rel not in present:
            return f"file {rel} is missing"
        if path.stat().st_size != size:
            return f"file {rel} has {path.stat().st_size} bytes, {size} when saved"
        if _digest(path) != digest:
            return f"file {rel} does not match its SHA-256 checksum"
    extra = sorted(present - set(expected))
    if extra:
        return f"file {extra[0]} was not part of the saved checkpoint"
    return None


def quarantine(step_dir: Path) -> Path:
    """Move a bad step aside (``<step>.corrupt``, numbered if taken) so that neither restore nor retention sees it."""
    target = step_dir.with_name(f"{step_dir.name}.corrupt")
    n = 1
    while target.exists():
        n += 1
        target = step_dir.with_name(f"{step_dir.name}.corrupt{n}")
    step_dir.rename(target)
    return target


def newest_good_step(root: str | Path, *, move_bad: bool, say=None) -> int | None:
    """The newest step under ``root`` that passes verification (None if none does). Bad steps are reported through
    ``say`` and, with ``move_bad``, moved aside; an unverified step is used and reported."""
    say = say or (lambda msg: print(f"lcx: {msg}", file=sys.stderr, flush=True))
    for step_dir in step_dirs(root):
        problem = verify(step_dir)
        if problem is None:
            return int(step_dir.name)
        if problem == "unverified":
            say(f"checkpoint {step_dir} has no checksum manifest (written before lcx kept them, or interrupted "
                "right after saving): using it unverified")
            return int(step_dir.name)
        where = f"; moved to {quarantine(step_dir)}" if move_bad else ""
        say(f"checkpoint {step_dir} failed verification ({problem}){where}: falling back to the previous one")
    return None


def fingerprint(step_dir: str | Path) -> str:
    """A short content hash of a step: of its manifest when it has one, else of its files (hashed now)."""
    step_dir = Path(step_dir)
    manifest = step_dir / MANIFEST
    if manifest.is_file():
        return hashlib.sha256(manifest.read_bytes()).hexdigest()[:16]
    h = hashlib.sha256()
    for p in _files(step_dir):
        h.update(p.relative_to(step_dir).as_posix().encode())
        h.update(_digest(p).encode())
    return h.hexdigest()[:16]


__all__ = ["MANIFEST", "fingerprint", "newest_good_step", "quarantine", "step_dirs", "verify", "write_manifest",
           "write_missing_manifests"]
