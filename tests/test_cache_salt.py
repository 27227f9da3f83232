"""Tenant isolation in the serving loop: a request's ``salt`` (``cache_salt``) starts the chain of every page it keeps
on the device and writes to the store, so two salts with the same prompt share no kept page, no pool page and no
stored page (the second prefills everything: ``cached == 0``), one salt shares with itself, and no salt shares as
before salts existed (the same keys)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import lcx
from lcx.config_base import ConfigError
from lcx.engine.kv_store import PageStore, chain
from lcx.engine.server import Server

CFG = lcx.ModelConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                      max_position_embeddings=128)
PAGE = 8
NEW = 4
PROMPT = np.random.default_rng(3).integers(0, 61, 29).tolist()  # 3 whole pages before its last token
WHOLE = (len(PROMPT) - 1) // PAGE * PAGE


@pytest.fixture(scope="module")
def params():
    return lcx.init_params(CFG, jax.random.key(5))


def _server(params, store=None) -> Server:
    # pages for three tenants' kept prefixes beside a running request: none is dropped to make room
    return Server(CFG, params, max_num_seqs=2, max_len=40, pages=24, segment=4, prefill_chunk=16,
                  cache=lcx.CacheConfig(layout="paged", page_size=PAGE), store=store)


def _serve(server: Server, salt=None) -> tuple[list[int], int]:
    """One request of ``PROMPT`` under ``salt``: its tokens and the prompt tokens it did not prefill."""
    before = server.cached_tokens
    rid = server.submit(PROMPT, max_new_tokens=NEW, salt=salt)
    return server.run()[rid], server.cached_tokens - before


def _kept(server: Server, salt) -> tuple[set, set]:
    """The chain keys and pool pages of the kept prefixes of ``salt``."""
    entries = [e for e in server.prefixes.entries.values() if e.salt == salt]
    return {k for e in entries for k in e.keys}, {p for e in entries for p in e.pages}


def test_two_salts_share_no_kept_page_one_salt_and_no_salt_share(params):
    server = _server(params)
    plain, cached = _serve(server)
    assert cached == 0
    again, cached = _serve(server)  # no salt: shared as before salts existed, under the same keys
    assert again == plain and cached == WHOLE
    assert _kept(server, None)[0] == set(chain("", np.asarray(PROMPT[:WHOLE], np.int32), PAGE))

    a, cached = _serve(server, "tenant-a")
    assert a == plain and cached == 0  # the same prompt, another tenant: nothing of the unsalted pages read
    b, cached = _serve(server, "tenant-b")
    assert b == plain and cached == 0
    a_again, cached = _serve(server, "tenant-a")
    assert a_again == plain and cached == WHOLE  # its own tenant's kept pages

    keys = {salt: _kept(server, salt) for salt in (None, "tenant-a", "tenant-b")}
    assert all(len(k) == WHOLE // PAGE for k, _ in keys.values())
    for x, y in ((None, "tenant-a"), (None, "tenant-b"), ("tenant-a", "tenant-b")):
        assert not keys[x][0] & keys[y][0], (x, y)  # no key shared
        assert not keys[x][1] & keys[y][1], (x, y)  # no pool page shared


def test_two_salts_share_no_stored_page(params, tmp_path):
    """The store keys pages with the salt too: a restarted server (a replica on the same directory) serves a
    tenant's pages to that tenant only."""
    store = PageStore("tiny", page=PAGE, directory=tmp_path)
    tokens, _ = _serve(_server(params, store), "tenant-a")
    prompt = np.asarray(PROMPT[:WHOLE], np.int32)
    assert store.match(prompt, "tenant-a") == WHOLE // PAGE
    assert store.match(prompt, "tenant-b") == store.match(prompt) == 0
    assert not set(store.keys(prompt, "tenant-a")) & set(store.keys(prompt, "tenant-b"))

    fresh = _server(params, PageStore("tiny", page=PAGE, directory=tmp_path))
    b, cached = _serve(fresh, "tenant-b")
    assert b == tokens and cached == 0
    plain, cached = _serve(fresh)
    assert plain == tokens and cached == 0
    a, cached = _serve(_server(params, PageStore("tiny", page=PAGE, directory=tmp_path)), "tenant-a")
    assert a == tokens and cached == WHOLE


@pytest.mark.parametrize("salt", ["", 5, "x" * 257])
def test_a_bad_salt_is_refused_naming_it(params, salt):
    with pytest.raises(ConfigError, match="salt="):
        _server(params).submit(PROMPT, max_new_tokens=NEW, salt=salt)
