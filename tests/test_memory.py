"""The tiered working / long-term memory cache: exactness, routing, stores, bounded device memory, bad settings."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lcx
from lcx.cache.memory import MemoryKind, make_router
from lcx.cache.memory.blocks import GROUPS, form_blocks, quantize, quantize_lowbit
from lcx.cache.memory.store import BlockStore
from lcx.config import ConfigError, from_dict, to_dict

CFG = lcx.ModelConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                      max_position_embeddings=2048)
PROMPTS = [np.random.default_rng(0).integers(0, 61, 150).tolist(),
           np.random.default_rng(1).integers(0, 61, 97).tolist()]


def memory(**kw) -> lcx.CacheConfig:
    spec = dict(policy="memory", sinks=4, window=16, block=8, topk=64, interval=8, prefill_chunk=32)
    spec.update(kw)
    return lcx.CacheConfig(**spec)


@pytest.fixture(scope="module")
def params():
    return lcx.init_params(CFG, jax.random.key(3))


@pytest.fixture(scope="module")
def full(params):
    return lcx.generate(CFG, params, PROMPTS, max_new_tokens=24)


# --------------------------------------------------------------------------------------------------- exactness
@pytest.mark.slow
@pytest.mark.parametrize("router, store, blocks", [("quest", "host", "contiguous"), ("infllm", "device", "contiguous"),
                                                   ("quest", "device", "cluster")])
def test_memory_recalling_every_block_equals_the_full_cache(params, full, router, store, blocks):
    out = lcx.generate(CFG, params, PROMPTS, max_new_tokens=24,
                       cache=memory(router=router, store=store, blocks=blocks, cluster_blocks=2))
    np.testing.assert_array_equal(out.tokens, full.tokens)
    assert (out.store_bytes > 0) == (store == "host")


@pytest.mark.slow
def test_memory_logits_equal_the_full_cache_under_teacher_forcing(params):
    """Perplexity protocol: prefill a prefix, score the rest token by token through the tiers (fp32, every block
    recalled, original positions): the log-probabilities equal the full cache's."""
    ids = np.random.default_rng(2).integers(0, 61, (2, 120))
    ref = lcx.Generator(CFG, params, max_new_tokens=80)
    _, want = ref.score(ref.prefill(ids[:, :40]), ids[:, 40:])
    gen = lcx.Generator(CFG, params, max_new_tokens=80, cache=memory())
    state, got = gen.score(gen.prefill(ids[:, :40]), ids[:, 40:])
    np.testing.assert_allclose(got, want, atol=2e-5)
    assert int(state.cache.n_blocks.max()) >= 10  # most of the context was in the long-term store
    # 8-bit (cache.kv_dtype): the window's codes with a scale per token and KV head, the blocks in int8 with one per
    # block - within rounding of the float tiers (the keys' scales left out: 0.19 off)
    gen8 = lcx.Generator(CFG, params, max_new_tokens=80, cache=memory(kv_dtype="int8"))
    state8, got8 = gen8.score(gen8.prefill(ids[:, :40]), ids[:, 40:])
    assert 0 < np.abs(got8 - want).max() < 2e-3 and np.abs(got8 - want).mean() < 5e-4  # measured: 2.1e-4, 5.3e-5
    assert state8.cache.k.dtype == jnp.int8 and state8.cache.store_k is None  # a host store: int8 blocks there
    assert gen8.kind.store_dtype == "int8" and state8.cache.k_scale.shape == state8.cache.k.shape[:-1]
    d = CFG.head_dim
    assert state8.cache.kv_bytes() * (4 * d) == state.cache.kv_bytes() * (d + 2)  # 1-byte codes + 2-byte scale
    # int4 (cache.kv_dtype): the working window stays float (the tier's residual), the long-term blocks are
    # bit-packed codes in KIVI's groups; recalled from the host store (NumPy) or the device (JAX) they dequantize to
    # the same values (up to float32 rounding: XLA fuses the multiply-add). Off the float tiers by ~10x the int8
    # blocks (measured: max 1.5e-3, mean 3.5e-4).
    drift = {}
    for store in ("host", "device"):
        gen4 = lcx.Generator(CFG, params, max_new_tokens=80, cache=memory(kv_dtype="int4", kv_group=8, store=store))
        state4, drift[store] = gen4.score(gen4.prefill(ids[:, :40]), ids[:, 40:])
        assert gen4.kind.store_dtype == "int4" and state4.cache.k.dtype == jnp.float32
    np.testing.assert_allclose(drift["host"], drift["device"], atol=2e-6)
    off = np.abs(drift["host"] - want)
    assert off.max() < 5e-3 and np.abs(got8 - want).mean() < off.mean() < 1e-3
    assert state4.cache.store_k.dtype == jnp.uint8 and state4.cache.store_k.shape[-1] == d // 2


