"""Serving with self-speculative decoding (``lcx serve --speculative-draft``): continuous batching over rows of a
contiguous full cache, each with its compressed draft cache beside it, verified as ``lcx.engine.spec_loop`` does.

    server = SpecServer(config, params, speculative=SpeculativeConfig(draft=CacheConfig(policy="streaming",
                        budget=256)), max_num_seqs=8, max_len=4096)
    ids = [server.submit(prompt, max_new_tokens=64) for prompt in prompts]
    outputs = server.run(on_token=lambda request, token: ...)

It answers to the engine thread (``lcx.service.engine``) as ``lcx.engine.server.Server`` does - ``submit``,
``check``, ``step``, ``cancel``, ``run``, ``busy`` - with these differences:

- every row reserves ``max_len`` + ``k`` + 1 slots of the full cache (the target must keep every token and roll
  rejected drafts back in place) and its draft's slots: no pages, no kept prefixes, no store, no admission by
  memory (a free row is all a request waits for);
- a request's prompt is prefilled into a cache of its own, one chunk (at most ``prefill_chunk`` tokens) per step
  while the other rows decode; when it ends the draft is derived from that prefill (``SpeculativeGenerator.start``)
  and both caches are written into the request's row;
- a decode segment is ``segment`` verifications, each emitting 1 to ``k`` + 1 tokens per row.

Each request's greedy tokens equal plain decoding of its prompt alone; its sampled ones follow the target
distribution with draws keyed by its own request key, whatever its batch-mates. ``drafted_tokens`` /
``accepted_tokens`` count draft tokens verified / accepted over the server's life (the metrics
``lcx_spec_draft_tokens_total`` / ``lcx_spec_accepted_tokens_total``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from lcx.cache.base import CacheCapacityError, round_chunk
from lcx.cache.config import CacheConfig
from lcx.config_base import ConfigError, format_bytes
from lcx.engine import rows as rows_
from lcx.engine.planning import plan_capacity
from lcx.engine.sampling import RowSampling, SamplingConfig
from lcx.engine.scheduler import Request, check_request_id, new_request
from lcx.engine.spec_generator import SpeculativeGenerator
from lcx.engine.spec_loop import SpecState
from lcx.engine.speculative import SpeculativeConfig
from lcx.model.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class SpecPlan:
    """What a speculative server holds (``lcx serve`` prints ``lines``): ``row_bytes`` of the full cache and
    ``draft_row_bytes`` of the draft per row, ``rows`` of them, reserved at start."""

    rows: int
    max_len: int
    capacity: int
    draft_capacity: int
    row_bytes: int
    draft_row_bytes: int
    draft: str
    k: int
    page_size: int

    @property
    def row_pages(self) -> int:
        """A row's reservation in ``page_size`` units (what the page gauges count)."""
        return -(-self.capacity // self.page_size)

    @property
    def page_bytes(self) -> int:
        return -(-(self.row_bytes + self.draft_row_bytes) // self.row_pages)

    def lines(self) -> list[str]:
        total = self.rows * (self.row_bytes + self.draft_row_bytes)
        return [f"speculative decoding: {self.draft} drafts {self.k} tokens per verification against the full cache",
                f"every one of {self.rows} sequences reserves {self.capacity:,} slots of the full cache "
                f"({format_bytes(self.row_bytes)}) and {self.draft_capacity:,} of its draft "
                f"({format_bytes(self.draft_row_bytes)}): {format_bytes(total)} in all, at --max-model-len "
                f"{self.max_len:,}"]


class SpecServer:
    """Continuous batching with a compressed-KV draft per row; see the module docstring. ``cache``: the target (the
    full cache; ``kv_dtype`` int8 / fp8 / fp4 allowed); ``reconstruction``: KVzip's repeat prompt for a KVzip
    draft; ``page_size``: the unit the page gauges count a row's reservation in."""

    def __init__(self, config: ModelConfig, params, *, speculative: SpeculativeConfig, max_num_seqs: int = 8,
                 max_len: int = 4096, cache: CacheConfig | None = None, eos_id: int | None = None, segment: int = 16,
                 prefill_chunk: int = 512, reconstruction=None, page_size: int = 16):
        for name, value in (("max_num_seqs", max_num_seqs), ("max_len", max_len), ("segment", segment),
                            ("prefill_chunk", prefill_chunk), ("page_size", page_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"SpecServer: {name}={value!r} is invalid: must be a positive integer")
        self.gen = SpeculativeGenerator(config, params, max_new_tokens=max_len, speculative=speculative, cache=cache,
                                        eos_id=eos_id, reconstruction=reconstruction)
        budgets = self.gen.draft_kind.head_budgets
        if budgets is not None and min(budgets) >= max_len:
            raise ConfigError(f"speculative.draft.budget={speculative.draft.budget} holds every token a request may "
                              f"have (max_len={max_len}): the draft would read what the target reads; allowed: a "
                              "budget below max_len")
        self.config, self.eos_id, self.rows, self.max_len = config, eos_id, max_num_seqs, max_len
        self.segment, self.chunk, self.page = segment, prefill_chunk, page_size
        k = speculative.k
        self.capacity = plan_capacity(config, self.gen.cache_config, max_num_seqs, max_len, k + 1)
        self.draft_capacity = self.gen.draft_kind.plan(1, max_len, k + 1)
        self.state = self._empty()
        self.plan = SpecPlan(rows=max_num_seqs, max_len=max_len, capacity=self.capacity,
                             draft_capacity=self.draft_capacity,
                             row_bytes=self.gen.target.kind.nbytes(1, self.capacity),
                             draft_row_bytes=self.gen.draft_kind.nbytes(1, self.draft_capacity),
                             draft=speculative.draft.policy if speculative.draft.kv_dtype is None
                             else f"{speculative.draft.policy} ({speculative.draft.kv_dtype})", k=k,
                             page_size=page_size)
        self.queue: list[Request] = []
        self.active: dict[int, Request] = {}  # row -> its request (prefilling or decoding)
        self.prefilling: dict[int, tuple] = {}  # request id -> (its own cache, its last logits)
        self.cancelled: dict[int, Exception | None] = {}
        self.next_id = 0
        self.prefill_tokens = 0
        self.drafted_tokens = 0  # draft tokens verified, over the server's life
        self.accepted_tokens = 0  # of them, accepted
        self._counts = np.zeros((max_num_seqs, 2), np.int64)  # each row's (drafted, accepted) when last read
        self.store = None  # nothing kept across requests (the engine and the health check ask)

    def _empty(self) -> SpecState:
        b, g = self.rows, self.gen
        zeros = lambda: jnp.zeros((b,), jnp.int32)  # noqa: E731 - distinct buffers: the loop donates its state
        # the target over an empty prefill cache: a row's target is a view of its prefill's buffers, whose shapes
        # are the prefill kind's (a per-KV-head draft policy's keep sets)
        target = g.target_view(g.prefill_runner.kind.create(b, self.capacity))
        return SpecState(target=target, draft=g.draft_kind.create(b, self.draft_capacity),
                         token=zeros(), extra=zeros(), has_extra=jnp.zeros((b,), bool),
                         tokens=jnp.zeros((b, self.max_len), jnp.int32), n_generated=zeros(), limit=zeros(),
                         stops=jnp.ones((b,), bool), done=jnp.ones((b,), bool), drafted=zeros(), accepted=zeros(),
                         verifications=zeros(), step=jnp.int32(0), sampling=RowSampling.empty(b))

    # ----------------------------------------------------------------------------------------------- requests
    def submit(self, prompt: Sequence[int], max_new_tokens: int, sampling: SamplingConfig | None = None,
               seed: int | None = None, *, ignore_eos: bool = False, salt: str | None = None) -> int:
        """Queue a request (``Server.submit``'s checks); its id. ``salt`` is checked and has nothing to key apart:
        this server shares no cache between requests."""
        request = new_request(self.next_id, prompt, max_new_tokens, sampling, seed, ignore_eos, salt,
                              self.config.vocab_size, self.check)
        self.next_id += 1
        self.queue.append(request)
        return request.id

    def check(self, prompt: int, max_new_tokens: int) -> None:
        """A ``CacheCapacityError`` for a request past ``max_len`` (the only limit: every row holds ``max_len``)."""
        if prompt + max_new_tokens > self.max_len:
            raise CacheCapacityError(f"request of {prompt} prompt + {max_new_tokens} new tokens exceeds the "
                                     f"server's max_len={self.max_len}")

    busy = property(lambda self: bool(self.queue or self.active), doc="requests wait or run")
    waiting = property(lambda self: len(self.queue), doc="requests queued for a row")
    running = property(lambda self: len(self.active), doc="requests holding a row")

    def pages_used(self) -> int:
        """The running rows' reservations in ``page_size`` units (what ``lcx_kv_pages_used`` reports)."""
        return len(self.active) * self.plan.row_pages

    def cached_of(self, request_id: int) -> int:
        return 0  # no prompt token is ever read from a cache

    def run(self, on_token: Callable[[int, int], None] | None = None) -> dict[int, list[int]]:
        """Serve every queued request (``Server.run``)."""
        done: dict[int, list[int]] = {}
        while self.busy:
            self.step(on_token, done)
        return done

    def step(self, on_token: Callable[[int, int], None] | None = None, done: dict | None = None) -> dict:
        """Admit to free rows; one prefill chunk of every request reading its prompt; one decode segment."""
        done = {} if done is None else done
        emit = on_token or (lambda request, token: None)
        free = [r for r in range(self.rows) if r not in self.active]
        while self.queue and free:
            request = self.queue.pop(0)
            request.row = free.pop(0)
            self.active[request.row] = request
            self.prefilling[request.id] = (self.gen.prefill_runner.kind.create(1, self.capacity),
                                           jnp.zeros((1, self.config.vocab_size), jnp.float32))
        for request in [r for r in self.active.values() if r.prefilling]:
            if self.active.get(request.row) is request:  # not cancelled by an earlier request's on_token
                self._prefill_chunk(request, emit, done)
        if any(not r.prefilling for r in self.active.values()):
            self._decode(emit, done)
        return done

    def cancel(self, request_id: int) -> bool:
        """End request ``request_id`` now (``Server.cancel``); False if it had already ended."""
        check_request_id(request_id, self.next_id)
        if not self._drop(int(request_id)):
            return False
        self.cancelled[int(request_id)] = None
        return True

    # ----------------------------------------------------------------------------------------------- steps
    def _prefill_chunk(self, request: Request, emit, done) -> None:
        runner = self.gen.prefill_runner
        cache, logits = self.prefilling[request.id]
        size, read = request.prompt.size, request.read
        chunk = min(self.chunk, round_chunk(size - read))
        n = min(chunk, size - read)
        ids, ok = np.zeros((1, chunk), np.int32), np.zeros((1, chunk), bool)
        ids[0, :n], ok[0, :n] = request.prompt[read:read + n], True
        last_index = np.asarray([n - 1 if read + n == size else -1], np.int32)
        weights = runner.kind.prefill_weights(np.asarray([size]), size)
        if weights is not None:
            weights = np.pad(weights[:, read:read + n], ((0, 0), (0, chunk - n)))
        cache, logits = runner.programs.prefill_chunk(runner.params, cache, jnp.asarray(ids), jnp.asarray(ok),
                                                      jnp.asarray(last_index), logits,
                                                      None if weights is None else jnp.asarray(weights))
        cache = runner.kind.sync(cache)
        request.read += n
        self.prefill_tokens += n
        if request.prefilling:
            self.prefilling[request.id] = (cache, logits)
            return
        del self.prefilling[request.id]
        if runner.reconstruction is not None and getattr(runner.policy, "reconstructs", False):
            cache = runner.reconstruct(cache, request.prompt[None], np.asarray([size]), False)
        one = self.gen.start(cache, logits, RowSampling.build([request.sampling], request.key[None]),
                             draft_capacity=self.draft_capacity, limit=request.max_new_tokens,
                             stops=not request.ignore_eos)
        self.state = _put_row(self.state, one, jnp.int32(request.row))
        self._counts[request.row] = 0
        self._emit(request, [int(one.token[0])], bool(one.done[0]), emit, done)

    def _decode(self, emit, done) -> None:
        decoding = {row: r for row, r in self.active.items() if not r.prefilling}
        sampled = any(r.sampling.temperature > 0 for r in decoding.values())
        self.state = self.gen.loop(self.gen.target.params, self.state, self.state.step + self.segment,
                                   sampled=sampled)
        s = self.state
        # one transfer of what the host reads after a segment
        n_generated, finished, drafted, accepted, tokens = jax.device_get(
            (s.n_generated, s.done, s.drafted, s.accepted, s.tokens))
        counts = np.stack([drafted, accepted], 1)
        for row, request in decoding.items():
            new = counts[row] - self._counts[row]
            self.drafted_tokens += int(new[0])
            self.accepted_tokens += int(new[1])
            self._counts[row] = counts[row]
            self._emit(request, tokens[row, len(request.tokens):n_generated[row]].tolist(), bool(finished[row]),
                       emit, done)

    def _emit(self, request: Request, tokens: list[int], finished: bool, emit, done) -> None:
        """Stream ``tokens`` of ``request``; it ends when ``finished`` (EOS or its last token) - or earlier, when its
        callback raised or cancelled it."""
        for token in tokens:
            request.tokens.append(token)
            try:
                emit(request.id, token)
            except Exception as error:  # the caller's callback failed: its request ends here, the others go on
                self._drop(request.id)
                self.cancelled[request.id] = error
                return
            if self.active.get(request.row) is not request:
                return  # the callback cancelled it
        if finished:
            self._release(request)
            done[request.id] = request.tokens

    def _drop(self, request_id: int) -> bool:
        waiting = [r for r in self.queue if r.id == request_id]
        if waiting:
            self.queue.remove(waiting[0])
            return True
        request = next((r for r in self.active.values() if r.id == request_id), None)
        if request is None:
            return False
        self._release(request)
        return True

    def _release(self, request: Request) -> None:
        """``request`` leaves its row: the loop skips the row (done) until a new request is written into it."""
        del self.active[request.row]
        self.prefilling.pop(request.id, None)
        self.state = self.state.replace(done=self.state.done.at[request.row].set(True))


@functools.partial(jax.jit, donate_argnums=(0,))
def _put_row(state: SpecState, one: SpecState, row) -> SpecState:
    """``state`` with row ``row`` set to ``one``'s only row: every per-row buffer of both caches (by their field
    declarations) and of the loop; in place (donated)."""
    def caches(big, small):
        fields = rows_.row_fields(big.kind)
        return big.replace(**{n: jax.lax.dynamic_update_slice_in_dim(getattr(big, n), getattr(small, n), row, axis)
                              for n, (axis, _) in fields.items() if getattr(big, n, None) is not None})

    rest = {f.name: jax.tree.map(lambda b, s: jax.lax.dynamic_update_slice_in_dim(b, s.astype(b.dtype), row, 0),
                                 getattr(state, f.name), getattr(one, f.name))
            for f in dataclasses.fields(state) if f.name not in ("target", "draft", "step")}
    return state.replace(target=caches(state.target, one.target), draft=caches(state.draft, one.draft), **rest)


__all__ = ["SpecPlan", "SpecServer"]
