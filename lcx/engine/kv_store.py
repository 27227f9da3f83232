"""Pages of prompts kept off the device, so that a restarted server (even after ``kill -9``) serves a conversation's
history from them instead of prefilling it again.

    store = PageStore(namespace, page=16, host_bytes=1 << 30, directory="runs/kv", disk_bytes=8 << 30)
    n = store.match(tokens)                 # leading whole pages of ``tokens`` the store holds
    loaded, arrays = store.get(tokens[:n * 16], layout)   # {"k": [L, loaded, k, g, d], "v": ...}
    store.put(tokens, missing_pages, arrays)

Keys are deterministic: page ``i`` of a token sequence is keyed by a chain hash over the ``namespace`` (the model's
content fingerprint and the cache settings: a different model or page size or KV dtype never reads these pages) and
the tokens of pages ``0 .. i`` - the same key in every process, unlike a hash seeded per process. A page depends on
every token before it (attention), which the chain captures; two prompts with the same first pages share them.
A request's ``salt`` (``cache_salt``: a tenant's) enters the namespace the chain starts from (``salted``), so two
salts - or a salt and none - share no page; no salt keys pages exactly as before (stores written earlier stay valid).
Every method that keys by tokens takes it.

Under an evicting policy a row's compressed state is one entry (``put_state`` / ``get_state``;
``lcx.engine.store_io``), keyed by the namespace and every token the row has seen, its length in the key's last 8
hex digits; ``get_state`` finds the longest state a prompt continues. It shares the tiers, files and checks below.

Tiers: host memory (least recently used dropped first past ``host_bytes``) and, with a ``directory``, one file per
page, ``<key>.kvp``: ``MAGIC``, the header's size, a JSON header (each array's name, dtype and shape; the payload's
size), the payload, and a 16-byte BLAKE2b digest of everything before it keyed by the page's key. The digest binds
the content to its name: a file copied under another page's name, or with its header edited, is as bad as a flipped
bit (a plain checksum of the payload served both). It is no defence against someone who can write the directory:
the key follows from the tokens. Files are written atomically (a temporary file renamed into place, so a killed
process leaves whole files or none). A file that is truncated, corrupt, under another page's name, or of another
layout than the caller expects (``get``'s ``layout``: each array's dtype and shape) is detected on reading, deleted,
counted in ``corrupt`` and reported as missing - the page is prefilled again, never served. Files of an earlier
format (another ``MAGIC``) are deleted when a store opens the directory: they are missing, not corrupt.

The directory is bounded by ``disk_bytes``: least recently used files are deleted first, and a chain is used as a
whole - every ``get`` and ``put`` stamps the pages of its tokens with one time, page ``i`` ``i`` microseconds older
than page 0 - so the bound cuts a chain from its end. What stays is a prefix a later prompt can match (deleting the
oldest file first deleted a conversation's first pages, and its other pages could never be matched again). The
stamps need a filesystem with sub-millisecond modification times (ext4, xfs, btrfs, tmpfs); on a coarser one the
pages of a chain tie and are deleted in any order.

A failing disk (an unwritable, deleted or full directory) degrades the store, never its caller: the write is skipped,
the page stays in host memory (or is prefilled again later), and ``disk_errors`` counts the failures;
``disk_error`` holds the last one's message until a later write succeeds (then None): what a health check reports.

Several processes may share one directory (replicas behind a load balancer, on a volume they all mount): lookups
read the directory, not an index of this process's own, so a page another process wrote is found (``match`` checks
the file; row states are listed again when the directory changed); each write goes to a temporary file of a unique
name, renamed into place, so two writers of one page leave one whole file; a file another process deletes between a
lookup and the read is missing, not an error; and a store opening the directory deletes only temporary files older
than ``STALE_TMP_S`` (a younger one may be another process's write under way). Each process applies ``disk_bytes`` to
the whole directory when its own writes since its last count cross it, so the directory may exceed the bound by what
the others wrote since: give it headroom.
"""

from __future__ import annotations

import collections
import hashlib
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from lcx.config_base import ConfigError
from lcx.engine.page_file import (DIGEST, FAMILY, MAGIC, SUFFIX, decode_page, encode_page,  # noqa: F401 (public)
                                  layout_of, page_digest)

STAMP_STEP_NS = 1_000  # how much older page i + 1 of a chain is stamped than page i
STATE_KEY = 40  # hex digits of a row state's key (a page's has 32): the digest, then the token count
STALE_TMP_S = 600  # a temporary file older than this is a killed writer's; a younger one may be a live replica's
SALT_MARK = "\x00salt:"  # between a namespace and a salt: no namespace holds a NUL (JSON escapes it)


