"""Eviction policies: exact kept sets, the ladder's shape, attention-based picks, and parity with ``full``."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lcx
from lcx.cache import SlotView, evict, layer_budgets, make_policy, simulate
from lcx.config import CacheConfig, Config, ConfigError, ModelConfig
from lcx.engine import Generator

CFG = ModelConfig(vocab_size=61, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=48, init_std=0.15)
POLICY_PARAMS = {"window": {}, "streaming": {"sinks": 2}, "h2o": {}, "observed": {}, "tova": {},
                 "snapkv": {"window": 4}, "knorm": {}, "random": {"seed": 3},
                 "ladder": {"sinks": 2, "span": 2, "overlap": 0, "recent": 4},
                 "snapkv-adaptive": {"policy": "snapkv", "window": 4, "head_budget": "adaptive"}}


@pytest.fixture(scope="module")
def params():
    return lcx.init_params(CFG, jax.random.key(0))


# built-in policies whose generation another test exercises: the kept positions and greedy tokens of kvpress's press
EXERCISED_ELSEWHERE = {"chunkkv": "tests/test_kvpress_parity.py",
                       "expected_attention": "tests/test_kvpress_parity.py and the query-moments test below",
                       "kvzip": "tests/test_kvpress_parity.py and the reconstruction tests below",
                       "duo": "the calibration test below",
                       "keydiff": "tests/test_kvpress_parity.py", "capkv": "tests/test_kvpress_parity.py"}


def test_policies_registry_lists_every_builtin():
    """Every built-in eviction policy (tests may register more) is exercised by the tests below, or elsewhere."""
    from lcx.cache.policy import _REGISTRY

    builtin = {name for name, cls in _REGISTRY.items() if cls.__module__.startswith("lcx.")}
    covered = {p.get("policy", name) for name, p in POLICY_PARAMS.items()} | {"full", "memory"}
    assert covered | set(EXERCISED_ELSEWHERE) == builtin


# ------------------------------------------------------------------------------------------- attention-free shapes
def test_policies_window_keeps_exactly_the_recent_tokens():
    kept = simulate({"policy": "window", "budget": 10}, n_layers=3, length=50)
    expected = np.zeros(50, bool)
    expected[50 - 11:] = True  # budget + the token just appended (eviction runs before each append)
    assert (kept == expected).all()


def test_policies_streaming_keeps_exactly_sinks_and_recent():
    kept = simulate({"policy": "streaming", "budget": 10, "sinks": 3}, n_layers=2, length=40)
    expected = np.zeros(40, bool)
    expected[:3] = True
    expected[40 - 8:] = True  # budget - sinks recent + the appended token
    assert (kept == expected).all()


def test_policies_streaming_interval_bounds_the_cache():
    kept = simulate({"policy": "streaming", "budget": 10, "sinks": 3, "interval": 5}, n_layers=1, length=43)
    assert 10 < kept.sum() <= 15 and kept[0, :3].all() and kept[0, -1]


def test_policies_ladder_shape():
    n, budget, sinks, recent = 8, 40, 2, 6
    kept = simulate({"policy": "ladder", "budget": budget, "sinks": sinks, "span": 2, "overlap": 0,
                     "recent": recent}, n_layers=n, length=400)
    assert kept[:, :sinks].all(), "sinks are kept in every layer"
    assert kept[:, -recent:].all(), "the recent tail is dense in every layer"
    assert (kept.sum(axis=1) <= budget + 1).all(), "the budget holds (plus the token just appended)"
    assert len({row.tobytes() for row in kept}) > 1, "layers keep different old tokens (staircase)"
    old = kept[:, sinks:-recent]
    assert old.any(axis=0).mean() > 2 * old.mean(), "old tokens survive in some layer far more than in each"
    middle = old.shape[1] // 2
    assert old[:, :middle].mean() < old[:, middle:].mean(), "older regions are thinner than newer ones"


def test_policies_ladder_staircase_offsets():
    # n=4, span 2, overlap 0: runs of G=2, each layer keeps A=1, layer i at offset i mod 2.
    kept = simulate({"policy": "ladder", "budget": 12, "sinks": 1, "span": 2, "overlap": 0, "recent": 2},
                    n_layers=4, length=16)
    assert (kept[0] == kept[2]).all() and (kept[1] == kept[3]).all() and not (kept[0] == kept[1]).all()
    first_run = kept[:, 1:3]  # the oldest laddered run after the sink
    assert first_run[0].tolist() == [True, False] and first_run[1].tolist() == [False, True]


def test_policies_random_is_reproducible_and_seeded():
    a = simulate({"policy": "random", "budget": 12, "seed": 1}, n_layers=2, length=60)
    b = simulate({"policy": "random", "budget": 12, "seed": 1}, n_layers=2, length=60)
    c = simulate({"policy": "random", "budget": 12, "seed": 2}, n_layers=2, length=60)
    assert (a == b).all() and not (a == c).all() and (a.sum(axis=1) == 13).all()


# ------------------------------------------------------------------------------------------- score-based picks
def _view(score, pos=None, k=None):
    c = score.shape[-1]
    pos = np.arange(c)[None] if pos is None else pos
    k = jnp.zeros((1, c, 1, 4)) if k is None else k
    return SlotView(layer=jnp.int32(0), pos=jnp.asarray(pos, jnp.int32), valid=jnp.ones((1, c), bool),
                    count=jnp.asarray([c], jnp.int32), k=k, v=jnp.zeros_like(k), score=jnp.asarray(score),
                    n_layers=1)


def test_policies_h2o_keeps_heavy_hitters_and_recent():
    score = np.full((1, 32), 0.1, np.float32)
    score[0, [3, 11, 17]] = 5.0  # planted heavy hitters
    out = evict(make_policy("h2o", {"recent": 4}), _view(score), jnp.int32(8))
    kept = set(np.asarray(out.pos[0][out.valid[0]]).tolist())
    assert kept >= {3, 11, 17, 28, 29, 30, 31} and len(kept) == 8
    assert np.asarray(out.pos[0, :8]).tolist() == sorted(kept), "survivors are packed in position order"


def test_policies_knorm_keeps_smallest_keys():
    norms = np.arange(16, 0, -1, dtype=np.float32)  # position 15 has the smallest key
    k = jnp.asarray(norms)[None, :, None, None] * jnp.ones((1, 16, 2, 4))
    out = evict(make_policy("knorm"), _view(np.zeros((1, 16), np.float32), k=k), jnp.int32(5))
    assert np.asarray(out.pos[0, :5]).tolist() == [11, 12, 13, 14, 15]


def _attend_one_layer(cfg, q, k, cos, sin, positions, capacity, weights, heads="shared"):
    """One layer of the slot cache's attention with an attention-summing policy (h2o), from an empty cache; returns
    that layer's buffers (``[b, H, C]`` per keep head H)."""
    kind = lcx.CacheConfig(policy="h2o", budget=capacity, heads=heads).kind(cfg)
    layer = jax.tree.map(lambda x: x[0], kind.create(1, capacity).layers())
    _, layer = kind.attend(layer, jnp.asarray(q), jnp.asarray(k), jnp.asarray(k), cos=cos, sin=sin,
                           positions=positions, ok=jnp.ones(positions.shape, bool), stat_weights=jnp.asarray(weights))
    return layer


