"""Faults of the KV page store (``lcx.engine.kv_store.PageStore``) and what the server does with them: a failing disk
degrades the store and never fails a request or its neighbours; a file of another layout, another page's contents
or an edited header is bad, never served; the size bound keeps what a later prompt can match."""

from __future__ import annotations

import json
import os
import shutil
import struct

import jax
import numpy as np
import pytest

import lcx
from lcx.engine.kv_store import MAGIC, SUFFIX, PageStore
from lcx.engine.server import Server

CFG = lcx.ModelConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                      max_position_embeddings=128)
PAGE = 8
NEW = 5
PROMPTS = [np.random.default_rng(40 + i).integers(0, 61, n).tolist() for i, n in enumerate((29, 27, 30))]


# --------------------------------------------------------------------------------------------------- the store alone
def _pages(n: int, seed: int = 0, dtype=np.float32) -> dict[str, np.ndarray]:
    """The contents of ``n`` pages of a 2-layer cache: ``[L, n, k, page, d]`` keys and values."""
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal((2, n, 1, PAGE, 4)).astype(dtype) for name in ("k", "v")}


def _tokens(n_pages: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1000, n_pages * PAGE).astype(np.int32)


def _files(directory) -> list:
    return sorted(p for p in directory.glob(f"*{SUFFIX}") if not p.name.startswith(".tmp-"))


def test_a_failing_disk_is_counted_and_skipped_never_raised(tmp_path, monkeypatch):
    """A store whose directory is replaced by a file, deleted, or full: ``put`` keeps the pages in host memory and
    records the failure (``disk_errors``, ``disk_error``) instead of raising into the serving step."""
    directory = tmp_path / "kv"
    store = PageStore("m", page=PAGE, directory=directory)
    tokens = _tokens(3, seed=1)
    shutil.rmtree(directory)
    directory.write_text("not a directory")  # writes fail with ENOTDIR (as root, chmod would not stop them)
    store.put(tokens, [0, 1, 2], _pages(3))
    assert store.disk_errors >= 1 and str(directory) in store.disk_error
    n, arrays = store.get(tokens)  # served from host memory, as computed
    assert n == 3
    np.testing.assert_array_equal(arrays["k"], _pages(3)["k"])
    # the directory back: the next write succeeds and the store reports healthy again
    directory.unlink()
    directory.mkdir()
    store.put(_tokens(1, seed=2), [0], _pages(1))
    assert store.disk_error is None and len(_files(directory)) == 1
    # a deleted directory is made again by the next write
    shutil.rmtree(directory)
    store.put(_tokens(1, seed=3), [0], _pages(1))
    assert store.disk_error is None and len(_files(directory)) == 1
    # a full disk: the write is skipped and counted, no temporary file is left
    errors = store.disk_errors

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    store.put(_tokens(1, seed=4), [0], _pages(1))
    assert store.disk_errors == errors + 1 and "No space left" in store.disk_error
    assert len(_files(directory)) == 1 and not list(directory.glob(".tmp-*"))


def test_a_file_of_another_layout_is_bad_never_served(tmp_path):
    """A page file with a valid checksum whose arrays are not what the caller expects (shape, names, dtype) is
    deleted and counted, as a corrupt one: loading it would fail the engine step."""
    tokens = _tokens(2, seed=5)
    want = {n: (str(x.dtype), (x.shape[0],) + x.shape[2:]) for n, x in _pages(1).items()}
    for bad in ({"k": _pages(2)["k"][..., :2], "v": _pages(2)["v"][..., :2]},  # another head_dim
                {"k": _pages(2)["k"], "x": _pages(2)["v"]},  # another name
                _pages(2, dtype=np.float16)):  # another dtype
        PageStore("m", page=PAGE, directory=tmp_path).put(tokens, [0, 1], bad)
        store = PageStore("m", page=PAGE, directory=tmp_path)
        assert store.match(tokens) == 2  # present until read
        assert store.get(tokens, want) == (0, None) and store.corrupt == 1
        assert _files(tmp_path) == [tmp_path / f"{store.keys(tokens)[1]}{SUFFIX}"]  # the first deleted
        shutil.rmtree(tmp_path)
    # the expected layout reads back
    PageStore("m", page=PAGE, directory=tmp_path).put(tokens, [0, 1], _pages(2))
    n, arrays = PageStore("m", page=PAGE, directory=tmp_path).get(tokens, want)
    assert n == 2 and np.array_equal(arrays["v"], _pages(2)["v"])


