"""Serving with self-speculative decoding (``lcx serve --speculative-draft``, issue 64): every request's greedy
tokens equal plain decoding of its prompt alone while rows come and go (more requests than rows, prompts read in
chunks, EOS, ignore_eos, cancellation from a callback), sampled requests are independent of their batch-mates, the
acceptance counters are exact, and through the real ``openai`` client the service streams the offline tokens and
publishes ``lcx_spec_draft_tokens_total`` / ``lcx_spec_accepted_tokens_total``. Bad flags get one error naming
the flag."""

from __future__ import annotations

import numpy as np
import pytest

import lcx
from lcx.config import CacheConfig, ConfigError
from lcx.engine.spec_server import SpecServer
from lcx.engine.speculative import SpeculativeConfig
from lcx.service.config import ServeConfig
from lcx.service.app import encode_chat
from tests.test_service import Running, _free_port, _M, _offline
from tests.test_speculative import CFG, params  # noqa: F401 - the engine tests' tiny model and its params fixture
from tests.test_speculative import _prompts as _random_prompts
from tests.tiny_chat_model import write_model

EOS = 7
LENGTHS = (40, 25, 60, 33, 50, 21)
NEW = (24, 10, 24, 5, 17, 12)
SNAPKV = SpeculativeConfig(draft=CacheConfig(policy="snapkv", budget=16, window=4, interval=8), k=3)


def _prompts(lengths=LENGTHS, seed=0):
    return _random_prompts(lengths, seed)


def _server(params, spec=SNAPKV, **kw) -> SpecServer:
    return SpecServer(CFG, params, speculative=spec, max_num_seqs=3, max_len=96, eos_id=EOS, segment=4,
                      prefill_chunk=16, **kw)


def _alone(params, prompt, n, ignore_eos=False) -> list[int]:
    out = lcx.generate(CFG, params, [prompt], max_new_tokens=n, eos_id=None if ignore_eos else EOS)
    return out.tokens[0, :int(out.lengths[0])].tolist()


def test_rows_that_come_and_go_generate_their_plain_greedy_tokens(params):
    """Six requests on three rows: prompts of 21-60 tokens read 16 at a time beside decoding rows, rows freed at EOS
    or max_new_tokens and taken by the next; one request ignores EOS; one is cancelled by its own callback."""
    server = _server(params)
    prompts = _prompts()
    ids = [server.submit(p, n, ignore_eos=(i == 4)) for i, (p, n) in enumerate(zip(prompts, NEW))]
    seen: dict[int, list[int]] = {}

    def on_token(request, token):
        seen.setdefault(request, []).append(token)
        if request == ids[2] and len(seen[request]) == 6:
            server.cancel(request)

    out = server.run(on_token)
    for i, (prompt, n) in enumerate(zip(prompts, NEW)):
        want = _alone(params, prompt, n, ignore_eos=(i == 4))
        if i == 2:
            assert ids[i] not in out and server.cancelled[ids[i]] is None
            assert seen[ids[i]] == want[:6]  # nothing streamed after the cancel
            continue
        assert out[ids[i]] == want == seen[ids[i]], i
    assert not server.busy and server.pages_used() == 0
    assert 0 < server.accepted_tokens <= server.drafted_tokens
    assert server.prefill_tokens == sum(LENGTHS)


def test_sampled_requests_are_independent_of_their_batch_mates(params):
    """A seeded sampled request gives the same tokens alone and in a crowd of greedy and sampled ones; another
    seed gives others."""
    prompts = _prompts(seed=1)
    sampling = lcx.SamplingConfig(temperature=1.0)
    alone = _server(params)
    first = alone.submit(prompts[0], 20, sampling, seed=5)
    want = alone.run()[first]
    crowd = _server(params)
    others = [crowd.submit(p, 20, lcx.SamplingConfig(temperature=t), seed=i)
              for i, (p, t) in enumerate(zip(prompts[1:4], (0.0, 0.8, 1.0)))]
    mine = crowd.submit(prompts[0], 20, sampling, seed=5)
    out = crowd.run()
    assert out[mine] == want and len(out) == 1 + len(others)
    again = _server(params)
    other = again.submit(prompts[0], 20, sampling, seed=6)
    assert again.run()[other] != want


def test_an_int8_draft_is_accepted_almost_always_and_counted_exactly(params):
    """8-bit codes of every token draft what the float cache verifies: nearly every draft accepted; the counters
    are the loop's own per-row counts summed."""
    server = _server(params, SpeculativeConfig(draft=CacheConfig(kv_dtype="int8"), k=3))
    ids = [server.submit(p, 20, ignore_eos=True) for p in _prompts()[:3]]
    out = server.run()
    for i, p in zip(ids, _prompts()[:3]):
        assert out[i] == _alone(params, p, 20, ignore_eos=True)
    state = server.state
    assert server.drafted_tokens == int(np.asarray(state.drafted).sum()) > 0
    assert server.accepted_tokens == int(np.asarray(state.accepted).sum())
    assert server.accepted_tokens / server.drafted_tokens > 0.9


