"""The warm-up of ``lcx serve`` (``--warmup PROMPT_TOKENS[:NEW_TOKENS][@SHARED_TOKENS],...``): before the server
accepts a connection, dummy requests run through its ``Server`` so that the programs real requests of those lengths
use are compiled, and the first clients do not pay for the compiles in their time to first token.

Why: the server compiles a prefill program per (rows in the chunk rounded up to a power of two, chunk width, table
width), a decode segment per table width (greedy and sampled apart), and small programs per count of rows (the
sub-batch written back, the first tokens sampled) - on first use, seconds each on a CPU. Under load the first
requests of a length arrive together and wait for every one of those compiles.

The dummies are shaped like the chats clients send: P tokens that begin with the chat template's opening (what
every rendered conversation shares - e.g. a default system prompt - whose whole pages the server keeps and shares,
so chats after the first prefill from there: other chunk widths than a prompt read from its start), then random
ids, no two dummies sharing more (a model without a chat template: random ids only); with ``@SHARED_TOKENS`` they
begin with that many random ids common to all of them instead (a system prompt). EOS is ignored. Per P:

- one dummy alone first: the first chat of a fresh server, which has no kept opening yet;
- at each concurrency c from 1 to ``max_num_seqs`` (past 16 rows: the powers of two and ``max_num_seqs``), c
  prompts at once, each generating one token: every prefill shape of c rows reading P tokens together, and the
  programs of each count of rows;
- at each power of two c >= 2, c prompts of which the second half arrive one step late (a first chunk beside other
  rows' later chunks reads a wider table: what staggered arrivals run);
- two single prompts decoding NEW_TOKENS (default two decode segments), one greedy and one sampled at temperature 1
  (the decode segment has a variant for each; every row decodes in it, so one request compiles what eight use).

Afterwards what the dummies left is undone: their kept prefixes are released (the pool's references back to
baseline: no page in use), the request numbering starts again at 0 (a request without a seed is keyed by its
number), the counters and the pool's peak are reset, the store never saw them (a throwaway store stood in: the
store's copy programs compiled all the same) and the metrics are made after. ``lcx.engine.server`` has no reset of
its own (it is at its size limit), so this module sets those few fields itself.
"""

from __future__ import annotations

import dataclasses
import re
import tempfile
import time

import numpy as np

from lcx.config_base import ConfigError

DECODE_SEGMENTS = 2  # segments a decoding dummy runs when its spec gives no NEW_TOKENS (its prompt's table width)
ALL_COUNTS = 16  # up to this many rows every concurrency is warmed; past it the powers of two only


FORM = "PROMPT_TOKENS[:NEW_TOKENS][@SHARED_TOKENS],... with positive integers, e.g. 256 or 286:64,1024@512"


@dataclasses.dataclass(frozen=True)
class WarmupSpec:
    """One length to warm: ``prompt`` tokens, ``new`` tokens generated (None: ``DECODE_SEGMENTS`` segments);
    ``shared``: tokens every prompt begins with (a system prompt; None: the chat template's opening)."""

    prompt: int
    new: int | None = None
    shared: int | None = None


def parse_warmup(text: str | None) -> tuple[WarmupSpec, ...]:
    """``"256,1024:64@512"`` -> the specs; ``None`` / ``""`` -> none. Errors name the flag, the value and the
    form."""
    if text is None or text == "":
        return ()
    if not isinstance(text, str):
        raise ConfigError(f"--warmup={text!r} is invalid: write {FORM}")
    specs = []
    for item in text.split(","):
        m = re.fullmatch(r"\s*(\d+)(?::(\d+))?(?:@(\d+))?\s*", item)
        spec = WarmupSpec(*(None if g is None else int(g) for g in m.groups())) if m else None
        shared_ok = spec is not None and (spec.shared is None or 0 < spec.shared < spec.prompt)
        if not shared_ok or spec.prompt == 0 or spec.new == 0:
            raise ConfigError(f"--warmup={text!r} is invalid at {item!r}: write {FORM} (SHARED_TOKENS below "
                              "PROMPT_TOKENS)")
        specs.append(spec)
    return tuple(specs)