def _two_pages(directory) -> tuple:
    """Two conversations' first pages written to ``directory``: ``(ours, theirs)``, each ``(tokens, file)``."""
    ours, theirs = _tokens(1, seed=6), _tokens(1, seed=7)
    writer = PageStore("m", page=PAGE, directory=directory)
    writer.put(ours, [0], _pages(1, seed=1))
    writer.put(theirs, [0], _pages(1, seed=2))
    return tuple((t, directory / f"{writer.keys(t)[0]}{SUFFIX}") for t in (ours, theirs))


def test_a_file_copied_under_another_pages_name_is_corrupt(tmp_path):
    """A whole, checksummed page file copied under another page's name (key) is corrupt: the digest covers the
    key (it covered the payload alone, and another conversation's keys and values were served)."""
    (_, our_file), (theirs, their_file) = _two_pages(tmp_path)
    their_file.write_bytes(our_file.read_bytes())
    store = PageStore("m", page=PAGE, directory=tmp_path)
    assert store.get(theirs) == (0, None) and store.corrupt == 1 and not their_file.exists()


def test_a_file_with_an_edited_header_is_corrupt(tmp_path):
    """A page file whose header's dtype is edited (float32 -> int32: the same size, the payload still fits; the
    header's size field fixed) is corrupt: the digest covers the header (the bytes were served as int32)."""
    (ours, our_file), _ = _two_pages(tmp_path)
    data = our_file.read_bytes()
    (size,) = struct.unpack_from("<Q", data, len(MAGIC))
    start = len(MAGIC) + 8
    header = json.loads(data[start:start + size])
    header["arrays"] = [[n, "int32", shape] for n, _, shape in header["arrays"]]
    edited = json.dumps(header).encode()
    our_file.write_bytes(MAGIC + struct.pack("<Q", len(edited)) + edited + data[start + size:])
    store = PageStore("m", page=PAGE, directory=tmp_path)
    assert store.get(ours) == (0, None) and store.corrupt == 1 and not our_file.exists()


def test_files_of_the_earlier_format_are_deleted_as_missing(tmp_path):
    """A page file of format 1 (``LCXKVP1``: its checksum covered the payload only) is unreadable by design: a
    store opening the directory deletes it; it is missing (prefilled again), not corrupt."""
    tokens = _tokens(2, seed=8)
    PageStore("m", page=PAGE, directory=tmp_path).put(tokens, [0, 1], _pages(2))
    old = _files(tmp_path)[0]
    old.write_bytes(b"LCXKVP1\n" + old.read_bytes()[len(MAGIC):])
    store = PageStore("m", page=PAGE, directory=tmp_path)
    assert not old.exists() and len(_files(tmp_path)) == 1 and store.corrupt == 0


def test_the_size_bound_keeps_a_prefix_of_a_chain(tmp_path):
    """Past ``disk_bytes`` the store deletes a chain's last pages first: what stays is matched after a restart.
    (It deleted the oldest files first: a conversation's first pages, written a turn earlier - then none of its
    pages could be matched again.)"""
    probe = PageStore("m", page=PAGE, directory=tmp_path / "probe")
    probe.put(_tokens(1, seed=9), [0], _pages(1))
    size = _files(tmp_path / "probe")[0].stat().st_size
    directory = tmp_path / "kv"
    tokens = _tokens(6, seed=10)
    # a conversation: turn 1 stores 3 pages, turn 2 (a minute later) its prompt + answer, 6 pages
    store = PageStore("m", page=PAGE, directory=directory, disk_bytes=4 * size)
    store.put(tokens[:3 * PAGE], [0, 1, 2], _pages(3, seed=1))
    for path in _files(directory):  # turn 1 was a minute ago
        os.utime(path, (path.stat().st_atime - 60, path.stat().st_mtime - 60))
    store.put(tokens, [3, 4, 5], _pages(3, seed=2))
    assert len(_files(directory)) == 4
    assert PageStore("m", page=PAGE, directory=directory).match(tokens) == 4
    # one put of a chain longer than the bound
    tokens = _tokens(7, seed=11)
    shutil.rmtree(directory)
    PageStore("m", page=PAGE, directory=directory, disk_bytes=3 * size).put(tokens, list(range(7)), _pages(7))
    reopened = PageStore("m", page=PAGE, host_bytes=0, directory=directory)
    assert reopened.match(tokens) == 3 and reopened.get(tokens)[0] == 3
    # reading a chain uses all of it: a later write deletes an older chain's last page, not the chain just read
    other = _tokens(2, seed=12)
    reopened.disk_bytes = 5 * size
    reopened.put(other, [0, 1], _pages(2))  # 5 files
    for key in reopened.keys(tokens)[:3]:
        os.utime(directory / f"{key}{SUFFIX}", (0, 0))  # the first chain unused for long...
    assert reopened.get(tokens)[0] == 3  # ...until read now (host_bytes=0: from its files)
    reopened.put(_tokens(1, seed=13), [0], _pages(1))  # 6 files: one goes
    assert reopened.match(tokens) == 3 and reopened.match(other) == 1


