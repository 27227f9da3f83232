"""Lockstep serving (``lcx.engine.lockstep``) on one process: process 0's messages, replayed on a second Server as a
follower applies them, give the follower the same requests, the same steps and the same tokens - sampled ones, kept
prefix pages and a cancel from ``on_token`` (deferred to the step's end) included. The multi-process run is
tests/multidevice/test_serve_lockstep.py."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import lcx
from lcx.engine import lockstep
from lcx.engine.sampling import SamplingConfig
from lcx.engine.server import Server

CFG = lcx.ModelConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                      max_position_embeddings=256)
SYSTEM = np.random.default_rng(0).integers(0, 61, 17).tolist()  # 2 whole pages of 8: kept and shared
PROMPTS = [SYSTEM + np.random.default_rng(i).integers(0, 61, n).tolist() for i, n in enumerate((3, 9, 5, 1), 1)]


def server(params) -> Server:
    return Server(CFG, params, max_num_seqs=2, max_len=48, segment=3, prefill_chunk=8, prefix_entries=2,
                  cache=lcx.CacheConfig(layout="paged", page_size=8))


@pytest.fixture(scope="module")
def replayed():
    params = lcx.init_params(CFG, jax.random.key(3))
    messages = []
    real = lockstep.broadcast
    lockstep.broadcast = lambda message: messages.append(message) or message  # process 0's side, recorded
    try:
        lead = lockstep.Lockstep(server(params))
        ids = [lead.submit(p, 5) for p in PROMPTS]
        ids.append(lead.submit(PROMPTS[0], 6, SamplingConfig(temperature=0.9, top_k=8), seed=7))
        stopped = lead.submit(PROMPTS[1], 6)
        streamed: dict[int, list[int]] = {}

        def on_token(request_id, token):
            streamed.setdefault(request_id, []).append(token)
            if request_id == stopped and len(streamed[request_id]) == 2:
                assert lead.cancel(request_id)  # a stop string: deferred to the step's end

        got = lead.run(on_token)
        lead.sync()
        lead.close()
    finally:
        lockstep.broadcast = real
    follower, followed = server(params), {}
    for message in messages:
        lockstep.apply(follower, message["ops"])
        if message["step"]:
            follower.step(done=followed)
    return dict(lead=lead, ids=ids, stopped=stopped, got=got, streamed=streamed, messages=messages,
                follower=follower, followed=followed)


def test_lockstep_follower_gets_process_0s_tokens(replayed):
    got, followed = replayed["got"], replayed["followed"]
    assert set(got) == set(replayed["ids"]) and all(len(got[i]) == 5 for i in replayed["ids"][:4])
    assert {i: list(t) for i, t in got.items()} == {i: list(followed[i]) for i in got}


def test_lockstep_cancel_from_on_token_waits_for_the_step_end(replayed):
    stopped, lead, follower = replayed["stopped"], replayed["lead"], replayed["follower"]
    assert len(replayed["streamed"][stopped]) == 2 and stopped not in replayed["got"]
    assert lead.server.cancelled == {stopped: None} and set(follower.cancelled) == {stopped}
    assert not follower.busy and follower.pages_used() == lead.server.pages_used()
    assert follower.cached_tokens == lead.server.cached_tokens > 0  # the system prompt's pages were shared


def test_lockstep_messages_end_with_close(replayed):
    messages = replayed["messages"]
    assert messages[-1]["stop"] and not any(m["stop"] for m in messages[:-1])
    assert sum(m["step"] for m in messages) == len(messages) - 2  # every step, then sync and close
    with pytest.raises(RuntimeError, match="Lockstep is closed"):
        replayed["lead"].submit(PROMPTS[0], 2)


def test_lockstep_follower_refuses_a_diverged_request_id(replayed):
    op = {"op": "submit", "id": 99, "prompt": [1, 2], "max_new_tokens": 2, "sampling": None, "seed": None,
          "ignore_eos": False, "salt": None}
    with pytest.raises(RuntimeError, match="lockstep diverged"):
        lockstep.apply(replayed["follower"], [op])


def test_lockstep_broadcast_on_one_process_returns_the_message():
    message = {"ops": [{"op": "cancel", "id": 3}], "step": True, "stop": False}
    assert lockstep.broadcast(message) == message
