"""One writer per run directory: ``run_dir/lock.json`` names the trainer holding it (pid, host, start time).

The lock is the file plus an exclusive ``flock`` on it, held for the whole run. The kernel drops the ``flock`` when
its process dies (even by ``kill -9``), so a lock file whose ``flock`` can be taken is stale: its owner is gone, and
the new trainer takes it over and says whose lock it replaced. A live owner's lock is refused with its pid, host and
start time. On file systems without ``flock`` the owner's pid is checked instead (same host only).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

from lcx.config_base import ConfigError

try:
    import fcntl
except ImportError:  # not POSIX
    fcntl = None

LOCK = "lock.json"


class RunLockedError(ConfigError):
    """Another live process trains in this run directory."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


class RunLock:
    """``with RunLock(run_dir):`` - hold the run directory's lock for the block."""

    def __init__(self, run_dir: str | Path, say=None):
        self.path = Path(run_dir) / LOCK
        self.say = say or (lambda msg: print(f"lcx: {msg}", file=sys.stderr, flush=True))
        self._fd: int | None = None

    def _owner(self) -> dict:
        try:
            owner = json.loads(self.path.read_text() or "{}")
            return owner if isinstance(owner, dict) else {}
        except (OSError, ValueError):
            return {}

    def _refuse(self, owner: dict) -> RunLockedError:
        return RunLockedError(
            f"run directory {str(self.path.parent)!r} is in use by pid {owner.get('pid', '?')} on host "
            f"{owner.get('host', '?')} (since {owner.get('started', '?')}); wait for that run to finish, or train in "
            f"another run directory (if that process is gone, delete {self.path})")

    def __enter__(self) -> "RunLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        owner = self._owner()
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise self._refuse(owner) from None
            except OSError:  # no flock on this file system: fall back to the pid
                if owner and owner.get("host") == socket.gethostname() and _alive(int(owner.get("pid", -1))):
                    os.close(fd)
                    raise self._refuse(owner) from None
        elif owner and owner.get("host") == socket.gethostname() and _alive(int(owner.get("pid", -1))):
            os.close(fd)
            raise self._refuse(owner) from None
        if owner.get("pid") is not None:
            self.say(f"taking over the stale lock of pid {owner.get('pid')} on host {owner.get('host')} (started "
                     f"{owner.get('started')}): that process is gone")
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        os.fsync(fd)
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)  # unlink first: a waiting trainer then finds no stale owner
        finally:
            os.close(self._fd)  # releases the flock
            self._fd = None


__all__ = ["LOCK", "RunLock", "RunLockedError"]
