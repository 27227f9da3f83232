"""Replicas behind one request stream (``lcx.engine.server_group.ServerGroup``, ``lcx serve --data-parallel-size``):
the same tokens as one server for greedy and unseeded sampled requests whichever replica serves them, a conversation's
next turn routed to the replica holding its history (its pages read, not prefilled), the least loaded replica
otherwise, and cancellation by the group's ids. Two replicas on one device here; on 8 fake devices, each on its own
group of them: tests/multidevice/test_serve_mesh.py."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import lcx
from lcx.engine.sampling import SamplingConfig
from lcx.engine.server import Server
from lcx.engine.server_group import ServerGroup

CFG = lcx.ModelConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                      max_position_embeddings=256)
PROMPTS = [np.random.default_rng(i).integers(0, 61, n).tolist() for i, n in enumerate((19, 9, 25, 4, 12), 1)]
HOT = SamplingConfig(temperature=0.9, top_k=8)


def server(params) -> Server:
    return Server(CFG, params, max_num_seqs=2, max_len=64, segment=3, prefill_chunk=8, prefix_entries=4,
                  cache=lcx.CacheConfig(layout="paged", page_size=8))


@pytest.fixture(scope="module")
def params():
    return lcx.init_params(CFG, jax.random.key(5))


def serve(target, requests):
    ids = [target.submit(p, n, sampling) for p, n, sampling in requests]
    done = target.run()
    return [done[i] for i in ids]


def test_server_group_gives_one_servers_tokens_greedy_and_sampled(params):
    requests = [(p, 5, HOT if i % 2 else None) for i, p in enumerate(PROMPTS)]
    group = ServerGroup([server(params), server(params)])
    assert serve(group, requests) == serve(server(params), requests)
    assert all(s.prefill_tokens > 0 for s in group.servers)  # both replicas served requests


def test_server_group_routes_a_next_turn_to_the_replica_holding_its_history(params):
    group = ServerGroup([server(params), server(params)])
    first = [group.submit(p, 4) for p in (PROMPTS[1], PROMPTS[0])]  # the least loaded: one per replica
    done = group.run()
    assert [group._where[i][0] for i in first] == [0, 1]
    turn = PROMPTS[0] + done[first[1]] + [7, 8, 9]  # the second conversation's next turn (19 prompt tokens)
    assert group.route(turn) == 1  # not the first replica, which is as idle
    request = group.submit(turn, 3)
    group.step()
    assert group.cached_of(request) == 16  # its prompt's two whole pages were kept on replica 1: read, not prefilled
    group.run()


def test_server_group_cancels_by_its_own_ids(params):
    group = ServerGroup([server(params), server(params)])
    ids = [group.submit(p, 8) for p in PROMPTS[:3]]
    group.step()
    assert group.cancel(ids[2]) and not group.cancel(ids[2]) and not group.cancel(99)
    done = group.run()
    assert sorted(done) == ids[:2] and ids[2] in group.cancelled
    with pytest.raises(ValueError, match="2 or more servers"):
        ServerGroup([server(params)])


def test_lcx_serve_data_parallel_answers_the_openai_client_as_one_replica(tmp_path, monkeypatch):
    """``build_service`` with ``--data-parallel-size 2`` (both replicas on this one device: ``ServeConfig.meshes``
    puts them on their own devices where there are enough, tests/multidevice/test_serve_mesh.py) serves concurrent
    chat requests through the ``openai`` client with one replica's answers, over twice its pool."""
    from concurrent.futures import ThreadPoolExecutor

    from lcx.service.config import ServeConfig
    from tests.test_service import Running, _free_port
    from tests.tiny_chat_model import write_model

    path = write_model(tmp_path / "tiny")
    lm = lcx.load(path)
    asks = [[{"role": "user", "content": text}] for text in ("hello there", "the cache", "a long context", "one")]

    def answers(data: int):
        running = Running(ServeConfig(model=str(path), port=_free_port(), max_num_seqs=2, max_model_len=256,
                                      page_size=8, served_model_name="tiny", data_parallel_size=data), lm)
        try:
            client = running.client()
            with ThreadPoolExecutor(len(asks)) as pool:
                got = list(pool.map(lambda m: client.chat.completions.create(
                    model="tiny", messages=m, max_tokens=6, temperature=0), asks))
            return ([(c.choices[0].message.content, c.choices[0].finish_reason) for c in got],
                    running.metrics()["lcx_kv_pages_total"], running.service.server)
        finally:
            running.stop()

    monkeypatch.setattr(ServeConfig, "meshes", lambda self, model, devices=None: [None] * self.data_parallel_size)
    got, pages, group = answers(2)
    want, one_pool, _ = answers(1)
    assert isinstance(group, ServerGroup) and all(s.prefill_tokens > 0 for s in group.servers)
    assert got == want and pages == 2 * one_pool
