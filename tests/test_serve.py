"""The serving loop: continuous batching over a paged cache under page pressure gives every request the tokens of
generating it alone, streams them in order, shares a system prompt's pages across requests, and returns every
page when done."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

import lcx
from lcx.cache.base import CacheCapacityError
from lcx.config import ConfigError
from lcx.engine.server import Server
from lcx.engine.setup import prefix_formats

CFG = lcx.ModelConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                      max_position_embeddings=256)
SYSTEM = np.random.default_rng(0).integers(0, 61, 26).tolist()  # 3 whole pages of 8
PROMPTS = [SYSTEM + np.random.default_rng(i).integers(0, 61, n).tolist()
           for i, n in enumerate((3, 12, 5, 9, 1, 7), start=1)]
NEW = (4, 10, 6, 3, 8, 5)


@pytest.fixture(scope="module")
def params():
    return lcx.init_params(CFG, jax.random.key(3))


@pytest.mark.slow
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
    assert refs.sum() == sum(len(p.pages) for p in server.prefixes.entries.values()) and server.committed == 0
    # ignore_eos: request 1 again runs past the EOS it emits third, to its limit, as generating without an EOS id
    again = server.submit(PROMPTS[1], max_new_tokens=NEW[1], ignore_eos=True)
    assert server.run()[again] == plain.tokens[1, :NEW[1]].tolist()


def test_server_refuses_what_it_cannot_hold(params):
    with pytest.raises(ConfigError, match=r"cache.layout='contiguous' is invalid for Server"):
        Server(CFG, params, cache=lcx.CacheConfig())
    with pytest.raises(ConfigError, match=r"cache.policy='duo' is invalid for Server: it calibrates.*allowed: "
                                          r".*h2o.*kvzip.*streaming"):
        Server(CFG, params, cache=lcx.CacheConfig(layout="paged", policy="duo", budget=16))
    with pytest.raises(ConfigError, match=r"Server pages=0 is invalid: must be a positive integer"):
        Server(CFG, params, max_len=32, pages=0, cache=lcx.CacheConfig(layout="paged", page_size=8))
    server = Server(CFG, params, max_len=32, cache=lcx.CacheConfig(layout="paged", page_size=8))
    with pytest.raises(CacheCapacityError, match=r"30 prompt \+ 8 new tokens exceeds the server's max_len=32"):
        server.submit(list(range(30)), max_new_tokens=8)
    small = Server(CFG, params, max_len=64, pages=4, max_num_seqs=2, cache=lcx.CacheConfig(layout="paged",
                                                                                            page_size=8))
    with pytest.raises(CacheCapacityError, match=r"40 prompt \+ 8 new tokens needs 6 pages of 8 tokens \([0-9,]+ bytes "
                                                 r"of KV cache\); the server's KV budget is 4 pages.*--cache-policy "
                                                 r"streaming --cache-param budget="):
        small.submit(list(range(40)), max_new_tokens=8)


def _pool(server: Server) -> dict:
    """What the server's pool and admission hold: references, free pages, committed pages, kept prefixes."""
    pool = server.state.pool
    return dict(refs=np.asarray(pool.refs).tolist(), free=int(pool.free()), committed=server.committed,
                prefixes={k: (list(p.pages), p.users) for k, p in server.prefixes.entries.items()})


def _held_by_tables_and_prefixes(server: Server) -> np.ndarray:
    table = np.asarray(server.state.table)
    kept = [p for prefix in server.prefixes.entries.values() for p in prefix.pages]
    return np.bincount(table[table >= 0], minlength=server.pages) + np.bincount(kept, minlength=server.pages)