@pytest.mark.slow
def test_memory_device_kv_is_bounded_while_decoding_16x_the_working_size(params):
    cache = memory(topk=2, window=16)
    gen = lcx.Generator(CFG, params, max_new_tokens=16 * 24, cache=cache)
    state = gen.prefill([PROMPTS[0][:20]])
    kv_before = state.cache.kv_bytes()
    shapes = jax.tree.map(lambda x: x.shape, state.cache)
    state = gen.decode(state)
    result = gen.result(state)
    assert state.cache.kv_bytes() == kv_before and jax.tree.map(lambda x: x.shape, state.cache) == shapes
    kind = gen.kind
    m = CFG
    # the device keeps the working slots only: sinks + window + one run + the room of a jitted call
    assert kind.working_slots == 4 + 16 + 7 + 32
    assert result.cache_bytes == 2 * m.n_layers * m.n_kv_heads * m.head_dim * 4 * kind.working_slots
    tokens = 20 + 16 * 24
    assert int(state.cache.n_blocks[0, 0]) * 8 >= tokens - (4 + 16 + 8 + 8)  # the rest went to the store
    assert result.store_bytes >= (tokens - 36) * 2 * m.n_layers * m.n_kv_heads * m.head_dim * 4


# --------------------------------------------------------------------------------------------------- routing
def _blocks_with_needle(seed=0, n=12, j=8, k=2, d=16, needle_block=7):
    rng = np.random.default_rng(seed)
    keys = rng.normal(size=(1, n, j, k, d)).astype(np.float32) * 0.3
    needle = rng.normal(size=(d,)).astype(np.float32)
    needle /= np.linalg.norm(needle)
    keys[0, needle_block, 3] = 4.0 * needle  # one token of the block carries the needle, in both KV heads
    received = np.full((1, n, j, k), 0.01, np.float32)
    received[0, needle_block, 3] = 1.0
    return jnp.asarray(keys), jnp.asarray(received), needle


@pytest.mark.parametrize("router", ["quest", "infllm"])
def test_memory_router_recalls_the_block_of_a_planted_needle(router):
    keys, received, needle = _blocks_with_needle()
    r = make_router(router, representatives=2)
    summaries = r.summarize(keys, received)
    q = jnp.asarray(np.tile(needle, (1, 4, 1)) * 2.0)  # [b, h, d]: every query head looks for the needle
    scores = r.score(q, summaries, None)  # [b, k, n]
    assert scores.shape == (1, 2, 12)
    assert np.asarray(jnp.argmax(scores, axis=-1)).tolist() == [[7, 7]]


def test_memory_quest_score_bounds_every_key_of_the_block():
    rng = np.random.default_rng(4)
    keys = jnp.asarray(rng.normal(size=(1, 5, 8, 2, 16)).astype(np.float32))
    q = jnp.asarray(rng.normal(size=(1, 2, 16)).astype(np.float32))  # one query head per KV head
    scores = make_router("quest").score(q, make_router("quest").summarize(keys, None), None)  # [1, 2, 5]
    dots = jnp.einsum("bkd,bnjkd->bknj", q, keys)
    assert bool(jnp.all(scores >= jnp.max(dots, axis=-1) - 1e-5))


@pytest.mark.slow
def test_memory_end_to_end_recalls_the_needle_block(params):
    """Through generation: keys of one early block are made to match the final query; after prefill of a long
    prompt, that block is among each layer's recalled blocks."""
    from lcx.cache.memory.attend import route

    gen = lcx.Generator(CFG, params, max_new_tokens=1, cache=memory(topk=1))
    state = gen.prefill([PROMPTS[0]])
    layer = jax.tree.map(lambda x: x[0], state.cache.layers())
    kmin, kmax = layer.kmin, layer.kmax  # [b, N, k, d]
    target = 5
    direction = jnp.zeros((CFG.head_dim,)).at[0].set(1.0)
    layer = layer.replace(kmax=kmax.at[:, target].set(50.0 * direction), kmin=kmin.at[:, target].set(0.0))
    q = jnp.broadcast_to(direction, (1, 1, CFG.n_heads, CFG.head_dim))
    ids, gate, _ = route(gen.kind, layer.replace(recent_n=jnp.zeros_like(layer.recent_n)), q, jnp.ones((1, 1), bool))
    assert gate is None and np.asarray(ids[0, :, 0]).tolist() == [target, target]