# --------------------------------------------------------------------------------------------------- in a server
@pytest.fixture(scope="module")
def params():
    return lcx.init_params(CFG, jax.random.key(4))


def _server(params, store=None, **kw) -> Server:
    # one configuration for every server here: the compiled programs are shared
    return Server(CFG, params, max_num_seqs=2, max_len=40, segment=4, prefill_chunk=16,
                  cache=lcx.CacheConfig(layout="paged", page_size=PAGE), store=store, **kw)


@pytest.fixture(scope="module")
def reference(params) -> dict:
    """Each prompt's tokens from a server without a store."""
    server = _server(params)
    ids = [server.submit(p, max_new_tokens=NEW) for p in PROMPTS]
    out = server.run()
    return {"tokens": [out[i] for i in ids]}


def _idle_pool_is_back(server: Server) -> None:
    """Every row released: the only references left are the kept prefixes'."""
    refs = np.asarray(server.state.refs)
    assert np.all(np.asarray(server.state.table) == -1) and server.committed == 0
    assert refs.sum() == sum(len(p.pages) for p in server.prefixes.entries.values()) == server.pages_used()


def test_requests_beside_a_failing_store_directory_finish_as_without_a_store(params, reference, tmp_path):
    """The ``--kv-store`` directory replaced by a file while serving: the two streams running together give the
    tokens of a server without a store, every page comes back, and the store reports the failure."""
    directory = tmp_path / "kv"
    store = PageStore("tiny", page=PAGE, directory=directory)
    shutil.rmtree(directory)
    directory.write_text("")
    server = _server(params, store)
    ids = [server.submit(p, max_new_tokens=NEW) for p in PROMPTS[:2]]
    out = server.run()
    assert [out[i] for i in ids] == reference["tokens"][:2]
    _idle_pool_is_back(server)
    assert store.disk_errors > 0 and str(directory) in store.disk_error


class _BrokenStore:
    """A store whose writes raise: what the server's spill of a kept prefix must survive without leaking it."""

    directory = None

    def missing(self, tokens, salt=None):
        return list(range(len(tokens) // PAGE))

    def put(self, tokens, indices, arrays, salt=None):
        raise RuntimeError("store broken")


def test_a_kept_prefix_is_released_even_when_its_spill_raises(params, reference):
    server = _server(params)
    rid = server.submit(PROMPTS[0], max_new_tokens=NEW)
    assert server.run()[rid] == reference["tokens"][0]
    (prefix,) = server.prefixes.entries.values()
    used = server.pages_used()
    server.store = _BrokenStore()
    with pytest.raises(RuntimeError, match="store broken"):
        server.prefixes.drop_lru(keep=None)
    assert not server.prefixes.entries and server.pages_used() == used - len(prefix.pages) == 0


def test_stored_pages_of_another_layout_are_recomputed_not_loaded(params, reference, tmp_path):
    """A file under a prompt's first page key with a valid checksum but another layout (head dim, array names,
    dtype) is deleted and the page prefilled again: the request gets the tokens of a server without a store, and
    so do the requests beside it (a load of it failed the engine step, for every row, on every retry)."""
    shape = (2, 1, 2, PAGE, 8)  # [L, pages, k, page, d] of CFG's pages
    bad = [{n: np.ones(shape[:-1] + (4,), np.float32) for n in ("k", "v")},  # another head_dim
           {n: np.ones(shape, np.float32) for n in ("k", "x")},  # another name
           {n: np.ones(shape, np.float16) for n in ("k", "v")}]  # another dtype
    writer = PageStore("tiny", page=PAGE, directory=tmp_path)
    for prompt, arrays in zip(PROMPTS, bad):
        writer.put(np.asarray(prompt[:PAGE], np.int32), [0], arrays)
    store = PageStore("tiny", page=PAGE, directory=tmp_path)
    server = _server(params, store)
    ids = [server.submit(p, max_new_tokens=NEW) for p in PROMPTS]
    out = server.run()
    assert [out[i] for i in ids] == reference["tokens"]
    assert server.cached_tokens == 0 and store.corrupt == 3
    _idle_pool_is_back(server)
    # the pages were written again, of the right layout: a restarted server loads them
    again = _server(params, PageStore("tiny", page=PAGE, directory=tmp_path))
    rid = again.submit(PROMPTS[2], max_new_tokens=NEW)
    assert again.run()[rid] == reference["tokens"][2] and again.cached_tokens == 3 * PAGE