@pytest.mark.slow
def test_an_on_token_that_raises_cancels_its_request_and_returns_its_pages(params):
    """A client whose callback raises mid-stream: its request is cancelled (pages back at once, left out of the
    result, recorded with the exception), the request beside it streams the tokens of generating it alone, the pool
    ends as it was before the request came, and a later run does not resurrect it."""
    alone = lcx.generate(CFG, params, PROMPTS, max_new_tokens=max(NEW)).tokens
    server = Server(CFG, params, max_num_seqs=3, max_len=56, pages=12, segment=4, prefill_chunk=16,
                    cache=lcx.CacheConfig(layout="paged", page_size=8), prefix_entries=2)
    first = [server.submit(p, max_new_tokens=n) for p, n in zip(PROMPTS, NEW)]
    assert server.run() == {i: alone[k, :n].tolist() for k, (i, n) in enumerate(zip(first, NEW))}
    before = _pool(server)  # kept system-prompt prefixes, nothing running
    assert before["committed"] == 0 and before["free"] < server.pages
    # the victim reads the kept system prompt's pages and owns two of its own; its neighbour reads them too (neither
    # keeps a prefix of its own: the system prompt's whole pages are kept already)
    victim_prompt = SYSTEM + [5, 9, 1]
    victim = server.submit(victim_prompt, max_new_tokens=10)
    neighbour = server.submit(PROMPTS[0], max_new_tokens=10)
    streamed: dict[int, list[int]] = {victim: [], neighbour: []}
    boom = RuntimeError("client went away")
    seen = []  # the pool at the neighbour's first token after the cancellation (asserted below: an assertion
    # failing inside on_token would itself cancel the request)

    def on_token(request, token):
        streamed[request].append(token)
        if request == victim and len(streamed[victim]) == 3:
            raise boom
        if victim in server.cancelled and not seen:
            running = list(server.scheduler.running.values())
            seen.append(dict(running=[r.id for r in running], table=np.asarray(server.state.table),
                             row=running[0].row, refs=np.asarray(server.state.refs),
                             held=_held_by_tables_and_prefixes(server), committed=server.committed,
                             private=running[0].private))

    out = server.run(on_token=on_token)
    assert out == {neighbour: alone[0, :10].tolist()} and streamed[neighbour] == out[neighbour]
    want = lcx.generate(CFG, params, [victim_prompt], max_new_tokens=3).tokens[0].tolist()
    assert streamed[victim] == want  # its first three tokens, then nothing
    assert server.cancelled == {victim: boom}
    # at once: at the neighbour's next token only its row holds pages, beside the kept prefixes
    (now,) = seen
    assert now["running"] == [neighbour] and now["committed"] == now["private"]
    assert np.all(np.delete(now["table"], now["row"], axis=0) == -1)
    np.testing.assert_array_equal(now["refs"], now["held"])
    assert _pool(server) == before  # references, free pages, commitments and kept prefixes as before it came
    later = server.submit(PROMPTS[0], max_new_tokens=4)
    assert server.run(on_token=lambda r, t: streamed.setdefault(r, []).append(t)) == {later: alone[0, :4].tolist()}
    assert len(streamed[victim]) == 3 and server.cancelled == {victim: boom}


def test_cancel_drops_a_waiting_request_and_ends_a_running_one_at_once(params):
    server = Server(CFG, params, max_num_seqs=2, max_len=56, pages=12, segment=4, prefill_chunk=16,
                    cache=lcx.CacheConfig(layout="paged", page_size=8), prefix_entries=0)
    prompts = [np.random.default_rng(i).integers(0, 61, 12).tolist() for i in (10, 11, 12)]  # nothing in common
    a, b, c = (server.submit(p, max_new_tokens=8) for p in prompts)
    assert server.cancel(c) and server.cancelled == {c: None}  # waiting: dropped from the queue
    assert not server.cancel(c)
    seen, pools = [], []

    def on_token(request, token):
        seen.append(request)
        if request == a and seen.count(a) == 2:  # a cancels b (running beside it) from inside its callback
            row = next(r for r in server.scheduler.running.values() if r.id == b)
            pools.append((np.asarray(server.state.table)[row.row], row.private, _pool(server)))
            pools.append(server.cancel(b))
            pools.append((np.asarray(server.state.table)[row.row], _pool(server)))
        if request == a and seen.count(a) == 4:
            server.cancel(a)  # its own request: no further token

    out = server.run(on_token=on_token)
    assert out == {} and server.cancelled == {c: None, b: None, a: None}
    assert seen == [a, b, a, a, a]  # both prefilled together; b cancelled at a's second token, before its own
    (table, private, pool), cancelled, (table_after, pool_after) = pools
    held = np.bincount(table[table >= 0], minlength=server.pages)
    assert cancelled and held.sum() > 0 and np.all(table_after == -1)
    assert pool_after["refs"] == (np.asarray(pool["refs"]) - held).tolist()  # its pages back at once
    assert pool_after["free"] == pool["free"] + held.sum() and pool_after["committed"] == pool["committed"] - private
    assert not server.cancel(a) and _pool(server) == dict(refs=[0] * 12, free=12, committed=0, prefixes={})
    with pytest.raises(ConfigError, match=r"Server.cancel: request_id=3 is invalid: must be an id submit returned "
                                          r"\(0 .. 2\)"):
        server.cancel(3)


