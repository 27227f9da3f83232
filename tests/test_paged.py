"""The paged KV cache and prefix sharing: tokens equal the contiguous cache's, a forked context is stored once and
continues like unshared generation, page accounting, and the errors of bad settings and an exhausted pool."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lcx
from lcx.cache.base import CacheCapacityError
from lcx.config import ConfigError

CFG = lcx.ModelConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                      max_position_embeddings=512)
PAGED = lcx.CacheConfig(layout="paged", page_size=8)
CONTEXT = np.random.default_rng(0).integers(0, 61, 45).tolist()  # 5 full pages of 8 and a partial one
QUESTIONS = [np.random.default_rng(i).integers(0, 61, n).tolist() for i, n in ((1, 5), (2, 11), (3, 3))]
OTHER = np.random.default_rng(9).integers(0, 61, 45).tolist()  # another document of the same length


@pytest.fixture(scope="module")
def params():
    return lcx.init_params(CFG, jax.random.key(3))


@pytest.mark.slow
def test_paged_generation_equals_the_contiguous_cache(params):
    prompts = [CONTEXT[:37], CONTEXT[25:]]  # no common prefix: nothing shared
    want = lcx.generate(CFG, params, prompts, max_new_tokens=12)
    got = lcx.generate(CFG, params, prompts, max_new_tokens=12, cache=PAGED)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    # pages in use at the peak: ceil((37 + 12) / 8) + ceil((20 + 12) / 8) = 7 + 4, each 2 layers x K and V
    page_bytes = 2 * CFG.n_layers * CFG.n_kv_heads * 8 * CFG.head_dim * 4
    assert got.cache_bytes == 11 * page_bytes
    # kv_dtype int8 on pages: codes in the pool, a float16 scale per slot and KV head in scale pages. The full cache
    # (decode reads a page's codes and scales) and SnapKV (evicting while the prompt streams in and while decoding:
    # compactions move the scales with their codes) give the contiguous 8-bit cache's tokens; a page's bytes count
    # codes and scales.
    for policy in ({}, dict(policy="snapkv", budget=16, window=4, interval=8)):
        want, got = (lcx.generate(CFG, params, prompts, max_new_tokens=12, cache=lcx.CacheConfig(
            layout=layout, page_size=8, kv_dtype="int8", **policy)) for layout in ("contiguous", "paged"))
        np.testing.assert_array_equal(got.tokens, want.tokens, err_msg=str(policy))
    page8 = 2 * CFG.n_layers * CFG.n_kv_heads * 8 * (CFG.head_dim + 2)
    assert lcx.CacheConfig(layout="paged", page_size=8, kv_dtype="int8").kind(CFG).page_nbytes() == page8
    # snapkv holds budget + interval = 24 slots per row: 3 pages each at the peak, the contiguous cache's bytes
    assert got.cache_bytes == want.cache_bytes == 2 * 3 * page8


@pytest.fixture(scope="module")
def unshared(params):
    """Each question generated after its own copy of the context (one ragged batch)."""
    return lcx.generate(CFG, params, [CONTEXT + q for q in QUESTIONS], max_new_tokens=8).tokens


def test_fork_continues_each_question_like_unshared_generation(params, unshared):
    """One prefilled context forked into three rows, a different question appended to each: the greedy tokens of
    generating context + question per row from scratch, with the context's full pages stored once."""
    gen = lcx.Generator(CFG, params, max_new_tokens=8, cache=PAGED, capacity=72)
    state = gen.fork(gen.prefill([CONTEXT]), len(QUESTIONS))
    assert state.cache.lengths.tolist() == [45] * 3
    result = gen.result(gen.decode(gen.prefill(QUESTIONS, state=state)))
    np.testing.assert_array_equal(result.tokens, unshared)
    slot_bytes = 2 * CFG.n_layers * CFG.n_kv_heads * CFG.head_dim * 4  # K and V of one token in every layer
    # 5 shared pages + per row the pages from its partial-page copy to its last token: 45 + 5 + 8 -> pages 6..8,
    # 45 + 11 + 8 -> 6..8, 45 + 3 + 8 -> 6..7 (one sequence alone holds 8 pages)
    assert result.cache_bytes == (5 + 3 + 3 + 2) * 8 * slot_bytes


