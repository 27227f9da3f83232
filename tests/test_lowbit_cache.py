"""The bit-packed working cache (``cache.kv_dtype: int4 | int2``, ``lcx.cache.lowbit_slots``) against a float
reference: its codes and scales are the float cache's keys and values quantized in KIVI's groups, its bytes are the
declared ones, decode over the codes equals a prefill over the same tokens, eviction keeps keys within the
re-quantization error and values exact, every policy runs on it, and bad settings fail at config load."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import lcx
from lcx.cache import lowbit_slots
from lcx.cache.storage import PackedStorage
from lcx.config import CacheConfig, ConfigError, ModelConfig
from lcx.engine import Generator
from lcx.kernels import lowbit

CFG = ModelConfig(vocab_size=61, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, init_std=0.1)
PROMPT = np.random.default_rng(5).integers(0, 61, 45).tolist()
G = 8  # tokens per key group (so the 45-token prompt fills several and leaves one open)


@pytest.fixture(scope="module")
def params():
    return lcx.init_params(CFG, jax.random.key(0))


def _layer0_floats(gen_cache, n):
    """Layer 0's float keys and values of the first ``n`` slots, ``[b, k, n, d]``."""
    return np.asarray(gen_cache.k[0, :, :, :n]), np.asarray(gen_cache.v[0, :, :, :n])


