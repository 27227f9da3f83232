"""The host half of serving: a FIFO queue of requests, their admission to rows by the page budget, the pages each
running request keeps reserved, and cancellation.

A request is admitted when a row is free and the pool can hold everything it may write beyond the pages it shares -
its prompt and ``max_new_tokens`` under the ``full`` policy, the slots its policy plans (budget + interval) under an
evicting one - counted on the host as ``committed`` + the kept prefixes' pages (``PrefixCache.kept_pages``):
admission is deferred, never an out-of-memory error, and a request no empty pool could hold is refused at ``submit``
with the bytes it needs, the budget and a policy that would serve it. Kept prefixes are released (least recently
used first) when a request needs their pages. Under eviction a compressed row keeps reserved only the pages it can
still come to hold (``lcx.engine.prompt_end``).
"""

from __future__ import annotations

import collections
import dataclasses

import jax.numpy as jnp
import numpy as np

from lcx.cache.base import CacheCapacityError
from lcx.config_base import ConfigError
from lcx.engine import rows
from lcx.engine.prompt_end import pages_still_needed
from lcx.engine.sampling import SamplingConfig, request_key

SUGGESTED_POLICY = "streaming"  # what a refusal proposes: bounded pages for any prompt, no statistics to gather
MAX_SALT = 256  # characters of a request's cache salt: enough for any tenant id or random token, hashed per page


@dataclasses.dataclass
class Request:
    id: int
    prompt: np.ndarray
    max_new_tokens: int
    tokens: list[int] = dataclasses.field(default_factory=list)
    row: int | None = None
    private: int = 0  # pages this request may own (not shared), counted against the pool while it runs
    shared: int = 0  # pages of a kept prefix it reads
    uses: list = dataclasses.field(default_factory=list)  # kept prefixes that must outlive it (read or made)
    sampling: SamplingConfig = SamplingConfig()
    key: np.ndarray | None = None  # its random stream's key (uint32 [2])
    read: int = 0  # prompt tokens in its cache so far (shared, loaded or prefilled)
    cached: int = 0  # prompt tokens it did not prefill (a kept prefix's pages or the store's)
    stored: tuple | None = None  # (pages, arrays) the store gave it, until loaded
    ignore_eos: bool = False  # generate max_new_tokens whatever it samples (EOS included, as any token)
    keys: list | None = None  # the chain keys of its prompt's whole pages (PrefixCache.prompt_keys)
    salt: str | None = None  # its tenant's cache salt: its pages are shared only with requests of the same salt

    @property
    def prefilling(self) -> bool:
        return self.read < self.prompt.size


def common_pages(prompt: np.ndarray, other: np.ndarray, page: int) -> int:
    """Whole pages ``prompt`` shares with ``other`` (leaving ``prompt`` one token of its own)."""
    n = min(prompt.size - 1, other.size)
    same = prompt[:n] == other[:n]
    return (n if same.all() else int(np.argmin(same))) // page


def new_request(request_id: int, prompt, max_new_tokens: int, sampling: SamplingConfig | None, seed: int | None,
                ignore_eos: bool, salt: str | None, vocab: int, check) -> Request:
    """Request ``request_id`` with ``Server.submit``'s checks: token ids in ``[0, vocab)``, the settings' types and
    ``check(prompt tokens, max_new_tokens)`` (the server's capacity; raises)."""
    prompt = np.asarray(prompt, np.int32)
    if prompt.ndim != 1 or prompt.size == 0:
        raise ConfigError("Server.submit: prompt must be a non-empty list of token ids")
    if np.any(prompt < 0) or np.any(prompt >= vocab):
        raise ConfigError(f"Server.submit: prompt token ids must lie in [0, {vocab})")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens={max_new_tokens!r} is invalid: must be a positive integer")
    check(prompt.size, max_new_tokens)
    if sampling is not None and not isinstance(sampling, SamplingConfig):
        raise ConfigError(f"Server.submit: sampling={sampling!r:.60} is invalid: must be a lcx.SamplingConfig")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ConfigError(f"Server.submit: seed={seed!r:.60} is invalid: must be an integer or None")
    if salt is not None and (not isinstance(salt, str) or not 0 < len(salt) <= MAX_SALT):
        raise ConfigError(f"Server.submit: salt={salt!r:.60} is invalid: must be None or a non-empty string of at "
                          f"most {MAX_SALT} characters")
    return Request(request_id, prompt, max_new_tokens, sampling=sampling or SamplingConfig(),
                   key=request_key(request_id if seed is None else seed), ignore_eos=bool(ignore_eos), salt=salt)


