"""The bridge between the HTTP handlers (an asyncio loop) and the serving loop (``lcx.engine.server.Server``, which
is not thread-safe): one engine thread owns the ``Server`` and runs its steps; handlers hand it requests and
cancellations through a queue, and receive text through the loop (``call_soon_threadsafe``).

Per request (a ``Generation``) the engine thread turns tokens into text incrementally (``Detokenizer``: only the
last tokens are decoded again; an incomplete UTF-8 character is held back), stop strings searched in the new text's
reach only - a match ends the request at once (``Server.cancel``: its pages return before the next segment) and
cuts the text before the stop - and text that could be the start of a stop string held back until it cannot.
Events go to every subscriber of the generation (an idempotent retry subscribes to the one already running, and
replays what it missed). A request that asks for log-probabilities is scored when it ends (``lcx.engine.scoring``:
its prompt and answer teacher-forced, so cached or stored pages need no log-probabilities of their own), before its
end is published; one with ``max_tokens`` 0 (echo) is only scored.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
import traceback
import uuid
from typing import Any

import numpy as np

from lcx.engine.sampling import SamplingConfig
from lcx.engine.scoring import Scored, Scorer
from lcx.engine.server import Server

log = logging.getLogger("lcx.serve")


@dataclasses.dataclass(eq=False)
class Generation:
    """One request's life: what it asked, what it produced, and its subscribers (asyncio queues, loop side)."""

    kind: str  # "completion" | "chat"
    prompt: list[int]
    max_tokens: int
    sampling: SamplingConfig
    seed: int | None
    stops: list[str]
    loop: asyncio.AbstractEventLoop
    ignore_eos: bool = False
    salt: str | None = None  # the request's cache_salt: its pages are shared only within this salt
    top: int | None = None  # alternatives per token to report; None: no log-probabilities wanted
    echo: bool = False
    prompt_text: str = ""  # what echo shows of the prompt
    index: int = 0  # the choice's index in its request
    id: str = ""
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    arrival: float = dataclasses.field(default_factory=time.monotonic)
    # engine thread side
    request_id: int | None = None
    tokens: list[int] = dataclasses.field(default_factory=list)
    text: str = ""  # the answer so far (cut before a stop string)
    sent: int = 0  # characters of ``text`` published
    cached_tokens: int = 0
    scored: Scored | None = None  # log-probabilities of prompt + tokens (when ``top`` is not None)
    top_done: bool = False  # ``scored`` is final (a greedy one-token request scored without the server)
    detok: Any = None  # the engine's ``Detokenizer`` of the answer
    finish_reason: str | None = None  # "stop", "length", "cancelled", "error"
    last_token_at: float | None = None
    # loop side
    events: list = dataclasses.field(default_factory=list)  # ("text", str) ... then ("done", reason)
    subscribers: list = dataclasses.field(default_factory=list)
    ended: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)  # set with the "done" event

    def __post_init__(self):
        if not self.id:
            self.id = f"{'chatcmpl' if self.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def subscribe(self) -> asyncio.Queue:
        """(Loop side.) A queue of every event so far and those to come."""
        queue: asyncio.Queue = asyncio.Queue()
        for event in self.events:
            queue.put_nowait(event)
        self.subscribers.append(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue) -> None:
        if queue in self.subscribers:
            self.subscribers.remove(queue)

    def _publish(self, event: tuple) -> None:  # loop side, via call_soon_threadsafe
        self.events.append(event)
        if event[0] == "done":
            self.ended.set()
        for queue in self.subscribers:
            queue.put_nowait(event)

    def usage(self) -> dict[str, Any]:
        return {"prompt_tokens": len(self.prompt), "completion_tokens": len(self.tokens),
                "total_tokens": len(self.prompt) + len(self.tokens),
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


class Engine:
    """The engine thread around ``server``; ``tokenizer`` decodes; ``metrics`` (``lcx.service.metrics.Metrics``)
    is updated after every step. ``draining``: set on SIGTERM (the app answers new requests 503)."""

    def __init__(self, server: Server, tokenizer, metrics, *, eos_id: int | None, scorer: Scorer | None = None,
                 heartbeat: float | None = None):
        self.server, self.tokenizer, self.metrics, self.eos_id = server, tokenizer, metrics, eos_id
        self.scorer = scorer  # for requests that want log-probabilities (without one they end with an error)
        # seconds idle before ``server.sync()`` (a ``Lockstep``'s heartbeat: the followers wait in a collective)
        self.heartbeat = heartbeat
        self._cv = threading.Condition()
        self._pending: list[tuple[str, Generation]] = []
        self._by_request: dict[int, Generation] = {}
        self._closed = False
        self.draining = False
        self.failed: str | None = None  # the serving loop's last failure (health answers 503 once it is set)
        self._thread = threading.Thread(target=self._run, name="lcx-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------------------- handler side
    def submit(self, gen: Generation) -> None:
        """Queue ``gen``; the caller has checked it fits (``Server.check``)."""
        with self._cv:
            self._pending.append(("submit", gen))
            self._cv.notify()

    def cancel(self, gen: Generation) -> None:
        """End ``gen`` (a client went away): its pages return before the next segment."""
        with self._cv:
            self._pending.append(("cancel", gen))
            self._cv.notify()

    @property
    def idle(self) -> bool:
        with self._cv:
            return not self._pending and not self._by_request

    @property
    def running(self) -> bool:
        """The engine thread is alive (``close`` may time out on a step that does not end)."""
        return self._thread.is_alive()

    def close(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout)

    # ------------------------------------------------------------------------------------------- engine thread
    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._pending and not self.server.busy and not self._closed:
                    if not self._cv.wait(self.heartbeat):  # timed out: only with a heartbeat
                        break
                if self._closed:
                    break
                commands, self._pending = self._pending, []
            for what, gen in commands:
                self._apply(what, gen)
            if not self.server.busy and self.heartbeat is not None:
                self.server.sync()  # what changed (a cancel) or nothing: the followers hear from process 0
            if self.server.busy:
                try:
                    done = self.server.step(self._on_token)
                except Exception:  # a bug, not bad input: fail what runs, keep serving the rest
                    self._fail(traceback.format_exc())
                    continue
                for request_id, tokens in done.items():
                    gen = self._by_request.get(request_id)
                    if gen is not None and not gen.finished:
                        ended_by_eos = bool(tokens) and tokens[-1] == self.eos_id and not gen.ignore_eos
                        self._finish(gen, "stop" if ended_by_eos else "length")
            self.metrics.observe_server(self.server)

    def _apply(self, what: str, gen: Generation) -> None:
        if what == "submit":
            if gen.finished:  # cancelled before it was submitted
                return
            gen.detok = Detokenizer(self.tokenizer)
            if gen.max_tokens == 0:  # echo of the prompt's log-probabilities: nothing to generate
                self._finish(gen, "length")
                return
            if gen.top is not None and gen.max_tokens == 1 and gen.sampling.temperature == 0:
                self._score_one_greedy(gen)
                return
            try:
                gen.request_id = self.server.submit(gen.prompt, gen.max_tokens, gen.sampling, gen.seed,
                                                    ignore_eos=gen.ignore_eos, salt=gen.salt)
            except Exception:  # the handler checked it; a refusal here is a bug, and only this request's
                log.error("request %s refused by the serving loop:\n%s", gen.id, traceback.format_exc())
                self._finish(gen, "error")
                return
            self._by_request[gen.request_id] = gen
            self.metrics.prompt_tokens.inc(len(gen.prompt))
        elif not gen.finished:
            if gen.request_id is not None:
                self.server.cancel(gen.request_id)
            self._finish(gen, "cancelled")

    def _on_token(self, request_id: int, token: int) -> None:
        gen = self._by_request.get(request_id)
        if gen is None or gen.finished:
            return
        now = time.monotonic()
        if not gen.tokens:
            gen.cached_tokens = self.server.cached_of(request_id)
            self.metrics.cached_tokens.inc(gen.cached_tokens)
            self.metrics.ttft.observe(now - gen.arrival)
        else:
            self.metrics.itl.observe(now - gen.last_token_at)
        gen.last_token_at = now
        gen.tokens.append(token)
        self.metrics.generation_tokens.inc()
        before = len(gen.text)
        gen.text += gen.detok.add(token)
        # a stop string that ends in the new text begins at most (longest stop - 1) characters before it
        reach = max(0, before - max((len(s) for s in gen.stops), default=1) + 1)
        stop_at = min((i for i in (gen.text.find(s, reach) for s in gen.stops) if i >= 0), default=-1)
        if stop_at >= 0:
            gen.text = gen.text[:stop_at]
            self.server.cancel(request_id)  # ends it now: its pages are free for the next step
            self._finish(gen, "stop")
            return
        text, safe = gen.text, len(gen.text)
        for stop in gen.stops:  # text that may begin a stop string waits until it cannot
            for k in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:k]):
                    safe = min(safe, len(text) - k)
                    break
        self._send(gen, safe)

    def _send(self, gen: Generation, upto: int) -> None:
        if upto > gen.sent:
            gen.loop.call_soon_threadsafe(gen._publish, ("text", gen.text[gen.sent:upto]))
            gen.sent = upto

    def _finish(self, gen: Generation, reason: str) -> None:
        if reason == "length" and gen.detok is not None:  # a trailing incomplete character becomes one U+FFFD
            gen.text += gen.detok.flush()
        if reason in ("stop", "length") and gen.top is not None and not gen.top_done and not self._score(gen):
            reason = "error"
        if reason in ("stop", "length"):
            self._send(gen, len(gen.text))
        gen.finish_reason = reason
        self.metrics.finished.labels(reason).inc()
        if gen.request_id is not None:
            self._by_request.pop(gen.request_id, None)
        gen.loop.call_soon_threadsafe(gen._publish, ("done", reason))

    def _score(self, gen: Generation) -> bool:
        """Score ``gen``'s prompt + tokens into ``gen.scored``; False if that failed (this request's failure, not
        the loop's: it ends with an error, the others go on)."""
        ids = list(gen.prompt) + list(gen.tokens)
        if self.scorer is None:
            log.error("request %s wants log-probabilities: this server has no scorer (lcx serve across processes "
                      "scores nothing yet)", gen.id)
            return False
        if len(ids) < 2:  # a one-token prompt and nothing generated: no conditional probability to report
            gen.scored = Scored(np.zeros(0, np.float32), np.zeros((0, 0), np.float32), np.zeros((0, 0), np.int32))
            return True
        try:
            gen.scored = self.scorer.score(ids)
        except Exception:
            log.error("scoring request %s failed:\n%s", gen.id, traceback.format_exc())
            return False
        return True

    def _score_one_greedy(self, gen: Generation) -> None:
        """A greedy one-token request with log-probabilities (a harness's log-likelihood request) in one scoring
        pass, without the server: the prompt's last position scored with a placeholder after it gives the greedy
        token (its most likely) and that token's log-probability (position i's distribution does not depend on
        token i). The token is the scorer's argmax; the numbers are those of scoring prompt + token."""
        gen.tokens = [0]
        if not self._score(gen):
            self._finish(gen, "error")
            return
        s = gen.scored
        token = int(s.top_ids[-1, 0])
        s.logprobs[-1] = s.top_logprobs[-1, 0]
        gen.tokens = [token]
        self.metrics.generation_tokens.inc()
        gen.text = gen.detok.add(token) + gen.detok.flush()
        stop_at = min((i for i in (gen.text.find(x) for x in gen.stops) if i >= 0), default=-1)
        if stop_at >= 0:
            gen.text = gen.text[:stop_at]
        ended = stop_at >= 0 or (token == self.eos_id and not gen.ignore_eos)
        gen.top_done = True
        self._finish(gen, "stop" if ended else "length")

    def _fail(self, trace: str) -> None:
        self.failed = trace.strip().splitlines()[-1][:200]
        log.error("the serving loop failed; its running requests end with an error:\n%s", trace)
        for gen in list(self._by_request.values()):
            if gen.request_id is not None:
                try:
                    self.server.cancel(gen.request_id)
                except Exception:  # the state may be unusable; the request ends anyway
                    pass
            self._finish(gen, "error")


class Detokenizer:
    """Text of a growing token list, decoding only its last tokens: ``add(token)`` returns the new text (empty
    while it ends in an incomplete UTF-8 character), ``flush()`` what is held back. The window starts one step back,
    so tokenizers whose decoding depends on the previous token (SentencePiece's leading space) decode as in the
    whole; the concatenated text equals ``tokenizer.decode(tokens)``."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.prefix = self.read = 0  # window start; tokens already turned into text

    def add(self, token: int) -> str:
        self.tokens.append(int(token))
        return self._new(final=False)

    def flush(self) -> str:
        return self._new(final=True)

    def _new(self, final: bool) -> str:
        done = self.tokenizer.decode(self.tokens[self.prefix:self.read])
        text = self.tokenizer.decode(self.tokens[self.prefix:])
        if len(text) <= len(done) or (text.endswith("\ufffd") and not final):
            return ""
        self.prefix, self.read = self.read, len(self.tokens)
        return text[len(done):]


__all__ = ["Detokenizer", "Engine", "Generation"]