# --------------------------------------------------------------------------------------------------- stores
def _random_blocks(seed, L=2, b=2, n=3, j=4, k=2, d=8):
    rng = np.random.default_rng(seed)
    kk = rng.normal(size=(L, b, n, j, k, d)).astype(np.float32)
    vv = rng.normal(size=(L, b, n, j, k, d)).astype(np.float32)
    pos = rng.integers(0, 1000, (L, b, n, j, k)).astype(np.int32)
    return kk, vv, pos


@pytest.mark.parametrize("disk", [False, True])
def test_memory_store_round_trip_is_bit_exact(tmp_path, disk):
    store = BlockStore(2, 2, 8, 4, 2, 8, "float32", tmp_path / "blocks" if disk else None)
    kk, vv, pos = _random_blocks(0)
    store.append(kk, vv, pos, np.array([3, 2]))
    store.append(kk[:, :, ::-1], vv[:, :, ::-1], pos, np.array([1, 3]))
    assert store.n_blocks.tolist() == [4, 5]
    ids = np.array([[[2, 0, 3], [1, 2, 0]], [[4, 1, 0], [3, 3, 2]]])  # [b, k, K]
    got_k, got_v = store.fetch(1, ids)
    for row in range(2):
        for head in range(2):
            for i, block in enumerate(ids[row, head]):
                first = 3 if row == 0 else 2
                src_k = kk[1, row, block] if block < first else kk[1, row, ::-1][block - first]
                np.testing.assert_array_equal(got_k[row, i * 4:(i + 1) * 4, head], src_k[:, head])
    saved = tmp_path / "saved"
    store.save(saved)
    again = BlockStore.load(saved)
    for x, y in ((again.k, store.k), (again.v, store.v), (again.pos, store.pos)):
        np.testing.assert_array_equal(np.asarray(x)[:, :, :5], np.asarray(y)[:, :, :5])
    np.testing.assert_array_equal(again.fetch(1, ids)[1], got_v)


def test_memory_store_bfloat16_round_trip(tmp_path):
    """bfloat16 blocks are saved as raw 2-byte records and load back as bfloat16."""
    store = BlockStore(2, 2, 8, 4, 2, 8, "bfloat16")
    kk, vv, pos = _random_blocks(3)
    store.append(kk.astype(store.k.dtype), vv.astype(store.v.dtype), pos, np.array([3, 2]))
    ids = np.array([[[0, 1, 2]] * 2, [[1, 0, -1]] * 2])
    store.save(tmp_path / "saved")
    again = BlockStore.load(tmp_path / "saved")
    assert again.k.dtype == store.k.dtype
    for x, y in zip(again.fetch(1, ids), store.fetch(1, ids)):
        np.testing.assert_array_equal(x, y)
    assert store.nbytes() == 5 * 2 * 2 * (4 * (2 * 8 * 2 + 4))  # blocks x layers x kv heads x (j x (k, v, pos))


def test_memory_store_int8_is_within_half_a_step():
    store = BlockStore(2, 2, 8, 4, 2, 8, "int8")
    kk, vv, pos = _random_blocks(1)
    (qk, sk), (qv, sv) = quantize(jnp.asarray(kk)), quantize(jnp.asarray(vv))
    store.append(np.asarray(qk), np.asarray(qv), pos, np.array([3, 3]), np.stack([np.asarray(sk), np.asarray(sv)]))
    got, _ = store.fetch(0, np.array([[[0, 1, 2]] * 2] * 2))
    want = kk[0].reshape(2, 12, 2, 8)  # [b, n * j, k, d]
    step = np.abs(kk).max() / 127
    assert np.max(np.abs(got - want)) <= step / 2 + 1e-6
    fp32 = BlockStore(2, 2, 8, 4, 2, 8, "float32")
    fp32.append(kk, vv, pos, np.array([3, 3]))
    assert store.nbytes() < 0.5 * fp32.nbytes()  # 1 byte per element instead of 4, plus positions and scales


