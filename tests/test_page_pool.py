"""The page pool's bookkeeping (``lcx.cache.page_pool``): grant, release, hold, copy-on-write and fork against a
small numpy model and explicit arrays; references always equal the tables' plus the held ones, and the peak is the
most pages ever in use."""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lcx
from lcx.cache import page_pool
from lcx.cache.base import CacheCapacityError
from lcx.kernels.paged_decode import gather_pages


class Model:
    """The bookkeeping in plain numpy and loops: free pages are handed out lowest index first, rows in order."""

    def __init__(self, rows: int, row_pages: int, pages: int):
        self.table = np.full((rows, row_pages), -1, np.int64)
        self.refs = np.zeros(pages, np.int64)
        self.peak, self.overflow = 0, False

    def _take(self) -> int:
        free = np.flatnonzero(self.refs == 0)
        if free.size == 0:
            self.overflow = True
            return -1
        self.refs[free[0]] += 1
        self.peak = max(self.peak, int(np.sum(self.refs > 0)))
        return int(free[0])

    def grant(self, fill: np.ndarray) -> None:
        for b, j in zip(*np.nonzero(fill)):  # row-major: rows in order, each row's entries in order
            self.table[b, j] = self._take()

    def grant_upto(self, want: np.ndarray) -> None:
        self.grant((np.arange(self.table.shape[1])[None, :] < np.minimum(want, self.table.shape[1])[:, None])
                   & (self.table < 0))

    def drop(self, mask: np.ndarray) -> None:
        for b, j in zip(*np.nonzero(mask & (self.table >= 0))):
            self.refs[self.table[b, j]] -= 1
            self.table[b, j] = -1

    def assign(self, row: int, pages: np.ndarray) -> None:
        self.table[row] = pages
        for p in pages[pages >= 0]:
            self.refs[p] += 1
        self.peak = max(self.peak, int(np.sum(self.refs > 0)))

    def hold(self, pages, delta: int) -> None:
        for p in pages:
            self.refs[p] += delta
        self.peak = max(self.peak, int(np.sum(self.refs > 0)))

    def copy_on_write(self, write: np.ndarray) -> None:
        shared = [(b, j) for b, j in zip(*np.nonzero(write & (self.table >= 0))) if self.refs[self.table[b, j]] > 1]
        for b, j in shared:  # every shared page lets go first, then the fresh pages are handed out
            self.refs[self.table[b, j]] -= 1
            self.table[b, j] = -1
        for b, j in shared:
            self.table[b, j] = self._take()


def overflows(model: Model, call: str, *args) -> bool:
    trial = copy.deepcopy(model)
    getattr(trial, call)(*args)
    return trial.overflow


def same(pool: page_pool.PagePool, model: Model, step: str) -> None:
    np.testing.assert_array_equal(np.asarray(pool.table), model.table, err_msg=step)
    np.testing.assert_array_equal(np.asarray(pool.refs), model.refs, err_msg=step)
    assert int(pool.peak) == model.peak and bool(pool.overflow) == model.overflow, step
    assert int(pool.in_use()) == np.sum(model.refs > 0) and int(pool.free()) == np.sum(model.refs == 0), step


