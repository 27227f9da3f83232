"""``lcx serve --warmup``: after the warm-up, the first requests of a warmed length compile nothing (their programs
are in jax's caches), and the dummies leave no trace - no page in use, request ids from 0, counters, the pool's
peak, the store and the metrics as before. Without it the same first requests compile (each test uses a pool shape
of its own, so no other test's programs serve it)."""

from __future__ import annotations

import numpy as np
import pytest

import lcx
from lcx.config_base import ConfigError
from lcx.engine.sampling import SamplingConfig
from lcx.service.app import build_service
from lcx.service.config import ServeConfig
from lcx.service.warmup import WarmupSpec, compile_counter, parse_warmup
from tests.tiny_chat_model import write_model

PROMPT = 40  # tokens: five pages of 8, two prefill chunks of 32
NEW = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("warmup") / "tiny")


@pytest.fixture(scope="module")
def lm(model_dir):
    return lcx.load(str(model_dir))


def _config(model_dir, max_len: int, warmup: str | None) -> ServeConfig:
    return ServeConfig(model=str(model_dir), max_num_seqs=2, max_model_len=max_len, page_size=8, segment=4,
                       prefill_chunk=32, warmup=warmup)


def _first_requests(server, vocab: int) -> int:
    """Compiles while two prompts of PROMPT tokens arrive one step apart, one greedy and one sampled."""
    rng = np.random.default_rng(7)
    prompt = lambda: rng.integers(3, vocab, size=PROMPT).tolist()  # noqa: E731
    with compile_counter() as compiles:
        first = server.submit(prompt(), NEW)
        server.step()
        server.submit(prompt(), NEW, SamplingConfig(temperature=1.0), seed=3)
        server.run()
    assert first == 0  # request numbering starts at 0, warmed or not
    return compiles.count


def test_warmed_first_requests_compile_nothing_and_the_dummies_leave_no_trace(model_dir, lm):
    service = build_service(_config(model_dir, 232, f"{PROMPT}:{NEW}"), lm=lm)
    try:
        server = service.server
        assert service.warmup.requests > 0 and service.warmup.compiles > 0 and service.warmup.seconds > 0
        assert "warm-up:" in service.warmup.line()
        assert server.pages_used() == 0 and int(server.state.peak) == 0 and server.committed == 0
        assert server.prefill_tokens == server.cached_tokens == 0 and not server.cancelled and not server.busy
        assert server.store is not None and server.store.match(np.arange(3, 3 + PROMPT)) == 0
        assert server.store.hits == server.store.misses == 0
        metrics = service.metrics.render().decode()
        assert "lcx_prompt_tokens_total 0.0" in metrics and "lcx_generation_tokens_total 0.0" in metrics
    finally:
        service.close()  # the engine thread stops; the server is driven directly below
    assert _first_requests(server, lm.config.vocab_size) == 0
    assert server.pages_used() > 0  # the two prompts' kept prefixes: the server works as before


def test_without_warmup_the_same_first_requests_compile(model_dir, lm):
    service = build_service(_config(model_dir, 248, None), lm=lm)
    service.close()
    assert service.warmup is None
    assert _first_requests(service.server, lm.config.vocab_size) > 0


def test_bad_warmup_specs_are_refused_naming_the_flag(model_dir):
    assert parse_warmup("256, 1024:64,600@300") == (WarmupSpec(256), WarmupSpec(1024, 64), WarmupSpec(600, None, 300))
    assert parse_warmup(None) == parse_warmup("") == ()
    for bad in ("0", "abc", "256:", "256:0", "-3", "256@256", "256@0", 256):
        with pytest.raises(ConfigError, match="--warmup"):
            _config(model_dir, 232, bad)