@pytest.mark.parametrize("kv_dtype, residual", [("int4", 0), ("int2", 16)])
def test_lowbit_codes_are_the_float_cache_quantized_in_groups(params, kv_dtype, residual):
    """Prefilled in chunks of 16 (a key group completes inside a later chunk than its first token), layer 0's store
    holds exactly the float cache's keys quantized per channel over groups of G slots and its values per token
    (layer 0's keys depend on the token alone); the window holds the slots after the last whole group that is older
    than ``residual`` tokens, in float."""
    # capacity 80: the float reference's programs are the decode test's below
    fl = Generator(CFG, params, max_new_tokens=1, cache=CacheConfig(prefill_chunk=16), capacity=80)
    lb = Generator(CFG, params, max_new_tokens=1, capacity=80,
                   cache=CacheConfig(prefill_chunk=16, kv_dtype=kv_dtype, kv_group=G, kv_residual=residual))
    n, bits = len(PROMPT), lowbit.LOWBIT[kv_dtype]
    ref, got = fl.prefill([PROMPT]).cache, lb.prefill([PROMPT]).cache
    k, v = _layer0_floats(ref, n)
    q = (n - residual) // G * G
    kc, ks, kz = lowbit.quantize_channels(k[:, :, :q], kv_dtype, G, channel_major=True)
    vc, vs, vz = lowbit.quantize_tokens(v[:, :, :q], kv_dtype, G)
    for name, want in (("k", kc), ("k_scale", ks), ("k_zero", kz)):
        stored = np.asarray(getattr(got, name)[0])
        stored = stored[..., :q * bits // 8] if name == "k" else stored[:, :, :q // G]
        np.testing.assert_array_equal(stored, np.asarray(want), err_msg=name)
    for name, want in (("v", vc), ("v_scale", vs), ("v_zero", vz)):
        np.testing.assert_array_equal(np.asarray(getattr(got, name)[0, :, :, :q]), np.asarray(want), err_msg=name)
    np.testing.assert_array_equal(np.asarray(got.k_res[0, :, :, :n - q]), k[:, :, q:])
    np.testing.assert_array_equal(np.asarray(got.v_res[0, :, :, :n - q]), v[:, :, q:])
    # keys channel-major, packed along the slots (whole key groups); values packed along head_dim
    assert got.k.dtype == np.uint8 and got.k.shape[-2:] == (CFG.head_dim, 80 * bits // 8)
    assert got.v.shape[-1] == CFG.head_dim * bits // 8


def test_lowbit_bytes_are_the_declared_ones_and_meet_the_ratios(params):
    """``GenerateResult.cache_bytes`` is the arrays' bytes, which follow the declaration: packed codes, a float16
    scale and zero per key group (per channel) and per value group (per token), and the float window; for a real
    model's shape (SmolLM2-135M: 30 layers, 3 KV heads, head dim 64) at 8,192 tokens, int4 with groups of 64 takes
    <= 0.30 of bfloat16's bytes and int2 <= 0.18 (the window in bfloat16)."""
    cache = CacheConfig(kv_dtype="int4", kv_group=G)
    res = lcx.generate(CFG, params, [PROMPT], max_new_tokens=2, cache=cache)
    L, k, d, W = CFG.n_layers, CFG.n_kv_heads, CFG.head_dim, G
    C = cache.kind(CFG).plan(1, len(PROMPT), 2)  # 47 slots: the last key group is partial
    codes = L * k * -(-C // G) * G * d // 2 + L * k * C * d // 2  # keys in whole groups of slots, values per slot
    scales = 2 * 2 * L * k * -(-C // G) * d + 2 * 2 * L * k * C * (d // G)
    window = 2 * L * k * W * d * 4  # float32, the model's dtype
    assert res.cache_bytes == codes + scales + window
    smol = ModelConfig(vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, d_ff=1536)
    bf16 = CacheConfig(dtype="bfloat16").kind(smol).nbytes(1, 8192)
    ratios = {q: CacheConfig(kv_dtype=q, dtype="bfloat16").kind(smol).nbytes(1, 8192) / bf16 for q in ("int4", "int2")}
    assert ratios["int4"] <= 0.30 and ratios["int2"] <= 0.18, ratios


def test_lowbit_decode_flushes_groups_as_a_prefill_and_sees_what_one_token_calls_see(params):
    """Decode steps quantize each key group when it leaves the window: after 12 steps layer 0 stores the codes and
    scales a prefill over the same tokens stores (same groups, same tokens). Fed one token per call, a prefill gives
    the logits of decode steps over the same tokens - a query sees the recent tokens in float and the older ones as
    codes, in both (a whole-prompt prefill differs: its early queries see as codes tokens a decode step would still
    hold in the window) - and they stay close to the float cache's."""
    # prefilled in chunks of 16 (the 45-token prompt and the 57 tokens fed back: one compiled chunk, the paged test's
    # contiguous int4 one too)
    cache = CacheConfig(kv_dtype="int4", kv_group=G, kv_residual=4, prefill_chunk=16)
    gen = Generator(CFG, params, max_new_tokens=12, cache=cache, capacity=80)
    state = gen.decode(gen.prefill([PROMPT]))
    fed = [PROMPT + [int(t) for t in state.tokens[0]]]
    whole = gen.prefill(fed).cache
    for name in lowbit_slots.STORED[:6]:
        np.testing.assert_array_equal(np.asarray(getattr(state.cache, name)[0]), np.asarray(getattr(whole, name)[0]),
                                      err_msg=name)
    n = len(fed[0]) - 1  # the last token is sampled, not yet written
    r = n - int(lowbit_slots.quantized_slots(n, PackedStorage(name="int4", group=G, residual=4)))
    for name in ("k_res", "v_res"):  # float, computed by a decode step vs a prefill: equal up to rounding
        np.testing.assert_allclose(np.asarray(getattr(state.cache, name)[0, :, :, :r]),
                                   np.asarray(getattr(whole, name)[0, :, :, :r]), atol=1e-5, err_msg=name)
    one = Generator(CFG, params, max_new_tokens=12, cache=CacheConfig(kv_dtype="int4", kv_group=G, kv_residual=4,
                                                                      prefill_chunk=1), capacity=80)
    stepped = one.decode(one.prefill([PROMPT]))
    fed = [PROMPT + [int(t) for t in stepped.tokens[0]]]
    np.testing.assert_allclose(np.asarray(stepped.logits), np.asarray(one.prefill(fed).logits), atol=2e-5)
    fl = Generator(CFG, params, max_new_tokens=1, cache=CacheConfig(prefill_chunk=16), capacity=80)
    diff = np.abs(np.asarray(fl.prefill(fed).logits) - np.asarray(stepped.logits))
    assert 0 < diff.max() < 0.1 * np.abs(np.asarray(stepped.logits)).max()  # int4: steps of 1/15 of a range


@pytest.mark.slow
def test_lowbit_eviction_keeps_values_exact_and_keys_within_requantization(params):
    """SnapKV (its own positions per KV head) compresses and evicts while decoding: every kept slot of layer 0
    holds the value codes and scales the uncompressed int4 cache holds at that position (values are quantized per
    token, so re-quantizing survivors is exact), and dequantized keys within one quantization step of the float
    keys (the first rounding plus the regrouped one, each at most half a step of its group's range)."""
    kw = dict(kv_dtype="int4", kv_group=G, positions="cache")
    gen = Generator(CFG, params, max_new_tokens=12, cache=CacheConfig(budget=16, interval=8, policy="snapkv",
                                                                      window=4, **kw))
    state = gen.decode(gen.prefill([PROMPT]))
    fed = [PROMPT + [int(t) for t in state.tokens[0]]]
    ref = Generator(CFG, params, max_new_tokens=1, cache=CacheConfig(**kw)).prefill(fed).cache
    flt = Generator(CFG, params, max_new_tokens=1, cache=CacheConfig(positions="cache")).prefill(fed).cache
    c = state.cache
    fmt = PackedStorage(name="int4", group=G)
    keys, values = (np.asarray(x[0]) for x in lowbit_slots.float_kv(
        jax.tree.map(lambda x: x[0] if hasattr(x, "ndim") and x.ndim > 1 else x, c), fmt, np.float32))
    n = len(fed[0])
    fk = np.asarray(flt.k[0, 0])[:, :n]  # [k, n, d]
    step = (fk.max(axis=1) - fk.min(axis=1)) / 15  # [k, d]: a step over a channel's whole range bounds any group's
    q = lowbit_slots.quantized_slots(np.asarray(c.count[0, 0]), fmt)  # [H] slots held as codes per keep head
    for kv_head in range(CFG.n_kv_heads):
        live = np.asarray(c.valid[0, 0, kv_head])
        pos = np.asarray(c.pos[0, 0, kv_head])[live]
        assert 0 < len(pos) < n  # something was evicted
        coded = np.arange(len(pos)) < q[kv_head]
        for name in ("v", "v_scale", "v_zero"):
            np.testing.assert_array_equal(np.asarray(getattr(c, name)[0, 0, kv_head])[:len(pos)][coded],
                                          np.asarray(getattr(ref, name)[0, 0, kv_head])[pos][coded], err_msg=name)
        err = np.abs(keys[kv_head, :len(pos)] - fk[kv_head, pos])
        assert np.all(err <= step[kv_head] * 1.01 + 1e-6)
        np.testing.assert_allclose(values[kv_head, :len(pos)], np.asarray(flt.v[0, 0, kv_head])[pos],
                                   atol=float(np.abs(flt.v[0]).max()) / 7.5 * 0.51 + 1e-6)


# SnapKV runs as AdaKV's and PyramidKV's scorer here and on int2 pages below.
POLICIES = {"streaming": dict(sinks=2), "h2o": {}, "tova": {}, "knorm": {},
            "ladder": dict(sinks=2, span=1, overlap=0, recent=4),  # span below the 2 layers
            "adakv": dict(policy="snapkv", window=4, head_budget="adaptive"),
            "pyramid": dict(policy="snapkv", window=4, budget_schedule="pyramid"),
            "chunkkv": dict(window=4, chunk=4), "expected_attention": dict(sinks=2, horizon=16),
            "kvzip": dict(sinks=2, chunk=64), "keydiff": {}, "capkv": {}}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(POLICIES))  # one case per policy: the workers share them
def test_lowbit_every_eviction_policy_runs_and_keeps_its_budget(params, name):
    """Every eviction policy (SnapKV as AdaKV's and PyramidKV's scorer) runs on int2 codes with a window (scores
    on the dequantized slots, survivors re-quantized): finite logits, the cache evicted and within its capacity,
    fewer bytes than the float cache."""
    from lcx.cache.reconstruct import Reconstruction

    kw = {"policy": name, **POLICIES[name]}
    # KVzip scores the whole prompt by a reconstruction pass, then compresses: the prompt fits the capacity
    extra = dict(reconstruction=Reconstruction(first=(3, 4, 5), later=(6,), suffix=(7,), skip=1, tail=3),
                 capacity=64) if name == "kvzip" else {}
    cache = CacheConfig(budget=16, interval=8, kv_dtype="int2", kv_group=G, kv_residual=8, **kw)
    gen = Generator(CFG, params, max_new_tokens=10, cache=cache, **extra)
    state = gen.decode(gen.prefill([PROMPT]))
    assert np.isfinite(np.asarray(state.logits)).all(), name
    count = np.asarray(state.cache.count)
    assert count.max() <= state.cache.capacity and count.min() < len(PROMPT), name  # it evicted, within room
    floats = CacheConfig(budget=16, interval=8, **kw).kind(CFG).nbytes(1, state.cache.capacity)
    assert state.cache.kv_bytes() < floats, name  # (a 16-slot float window at this tiny capacity)


@pytest.mark.parametrize("cache, message", [
    (dict(kv_dtype="int3"), "cache.kv_dtype='int3' is invalid: must be one of ['int8', 'fp8', 'int4', 'int2', 'fp4']"),
    (dict(kv_dtype="int4", kv_group=48), "cache.kv_group=48 is invalid: must be a power of two"),
    (dict(kv_dtype="int2", kv_group=2), "cache.kv_group=2 is invalid: must be >= 4 with cache.kv_dtype='int2'"),
    (dict(kv_dtype="int4", kv_residual=-1), "cache.kv_residual=-1 is invalid: must be a non-negative integer"),
    (dict(kv_dtype="int8", kv_residual=128), "cache.kv_residual=128 applies to the bit-packed caches only"),
    (dict(kv_group=32), "cache.kv_group=32 applies to the bit-packed caches only"),
    (dict(kv_dtype="int4", layout="paged"), "cache.page_size=16 is invalid: must be a multiple of "
                                            "cache.kv_group=64 with cache.kv_dtype='int4' and layout 'paged'"),
    (dict(kv_dtype="int2", layout="paged", page_size=8, kv_group=16), "raise page_size (e.g. 16) or lower kv_group "
                                                                      "to a divisor of 8 (>= 4)"),
    (dict(kv_dtype="int2", policy="memory", window=64, layout="paged"),
     "cache.kv_dtype='int2' with cache.policy='memory' and cache.layout='paged': a quantized cache is built for the "
     "slot cache"),
])
def test_lowbit_errors_name_the_field_and_what_is_allowed(cache, message):
    with pytest.raises(ConfigError) as err:
        CacheConfig(**cache)
    assert message in str(err.value)


def test_lowbit_model_errors_name_the_setting():
    """A head dim the groups cannot split, and a model with sliding-window layers, fail when the cache is built."""
    with pytest.raises(ValueError, match=r"cache.kv_group=32 must divide the model.s head_dim=48"):
        CacheConfig(kv_dtype="int4", kv_group=32).kind(ModelConfig(vocab_size=61, d_model=96, n_layers=1,
                                                                    n_heads=2, n_kv_heads=1, d_ff=48))
    gemma = ModelConfig(vocab_size=61, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, sliding_window=8,
                        layer_types=("sliding_attention", "full_attention"))
    with pytest.raises(ConfigError, match="this model has sliding-window layers"):
        CacheConfig(kv_dtype="int4").kind(gemma)


# --------------------------------------------------------------------------------------------------- in pages
PAGE = 16  # two key groups of G per page


@pytest.mark.slow
@pytest.mark.parametrize("kw", [dict(kv_dtype="int4", kv_residual=4),
                                dict(kv_dtype="int2", policy="snapkv", budget=16, window=4, interval=8)],
                         ids=["int4-full-window", "int2-snapkv"])
def test_paged_lowbit_cache_generates_the_contiguous_tokens_and_shares_pages_of_codes(params, kw):
    """``layout: paged`` (``lcx.cache.lowbit_pages``): the same store cut into pages of whole key groups, the float
    window per row. Full int4 with a residual window and SnapKV int2 (evicting while the prompt streams in and while
    decoding, forked after the context: copy-on-write of the code pages it rewrites) give the contiguous cache's
    tokens; a fork shares the pages of codes (not the window's slots); ``cache_bytes`` is the peak pages plus the
    rows' windows."""
    questions = [np.random.default_rng(i).integers(0, 61, n).tolist() for i, n in ((1, 5), (2, 11), (3, 3))]
    tokens, results = {}, {}
    for layout in ("contiguous", "paged"):
        cache = CacheConfig(layout=layout, page_size=PAGE, kv_group=G, prefill_chunk=16, **kw)
        gen = Generator(CFG, params, max_new_tokens=9, cache=cache, capacity=80)
        state = gen.fork(gen.prefill([PROMPT]), len(questions))
        if layout == "paged" and "policy" not in kw:
            # 45 tokens, 4 in the window: slots 0..39 are codes, so pages 0 and 1 (32 slots) are shared
            table, refs = np.asarray(state.cache.table), np.asarray(state.cache.refs)
            np.testing.assert_array_equal(table[:, :2], np.broadcast_to(table[0, :2], (3, 2)))
            assert np.all(refs[table[0, :2]] == 3) and len(set(table[:, 2].tolist())) == 3
            np.testing.assert_array_equal(state.cache.k_res[:, 1], state.cache.k_res[:, 0])  # the window copied
        state = gen.decode(gen.prefill(questions, state=state))
        tokens[layout], results[layout] = gen.result(state).tokens, gen.result(state)
    np.testing.assert_array_equal(tokens["paged"], tokens["contiguous"], err_msg=str(kw))
    kind = CacheConfig(layout="paged", page_size=PAGE, kv_group=G, **kw).kind(CFG)
    assert kind.name == "paged_slots" and state.cache.k.dtype == np.uint8
    bits, d, kv_heads = lowbit.LOWBIT[kw["kv_dtype"]], CFG.head_dim, CFG.n_kv_heads
    # one page: key codes, a scale and zero per key group and channel, value codes, a scale and zero per token
    # and value group - per KV head and layer
    per_head = 2 * PAGE * d * bits // 8 + 2 * 2 * (PAGE // G) * d + 2 * 2 * PAGE * (d // min(G, d))
    assert kind.page_nbytes() == CFG.n_layers * kv_heads * per_head
    window = state.cache.k_res.size * state.cache.k_res.dtype.itemsize * 2
    assert results["paged"].cache_bytes == int(state.cache.peak) * kind.page_nbytes() + window


@pytest.mark.slow
@pytest.mark.parametrize("kw", [dict(kv_dtype="int4", kv_group=G, kv_residual=4)], ids=["int4"])
def test_kvzip_on_pages_gives_the_contiguous_tokens_and_then_holds_only_the_kept_pages(params, kw):
    """KVzip on bit-packed pages (its reconstruction passes score the gathered view; float pages: the one-shot
    evaluation test in test_eval_checkpoint.py): the contiguous cache's tokens
    for two prompts forked into two rows each; after the compression a row holds the pages of its kept slots only
    (``held_bytes``), while ``cache_bytes`` is the peak (the whole prompt, prefilled before it is scored)."""
    from lcx.cache.reconstruct import Reconstruction

    prompts = [PROMPT, np.random.default_rng(6).integers(0, 61, 30).tolist()]
    rec = Reconstruction(first=(3, 4, 5), later=(6,), suffix=(7,), skip=1, tail=3)
    tokens = {}
    for layout in ("contiguous", "paged"):
        cache = CacheConfig(policy="kvzip", budget=16, interval=48, sinks=2, chunk=8, layout=layout, page_size=PAGE,
                            prefill_chunk=16, **kw)
        gen = Generator(CFG, params, max_new_tokens=8, cache=cache, reconstruction=rec)
        state = gen.prefill(prompts)
        if layout == "paged":
            c = state.cache
            kept = np.asarray(c.count).max(axis=(0, 2))  # [b] slots the fullest layer and head keeps
            assert kept.max() <= 16 < min(map(len, prompts))  # compressed
            held = -(-kept // PAGE)
            assert int(c.pool.in_use()) == held.sum() and int(c.peak) == sum(-(-len(p) // PAGE) for p in prompts)
            window = c.held_bytes() - int(c.pool.in_use()) * c.kind.page_nbytes()
            assert window == (c.k_res.nbytes + c.v_res.nbytes if kw else 0)
            assert c.held_bytes() < c.kv_bytes()
        tokens[layout] = gen.result(gen.decode(gen.fork(state, 2))).tokens
    np.testing.assert_array_equal(tokens["paged"], tokens["contiguous"])


def test_paged_lowbit_server_serves_each_request_as_generate_does(params):
    """``lcx serve --kv-dtype int4`` underneath: the continuous-batching server over bit-packed pages (its table
    cut to the pages the rows hold) gives each request the contiguous int4 cache's tokens, keeps no prefix (the
    window is not in the pages) and returns every page; a page store is refused."""
    from lcx.engine.server import Server

    prompts = [np.random.default_rng(i).integers(0, 61, n).tolist() for i, n in enumerate((30, 17, 41), 1)]
    new = (8, 6, 10)
    kw = dict(kv_dtype="int4", kv_group=G, kv_residual=8)
    server = Server(CFG, params, max_num_seqs=2, max_len=64, segment=4, prefill_chunk=16,
                    cache=CacheConfig(layout="paged", page_size=2 * G, **kw))
    # the same prefill chunks: a chunk attends on its own keys as codes once their group leaves the window, so a
    # bit-packed cache's tokens depend on where the chunks end
    alone = lcx.generate(CFG, params, prompts, max_new_tokens=max(new),
                         cache=CacheConfig(prefill_chunk=server.chunk, **kw))
    ids = [server.submit(p, max_new_tokens=n) for p, n in zip(prompts, new)]
    out = server.run()
    for i, n, row in zip(ids, new, alone.tokens):
        assert out[i] == row[:n].tolist(), f"request {i}"
    assert server.prefix_entries == 0 and int(np.asarray(server.state.refs).sum()) == 0
    with pytest.raises(ConfigError, match=r"Server store= with cache.kv_dtype='int4'"):
        Server(CFG, params, cache=CacheConfig(layout="paged", page_size=2 * G, **kw), store=object())


@pytest.mark.pallas
def test_pallas_backend_decodes_on_the_codes_with_its_kernel(params):
    """``attention.impl: pallas`` reads a bit-packed cache through the kernels that unpack tile by tile
    (``lcx.kernels.lowbit_pallas``; interpreted here, compiled on a GPU): greedy tokens equal the XLA path's, the
    decode step's program holds the split-K kernel and a prefill chunk's the chunk kernel."""
    import dataclasses

    pallas = dataclasses.replace(CFG, attention=lcx.AttentionConfig(impl="pallas"))
    cache = CacheConfig(kv_dtype="int4", kv_group=G, kv_residual=4, prefill_chunk=16)
    prompts = [PROMPT[:30], PROMPT[10:]]
    want = lcx.generate(CFG, params, prompts, max_new_tokens=5, cache=cache)
    got = lcx.generate(pallas, params, prompts, max_new_tokens=5, cache=cache)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    state = cache.kind(pallas).create(1, 32)
    step = jax.make_jaxpr(lambda p, ids, c: lcx.Decoder(pallas).apply({"params": p}, ids, cache=c))(
        params, np.ones((1, 1), np.int32), state)
    assert "lcx_lowbit_decode" in str(step)
    chunk = jax.make_jaxpr(lambda p, ids, c: lcx.Decoder(pallas).apply({"params": p}, ids, cache=c))(
        params, np.ones((1, 8), np.int32), state)
    assert "lcx_lowbit_chunk" in str(chunk) and "lcx_lowbit_chunk" not in str(
        jax.make_jaxpr(lambda p, ids, c: lcx.Decoder(CFG).apply({"params": p}, ids, cache=c))(
            params, np.ones((1, 8), np.int32), cache.kind(CFG).create(1, 32)))