def _shared(layer):
    """A one-keep-head layer as a ``SlotView``'s arrays (the keep-head axis dropped)."""
    return layer.replace(pos=layer.pos[:, 0], valid=layer.valid[:, 0], count=layer.count[:, 0],
                         score=layer.score[:, 0])


@pytest.mark.slow
def test_policies_snapkv_keeps_the_needle_the_window_attends_to():
    """End to end through the cached attention: the last queries look at position 9; SnapKV keeps it."""
    from lcx.model.rope import rope_tables

    cfg = dataclasses.replace(CFG, n_layers=1)
    t, d = 40, cfg.head_dim
    rng = np.random.default_rng(0)
    k = rng.normal(size=(1, t, cfg.n_kv_heads, d)).astype(np.float32) * 0.1
    q = rng.normal(size=(1, t, cfg.n_heads, d)).astype(np.float32) * 0.1
    needle = rng.normal(size=(d,)).astype(np.float32)
    k[0, 9] = 3 * needle
    q[0, -6:] = 3 * needle  # the observation window attends to the needle
    positions = jnp.arange(t)[None]
    cos, sin = rope_tables(dataclasses.replace(cfg, rope=lcx.RopeConfig(theta=1e9)), positions)  # ~no rotation
    window = (np.arange(t) >= t - 6).astype(np.float32)[None]
    layer = _shared(_attend_one_layer(cfg, q, k, cos, sin, positions, 48, window))
    view = SlotView(layer=jnp.int32(0), pos=layer.pos, valid=layer.valid, count=layer.count,
                    k=layer.k.swapaxes(1, 2), v=layer.v.swapaxes(1, 2),  # a policy's view: [b, C, j, d]
                    score=layer.score, n_layers=1)
    out = evict(make_policy("snapkv", {"window": 6, "kernel": 3}), view, jnp.int32(10))
    kept = np.asarray(out.pos[0][out.valid[0]]).tolist()
    assert 9 in kept and set(range(t - 6, t)) <= set(kept) and len(kept) == 10


