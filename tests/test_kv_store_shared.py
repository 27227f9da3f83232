"""One KV store directory shared: by replicas (two ``PageStore`` instances, two processes writing, reading and
bounding the same pages at once - every read missing or exactly what was written, nothing counted corrupt or failed)
and by tenants (a ``cache_salt`` keys every page and row state apart; no salt keys them as before salts existed)."""

from __future__ import annotations

import multiprocessing
import os
import time

import numpy as np

from lcx.engine.kv_store import SUFFIX, PageStore, chain, encode_page, salted

PAGE = 8
KEYS = 6  # conversations both processes write and read at once
ROUNDS = 200  # puts and gets per process: enough for the writes, reads and deletions of the two to interleave


def _tokens(n_pages: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1000, n_pages * PAGE).astype(np.int32)


def _pages(tokens: np.ndarray, n: int) -> dict[str, np.ndarray]:
    """What page ``i`` of ``tokens`` holds, the same in every process (seeded by the tokens): ``[L, n, k, page, d]``."""
    out = {"k": [], "v": []}
    for i in range(n):
        rng = np.random.default_rng(int(tokens[i * PAGE:(i + 1) * PAGE].sum()) + 7919 * i)
        for name in out:
            out[name].append(rng.standard_normal((2, 1, PAGE, 4)).astype(np.float32))
    return {name: np.stack(x, axis=1) for name, x in out.items()}


def _files(directory) -> list:
    return sorted(p for p in directory.glob(f"*{SUFFIX}") if not p.name.startswith(".tmp-"))


# --------------------------------------------------------------------------------------------------- tenants
def test_a_salt_keys_every_page_and_state_apart_and_no_salt_keys_as_before(tmp_path):
    tokens = _tokens(3, seed=1)
    # no salt: today's keys exactly (stores written before salts existed stay valid)
    assert salted("m", None) == salted("m", "") == "m"
    assert PageStore("m", page=PAGE).keys(tokens) == chain("m", tokens, PAGE)
    plain, a, b = (PageStore("m", page=PAGE).keys(tokens, salt) for salt in (None, "tenant-a", "tenant-b"))
    assert len(set(plain) | set(a) | set(b)) == 9  # no page shared between any two
    assert PageStore("m", page=PAGE).keys(tokens, "tenant-a") == a  # deterministic: every process, every restart

    writer = PageStore("m", page=PAGE, directory=tmp_path)
    writer.put(tokens, [0, 1, 2], _pages(tokens, 3), salt="tenant-a")
    reader = PageStore("m", page=PAGE, directory=tmp_path)  # another process's view: the directory only
    assert reader.match(tokens, "tenant-a") == 3 and reader.get(tokens, salt="tenant-a")[0] == 3
    assert reader.match(tokens, "tenant-b") == reader.match(tokens) == 0
    assert reader.get(tokens, salt="tenant-b") == (0, None) and reader.get(tokens) == (0, None)
    assert {p.stem for p in _files(tmp_path)} == set(a)

    # an evicting policy's row states: the same
    state = {"page.k": np.ones((2, 1, 3), np.float32)}
    writer.put_state(tokens[:20], state, salt="tenant-a")
    assert writer.state_key(tokens[:20], "tenant-a") != writer.state_key(tokens[:20]) != \
        writer.state_key(tokens[:20], "tenant-b")
    assert reader.get_state(tokens, salt="tenant-a")[0] == 20
    assert reader.get_state(tokens, salt="tenant-b") == (0, None) and reader.get_state(tokens) == (0, None)


# --------------------------------------------------------------------------------------------------- replicas
def test_a_store_finds_what_another_wrote_after_it_opened(tmp_path):
    """Two stores on one directory (two replicas): pages and row states one writes after the other opened are
    found by the other - lookups read the directory, not an index of their own."""
    a = PageStore("m", page=PAGE, directory=tmp_path)
    b = PageStore("m", page=PAGE, directory=tmp_path)
    tokens = _tokens(4, seed=2)
    a.put(tokens, [0, 1, 2, 3], _pages(tokens, 4))
    assert b.match(tokens) == 4
    n, arrays = b.get(tokens)
    assert n == 4 and np.array_equal(arrays["k"], _pages(tokens, 4)["k"])
    a.put_state(tokens[:13], {"page.k": np.full((2, 1, 3), 5, np.float32)})
    n, arrays = b.get_state(tokens)
    assert n == 13 and np.all(arrays["page.k"] == 5)
    # a page the other deletes (its disk bound) between a lookup and the read is missing, not an error
    c = PageStore("m", page=PAGE, host_bytes=0, directory=tmp_path)  # no host copies: reads go to the files
    assert c.match(tokens) == 4
    (tmp_path / f"{a.keys(tokens)[2]}{SUFFIX}").unlink()
    assert c.get(tokens)[0] == 2 and c.corrupt == c.disk_errors == 0