def check_request_id(request_id, next_id: int) -> None:
    """``Server.cancel``'s argument: an id ``submit`` returned (below ``next_id``), else one clear error."""
    if (isinstance(request_id, bool) or not isinstance(request_id, (int, np.integer))
            or not 0 <= request_id < next_id):
        raise ConfigError(f"Server.cancel: request_id={request_id!r:.60} is invalid: must be an id submit "
                          f"returned (0 .. {next_id - 1})")


class Scheduler:
    """Queue, admission, reservation and cancellation of one server (see the module docstring). ``setup``: its
    ``ServeSetup``; ``prefixes``: its ``PrefixCache``; ``ref``: its ``rows.StateRef``; ``vocab``: the model's
    vocabulary size."""

    def __init__(self, setup, prefixes, ref: rows.StateRef, vocab: int):
        self.setup, self.prefixes, self.ref, self.vocab = setup, prefixes, ref, vocab
        self.queue: collections.deque[Request] = collections.deque()
        self.running: dict[int, Request] = {}  # row -> request
        self.next_id = 0
        self.committed = 0  # pages the running requests may own
        self.cancelled: dict[int, Exception | None] = {}  # request id -> what its on_token raised (None: cancel)
        self.cached_tokens = 0  # prompt tokens served from kept or stored pages

    # ------------------------------------------------------------------------------------------- requests
    def submit(self, prompt, max_new_tokens: int, sampling: SamplingConfig | None = None, seed: int | None = None,
               ignore_eos: bool = False, salt: str | None = None) -> int:
        """Queue a request (checked: ``Server.submit``); its id."""
        request = new_request(self.next_id, prompt, max_new_tokens, sampling, seed, ignore_eos, salt, self.vocab,
                              self.check)
        self.next_id += 1
        self.queue.append(request)
        return request.id

    def check(self, prompt: int, max_new_tokens: int) -> None:
        """A ``CacheCapacityError`` if a request of ``prompt`` + ``max_new_tokens`` tokens can never be served."""
        s = self.setup
        if prompt + max_new_tokens > s.max_len:
            raise CacheCapacityError(f"request of {prompt} prompt + {max_new_tokens} new tokens exceeds the "
                                     f"server's max_len={s.max_len}")
        need = self.pages_needed(prompt, max_new_tokens)
        if need > s.pages:
            nbytes = s.kind.page_nbytes()
            per_row = max(1, s.pages // s.max_num_seqs) * s.page
            budget = max(s.page, (per_row - s.cache.interval) // s.page * s.page)
            raise CacheCapacityError(
                f"request of {prompt} prompt + {max_new_tokens} new tokens needs {need} pages of {s.page} tokens "
                f"({need * nbytes:,} bytes of KV cache); the server's KV budget is {s.pages} pages "
                f"({s.pages * nbytes:,} bytes) under cache policy {s.cache.policy!r}; a policy that serves it in "
                f"bounded pages: --cache-policy {SUGGESTED_POLICY} --cache-param budget={budget}")

    def pages_needed(self, prompt: int, max_new_tokens: int) -> int:
        """Pages a request of ``prompt`` + ``max_new_tokens`` tokens may own, sharing nothing."""
        tokens = prompt + max_new_tokens
        if self.setup.evicts:
            tokens = min(tokens, self.setup.kind.plan(1, prompt, max_new_tokens))
        return -(-tokens // self.setup.page)

    def free_pages(self) -> int:
        return self.setup.pages - self.prefixes.kept_pages() - self.committed

    # ------------------------------------------------------------------------------------------- admission
    def admit(self) -> list[Request]:
        """Start the queued requests that fit, in order (a request that does not fit blocks the ones behind it):
        each on a free row, on the kept prefix it shares or the pages the store holds of it."""
        setup, prefixes, admitted = self.setup, self.prefixes, []
        free_rows = [r for r in range(setup.max_num_seqs) if r not in self.running]
        while self.queue and free_rows:
            request = self.queue[0]
            key, shared = prefixes.lookup(request)
            # a prompt of another salt shares no page with it, however alike the tokens: nothing to wait for
            reading = [r for r in self.running.values()
                       if r.prefilling and setup.prefix_entries and r.salt == request.salt]
            if any(common_pages(request.prompt, other.prompt, setup.page) > shared for other in reading):
                break  # it shares more with a prompt still being read: wait, then read that prompt's kept pages
            stored = prefixes.stored(request, shared)
            if stored > shared:  # the store holds more of it than any kept prefix: load, share nothing
                key, shared = None, 0
            else:
                stored = 0
            if key is not None:
                key = prefixes.narrow(key, shared)
            private = self.pages_needed(request.prompt.size, request.max_new_tokens) - shared
            while private > self.free_pages() and prefixes.drop_lru(keep=key):
                pass
            if private > self.free_pages():
                break  # waits for running requests to finish
            self.queue.popleft()
            row = free_rows.pop(0)
            pages = prefixes.pin(key) if key is not None else []
            request.row, request.private, request.shared = row, private, shared
            request.uses = [] if key is None else [key]
            self.committed += private
            table = np.full(setup.row_pages, -1, np.int32)
            table[:shared] = pages
            self.ref.state = rows.assign(self.ref.state, jnp.int32(row), jnp.asarray(table),
                                         jnp.int32(shared * setup.page))
            if stored:
                prefixes.load(request)
            request.read = request.cached = stored if setup.evicts else max(shared, stored) * setup.page
            self.cached_tokens += request.cached
            self.running[row] = request
            admitted.append(request)
        return admitted

    def prompt_read(self, request: Request, table_row: np.ndarray) -> None:
        """``request``'s prompt was read into pool pages ``table_row``: under eviction (compressed) it keeps
        reserved only what it can still come to hold; its whole pages are kept for later requests (the kept prefix
        owns them from now on)."""
        if self.setup.evicts:
            need = pages_still_needed(table_row, request.max_new_tokens, self.setup.page, self.setup.row_pages)
            self.committed -= request.private - min(need, request.private)
            request.private = min(need, request.private)
        key = self.prefixes.keep(request, table_row)
        if key is not None:  # its pages but the shared ones (the prefix it read: exactly those) move to the entry
            n_pages = len(self.prefixes.entries[key].pages)
            moved = n_pages - min(request.shared, n_pages)
            request.private -= moved
            self.committed -= moved
            request.uses.append(key)

    # ------------------------------------------------------------------------------------------- ending
    def end(self, request: Request) -> None:
        """``request`` leaves its row: its pages lose its references, its committed pages return to admission and
        the kept prefixes it reads have one user less."""
        self.ref.state = rows.release(self.ref.state, jnp.int32(request.row))
        self.committed -= request.private
        self.prefixes.release(request.uses)
        del self.running[request.row]

    def find(self, request_id: int) -> Request | None:
        """The running request ``request_id``, or None."""
        return next((r for r in self.running.values() if r.id == request_id), None)

    def drop(self, request_id: int) -> bool:
        """Drop the waiting request ``request_id`` or end the running one; False if it is neither."""
        waiting = [r for r in self.queue if r.id == request_id]
        if waiting:
            self.queue.remove(waiting[0])
            return True
        running = self.find(request_id)
        if running is not None:
            self.end(running)
        return running is not None

    def cancel(self, request_id: int) -> bool:
        """``Server.cancel``: records ``cancelled[request_id] = None`` unless it had already ended."""
        check_request_id(request_id, self.next_id)
        if not self.drop(int(request_id)):
            return False
        self.cancelled[int(request_id)] = None
        return True


__all__ = ["MAX_SALT", "Request", "SUGGESTED_POLICY", "Scheduler", "check_request_id", "common_pages", "new_request"]
