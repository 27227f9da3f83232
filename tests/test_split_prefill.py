"""One-shot contexts read in two parts (``lcx.engine.split_prefill``) and one-shot grid cells that share each
prompt's prefill (``lcx.eval.groups``): the same compressed caches and answers as each policy alone, the same kept
tokens as one call, and the refusals for policies the split would change."""

import json

import numpy as np
import pytest
import yaml

from lcx.config import CacheConfig
from lcx.data import make_task
from lcx.data.policy_inputs import policy_inputs
from lcx.data.tokenizer import HFTokenizer
from lcx.engine import Generator
from lcx.engine import split_prefill
from lcx.eval import grid
from lcx.eval.cells import Cell, Shard, assign
from lcx.eval.config import Setting
from lcx.eval.evaluate import cell_examples
from lcx.experiment import load_experiment, run
from lcx.hf import load_hf
from tests.tiny_chat_model import write_model

LENGTH = 640  # a context of ~600 tokens: more than the split's 256-token tail
SHARED = [{"policy": "snapkv", "window": 8}, {"policy": "tova"}, {"policy": "kvzip", "chunk": 128},
          {"policy": "knorm"}]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    folder = write_model(tmp_path_factory.mktemp("tiny"))
    config, params = load_hf(folder)
    task = make_task("niah_single_1", {}).with_tokenizer(HFTokenizer(folder), chat=True)
    return folder, config, params, task


def _one_shot(spec: dict, room: int = 64) -> CacheConfig:
    return Setting(tuple(sorted({**spec, "interval": 32, "prefill_chunk": 256}.items())), compression=0.75,
                   protocol="one_shot").cache(LENGTH, room)


def test_refusals_name_what_the_split_would_change(chat_model):
    _, config, _, _ = chat_model
    for spec in SHARED:
        assert split_prefill.split_refusal(config, _one_shot(spec)) is None, spec
    refused = {"h2o": "observes queries before", "expected_attention": "statistics of every query",
               "streaming": "not stored rotated"}
    for policy, why in refused.items():
        assert why in split_prefill.split_refusal(config, _one_shot({"policy": policy})), policy
    assert "int8 storage" in split_prefill.split_refusal(config, _one_shot({"policy": "snapkv", "kv_dtype": "int8"}))
    assert "contiguous" in split_prefill.split_refusal(config, _one_shot({"policy": "snapkv", "layout": "paged"}))
    assert "nothing to share" in split_prefill.split_refusal(config, CacheConfig())


def test_a_shared_start_gives_each_policy_its_cache_alone(chat_model):
    """Each policy continued from one start (read once, every policy after the other) holds the same slots, keys and
    positions as from a start read for it alone - the start is not consumed - and keeps the tokens a single-call
    prefill of the whole context keeps."""
    _, config, params, task = chat_model
    examples = cell_examples(task, length=LENGTH, depth=None, samples=2, seed=0)
    contexts = [ex.prompt_ids[:ex.context_len] for ex in examples]
    assert split_prefill.split(contexts, LENGTH + 128)
    caches = [_one_shot(spec) for spec in SHARED]
    gens = [Generator(config, params, max_new_tokens=64, cache=c, capacity=LENGTH + 128,
                      **policy_inputs(c.make_policy(), task.frame)) for c in caches]
    base = split_prefill.base_generator(gens[0], LENGTH + 128)
    start = split_prefill.read_start(base, contexts)
    shared = [split_prefill.read_rest(g, start, contexts).cache for g in gens]
    for gen, cache, spec in zip(gens, shared, SHARED):
        alone = split_prefill.read_rest(gen, split_prefill.read_start(base, contexts), contexts).cache
        for name in ("k", "v", "pos", "valid", "count", "lengths"):
            np.testing.assert_array_equal(np.asarray(getattr(cache, name)), np.asarray(getattr(alone, name)), name)
        one_call = gen.prefill(contexts).cache  # the context in one call: the same math, rounded otherwise
        assert _overlap(cache, one_call) > 0.97, spec["policy"]
        assert int(np.asarray(cache.count).max()) < len(contexts[0]) // 2  # it compressed


