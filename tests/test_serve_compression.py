"""One-shot compression in the server (issue 60): KVzip runs in ``lcx serve`` (its reconstruction passes after a
row's prompt, that row only), each request's tokens equal generating it alone, and a compressed row reserves only
the pages it can still fill - so at equal KV memory a one-shot policy admits a request the full cache makes wait."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import lcx
from lcx.cache.reconstruct import Reconstruction
from lcx.config import ConfigError
from lcx.engine import Generator
from lcx.engine.server import Server

CFG = lcx.ModelConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, init_std=0.1)
REPEAT = Reconstruction(first=(7, 8, 9), later=(10, 11), suffix=(12,), skip=1, tail=2)
MAX_LEN, NEW = 64, 6
LENGTHS = (41, 23, 37)


@pytest.fixture(scope="module")
def params():
    return lcx.init_params(CFG, jax.random.key(4))


def _prompts():
    rng = np.random.default_rng(2)
    return [rng.integers(0, CFG.vocab_size, n).tolist() for n in LENGTHS]


def _cache(policy: str, **kw) -> lcx.CacheConfig:
    # one-shot: budget + interval = max_len, the whole prompt read before the one compression
    extra = {"chunk": 16} if policy == "kvzip" else {}
    return lcx.CacheConfig(layout="paged", page_size=4, policy=policy, budget=12, interval=MAX_LEN - 12, **extra,
                           **kw)


def _alone(params, cache, prompt, reconstruction=None) -> list[int]:
    # planned for a server row (MAX_LEN slots), not per prompt length: the prompts of a test share one compiled
    # cache shape (the tokens are the same)
    gen = Generator(CFG, params, max_new_tokens=NEW, cache=cache, reconstruction=reconstruction, capacity=MAX_LEN)
    return gen.result(gen.decode(gen.prefill([prompt]))).tokens[0].tolist()


def test_kvzip_serves_each_request_as_generated_alone(params):
    cache = _cache("kvzip")
    server = Server(CFG, params, max_num_seqs=3, max_len=MAX_LEN, segment=4, prefill_chunk=16, cache=cache,
                    reconstruction=REPEAT)
    prompts = _prompts()
    ids = [server.submit(p, max_new_tokens=NEW, ignore_eos=True) for p in prompts]
    out = server.run()
    for rid, prompt in zip(ids, prompts):
        alone = _alone(params, lcx.CacheConfig(**cache.to_dict() | {"prefill_chunk": 16}), prompt, REPEAT)
        assert out[rid] == alone, f"request {rid} ({len(prompt)} tokens)"
    assert server.pages_used() == 0 and server.committed == 0


def test_a_compressed_row_reserves_what_it_can_still_fill(params):
    """A pool of 16 pages of 4 holds one 41 + 6 token request uncompressed (12 pages): under the full cache the
    second request waits for the first to end; under one-shot SnapKV the first holds 12 slots (3 pages) + 2 pages
    for its answer after its prompt, and the second runs beside it - with the tokens each generates alone."""
    prompts = _prompts()[:2]
    peaks = {}
    for policy in ("full", "snapkv"):
        cache = (lcx.CacheConfig(layout="paged", page_size=4) if policy == "full"
                 else _cache("snapkv", window=4, kernel=3))
        server = Server(CFG, params, max_num_seqs=2, max_len=MAX_LEN, pages=16, segment=2, prefill_chunk=16,
                        cache=cache, prefix_entries=0)
        ids = [server.submit(p, max_new_tokens=NEW, ignore_eos=True) for p in prompts]
        done, together = {}, 0
        while server.busy:
            server.step(done=done)
            together = max(together, server.running)
            assert int(server.state.peak) <= 16
        peaks[policy] = together
        for rid, prompt in zip(ids, prompts):
            assert done[rid] == _alone(params, lcx.CacheConfig(**cache.to_dict() | {"prefill_chunk": 16}), prompt)
        assert server.committed == 0 and server.pages_used() == 0
    assert peaks == {"full": 1, "snapkv": 2}


def test_kvzip_in_the_server_needs_its_repeat_prompt_and_one_shot_room(params):
    with pytest.raises(ConfigError, match=r"pass Server\(reconstruction=\.\.\.\)"):
        Server(CFG, params, max_len=MAX_LEN, cache=_cache("kvzip"))
    with pytest.raises(ConfigError, match=r"budget \+ interval = 28 < max_len=64.*cache.interval >= 52"):
        Server(CFG, params, max_len=MAX_LEN, reconstruction=REPEAT,
               cache=lcx.CacheConfig(layout="paged", page_size=4, policy="kvzip", budget=12, interval=16))


@pytest.mark.slow
def test_a_conversation_continues_its_compressed_state_across_a_restart(params, tmp_path):
    """Under an evicting policy the store keeps a finished request's compressed state; the next turn (its prompt:
    the history, the answer, a new message) starts from it in a new server on the same directory - the tokens of a
    ``Generator`` that continues the state (``prefill(state=...)``), not of compressing the history afresh."""
    from lcx.engine.kv_store import PageStore

    cache = lcx.CacheConfig(**_cache("snapkv", window=4, kernel=3).to_dict() | {"prefill_chunk": 16})
    first, extra = _prompts()[1], np.random.default_rng(9).integers(0, CFG.vocab_size, 9).tolist()

    def server():
        store = PageStore("test", page=4, directory=tmp_path)
        return Server(CFG, params, max_num_seqs=2, max_len=MAX_LEN, segment=4, prefill_chunk=16, cache=cache,
                      store=store), store

    one, _ = server()
    rid = one.submit(first, max_new_tokens=NEW, ignore_eos=True)
    answer = one.run()[rid]
    two, store = server()  # a restart: the state comes from its file
    rid = two.submit(first + answer + extra, max_new_tokens=NEW, ignore_eos=True)
    again = two.run()[rid]
    assert two.cached_tokens == len(first) + NEW - 1 and two.prefill_tokens == 1 + len(extra)
    gen = Generator(CFG, params, max_new_tokens=NEW, cache=cache, capacity=MAX_LEN)
    state = gen.decode(gen.prefill([first]))
    assert gen.result(state).tokens[0].tolist() == answer
    continued = gen.result(gen.decode(gen.prefill([answer[-1:] + extra], state=state))).tokens[0].tolist()
    assert again == continued
    fresh = _alone(params, cache, first + answer + extra)
    assert again != fresh  # the session's state, not a fresh compression of the history (else the test proves less)
    # a longer state of another layout (another server's pool) is skipped, never loaded: the longest that fits is
    store.put_state(np.asarray(first + answer + extra, np.int32), {"page.k": np.zeros((2, 1, 3), np.float32)})
    rid = two.submit(first + answer + extra + [5], max_new_tokens=NEW, ignore_eos=True)
    assert len(two.run()[rid]) == NEW and two.cached_tokens == 2 * (len(first) + NEW - 1)


def test_decode_evictions_stay_within_the_lowered_reservation(params):
    """Streaming with a small interval evicts while decoding (the row grows to budget + interval and back), so a
    row that may still generate ``interval`` tokens keeps its whole table reserved: in a pool of two rows and a
    half, two run at once, the third after - none past the pool, each with its tokens alone."""
    cache = lcx.CacheConfig(layout="paged", page_size=4, policy="streaming", budget=12, interval=8, sinks=2)
    server = Server(CFG, params, max_num_seqs=3, max_len=MAX_LEN, pages=10, segment=4, prefill_chunk=8,
                    cache=cache)
    prompts = _prompts()
    ids = [server.submit(p, max_new_tokens=20, ignore_eos=True) for p in prompts]
    done, together = {}, 0
    while server.busy:
        server.step(done=done)
        together = max(together, server.running)
    assert together == 2 and int(server.state.peak) <= 10 and server.committed == 0
    for rid, prompt in zip(ids, prompts):
        gen = Generator(CFG, params, max_new_tokens=20, cache=lcx.CacheConfig(**cache.to_dict() | {
            "prefill_chunk": server.chunk}))
        assert done[rid] == gen.result(gen.decode(gen.prefill([prompt]))).tokens[0].tolist()