# --------------------------------------------------------------------------------------------------- chunked prefill
@pytest.mark.slow
def test_a_long_prompt_arrives_a_chunk_per_step_while_the_others_decode(params):
    cache = lcx.CacheConfig(layout="paged", page_size=8)
    server = Server(CFG, params, max_num_seqs=2, max_len=160, segment=2, prefill_chunk=16, cache=cache)
    short, long = PROMPTS[0], np.random.default_rng(9).integers(0, 61, 100).tolist()
    a = server.submit(short, max_new_tokens=40)
    out: dict[int, list[int]] = {}
    server.step(done=out)  # A prefilled (2 chunks of 16 would be 29 tokens: a step each) ...
    while any(r.prefilling for r in server.scheduler.running.values()):
        server.step(done=out)
    b = server.submit(long, max_new_tokens=4)
    per_step = []
    while server.busy:
        got: list[int] = []
        reading = [r for r in server.scheduler.running.values() if r.id == b and r.prefilling]
        server.step(on_token=lambda request, token: got.append(request), done=out)
        if reading:
            per_step.append(got.count(a))
    assert len(per_step) >= 100 // 16  # B's prompt took a step per chunk ...
    assert all(n == 2 for n in per_step[:-1])  # ... and A decoded a segment in each of them
    alone = lcx.generate(CFG, params, [short, long], max_new_tokens=40)
    assert out[a] == alone.tokens[0, :40].tolist() and out[b] == alone.tokens[1, :4].tolist()


# --------------------------------------------------------------------------------------------------- eviction
@pytest.mark.slow
@pytest.mark.parametrize("policy", ["streaming", "tova"])  # TOVA scores by the decode queries' attention
def test_an_evicting_policy_serves_prompts_past_its_pages_as_generate_does(params, policy):
    cache = lcx.CacheConfig(layout="paged", page_size=8, policy=policy, budget=16, interval=8)
    server = Server(CFG, params, max_num_seqs=1, max_len=200, segment=4, prefill_chunk=8, cache=cache)
    assert server.row_pages == 3  # budget + interval slots, whatever max_len
    prompt = np.random.default_rng(5).integers(0, 61, 90).tolist()
    rid = server.submit(prompt, max_new_tokens=20)
    out = server.run()
    alone = lcx.generate(CFG, params, [prompt], max_new_tokens=20,
                         cache=lcx.CacheConfig(**cache.to_dict() | {"prefill_chunk": server.chunk}))
    assert out[rid] == alone.tokens[0, :20].tolist()
    assert int(server.state.peak) <= server.row_pages and server.pages_used() == 0


# --------------------------------------------------------------------------------------------------- the page store
@pytest.mark.slow
def test_stored_pages_serve_a_new_server_with_the_tokens_of_recomputing(params, tmp_path):
    from lcx.engine.kv_store import PageStore

    cache = lcx.CacheConfig(layout="paged", page_size=8)
    first = Server(CFG, params, max_num_seqs=2, max_len=128, cache=cache, prefill_chunk=16,
                   store=PageStore("model-a", page=8, directory=tmp_path))
    prompt = np.random.default_rng(11).integers(0, 61, 43).tolist()
    rid = first.submit(prompt, max_new_tokens=9)
    answer = first.run()[rid]
    files = sorted(tmp_path.glob("*.kvp"))
    assert len(files) == (len(prompt) + len(answer) - 1) // 8  # the prompt's and the answer's whole pages
    # a restarted server (nothing in memory): the next turn extends the conversation and reads its pages from disk
    turn = prompt + answer + [7, 8, 9, 10, 11]
    want = lcx.generate(CFG, params, [turn], max_new_tokens=6).tokens[0].tolist()

    def serve(namespace):
        server = Server(CFG, params, max_num_seqs=2, max_len=128, cache=cache, prefill_chunk=16,
                        store=PageStore(namespace, page=8, directory=tmp_path))
        rid = server.submit(turn, max_new_tokens=6)
        out = server.run()[rid]
        return out, server.cached_tokens, server.store

    out, cached, store = serve("model-a")
    assert out == want and cached == len(files) * 8
    assert serve("model-b")[1] == 0  # another model's (or cache setting's) pages are never read
    # a truncated file and a corrupt one: detected, deleted, recomputed - never served
    keys = store.keys(np.asarray(turn[:len(files) * 8]))
    paths = [tmp_path / f"{k}.kvp" for k in keys]
    paths[3].write_bytes(paths[3].read_bytes()[:-100])
    data = bytearray(paths[5].read_bytes())
    data[-10] ^= 0xFF
    paths[5].write_bytes(bytes(data))
    out, cached, store = serve("model-a")
    assert out == want and cached == 3 * 8 and store.corrupt == 1  # the run stops at the first bad page
    # the truncated page was stored again, whole; the corrupt one (past it, unread so far) is found by the next
    # restart, which stops there and stores it again; then every page reads back
    out, cached, store = serve("model-a")
    assert out == want and cached == 5 * 8 and store.corrupt == 1
    out, cached, store = serve("model-a")
    assert out == want and cached == (len(turn) - 1) // 8 * 8 and store.corrupt == 0  # this turn's pages too