def test_random_calls_keep_the_numpy_model_s_bookkeeping():
    """Two hundred random grants, releases, trims, holds, assigns and copy-on-writes on 3 rows x 4 entries over 10
    pages: the pool's tables, references, peak and free count equal the model's after every call, and the
    references are the tables' plus the held ones."""
    rows, row_pages, pages = 3, 4, 10
    rng = np.random.default_rng(0)
    pool, model = page_pool.empty(rows, row_pages, pages), Model(rows, row_pages, pages)
    held: list[int] = []  # pages held outside the tables (a server's kept prefixes)
    ops = dict(grant_upto=jax.jit(page_pool.grant_upto), release=jax.jit(page_pool.release),
               trim=jax.jit(page_pool.trim), hold=jax.jit(page_pool.hold), assign=jax.jit(page_pool.assign),
               copy_on_write=jax.jit(page_pool.copy_on_write))
    kinds = set()
    for step in range(200):
        name = str(rng.choice(list(ops)))
        if name == "grant_upto":
            want = rng.integers(0, row_pages + 2, rows)
            if overflows(model, "grant_upto", want):
                continue  # tested on its own below (the table's content is then undefined)
            pool = ops[name](pool, jnp.asarray(want))
            model.grant_upto(want)
        elif name == "release":
            row = int(rng.integers(rows))
            pool = ops[name](pool, jnp.int32(row))
            model.drop(np.arange(rows)[:, None] == row)
        elif name == "trim":
            keep = rng.integers(0, row_pages + 1, rows)
            pool = ops[name](pool, jnp.asarray(keep))
            model.drop(np.arange(row_pages)[None, :] >= keep[:, None])
        elif name == "hold":  # take a row's pages as a kept prefix, or let one kept page go
            if held and rng.random() < 0.5:
                pages_ = np.asarray([held.pop()], np.int32)
                delta = -1
            else:
                row_held = model.table[rng.integers(rows)]
                pages_ = row_held[row_held >= 0][:2].astype(np.int32)
                if pages_.size == 0:
                    continue
                held += pages_.tolist()
                delta = 1
            pool = ops[name](pool, jnp.asarray(pages_), jnp.int32(delta))
            model.hold(pages_, delta)
        elif name == "assign":  # an empty row starts on kept pages
            empty_rows = np.flatnonzero(np.all(model.table < 0, axis=1))
            if empty_rows.size == 0 or not held:
                continue
            table = np.full(row_pages, -1, np.int32)
            prefix = sorted(set(held))[:row_pages]
            table[:len(prefix)] = prefix
            pool = ops[name](pool, jnp.int32(empty_rows[0]), jnp.asarray(table))
            model.assign(int(empty_rows[0]), table)
        else:
            write = rng.random((rows, row_pages)) < 0.5
            if overflows(model, "copy_on_write", write):
                continue
            pool = ops[name](pool, jnp.asarray(write))
            model.copy_on_write(write)
        kinds.add(name)
        same(pool, model, f"step {step}: {name}")
        count = np.bincount(model.table[model.table >= 0], minlength=pages) + np.bincount(held, minlength=pages)
        np.testing.assert_array_equal(np.asarray(pool.refs), count, err_msg=f"step {step}: {name}")
    assert kinds == set(ops) and model.peak >= 6  # every call ran, and the pool was more than half full


def test_grant_takes_free_pages_in_index_order_and_flags_an_exhausted_pool():
    pool = page_pool.PagePool(table=jnp.asarray([[3, -1, -1], [-1, -1, -1]], jnp.int32),
                              refs=jnp.asarray([1, 0, 0, 1, 0, 0], jnp.int32), peak=jnp.int32(2),
                              overflow=jnp.asarray(False))
    out = page_pool.grant(pool, jnp.asarray([[False, True, True], [True, False, False]]))
    np.testing.assert_array_equal(out.table, [[3, 1, 2], [4, -1, -1]])  # row 0's entries first, then row 1's
    np.testing.assert_array_equal(out.refs, [1, 1, 1, 1, 1, 0])
    assert int(out.peak) == 5 and not bool(out.overflow)
    page_pool.check(out, 8)  # nothing to raise
    out = page_pool.grant_upto(out, jnp.asarray([9, 3]))  # row 0 is full; row 1 wants 2 more, 1 is free
    assert bool(out.overflow) and int(out.peak) == 6
    with pytest.raises(CacheCapacityError, match="ran out of pages: its pool holds 6 pages of 8 tokens and 6 are in "
                                                 "use"):
        page_pool.check(out, 8)


def test_release_and_hold_return_pages_and_the_peak_stays():
    pool = page_pool.grant_upto(page_pool.empty(2, 3, 6), jnp.asarray([3, 2]))
    np.testing.assert_array_equal(pool.table, [[0, 1, 2], [3, 4, -1]])
    pool = page_pool.hold(pool, jnp.asarray([0, 1], jnp.int32), 1)  # a kept prefix: row 0's first two pages
    pool = page_pool.release(pool, 0)
    np.testing.assert_array_equal(pool.table, [[-1, -1, -1], [3, 4, -1]])
    np.testing.assert_array_equal(pool.refs, [1, 1, 0, 1, 1, 0])
    pool = page_pool.assign(pool, 0, jnp.asarray([0, 1, -1], jnp.int32))  # a new row reads the kept prefix
    np.testing.assert_array_equal(pool.refs, [2, 2, 0, 1, 1, 0])
    pool = page_pool.hold(page_pool.release(page_pool.release(pool, 1), 0), jnp.asarray([0, 1], jnp.int32), -1)
    assert np.all(np.asarray(pool.refs) == 0) and np.all(np.asarray(pool.table) == -1)
    assert int(pool.peak) == 5 and int(pool.free()) == 6  # the most at once: 5 pages, before the first release


