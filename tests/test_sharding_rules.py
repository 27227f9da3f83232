"""The sharding rules table, the GQA topology check, mesh shapes and the distributed config - on one device (the
8-device behaviour is tested under tests/multidevice/)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh, AxisType, PartitionSpec as P

import lcx
from lcx import plan
from lcx.parallel import sharding
from lcx.model import placement
from lcx.config import ConfigError, from_dict
from lcx.parallel.distributed import DistributedConfig, initialize_from_env


def abstract_mesh(data: int, model: int) -> AbstractMesh:
    return AbstractMesh((data, model), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))


def tiny(n_kv_heads: int = 8, n_heads: int = 8, d_ff: int = 128) -> lcx.ModelConfig:
    return lcx.ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=n_heads, n_kv_heads=n_kv_heads, d_ff=d_ff)


# --------------------------------------------------------------------------------------------------- rules
@pytest.mark.parametrize("logical, mesh", [
    (("embed", "heads", "head_dim"), P(None, "model", None)),
    (("heads", "head_dim", "embed"), P("model", None, None)),
    (("embed", "kv_heads", "head_dim"), P(None, "model", None)),
    (("embed", "mlp"), P(None, "model")),
    (("mlp", "embed"), P("model", None)),
    (("vocab", "embed"), P(None, None)),
    (("layers", "batch", "length", "kv_heads", "head_dim"), P(None, "data", None, "model", None)),
    ((None, "batch"), P(None, "data")),
])
def test_sharding_rules_map_logical_axes(logical, mesh):
    assert sharding.logical_to_mesh(logical) == mesh


def test_sharding_rules_collision_raises():
    with pytest.raises(ValueError, match=r"maps both 'heads' and 'kv_heads' to mesh axis 'model'"):
        sharding.logical_to_mesh(("heads", "kv_heads"))
    with pytest.raises(ValueError, match=r"maps both 'embed' and 'mlp' to mesh axis 'model'"):
        sharding.logical_to_mesh(("embed", "mlp"), rules={**sharding.LOGICAL_RULES, "embed": "model"})


def test_sharding_rules_unknown_axis_raises_naming_known():
    with pytest.raises(ValueError, match=r"logical axis 'hidden' .* no sharding rule; known: \["):
        sharding.logical_to_mesh(("hidden",))


def test_sharding_rules_bad_mesh_axis_raises():
    with pytest.raises(ValueError, match=r"rule 'heads' -> 'tensor' names unknown mesh axes \['tensor'\]"):
        sharding.check_rules({"heads": "tensor"})


def test_sharding_rules_drop_axes_the_mesh_lacks():
    assert sharding.logical_to_mesh(("batch", "heads"), mesh_axes=("model",)) == P(None, "model")


def test_sharding_every_parameter_axis_has_a_rule():
    from lcx.model.params import LOGICAL_AXES

    assert set(LOGICAL_AXES) <= set(sharding.LOGICAL_RULES)


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_sharding_every_cache_buffer_axis_has_a_rule(layout):
    """Every storage format's buffers, in both layouts, under the full and an evicting policy, can be placed on a
    mesh (a format whose axes had no rule - fp4's, the bit-packed pages' - failed only when a mesh was used)."""
    from lcx.cache.storage import FORMATS

    model = tiny(n_kv_heads=2, n_heads=4)
    for kv_dtype in [None, *FORMATS]:
        for policy in ({}, {"policy": "h2o", "budget": 16}):
            extra = {"kv_group": 16, "page_size": 16} if kv_dtype in ("int4", "int2") else {}
            kind = lcx.CacheConfig(layout=layout, kv_dtype=kv_dtype, **policy, **extra).kind(model)
            axes = {a for f in kind.fields().values() for a in f.axes}
            assert axes <= set(sharding.LOGICAL_RULES), (layout, kv_dtype, policy, axes - set(sharding.LOGICAL_RULES))


# --------------------------------------------------------------------------------------------------- params
def test_sharding_param_specs_split_heads_and_mlp_over_model():
    specs = placement.param_specs(tiny(), abstract_mesh(2, 4))
    attn, mlp = specs["layers"]["attn"], specs["layers"]["mlp"]  # leading axis: layers (nn.scan)
    assert attn["q"] == P(None, None, "model", None) and attn["k"] == attn["v"] == P(None, None, "model", None)
    assert attn["o"] == P(None, "model", None, None)  # row-parallel: all-reduce after it
    assert mlp["gate"] == mlp["up"] == P(None, None, "model") and mlp["down"] == P(None, "model", None)
    assert specs["embed"] == specs["lm_head"] == P(None, None)
    assert all(s == P(None) or all(a is None for a in s) for s in
               (specs["final_norm"]["scale"], specs["layers"]["attn_norm"]["scale"]))


def test_sharding_param_specs_replicated_kv_heads_keep_kv_projections_whole():
    specs = placement.param_specs(tiny(n_kv_heads=4), abstract_mesh(1, 8))
    attn = specs["layers"]["attn"]
    assert attn["k"] == attn["v"] == P(None, None, None, None)
    assert attn["q"] == P(None, None, "model", None)


def test_sharding_param_specs_indivisible_dimension_raises():
    with pytest.raises(ConfigError, match=r"'mlp'\) has size 100, not divisible by mesh axis 'model' of size 8"):
        placement.param_specs(tiny(d_ff=100), abstract_mesh(1, 8))


def test_sharding_cache_model_config_repeats_kv_heads_only_when_replicating():
    assert sharding.cache_model_config(tiny(n_kv_heads=4), abstract_mesh(1, 8)).n_kv_heads == 8
    assert sharding.cache_model_config(tiny(n_kv_heads=4), abstract_mesh(2, 4)).n_kv_heads == 4
    assert sharding.cache_model_config(tiny(n_kv_heads=8), abstract_mesh(1, 8)) == tiny(n_kv_heads=8)


def test_sharding_without_mesh_is_identity():
    def fn(x):
        return x

    assert sharding.per_shard(fn, (sharding.BTHD,), sharding.BTHD) is fn
    k = jnp.ones((1, 2, 4, 8))
    assert sharding.replicate_kv_heads(k, k, n_heads=8) == (k, k)


# --------------------------------------------------------------------------------------------------- topology
@pytest.mark.parametrize("kv, heads, model, expected", [
    (8, 8, 8, "shard"), (8, 64, 4, "shard"), (8, 8, 1, "shard"), (6, 12, 3, "shard"),
    (4, 8, 8, "replicate"), (1, 8, 8, "replicate"), (2, 16, 8, "replicate")])
def test_sharding_check_topology(kv, heads, model, expected):
    assert sharding.check_topology(kv, model, n_heads=heads) == expected


def test_sharding_check_topology_neither_raises_with_valid_sizes():
    with pytest.raises(ConfigError) as err:
        sharding.check_topology(6, 4, n_heads=12)
    assert "kv_heads=6 cannot be split over a model axis of 4 devices" in str(err.value)
    assert "valid model-axis sizes: [1, 2, 3, 6, 12]" in str(err.value)


def test_sharding_check_topology_replication_needs_heads_divisible():
    with pytest.raises(ConfigError, match=r"n_heads=4, kv_heads=4: replicating KV heads 2x needs n_heads divisible"):
        sharding.check_topology(4, 8, n_heads=4)


def test_sharding_kv_replication_factor():
    assert sharding.kv_replication(4, 8, 8) == 2 and sharding.kv_replication(8, 4, 8) == 1


@pytest.mark.parametrize("kv, heads, devices", [(8, 64, 8), (8, 64, 16), (4, 8, 8), (6, 12, 16), (2, 4, 8)])
def test_sharding_valid_sizes_agree_with_the_planner(kv, heads, devices):
    config = lcx.ModelConfig(vocab_size=64, d_model=8 * heads, n_layers=1, n_heads=heads, n_kv_heads=kv, d_ff=64)
    assert sharding.valid_model_axis_sizes(kv, heads, limit=devices) == plan.valid_model_axis_sizes(config, devices)


# --------------------------------------------------------------------------------------------------- mesh
def test_sharding_make_mesh_wrong_product_raises():
    with pytest.raises(ConfigError, match=r"mesh data=2 x model=4 = 8 devices, but 1 devices .* valid \(data, "
                                          r"model\): \[\(1, 1\)\]"):
        sharding.make_mesh(2, 4, devices=jax.devices()[:1])


def test_sharding_make_mesh_one_device():
    mesh = sharding.make_mesh(1, 1, devices=jax.devices()[:1])
    assert mesh.axis_names == ("data", "seq", "model") and mesh.axis_sizes == (1, 1, 1)


@pytest.mark.parametrize("data, model, kv, expected", [("auto", 4, None, (2, 4)), (2, "auto", None, (2, 4)),
                                                       ("auto", "auto", None, (1, 8)), ("auto", "auto", 4, (2, 4)),
                                                       ("auto", "auto", 8, (1, 8)), ("auto", "auto", 6, (4, 2))])
def test_sharding_resolve_auto_mesh_shape(data, model, kv, expected):
    assert sharding.resolve_mesh_shape(data, model, 8, n_kv_heads=kv) == expected


def test_sharding_resolve_mesh_shape_errors():
    with pytest.raises(ConfigError, match=r"mesh.data=3 is invalid: it must divide the 8 devices"):
        sharding.resolve_mesh_shape(3, "auto", 8)
    with pytest.raises(ConfigError, match=r"kv_heads=6 cannot be split over a model axis of 4"):
        sharding.resolve_mesh_shape(2, 4, 8, n_kv_heads=6, n_heads=12)


def test_sharding_mesh_config_validates_and_loads():
    assert from_dict(sharding.MeshConfig, {"data": "2", "model": "auto"}, prefix="mesh") == \
        sharding.MeshConfig(data=2, model="auto")
    for bad in (0, -1, True, "two", 1.5):
        with pytest.raises(ConfigError, match=r"mesh.model=.* is invalid: must be a positive integer or 'auto'"):
            sharding.MeshConfig(model=bad)
    assert sharding.MeshConfig().shape(8, n_kv_heads=4) == (2, 4)
    assert lcx.MeshConfig is sharding.MeshConfig and lcx.make_mesh is sharding.make_mesh


# --------------------------------------------------------------------------------------------------- distributed
def test_sharding_distributed_config_from_env():
    assert not DistributedConfig.from_env({}).enabled
    assert initialize_from_env({}) is False
    env = {"LCX_COORDINATOR": "127.0.0.1:1234", "LCX_NUM_PROCESSES": "2", "LCX_PROCESS_ID": "1"}
    assert DistributedConfig.from_env(env) == DistributedConfig("127.0.0.1:1234", 2, 1)
    jax_env = {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"}
    assert DistributedConfig.from_env(jax_env) == DistributedConfig("h:1", 4, 3)


def test_sharding_distributed_config_errors():
    with pytest.raises(ConfigError, match=r"distributed.process_id=None is invalid: .* together"):
        DistributedConfig.from_env({"LCX_COORDINATOR": "h:1", "LCX_NUM_PROCESSES": "2"})
    with pytest.raises(ConfigError, match=r"distributed.coordinator='nohost' is invalid: must be 'host:port'"):
        DistributedConfig("nohost", 2, 0)
    with pytest.raises(ConfigError, match=r"distributed.process_id=2 is invalid: must be an integer in"):
        DistributedConfig("h:1", 2, 2)
    with pytest.raises(ConfigError, match=r"LCX_NUM_PROCESSES='two' is invalid"):
        DistributedConfig.from_env({"LCX_COORDINATOR": "h:1", "LCX_NUM_PROCESSES": "two", "LCX_PROCESS_ID": "0"})
