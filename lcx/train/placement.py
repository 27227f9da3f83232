"""Where a run's train state and batches live on a device mesh.

The same logical-axis rules as inference (``lcx.model.placement``): query heads, KV heads and MLP columns split over
``model``; the batch splits over ``data`` (and, on a mesh with a ``seq`` axis, each row's positions over ``seq``:
context parallelism). With ``train.fsdp`` the weights and the optimizer state are also split over ``data`` and
``seq`` (FSDP / ZeRO-3 style): each parameter's largest dimension that the rules leave whole and that those axes
divide is cut into that many pieces, so parameter and optimizer bytes per device fall with the device count; XLA
gathers a weight where the step needs it whole and reduce-scatters its gradient. Optimizer moments take the sharding
of their parameter; scalars (step counts, the PRNG key) are replicated.
"""

from __future__ import annotations

from typing import Any

import jax
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from lcx.parallel import sharding
from lcx.model.config import ModelConfig
from lcx.model.decoder import abstract_params, param_axes
from lcx.model.placement import param_specs


def fsdp_spec(spec: PartitionSpec, shape: tuple[int, ...], data: int, logical: tuple = (),
              axes: str | tuple[str, ...] = "data") -> PartitionSpec:
    """``spec`` with the FSDP mesh ``axes`` (of ``data`` devices together) added to the largest dimension it leaves
    whole and ``data`` divides (unchanged when none does, or when one of the axes is already used). Never the stacked
    ``layers`` axis (``logical`` names the dimensions): the layer scan would gather the whole stack for every
    layer."""
    entries = list(spec) + [None] * (len(shape) - len(spec))
    names_of = lambda e: () if e is None else ((e,) if isinstance(e, str) else tuple(e))  # noqa: E731
    fsdp = (axes,) if isinstance(axes, str) else tuple(axes)
    if data == 1 or any(a in names_of(e) for e in entries for a in fsdp):
        return PartitionSpec(*entries)
    names = tuple(logical) + (None,) * (len(shape) - len(logical))
    free = [i for i, e in enumerate(entries) if e is None and shape[i] % data == 0 and names[i] != "layers"]
    if free:
        entries[max(free, key=lambda i: shape[i])] = fsdp[0] if len(fsdp) == 1 else fsdp
    return PartitionSpec(*entries)


def fsdp_axes(mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes FSDP splits weights over: ``data``, and ``seq`` when the mesh has a context-parallel axis (its
    devices hold different tokens of the same rows, so each can keep a slice of the weights as data devices do)."""
    return tuple(a for a in ("data", "seq") if sharding.axis_size(mesh, a) > 1) or ("data",)


def train_param_specs(model: ModelConfig, mesh: Mesh, fsdp: bool) -> Any:
    """``PartitionSpec`` of every parameter of a run on ``mesh``: the inference rules, plus the FSDP split (over
    ``data`` and ``seq``)."""
    specs = param_specs(model, mesh)
    if not fsdp:
        return specs
    axes = fsdp_axes(mesh)
    size = 1
    for a in axes:
        size *= sharding.axis_size(mesh, a)
    return jax.tree.map(lambda s, a, names: fsdp_spec(s, a.shape, size, tuple(names), axes), specs,
                        abstract_params(model), param_axes(model), is_leaf=lambda x: isinstance(x, PartitionSpec))


def state_shardings(model: ModelConfig, optimizer: optax.GradientTransformation, abstract_state, mesh: Mesh,
                    fsdp: bool = False):
    """A ``TrainState`` of ``NamedSharding``: params by the rules, optimizer moments like their parameter,
    everything else replicated. ``abstract_state``: the run's ``TrainState`` of shapes (``step.state_struct``)."""
    named = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
    params = jax.tree.map(named, train_param_specs(model, mesh, fsdp), is_leaf=lambda x: isinstance(x, PartitionSpec))
    replicated = sharding.replicated(mesh)
    opt_state = optax.tree_map_params(optimizer, lambda _, s: s, abstract_state.opt_state, params,
                                      transform_non_params=lambda _: replicated)
    return abstract_state.replace(step=replicated, params=params, opt_state=opt_state, rng=replicated)


def batch_shardings(batch_struct: dict[str, jax.ShapeDtypeStruct], mesh: Mesh) -> dict[str, NamedSharding]:
    """Every batch array ``[batch, ...]`` split by rows over ``data``; on a mesh with a ``seq`` axis ``[batch,
    sequence]`` arrays also split their positions over it (rows laid out by ``lcx.parallel.context.layout_batch``)."""
    if sharding.axis_size(mesh, "seq") > 1:
        return {name: sharding.sequence_sharding(mesh, s.ndim) for name, s in batch_struct.items()}
    return {name: sharding.batch_sharding(mesh, s.ndim) for name, s in batch_struct.items()}


def with_shardings(abstract, shardings):
    """``jax.ShapeDtypeStruct`` leaves carrying ``shardings`` (the target of a sharded orbax restore)."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


__all__ = ["batch_shardings", "fsdp_axes", "fsdp_spec", "state_shardings", "train_param_specs", "with_shardings"]