@pytest.mark.slow
@pytest.mark.parametrize("kv_dtype", prefix_formats())
def test_each_format_whose_pages_hold_a_row_is_stored_and_read_back(tmp_path, kv_dtype):
    """Every registered storage format whose pages alone hold a row (``KVStorage.pages_hold_rows``: the store is
    allowed for it) round-trips through a ``PageStore``: a restarted server reading the stored pages gives the tokens
    of a server that prefills the whole prompt."""
    from lcx.engine.kv_store import PageStore

    config = dataclasses.replace(CFG, n_heads=2, n_kv_heads=1, head_dim=16)  # head_dim 16: a whole fp4 scale block
    params = lcx.init_params(config, jax.random.key(3))
    cache = lcx.CacheConfig(layout="paged", page_size=8, kv_dtype=kv_dtype)
    prompt = np.random.default_rng(5).integers(0, 61, 35).tolist()

    def serve(store):
        server = Server(config, params, max_num_seqs=1, max_len=64, cache=cache, prefill_chunk=16, store=store)
        rid = server.submit(prompt, max_new_tokens=5)
        return server.run()[rid], server.cached_tokens

    serve(PageStore("m", page=8, directory=tmp_path))
    (stored, cached), (fresh, _) = serve(PageStore("m", page=8, directory=tmp_path)), serve(None)
    assert cached == 32 and stored == fresh


@pytest.mark.slow
def test_a_request_pins_only_the_kept_pages_it_shares(params):
    """A prompt that shares one page of a kept 3-page prefix reads (and pins) that page only: its own pages are
    counted once, and the longer prefix can still be released for pages."""
    cache = lcx.CacheConfig(layout="paged", page_size=8)
    server = Server(CFG, params, max_num_seqs=2, max_len=64, pages=20, segment=2, prefill_chunk=32, cache=cache,
                    prefix_entries=8)
    common = list(range(3, 11))  # one page
    a, b = common + [10] * 16 + [11], common + [20] * 16 + [21]  # 3 whole pages + 1 token each
    server.submit(a, max_new_tokens=30)
    server.step()  # a prefilled; its 3 pages kept
    server.submit(b, max_new_tokens=30)
    server.step()  # b reads page 0 of a's prefix, keeps its own 3 pages
    need = server.pages_needed(len(a), 30)
    assert server.committed == 2 * (need - 3)  # each owns its pages less the 3 its kept prefix holds
    # a's 3 pages (read by a), b's 3 pages (by b), and page 0 alone (by b)
    assert sorted((len(p.tokens) // 8, p.users) for p in server.prefixes.entries.values()) == [(1, 1), (3, 1), (3, 1)]
    longer = tuple(a[:24])
    assert server.prefixes.entry(longer).users == 1  # its maker only: b pins the 1-page entry, not this one
    out = server.run()
    alone = lcx.generate(CFG, params, [a, b], max_new_tokens=30)
    assert list(out.values()) == [alone.tokens[0].tolist(), alone.tokens[1].tolist()]
