"""One ``Server`` across processes (multi-host serving): every process builds the same ``Server`` on the global mesh
and runs the same ``step`` sequence; process 0 alone takes requests.

    server = Server(config, params, setup=setup)        # in every process, on a mesh over every process's devices
    if jax.process_index() == 0:
        lead = Lockstep(server)                          # a Server: submit / cancel / step / run, as on one host
        ids = [lead.submit(p, max_new_tokens=64) for p in prompts]
        outputs = lead.run()
        lead.close()                                     # the followers return
    else:
        follow(server)                                   # the same steps, until process 0 closes

Why lockstep works: a step's host decisions (admission, pages, which rows prefill or decode) depend only on the
requests submitted and cancelled before it and on the tokens earlier steps produced - the same on every process, as
every process reads the step's tokens whole (``sharding.to_host``). So before each step process 0 broadcasts what
changed since the last one (``jax.experimental.multihost_utils.broadcast_one_to_all``: the message's length, then
its JSON bytes padded to a power of two - a few compiled shapes), and every follower applies the same changes in the
same order, then steps. A follower whose request ids differ from process 0's raises: the processes diverged.

A cancel from inside ``on_token`` (a stop string) is deferred to the end of the step - a follower cannot replay it
in the middle of one - and the request streams nothing more meanwhile; its pages return one step later.

Process 0 broadcasts at every step, and ``sync`` (a heartbeat, when idle) and ``close`` (the followers return) in
between: each is a collective, so only one thread may call them - the one that steps.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import traceback
from collections.abc import Callable, Sequence

import jax
import numpy as np

from lcx.engine.sampling import SamplingConfig

log = logging.getLogger("lcx.serve")

MIN_PAYLOAD = 256  # bytes: smaller messages are padded to this (one compiled broadcast for most steps)


# --------------------------------------------------------------------------------------------------- the channel
def broadcast(message: dict | None) -> dict:
    """``message`` (process 0's; None elsewhere) on every process: its length, then its JSON bytes padded to a power
    of two of at least ``MIN_PAYLOAD``. A collective: every process must call it, in the same order."""
    from jax.experimental import multihost_utils

    lead = jax.process_index() == 0
    data = json.dumps(message, separators=(",", ":")).encode() if lead else b""
    n = int(np.asarray(multihost_utils.broadcast_one_to_all(np.int32(len(data)))))
    size = max(MIN_PAYLOAD, 1 << max(n - 1, 0).bit_length())
    buf = np.zeros(size, np.uint8)
    if lead:
        buf[:n] = np.frombuffer(data, np.uint8)
    buf = np.asarray(multihost_utils.broadcast_one_to_all(buf))
    return json.loads(bytes(buf[:n]).decode())


def _submission(request_id: int, prompt, max_new_tokens: int, sampling: SamplingConfig | None, seed: int | None,
                ignore_eos: bool, salt: str | None) -> dict:
    return {"op": "submit", "id": int(request_id), "prompt": [int(t) for t in np.asarray(prompt).reshape(-1)],
            "max_new_tokens": int(max_new_tokens),
            "sampling": None if sampling is None else dataclasses.asdict(sampling),
            "seed": None if seed is None else int(seed), "ignore_eos": bool(ignore_eos), "salt": salt}


def apply(server, ops: list[dict]) -> None:
    """Process 0's changes ``ops`` on ``server`` (a follower's), in order."""
    for op in ops:
        if op["op"] == "submit":
            sampling = None if op["sampling"] is None else SamplingConfig(**op["sampling"])
            got = server.submit(op["prompt"], op["max_new_tokens"], sampling, op["seed"],
                                ignore_eos=op["ignore_eos"], salt=op["salt"])
            if got != op["id"]:
                raise RuntimeError(f"lockstep diverged: process {jax.process_index()} gave request id {got} where "
                                   f"process 0 gave {op['id']} (every process must build the same Server)")
        elif op["op"] == "cancel":
            server.cancel(op["id"])
        else:
            raise RuntimeError(f"lockstep message op={op['op']!r} is unknown: allowed 'submit', 'cancel'")


# --------------------------------------------------------------------------------------------------- process 0
class Lockstep:
    """Process 0's ``Server`` (``server``), driven in lockstep with the followers' (``follow``): ``submit``,
    ``cancel``, ``step`` and ``run`` as the ``Server``'s (every other attribute is the server's), ``sync`` (a
    heartbeat while idle: the followers' wait for the next message is bounded by the collectives' timeout) and
    ``close`` (the followers return; idempotent)."""

    def __init__(self, server):
        if jax.process_index() != 0:
            raise RuntimeError(f"Lockstep runs on process 0 only (this is process {jax.process_index()}): the "
                               "others run lcx.engine.lockstep.follow(server)")
        self.server = server
        self._ops: list[dict] = []  # changes since the last message
        self._stepping = False
        self._deferred: dict[int, Exception | None] = {}  # cancelled during the step: request id -> error or None
        self.closed = False

    def __getattr__(self, name):  # busy, waiting, running, check, cached_of, ...: the server's
        server = self.__dict__.get("server")
        if server is None:
            raise AttributeError(name)
        return getattr(server, name)

    def submit(self, prompt: Sequence[int], max_new_tokens: int, sampling: SamplingConfig | None = None,
               seed: int | None = None, *, ignore_eos: bool = False, salt: str | None = None) -> int:
        """``Server.submit``; the followers queue the same request before the next step."""
        self._check_open()
        request_id = self.server.submit(prompt, max_new_tokens, sampling, seed, ignore_eos=ignore_eos, salt=salt)
        self._ops.append(_submission(request_id, prompt, max_new_tokens, sampling, seed, ignore_eos, salt))
        return request_id

    def cancel(self, request_id: int) -> bool:
        """``Server.cancel``; during a step (from ``on_token``) deferred to its end - the request streams nothing
        more meanwhile - and True if it was waiting or running."""
        self._check_open()
        if self._stepping:
            live = (self.server.scheduler.find(request_id) is not None
                    or any(r.id == request_id for r in self.server.scheduler.queue))
            if live and request_id not in self._deferred:
                self._deferred[int(request_id)] = None
                return True
            return False
        ended = self.server.cancel(request_id)
        self._ops.append({"op": "cancel", "id": int(request_id)})
        return ended

    def step(self, on_token: Callable[[int, int], None] | None = None, done: dict | None = None) -> dict:
        """``Server.step`` on every process: the changes since the last step go to the followers first."""
        self._send(step=True)
        done = {} if done is None else done
        deferred = self._deferred

        def emit(request_id: int, token: int) -> None:
            if request_id in deferred or on_token is None:
                return
            try:
                on_token(request_id, token)
            except Exception as error:  # its request ends (at the step's end), the others go on
                deferred[request_id] = error

        self._stepping = True
        try:
            self.server.step(emit, done)
        finally:
            self._stepping = False
            self._deferred = {}
            for request_id, error in deferred.items():
                done.pop(request_id, None)
                if self.server.cancel(request_id):
                    self.server.cancelled[request_id] = error
                self._ops.append({"op": "cancel", "id": request_id})
        return done

    def run(self, on_token: Callable[[int, int], None] | None = None) -> dict[int, list[int]]:
        """``Server.run``: every queued request served, every step in lockstep."""
        done: dict[int, list[int]] = {}
        while self.server.busy:
            self.step(on_token, done)
        return done

    def sync(self) -> None:
        """The changes so far to the followers, no step (a heartbeat while idle)."""
        self._send(step=False)

    def close(self) -> None:
        """The followers apply the last changes and return from ``follow``."""
        if not self.closed:
            self._send(step=False, stop=True)
            self.closed = True

    def _send(self, step: bool, stop: bool = False) -> None:
        self._check_open()
        ops, self._ops = self._ops, []
        broadcast({"ops": ops, "step": step, "stop": stop})

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("Lockstep is closed: the followers have returned")


# --------------------------------------------------------------------------------------------------- the others
def follow(server) -> int:
    """A follower's loop (processes 1 .. n-1): receive process 0's changes, apply them to ``server`` (built as
    process 0's), step when process 0 steps; return the number of steps once process 0 closes. A step that raises
    is logged and the loop goes on, as process 0's engine goes on (it cancels what ran, and those cancels arrive)."""
    if jax.process_index() == 0:
        raise RuntimeError("follow runs on processes 1 .. n-1: process 0 drives them with Lockstep(server)")
    steps = 0
    while True:
        message = broadcast(None)
        apply(server, message["ops"])
        if message["stop"]:
            return steps
        if message["step"]:
            steps += 1
            try:
                server.step()
            except Exception:
                log.error("lockstep step %d failed on process %d:\n%s", steps, jax.process_index(),
                          traceback.format_exc())


__all__ = ["Lockstep", "apply", "broadcast", "follow"]