def test_opening_a_store_keeps_a_recent_temporary_file_and_deletes_an_old_one(tmp_path):
    """A temporary file may be another process's write under way (a replica on the same directory): a store that
    opens the directory leaves a recent one alone, and deletes one older than ``STALE_TMP_S`` (a killed writer's)."""
    from lcx.engine.kv_store import STALE_TMP_S

    recent, old = tmp_path / f".tmp-1-recent{SUFFIX}", tmp_path / f".tmp-2-old{SUFFIX}"
    recent.write_bytes(b"half a page")
    old.write_bytes(b"half a page")
    t = time.time() - STALE_TMP_S - 60
    os.utime(old, (t, t))
    PageStore("m", page=PAGE, directory=tmp_path)
    assert recent.exists() and not old.exists()


def _hammer(directory: str, worker: int, out) -> None:
    """One replica's traffic: ``ROUNDS`` writes and reads of the shared conversations, a tight disk bound (so both
    delete files the other reads), and a store opened again now and then (its sweep beside the other's writes).
    Puts every read that is not missing and not exactly what was written into ``out``, with the store's counters."""
    rng = np.random.default_rng(worker)
    conversations = [_tokens(4, seed=100 + i) for i in range(KEYS)]
    page_bytes = len(encode_page("0" * 32, {n: x[:, 0] for n, x in _pages(conversations[0], 1).items()}))

    def store():
        # host_bytes=0: every read goes to the directory
        return PageStore("m", page=PAGE, host_bytes=0, directory=directory, disk_bytes=10 * page_bytes)

    s, bad, read = store(), [], 0
    for r in range(ROUNDS):
        tokens = conversations[int(rng.integers(KEYS))]
        if rng.random() < 0.5:
            missing = s.missing(tokens)
            s.put(tokens, missing, {n: x[:, missing] for n, x in _pages(tokens, 4).items()})
        n, arrays = s.get(tokens)
        if n:
            read += n
            want = _pages(tokens, n)
            if not all(np.array_equal(arrays[name], want[name]) for name in want):
                bad.append(f"worker {worker} round {r}: {n} pages differ from what was written")
        if r % 10 == 9:
            totals = (s.corrupt, s.disk_errors, s.disk_error)
            s = store()
            if totals[0] or totals[1]:
                bad.append(f"worker {worker}: corrupt={totals[0]} disk_errors={totals[1]} ({totals[2]})")
    if s.corrupt or s.disk_errors:
        bad.append(f"worker {worker}: corrupt={s.corrupt} disk_errors={s.disk_errors} ({s.disk_error})")
    out.put((worker, read, bad))


def test_two_processes_writing_reading_and_bounding_the_same_pages_never_see_a_bad_one(tmp_path):
    """Two processes (replicas) on one directory, writing the same pages at once, reading them and deleting them
    under a bound that holds fewer than they write: every read is missing or exactly what was written, no file is
    ever counted corrupt, no disk operation fails (a file the other deletes between a lookup and its read is missing;
    a store opening the directory leaves the other's write under way alone), and every file left is whole."""
    ctx = multiprocessing.get_context("spawn")  # fresh interpreters, as two servers are (no forked JAX threads)
    out = ctx.Queue()
    procs = [ctx.Process(target=_hammer, args=(str(tmp_path), w, out)) for w in range(2)]
    for p in procs:
        p.start()
    try:
        results = [out.get(timeout=120) for _ in procs]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs)
    problems = [line for _, _, bad in results for line in bad]
    assert not problems, "\n".join(problems[:10])
    assert all(read > 0 for _, read, _ in results)  # each read pages (the other's among them), not only misses
    reader = PageStore("m", page=PAGE, directory=tmp_path)
    for path in _files(tmp_path):
        assert reader._read(path.stem, None) is not None, f"{path.name} is not a whole page file"
    assert reader.corrupt == 0