def test_a_grouped_int4_draft_serves_each_request_as_alone(params):
    """int4 codes (groups of 8 behind a 4-token float residual, so rejections cross group boundaries) as the draft
    of every row of the continuous batch: each request's tokens are its tokens alone, the counters the loop's."""
    server = _server(params, SpeculativeConfig(draft=CacheConfig(kv_dtype="int4", kv_group=8, kv_residual=4), k=3))
    ids = [server.submit(p, 20, ignore_eos=True) for p in _prompts()[:3]]
    out = server.run()
    for i, p in zip(ids, _prompts()[:3]):
        assert out[i] == _alone(params, p, 20, ignore_eos=True)
    assert server.drafted_tokens == int(np.asarray(server.state.drafted).sum()) > 0
    assert 0 < server.accepted_tokens <= server.drafted_tokens


def test_bad_settings_are_refused_naming_the_flag(params, tmp_path):
    with pytest.raises(ConfigError, match="budget=.*max_len=32"):
        SpecServer(CFG, params, speculative=SNAPKV.__class__(draft=CacheConfig(policy="streaming", budget=40)),
                   max_len=32)
    base = dict(model=str(tmp_path), speculative_draft="streaming", speculative_params=(("budget", 32),))
    for flag, extra in (("--cache-policy", {"cache_policy": "snapkv"}), ("--kv-store", {"kv_store": "x"}),
                        ("--tensor-parallel-size", {"tensor_parallel_size": 2}), ("--warmup", {"warmup": "64"})):
        with pytest.raises(ConfigError, match=flag + ".*with --speculative-draft"):
            ServeConfig(**base, **extra).speculative()
    with pytest.raises(ConfigError, match="--speculative-param without --speculative-draft"):
        ServeConfig(model=str(tmp_path), speculative_params=(("budget", 32),)).speculative()
    with pytest.raises(ConfigError, match="--speculative-k=0"):
        ServeConfig(**base, speculative_k=0)
    with pytest.raises(ConfigError, match="--speculative-draft='nope' is not a registered"):
        ServeConfig(**{**base, "speculative_draft": "nope"}).speculative()
    from lcx.cli import build_parser
    from lcx.service.config import config_of

    args = build_parser().parse_args(["serve", "m", "--speculative-draft", "snapkv", "--speculative-param",
                                     "budget=64", "--speculative-param", "window=8", "--speculative-k", "3",
                                     "--speculative-confidence", "0.4"])
    config = config_of(args)
    spec, target = config.speculative()
    assert (spec.draft.policy, spec.draft.budget, spec.k, spec.confidence, target.policy) == \
        ("snapkv", 64, 3, 0.4, "full")
    with pytest.raises(ConfigError, match="speculative.confidence=2.0 is invalid"):
        ServeConfig(**base, speculative_confidence=2.0).speculative()


@pytest.mark.slow
def test_the_service_streams_offline_tokens_and_counts_acceptance(tmp_path):
    """``lcx serve --speculative-draft streaming``: completions and streamed chats through the ``openai`` client
    equal offline greedy decoding; the two counters move, accepted <= drafted."""
    model_dir = write_model(tmp_path / "tiny")
    lm = lcx.load(model_dir)
    running = Running(ServeConfig(model=str(model_dir), port=_free_port(), max_num_seqs=2, max_model_len=256,
                                  segment=4, prefill_chunk=64, served_model_name="tiny",
                                  speculative_draft="streaming",
                                  speculative_params=(("budget", 32), ("sinks", 4), ("interval", 16))), lm)
    try:
        client = running.client()
        prompt = "Here we go. There and back again, " * 4
        ids = lm.encode(prompt)
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0)
        assert r.choices[0].text == lm.tokenizer.decode(_offline(lm, ids, 16))
        messages = [{"role": "user", "content": "Say hi, user and assistant. " * 6}]
        chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=12,
                                                     temperature=0, stream=True))
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        chat_ids = encode_chat(running.service, [_M(m["role"], m["content"]) for m in messages])
        assert text == lm.tokenizer.decode(_offline(lm, chat_ids, 12))
        import httpx

        for body in ('{"model": "tiny", "prompt": "\\ud800", "max_tokens": 4}',  # an unpaired surrogate
                     '{"model": "tiny", "prompt": "hi", "max_tokens": 100000}', "[" * 64 + "]" * 64):
            bad = httpx.post(running.url + "/completions", content=body, timeout=30,
                             headers={"content-type": "application/json"})
            assert 400 <= bad.status_code < 500, (body[:40], bad.status_code)
        assert httpx.get(running.base + "/health", timeout=5).json() == {"status": "ok"}
        m = running.settled()
        assert m["lcx_spec_draft_tokens_total"] > 0
        assert 0 <= m["lcx_spec_accepted_tokens_total"] <= m["lcx_spec_draft_tokens_total"]
        assert m["lcx_kv_pages_used"] == 0 and m["lcx_generation_tokens_total"] >= 16
    finally:
        running.stop()