def test_fork_of_a_contiguous_cache_copies_each_row(params):
    """Other caches fork by repeating rows: every buffer with a batch axis, row i -> rows 3i .. 3i + 2."""
    kind = lcx.CacheConfig(policy="streaming", budget=16, sinks=2).kind(CFG)
    state = kind.create(2, 24)
    state = state.replace(k=jax.random.normal(jax.random.key(0), state.k.shape), lengths=jnp.asarray([5, 9]))
    forked = kind.fork(state, 3)
    np.testing.assert_array_equal(forked.k, np.repeat(np.asarray(state.k), 3, axis=1))
    assert forked.lengths.tolist() == [5, 5, 5, 9, 9, 9] and forked.pos.shape[1] == 6


def test_runs_of_prompts_sharing_whole_pages_are_prefilled_and_stored_once(params):
    """Two questions about one 45-token document, then one about another (the rows of a RULER grid with several
    questions per haystack): the first two rows' 5 common whole pages are prefilled for one row and shared, the
    third row's own 5 go through in the same first pass, and each row continues with its own tokens (from position
    40). Tokens: the contiguous cache's."""
    prompts = [CONTEXT + QUESTIONS[0], CONTEXT + QUESTIONS[1], OTHER + QUESTIONS[2]]
    gen = lcx.Generator(CFG, params, max_new_tokens=8, cache=PAGED)
    state = gen.prefill(prompts)
    table = np.asarray(state.cache.table)
    np.testing.assert_array_equal(table[1, :5], table[0, :5])
    assert len({*table[0, 5:], *table[1, 5:]} - {-1}) == 4 and not (set(table[2]) - {-1}) & set(table[:2].ravel())
    assert (gen.prompt_tokens, gen.prefilled_tokens) == (50 + 56 + 48, 40 + 40 + 10 + 16 + 8)
    result = gen.result(gen.decode(state))
    np.testing.assert_array_equal(result.tokens, lcx.generate(CFG, params, prompts, max_new_tokens=8).tokens)
    # 5 shared + 5 + per row its pages past position 40: ceil(58 / 8) - 5, ceil(64 / 8) - 5, ceil(56 / 8) - 5
    assert result.cache_bytes == (5 + 5 + 3 + 3 + 2) * PAGED.kind(CFG).page_nbytes()


def test_fork_shares_full_pages_and_copies_the_partial_one(params, tmp_path):
    gen = lcx.Generator(CFG, params, max_new_tokens=4, cache=PAGED, capacity=64)
    state = gen.fork(gen.prefill([CONTEXT]), 4)
    table, refs = np.asarray(state.cache.table), np.asarray(state.cache.refs)
    np.testing.assert_array_equal(table[:, :5], np.broadcast_to(table[0, :5], (4, 5)))  # the same 5 full pages
    assert np.all(refs[table[0, :5]] == 4)
    assert len(set(table[:, 5].tolist())) == 4 and np.all(refs[table[:, 5]] == 1)  # 4 private partial pages
    # the pool: 5 shared pages + per row the 8 - 5 pages its table may still hold
    assert state.cache.n_pages == 5 + 4 * 3
    k = np.asarray(state.cache.k)
    np.testing.assert_array_equal(k[:, table[1, 5]], k[:, table[3, 5]])  # copies of one page
    gen.save(state, tmp_path / "forked")  # a pool sized by its pages, not batch x capacity: restored as saved
    np.testing.assert_array_equal(gen.result(gen.decode(gen.restore(tmp_path / "forked"))).tokens,
                                  gen.result(gen.decode(state)).tokens)