def test_copy_on_write_gives_a_row_fresh_pages_for_what_others_hold():
    pool = page_pool.PagePool(table=jnp.asarray([[0, 1, 2], [0, 1, 3]], jnp.int32),
                              refs=jnp.asarray([2, 2, 1, 1, 0, 0], jnp.int32), peak=jnp.int32(4),
                              overflow=jnp.asarray(False))
    # row 1 rewrites its pages 1 (shared: copied) and 2 (its own: written in place); row 0 writes nothing
    out = page_pool.copy_on_write(pool, jnp.asarray([[False] * 3, [False, True, True]]))
    np.testing.assert_array_equal(out.table, [[0, 1, 2], [0, 4, 3]])
    np.testing.assert_array_equal(out.refs, [2, 1, 1, 1, 1, 0])
    assert int(out.peak) == 5
    # after it, the row writes pages it alone holds: a second copy-on-write of the same entries changes nothing
    again = page_pool.copy_on_write(out, jnp.asarray([[False] * 3, [False, True, True]]))
    np.testing.assert_array_equal(again.table, out.table)
    np.testing.assert_array_equal(again.refs, out.refs)


def test_trim_lets_go_of_the_entries_past_each_row_s_count():
    pool = page_pool.PagePool(table=jnp.asarray([[0, 1, 2], [0, 1, 3]], jnp.int32),
                              refs=jnp.asarray([2, 2, 1, 1], jnp.int32), peak=jnp.int32(4), overflow=jnp.asarray(False))
    out = page_pool.trim(pool, jnp.asarray([1, 3]))
    np.testing.assert_array_equal(out.table, [[0, -1, -1], [0, 1, 3]])
    np.testing.assert_array_equal(out.refs, [2, 1, 0, 1])


def test_fork_shares_full_pages_copies_the_rest_and_moves_the_data():
    """Row 0 (pages 5, 2, 7; two full) into two rows, row 1 (pages 0, 4; one full) into three: the full pages once
    (every copy a reference), the others once per copy, each copy reading its row's data, and the pool sized by
    the shared pages plus every copy's reserve."""
    table = np.asarray([[5, 2, 7, -1], [0, 4, -1, -1]], np.int32)
    refs = np.bincount(table[table >= 0], minlength=8).astype(np.int32)
    pool = page_pool.PagePool(table=jnp.asarray(table), refs=jnp.asarray(refs), peak=jnp.int32(5),
                              overflow=jnp.asarray(False))
    full, reserve, n = np.asarray([2, 1]), np.asarray([2, 3]), np.asarray([2, 3])
    out, source = page_pool.fork(pool, n, full, reserve)
    # the shared pages first, in index order (0, 2, 5 -> 0, 1, 2), then each copy's private pages
    np.testing.assert_array_equal(out.table, [[2, 1, 3, -1], [2, 1, 4, -1], [0, 5, -1, -1], [0, 6, -1, -1],
                                              [0, 7, -1, -1]])
    np.testing.assert_array_equal(source, [0, 2, 5, 7, 7, 4, 4, 4])
    assert out.n_pages == 3 + 2 * 2 + 3 * 3
    np.testing.assert_array_equal(out.refs, [3, 2, 2, 1, 1, 1, 1, 1] + [0] * 8)
    assert int(out.peak) == 8 and not bool(out.overflow)
    # the data: every new row's pages hold what its source row's pages held
    x = jax.random.normal(jax.random.key(0), (2, 8, 1, 4, 3))  # [L, P, k, g, d]
    moved = page_pool.take_pages(x, source, out.n_pages)
    assert moved.shape == (2, 16, 1, 4, 3) and not np.any(np.asarray(moved[:, 8:]))
    for layer in range(2):
        old = np.asarray(gather_pages(x[layer], jnp.asarray(table)))
        new = np.asarray(gather_pages(moved[layer], out.table))
        for row, src in enumerate([0, 0, 1, 1, 1]):
            held = 4 * int(np.sum(table[src] >= 0))
            np.testing.assert_array_equal(new[row, :, :held], old[src, :, :held])


def test_a_paged_state_reads_and_writes_its_pool():
    kind = lcx.CacheConfig(layout="paged", page_size=8).kind(lcx.ModelConfig(
        vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_position_embeddings=64))
    state = kind.create(2, 16)
    pool = state.pool
    assert pool.n_pages == 4 and pool.rows == 2 and int(pool.free()) == 4
    state = state.with_pool(page_pool.grant_upto(pool, jnp.asarray([1, 2])))
    np.testing.assert_array_equal(state.table, [[0, -1], [1, 2]])
    np.testing.assert_array_equal(state.refs, [1, 1, 1, 0])
    assert int(state.peak) == 3 and state.kv_bytes() == 3 * kind.page_nbytes()