@dataclasses.dataclass
class WarmupReport:
    """What a warm-up ran: ``requests`` dummies in ``seconds``; ``compiles``: backend compiles meanwhile."""

    requests: int
    seconds: float
    compiles: int

    def line(self) -> str:
        return (f"warm-up: {self.requests} dummy requests, {self.compiles} programs compiled in "
                f"{self.seconds:.1f} s")


def warm_up(server, specs: tuple[WarmupSpec, ...], *, head=(), seed: int = 0) -> WarmupReport:
    """Run the dummies of ``specs`` through ``server`` (idle, never started) and reset what they left (module
    docstring); ``head``: the ids every prompt begins with (``chat_head``). Refused when a spec cannot be served
    (longer than ``max_len`` or the pool)."""
    if server.busy:
        raise ConfigError("warm_up: the server already has requests; warm it up before serving")
    for spec in specs:
        new = _new_tokens(server, spec)
        try:
            server.check(spec.prompt, new)
        except Exception as err:
            raise ConfigError(f"--warmup {spec.prompt}:{new} cannot be served: {err}") from err
    rng = np.random.default_rng(seed)
    compiles = _CompileCounter()
    saved = _Saved.of(server)
    t0 = time.perf_counter()
    n = 0
    try:
        with compiles:
            for spec in specs:
                shared = head if spec.shared is None else _Prompts(server, rng).make(spec.shared)
                n += _warm_length(server, spec, _Prompts(server, rng, shared))
    finally:
        saved.restore(server)
    return WarmupReport(requests=n, seconds=time.perf_counter() - t0, compiles=compiles.count)


def _new_tokens(server, spec: WarmupSpec) -> int:
    new = spec.new if spec.new is not None else DECODE_SEGMENTS * server.segment
    return max(1, min(new, server.max_len - spec.prompt))


def _levels(rows: int) -> list[int]:
    """Powers of two up to ``rows``, and ``rows``."""
    levels = [1 << i for i in range(rows.bit_length()) if 1 << i <= rows]
    return levels + ([rows] if rows not in levels else [])