@pytest.mark.parametrize("kv_dtype", ["int4", "int2"])
def test_memory_store_lowbit_is_within_half_a_step_of_its_groups(tmp_path, kv_dtype):
    """Bit-packed blocks (``memory_dtype: int4 | int2``): keys within half a step of their block's channel scale,
    values of their token's group scale; saved and loaded with their groups; the bytes are codes + scales."""
    store = BlockStore(2, 2, 8, 4, 2, 8, kv_dtype, value_group=4)
    kk, vv, pos = _random_blocks(2)
    codes = {n: np.asarray(x) for n, x in quantize_lowbit(jnp.asarray(kk), jnp.asarray(vv), kv_dtype, 4).items()}
    store.append(codes["k"], codes["v"], pos, np.array([3, 2]), groups={n: codes[n] for n in GROUPS})
    ids = np.array([[[0, 1, 2]] * 2, [[1, 0, -1]] * 2])
    got_k, got_v = store.fetch(1, ids)
    for row in range(2):
        for i, block in enumerate(ids[row, 0]):
            if block < 0:
                assert not got_k[row, i * 4:(i + 1) * 4].any()
                continue
            step_k = codes["k_scale"][1, row, block].astype(np.float32)  # [k, d]: per channel over the block
            err = np.abs(got_k[row, i * 4:(i + 1) * 4] - kk[1, row, block])  # [j, k, d]
            assert np.all(err <= step_k / 2 + 1e-3), (row, block)
            step_v = np.repeat(codes["v_scale"][1, row, block].astype(np.float32), 4, axis=-1)  # [j, k, d]
            assert np.all(np.abs(got_v[row, i * 4:(i + 1) * 4] - vv[1, row, block]) <= step_v / 2 + 1e-3)
    again = BlockStore.load(store.save(tmp_path / "saved") or tmp_path / "saved")
    np.testing.assert_array_equal(again.fetch(1, ids)[0], got_k)
    fp32 = BlockStore(2, 2, 8, 4, 2, 8, "float32")
    fp32.append(kk, vv, pos, np.array([3, 2]))
    bits = {"int4": 4, "int2": 2}[kv_dtype]
    per_block = 2 * 4 * 2 * 8 * bits // 8 + 4 * 4 * 2 + 2 * 2 * (2 * 8 + 4 * 2 * 2)  # codes, positions, groups
    assert store.nbytes() == 5 * 2 * per_block < fp32.nbytes()


def test_memory_cluster_blocks_group_similar_keys():
    rng = np.random.default_rng(5)
    centers = rng.normal(size=(2, 16)) * 3
    which = rng.permutation(np.repeat([0, 1], 8))  # 16 tokens, two clusters, interleaved
    keys = (centers[which] + 0.1 * rng.normal(size=(16, 16))).astype(np.float32)
    k = jnp.asarray(keys)[None, :, None, :]  # [b, T, k, d]
    pos = jnp.arange(16)[None]
    bk, _, bpos, _ = form_blocks(k, k, pos, jnp.zeros((1, 16, 1)), block=8, cluster_run=16, iters=5)
    for block in range(2):  # each block holds the tokens of one cluster, in position order
        members = np.asarray(bpos[0, block, :, 0])
        assert len(set(which[members])) == 1 and (np.diff(members) > 0).all()
    contiguous = form_blocks(k, k, pos, jnp.zeros((1, 16, 1)), block=8, cluster_run=0, iters=5)[2]
    assert np.asarray(contiguous[0, :, :, 0]).tolist() == [list(range(8)), list(range(8, 16))]


@pytest.mark.slow
def test_memory_save_and_restore_resumes_with_the_store(params, tmp_path):
    gen = lcx.Generator(CFG, params, max_new_tokens=20, cache=memory(topk=2))
    state = gen.decode(gen.prefill(PROMPTS), steps=9)
    gen.save(state, tmp_path / "ckpt")
    expected = gen.result(gen.decode(state)).tokens
    other = lcx.Generator(CFG, params, max_new_tokens=20, cache=memory(topk=2))
    resumed = other.result(other.decode(other.restore(tmp_path / "ckpt"))).tokens
    np.testing.assert_array_equal(resumed, expected)


# --------------------------------------------------------------------------------------------------- settings
@pytest.mark.parametrize("kw, message", [
    (dict(block=0), "cache.block=0 is invalid: must be an integer >= 1"),
    (dict(window=0), "cache.window=0 is invalid: must be an integer >= 1"),
    (dict(router="lsh"), "cache.router='lsh' is invalid: must be one of ['quest', 'infllm', 'learned']"),
    (dict(router="learned"), "cache.router='learned' needs cache.router_path"),
    (dict(blocks="cluster", cluster_blocks=1), "k-means needs a run of at least 2 blocks"),
    (dict(store="disk"), "cache.store='disk' needs cache.store_dir"),
    (dict(memory_dtype="int3"), "cache.memory_dtype='int3' is invalid: must be one of ['float32', 'bfloat16', "
                                "'float16', 'int8', 'int4', 'int2'] or null"),
    (dict(kv_dtype="int4", kv_residual=8), "cache.kv_residual=8 is invalid with cache.policy='memory': the memory "
                                           "tier's working window is its float residual"),
    (dict(window=None, budget=40, topk=8, block=8), "cache.budget=40 is invalid for cache.policy='memory': it must "
                                                    "exceed sinks + topk * block = 4 + 8 * 8 = 68"),
    (dict(window=16, budget=40), "cache.budget=40 and cache.window=16 disagree"),
    (dict(representatives=9), "cache.representatives=9 is invalid: a block of 8 tokens"),
])
def test_memory_bad_settings_fail_at_load(kw, message):
    with pytest.raises(ConfigError) as err:
        lcx.Config(model=CFG, cache=memory(**kw))
    assert message in str(err.value)


