"""The cache contract: a cache type registered from this file (nothing in lcx changed) runs through lcx.generate.

``mirror`` keeps every token twice - a write buffer and a mirror - and attends over the mirror. It implements only
the contract of ``lcx.cache.base``: its buffers declared once (``fields``), their sizes, planning and ``attend``.
Generation, the model and the sharding helpers never name it.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import chex
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lcx
from lcx import kernels
from lcx.cache import CacheKind, CachePolicy, CacheState, Field, register, register_kind
from lcx.model.rope import apply_rope

CFG = lcx.ModelConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64)
SLOTS = ("layers", "batch", "length", "kv_heads", "head_dim")


@flax.struct.dataclass
class MirrorCache(CacheState):
    k: jax.Array
    v: jax.Array
    k_mirror: jax.Array
    v_mirror: jax.Array
    count: jax.Array
    lengths: jax.Array | None
    kind: "MirrorKind" = flax.struct.field(pytree_node=False, default=None)

    @property
    def capacity(self) -> int:
        return self.k.shape[-3]


@register_kind
@dataclasses.dataclass(frozen=True)
class MirrorKind(CacheKind):
    name: ClassVar[str] = "mirror"
    state_type: ClassVar[type] = MirrorCache
    model: lcx.ModelConfig

    @classmethod
    def from_config(cls, model, cache, policy):
        return cls(model)

    def fields(self):
        return {"k": Field(SLOTS, role="kv"), "v": Field(SLOTS, role="kv"), "k_mirror": Field(SLOTS, role="kv"),
                "v_mirror": Field(SLOTS, role="kv"), "count": Field(("layers", "batch"), "int32"),
                "lengths": Field(("batch",), "int32")}

    def sizes(self, batch, capacity):
        m = self.model
        return {"layers": m.n_layers, "batch": batch, "length": capacity, "kv_heads": m.n_kv_heads,
                "head_dim": m.head_dim}

    @property
    def kv_dtype(self):
        return self.model.dtype

    def plan(self, batch, max_prompt, max_new_tokens):
        return max_prompt + max_new_tokens

    def attend(self, layer, q, key, val, *, cos, sin, positions, ok, stat_weights):
        q, key = apply_rope(q, cos, sin), apply_rope(key, cos, sin)
        slot = jnp.where(ok, layer.count[:, None] + jnp.cumsum(ok, axis=1) - 1, layer.capacity)  # [b, t]
        rows = jnp.arange(q.shape[0])[:, None]
        put = lambda buf, x: buf.at[rows, slot].set(x.astype(buf.dtype), mode="drop")  # noqa: E731
        new = layer.replace(k=put(layer.k, key), v=put(layer.v, val), k_mirror=put(layer.k_mirror, key),
                            v_mirror=put(layer.v_mirror, val), count=layer.count + jnp.sum(ok, axis=1))
        res = kernels.backend(self.model.attention.impl).chunk(
            q, new.k_mirror, new.v_mirror, q_offsets=layer.count, kv_lengths=new.count, sm_scale=q.shape[-1] ** -0.5)
        out = res.out
        return out, new


@register
@dataclasses.dataclass(frozen=True)
class MirrorPolicy(CachePolicy):
    name: ClassVar[str] = "mirror"
    cache_type: ClassVar[str] = "mirror"
    evicts: ClassVar[bool] = False


@pytest.fixture(scope="module")
def params():
    return lcx.init_params(CFG, jax.random.key(3))


PROMPTS = [[5, 9, 2, 7, 1, 3, 3, 8, 2, 6, 4], [1, 2, 3], [7] * 17]


@pytest.mark.slow
def test_cache_contract_new_type_generates_like_the_full_cache(params):
    full = lcx.generate(CFG, params, PROMPTS, max_new_tokens=10)
    mirror = lcx.generate(CFG, params, PROMPTS, max_new_tokens=10, cache=lcx.CacheConfig(policy="mirror"))
    np.testing.assert_array_equal(mirror.tokens, full.tokens)
    np.testing.assert_array_equal(mirror.lengths, full.lengths)
    # Its declared buffers are what it allocated: four K/V-sized buffers where the full cache has two.
    assert mirror.cache_bytes == 2 * full.cache_bytes


def test_cache_contract_state_derives_from_the_declaration(params):
    kind = lcx.CacheConfig(policy="mirror").kind(CFG)
    state = kind.create(batch=3, capacity=20)
    chex.assert_shape([state.k, state.k_mirror], (2, 3, 20, 2, 8))
    chex.assert_shape(state.count, (2, 3))
    assert state.kv_bytes() == kind.nbytes(3, 20) == 4 * 2 * 3 * 20 * 2 * 8 * 4
    # The layer scan's view drops the buffers without a "layers" axis and gets them back.
    layers = state.layers()
    assert layers.lengths is None and layers.k.shape == state.k.shape
    assert state.with_layers(layers, state.lengths + 1).lengths.tolist() == [1, 1, 1]
    abstract = jax.eval_shape(lambda: kind.create(3, 20))
    chex.assert_trees_all_equal_shapes_and_dtypes(abstract, state)


@pytest.mark.slow
def test_cache_contract_resume_of_a_new_type(params, tmp_path):
    gen = lcx.Generator(CFG, params, max_new_tokens=8, cache=lcx.CacheConfig(policy="mirror"))
    state = gen.decode(gen.prefill(PROMPTS), steps=3)
    gen.save(state, tmp_path / "state")
    resumed = gen.result(gen.decode(gen.restore(tmp_path / "state")))
    np.testing.assert_array_equal(resumed.tokens, gen.result(gen.decode(state)).tokens)
