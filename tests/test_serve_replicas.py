"""Replicas of ``lcx serve`` on one ``--kv-store`` directory, and ``cache_salt`` over HTTP.

A conversation's first turn on replica A and its second (the history + a new message) on replica B: B reads A's
stored pages (``usage.prompt_tokens_details.cached_tokens`` >= 90% of its prompt) and answers with the text one
replica gives. In-process (two services, each on its own uvicorn thread) in the fast tier; as two real ``lcx serve``
processes in the slow one. ``cache_salt``: the same prompt under two salts shares no page (the second reports 0
cached tokens), under one salt it does, and a bad salt is a 400 naming the field."""

from __future__ import annotations

import os
import signal
import tempfile
import time

import httpx
import pytest

import lcx
from lcx.data.haystack import NOISE
from lcx.service.config import ServeConfig
from tests.test_service import Running, _free_port
from tests.test_service_drills import ServeProcess
from tests.tiny_chat_model import write_model

PAGE = 8
MAX_LEN = 512
SYSTEM = (NOISE * 12).strip()  # ~300 tokens of prose: the history the second turn resends
FIRST_TURN = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Say hi."}]
NEW_TURN = {"role": "user", "content": "Again."}


def _cached(response) -> int:
    return response.usage.prompt_tokens_details.cached_tokens


def _chat(client, messages, **kw):
    return client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0, **kw)


def _second_turn(first) -> list[dict]:
    return FIRST_TURN + [{"role": "assistant", "content": first.choices[0].message.content}, NEW_TURN]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("replicas") / "tiny")


@pytest.fixture(scope="module")
def replicas(model_dir, tmp_path_factory):
    """Two services (A, B) on one ``--kv-store`` directory, as two replicas behind a load balancer."""
    lm = lcx.load(model_dir)
    store = tmp_path_factory.mktemp("shared-store")
    started = []
    try:
        for _ in range(2):
            started.append(Running(ServeConfig(model=str(model_dir), port=_free_port(), max_num_seqs=2,
                                               max_model_len=MAX_LEN, page_size=PAGE, segment=4, prefill_chunk=64,
                                               served_model_name="tiny", kv_store=str(store)), lm))
        yield started
    finally:
        for running in started:
            running.stop()


def test_a_conversation_moved_to_another_replica_reads_its_history_from_the_shared_store(replicas):
    a, b = replicas
    first = _chat(a.client(), FIRST_TURN)
    moved = _chat(b.client(), _second_turn(first))  # the load balancer sends the next turn to B
    n = moved.usage.prompt_tokens
    print(f"\nsecond turn on the other replica: {_cached(moved)}/{n} prompt tokens cached "
          f"({_cached(moved) / n:.3f})")
    assert _cached(first) == 0 and _cached(moved) >= 0.9 * n
    stayed = _chat(a.client(), _second_turn(first))  # the same turn on the replica that served the first
    assert moved.choices[0].message.content == stayed.choices[0].message.content
    assert moved.choices[0].finish_reason == stayed.choices[0].finish_reason


def test_two_salts_share_no_page_one_salt_does(replicas):
    """The same prompt (never sent before) under salt x, then y, then x, then none - on either replica: y and
    none read nothing of x's pages (the device's kept ones nor the store's), x reads its own."""
    a, b = replicas

    def complete(server, salt=None):
        extra = {} if salt is None else {"extra_body": {"cache_salt": salt}}
        return server.client().completions.create(model="tiny", prompt="Salted. " + SYSTEM[:600], max_tokens=8,
                                                  temperature=0, **extra)

    x, y, x_again = complete(a, "tenant-x"), complete(a, "tenant-y"), complete(a, "tenant-x")
    x_moved, y_moved, plain = complete(b, "tenant-x"), complete(b, "tenant-y"), complete(b)
    whole = (x.usage.prompt_tokens - 1) // PAGE * PAGE
    assert (_cached(x), _cached(y), _cached(plain)) == (0, 0, 0)
    assert _cached(x_again) == _cached(x_moved) == _cached(y_moved) == whole
    assert len({r.choices[0].text for r in (x, y, x_again, x_moved, y_moved, plain)}) == 1  # the same text
    entries = a.service.server.prefixes.entries.values()
    kept = {salt: {k for e in entries if e.salt == salt for k in e.keys} for salt in ("tenant-x", "tenant-y")}
    assert kept["tenant-x"] and kept["tenant-y"] and not kept["tenant-x"] & kept["tenant-y"]


@pytest.mark.parametrize("path", ["/chat/completions", "/completions"])
@pytest.mark.parametrize("salt", ["", 7, "s" * 257, ["a"]])
def test_a_bad_cache_salt_is_a_400_naming_it(replicas, path, salt):
    a = replicas[0]
    body = {"model": "tiny", "max_tokens": 2, "cache_salt": salt}
    body |= {"messages": [{"role": "user", "content": "x"}]} if path.startswith("/chat") else {"prompt": "x"}
    r = httpx.post(a.url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "cache_salt" and "cache_salt" in r.json()["error"]["message"]
    assert httpx.get(a.base + "/health", timeout=5).status_code == 200


# --------------------------------------------------------------------------------------------------- processes
def _env() -> dict:
    """The servers' environment: CPU, and the suite's persistent compilation cache (tests/conftest.py names it)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    env.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "lcx-tests-jax-cache"))
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    return env


@pytest.mark.slow
def test_two_serve_processes_on_one_store_continue_each_others_conversations(model_dir, tmp_path):
    """Two ``lcx serve`` processes (two ports) on one ``--kv-store``: a conversation's first turn on A, its second
    on B - B reads A's pages from the directory and answers as A does."""
    store = tmp_path / "store"
    servers = [ServeProcess(model_dir, tmp_path, name, _env(), "--kv-store", str(store)) for name in "AB"]
    started = time.monotonic()
    try:
        # one after the other: JAX writes a persistent compilation cache entry in place, so a process starting
        # beside one that writes it may read half an entry (and fail to start) - a test harness's hazard, not lcx's
        a = servers[0].start().wait_ready()
        b = servers[1].start().wait_ready()
        ready = time.monotonic() - started
        first = _chat(a.client(), FIRST_TURN)
        moved = _chat(b.client(), _second_turn(first))
        stayed = _chat(a.client(), _second_turn(first))
    finally:
        for s in servers:
            if s.proc is not None:
                s.stop(signal.SIGKILL, timeout=10)
    n = moved.usage.prompt_tokens
    print(f"\ntwo processes ready in {ready:.1f} s; second turn on B: {_cached(moved)}/{n} prompt tokens cached "
          f"({_cached(moved) / n:.3f})")
    assert _cached(first) == 0 and _cached(moved) >= 0.9 * n
    assert moved.choices[0].message.content == stayed.choices[0].message.content
