"""The serving loop: continuous batching over a paged cache under page pressure gives every request the tokens of
generating it alone, streams them in order, shares a system prompt's pages across requests, and returns every
page when done."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import lcx
from lcx.cache.base import CacheCapacityError
from lcx.config import ConfigError
from lcx.engine.server import Server

CFG = lcx.ModelConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                      max_position_embeddings=256)
SYSTEM = np.random.default_rng(0).integers(0, 61, 26).tolist()  # 3 whole pages of 8
PROMPTS = [SYSTEM + np.random.default_rng(i).integers(0, 61, n).tolist()
           for i, n in enumerate((3, 12, 5, 9, 1, 7), start=1)]
NEW = (4, 10, 6, 3, 8, 5)


@pytest.fixture(scope="module")
def params():
    return lcx.init_params(CFG, jax.random.key(3))


def test_server_tokens_equal_generating_each_request_alone(params):
    plain = lcx.generate(CFG, params, PROMPTS, max_new_tokens=max(NEW))
    eos = int(plain.tokens[1, 2])  # a token request 1 emits third: requests end at EOS as well as at their limit
    alone = lcx.generate(CFG, params, PROMPTS, max_new_tokens=max(NEW), eos_id=eos)
    # 3 rows but a pool of 12 pages: a request may own up to 6, so admissions wait for pages as well as rows
    server = Server(CFG, params, max_num_seqs=3, max_len=56, pages=12, eos_id=eos, segment=4, prefill_chunk=16,
                    cache=lcx.CacheConfig(layout="paged", page_size=8), prefix_entries=2)
    ids = [server.submit(p, max_new_tokens=n) for p, n in zip(PROMPTS, NEW)]
    streamed: dict[int, list[int]] = {i: [] for i in ids}
    out = server.run(on_token=lambda request, token: streamed[request].append(token))
    for i, n, row, length in zip(ids, NEW, alone.tokens, alone.lengths):
        want = row[:min(n, length)].tolist()
        assert out[i] == want and streamed[i] == want, f"request {i}"
    assert any(len(out[i]) < n for i, n in zip(ids, NEW))  # EOS ended some request early
    assert any(len(out[i]) == n for i, n in zip(ids, NEW))  # and some ran to their limit
    # the system prompt's 3 pages were prefilled for the first request only
    assert server.prefill_tokens == sum(map(len, PROMPTS)) - 3 * 8 * (len(PROMPTS) - 1)
    # every row released; the only references left are the kept prefixes'
    refs = np.asarray(server.state.refs)
    assert np.all(np.asarray(server.state.table) == -1)
    assert refs.sum() == sum(len(p.pages) for p in server._prefixes.values()) and server.committed == 0


def test_server_refuses_what_it_cannot_hold(params):
    with pytest.raises(ConfigError, match=r"cache.layout='contiguous' is invalid for Server"):
        Server(CFG, params, cache=lcx.CacheConfig())
    with pytest.raises(ConfigError, match=r"cache.policy='h2o' is invalid for Server.*allowed: 'full'"):
        Server(CFG, params, cache=lcx.CacheConfig(layout="paged", policy="h2o", budget=16))
    with pytest.raises(ConfigError, match=r"Server pages=2 is invalid: one request of max_len=32 needs 4 pages"):
        Server(CFG, params, max_len=32, pages=2, cache=lcx.CacheConfig(layout="paged", page_size=8))
    server = Server(CFG, params, max_len=32, cache=lcx.CacheConfig(layout="paged", page_size=8))
    with pytest.raises(CacheCapacityError, match=r"30 prompt \+ 8 new tokens exceeds the server's max_len=32"):
        server.submit(list(range(30)), max_new_tokens=8)
