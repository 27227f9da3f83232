"""Rows over a ``data`` axis (``lcx serve --data-parallel-size D``): ``ServerGroup`` holds ``D`` ``Server`` replicas,
each on its own group of ``--tensor-parallel-size`` devices with a page pool of its own - a pool per data shard: a
row and its pages live on one group of devices, so no step crosses groups and the pools never have to agree - and
gives them one request stream with the ``Server``'s interface (what ``lcx.service.engine.Engine`` drives).

Routing, per request at submit: the replica that keeps the most leading pages of its prompt (a conversation's next
turn goes where its history is), else the least loaded (running + waiting requests, then pages in use), else the
first. Request ids are the group's (0, 1, ... in submission order); an unseeded request's random stream is keyed by
that id, as a single server keys it by its own - so which replica serves a request changes none of its tokens (its
tokens never depend on its batch-mates either). One ``PageStore`` may serve every replica: its keys are the
model's and the tokens', not a replica's. Replicas step one after the other in the engine's thread; on a GPU each
replica's step is dispatched asynchronously, so their device work overlaps only where a step does not wait on the
host (it does, once per step, for its tokens).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


class ServerGroup:
    """``D`` ``Server`` replicas behind one request stream; see the module docstring."""

    def __init__(self, servers: Sequence):
        if len(servers) < 2:
            raise ValueError(f"a ServerGroup holds 2 or more servers, got {len(servers)}: use the Server itself")
        self.servers = list(servers)
        first = self.servers[0]
        self.config, self.page, self.max_len, self.segment = first.config, first.page, first.max_len, first.segment
        self.rows = sum(s.rows for s in self.servers)
        self.next_id = 0
        self._where: dict[int, tuple[int, int]] = {}  # group id -> (replica, the replica's id)
        self._ids: list[dict[int, int]] = [{} for _ in self.servers]  # per replica: its id -> the group's

    # ----------------------------------------------------------------------------------------------- requests
    def submit(self, prompt: Sequence[int], max_new_tokens: int, sampling=None, seed: int | None = None, *,
               ignore_eos: bool = False, salt: str | None = None) -> int:
        """``Server.submit`` on the replica ``route`` picks; returns the group's request id."""
        request_id = self.next_id
        replica = self.route(prompt, salt)
        local = self.servers[replica].submit(prompt, max_new_tokens, sampling, request_id if seed is None else seed,
                                             ignore_eos=ignore_eos, salt=salt)
        self.next_id += 1
        self._where[request_id] = (replica, local)
        self._ids[replica][local] = request_id
        return request_id

    def route(self, prompt: Sequence[int], salt: str | None = None) -> int:
        """The replica a request with ``prompt`` goes to (see the module docstring)."""
        def rank(i: int):
            s = self.servers[i]
            return (-s.prefixes.kept_pages_of(prompt, salt), s.running + s.waiting, s.pages_used(), i)
        return min(range(len(self.servers)), key=rank)

    def check(self, prompt: int, max_new_tokens: int) -> None:
        self.servers[0].check(prompt, max_new_tokens)  # every replica has the same configuration

    def cancel(self, request_id: int) -> bool:
        where = self._where.get(request_id)
        if where is None:
            return False
        replica, local = where
        return self.servers[replica].cancel(local)

    def cached_of(self, request_id: int) -> int:
        where = self._where.get(request_id)
        return 0 if where is None else self.servers[where[0]].cached_of(where[1])

    # ----------------------------------------------------------------------------------------------- steps
    def step(self, on_token: Callable[[int, int], None] | None = None, done: dict | None = None) -> dict:
        """One step of every busy replica; finished requests' tokens (by the group's ids) go into ``done``."""
        done = {} if done is None else done
        for replica, server in enumerate(self.servers):
            if not server.busy:
                continue
            ids = self._ids[replica]
            emit = None if on_token is None else (lambda local, token, ids=ids: on_token(ids[local], token))
            for local, tokens in server.step(emit).items():
                done[ids[local]] = tokens
        return done

    def run(self, on_token: Callable[[int, int], None] | None = None) -> dict[int, list[int]]:
        done: dict[int, list[int]] = {}
        while self.busy:
            self.step(on_token, done)
        return done

    # ----------------------------------------------------------------------------------------------- state
    @property
    def cancelled(self) -> dict[int, BaseException | None]:
        """Every cancelled request (the group's ids) -> why, as ``Server.cancelled``: the replicas' records."""
        return {self._ids[r][local]: why for r, s in enumerate(self.servers) for local, why in s.cancelled.items()}

    @property
    def busy(self) -> bool:
        return any(s.busy for s in self.servers)

    @property
    def running(self) -> int:
        return sum(s.running for s in self.servers)

    @property
    def waiting(self) -> int:
        return sum(s.waiting for s in self.servers)

    def pages_used(self) -> int:
        return sum(s.pages_used() for s in self.servers)

    @property
    def pages(self) -> int:
        return sum(s.pages for s in self.servers)

    @property
    def store(self):
        return self.servers[0].store

    @store.setter
    def store(self, value) -> None:
        for s in self.servers:
            s.store = value

    @property
    def prefill_tokens(self) -> int:
        return sum(s.prefill_tokens for s in self.servers)

    @property
    def cached_tokens(self) -> int:
        return sum(s.cached_tokens for s in self.servers)


__all__ = ["ServerGroup"]
