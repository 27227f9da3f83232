"""Serving many requests: continuous batching over a paged cache, chunked prefill between decode segments, prefix
pages kept across requests (and across restarts, with a ``PageStore``), eviction policies on pages, streaming.

    server = Server(config, params, max_num_seqs=8, max_len=4096)
    ids = [server.submit(prompt, max_new_tokens=64) for prompt in prompts]
    outputs = server.run(on_token=lambda request, token: ...)   # {request id: generated tokens}

``Server`` composes three parts over ``max_num_seqs`` rows of one paged cache (``lcx.cache.paged``: a pool of
``pages`` pages of ``cache.page_size`` tokens), all read from one resolved ``ServeSetup`` (``lcx.engine.setup``):

- ``Scheduler`` (``lcx.engine.scheduler``): the queue, admission by the page budget, reservations, cancellation;
- ``PrefixCache`` (``lcx.engine.prefix_cache``): kept prompt pages under one chained-hash index, and the store;
- ``Runner`` (``lcx.engine.runner``, ``build``): the model's compiled programs over the rows (as ``Generator``).

One ``step`` (``run`` repeats it): admit what fits; run **one prefill chunk** (at most ``prefill_chunk`` tokens) of
every row still reading its prompt, as a batch of those rows only; then decode every row past its prompt
``segment`` steps. A long prompt thus arrives a chunk per step while the other streams go on. A row that emits EOS
or its last token is released at once and the next request takes it. Each request samples with its own settings and
key (``lcx.engine.sampling``): under the full policy its tokens equal ``lcx.generate`` of its prompt alone with the
same settings and seed (greedy by default). Under an evicting policy (``lcx.cache.paged_slots``) a row's prompt ends
with the policy's end-of-prefill eviction - KVzip's after its reconstruction passes (``reconstruction``: the repeat
prompt) - and from then on it reserves only the pages it can still come to hold (``lcx.engine.prompt_end``).

Cancellation: ``Server.cancel(request_id)`` (between steps, or from inside ``on_token``) drops a waiting request, or
ends a running one at once (its row and pages released; it streams no further token). An ``Exception`` raised by
``on_token`` cancels that request the same way (the others go on): ``run`` leaves it out of what it returns and
``Server.cancelled`` maps its id to the exception (to None for a ``cancel`` call).

Prefix pages (full policy): after its prefill, the whole pages of a request's prompt are kept; a later request whose
prompt starts with the same whole pages gets them without prefilling them. With a ``store`` the whole pages of every
prompt, and of a finished request's prompt + answer, also go to host memory (and disk); a prompt that extends stored
pages further than any kept prefix loads them. Under an evicting policy (not KVzip) the store keeps a finished
request's compressed state instead, and a prompt that continues it starts from it (``lcx.engine.store_io``). A
request's ``salt`` (a tenant's) keys its pages apart: kept and stored pages are shared only within one salt.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import numpy as np

from lcx.cache import paged
from lcx.cache.base import CacheCapacityError
from lcx.cache.config import CacheConfig
from lcx.engine import rows
from lcx.engine import setup as setup_
from lcx.engine.prefix_cache import PrefixCache
from lcx.engine.runner import build
from lcx.engine.sampling import RowSampling, SamplingConfig
from lcx.engine.scheduler import Request, Scheduler
from lcx.engine.setup import ServeSetup, resolve, server_policies
from lcx.model.config import ModelConfig
from lcx.parallel import sharding


class Server:
    """Continuous batching over a paged cache; see the module docstring.

    ``max_len``: the most tokens (prompt + new) of one request; ``pages``: the pool size (default: every row at its
    largest, i.e. no admission ever waits for pages); ``segment``: decode steps per jitted call (rows admitted
    between segments); ``prefill_chunk``: prompt tokens per row and step; ``prefix_entries``: prefixes kept across
    requests (0: none; the full policy only); ``store``: a ``PageStore`` (prompt pages; compressed states under
    eviction); ``reconstruction``: KVzip's repeat prompt (one-shot: budget + interval >= ``max_len``). ``setup``: a
    ``ServeSetup`` already resolved (``lcx.engine.setup.resolve``; ``ServeConfig.resolve``) instead of those
    settings - the server checks nothing again. ``mesh``: a device mesh (``lcx.parallel.sharding.make_mesh``, no
    ``data`` axis; with ``setup``, the setup's): the weights and the pool split by KV head over ``model`` - each
    device holds its heads' part of every page - and every step runs on all of them (``lcx serve
    --tensor-parallel-size M``).

    ``cancel(request_id)`` ends a request early (waiting or running; usable from inside ``on_token``); a request
    whose ``on_token`` raises an ``Exception`` is cancelled the same way. ``cancelled``: every cancelled request's id
    -> the exception its ``on_token`` raised, or None when ``cancel`` ended it (kept across ``run`` calls)."""

    def __init__(self, config: ModelConfig, params, *, max_num_seqs: int = setup_.MAX_NUM_SEQS,
                 max_len: int = setup_.MAX_LEN, pages: int | None = None, cache: CacheConfig | None = None,
                 eos_id: int | None = None, segment: int = setup_.SEGMENT, prefill_chunk: int = setup_.PREFILL_CHUNK,
                 prefix_entries: int = setup_.PREFIX_ENTRIES, store=None, reconstruction=None,
                 setup: ServeSetup | None = None, mesh=None):
        s = setup or resolve(config, cache, max_num_seqs=max_num_seqs, max_len=max_len, pages=pages,
                             segment=segment, prefill_chunk=prefill_chunk, prefix_entries=prefix_entries,
                             store=store is not None, reconstruction=reconstruction, mesh=mesh)
        self.setup, self.config, self.eos_id = s, config, eos_id
        self.runner = build(config, params, cache=s.cache, eos_id=eos_id, reconstruction=s.reconstruction,
                            kind=s.kind, policy=s.policy, mesh=s.mesh)
        self.kind, self.cache_config, self.evicts, self.reconstruction = s.kind, s.cache, s.evicts, s.reconstruction
        self.page, self.max_len, self.row_pages, self.pages, self.rows = s.page, s.max_len, s.row_pages, s.pages, \
            s.max_num_seqs
        self.segment, self.chunk, self.prefix_entries = s.segment, s.chunk, s.prefix_entries
        self.mesh = s.mesh
        self.ref = rows.StateRef(new_state(self.kind, self.rows, self.row_pages * self.page, self.pages, s.mesh))
        self.prefixes = PrefixCache(s, store, self.ref)
        self.scheduler = Scheduler(s, self.prefixes, self.ref, config.vocab_size)
        self.cancelled = self.scheduler.cancelled
        self.prefill_tokens = 0  # prompt tokens run through the model (shared prefixes not counted twice)
        self.programs = self.runner.programs
        self.sampling = RowSampling.build([SamplingConfig()] * self.rows, np.zeros((self.rows, 2), np.uint32))

    # the pool and the store live in the parts; these are the server's views of them
    state = property(lambda self: self.ref.state, lambda self, value: setattr(self.ref, "state", value))
    store = property(lambda self: self.prefixes.store, lambda self, value: setattr(self.prefixes, "store", value))
    committed = property(lambda self: self.scheduler.committed, doc="pages the running requests may own")
    cached_tokens = property(lambda self: self.scheduler.cached_tokens, doc="prompt tokens not prefilled")

    # ----------------------------------------------------------------------------------------------- requests
    def submit(self, prompt: Sequence[int], max_new_tokens: int, sampling: SamplingConfig | None = None,
               seed: int | None = None, *, ignore_eos: bool = False, salt: str | None = None) -> int:
        """Queue a request; returns its id. Refused (``CacheCapacityError``) if it exceeds ``max_len`` or needs
        more pages than the whole pool. ``sampling``: its settings (default greedy); ``seed``: its random stream
        (default: its request id); ``ignore_eos``: EOS does not end it (``max_new_tokens`` are generated);
        ``salt``: its tenant's cache salt (a non-empty string of at most ``scheduler.MAX_SALT`` characters; None:
        the pages every unsalted request shares) - it reads and leaves kept and stored pages under that salt only."""
        return self.scheduler.submit(prompt, max_new_tokens, sampling, seed, ignore_eos, salt)

    def check(self, prompt: int, max_new_tokens: int) -> None:
        """A ``CacheCapacityError`` if a request of ``prompt`` + ``max_new_tokens`` tokens can never be served:
        past ``max_len``, or needing more pages than the whole pool (naming a policy that would serve it). Reads
        only the configuration: callable from any thread."""
        self.scheduler.check(prompt, max_new_tokens)

    def pages_needed(self, prompt: int, max_new_tokens: int) -> int:
        """Pages a request of ``prompt`` + ``max_new_tokens`` tokens may own, sharing nothing."""
        return self.scheduler.pages_needed(prompt, max_new_tokens)

    @property
    def busy(self) -> bool:
        """Requests wait or run."""
        return bool(self.scheduler.queue or self.scheduler.running)

    @property
    def waiting(self) -> int:
        return len(self.scheduler.queue)

    @property
    def running(self) -> int:
        return len(self.scheduler.running)

    def pages_used(self) -> int:
        """Pool pages held by a kept prefix or reserved by a running request (host counts: no device read)."""
        return self.prefixes.kept_pages() + self.scheduler.committed

    def cached_of(self, request_id: int) -> int:
        """Prompt tokens request ``request_id`` (running) did not prefill; 0 if it is not running."""
        request = self.scheduler.find(request_id)
        return 0 if request is None else request.cached

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
        for request in self.scheduler.admit():
            one = RowSampling.build([request.sampling], request.key[None])
            self.sampling = jax.tree.map(lambda all_, x: rows.set_row(all_, request.row, x[0]), self.sampling, one)
        running = self.scheduler.running
        if not running and self.scheduler.queue:  # unreachable: submit refuses what an empty pool cannot hold
            raise CacheCapacityError(f"the pool of {self.pages} pages cannot hold the next request")
        if any(r.prefilling for r in running.values()):
            self._prefill_chunk(emit, done)
        if any(not r.prefilling for r in running.values()):
            self._decode(emit, done)
        return done

    def cancel(self, request_id: int) -> bool:
        """End request ``request_id`` now: dropped from the queue, or (running) its row and pages released at once
        (its committed pages back to admission, the kept prefixes it reads one user less); it streams no further
        token and ``run`` does not return it. Usable between steps and from inside ``on_token``. Records
        ``cancelled[request_id] = None``; returns False (and records nothing) if it had already finished or been
        cancelled."""
        return self.scheduler.cancel(request_id)

    # ----------------------------------------------------------------------------------------------- steps
    def _prefill_chunk(self, emit, done) -> None:
        """One chunk of every row still reading its prompt (``Runner.prefill_rows``). A row whose prompt ends in
        this chunk gets its first token; its whole pages are kept (and, with a disk store, written now: a kill -9
        keeps them)."""
        reading = [r for r in self.scheduler.running.values() if r.prefilling]
        self.state, read, ending, first = self.runner.prefill_rows(self.setup, self.state, reading, self.sampling)
        for request, n in zip(reading, read):
            request.read += n
            self.prefill_tokens += n
        for j, i in enumerate(ending):
            request = reading[i]
            if self.scheduler.running.get(request.row) is not request:
                continue  # cancelled from an earlier request's on_token
            table_row = self._table_row(request)
            self.scheduler.prompt_read(request, table_row)
            if self.store is not None and self.store.directory is not None:
                self.prefixes.spill(request.prompt[:request.prompt.size - 1], table_row, request.salt)
            self._emit(request, int(first[j]), emit, done)

    def _decode(self, emit, done) -> None:
        decoding = {row: r for row, r in self.scheduler.running.items() if not r.prefilling}
        self.state, tokens, emitted = self.runner.decode_rows(self.setup, self.state, decoding, self.sampling)
        for step in range(tokens.shape[0]):
            for row in np.flatnonzero(emitted[step]):
                request = self.scheduler.running.get(int(row))
                if request is not None and not request.prefilling:
                    self._emit(request, int(tokens[step, row]), emit, done)

    def _table_row(self, request: Request) -> np.ndarray:
        return sharding.to_host(self.state.table[request.row])  # on every process of a mesh

    def _emit(self, request: Request, token: int, emit, done) -> None:
        request.tokens.append(token)
        try:
            emit(request.id, token)
        except Exception as error:  # the caller's callback failed: its request ends here, the others go on
            self.scheduler.drop(request.id)  # nothing more to free if the callback had cancelled it first
            self.cancelled[request.id] = error
            return
        if self.scheduler.running.get(request.row) is not request:
            return  # the callback cancelled it (Server.cancel)
        if (token == self.eos_id and not request.ignore_eos) or len(request.tokens) >= request.max_new_tokens:
            # what the row holds (the prompt and every token but the last, never fed back): a conversation's next
            # turn resent with this answer in its history reads these pages (or continues this compressed state)
            if self.store is not None:
                held = np.concatenate([request.prompt, np.asarray(request.tokens[:-1], np.int32)])
                self.prefixes.finished(held, request.row, request.salt)
            self.scheduler.end(request)
            done[request.id] = request.tokens


def new_state(kind, rows: int, capacity: int, pages: int, mesh=None):
    """An empty pool of ``pages`` pages for ``rows`` rows of ``capacity`` slots, made where it lives: on a mesh each
    device allocates only its shard (its KV heads' part of every page), never the whole pool on one device."""
    make = lambda: paged.create(kind, rows, capacity, pages)  # noqa: E731
    if mesh is None:
        return make()
    return jax.jit(make, out_shardings=kind.shardings(jax.eval_shape(make), mesh))()


__all__ = ["ServeSetup", "Server", "new_state", "resolve", "server_policies"]