def salted(namespace: str, salt: str | None) -> str:
    """The namespace a request's chain starts from: ``namespace`` itself without a salt (the keys every store already
    holds), else one that no other salt, and no unsalted request, shares - the one place a salt enters a key."""
    return namespace if not salt else namespace + SALT_MARK + salt


def chain(namespace: str, tokens: np.ndarray, page: int) -> list[str]:
    """The key of each whole page of ``tokens`` (hex): page ``i``'s hashes the namespace and pages ``0 .. i``."""
    tokens = np.asarray(tokens, "<i4")
    digest = hashlib.blake2b(namespace.encode(), digest_size=16).digest()
    keys = []
    for i in range(tokens.size // page):
        digest = hashlib.blake2b(digest + tokens[i * page:(i + 1) * page].tobytes(), digest_size=16).digest()
        keys.append(digest.hex())
    return keys


def _is_hex(text: str) -> bool:
    return all(c in "0123456789abcdef" for c in text)


class PageStore:
    """Host (and disk) tiers of KV pages keyed by ``chain``; see the module docstring. ``page``: tokens per page.
    Counters: ``hits`` / ``misses`` (pages), ``corrupt`` (files found bad and deleted), ``disk_errors`` (disk
    operations that failed: writes skipped, files unreadable). ``disk_error``: the last failure's message, or None
    when there was none or a write has succeeded since - the disk tier's health."""

    def __init__(self, namespace: str, *, page: int, host_bytes: int = 1 << 30, directory: str | Path | None = None,
                 disk_bytes: int = 16 << 30):
        for name, value in (("page", page), ("host_bytes", host_bytes), ("disk_bytes", disk_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0 or (name == "page" and not value):
                raise ConfigError(f"PageStore {name}={value!r} is invalid: must be a non-negative integer")
        self.namespace, self.page = namespace, page
        self.host_bytes, self.disk_bytes = host_bytes, disk_bytes
        self._host: collections.OrderedDict[str, dict[str, np.ndarray]] = collections.OrderedDict()
        self._host_used = 0
        self.hits = self.misses = self.corrupt = self.disk_errors = 0
        self.disk_error: str | None = None
        self.directory = None if directory is None else Path(directory)
        self._state_lengths: set[int] = set()  # token counts of the row states kept (get_state tries each)
        self._listed: int | None = None  # the directory's modification time when its states were last listed
        if self.directory is not None:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
                self._sweep()
                self._list_states()
            except OSError as err:
                raise ConfigError(f"kv store directory {str(directory)!r} cannot be created or read: {err}") from err
        self._disk_used = self.disk_used()

    def _sweep(self) -> None:
        """Delete what no reader can use: writes a killed process left unfinished (old ones only: a recent one may
        be another process's, under way), files of an earlier format."""
        old = time.time() - STALE_TMP_S
        for stale in self.directory.glob(f".tmp-*{SUFFIX}"):
            try:
                if stale.stat().st_mtime < old:
                    stale.unlink(missing_ok=True)
            except FileNotFoundError:
                continue  # renamed into place or deleted meanwhile by its writer
        for path in self._files():
            try:
                with open(path, "rb") as f:
                    head = f.read(len(MAGIC))
            except FileNotFoundError:
                continue  # deleted meanwhile (another process bounding the same directory)
            if head.startswith(FAMILY) and head != MAGIC:
                path.unlink(missing_ok=True)

    def _failed(self, what: str, err: OSError) -> None:
        self.disk_errors += 1
        self.disk_error = f"kv store {what} failed: {err}"

    def _list_states(self) -> None:
        """Add the row states in the directory to ``_state_lengths`` when it changed since the last listing: states
        another process (a replica on the same directory) wrote are found too."""
        mtime = self.directory.stat().st_mtime_ns
        if mtime == self._listed:
            return
        self._listed = mtime
        self._state_lengths |= {int(p.stem[32:], 16) for p in self._files()
                                if len(p.stem) == STATE_KEY and _is_hex(p.stem)}

    # ------------------------------------------------------------------------------------------- lookups
    def keys(self, tokens: np.ndarray, salt: str | None = None) -> list[str]:
        return chain(salted(self.namespace, salt), tokens, self.page)

    def _path(self, key: str) -> Path:
        return self.directory / f"{key}{SUFFIX}"

    def _has(self, key: str) -> bool:
        if key in self._host:
            return True
        if self.directory is None:
            return False
        try:
            return self._path(key).is_file()
        except OSError as err:  # is_file answers False for a missing one; this is a disk that cannot say
            self._failed("lookup", err)
            return False

    def match(self, tokens: np.ndarray, salt: str | None = None) -> int:
        """How many leading whole pages of ``tokens`` (under ``salt``) the store holds - in host memory or in the
        directory, whoever wrote them (files are checked when read)."""
        n = 0
        for key in self.keys(tokens, salt):
            if not self._has(key):
                break
            n += 1
        return n

    def missing(self, tokens: np.ndarray, salt: str | None = None) -> list[int]:
        """The indices of the whole pages of ``tokens`` (under ``salt``) the store lacks."""
        return [i for i, key in enumerate(self.keys(tokens, salt)) if not self._has(key)]

    def get(self, tokens: np.ndarray, layout: dict[str, tuple[str, tuple[int, ...]]] | None = None,
            salt: str | None = None) -> tuple[int, dict[str, np.ndarray] | None]:
        """``(n, arrays)``: the leading pages of ``tokens`` the store can give (a bad file ends the run: it is
        deleted and the rest is prefilled), each array ``[L, n, ...]``; ``(0, None)`` if none. ``layout``: what
        one page must be (``layout_of``: names, dtypes and shapes, exactly); a file of another is bad."""
        keys, pages = self.keys(tokens, salt), []
        for key in keys:
            arrays = self._fetch(key, layout)
            if arrays is None:
                break
            pages.append(arrays)
        self.hits += len(pages)
        self.misses += len(keys) - len(pages)
        if not pages:
            return 0, None
        self._stamp(keys[:len(pages)])
        return len(pages), {n: np.stack([p[n] for p in pages], axis=1) for n in pages[0]}

    def _fetch(self, key: str, layout) -> dict[str, np.ndarray] | None:
        """Entry ``key`` from host memory (used now) or disk (kept in host memory), or None. ``layout``: what it
        must be (a host copy of another is dropped, a file of another deleted by ``_read``); None: anything."""
        arrays = self._host.get(key)
        if arrays is not None and layout is not None and layout_of(arrays) != layout:
            self._drop_host(key)  # not what the caller reads: as if it had never been kept
            arrays = None
        if arrays is not None:
            self._host.move_to_end(key)
        elif self.directory is not None:
            arrays = self._read(key, layout)
            if arrays is not None:
                self._keep(key, arrays)
        return arrays

    # ------------------------------------------------------------------------------------------- row states
    def state_key(self, tokens: np.ndarray, salt: str | None = None) -> str:
        """The key of a compressed row's state after ``tokens`` (hex, as a page's; its last 8 digits the length)."""
        tokens = np.asarray(tokens, "<i4")
        return self._state_keys(tokens, [tokens.size], salt)[0]

    def _state_keys(self, tokens: np.ndarray, lengths: list[int], salt: str | None = None) -> list[str]:
        """The keys of the states after ``tokens[:n]`` for each ``n`` of ``lengths`` (ascending): one running hash."""
        tokens = np.asarray(tokens, "<i4")
        namespace = salted(self.namespace, salt)
        digest, done, keys = hashlib.blake2b(b"state:" + namespace.encode(), digest_size=16), 0, []
        for n in lengths:
            digest.update(tokens[done:n].tobytes())
            done = n
            keys.append(digest.copy().hexdigest() + f"{n:08x}")
        return keys

    def put_state(self, tokens: np.ndarray, arrays: dict[str, np.ndarray], salt: str | None = None) -> None:
        """Keep the state a row reached after ``tokens`` (``lcx.engine.store_io.snapshot``), as one entry. Keyed
        by the tokens (and ``salt``) only: a state reached by other turns over the same tokens is the same entry
        (the first kept)."""
        key = self.state_key(tokens, salt)
        self._keep(key, arrays)
        self._state_lengths.add(int(np.asarray(tokens).size))
        if self.directory is not None:
            self._write(key, arrays)
            self._stamp([key])
            self._bound_disk()

    def get_state(self, tokens: np.ndarray, accept=None, salt: str | None = None
                  ) -> tuple[int, dict[str, np.ndarray] | None]:
        """``(n, arrays)``: the state stored after the longest ``tokens[:n]`` (``n < tokens.size``: the rest is
        the request's own) that ``accept(arrays)`` takes (default: any), or ``(0, None)``. One it refuses (another
        server's layout: another max_model_len shares the namespace) is skipped, not deleted."""
        tokens = np.asarray(tokens)
        if self.directory is not None:
            try:
                self._list_states()
            except OSError as err:  # the directory gone or unreadable: what this process knows of still serves
                self._failed(f"listing of {self.directory}", err)
        lengths = sorted(n for n in self._state_lengths if n < tokens.size)
        for n, key in reversed(list(zip(lengths, self._state_keys(tokens, lengths, salt)))):
            arrays = self._fetch(key, None)
            if arrays is not None and (accept is None or accept(arrays)):
                self.hits += 1
                self._stamp([key])
                return n, arrays
        self.misses += 1
        return 0, None

    # ------------------------------------------------------------------------------------------- writes
    def put(self, tokens: np.ndarray, indices: list[int], arrays: dict[str, np.ndarray],
            salt: str | None = None) -> None:
        """Keep pages ``indices`` of ``tokens`` (under ``salt``); ``arrays[name] [L, len(indices), ...]`` holds their
        contents. The disk tier's failures are counted (``disk_errors`` / ``disk_error``), never raised."""
        keys = self.keys(tokens, salt)
        for j, i in enumerate(indices):
            one = {n: np.ascontiguousarray(x[:, j]) for n, x in arrays.items()}
            self._keep(keys[i], one)
            if self.directory is not None:
                self._write(keys[i], one)
        if self.directory is not None:
            self._stamp(keys)  # the whole chain used now, its first pages the last to go
            self._bound_disk()

    def _keep(self, key: str, arrays: dict[str, np.ndarray]) -> None:
        if key in self._host:
            self._host.move_to_end(key)
            return
        self._host[key] = arrays
        self._host_used += sum(x.nbytes for x in arrays.values())
        while self._host_used > self.host_bytes and self._host:
            self._drop_host(next(iter(self._host)))

    def _drop_host(self, key: str) -> None:
        self._host_used -= sum(x.nbytes for x in self._host.pop(key).values())

    def _write(self, key: str, arrays: dict[str, np.ndarray]) -> None:
        path, tmp = self._path(key), None
        try:
            if path.is_file():
                return
            data = encode_page(key, arrays)
            # a name no other writer has (mkstemp: random, created exclusively), the pid to say whose it was
            prefix = f".tmp-{os.getpid()}-"
            try:
                fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=prefix, suffix=SUFFIX)
            except FileNotFoundError:  # the directory was deleted under the server: make it again, once
                self.directory.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=prefix, suffix=SUFFIX)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            # atomic: readers (and a restart after kill -9) see a whole file or none; two writers of one page
            # (replicas) each rename a whole file of the same contents, the last one stays
            os.replace(tmp, path)
            self._disk_used += len(data)
            self.disk_error = None
        except OSError as err:  # unwritable, deleted, full: the page stays in host memory only
            self._failed(f"write to {self.directory}", err)
            if tmp is not None:
                try:
                    Path(tmp).unlink(missing_ok=True)
                except OSError:
                    pass  # the same disk failing again: counted once above

    def _read(self, key: str, layout) -> dict[str, np.ndarray] | None:
        """The page's arrays, or None (missing; or bad: deleted and counted in ``corrupt``)."""
        path = self._path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as err:
            self._failed(f"read of {path}", err)
            return None
        try:
            arrays = decode_page(key, data)
            if layout is not None and layout_of(arrays) != layout:
                raise ValueError(f"layout {layout_of(arrays)}, expected {layout}")
        except ValueError:
            self.corrupt += 1
            try:
                path.unlink(missing_ok=True)
            except OSError as err:
                self._failed(f"delete of {path}", err)
            return None
        return arrays

    def _stamp(self, keys: list[str]) -> None:
        """Mark the pages ``keys`` (a chain, in order) used now: page i ``i`` steps older than page 0, so that the
        bound deletes a chain from its end."""
        if self.directory is None:
            return
        now = time.time_ns()
        for i, key in enumerate(keys):
            t = now - i * STAMP_STEP_NS
            try:
                os.utime(self._path(key), ns=(t, t))
            except (FileNotFoundError, NotADirectoryError):
                pass  # in host memory only (or no directory at all: the write said so)
            except OSError as err:
                self._failed(f"stamp of {self._path(key)}", err)
                return

    def _files(self) -> list[Path]:
        return [p for p in self.directory.glob(f"*{SUFFIX}") if not p.name.startswith(".tmp-")]

    def _bound_disk(self) -> None:
        if self._disk_used <= self.disk_bytes:
            return
        files = []
        try:
            for path in self._files():
                try:
                    st = path.stat()
                except FileNotFoundError:
                    continue  # deleted meanwhile (another process on the same directory)
                files.append((st.st_mtime_ns, st.st_size, path))
            used = sum(size for _, size, _ in files)
            for _, size, path in sorted(files):
                if used <= self.disk_bytes:
                    break
                path.unlink(missing_ok=True)
                used -= size
        except OSError as err:
            self._failed(f"bound of {self.directory}", err)
            return
        self._disk_used = used

    def disk_used(self) -> int:
        """Bytes of the page files in the directory (0 without one, or when it cannot be read)."""
        if self.directory is None:
            return 0
        used = 0
        for path in self._files():
            try:
                used += path.stat().st_size
            except OSError:
                continue  # deleted meanwhile; or a disk failing, which the next write reports
        return used


__all__ = ["DIGEST", "MAGIC", "STALE_TMP_S", "SUFFIX", "PageStore", "chain", "decode_page", "encode_page", "layout_of",
           "page_digest", "salted"]