def test_roomy_split_equals_one_call(chat_model):
    """A budget that holds the whole context evicts nothing: the split read's next-token logits are one call's."""
    _, config, params, task = chat_model
    contexts = [ex.prompt_ids[:ex.context_len] for ex in cell_examples(task, length=LENGTH, depth=None, samples=1,
                                                                       seed=0)]
    roomy = CacheConfig(policy="snapkv", window=8, budget=LENGTH, interval=1024, prefill_chunk=1024)
    gen = Generator(config, params, max_new_tokens=8, cache=roomy, capacity=LENGTH + 64)
    split = split_prefill.read_rest(gen, split_prefill.read_start(split_prefill.base_generator(gen, LENGTH + 64),
                                                                  contexts), contexts)
    np.testing.assert_allclose(np.asarray(split.logits), np.asarray(gen.prefill(contexts).logits), atol=2e-4,
                               rtol=2e-4)


def test_group_answers_equal_each_policy_alone(chat_model, tmp_path, monkeypatch):
    """A grid of one-shot policies: the cells that can split share each prompt's start (read once per prompt, not
    once per policy) and give the answers of the same grid run cell by cell; H2O, which observes every query, runs
    alone; the cells record the split."""
    folder = chat_model[0]
    starts = []
    read_start = split_prefill.read_start
    monkeypatch.setattr(split_prefill, "read_start", lambda *a: starts.append(1) or read_start(*a))
    body = {"name": "group", "checkpoint": str(folder), "stages": ["ablate"],
            "eval": {"tasks": ["niah_single_1"], "lengths": [LENGTH], "samples": 2, "batch_size": 1, "chat": True},
            "ablate": {"policies": [*SHARED, {"policy": "h2o"}], "compressions": [0.75], "protocols": ["one_shot"],
                       "interval": 32, "prefill_chunk": 256}}

    def outputs(name):
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump({**body, "runs_dir": str(tmp_path / name)}))
        run(load_experiment(path), progress=False)
        out = tmp_path / name / "group" / "ablate"
        records = [json.loads(p.read_text()) for p in (out / "cells").glob("*/cell.json")]
        return [json.loads(line) for line in open(out / "outputs.jsonl")], records

    grouped, records = outputs("grouped")
    assert len(starts) == 2  # one per prompt for the 4 policies that split
    assert len(grouped) == 2 * (len(SHARED) + 1)
    assert sorted(r["inputs"].get("split") for r in records if "h2o" not in r["cell"]) == [256] * len(SHARED)
    assert all("split" not in r["inputs"] for r in records if "h2o" in r["cell"])
    monkeypatch.setattr(grid, "share_keys", lambda specs, *a: [""] * len(specs))  # every cell alone
    alone, _ = outputs("alone")
    assert len(starts) == 2 + 2 * len(SHARED)  # each policy read each prompt's start itself
    assert alone == grouped


def test_a_group_is_one_shard_unit():
    cells = [Cell(f"c{i}", {"i": i}, cost=c) for i, c in enumerate([5, 1, 1, 1, 4, 3])]
    groups = ["", "g", "g", "g", "", ""]
    shares = [assign(cells, Shard(i, 2), groups) for i in range(2)]
    assert sorted(shares[0] + shares[1]) == list(range(6))
    assert any({1, 2, 3} <= set(s) for s in shares)  # the group's three cells went to one worker
    assert assign(cells, Shard(0, 2)) == assign(cells, Shard(0, 2), [""] * 6)  # no groups: as before


