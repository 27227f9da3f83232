"""Serving many requests: continuous batching over a paged cache, chunked prefill between decode segments, prefix
pages kept across requests (and across restarts, with a ``PageStore``), eviction policies on pages, streaming.

    server = Server(config, params, max_num_seqs=8, max_len=4096)
    ids = [server.submit(prompt, max_new_tokens=64) for prompt in prompts]
    outputs = server.run(on_token=lambda request, token: ...)   # {request id: generated tokens}

The server holds ``max_num_seqs`` rows of one paged cache (``lcx.cache.paged``: a pool of ``pages`` pages of
``cache.page_size`` tokens). A request waits in a FIFO queue until a row is free and the pool can hold everything it
may write beyond the pages it shares - its prompt and ``max_new_tokens`` under the ``full`` policy, the slots its
policy plans (budget + interval) under an evicting one: admission is deferred, never an out-of-memory error, and a
request no empty pool could hold is refused at ``submit`` with the bytes it needs, the budget, and a policy that
would serve it.

One ``step`` (``run`` repeats it): admit what fits; run **one prefill chunk** (at most ``prefill_chunk`` tokens) of
every row still reading its prompt, as a batch of those rows only (the others' caches untouched); then decode every
row past its prompt ``segment`` steps. A long prompt thus arrives a chunk per step while the other streams go on:
their tokens wait for one chunk, not for the whole prompt. A row that emits EOS or its last token is released at once
(its pages back to the pool) and the next request takes it. Each request samples with its own settings and key
(``lcx.engine.sampling``): under the full policy its tokens equal ``lcx.generate`` of its prompt alone with the same
settings and seed (greedy by default). Under an evicting policy (the slot policies on pages,
``lcx.cache.paged_slots``) a row's prompt ends with the policy's end-of-prefill eviction, as in ``Generator`` -
KVzip's after its reconstruction passes (``reconstruction``: the repeat prompt) - a row evicts when its own slots
overflow, and from its compression on a row reserves only the pages it can still come to hold
(``lcx.engine.prompt_end``): a one-shot policy's freed pages admit more requests. The compiled functions are the
configuration's ``Programs``.

Cancellation: ``Server.cancel(request_id)`` (between steps, or from inside ``on_token``) drops a waiting request, or
ends a running one at once: its row and pages are released (its references gone, its committed pages back to
admission, the kept prefixes it reads one user less) and it streams no further token. An ``Exception`` raised by
``on_token`` cancels that request the same way (the others go on): ``run`` leaves it out of what it returns and
``Server.cancelled`` maps its id to the exception (to None for a ``cancel`` call).

Prefix pages (full policy): after its prefill, the whole pages of a request's prompt are kept (an extra reference)
keyed by their tokens; a later request whose prompt starts with the same whole pages (a shared system prompt) gets
them without prefilling them (a request that shares more with a prompt still being prefilled waits until its pages
are kept). Kept prefixes are released least recently used first when a request needs their pages, and at most
``prefix_entries`` are kept. With a ``store`` (``lcx.engine.kv_store.PageStore``) the whole pages of every prompt,
and of a finished request's prompt + answer, are also written to host memory (and disk); a request whose prompt
extends stored pages further than any kept prefix loads them into its own pages instead of prefilling them. Under an
evicting policy (not KVzip) the store keeps a finished request's compressed state instead, and a prompt that
continues it (the conversation's next turn) starts from it (``lcx.engine.store_io``).

Shape letters: b rows (``max_num_seqs``), T pages per row, S decode steps per segment.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from lcx.cache import paged
from lcx.cache.base import CacheCapacityError, round_chunk
from lcx.cache.config import CacheConfig
from lcx.config_base import ConfigError
from lcx.engine import rows, store_io
from lcx.engine.generator import Generator
from lcx.engine.prompt_end import compress_rows, pages_still_needed, pl2
from lcx.engine.sampling import RowSampling, SamplingConfig, request_key, sample_rows
from lcx.kernels.names import LOWBIT_DTYPES
from lcx.model.config import ModelConfig

SUGGESTED_POLICY = "streaming"  # what a refusal proposes: bounded pages for any prompt, no statistics to gather


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
    read: int = 0  # prompt tokens in its cache so far (shared, loaded or prefilled)
    cached: int = 0  # prompt tokens it did not prefill (a kept prefix's pages or the store's)
    stored: tuple | None = None  # (pages, arrays) the store gave it, until loaded
    ignore_eos: bool = False  # generate max_new_tokens whatever it samples (EOS included, as any token)

    @property
    def prefilling(self) -> bool:
        return self.read < self.prompt.size


@dataclasses.dataclass
class _Prefix:
    pages: list[int]
    users: int = 0  # running requests that read these pages


class Server:
    """Continuous batching over a paged cache; see the module docstring.

    ``max_len``: the most tokens (prompt + new) of one request; ``pages``: the pool size (default: every row at its
    largest, i.e. no admission ever waits for pages); ``segment``: decode steps per jitted call (rows admitted
    between segments); ``prefill_chunk``: prompt tokens per row and step; ``prefix_entries``: prefixes kept across
    requests (0: none; the full policy only); ``store``: a ``PageStore`` (prompt pages; compressed states under
    eviction); ``reconstruction``: KVzip's repeat prompt (one-shot: budget + interval >= ``max_len``).

    ``cancel(request_id)`` ends a request early (waiting or running; usable from inside ``on_token``); a request
    whose ``on_token`` raises an ``Exception`` is cancelled the same way. ``cancelled``: every cancelled request's id
    -> the exception its ``on_token`` raised, or None when ``cancel`` ended it (kept across ``run`` calls)."""

    def __init__(self, config: ModelConfig, params, *, max_num_seqs: int = 8, max_len: int = 4096,
                 pages: int | None = None, cache: CacheConfig | None = None, eos_id: int | None = None,
                 segment: int = 16, prefill_chunk: int = 256, prefix_entries: int = 4, store=None,
                 reconstruction=None):
        cache = cache or CacheConfig(layout="paged")
        if cache.layout != "paged":
            raise ConfigError(f"cache.layout={cache.layout!r} is invalid for Server: it batches over a paged cache; "
                              "allowed: 'paged'")
        for name, value in (("max_num_seqs", max_num_seqs), ("max_len", max_len), ("segment", segment),
                            ("prefill_chunk", prefill_chunk)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"Server {name}={value!r} is invalid: must be a positive integer")
        policy = cache.make_policy()
        self.evicts = policy.evicts
        if policy.observes.calibrates:
            raise ConfigError(f"cache.policy={cache.policy!r} is invalid for Server: it calibrates over a contiguous "
                              f"cache; allowed: {', '.join(server_policies())}")
        self.reconstruction = reconstruction if policy.observes.reconstructs else None
        if policy.observes.reconstructs and reconstruction is None:
            raise ConfigError(f"cache.policy={cache.policy!r} scores a prompt by asking the model to repeat it: pass "
                              "Server(reconstruction=...) (lcx.data.haystack.Frame(tokenizer, chat).reconstruction())")
        cache = CacheConfig(**(cache.to_dict() | {"prefill_chunk": prefill_chunk}))
        self.gen = Generator(config, params, max_new_tokens=1, cache=cache, eos_id=eos_id,
                             reconstruction=self.reconstruction)
        self.kind, self.config, self.eos_id = self.gen.kind, config, eos_id
        self.cache_config = cache
        self.page = self.kind.page
        self.max_len = max_len
        # a row's slots: every token under the full policy, the policy's plan (budget + interval) under eviction
        slots = self.kind.plan(1, max_len, 0) if self.evicts else max_len
        if self.reconstruction is not None and slots < max_len:  # it compresses a prompt once, having read it all
            raise ConfigError(f"cache.policy={cache.policy!r} with budget + interval = {slots} < max_len={max_len}: "
                              "it compresses a prompt once, after reading all of it; set cache.interval >= "
                              f"{max_len - (slots - cache.interval)} (max_len - budget)")
        self.row_pages = -(-slots // self.page)
        self.pages = max_num_seqs * self.row_pages if pages is None else pages
        if isinstance(self.pages, bool) or not isinstance(self.pages, int) or self.pages < 1:
            raise ConfigError(f"Server pages={self.pages!r} is invalid: must be a positive integer (a pool smaller "
                              f"than a request of max_len={max_len} refuses the requests it cannot hold)")
        self.rows, self.segment = max_num_seqs, segment
        self.chunk = self.kind.prefill_chunk(prefill_chunk, max_len, self.row_pages * self.page)
        # A bit-packed cache (int4 / int2) keeps a row's most recent tokens in its float window, beside its pages:
        # its pages alone are no prefix to keep or store.
        lowbit = cache.kv_dtype in LOWBIT_DTYPES
        if lowbit and store is not None:
            raise ConfigError(f"Server store= with cache.kv_dtype={cache.kv_dtype!r}: a bit-packed cache's pages "
                              "are not a prefix without the row's float window; allowed: store=None, or kv_dtype "
                              "'int8', 'fp8' or None")
        if store is not None and self.reconstruction is not None:
            raise ConfigError(f"Server store= with cache.policy={cache.policy!r}: its reconstruction passes score a "
                              "fresh prompt, not a stored compressed state; allowed: store=None")
        self.prefix_entries = 0 if self.evicts or lowbit else prefix_entries
        self.store = store
        self.state = paged.create(self.kind, self.rows, self.row_pages * self.page, self.pages)
        self._queue: collections.deque[_Request] = collections.deque()
        self._running: dict[int, _Request] = {}  # row -> request
        self._prefixes: collections.OrderedDict[tuple, _Prefix] = collections.OrderedDict()  # LRU order
        self._next_id = 0
        self.committed = 0  # pages the running requests may own
        self.cancelled: dict[int, Exception | None] = {}  # request id -> what its on_token raised (None: cancel)
        self.prefill_tokens = 0  # prompt tokens run through the model (shared prefixes not counted twice)
        self.cached_tokens = 0  # prompt tokens served from kept or stored pages
        self.programs = self.gen.programs
        self.sampling = RowSampling.build([SamplingConfig()] * self.rows, np.zeros((self.rows, 2), np.uint32))

    # ----------------------------------------------------------------------------------------------- requests
    def submit(self, prompt: Sequence[int], max_new_tokens: int, sampling: SamplingConfig | None = None,
               seed: int | None = None, *, ignore_eos: bool = False) -> int:
        """Queue a request; returns its id. Refused (``CacheCapacityError``) if it exceeds ``max_len`` or needs
        more pages than the whole pool. ``sampling``: its settings (default greedy); ``seed``: its random stream
        (default: its request id); ``ignore_eos``: EOS does not end it (``max_new_tokens`` are generated)."""
        prompt = np.asarray(prompt, np.int32)
        if prompt.ndim != 1 or prompt.size == 0:
            raise ConfigError("Server.submit: prompt must be a non-empty list of token ids")
        if np.any(prompt < 0) or np.any(prompt >= self.config.vocab_size):
            raise ConfigError(f"Server.submit: prompt token ids must lie in [0, {self.config.vocab_size})")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens={max_new_tokens!r} is invalid: must be a positive integer")
        self.check(prompt.size, max_new_tokens)
        if sampling is not None and not isinstance(sampling, SamplingConfig):
            raise ConfigError(f"Server.submit: sampling={sampling!r:.60} is invalid: must be a lcx.SamplingConfig")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ConfigError(f"Server.submit: seed={seed!r:.60} is invalid: must be an integer or None")
        request = _Request(self._next_id, prompt, max_new_tokens, sampling=sampling or SamplingConfig(),
                           key=request_key(self._next_id if seed is None else seed), ignore_eos=bool(ignore_eos))
        self._next_id += 1
        self._queue.append(request)
        return request.id

    def check(self, prompt: int, max_new_tokens: int) -> None:
        """A ``CacheCapacityError`` if a request of ``prompt`` + ``max_new_tokens`` tokens can never be served:
        past ``max_len``, or needing more pages than the whole pool (naming a policy that would serve it). Reads
        only the configuration: callable from any thread."""
        if prompt + max_new_tokens > self.max_len:
            raise CacheCapacityError(f"request of {prompt} prompt + {max_new_tokens} new tokens exceeds the "
                                     f"server's max_len={self.max_len}")
        need = self.pages_needed(prompt, max_new_tokens)
        if need > self.pages:
            raise CacheCapacityError(self._never_fits(prompt, max_new_tokens, need))

    def pages_needed(self, prompt: int, max_new_tokens: int) -> int:
        """Pages a request of ``prompt`` + ``max_new_tokens`` tokens may own, sharing nothing."""
        tokens = prompt + max_new_tokens
        if self.evicts:
            tokens = min(tokens, self.kind.plan(1, prompt, max_new_tokens))
        return -(-tokens // self.page)

    def _never_fits(self, prompt: int, new: int, need: int) -> str:
        nbytes = self.kind.page_nbytes()
        per_row = max(1, self.pages // self.rows) * self.page
        interval = self.cache_config.interval
        budget = max(self.page, (per_row - interval) // self.page * self.page)
        return (f"request of {prompt} prompt + {new} new tokens needs {need} pages of {self.page} tokens "
                f"({need * nbytes:,} bytes of KV cache); the server's KV budget is {self.pages} pages "
                f"({self.pages * nbytes:,} bytes) under cache policy {self.cache_config.policy!r}; a policy that "
                f"serves it in bounded pages: --cache-policy {SUGGESTED_POLICY} --cache-param budget={budget}")

    @property
    def busy(self) -> bool:
        """Requests wait or run."""
        return bool(self._queue or self._running)

    @property
    def waiting(self) -> int:
        return len(self._queue)

    @property
    def running(self) -> int:
        return len(self._running)

    def pages_used(self) -> int:
        """Pool pages held by a row or a kept prefix (a device read of the reference counts)."""
        return int(np.count_nonzero(np.asarray(self.state.refs)))

    def cached_of(self, request_id: int) -> int:
        """Prompt tokens request ``request_id`` (running) did not prefill; 0 if it is not running."""
        running = [r for r in self._running.values() if r.id == request_id]
        return running[0].cached if running else 0

    def run(self, on_token: Callable[[int, int], None] | None = None) -> dict[int, list[int]]:
        """Serve every queued request; ``on_token(request_id, token)`` as tokens are generated (streaming).
        Returns each finished request's generated tokens (EOS included when emitted); a request cancelled meanwhile
        (``cancel``, or its ``on_token`` raised) is left out and recorded in ``cancelled``."""
        done: dict[int, list[int]] = {}
        while self.busy:
            self.step(on_token, done)
        return done

    def step(self, on_token: Callable[[int, int], None] | None = None, done: dict | None = None) -> dict:
        """One round: admit, one prefill chunk of the rows reading their prompts, one decode segment of the others.
        Finished requests' tokens go into ``done`` (returned)."""
        done = {} if done is None else done
        emit = on_token or (lambda request, token: None)
        self._admit()
        if not self._running and self._queue:  # unreachable: submit refuses what an empty pool cannot hold
            raise CacheCapacityError(f"the pool of {self.pages} pages cannot hold the next request")
        if any(r.prefilling for r in self._running.values()):
            self._prefill_chunk(emit, done)
        if any(not r.prefilling for r in self._running.values()):
            self._decode_rows(emit, done)
        return done

    def cancel(self, request_id: int) -> bool:
        """End request ``request_id`` now: dropped from the queue, or (running) its row and pages released at once
        (its committed pages back to admission, the kept prefixes it reads one user less); it streams no further
        token and ``run`` does not return it. Usable between steps and from inside ``on_token``. Records
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
            reading = [r for r in self._running.values() if r.prefilling and self.prefix_entries]
            if any(self._common_pages(request.prompt, other.prompt) > shared for other in reading):
                break  # it shares more with a prompt still being read: wait, then read that prompt's kept pages
            stored = self._stored(request, shared)
            if stored > shared:  # the store holds more of it than any kept prefix: load, share nothing
                key, shared = None, 0
            else:
                stored = 0
            if key is not None:
                key = self._narrow(key, shared)
            private = self.pages_needed(request.prompt.size, request.max_new_tokens) - shared
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
            self.state = rows.assign(self.state, jnp.int32(row), jnp.asarray(table), jnp.int32(shared * self.page))
            if stored:
                self._load(request)
            request.read = request.cached = stored if self.evicts else max(shared, stored) * self.page
            self.cached_tokens += request.cached
            one = RowSampling.build([request.sampling], request.key[None])
            self.sampling = jax.tree.map(lambda all_, x: rows.set_row(all_, row, x[0]), self.sampling, one)
            self._running[row] = request
            admitted.append(request)
        return admitted

    def _stored(self, request: _Request, shared: int) -> int:
        """Leading pages of ``request``'s prompt the store can give (read and checked once, kept on the request
        while it waits), when that is more than the ``shared`` pages of a kept prefix; else 0."""
        if self.store is None:
            return 0
        if request.stored is None and self.evicts:  # the compressed state its prompt continues, if one is kept
            request.stored = store_io.continued(self.store, self.state, request.prompt)
        if request.stored is None:
            n = self.store.match(request.prompt[:(request.prompt.size - 1) // self.page * self.page])
            # reading checks each file and its layout (the pool's: another failed the step, for every row): a bad
            # one ends the run there (and may leave fewer pages than a kept prefix)
            layout = rows.page_layout(self.state)
            request.stored = self.store.get(request.prompt[:n * self.page], layout) if n > shared else (0, None)
        return request.stored[0]

    def _load(self, request: _Request) -> None:
        """Row ``request.row`` (empty) gets fresh pages holding the store's pages of its prompt (full cache), or the
        compressed state its prompt continues (evicting policy)."""
        n, arrays = request.stored
        request.stored = None
        if self.evicts:
            self.state = store_io.restore(self.state, request.row, arrays)
        else:
            self.state = store_io.load_pages(self.state, request.row, n, arrays)

    def _narrow(self, key: tuple, shared: int) -> tuple:
        """The kept prefix of the first ``shared`` pages of ``key``'s, as an entry of its own when shorter (one more
        reference to those pages): a request pins only the pages it reads, and the longer entry stays free to go."""
        if shared == len(self._prefixes[key].pages):
            return key
        short = key[:shared * self.page]
        if short not in self._prefixes:
            pages = self._prefixes[key].pages[:shared]
            self.state = rows.hold(self.state, rows.padded(pages), jnp.int32(1))
            self._prefixes[short] = _Prefix(pages)
        return short

    def _drop_lru(self, keep) -> bool:
        """Release the least recently used kept prefix no running request reads (not ``keep``); False if none. Its
        pages spill to the store first (host memory; they may serve a later request) and go back whatever it does."""
        for key, prefix in self._prefixes.items():
            if prefix.users == 0 and key != keep:
                try:
                    self._store_pages(np.asarray(key, np.int32), prefix.pages)
                finally:
                    self.state = rows.hold(self.state, rows.padded(prefix.pages), jnp.int32(-1))
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
        self.state = rows.hold(self.state, rows.padded(pages), jnp.int32(1))
        # the pages are no longer the request's alone: the kept prefix owns them from now on (the prefix it read is
        # exactly its shared pages: _narrow)
        shared_before = 0 if request.prefix is None else min(len(request.prefix) // self.page, n_pages)
        moved = n_pages - shared_before
        request.private -= moved
        self.committed -= moved
        self._prefixes[key] = _Prefix(pages, users=1)  # its maker reads it: kept until the maker ends
        request.uses.append(key)
        while len(self._prefixes) > self.prefix_entries and self._drop_lru(keep=key):
            pass

    def _store_pages(self, tokens: np.ndarray, pages) -> None:
        """Write the whole pages of ``tokens``, held in the pool pages ``pages`` (in order), that the store lacks."""
        if self.store is not None and not self.evicts:
            store_io.store_pages(self.state, self.store, tokens, pages)

    def _row_pages(self, request: _Request) -> np.ndarray:
        return np.asarray(self.state.table[request.row])

    # ----------------------------------------------------------------------------------------------- steps
    def _prefill_chunk(self, emit, done) -> None:
        """One chunk of every row still reading its prompt, as a batch of those rows only: the pool is shared, so a
        sub-batch is their rows of every per-row buffer (padded to a power of two with empty rows), written back
        after. A row whose prompt ends in this chunk gets its first token (and, under eviction, the policy's
        end-of-prefill eviction)."""
        reading = [r for r in self._running.values() if r.prefilling]
        row_ids = [r.row for r in reading]
        batch = min(self.rows, pl2(len(row_ids)))
        index = jnp.asarray(row_ids + [self.rows] * (batch - len(row_ids)), jnp.int32)  # out of range: an empty row
        rest = [r.prompt.size - r.read for r in reading]
        chunk = min(self.chunk, round_chunk(max(rest)))  # a few compiled widths, not always the largest
        ids = np.zeros((batch, chunk), np.int32)
        ok = np.zeros((batch, chunk), bool)
        last_index = np.full(batch, -1, np.int32)
        weights = None
        for i, r in enumerate(reading):
            n = min(chunk, r.prompt.size - r.read)
            ids[i, :n], ok[i, :n] = r.prompt[r.read:r.read + n], True
            if r.read + n == r.prompt.size:
                last_index[i] = n - 1
            w = self.kind.prefill_weights(np.asarray([r.prompt.size]), r.prompt.size)
            if w is not None:
                weights = np.zeros((batch, chunk), np.float32) if weights is None else weights
                weights[i, :n] = w[0, r.read:r.read + n]
        sub = rows.gather(self.state, index)
        logits = jnp.zeros((batch, self.config.vocab_size), jnp.float32)
        width = self._width(max(r.read + chunk for r in reading))
        narrow, wide = self._narrowed(sub, width)
        narrow, logits = self.programs.prefill_chunk(self.gen.params, narrow, jnp.asarray(ids), jnp.asarray(ok),
                                                     jnp.asarray(last_index), logits,
                                                     None if weights is None else jnp.asarray(weights))
        sub = self.kind.sync(_widened(narrow, wide))
        ending = [i for i in range(len(reading)) if last_index[i] >= 0]
        if self.evicts and ending:  # the policy's end-of-prefill eviction, for the rows whose prompt ended only
            sub = compress_rows(self.kind, self.programs, self.gen.params, sub, ending,
                                [reading[i].prompt for i in ending], self.reconstruction)
        self.state = rows.scatter(rows.rows_of(self.state), sub, index, len(row_ids))
        for i, r in enumerate(reading):
            r.read += int(ok[i].sum())
            self.prefill_tokens += int(ok[i].sum())
        if not ending:
            return
        picked = jnp.asarray([reading[i].row for i in ending], jnp.int32)
        first = np.asarray(_first_tokens(logits[jnp.asarray(ending)],
                                         jax.tree.map(lambda x: jnp.asarray(x)[picked], self.sampling)))
        for j, i in enumerate(ending):
            request = reading[i]
            if self._running.get(request.row) is not request:
                continue  # cancelled from an earlier request's on_token
            if self.evicts:  # compressed: reserved from now on only what it can still come to hold
                need = pages_still_needed(self._row_pages(request), request.max_new_tokens, self.page, self.row_pages)
                self.committed -= request.private - min(need, request.private)
                request.private = min(need, request.private)
            self._keep_prefix(request)
            if self.store is not None and self.store.directory is not None:  # on disk now: a kill -9 keeps them
                self._store_pages(request.prompt[:request.prompt.size - 1], self._row_pages(request))
            self._emit(request, int(first[j]), emit, done)

    def _width(self, tokens: int) -> int:
        """Table entries a call reads for rows of at most ``tokens`` tokens: the pages rounded up to a power of two
        under the full policy - attention gathers and masks every entry, so a row of 1k tokens in a server of
        max_len 16k would read 16x what it holds - and the whole table under eviction (its slots are the table)."""
        if self.evicts:
            return self.row_pages
        # a power of two: at most 2x what the rows hold, and one compiled width per octave - finer widths
        # (round_chunk's quarters) compiled ~4x as many programs, 124 while one 16k prompt arrived among 8 streams
        return min(self.row_pages, pl2(-(-tokens // self.page)))

    def _narrowed(self, state, width: int):
        """``(state with its table cut to width entries, the whole table)``; the whole state when no cut."""
        if width >= self.row_pages:
            return state, None
        return state.replace(table=state.table[:, :width]), state.table

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
        if (token == self.eos_id and not request.ignore_eos) or len(request.tokens) >= request.max_new_tokens:
            self._finish(request, done)

    def _finish(self, request: _Request, done) -> None:
        # what the row holds (the prompt and every token but the last, never fed back): a conversation's next turn
        # resent with this answer in its history reads these pages
        if self.store is not None:
            held = np.concatenate([request.prompt, np.asarray(request.tokens[:-1], np.int32)])
            if self.evicts:  # the compressed state: the conversation's next turn continues it
                self.store.put_state(held, store_io.snapshot(self.state, request.row))
            else:
                self._store_pages(held, self._row_pages(request))
        self._end(request)
        done[request.id] = request.tokens

    def _end(self, request: _Request) -> None:
        """``request`` leaves its row: its pages lose its references, its committed pages return to admission and
        the kept prefixes it reads have one user less."""
        self.state = rows.release(self.state, jnp.int32(request.row))
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
        eos_stops = np.ones(self.rows, bool)
        for row, request in self._running.items():
            if request.prefilling:
                continue
            token[row], active[row] = request.tokens[-1], True
            left[row] = request.max_new_tokens - len(request.tokens)
            steps[row] = len(request.tokens)
            eos_stops[row] = not request.ignore_eos
        held = max(r.prompt.size + len(r.tokens) for r in self._running.values() if not r.prefilling)
        narrow, wide = self._narrowed(self.state, self._width(held + self.segment))
        narrow, tokens, emitted = self.programs.serve_segment(
            self.gen.params, narrow, jnp.asarray(token), jnp.asarray(active), jnp.asarray(left), jnp.asarray(eos_stops),
            jax.tree.map(jnp.asarray, self.sampling), jnp.asarray(steps), n_steps=self.segment,
            sampled=bool(np.any(self.sampling.temperature[active] > 0)))  # all greedy: the argmax-only program
        self.state = self.kind.sync(_widened(narrow, wide))
        tokens, emitted = np.asarray(tokens), np.asarray(emitted)  # [S, b]
        for step in range(tokens.shape[0]):
            for row in np.flatnonzero(emitted[step]):
                request = self._running.get(int(row))
                if request is not None and not request.prefilling:
                    self._emit(request, int(tokens[step, row]), emit, done)


def server_policies() -> list[str]:
    """The cache policies a ``Server`` runs: those of the paged slot cache that need no calibration."""
    from lcx.cache.policy import registered_where

    return registered_where(lambda p: p.cache_type == "slots" and not p.observes.calibrates)


# --------------------------------------------------------------------------------------------------- jitted
_first_tokens = jax.jit(lambda logits, rows: sample_rows(logits, rows, jnp.zeros_like(rows.top_k)))


def _widened(state, wide):
    """``state`` (its table cut by ``Server._narrowed``) with the entries past the cut from ``wide`` (None: uncut).
    Rows hold no page past the cut that the call could have changed: it granted only within it."""
    if wide is None:
        return state
    return state.replace(table=wide.at[:, :state.table.shape[1]].set(state.table))


__all__ = ["Server", "server_policies"]