def test_memory_budget_sets_the_window():
    kind = memory(window=None, budget=100, topk=4, block=8).kind(CFG)
    assert isinstance(kind, MemoryKind) and kind.window == 100 - 4 - 32
    cfg = from_dict(lcx.Config, {"model": to_dict(CFG),
                                 "cache": {"policy": "memory", "budget": 100, "topk": 4, "block": 8}})
    assert cfg.cache.kind(cfg.model).window == 64


# --------------------------------------------------------------------------------------------------- learned router
@pytest.mark.slow
def test_memory_learned_router_trains_loads_and_reports_its_gate(params, tmp_path):
    from lcx.eval.recall import trace_recall
    from lcx.train.config import DataConfig
    from lcx.train.router import RouterConfig, train_router

    model = dataclasses.replace(CFG, vocab_size=260, max_position_embeddings=256)
    weights = lcx.init_params(model, jax.random.key(7))
    cfg = RouterConfig(steps=6, batch_size=2, seq_len=128, rank=8, window=16, block=8, queries=8, log_every=3)
    summary = train_router(model, weights, cfg, DataConfig(task="passkey", params={"instruction": False}),
                           tmp_path / "router", progress=False)
    rows = [json.loads(line) for line in (tmp_path / "router" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [3, 6] and all(np.isfinite(r["loss"]) for r in rows)
    assert 0.0 <= summary["recall@2_learned"] <= 1.0 and 0.0 <= summary["gate_skip_rate"] <= 1.0
    cache = memory(router="learned", router_path=str(tmp_path / "router"), topk=2, window=16)
    prompt = [np.random.default_rng(3).integers(0, 260, 120).tolist()]
    out = lcx.generate(model, weights, prompt, max_new_tokens=4, cache=cache)
    assert out.tokens.shape == (1, 4)
    trace = trace_recall(model, weights, cache, prompt)
    # every chunk after the first had blocks to route: each either recalled or was skipped by the gate
    assert (trace.recalls + trace.skips)[:, 0].tolist() == [-(-120 // 32) - 1] * model.n_layers
    with pytest.raises(ConfigError, match="was trained with positions='original'"):
        lcx.Config(model=model, cache=memory(router="learned", router_path=str(tmp_path / "router"),
                                             positions="local"))
    with pytest.raises(ConfigError, match="holds no trained router"):
        lcx.Config(model=model, cache=memory(router="learned", router_path=str(tmp_path)))


@pytest.mark.slow
def test_memory_grouped_routing_covering_everything_is_exact(params, full):
    """Two-level routing with groups that cover every block recalls every block: the full cache's tokens."""
    out = lcx.generate(CFG, params, PROMPTS, max_new_tokens=24,
                       cache=memory(route_groups=4, route_candidates=16, store="device"))
    np.testing.assert_array_equal(out.tokens, full.tokens)


@pytest.mark.slow
def test_memory_grouped_routing_finds_a_planted_needle(params):
    """A block whose keys match the query stands out at both levels: its group's bounds, then its own."""
    from lcx.cache.memory.attend import route

    gen = lcx.Generator(CFG, params, max_new_tokens=1, cache=memory(topk=1, route_groups=2, route_candidates=1))
    state = gen.prefill([PROMPTS[0]])
    layer = jax.tree.map(lambda x: x[0], state.cache.layers())
    target = 7
    direction = jnp.zeros((CFG.head_dim,)).at[0].set(1.0)
    kmax = layer.kmax.at[:, target].set(50.0 * direction)
    gmax = layer.gmax.at[:, target // 2].set(50.0 * direction)
    layer = layer.replace(kmax=kmax, gmax=gmax, recent_n=jnp.zeros_like(layer.recent_n))
    q = jnp.broadcast_to(direction, (1, 1, CFG.n_heads, CFG.head_dim))
    ids, _, _ = route(gen.kind, layer, q, jnp.ones((1, 1), bool))
    assert np.asarray(ids[0, :, 0]).tolist() == [target, target]
    with pytest.raises(ConfigError, match="cache.route_groups=4 is invalid for cache.router='infllm'"):
        memory(router="infllm", route_groups=4)
