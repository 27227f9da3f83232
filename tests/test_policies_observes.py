"""Policies declare what they observe (``Observes``); the cache derives its buffers and view from it, and the cache
kind's capabilities - not a policy's name - decide what runs where.

``test_gaze`` is registered here and named nowhere in lcx: it observes the running query mean, so the slot cache
keeps it and hands it to the policy, and a mesh that prefills across ``seq`` is refused by the kind.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lcx
from lcx.cache import ScoredPolicy, make_policy, register
from lcx.cache.observes import Observes
from lcx.config import CacheConfig, ConfigError
from lcx.engine import Generator

CFG = lcx.ModelConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, init_std=0.15)


@register
@dataclasses.dataclass(frozen=True)
class Gaze(ScoredPolicy):
    """Keys scored by their dot product with the running mean query of their KV head's group."""

    name: ClassVar[str] = "test_gaze"
    observes: ClassVar[Observes] = Observes(moments=1, kv=True)

    def scores(self, view, budget):
        g, j = view.q_mean.shape[1], view.k.shape[2]
        mean = view.q_mean.reshape(view.q_mean.shape[0], j, g // j, -1).mean(axis=2)  # [b, j, d]
        return jnp.einsum("bjd,bCjd->bC", mean, view.keys())


def test_policies_observes_seq_refusal_comes_from_the_kind():
    """The kind refuses a policy that observes the prompt, on a seq mesh, by what it declares: the check is a pure
    function of the kind, the policy and the seq size, and the Generator asks it."""
    kind = CacheConfig(policy="test_gaze", budget=8).kind(CFG)
    kind.check_runs(kind.policy)  # seq 1: nothing to refuse
    with pytest.raises(ConfigError, match=r"mesh.seq=2 .* cache.policy='test_gaze' cannot run that way: it observes "
                                          r"the prompt through the query moments; allowed: .*knorm"):
        kind.check_runs(kind.policy, seq=2)
    quiet = CacheConfig(policy="knorm", budget=8).kind(CFG)
    quiet.check_runs(quiet.policy, seq=2)  # keys only: written whole after a prefill across seq
    paged = CacheConfig(policy="knorm", budget=8, layout="paged").kind(CFG)
    with pytest.raises(ConfigError, match="its cache type is 'paged_slots', which takes no prompt attended across seq"):
        paged.check_runs(paged.policy, seq=2)
    # the Generator's check is the kind's (a mesh is not needed to reach it)
    gen = Generator(CFG, lcx.init_params(CFG, jax.random.key(0)), max_new_tokens=2,
                    cache=CacheConfig(policy="test_gaze", budget=8))
    gen.seq = 2
    with pytest.raises(ConfigError, match="cache.policy='test_gaze' cannot run that way"):
        gen._check_prefill_across_seq()


@pytest.mark.slow
def test_policies_observes_buffers_and_view_derive_from_the_declaration():
    """Observing the query mean allocates its count and mean (not the covariance), feeds them every counted query,
    and the policy's view carries them: an eviction by the test policy runs through generation."""
    kind = CacheConfig(policy="test_gaze", budget=8).kind(CFG)
    assert {"q_count", "q_mean"} <= set(kind.fields()) and "q_m2" not in kind.fields()
    assert "q_mean" not in CacheConfig(policy="knorm", budget=8).kind(CFG).fields()
    params = lcx.init_params(CFG, jax.random.key(0))
    gen = Generator(CFG, params, max_new_tokens=4, unroll=False, cache=CacheConfig(policy="test_gaze", budget=8,
                                                                                   interval=4, prefill_chunk=8))
    state = gen.prefill([np.random.default_rng(0).integers(0, 61, 20).tolist()])
    assert np.asarray(state.cache.q_count).tolist() == [[20.0]] * CFG.n_layers
    assert int(state.cache.count.max()) == 8 and np.abs(np.asarray(state.cache.q_mean)).sum() > 0
    assert int(gen.decode(state).step) == 4


def test_policies_observes_old_flags_are_read_only_views():
    assert make_policy("snapkv", {"window": 8}).observes == Observes(attention="sum", window=8)
    assert (make_policy("snapkv").attention_stat, make_policy("snapkv").prefill_queries) == ("sum", "window")
    assert (make_policy("tova").attention_stat, make_policy("tova").prefill_queries) == ("replace", "last")
    assert make_policy("h2o").prefill_queries == "all" and make_policy("knorm").attention_stat is None
    assert make_policy("expected_attention", {"covariance": False}).query_moments == 1
    assert make_policy("kvzip").reconstructs and make_policy("duo").calibrates and not make_policy("h2o").calibrates
    ok = jnp.ones((1, 6), bool)
    counted = make_policy("expected_attention", {"sinks": 2}).counts_query(jnp.arange(6)[None], ok)
    assert np.asarray(counted).tolist() == [[False, False, True, True, True, True]]
    with pytest.raises(TypeError, match="declare what it observes instead"):
        type("Legacy", (ScoredPolicy,), {"attention_stat": "sum"})
    with pytest.raises(ConfigError, match="Observes.window=4 is invalid with attention=None"):
        Observes(window=4)


def test_policies_observes_prefill_and_teacher_forcing_queries():
    lengths = np.array([5, 3])
    assert Observes().prefill_weights(lengths, 6) is None
    window = Observes(attention="sum", window=2).prefill_weights(lengths, 6)
    assert window.tolist() == [[0, 0, 0, 1, 1, 0], [0, 1, 1, 0, 0, 0]]
    assert Observes(attention="sum").prefill_weights(lengths, 6)[1].tolist() == [1, 1, 1, 0, 0, 0]
    assert Observes(attention="replace").score_weights(3, 4, 1).tolist() == [[0, 0, 1, 0]]
    assert Observes(attention="sum").score_weights(3, 4, 1).tolist() == [[1, 1, 1, 0]]


def test_mesh_capability_comes_from_the_kind():
    """Which cache types run on a device mesh is the kind's ``shardable`` flag and ``check_mesh``, not a list of names
    in Generator: the paged kinds split their pool by KV head over "model" and refuse a "data" axis."""
    from lcx.config_base import ConfigError
    from lcx.parallel.sharding import abstract_mesh

    for cache in (CacheConfig(), CacheConfig(policy="tova", budget=16), CacheConfig(layout="paged"),
                  CacheConfig(layout="paged", policy="tova", budget=16)):
        assert cache.kind(CFG).shardable
        cache.kind(CFG).check_mesh(abstract_mesh(1, 2))
    CacheConfig().kind(CFG).check_mesh(abstract_mesh(2, 1))
    for cache in (CacheConfig(layout="paged"), CacheConfig(layout="paged", policy="tova", budget=16)):
        with pytest.raises(ConfigError, match="mesh data=2: a paged cache"):
            cache.kind(CFG).check_mesh(abstract_mesh(2, 1))
