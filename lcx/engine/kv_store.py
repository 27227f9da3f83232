"""Pages of prompts kept off the device, so that a restarted server (even after ``kill -9``) serves a conversation's
history from them instead of prefilling it again.

    store = PageStore(namespace, page=16, host_bytes=1 << 30, directory="runs/kv", disk_bytes=8 << 30)
    n = store.match(tokens)                 # leading whole pages of ``tokens`` the store holds
    loaded, arrays = store.get(tokens[:n * 16])   # {"k": [L, loaded, k, g, d], "v": ...}
    store.put(tokens, missing_pages, arrays)

Keys are deterministic: page ``i`` of a token sequence is keyed by a chain hash over the ``namespace`` (the model's
content fingerprint and the cache settings: a different model or page size or KV dtype never reads these pages) and
the tokens of pages ``0 .. i`` - the same key in every process, unlike a hash seeded per process. A page depends on
every token before it (attention), which the chain captures; two prompts with the same first pages share them.

Tiers: host memory (least recently used dropped first past ``host_bytes``) and, with a ``directory``, one file per
page (written atomically: a temporary file renamed into place, so a killed process leaves whole files or none;
each file carries a checksum of its contents; least recently used files deleted past ``disk_bytes``). A file that
is truncated, corrupt or of another layout is detected on reading, deleted and reported as missing - the page is
prefilled again, never served.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import struct
import tempfile
from pathlib import Path

import numpy as np

from lcx.config_base import ConfigError

MAGIC = b"LCXKVP1\n"
SUFFIX = ".kvp"


def chain(namespace: str, tokens: np.ndarray, page: int) -> list[str]:
    """The key of each whole page of ``tokens`` (hex): page ``i``'s hashes the namespace and pages ``0 .. i``."""
    tokens = np.asarray(tokens, "<i4")
    digest = hashlib.blake2b(namespace.encode(), digest_size=16).digest()
    keys = []
    for i in range(tokens.size // page):
        digest = hashlib.blake2b(digest + tokens[i * page:(i + 1) * page].tobytes(), digest_size=16).digest()
        keys.append(digest.hex())
    return keys


class PageStore:
    """Host (and disk) tiers of KV pages keyed by ``chain``; see the module docstring. ``page``: tokens per page.
    Counters: ``hits`` / ``misses`` (pages), ``corrupt`` (files found bad and deleted)."""

    def __init__(self, namespace: str, *, page: int, host_bytes: int = 1 << 30, directory: str | Path | None = None,
                 disk_bytes: int = 16 << 30):
        for name, value in (("page", page), ("host_bytes", host_bytes), ("disk_bytes", disk_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0 or (name == "page" and not value):
                raise ConfigError(f"PageStore {name}={value!r} is invalid: must be a non-negative integer")
        self.namespace, self.page = namespace, page
        self.host_bytes, self.disk_bytes = host_bytes, disk_bytes
        self._host: collections.OrderedDict[str, dict[str, np.ndarray]] = collections.OrderedDict()
        self._host_used = 0
        self.directory = None if directory is None else Path(directory)
        if self.directory is not None:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
            except OSError as err:
                raise ConfigError(f"kv store directory {str(directory)!r} cannot be created: {err}") from err
            for stale in self.directory.glob(f".tmp-*{SUFFIX}"):  # a write a killed process left unfinished
                stale.unlink(missing_ok=True)
        self.hits = self.misses = self.corrupt = 0
        self._disk_used = self.disk_used()

    # ------------------------------------------------------------------------------------------- lookups
    def keys(self, tokens: np.ndarray) -> list[str]:
        return chain(self.namespace, tokens, self.page)

    def _path(self, key: str) -> Path:
        return self.directory / f"{key}{SUFFIX}"

    def _has(self, key: str) -> bool:
        return key in self._host or (self.directory is not None and self._path(key).is_file())

    def match(self, tokens: np.ndarray) -> int:
        """How many leading whole pages of ``tokens`` the store holds (files are checked when read)."""
        n = 0
        for key in self.keys(tokens):
            if not self._has(key):
                break
            n += 1
        return n

    def missing(self, tokens: np.ndarray) -> list[int]:
        """The indices of the whole pages of ``tokens`` the store lacks."""
        return [i for i, key in enumerate(self.keys(tokens)) if not self._has(key)]

    def get(self, tokens: np.ndarray) -> tuple[int, dict[str, np.ndarray] | None]:
        """``(n, arrays)``: the leading pages of ``tokens`` the store can give (a bad file ends the run: it is
        deleted and the rest is prefilled), each array ``[L, n, ...]``; ``(0, None)`` if none."""
        pages = []
        for key in self.keys(tokens):
            arrays = self._host.get(key)
            if arrays is not None:
                self._host.move_to_end(key)
            elif self.directory is not None:
                arrays = self._read(key)
                if arrays is not None:
                    self._keep(key, arrays)
            if arrays is None:
                break
            pages.append(arrays)
        self.hits += len(pages)
        self.misses += len(self.keys(tokens)) - len(pages)
        if not pages:
            return 0, None
        return len(pages), {n: np.stack([p[n] for p in pages], axis=1) for n in pages[0]}

    # ------------------------------------------------------------------------------------------- writes
    def put(self, tokens: np.ndarray, indices: list[int], arrays: dict[str, np.ndarray]) -> None:
        """Keep pages ``indices`` of ``tokens``; ``arrays[name] [L, len(indices), ...]`` holds their contents."""
        keys = self.keys(tokens)
        for j, i in enumerate(indices):
            one = {n: np.ascontiguousarray(x[:, j]) for n, x in arrays.items()}
            self._keep(keys[i], one)
            if self.directory is not None:
                self._write(keys[i], one)
        if self.directory is not None:
            self._bound_disk()

    def _keep(self, key: str, arrays: dict[str, np.ndarray]) -> None:
        if key in self._host:
            self._host.move_to_end(key)
            return
        self._host[key] = arrays
        self._host_used += sum(x.nbytes for x in arrays.values())
        while self._host_used > self.host_bytes and self._host:
            _, old = self._host.popitem(last=False)
            self._host_used -= sum(x.nbytes for x in old.values())

    def _write(self, key: str, arrays: dict[str, np.ndarray]) -> None:
        path = self._path(key)
        if path.is_file():
            return
        payload = b"".join(x.tobytes() for x in arrays.values())
        header = json.dumps({"arrays": [[n, str(x.dtype), list(x.shape)] for n, x in arrays.items()],
                             "digest": hashlib.blake2b(payload, digest_size=16).hexdigest(),
                             "nbytes": len(payload)}).encode()
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-", suffix=SUFFIX)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(MAGIC + struct.pack("<Q", len(header)) + header + payload)
            os.replace(tmp, path)  # atomic: readers (and a restart after kill -9) see a whole file or none
            self._disk_used += len(MAGIC) + 8 + len(header) + len(payload)
        except OSError:
            Path(tmp).unlink(missing_ok=True)  # a full disk: the page stays in host memory only

    def _read(self, key: str) -> dict[str, np.ndarray] | None:
        """The page's arrays, or None (missing; or bad: deleted and counted in ``corrupt``)."""
        import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, for dtype names read back)

        path = self._path(key)
        try:
            data = path.read_bytes()
        except OSError:
            return None
        try:
            if not data.startswith(MAGIC):
                raise ValueError("bad magic")
            (size,) = struct.unpack_from("<Q", data, len(MAGIC))
            start = len(MAGIC) + 8
            header = json.loads(data[start:start + size])
            payload = data[start + size:]
            if len(payload) != header["nbytes"]:
                raise ValueError("truncated")
            if hashlib.blake2b(payload, digest_size=16).hexdigest() != header["digest"]:
                raise ValueError("checksum")
            out, at = {}, 0
            for name, dtype, shape in header["arrays"]:
                dt = np.dtype(dtype)
                n = int(np.prod(shape)) * dt.itemsize
                out[name] = np.frombuffer(payload[at:at + n], dt).reshape(shape)
                at += n
            if at != len(payload):
                raise ValueError("layout")
        except (ValueError, KeyError, TypeError, struct.error, json.JSONDecodeError):
            self.corrupt += 1
            path.unlink(missing_ok=True)
            return None
        os.utime(path)  # recently used: the last to go when the directory is over its bound
        return out

    def _bound_disk(self) -> None:
        if self._disk_used <= self.disk_bytes:
            return
        files = [(p.stat().st_mtime, p.stat().st_size, p) for p in self.directory.glob(f"*{SUFFIX}")
                 if not p.name.startswith(".tmp-")]
        used = sum(size for _, size, _ in files)
        for _, size, path in sorted(files):
            if used <= self.disk_bytes:
                break
            path.unlink(missing_ok=True)
            used -= size
        self._disk_used = used

    def disk_used(self) -> int:
        if self.directory is None:
            return 0
        return sum(p.stat().st_size for p in self.directory.glob(f"*{SUFFIX}") if not p.name.startswith(".tmp-"))


__all__ = ["PageStore", "chain"]
