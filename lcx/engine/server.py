"""Serving many requests: continuous batching over a paged cache, prefix pages kept across requests, streaming.

    server = Server(config, params, max_num_seqs=8, max_len=4096)
    ids = [server.submit(prompt, max_new_tokens=64) for prompt in prompts]
    outputs = server.run(on_token=lambda request, token: ...)   # {request id: generated tokens}

The server holds ``max_num_seqs`` rows of one paged cache (``lcx.cache.paged``: a pool of ``pages`` pages of
``cache.page_size`` tokens). A request waits in a FIFO queue until a row is free and the pool can hold everything it
may write (its prompt and ``max_new_tokens``, beyond the pages it shares): admission is refused or deferred, never
an out-of-memory error, and a request no empty pool could hold is refused at ``submit``. Between jitted calls the
host admits requests, prefills the admitted rows' prompts together (the other rows' caches untouched: their tokens
are masked out), then decodes every active row ``segment`` steps at a time; a row that emits EOS or its last token is
released at once (its pages back to the pool) and the next request takes it. Each request samples with its own
settings and key (``lcx.engine.sampling``): its tokens equal ``lcx.generate`` of its prompt alone with the same
settings and seed (greedy by default). The compiled functions are the configuration's ``Programs``, shared with
``Generator``.

Cancellation: ``Server.cancel(request_id)`` (between ``run`` calls, or from inside ``on_token``) drops a waiting
request, or ends a running one at once: its row and pages are released (its references gone, its committed pages
back to admission, the kept prefixes it reads one user less) and it streams no further token. An ``Exception`` raised
by ``on_token`` cancels that request the same way (the others go on): ``run`` leaves it out of what it returns and
``Server.cancelled`` maps its id to the exception (to None for a ``cancel`` call).

Prefix pages: after its prefill, the whole pages of a request's prompt are kept (an extra reference) keyed by their
tokens; a later request whose prompt starts with the same whole pages (a shared system prompt) gets them without
prefilling them (a request that shares more with a prompt admitted in the same round waits one round for its
pages). Kept prefixes are released least recently used first when a request needs their pages, and at most
``prefix_entries`` are kept.

Shape letters: b rows (``max_num_seqs``), T pages per row, S decode steps per segment.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from lcx.cache import page_pool, paged
from lcx.cache.base import CacheCapacityError, round_chunk
from lcx.cache.config import CacheConfig
from lcx.cache.paged import PagedCache
from lcx.config_base import ConfigError
from lcx.engine.generator import Generator
from lcx.engine.sampling import RowSampling, SamplingConfig, request_key, sample_rows
from lcx.model.config import ModelConfig


@dataclasses.dataclass
class _Request:
    id: int
    prompt: np.ndarray
    max_new_tokens: int
    tokens: list[int] = dataclasses.field(default_factory=list)
    row: int | None = None
    private: int = 0  # pages this request may own (not shared), counted against the pool while it runs
    prefix: tuple | None = None  # the kept prefix it reads (key), if any
    uses: list = dataclasses.field(default_factory=list)  # kept prefixes that must outlive it (read or made)
    sampling: SamplingConfig = SamplingConfig()
    key: np.ndarray | None = None  # its random stream's key (uint32 [2])


@dataclasses.dataclass
class _Prefix:
    pages: list[int]
    users: int = 0  # running requests that read these pages


class Server:
    """Continuous batching over a paged cache; see the module docstring.

    ``max_len``: the most tokens (prompt + new) of one request; ``pages``: the pool size (default: every row at
    ``max_len``, i.e. no admission ever waits for pages); ``segment``: decode steps per jitted call (rows admitted
    between segments); ``prefill_chunk``: prompt tokens per prefill call; ``prefix_entries``: prefixes kept across
    requests (0: none).

    ``cancel(request_id)`` ends a request early (waiting or running; usable from inside ``on_token``); a request
    whose ``on_token`` raises an ``Exception`` is cancelled the same way. ``cancelled``: every cancelled request's id
    -> the exception its ``on_token`` raised, or None when ``cancel`` ended it (kept across ``run`` calls)."""

    def __init__(self, config: ModelConfig, params, *, max_num_seqs: int = 8, max_len: int = 4096,
                 pages: int | None = None, cache: CacheConfig | None = None, eos_id: int | None = None,
                 segment: int = 16, prefill_chunk: int = 256, prefix_entries: int = 4):
        cache = cache or CacheConfig(layout="paged")
        if cache.layout != "paged":
            raise ConfigError(f"cache.layout={cache.layout!r} is invalid for Server: it batches over a paged cache; "
                              "allowed: 'paged'")
        for name, value in (("max_num_seqs", max_num_seqs), ("max_len", max_len), ("segment", segment),
                            ("prefill_chunk", prefill_chunk)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"Server {name}={value!r} is invalid: must be a positive integer")
        if cache.make_policy().evicts:
            raise ConfigError(f"cache.policy={cache.policy!r} is invalid for Server: it serves a cache that keeps "
                              "every token; allowed: 'full' (eviction on pages runs through Generator)")
        cache = CacheConfig(**(cache.to_dict() | {"prefill_chunk": prefill_chunk}))
        self.gen = Generator(config, params, max_new_tokens=1, cache=cache, eos_id=eos_id)
        self.kind, self.config, self.eos_id = self.gen.kind, config, eos_id
        self.page = self.kind.page
        self.row_pages = -(-max_len // self.page)
        self.pages = pages or max_num_seqs * self.row_pages
        if self.pages < self.row_pages:
            raise ConfigError(f"Server pages={self.pages} is invalid: one request of max_len={max_len} needs "
                              f"{self.row_pages} pages of {self.page} tokens")
        self.rows, self.segment, self.chunk = max_num_seqs, segment, prefill_chunk
        self.prefix_entries = prefix_entries
        self.state = self._empty()
        self._queue: collections.deque[_Request] = collections.deque()
        self._running: dict[int, _Request] = {}  # row -> request
        self._prefixes: collections.OrderedDict[tuple, _Prefix] = collections.OrderedDict()  # LRU order
        self._next_id = 0
        self.committed = 0  # pages the running requests may own
        self.cancelled: dict[int, Exception | None] = {}  # request id -> what its on_token raised (None: cancel)
        self.prefill_tokens = 0  # prompt tokens run through the model (shared prefixes not counted twice)
        self.programs = self.gen.programs
        self.sampling = RowSampling.build([SamplingConfig()] * self.rows, np.zeros((self.rows, 2), np.uint32))

    def _empty(self) -> PagedCache:
        return paged.create(self.kind, self.rows, self.row_pages * self.page, self.pages)

    # ----------------------------------------------------------------------------------------------- requests
    def submit(self, prompt: Sequence[int], max_new_tokens: int, sampling: SamplingConfig | None = None,
               seed: int | None = None) -> int:
        """Queue a request; returns its id. Refused (``CacheCapacityError``) if it exceeds ``max_len``.
        ``sampling``: its settings (default greedy); ``seed``: its random stream (default: its request id)."""
        prompt = np.asarray(prompt, np.int32)
        if prompt.ndim != 1 or prompt.size == 0:
            raise ConfigError("Server.submit: prompt must be a non-empty list of token ids")
        if np.any(prompt < 0) or np.any(prompt >= self.config.vocab_size):
            raise ConfigError(f"Server.submit: prompt token ids must lie in [0, {self.config.vocab_size})")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens={max_new_tokens!r} is invalid: must be a positive integer")
        if prompt.size + max_new_tokens > self.row_pages * self.page:
            raise CacheCapacityError(f"request of {prompt.size} prompt + {max_new_tokens} new tokens exceeds the "
                                     f"server's max_len={self.row_pages * self.page}")
        if sampling is not None and not isinstance(sampling, SamplingConfig):
            raise ConfigError(f"Server.submit: sampling={sampling!r:.60} is invalid: must be a lcx.SamplingConfig")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ConfigError(f"Server.submit: seed={seed!r:.60} is invalid: must be an integer or None")
        request = _Request(self._next_id, prompt, max_new_tokens, sampling=sampling or SamplingConfig(),
                           key=request_key(self._next_id if seed is None else seed))
        self._next_id += 1
        self._queue.append(request)
        return request.id

    def run(self, on_token: Callable[[int, int], None] | None = None) -> dict[int, list[int]]:
        """Serve every queued request; ``on_token(request_id, token)`` as tokens are generated (streaming).
        Returns each finished request's generated tokens (EOS included when emitted); a request cancelled meanwhile
        (``cancel``, or its ``on_token`` raised) is left out and recorded in ``cancelled``."""
        done: dict[int, list[int]] = {}
        emit = on_token or (lambda request, token: None)
        while self._queue or self._running:
            admitted = self._admit()
            if not admitted and not self._running:  # unreachable: submit refuses what an empty pool cannot hold
                raise CacheCapacityError(f"the pool of {self.pages} pages cannot hold the next request")
            if admitted:
                self._prefill(admitted, emit, done)
            if self._running:
                self._decode_rows(emit, done)
        return done

    def cancel(self, request_id: int) -> bool:
        """End request ``request_id`` now: dropped from the queue, or (running) its row and pages released at once
        (its committed pages back to admission, the kept prefixes it reads one user less); it streams no further
        token and ``run`` does not return it. Usable between ``run`` calls and from inside ``on_token``. Records
        ``cancelled[request_id] = None``; returns False (and records nothing) if it had already finished or been
        cancelled."""
        if (isinstance(request_id, bool) or not isinstance(request_id, (int, np.integer))
                or not 0 <= request_id < self._next_id):
            raise ConfigError(f"Server.cancel: request_id={request_id!r:.60} is invalid: must be an id submit "
                              f"returned (0 .. {self._next_id - 1})")
        if not self._cancel(int(request_id)):
            return False
        self.cancelled[int(request_id)] = None
        return True

    def _cancel(self, request_id: int) -> bool:
        """Drop the waiting request ``request_id`` or end the running one; False if it is neither."""
        waiting = [r for r in self._queue if r.id == request_id]
        if waiting:
            self._queue.remove(waiting[0])
            return True
        running = [r for r in self._running.values() if r.id == request_id]
        if running:
            self._end(running[0])
        return bool(running)

    # ----------------------------------------------------------------------------------------------- admission
    def _shared(self, prompt: np.ndarray) -> tuple[tuple | None, int]:
        """The kept prefix sharing the most whole pages with ``prompt`` (leaving it one token): ``(key, pages)``."""
        best, best_pages = None, 0
        for key in self._prefixes:
            pages = self._common_pages(prompt, np.asarray(key, np.int32))
            if pages > best_pages:
                best, best_pages = key, pages
        return best, best_pages

    def _common_pages(self, prompt: np.ndarray, other: np.ndarray) -> int:
        """Whole pages ``prompt`` shares with ``other`` (leaving ``prompt`` one token of its own)."""
        n = min(prompt.size - 1, other.size)
        same = prompt[:n] == other[:n]
        return (n if same.all() else int(np.argmin(same))) // self.page

    def _free_pages(self) -> int:
        kept = len(set().union(*(p.pages for p in self._prefixes.values())))  # entries overlap on shared pages
        return self.pages - kept - self.committed

    def _admit(self) -> list[_Request]:
        admitted = []
        free_rows = [r for r in range(self.rows) if r not in self._running]
        while self._queue and free_rows:
            request = self._queue[0]
            key, shared = self._shared(request.prompt)
            if any(self._common_pages(request.prompt, other.prompt) > shared for other in admitted):
                break  # it shares more with a prompt of this round: wait one round and read that prompt's pages
            private = -(-(request.prompt.size + request.max_new_tokens) // self.page) - shared
            while private > self._free_pages() and self._drop_lru(keep=key):
                pass
            if private > self._free_pages():
                break  # waits for running requests to finish
            self._queue.popleft()
            row = free_rows.pop(0)
            pages = self._prefixes[key].pages[:shared] if key is not None else []
            if key is not None:
                self._prefixes.move_to_end(key)
                self._prefixes[key].users += 1
            request.row, request.private, request.prefix = row, private, key
            request.uses = [] if key is None else [key]
            self.committed += private
            table = np.full(self.row_pages, -1, np.int32)
            table[:shared] = pages
            self.state = _assign(self.state, jnp.int32(row), jnp.asarray(table), jnp.int32(shared * self.page))
            one = RowSampling.build([request.sampling], request.key[None])
            self.sampling = jax.tree.map(lambda all_, x: _set_row(all_, row, x[0]),
                                         self.sampling, one)
            self._running[row] = request
            admitted.append(request)
        return admitted

    def _drop_lru(self, keep) -> bool:
        """Release the least recently used kept prefix no running request reads (not ``keep``); False if none."""
        for key, prefix in self._prefixes.items():
            if prefix.users == 0 and key != keep:
                self.state = _hold(self.state, jnp.asarray(prefix.pages, jnp.int32), jnp.int32(-1))
                del self._prefixes[key]
                return True
        return False

    def _keep_prefix(self, request: _Request) -> None:
        """Keep the whole pages of ``request``'s prompt for later requests (one more reference each)."""
        n_pages = (request.prompt.size - 1) // self.page
        key = tuple(int(t) for t in request.prompt[:n_pages * self.page])
        if self.prefix_entries == 0 or n_pages == 0 or any(k[:len(key)] == key for k in self._prefixes):
            return
        table = np.asarray(self.state.table[request.row])
        pages = [int(p) for p in table[:n_pages]]
        self.state = _hold(self.state, jnp.asarray(pages, jnp.int32), jnp.int32(1))
        # the pages are no longer the request's alone: the kept prefix owns them from now on
        shared_before = 0 if request.prefix is None else min(len(request.prefix) // self.page, n_pages)
        moved = n_pages - shared_before
        request.private -= moved
        self.committed -= moved
        self._prefixes[key] = _Prefix(pages, users=1)  # its maker reads it: kept until the maker ends
        request.uses.append(key)
        while len(self._prefixes) > self.prefix_entries and self._drop_lru(keep=key):
            pass

    # ----------------------------------------------------------------------------------------------- steps
    def _prefill(self, admitted: list[_Request], emit, done) -> None:
        """Prefill the admitted rows' prompts (past their shared pages) as a batch of those rows only: the pool is
        shared, so a sub-batch is their table rows and lengths (padded to a power of two with rows whose tokens are
        all masked), written back after."""
        rows = [r.row for r in admitted]
        batch = min(self.rows, pl2(len(rows)))
        idle = [r for r in range(self.rows) if r not in self._running]
        pad = (idle + rows * batch)[:batch - len(rows)]  # rows that take no token: idle ones first
        index = jnp.asarray(rows + pad, jnp.int32)
        starts = np.asarray(self.state.lengths)[rows]
        rest = [r.prompt[start:] for r, start in zip(admitted, starts)]
        longest = max(x.size for x in rest)
        chunk = min(self.chunk, round_chunk(longest))  # a few compiled widths, not always the largest
        width = -(-longest // chunk) * chunk
        ids = np.zeros((batch, width), np.int32)
        lengths = np.zeros(batch, np.int64)
        for i, x in enumerate(rest):
            ids[i, :x.size] = x
            lengths[i] = x.size
            self.prefill_tokens += x.size
        ok = np.arange(width)[None, :] < lengths[:, None]
        logits = jnp.zeros((batch, self.config.vocab_size), jnp.float32)
        full = self.state
        cache = full.replace(table=full.table[index], lengths=full.lengths[index])
        for lo in range(0, width, chunk):
            last = lengths - 1 - lo
            last_index = np.where((lengths > 0) & (last >= 0) & (last < chunk), last, -1).astype(np.int32)
            cache, logits = self.programs.prefill_chunk(self.gen.params, cache, jnp.asarray(ids[:, lo:lo + chunk]),
                                                        jnp.asarray(ok[:, lo:lo + chunk]), jnp.asarray(last_index),
                                                        logits, None)
            cache = self.kind.sync(cache)
        n = len(rows)
        self.state = cache.replace(table=full.table.at[index[:n]].set(cache.table[:n]),
                                   lengths=full.lengths.at[index[:n]].set(cache.lengths[:n]))
        rows_sampling = jax.tree.map(lambda x: x[np.asarray(index)], self.sampling)
        first = np.asarray(_first_tokens(logits, rows_sampling))  # each request's token 0
        for i, request in enumerate(admitted):
            if self._running.get(request.row) is not request:
                continue  # cancelled from an earlier request's on_token
            self._keep_prefix(request)
            self._emit(request, int(first[i]), emit, done)

    def _emit(self, request: _Request, token: int, emit, done) -> None:
        request.tokens.append(token)
        try:
            emit(request.id, token)
        except Exception as error:  # the caller's callback failed: its request ends here, the others go on
            self._cancel(request.id)  # nothing more to free if the callback had cancelled it first
            self.cancelled[request.id] = error
            return
        if self._running.get(request.row) is not request:
            return  # the callback cancelled it (Server.cancel)
        if token == self.eos_id or len(request.tokens) >= request.max_new_tokens:
            self._finish(request, done)

    def _finish(self, request: _Request, done) -> None:
        self._end(request)
        done[request.id] = request.tokens

    def _end(self, request: _Request) -> None:
        """``request`` leaves its row: its pages lose its references, its committed pages return to admission and
        the kept prefixes it reads have one user less."""
        self.state = _release(self.state, jnp.int32(request.row))
        self.committed -= request.private
        for key in request.uses:
            if key in self._prefixes:
                self._prefixes[key].users -= 1
        del self._running[request.row]

    def _decode_rows(self, emit, done) -> None:
        token = np.zeros(self.rows, np.int32)
        active = np.zeros(self.rows, bool)
        left = np.zeros(self.rows, np.int32)
        steps = np.zeros(self.rows, np.int32)
        for row, request in self._running.items():
            token[row], active[row] = request.tokens[-1], True
            left[row] = request.max_new_tokens - len(request.tokens)
            steps[row] = len(request.tokens)
        self.state, tokens, emitted = self.programs.serve_segment(
            self.gen.params, self.state, jnp.asarray(token), jnp.asarray(active), jnp.asarray(left),
            jax.tree.map(jnp.asarray, self.sampling), jnp.asarray(steps), n_steps=self.segment,
            sampled=bool(np.any(self.sampling.temperature[active] > 0)))  # all greedy: the argmax-only program
        self.state = self.kind.sync(self.state)
        tokens, emitted = np.asarray(tokens), np.asarray(emitted)  # [S, b]
        for step in range(tokens.shape[0]):
            for row in np.flatnonzero(emitted[step]):
                request = self._running.get(int(row))
                if request is not None:
                    self._emit(request, int(tokens[step, row]), emit, done)


def pl2(n: int) -> int:
    """The power of two at or above ``n`` (the sub-batch sizes a prefill compiles for)."""
    return 1 << max(n - 1, 0).bit_length()


# --------------------------------------------------------------------------------------------------- jitted
_first_tokens = jax.jit(lambda logits, rows: sample_rows(logits, rows, jnp.zeros_like(rows.top_k)))


def _set_row(values: np.ndarray, row: int, value) -> np.ndarray:
    values = values.copy()
    values[row] = value
    return values


@functools.partial(jax.jit, donate_argnums=(0,))
def _assign(state: PagedCache, row, table, length) -> PagedCache:
    """Row ``row`` starts with the pages ``table [T]`` (-1: none) holding ``length`` tokens."""
    state = state.with_pool(page_pool.assign(state.pool, row, table))
    return state.replace(lengths=state.lengths.at[row].set(length))


@functools.partial(jax.jit, donate_argnums=(0,))
def _release(state: PagedCache, row) -> PagedCache:
    """Row ``row`` ends: its pages lose a reference, the row is empty."""
    state = state.with_pool(page_pool.release(state.pool, row))
    return state.replace(lengths=state.lengths.at[row].set(0))


@functools.partial(jax.jit, donate_argnums=(0,))
def _hold(state: PagedCache, pages, delta) -> PagedCache:
    """``delta`` more references to ``pages`` (a kept prefix taking or releasing them)."""
    return state.with_pool(page_pool.hold(state.pool, pages, delta))


__all__ = ["Server"]
