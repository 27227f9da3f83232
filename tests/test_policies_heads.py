"""Per-KV-head keep sets and head-adaptive budgets: each rule against a plain numpy statement of the published one."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from lcx.cache import simulate
from lcx.cache.config import CacheConfig
from lcx.cache.policy import SlotView, adaptive_keep, evict, make_policy
from lcx.config_base import ConfigError


def _view(score: np.ndarray, k: np.ndarray | None = None, lengths=None) -> SlotView:
    """One row of ``C`` full slots at positions 0..C-1."""
    c = score.shape[-1]
    k = np.zeros((1, c, 1, 2), np.float32) if k is None else k
    return SlotView(layer=jnp.int32(0), pos=jnp.arange(c, dtype=jnp.int32)[None], valid=jnp.ones((1, c), bool),
                    count=jnp.array([c], jnp.int32), k=jnp.asarray(k), v=jnp.asarray(k),
                    score=jnp.asarray(score, jnp.float32)[None], lengths=lengths)


def _adakv_numpy(scores: np.ndarray, budget: int, alpha: float) -> np.ndarray:
    """AdaKV as kvpress states it: every head's ``max(1, int(alpha x budget))`` best are forced in, then the
    ``H x (C - budget)`` lowest scores over all heads are pruned."""
    heads, c = scores.shape
    s = scores.astype(np.float64).copy()
    safe = max(1, int(budget * alpha))
    for h in range(heads):
        s[h, np.argsort(-s[h], kind="stable")[:safe]] = np.inf
    pruned = np.argsort(s.reshape(-1), kind="stable")[:heads * (c - budget)]
    keep = np.ones(heads * c, bool)
    keep[pruned] = False
    return keep.reshape(heads, c)


@pytest.mark.parametrize("seed, budget, skew", [(0, 8, 1.0), (1, 5, 4.0), (2, 12, 0.3)])
def test_adaptive_keep_is_kvpress_adakv(seed, budget, skew):
    rng = np.random.default_rng(seed)
    heads, c = 4, 24
    scores = rng.random((heads, c)) * (1.0 + skew * np.arange(heads))[:, None]  # heads of different spread
    policy = make_policy("snapkv", {"head_budget": "adaptive", "head_floor": 0.2, "head_cap": 10.0})
    pos = np.broadcast_to(np.arange(c), (heads, c))
    keep = np.asarray(adaptive_keep(policy, jnp.asarray(scores, jnp.float32), jnp.ones((heads, c), bool),
                                    jnp.asarray(pos, jnp.int32), jnp.int32(budget)))
    np.testing.assert_array_equal(keep, _adakv_numpy(scores, budget, 0.2))
    assert keep.sum() == heads * budget
    if skew > 1:  # the point of AdaKV: the layer's budget goes where the scores are
        assert len(set(keep.sum(-1).tolist())) > 1


def test_adaptive_keep_cap_and_floor_bind():
    heads, c, budget = 2, 20, 6
    scores = np.stack([np.full(c, 10.0) + np.arange(c), np.arange(c) * 1e-3])  # head 0 outranks head 1 everywhere
    pos = jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), (heads, c))
    ok = jnp.ones((heads, c), bool)

    def kept(floor, cap):
        policy = make_policy("knorm", {"head_budget": "adaptive", "head_floor": floor, "head_cap": cap})
        return np.asarray(adaptive_keep(policy, jnp.asarray(scores, jnp.float32), ok, pos, jnp.int32(budget)))

    assert kept(0.5, 10.0).sum(-1).tolist() == [9, 3]  # floor int(0.5 x 6) = 3 for head 1, the rest to head 0
    assert kept(0.0, 1.5).sum(-1).tolist() == [9, 3]  # head 0 capped at 1.5 x 6
    uniform = kept(0.0, 1.0)  # cap = budget: every head its own top budget
    np.testing.assert_array_equal(uniform, np.argsort(np.argsort(-scores, axis=-1), axis=-1) < budget)


def test_global_keep_pools_budgets_of_layers_with_their_own_floor_and_cap():
    """``head_budget: global``: rows from layers of different budgets ([4, 4, 8, 8]: two layers of two heads) share
    one top-k of sum(budgets) = 24 slots; each row's floor and cap come from its own layer's budget."""
    c = 20
    scores = np.stack([np.arange(c) + 100.0, np.arange(c) + 50.0, np.arange(c) * 1e-3, np.arange(c) * 1e-3 + 1.0])
    pos = jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), (4, c))
    budgets = jnp.array([4, 4, 8, 8], jnp.int32)
    policy = make_policy("kvzip", {"head_budget": "global", "head_floor": 0.25, "head_cap": 2.0})
    keep = np.asarray(adaptive_keep(policy, jnp.asarray(scores, jnp.float32), jnp.ones((4, c), bool), pos, budgets))
    # rows 0, 1 capped at 2 x 4 = 8; rows 2, 3 keep their floors (2 each) and the highest-scoring row 3 the rest
    assert keep.sum(-1).tolist() == [8, 8, 2, 6]
    assert keep[3, -6:].all() and keep[2, -2:].all()


def test_per_head_evict_keeps_each_heads_smallest_key_norms():
    """knorm per KV head: evicting one keep head sees that head's keys only."""
    rng = np.random.default_rng(0)
    c, budget = 16, 5
    k = rng.normal(size=(1, c, 1, 4)).astype(np.float32)
    view = _view(np.zeros(c), k)
    out = evict(make_policy("knorm", {}), view, jnp.int32(budget))
    expected = np.sort(np.argsort(np.linalg.norm(k[0, :, 0], axis=-1))[:budget])
    np.testing.assert_array_equal(np.asarray(out.pos[0, :budget]), expected)
    assert make_policy("knorm", {}).per_head and not make_policy("knorm", {"heads": "shared"}).per_head


