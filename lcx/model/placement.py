"""Where the decoder's parameters live on a mesh: the logical axes of every parameter (declared once, in the model
code) mapped through the rules of ``lcx.parallel.sharding``.

Query heads, KV heads and MLP columns split over ``model``; the vocabulary, embedding and norms stay whole (see
``lcx.parallel.sharding.LOGICAL_RULES``). With KV heads replicated over the model axis the K/V projections stay whole
too.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from lcx.parallel import sharding
from lcx.config_base import ConfigError, dtype_bytes
from lcx.model.config import ModelConfig
from lcx.model.decoder import abstract_params, param_axes


def param_specs(config: ModelConfig, mesh: Mesh) -> Any:
    """The ``PartitionSpec`` (mesh axes) of every parameter of ``Decoder(config)`` under ``mesh``."""
    replicate = sharding.mesh_topology(config, mesh) == "replicate"
    axes, shapes = param_axes(config), abstract_params(config)
    paths = jax.tree_util.tree_flatten_with_path(shapes)[0]
    specs = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, PartitionSpec))
    out = [sharding.spec_for(spec, leaf.shape, mesh, f"parameter {jax.tree_util.keystr(path)}", replicate)
           for (path, leaf), spec in zip(paths, specs)]
    return jax.tree.unflatten(jax.tree.structure(shapes), out)


def param_shardings(config: ModelConfig, mesh: Mesh) -> Any:
    """``NamedSharding`` of every parameter (the rules applied to ``param_axes(config)``)."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(config, mesh),
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


def shard_params(params, config: ModelConfig, mesh: Mesh):
    """``params`` placed on ``mesh`` by the rules."""
    return jax.tree.map(sharding.put, params, param_shardings(config, mesh))


def param_structs(config: ModelConfig, mesh: Mesh | None = None) -> Any:
    """``jax.ShapeDtypeStruct`` of every parameter with the sharding it takes on ``mesh`` (None: one device): the
    target of an orbax restore, so a checkpoint saved on any mesh restores onto this one."""
    shapes = abstract_params(config)
    if mesh is None:
        one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        shardings = jax.tree.map(lambda _: one, shapes)
    else:
        shardings = param_shardings(config, mesh)
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes, shardings)


@functools.lru_cache(maxsize=64)
def _declared(config: ModelConfig) -> tuple[tuple[tuple[int, ...], tuple[str | None, ...]], ...]:
    """(shape, logical axes) of every parameter, traced once per config."""
    shapes = jax.tree.leaves(abstract_params(config))
    axes = jax.tree.leaves(param_axes(config), is_leaf=lambda x: isinstance(x, PartitionSpec))
    return tuple((tuple(leaf.shape), tuple(spec)) for leaf, spec in zip(shapes, axes))


def param_bytes_per_device(config: ModelConfig, mesh, dtype: str | None = None) -> int:
    """Bytes of the parameters one device holds under ``mesh`` (an ``AbstractMesh`` will do), stored in ``dtype``
    (default ``config.param_dtype``): each dimension the rules split is divided by its mesh axis (rounded up where
    it does not divide, the padded worst case of a split ``param_specs`` would refuse); KV projections stay whole
    when the mesh replicates KV heads."""
    try:
        replicate = sharding.check_topology(config.n_kv_heads, sharding.axis_size(mesh, "model"),
                                            config.n_heads) == "replicate"
    except ConfigError:
        replicate = False
    itemsize = dtype_bytes(dtype or config.param_dtype)
    total = 0
    for shape, logical in _declared(config):
        spec = sharding.logical_to_mesh(logical, mesh_axes=mesh.axis_names)
        elements = 1
        for size, name, axes in zip(shape, logical, tuple(spec) + (None,) * (len(shape) - len(spec))):
            split = 1 if axes is None or (replicate and name == "kv_heads") else math.prod(
                sharding.axis_size(mesh, a) for a in ((axes,) if isinstance(axes, str) else axes))
            elements *= -(-size // split)
        total += elements * itemsize
    return total


__all__ = ["param_bytes_per_device", "param_shardings", "param_specs", "param_structs", "shard_params"]