@pytest.mark.slow
@pytest.mark.parametrize("impl,heads", [("reference", "shared"), ("xla", "shared"), ("xla", "per_head")])
def test_policies_attention_stats_equal_numpy_softmax(impl, heads):
    """The per-slot score is the attention mass the counted queries give each slot, summed over the query heads that
    share the keep set: all of the layer's (shared), or each KV head's group (per_head)."""
    from lcx.model.rope import rope_tables

    cfg = dataclasses.replace(CFG, n_layers=1, attention=lcx.AttentionConfig(impl=impl))
    t, d, h, kv = 10, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    rng = np.random.default_rng(1)
    q = rng.normal(size=(1, t, h, d)).astype(np.float32)
    k = rng.normal(size=(1, t, kv, d)).astype(np.float32)
    positions = jnp.arange(t)[None]
    cos, sin = rope_tables(cfg, positions)
    weights = (np.arange(t) % 3 == 0).astype(np.float32)[None]  # queries 0, 3, 6, 9 count
    layer = _attend_one_layer(cfg, q, k, cos, sin, positions, 16, weights, heads=heads)
    from lcx.model.rope import apply_rope

    qr = np.asarray(apply_rope(jnp.asarray(q), cos, sin))[0]
    kr = np.asarray(apply_rope(jnp.asarray(k), cos, sin))[0]
    expected = np.zeros((kv, 16))
    for i in (0, 3, 6, 9):
        for head in range(h):
            s = kr[: i + 1, head // (h // kv)] @ qr[i, head] / np.sqrt(d)
            p = np.exp(s - s.max())
            expected[head // (h // kv), : i + 1] += p / p.sum()
    if heads == "shared":
        expected = expected.sum(axis=0, keepdims=True)
    np.testing.assert_allclose(np.asarray(layer.score[0]), expected, rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------------------------------- with generation
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(POLICY_PARAMS))
def test_policies_budget_above_length_reproduces_full(name, params):
    prompts = [np.random.default_rng(1).integers(0, 61, 20).tolist(), [5, 6, 7]]
    # the scanned decoder (one layer body to compile; tests/test_generate_unrolled.py: the same tokens unrolled)
    ref = Generator(CFG, params, max_new_tokens=8, unroll=False)
    ref_state = ref.decode(ref.prefill(prompts))
    gen = Generator(CFG, params, max_new_tokens=8, unroll=False,
                    cache=CacheConfig(**{"policy": name, "budget": 64, "interval": 8, **POLICY_PARAMS[name]}))
    state = gen.decode(gen.prefill(prompts))
    np.testing.assert_array_equal(np.asarray(state.tokens), np.asarray(ref_state.tokens))
    np.testing.assert_allclose(np.asarray(state.logits), np.asarray(ref_state.logits), atol=2e-5)


# streaming (keys rotated by rank) and snapkv (per-head sets, accumulated attention); the ladder's and H2O's decode-time
# evictions are exercised by tests/test_generate_score.py's chunked scoring, which compares them step by step
@pytest.mark.slow
@pytest.mark.parametrize("name", ["streaming", "snapkv"])
def test_policies_decoding_16x_budget_keeps_cache_at_capacity(name, params):
    budget, interval, new = 16, 8, 16 * 16
    gen = Generator(CFG, params, max_new_tokens=new, unroll=False,
                    cache=CacheConfig(policy=name, budget=budget, interval=interval, **POLICY_PARAMS[name]))
    state = gen.prefill([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]])
    capacity = budget + interval
    assert state.cache.k.shape == (CFG.n_layers, 1, CFG.n_kv_heads, capacity, CFG.head_dim)
    assert int(state.cache.count.max()) <= budget
    state = gen.decode(state)
    assert int(state.step) == new
    assert state.cache.k.shape[3] == capacity
    assert state.cache.kv_bytes() == 2 * CFG.n_layers * CFG.n_kv_heads * CFG.head_dim * capacity * 4
    assert int(state.cache.count.max()) <= capacity and int(state.cache.lengths[0]) == 20 + new
    live = np.asarray(state.cache.pos[0, 0][state.cache.valid[0, 0]])
    assert live.max() == 20 + new - 1  # the newest token is cached


@pytest.mark.slow
def test_policies_expected_attention_query_moments_run_over_chunks_and_decode(params):
    """The running query moments after a prefill in chunks of 8 and 16 decode steps, evicting to a budget of 10
    (the sinks kept), are those of one pass over the same 36 tokens: in layer 0, whose queries no eviction shapes,
    mean and covariance alike (Chan's merge is exact); the count (the first ``sinks`` positions excluded) in every
    layer."""
    prompt = np.random.default_rng(4).integers(0, 61, (1, 20))
    cache = dict(policy="expected_attention", interval=8, sinks=2, horizon=16)
    gen = Generator(CFG, params, max_new_tokens=16, unroll=False,
                    cache=CacheConfig(budget=10, prefill_chunk=8, **cache))
    state = gen.decode(gen.prefill(prompt))
    c = state.cache
    fed = np.concatenate([prompt[0], np.asarray(state.tokens[0])])[None]  # every token the cache has read
    once = Generator(CFG, params, max_new_tokens=1, unroll=False,
                     cache=CacheConfig(budget=64, prefill_chunk=64, **cache))
    ref = once.prefill(fed).cache
    assert np.asarray(c.q_count).tolist() == [[36.0 - 2]] * CFG.n_layers == np.asarray(ref.q_count).tolist()
    for name in ("q_mean", "q_m2"):
        np.testing.assert_allclose(np.asarray(getattr(c, name)[0]), np.asarray(getattr(ref, name)[0]),
                                   rtol=1e-4, atol=1e-5, err_msg=name)
    assert int(c.count.max()) <= 10 + 8 and int(c.lengths[0]) == 36
    for layer in range(CFG.n_layers):  # the sinks survive every eviction in every KV head
        for head in range(CFG.n_kv_heads):
            live = np.asarray(c.pos[layer, 0, head])[np.asarray(c.valid[layer, 0, head])]
            assert {0, 1} <= set(live.tolist()) and live.max() == 35 and len(live) < 36


def test_policies_kvzip_reconstruction_passes_lay_out_each_row():
    """The passes over a ragged batch: instruction, then (later passes) the previous chunk's tail, the suffix and the
    row's chunk, padded to one width; a row whose context has ended is all padding with ``hi = lo``."""
    from lcx.cache.reconstruct import Reconstruction

    rec = Reconstruction(first=(1, 2, 3), later=(4,), suffix=(9,), skip=2, tail=2)
    ids = np.zeros((2, 13), np.int32)
    ids[0], ids[1, :7] = 100 + np.arange(13), 200 + np.arange(7)
    passes = rec.passes(ids, np.array([13, 7]), chunk=5)
    assert rec.width(5) == 3 + 1 + 5 and len(passes) == 3  # 11 context tokens of row 0 in chunks of 5
    (t0, ok0, lo0, hi0), (t1, ok1, lo1, hi1), (t2, ok2, lo2, hi2) = passes
    assert t0[0].tolist() == [1, 2, 3, 9, 102, 103, 104, 105, 106] and ok0.all()
    assert (lo0, hi0.tolist()) == (2, [7, 7]) and t0[1, 4:].tolist() == [202, 203, 204, 205, 206]
    assert t1[0].tolist() == [4, 105, 106, 9, 107, 108, 109, 110, 111] and (lo1, hi1.tolist()) == (7, [12, 7])
    assert not ok1[1].any() and t2[0, :5].tolist() == [4, 110, 111, 9, 112] and ok2[0].sum() == 5
    assert (lo2, hi2.tolist()) == (12, [13, 12])


@pytest.mark.slow
def test_policies_kvzip_scores_each_row_by_its_own_context(params):
    """Swapping the rows of a ragged batch swaps their kept sets (each row's passes score only its own chunk; the
    passes leave the cache holding the prompt), and a prompt the capacity cannot hold whole is refused before
    anything is scored (eviction between prefill chunks would drop tokens unscored)."""
    from lcx.cache.reconstruct import Reconstruction

    rng = np.random.default_rng(5)
    a, b = rng.integers(0, 61, 30).tolist(), rng.integers(0, 61, 19).tolist()
    rec = Reconstruction(first=(3, 4, 5), later=(6,), suffix=(7,), skip=1, tail=3)
    cache = CacheConfig(policy="kvzip", budget=12, interval=24, sinks=2, chunk=8, prefill_chunk=32)
    gen = Generator(CFG, params, max_new_tokens=4, unroll=False, cache=cache, reconstruction=rec, capacity=36)

    def kept(prompts):
        c = gen.prefill(prompts).cache
        assert np.asarray(c.lengths).tolist() == [len(p) for p in prompts]
        return [[sorted(np.asarray(c.pos[i, r, h])[np.asarray(c.valid[i, r, h])].tolist())
                 for i in range(CFG.n_layers) for h in range(CFG.n_kv_heads)] for r in range(2)]

    ab, ba = kept([a, b]), kept([b, a])
    assert ab == ba[::-1] and ab[0] != ab[1]
    assert all(len(s) == 12 and {0, 1} <= set(s) for row in ab for s in row)
    assert any(s != row[0] for row in ab for s in row)  # per KV head and layer: sets differ
    with pytest.raises(ConfigError, match="must fit the capacity"):
        gen.prefill([rng.integers(0, 61, 40).tolist()])
    with pytest.raises(ConfigError, match="pass Generator\\(reconstruction=...\\)"):
        Generator(CFG, params, max_new_tokens=4, cache=cache)


@pytest.mark.slow
def test_policies_duo_calibration_splits_heads_by_distant_attention(params):
    """DuoAttention's split: the calibration score of each (layer, KV head) is the attention mass the last 30
    queries of each calibration row give positions ``sinks .. t - recent`` (numpy softmax on the model's own queries
    and keys, two rows averaged); the half with the least mass stream - they keep the 2 sinks and the 8 newest
    tokens, the others all 40."""
    from lcx.cache.duo import head_scores, streaming_heads

    sinks, recent, queries = 2, 8, 30
    ids = np.random.default_rng(0).integers(0, 61, (2, 48))
    q, k = (np.asarray(x, np.float64) for x in lcx.model.attention_inputs(CFG, params, ids))
    ref = np.zeros((CFG.n_layers, CFG.n_kv_heads))
    group = CFG.n_heads // CFG.n_kv_heads
    for row in range(2):
        for layer in range(CFG.n_layers):
            for head in range(CFG.n_heads):
                for t in range(48 - queries, 48):
                    logits = q[layer, row, t, head] @ k[layer, row, :t + 1, head // group].T / np.sqrt(CFG.head_dim)
                    p = np.exp(logits - logits.max())
                    ref[layer, head // group] += (p[sinks:t - recent + 1].sum() / p.sum()) / (queries * group * 2)
    scores = head_scores(CFG, params, ids, sinks=sinks, recent=recent, queries=queries)
    np.testing.assert_allclose(scores, ref, rtol=1e-4)

    cache = CacheConfig(policy="duo", budget=48, interval=16, sinks=sinks, recent=recent, head_ratio=0.5,
                        queries=queries)
    gen = Generator(CFG, params, max_new_tokens=4, cache=cache, calibration=ids)  # the default (unrolled) decoder
    stream = gen.policy.streaming()
    assert (stream == streaming_heads(ref, 0.5)).all() and stream.sum() == CFG.n_layers * CFG.n_kv_heads // 2
    c = gen.prefill([ids[0, :40].tolist()]).cache
    for layer in range(CFG.n_layers):
        for head in range(CFG.n_kv_heads):
            live = sorted(np.asarray(c.pos[layer, 0, head])[np.asarray(c.valid[layer, 0, head])].tolist())
            assert live == ([0, 1, *range(32, 40)] if stream[layer, head] else list(range(40)))
    with pytest.raises(ConfigError, match="pass Generator\\(calibration="):
        Generator(CFG, params, max_new_tokens=4, cache=cache)
    with pytest.raises(ConfigError, match="one score per layer and KV head"):
        Generator(CFG, params, max_new_tokens=4, cache=CacheConfig(
            policy="duo", budget=48, sinks=sinks, recent=recent, scores=[[0.1, 0.2, 0.3]] * CFG.n_layers))


def test_policies_kvzip_and_duo_in_an_ablation_grid():
    """A compression ratio sets DuoAttention's share of streaming heads (the retrieval heads keep the whole context);
    a ratio its window cannot reach, and KVzip in a stream that evicts between chunks, are refused by name."""
    from lcx.eval.config import AblateConfig

    grid = AblateConfig.from_mapping({"policies": [{"policy": "duo", "sinks": 4, "recent": 60}], "compressions": [0.5],
                                      "protocols": ["one_shot"]})
    cache = grid.settings()[0].cache(1024, 40)
    assert cache.budget == 1024 and cache.params["head_ratio"] == round(0.5 / (1 - 64 / 1024), 3)
    with pytest.raises(ConfigError, match="cannot evict 0.5 of 100 tokens"):
        grid.settings()[0].cache(100)
    with pytest.raises(ConfigError, match="with protocol 'streaming'.*allowed: ablate.protocols \\[one_shot\\]"):
        AblateConfig.from_mapping({"policies": [{"policy": "kvzip"}], "compressions": [0.5]})


@pytest.mark.slow
def test_policies_long_prompt_is_compressed_between_chunks(params):
    prompt = np.random.default_rng(2).integers(0, 61, (1, 100))
    gen = Generator(CFG, params, max_new_tokens=4, unroll=False,
                    cache=CacheConfig(policy="streaming", budget=24, interval=8, sinks=2, prefill_chunk=64))
    state = gen.prefill(prompt)
    assert state.cache.capacity == 32 and int(state.cache.count.max()) <= 24
    pos = np.asarray(state.cache.pos[0, 0][state.cache.valid[0, 0]])
    assert pos[:2].tolist() == [0, 1] and pos[-1] == 99


def test_policies_pyramid_budgets_shrink_with_depth():
    budgets = layer_budgets(CacheConfig(policy="window", budget=100, budget_schedule="pyramid"), 5)
    assert budgets == (150, 125, 100, 75, 50)
    # PyramidKV's beta = 20 (its reference code, kvpress's PyramidKVPress): 1.95x down to 0.05x, the same total
    steep = CacheConfig(policy="window", budget=100, budget_schedule="pyramid", pyramid_beta=20)
    assert layer_budgets(steep, 5) == (195, 148, 100, 52, 5) and steep.max_budget == 195
    assert layer_budgets(CacheConfig(policy="window", budget=[4, 5, 6]), 3) == (4, 5, 6)


# ------------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize("cache, message", [
    ({"policy": "streaming", "budget": 4, "sinks": 4}, "cache.budget=4 is invalid for cache.policy='streaming'"),
    ({"policy": "ladder", "budget": 64, "span": 4, "overlap": 4}, "cache.span=4 is invalid: must be > cache.overlap"),
    ({"policy": "ladder", "budget": 64, "span": 8, "overlap": 4},
     "with span=8, overlap=4 on 4 layers cannot reduce anything"),
    ({"policy": "ladder", "budget": 6, "span": 2, "overlap": 0}, "it must be at least sinks + recent + one run"),
    ({"policy": "h2o"}, "cache.budget=None is invalid for cache.policy='h2o'"),
    ({"policy": "streamin", "budget": 8}, "did you mean 'streaming'?"),
    ({"policy": "window", "budget": 8, "sinks": 2}, "cache.sinks is not a parameter of cache.policy='window'"),
    ({"policy": "snapkv", "budget": 8, "kernel": 4}, "cache.kernel=4 is invalid"),
    ({"policy": "window", "budget": [4, 4]}, "cache.budget has 2 per-layer values; the model has 4 layers"),
    ({"policy": "window", "budget": 0}, "cache.budget=0 is invalid"),
    ({"policy": "window", "budget": 8, "budget_schedule": "cone"}, "cache.budget_schedule='cone' is invalid"),
    ({"policy": "window", "budget": 8, "budget_schedule": "pyramid", "pyramid_beta": 0.5},
     "cache.pyramid_beta=0.5 is invalid: must be a number >= 1"),
    ({"policy": "chunkkv", "budget": 16, "window": 4, "chunk": 0}, "cache.chunk=0 is invalid"),
    ({"policy": "chunkkv", "budget": 16, "window": 4, "chunk": 20}, "it must hold one chunk (cache.chunk=20)"),
    ({"policy": "kvzip", "budget": 16, "positions": "cache"}, "cache.positions='cache' is invalid for "
     "cache.policy='kvzip'"),
    ({"policy": "kvzip", "budget": 16, "chunk": 0}, "cache.chunk=0 is invalid"),
    ({"policy": "duo", "budget": 400, "head_ratio": 1.5}, "cache.head_ratio=1.5 is invalid: must be in [0, 1]"),
    ({"policy": "duo", "budget": 400, "heads": "shared"}, "cache.heads='shared' is invalid for cache.policy='duo'"),
    ({"policy": "duo", "budget": 300}, "it must exceed cache.sinks + cache.recent=384"),
    ({"policy": "duo", "budget": 400, "scores": [[0.5, 0.5]] * 3}, "cache.scores has 3 rows"),
    ({"policy": "chunkkv", "budget": 16, "window": 4, "head_budget": "global"},
     "cache.head_budget='global' is invalid for cache.policy='chunkkv'"),
])
def test_policies_bad_config_fails_at_load(cache, message):
    from lcx.config import from_dict, to_dict

    with pytest.raises(ConfigError) as err:
        from_dict(Config, {"model": to_dict(CFG), "cache": cache})
    assert message in str(err.value)


@pytest.mark.slow
def test_policies_kvzip_on_a_sliding_window_model_compresses_its_global_layers():
    """KVzip on a Gemma-3-shaped model (local, local, global): the reconstruction passes score the global layer's
    slots and read the local layers' windows without appending to them.

    - Window longer than the prompt and a pass (a local layer then attends as a global one does): the global layer
      keeps what the same layer keeps, with the same scores, when every layer of the model is global.
    - Window 8 (the passes' 13 tokens outgrow it): the local cache after the passes equals the one the full policy
      leaves, the global layer keeps its budget per KV head, and decoding continues from there."""
    from lcx.cache.reconstruct import Reconstruction

    base = ModelConfig(vocab_size=61, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=48, head_dim=8,
                       family="gemma3", query_scale=12.0, init_std=0.3)
    hybrid = dataclasses.replace(base, layer_types=("sliding_attention", "sliding_attention", "full_attention"),
                                 sliding_window=128)
    weights = lcx.init_params(base, jax.random.key(1))
    prompt = [np.random.default_rng(6).integers(0, 61, 30).tolist()]
    rec = Reconstruction(first=(3, 4, 5), later=(6,), suffix=(7,), skip=1, tail=3)
    kvzip = CacheConfig(policy="kvzip", budget=12, interval=24, sinks=2, chunk=8, prefill_chunk=32)

    def prefill(cfg, cache):
        # the default (unrolled) decoder: the only test of KVzip's passes over a hybrid cache's per-layer buffers
        gen = Generator(cfg, weights, max_new_tokens=4, cache=cache, reconstruction=rec, capacity=36)
        return gen, gen.prefill(prompt)

    def kept(layer):  # [k] (sorted positions, their scores) of one layer's view
        pos, valid, score = (np.asarray(x)[0] for x in (layer.pos, layer.valid, layer.score))
        return [(pos[h][valid[h]], score[h][valid[h]]) for h in range(pos.shape[0])]

    _, every = prefill(base, kvzip)
    _, wide = prefill(hybrid, kvzip)
    want = kept(jax.tree.map(lambda x: x[2], every.cache))  # the all-global model's last layer
    got = kept(jax.tree.map(lambda x: x[0], wide.cache.glob))
    for (want_pos, want_score), (got_pos, got_score) in zip(want, got):
        order = np.argsort(want_pos), np.argsort(got_pos)
        np.testing.assert_array_equal(want_pos[order[0]], got_pos[order[1]])
        np.testing.assert_allclose(want_score[order[0]], got_score[order[1]], rtol=1e-4, atol=1e-7)
    assert np.asarray(wide.cache.loc.valid).sum() > 0

    narrow = dataclasses.replace(hybrid, sliding_window=8)
    gen, state = prefill(narrow, kvzip)
    _, plain = prefill(narrow, CacheConfig(interval=24, prefill_chunk=32))
    # The local layers' slots are the plain cache's: the same positions exactly, the same keys and values up to the
    # rounding of two differently fused programs (layer 1's keys come from layer 0's output; ~5e-7 apart with XLA's
    # older CPU emitters). A compressed or shifted local buffer would differ by O(1).
    for name in ("pos", "valid", "count"):
        np.testing.assert_array_equal(np.asarray(getattr(state.cache.loc, name)),
                                      np.asarray(getattr(plain.cache.loc, name)), err_msg=name)
    for name in ("k", "v"):
        np.testing.assert_allclose(np.asarray(getattr(state.cache.loc, name)),
                                   np.asarray(getattr(plain.cache.loc, name)), rtol=1e-5, atol=1e-6, err_msg=name)
    assert np.asarray(state.cache.glob.valid).sum(-1).tolist() == [[[12, 12]]]
    assert gen.result(gen.decode(state)).lengths.tolist() == [4]
    assert {"k", "v", "pos", "valid"} <= set(state.cache.kind.fields())  # the declaration (a NameError before)
    # DuoAttention's calibrated head split stays refused on a sliding-window model
    with pytest.raises(ConfigError, match="cache.policy='duo'.*cache type is 'hybrid'"):
        Generator(narrow, weights, max_new_tokens=4,
                  cache=CacheConfig(policy="duo", budget=12, sinks=2, recent=4, head_ratio=0.5))