@pytest.mark.slow
def test_eviction_on_pages_forks_a_compressed_context_and_equals_the_contiguous_cache(params):
    """The slot cache's eviction over pages (``lcx.cache.paged_slots``), SnapKV with per-head keep sets: the 45-token
    context is compressed while it streams in (capacity 16 + 8) and at the end; fork gives its two full pages to
    three rows, each asks its own question, and the prefill's end compresses each row again (the slot cache's rule),
    rewriting those slots: each row first copies the pages it rewrites (copy-on-write), the others never see it;
    decoding evicts every 8 tokens. Pages past a row's kept slots go back to the pool. Tokens: the contiguous
    cache's, which copies the rows."""
    tokens = {}
    for layout in ("contiguous", "paged"):
        cache = lcx.CacheConfig(policy="snapkv", budget=16, window=4, interval=8, layout=layout, page_size=8)
        gen = lcx.Generator(CFG, params, max_new_tokens=13, cache=cache)
        state = gen.fork(gen.prefill([CONTEXT]), 3)
        if layout == "paged":
            assert gen.kind.name == "paged_slots"
            table, refs = np.asarray(state.cache.table), np.asarray(state.cache.refs)
            np.testing.assert_array_equal(table, [[0, 1, -1]] * 3)  # 16 kept slots: 2 full pages, shared
            assert refs.tolist() == [3, 3] + [0] * 9  # the pool: 2 + per row its 3 pages' worst case
            assert gen.result(state).cache_bytes == gen.kind.page_nbytes() * 2
        state = gen.prefill(QUESTIONS, state=state)
        if layout == "paged":  # compressed to 16 again: 2 pages per row, its own
            table, refs = np.asarray(state.cache.table), np.asarray(state.cache.refs)
            assert np.all(table[:, 2] == -1) and len(set(table[:, :2].ravel())) == 6
            assert np.all(refs[table[:, :2]] == 1) and int(np.sum(refs > 0)) == 6
        state = gen.decode(state)
        tokens[layout] = gen.result(state).tokens
        if layout == "paged":
            cache = state.cache
            held = np.sum(np.asarray(cache.table) >= 0, axis=1)
            occupied = np.max(np.asarray(cache.count), axis=(0, 2))  # 16 kept + the steps since the last eviction
            np.testing.assert_array_equal(held, -(-occupied // 8))
            assert int(np.sum(np.asarray(cache.refs) > 0)) == held.sum() and int(cache.peak) <= 3 * 3
    np.testing.assert_array_equal(tokens["paged"], tokens["contiguous"])


def test_paged_settings_and_exhausted_pool_fail_clearly(params):
    with pytest.raises(ConfigError, match=r"cache.layout='pages' is invalid: must be one of \['contiguous', "
                                          r"'paged'\]"):
        lcx.CacheConfig(layout="pages")
    with pytest.raises(ConfigError, match=r"cache.page_size=0 is invalid"):
        lcx.CacheConfig(layout="paged", page_size=0)
    with pytest.raises(ConfigError, match=r"layout='paged' with cache.policy='memory': that policy keeps its own "
                                          r"cache type \('memory'\); allowed: the slot policies"):
        lcx.CacheConfig(layout="paged", policy="memory", budget=32, block=8).kind(CFG)
    kind = PAGED.kind(CFG)
    state = kind.create(2, 16)  # 2 rows x 2 pages
    state = kind.make_room(state.replace(refs=state.refs.at[:3].set(1)), jnp.int32(9))  # 1 free page, 4 wanted
    with pytest.raises(CacheCapacityError, match="ran out of pages: its pool holds 4 pages of 8 tokens"):
        kind.sync(state)
    gen = lcx.Generator(CFG, params, max_new_tokens=4, cache=PAGED)
    state = gen.prefill([CONTEXT])
    with pytest.raises(CacheCapacityError, match=r"needs 72 cache slots .* capacity >= 72"):
        gen.prefill([list(range(20))], state=state)
    with pytest.raises(ConfigError, match=r"fork n=\[1, 2\] is invalid: .* or a list of 1 of them"):
        gen.fork(state, [1, 2])
