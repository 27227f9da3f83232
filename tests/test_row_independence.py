"""Rows independent of their batch (issue 60): under eviction a row is compacted when its own cache would overflow
and only then, so its tokens are the ones it generates alone whatever its batch-mates - on slots and on pages, while
the prompt is prefilled in chunks and while decoding - and an evaluation cell's results do not depend on
``eval.batch_size``."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lcx
from lcx.config import CacheConfig
from lcx.engine import Generator

CFG = lcx.ModelConfig(vocab_size=61, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=64, init_std=0.1)
# budget 12 + interval 8: 20 slots per row. In chunks of 8 the 30-token prompt overflows in its third chunk
# (16 + 8 > 20) while the 19-token one still fits (16 + 3); after the prompt the rows hold 12, 5, 12 and 9 tokens, so
# they overflow at different decode steps (the 5-token row last).
LENGTHS = (19, 5, 30, 9)
NEW = 20
POLICIES = {"streaming": dict(sinks=2), "tova": {}, "snapkv": dict(window=4, kernel=3)}


@pytest.fixture(scope="module")
def params():
    return lcx.init_params(CFG, jax.random.key(0))


def _prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(0, CFG.vocab_size, n).tolist() for n in LENGTHS]


def _cache(policy: str, **kw) -> CacheConfig:
    return CacheConfig(policy=policy, budget=12, interval=8, prefill_chunk=8, **POLICIES[policy], **kw)


def _each_row_as_alone(params, cache: CacheConfig) -> None:
    prompts = _prompts()
    batch = lcx.generate(CFG, params, prompts, max_new_tokens=NEW, cache=cache)
    for i, prompt in enumerate(prompts):
        alone = lcx.generate(CFG, params, [prompt], max_new_tokens=NEW, cache=cache)
        np.testing.assert_array_equal(batch.tokens[i], alone.tokens[0], err_msg=f"row {i} ({LENGTHS[i]} tokens)")


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_each_row_generates_what_it_generates_alone(params, policy):
    _each_row_as_alone(params, _cache(policy))


def test_each_row_on_pages_generates_what_it_generates_alone(params):
    _each_row_as_alone(params, _cache("snapkv", layout="paged", page_size=4))


def test_the_server_serves_each_request_as_generated_alone(params):
    """Continuous batching under eviction (``lcx serve --cache-policy``): a request's tokens do not depend on who
    else is being served - the rows prefill, evict and decode at their own steps."""
    from lcx.engine.server import Server

    server = Server(CFG, params, max_num_seqs=3, max_len=64, segment=4, prefill_chunk=8,
                    cache=_cache("snapkv", layout="paged", page_size=4))
    prompts = _prompts()
    ids = [server.submit(p, max_new_tokens=NEW) for p in prompts]
    out = server.run()
    for i, prompt in zip(ids, prompts):
        alone = lcx.generate(CFG, params, [prompt], max_new_tokens=NEW, cache=_cache("snapkv"))
        assert out[i] == alone.tokens[0].tolist(), f"request {i} ({len(prompt)} tokens)"


def test_teacher_forcing_scores_each_row_as_alone(params):
    """``Generator.score`` in chunks: a chunk never carries a row past its own eviction (``score_room`` is the room of
    the fullest row not yet full), so each row's log-probabilities are the ones it gets alone."""
    gen = Generator(CFG, params, max_new_tokens=NEW, cache=_cache("tova"))
    prompts = _prompts()
    tokens = np.random.default_rng(1).integers(0, CFG.vocab_size, (len(prompts), NEW))
    _, batch = gen.score(gen.prefill(prompts), tokens)
    for i, prompt in enumerate(prompts):
        _, alone = gen.score(gen.prefill([prompt]), tokens[i:i + 1])
        np.testing.assert_allclose(batch[i], alone[0], rtol=1e-5, atol=1e-5, err_msg=f"row {i}")


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_make_room_cuts_only_the_rows_that_overflow(params, layout):
    """One row over its capacity: it is compacted; every buffer of the other rows (slots, positions, scores, their
    pages and the bytes in them) stays as it was, to the bit."""
    kw = dict(layout="paged", page_size=4) if layout == "paged" else {}
    gen = Generator(CFG, params, max_new_tokens=NEW, cache=_cache("snapkv", **kw))
    cache = gen.decode(gen.prefill(_prompts()), steps=4).cache  # 16, 9, 16 and 13 tokens: none cut yet
    n = jnp.asarray([5, 1, 4, 7], jnp.int32)  # only row 0 would overflow (16 + 5 > 20); row 2 just fits
    out = jax.jit(gen.kind.make_room)(cache, n)
    assert np.asarray(out.count).max(axis=(0, 2)).tolist() == [12, 9, 16, 13]
    before, after = _row_buffers(gen.kind, cache), _row_buffers(gen.kind, out, cache)
    for name in before:
        np.testing.assert_array_equal(after[name][:, 1:], before[name][:, 1:], err_msg=name)


def _row_buffers(kind, state, held=None) -> dict[str, np.ndarray]:
    """The buffers with a row axis, rows second: the per-row fields and, on pages, the table and each row's keys
    and values read through it - through ``held``'s table when given (the pages the rows held before: make_room
    also grants the pages the next tokens need)."""
    out = {n: np.asarray(getattr(state, n)) for n, f in kind.fields().items()
           if "batch" in f.axes and "layers" in f.axes and getattr(state, n) is not None}
    if hasattr(state, "table"):
        table = (state if held is None else held).table
        out["table"] = np.asarray(jnp.where(table >= 0, state.table, -1))[None]
        mask = (table >= 0)[None, :, :, None, None, None]
        out |= {f"{n} pages": np.asarray(jnp.where(mask, getattr(state, n)[:, jnp.maximum(table, 0)], 0))
                for n in ("k", "v")}
    return out


def test_an_eval_cell_is_the_same_at_any_batch_size(tmp_path):
    """A grid cell's generations and score at ``eval.batch_size`` 1 and 4: the passkey prompts of one length differ
    by a token (123, 123, 122, 122), the budget holds them whole, and the rows fill up one decode step apart."""
    from lcx.eval.config import EvalConfig
    from lcx.eval.grid import run_eval

    model = lcx.ModelConfig(vocab_size=260, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64,
                            max_position_embeddings=256, init_std=0.1)
    weights = lcx.init_params(model, jax.random.key(1))
    # a model that speaks printable ASCII (the other byte ids' logits 0): its generations read back as distinct text
    printable = (jnp.arange(model.vocab_size) >= 32) & (jnp.arange(model.vocab_size) < 127)
    weights = {**weights, "lm_head": jnp.where(printable, weights["lm_head"], 0.0)}
    cache = CacheConfig(policy="tova", budget=123, interval=4)
    outputs = {}
    for batch in (1, 4):
        ev = EvalConfig(task="passkey", params={"instruction": False}, lengths=(128,), samples=4, batch_size=batch,
                        max_new_tokens=16)
        rows = run_eval(model, weights, ev, cache, tmp_path / f"b{batch}", progress=False)
        lines = (tmp_path / f"b{batch}" / "outputs.jsonl").read_text().splitlines()
        outputs[batch] = ([{k: r[k] for k in ("value", "lo", "hi")} for r in rows],
                          [(x["sample"], x["output"], x["grade"]) for x in map(json.loads, lines)])
    assert outputs[1] == outputs[4]