def test_tova_keeps_the_newest_token_even_when_it_scores_lowest():
    score = np.linspace(1.0, 2.0, 10)
    score[-1] = 0.0
    out = evict(make_policy("tova", {}), _view(score), jnp.int32(4))
    assert np.asarray(out.pos[0, :4]).tolist() == [6, 7, 8, 9]


@pytest.mark.parametrize("pooling", ["avg", "max"])
def test_snapkv_pools_over_the_prefix_only(pooling):
    rng = np.random.default_rng(1)
    c, window, kernel = 20, 4, 5
    score = rng.random(c)
    pooled = np.asarray(make_policy("snapkv", {"window": window, "kernel": kernel, "pooling": pooling})
                        .scores(_view(score), jnp.int32(8)))[0]
    prefix = np.pad(score[:c - window], (kernel // 2, kernel // 2 + window))  # zeros past both ends of the prefix
    windows = np.lib.stride_tricks.sliding_window_view(prefix, kernel)[:c]
    expected = windows.mean(-1) if pooling == "avg" else windows.max(-1)
    np.testing.assert_allclose(pooled[:c - window], expected[:c - window], rtol=1e-6)
    assert (pooled[c - window:] > 1e29).all()  # the observation window is kept


def test_observed_divides_accumulated_attention_by_the_queries_that_saw_each_token():
    c = 8
    score = np.arange(1, c + 1, dtype=np.float32)
    got = np.asarray(make_policy("observed", {}).scores(_view(score, lengths=jnp.array([c])), jnp.int32(4)))[0]
    np.testing.assert_allclose(got, score / (c - np.arange(c)))


def test_simulate_random_per_head_draws_a_set_per_kv_head():
    kept = simulate({"policy": "random", "budget": 12, "heads": "per_head"}, n_layers=2, length=40, kv_heads=3)
    assert kept.shape == (2, 3, 40) and (kept.sum(-1) == 13).all()
    assert (kept[:, 0] != kept[:, 1]).any()
    shared = simulate({"policy": "random", "budget": 12}, n_layers=2, length=40, kv_heads=3)
    assert shared.shape == (2, 40)


@pytest.mark.parametrize("params, field", [
    ({"policy": "snapkv", "heads": "each"}, "cache.heads"),
    ({"policy": "snapkv", "heads": "shared", "head_budget": "adaptive"}, "cache.head_budget"),
    ({"policy": "knorm", "head_budget": "greedy"}, "cache.head_budget"),
    ({"policy": "h2o", "head_floor": 1.5}, "cache.head_floor"),
    ({"policy": "h2o", "head_cap": 0.5}, "cache.head_cap"),
])
def test_head_options_are_checked_at_config_load(params, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        CacheConfig(budget=16, **params)


def test_adaptive_cache_holds_the_capped_head_budget():
    from lcx.model.config import ModelConfig

    model = ModelConfig(vocab_size=8, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=8)
    kind = CacheConfig(policy="knorm", budget=12, interval=8, head_budget="adaptive", head_cap=2.0).kind(model)
    # A head keeps at most min(2 x 12, 2 x 12 - floor(0.2 x 12)) = 22 of the layer's 24 slots.
    assert kind.keep_heads == 2 and kind.head_budgets == (22, 22) and kind.plan(1, 100, 10) == 30
    shared = CacheConfig(policy="knorm", budget=12, interval=8, heads="shared").kind(model)
    assert shared.keep_heads == 1 and shared.plan(1, 100, 10) == 20
    # Pooled over layers, a head holds up to its cap: 2 x 12 slots.
    pooled = CacheConfig(policy="knorm", budget=12, interval=8, head_budget="global", head_cap=2.0).kind(model)
    assert pooled.head_budgets == (24, 24) and pooled.plan(1, 100, 10) == 32
    # K/V bytes do not depend on the keep sets; positions, validity and scores are stored per keep head.
    assert kind.nbytes(1, 20) == shared.nbytes(1, 20)
    assert kind.nbytes(1, 20, role="meta") == 2 * shared.nbytes(1, 20, role="meta") - 4  # lengths [b]: once


@pytest.mark.slow
def test_per_head_cache_attends_exactly_what_each_head_keeps():
    """End to end through chunked prefill, evictions and decode: KV head 1 of every layer has zero keys and values
    (it outputs nothing; its keys tie, so per head it keeps the newest tokens), head 0 is untouched. K-norm per head
    and shared then keep the same set for head 0 - and a different one for head 1 - so any slot of head 0 read
    through head 1's layout, or written at the wrong slot, changes the logits."""
    import jax

    import lcx
    from lcx.engine import Generator
    from tests.test_policies import CFG

    params = lcx.init_params(CFG, jax.random.key(0))
    attn = params["layers"]["attn"]
    params["layers"]["attn"] = dict(attn, k=attn["k"].at[:, :, 1].set(0.0), v=attn["v"].at[:, :, 1].set(0.0))
    # Distinct prompt tokens: a repeated token has the same layer-0 key up to rounding, a near-tie that either mode
    # may break its own way.
    prompts = [np.random.default_rng(2).permutation(61)[:45].tolist(), [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]]
    runs = {}
    for heads in ("shared", "per_head"):
        cache = CacheConfig(policy="knorm", heads=heads, budget=12, interval=4, prefill_chunk=8)
        gen = Generator(CFG, params, max_new_tokens=24, cache=cache)
        state = gen.decode(gen.prefill(prompts))
        runs[heads] = (np.asarray(state.logits), np.asarray(state.tokens), np.asarray(state.cache.pos))
    np.testing.assert_allclose(runs["per_head"][0], runs["shared"][0], atol=1e-5)
    np.testing.assert_array_equal(runs["per_head"][1], runs["shared"][1])
    pos = runs["per_head"][2]  # [L, b, H, C]
    assert (np.sort(pos[:, :, 0], -1) == np.sort(runs["shared"][2][:, :, 0], -1)).all()
    assert (np.sort(pos[:, :, 0], -1) != np.sort(pos[:, :, 1], -1)).any()  # the heads' sets do differ


@pytest.mark.parametrize("haystack", ["noise", "prose"])
def test_kvzip_head_budget_and_the_haystack(haystack):
    """The mechanism behind docs/real_model (e)'s KVzip finding on SmolLM2 (per KV head: 8/8 passkeys in a
    repeated-noise haystack, 0/8 in prose; global: 5-8/8 in both). Two KV heads of one layer, 8 slots each; the
    needle (4 slots) is what head 0 reconstructs from. In noise filler nothing else stands out, so it is head 0's
    top and both rules keep it. In prose 11 other tokens outscore it in head 0: its own 8 slots (uniform) drop it;
    the pooled 16 (global) flow to head 0, where the scores are (15 of them: head 1 keeps its floor of 1), and keep
    it - head 1, whose scores are low everywhere, gives up slots it does not need."""
    c, budget, needle = 64, 8, np.arange(30, 34)
    rng = np.random.default_rng(0)
    scores = rng.uniform(0.0, 0.02, (2, c))  # filler: low everywhere
    scores[0, needle] = 0.8
    if haystack == "prose":
        scores[0, rng.choice(np.setdiff1d(np.arange(c), needle), 11, replace=False)] = 0.9  # sentences that compete
    pos = jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), (2, c))
    ok = jnp.ones((2, c), bool)
    per_head = np.asarray(adaptive_keep(make_policy("kvzip", {"head_cap": 1.0}), jnp.asarray(scores, jnp.float32),
                                        ok, pos, jnp.int32(budget)))  # cap = budget: each head its own top 8
    pooled = np.asarray(adaptive_keep(make_policy("kvzip", {"head_budget": "global"}),
                                      jnp.asarray(scores, jnp.float32), ok, pos, jnp.int32(budget)))
    assert per_head.sum() == pooled.sum() == 2 * budget  # the same memory
    assert pooled[0, needle].all()
    assert per_head[0, needle].all() == (haystack == "noise")