def _warm_length(server, spec: WarmupSpec, prompts: _Prompts) -> int:
    from lcx.engine.sampling import SamplingConfig

    n = _run(server, [prompts.make(spec.prompt)], 1)  # the first chat: it keeps the opening the others share
    counts = range(1, server.rows + 1) if server.rows <= ALL_COUNTS else _levels(server.rows)
    for c in counts:  # every count of rows reading (and ending) together; one token each: prefill only
        n += _run(server, [prompts.make(spec.prompt) for _ in range(c)], 1)
    for c in _levels(server.rows)[1:]:  # half of them one step late: first chunks beside later chunks
        n += _run(server, [prompts.make(spec.prompt) for _ in range(c)], 1, late=c // 2)
    new = _new_tokens(server, spec)
    for sampling in (None, SamplingConfig(temperature=1.0)):  # the decode segment's greedy and sampled programs
        n += _run(server, [prompts.make(spec.prompt)], new, sampling=sampling)
    return n


def _run(server, prompts: list[np.ndarray], new: int, late: int = 0, sampling=None) -> int:
    """Serve ``prompts`` (``late`` of them submitted after one step) to the end."""
    early = prompts[:len(prompts) - late]
    for p in early:
        server.submit(p, new, sampling, ignore_eos=True)
    if late:
        server.step()
        for p in prompts[len(early):]:
            server.submit(p, new, sampling, ignore_eos=True)
    server.run()
    return len(prompts)


class _Prompts:
    """Prompts of ``head`` then random ids (avoiding the special ids) whose first page after it all differ."""

    def __init__(self, server, rng, head=()):
        self.server, self.rng, self.made = server, rng, set()
        self.head = np.asarray(head, np.int32)
        vocab = server.config.vocab_size
        self.low = min(256, vocab // 2)  # byte-level and BPE vocabularies keep their specials near the start
        self.high = vocab

    def make(self, n: int) -> np.ndarray:
        head = self.head[:max(n - self.server.page, 0)]  # a prompt shorter than the opening and a page: random
        while True:
            tail = self.rng.integers(self.low, self.high, size=n - head.size, dtype=np.int32)
            first = tuple(tail[:self.server.page].tolist())
            if first not in self.made:
                self.made.add(first)
                return np.concatenate([head, tail])


def chat_head(lm) -> list[int]:
    """The ids every chat prompt of ``lm`` begins with: two one-message chats rendered by ``lcx.lm.encode_chat``,
    up to their first difference; [] without a chat template."""
    from lcx.lm import encode_chat

    if not getattr(lm.tokenizer, "chat_template", None):
        return []
    a, b = (encode_chat(lm.tokenizer, [{"role": "user", "content": t}]) for t in ("Hi", "Yes"))
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return a[:n]


@dataclasses.dataclass
class _Saved:
    """What the dummies change on the server, as it was before them."""

    sampling: object
    peak: object
    store: object
    scratch: tempfile.TemporaryDirectory | None

    @classmethod
    def of(cls, server) -> _Saved:
        import jax

        from lcx.engine.kv_store import PageStore

        scratch, store = None, server.store
        if store is not None:  # a throwaway store like the real one (on disk if it is): its programs compile
            scratch = tempfile.TemporaryDirectory(prefix="lcx-warmup-") if store.directory is not None else None
            server.store = PageStore("lcx-warmup", page=server.page, host_bytes=64 << 20,
                                     directory=None if scratch is None else scratch.name)
        # copies: the server's calls donate its state's buffers
        return cls(sampling=jax.tree.map(np.array, server.sampling), peak=np.array(server.state.peak), store=store,
                   scratch=scratch)

    def restore(self, server) -> None:
        import jax.numpy as jnp

        for request_id in range(server.scheduler.next_id):  # what an error left running
            server.cancel(request_id)
        while server.prefixes.drop_lru(keep=None):  # the dummies' kept prefixes (spilled to the throwaway store)
            pass
        server.store = self.store
        if self.scratch is not None:
            self.scratch.cleanup()
        server.state = server.state.replace(peak=jnp.asarray(self.peak))
        server.sampling = self.sampling
        server.scheduler.next_id = 0  # an unseeded request's stream is keyed by its number: as if no dummy had run
        server.cancelled.clear()
        server.prefill_tokens = server.scheduler.cached_tokens = 0


class _CompileCounter:
    """Counts XLA backend compiles while entered (``jax.monitoring``'s compile-duration event)."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        self.count = 0
        self.active = False

    def _listen(self, event: str, duration: float, **kwargs) -> None:
        if self.active and event == self.EVENT:
            self.count += 1

    def __enter__(self):
        import jax

        if not getattr(_CompileCounter, "_registered", False):  # listeners cannot be removed: one, forwarding
            jax.monitoring.register_event_duration_secs_listener(_forward)
            _CompileCounter._registered = True
        _LISTENERS.append(self)
        self.active = True
        return self

    def __exit__(self, *exc) -> None:
        self.active = False
        _LISTENERS.remove(self)


_LISTENERS: list[_CompileCounter] = []


def _forward(event: str, duration: float, **kwargs) -> None:
    for listener in list(_LISTENERS):
        listener._listen(event, duration, **kwargs)


def compile_counter() -> _CompileCounter:
    """A context manager counting XLA compiles while entered (``.count``): what a test or benchmark checks."""
    return _CompileCounter()


__all__ = ["DECODE_SEGMENTS", "FORM", "WarmupReport", "WarmupSpec", "chat_head", "compile_counter", "parse_warmup",
           "warm_up"]