def test_sliding_window_layers_share_a_start_too():
    """A Gemma-3-shaped model (two sliding-window layers, one global): the local layers' window cache is carried over
    (padded to the policy's own slots), the global layer's re-laid; the same states as alone, the tokens one call
    keeps, and a roomy budget's logits are one call's."""
    import jax

    from lcx.model.config import ModelConfig, RopeConfig
    from lcx.model.decoder import init_params

    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=48, head_dim=8,
                      family="gemma3", layer_types=("sliding_attention", "sliding_attention", "full_attention"),
                      sliding_window=16, query_scale=12.0, local_rope=RopeConfig(theta=100.0), init_std=0.3,
                      max_position_embeddings=2048)
    params = init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    contexts = [rng.integers(3, 64, 600), rng.integers(3, 64, 600)]
    capacity = LENGTH + 128
    for spec in ({"policy": "snapkv", "window": 8}, {"policy": "tova"},
                 {"policy": "snapkv", "window": 8, "compression": None}):
        cache = (_one_shot(spec) if "compression" not in spec else
                 CacheConfig(policy="snapkv", window=8, budget=LENGTH, interval=1024, prefill_chunk=1024))
        assert split_prefill.split_refusal(cfg, cache) is None
        gen = Generator(cfg, params, max_new_tokens=64, cache=cache, capacity=capacity)
        base = split_prefill.base_generator(gen, capacity)
        start = split_prefill.read_start(base, contexts)
        first = split_prefill.read_rest(gen, start, contexts)
        again = split_prefill.read_rest(gen, start, contexts)  # the start is not consumed
        for a, b in zip(jax.tree.leaves(first.cache), jax.tree.leaves(again.cache)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        whole = gen.prefill(contexts)
        if "compression" in spec:  # evicts nothing: one call's logits
            np.testing.assert_allclose(np.asarray(first.logits), np.asarray(whole.logits), atol=2e-4, rtol=2e-4)
            continue
        assert _overlap(first.cache.glob, whole.cache.glob) > 0.97, spec
        assert int(np.asarray(first.cache.glob.count).max()) < 300
        np.testing.assert_array_equal(np.asarray(first.cache.loc.pos)[..., :int(whole.cache.loc.pos.shape[-1])],
                                      np.asarray(whole.cache.loc.pos))


def _overlap(a, b) -> float:
    """The share of the kept (layer, row, keep head, position) entries two slot caches agree on."""
    def kept(c):
        pos, valid = np.asarray(c.pos), np.asarray(c.valid)
        return {(*idx[:-1], int(pos[idx])) for idx in zip(*np.nonzero(valid))}
    x, y = kept(a), kept(b)
    return len(x & y) / max(len(x | y), 1)


def test_what_a_split_needs_besides_the_policy(chat_model):
    """The split is a one-shot read: a cache too small for the whole context reads it in one call, evicting as it
    goes (SnapKV answers; KVzip is refused as before, naming the whole context's length); a RoPE whose frequencies
    depend on the length is refused; caches of other dtypes do not share a start, and a group of both runs."""
    import dataclasses

    from lcx.config import ConfigError
    from lcx.eval.one_shot import one_shot_outputs
    from lcx.eval.evaluate import prompt_batches, retrieval_outputs
    from lcx.model.config import RopeConfig

    _, config, params, task = chat_model
    examples = cell_examples(task, length=LENGTH, depth=None, samples=1, seed=0)
    contexts = [ex.prompt_ids[:ex.context_len] for ex in examples]
    assert not split_prefill.split(contexts, len(contexts[0]) - 1) and split_prefill.split(contexts, LENGTH)
    small = CacheConfig(policy="snapkv", budget=64, window=8)  # capacity 96 < the context: evicts while reading
    _, out = retrieval_outputs(config, params, task, length=LENGTH, depth=None, samples=1, batch_size=1, seed=0,
                               cache=small, max_new_tokens=4, protocol="one_shot")
    assert isinstance(out[0], str)
    with pytest.raises(ConfigError, match=f"the prompt \\({len(contexts[0])} tokens\\) must fit"):
        retrieval_outputs(config, params, task, length=LENGTH, depth=None, samples=1, batch_size=1, seed=0,
                          cache=CacheConfig(policy="kvzip", budget=300, interval=64, chunk=128), max_new_tokens=4,
                          protocol="one_shot")
    dynamic = dataclasses.replace(config, rope=RopeConfig(type="dynamic", factor=4.0))
    assert "depend on the length" in split_prefill.split_refusal(dynamic, _one_shot({"policy": "tova"}))
    half = _one_shot({"policy": "tova", "dtype": "bfloat16"})
    assert split_prefill.base_key(half, 900) != split_prefill.base_key(_one_shot({"policy": "tova"}), 900)
    measured = one_shot_outputs(config, params, task, examples, [_one_shot({"policy": "tova"}), half],
                                batches=prompt_batches(examples, 1, "one_shot", task.name), batch_size=1, max_new=4,
                                generator_new=4 + 64, capacity=LENGTH + 128, unroll=None)
    assert all(isinstance(m.outputs[0], str) and m.counts["prefilled_tokens"] > 0 for m in measured)
