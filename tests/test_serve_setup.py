"""One resolved serve setup: ``ServeConfig.resolve`` gives the one frozen ``ServeSetup`` (cache, policy, kind, pool,
what a store may keep) the server runs, ``lcx serve``'s flags are generated from ``ServeConfig``'s fields (so their
defaults are the fields'), and ``Server``'s defaults are ``lcx serve``'s."""

from __future__ import annotations

import argparse
import dataclasses
import inspect

import pytest

import lcx
from lcx.config import ConfigError
from lcx.engine.server import Server
from lcx.engine.setup import ServeSetup, resolve
from lcx.service.config import ServeConfig, add_flags, config_of, flags

CFG = lcx.ModelConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                      max_position_embeddings=256)


def _parse(argv):
    parser = argparse.ArgumentParser()
    add_flags(parser)
    return parser.parse_args(argv)


def test_flags_are_the_fields_and_an_absent_flag_is_the_fields_default():
    assert config_of(_parse(["m"])) == ServeConfig(model="m")
    got = config_of(_parse(["m", "--kv-memory", "1MiB", "--kv-store-size", "2GiB", "--cache-param", "budget=64",
                            "--cache-policy", "snapkv", "--segment", "4", "--header-timeout", "2.5"]))
    assert got == ServeConfig(model="m", kv_memory=1 << 20, kv_store_bytes=2 << 30, cache_params=(("budget", 64),),
                              cache_policy="snapkv", segment=4, header_timeout=2.5)
    names = [f.name for f in flags()]
    assert "prefix_entries" not in names and "host_store_bytes" not in names  # settings without a flag
    with pytest.raises(SystemExit):  # one budget: the two flags exclude each other
        _parse(["m", "--kv-memory", "1MiB", "--gpu-memory-utilization", "0.5"])


def test_the_servers_defaults_are_lcx_serves():
    serve = ServeConfig(model="m")
    server = inspect.signature(Server).parameters
    for name, field in (("max_num_seqs", "max_num_seqs"), ("max_len", "max_model_len"), ("segment", "segment"),
                        ("prefill_chunk", "prefill_chunk"), ("prefix_entries", "prefix_entries")):
        assert server[name].default == getattr(serve, field), name


def test_resolve_is_one_frozen_value_with_the_pool_and_what_a_store_keeps():
    setup = ServeConfig(model="m", max_num_seqs=2, max_model_len=64, page_size=8, kv_memory=None).resolve(CFG)
    assert isinstance(setup, ServeSetup) and setup.pages == 2 * 8 == setup.plan.pages and setup.row_pages == 8
    assert setup.store == "pages" and setup.make_store and setup.prefix_entries == 8 and setup.chunk <= 256
    with pytest.raises(dataclasses.FrozenInstanceError):
        setup.pages = 3
    evicting = ServeConfig(model="m", max_num_seqs=2, max_model_len=64, page_size=8, cache_policy="streaming",
                           cache_params=(("budget", 16), ("interval", 8))).resolve(CFG)
    assert evicting.store == "states" and not evicting.make_store and evicting.prefix_entries == 0
    assert evicting.row_pages == 3  # budget + interval = 24 slots, not the 64 of max_model_len
    asked = ServeConfig(model="m", page_size=8, cache_policy="streaming", kv_store="/nonexistent",
                        cache_params=(("budget", 16), ("interval", 8))).resolve(CFG)
    assert asked.make_store  # compressed states only when --kv-store asks for them


def test_a_store_where_nothing_can_be_kept_is_refused_once_by_flag_or_by_argument():
    with pytest.raises(ConfigError, match=r"--kv-store with --cache-policy='kvzip'"):
        ServeConfig(model="m", max_model_len=64, page_size=8, cache_policy="kvzip", kv_store="/nonexistent",
                    cache_params=(("budget", 16), ("interval", 64))).resolve(CFG, reconstruction=lambda: object())
    with pytest.raises(ConfigError, match=r"Server store= with cache.policy='kvzip'"):
        resolve(CFG, lcx.CacheConfig(layout="paged", page_size=8, policy="kvzip", budget=16, interval=64),
                max_len=64, store=True, reconstruction=object())
