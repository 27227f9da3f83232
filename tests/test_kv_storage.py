"""The storage seam (``lcx.cache.storage``): every registered ``cache.kv_dtype`` - and floats - runs through the same
contract. Its kinds take their KV bytes from the format's declarations, a paged cache gives the contiguous cache's
tokens, and an evicting policy runs on it; a format added to ``FORMATS`` is tested here without a line of change."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import lcx
from lcx.cache.storage import FORMATS, KVStorage, storage_for
from lcx.config import CacheConfig, ModelConfig
from lcx.engine import Generator

CFG = ModelConfig(vocab_size=61, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, init_std=0.1)
PROMPT = np.random.default_rng(7).integers(0, 61, 37).tolist()


def _settings(kv_dtype):
    """A format's own settings at test sizes (groups of 16 slots, pages of whole groups)."""
    grouped = kv_dtype is not None and "kv_group" in FORMATS[kv_dtype].settings
    return dict(kv_dtype=kv_dtype, page_size=16, **(dict(kv_group=16) if grouped else {}))


@pytest.fixture(scope="module")
def params():
    return lcx.init_params(CFG, jax.random.key(0))


@pytest.mark.parametrize("kv_dtype", [None, *FORMATS])
def test_every_format_counts_its_declared_bytes(kv_dtype):
    """A slot cache's KV bytes are its storage's (``KVStorage.nbytes``, from the format's declarations); the
    planner's bytes per token and per row add up to them."""
    cache = CacheConfig(**{k: v for k, v in _settings(kv_dtype).items() if k != "page_size"})
    kind = cache.kind(CFG)
    storage = kind.storage
    assert storage == (KVStorage(dtype="float32") if kv_dtype is None else storage_for(kv_dtype, "float32", 16))
    for capacity in (16, 48):
        assert kind.nbytes(2, capacity) == 2 * storage.nbytes(CFG, 1, capacity)
        assert storage.nbytes(CFG, 1, capacity) == capacity * storage.bytes_per_token(CFG) + storage.bytes_per_row(CFG)


@pytest.mark.slow
@pytest.mark.parametrize("kv_dtype", [None, *FORMATS])
def test_every_format_on_pages_gives_the_contiguous_tokens_and_evicts(params, kv_dtype):
    tokens = {}
    for layout in ("contiguous", "paged"):
        gen = Generator(CFG, params, max_new_tokens=6, cache=CacheConfig(layout=layout, **_settings(kv_dtype)),
                        capacity=64)
        tokens[layout] = gen.result(gen.decode(gen.prefill([PROMPT]))).tokens
    np.testing.assert_array_equal(tokens["paged"], tokens["contiguous"])
    gen = Generator(CFG, params, max_new_tokens=12, cache=CacheConfig(policy="h2o", budget=16, interval=8,
                                                                      **_settings(kv_dtype)))
    state = gen.decode(gen.prefill([PROMPT]))
    assert np.isfinite(np.asarray(state.logits)).all() and int(np.asarray(state.cache.count).max()) <= 24
