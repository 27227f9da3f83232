"""Device meshes and sharding: the mesh from config, one table of logical-axis rules, the GQA topology check, and
running kernels once per shard.

Mesh axes: ``"data"`` splits the batch, ``"seq"`` the sequence of a training row's activations (context
parallelism, ``lcx.parallel.context``; size 1 unless asked for), ``"model"`` is tensor parallelism (query heads, KV
heads, MLP hidden).
Model code names logical axes only; ``LOGICAL_RULES`` maps them to mesh axes, and :func:`logical_to_mesh` turns
a logical spec into a ``PartitionSpec``, raising when one mesh axis would split two dimensions of one array.

The model learns the mesh at trace time from the context mesh (``with use_mesh(mesh): ...``, which is
``jax.set_mesh``) through ``jax.sharding.get_abstract_mesh()``, so no model signature carries it. Without a context
mesh every helper here is the identity and kernels are called directly.

Communication. Query heads are ordered by KV group (head h belongs to KV head h // g), so splitting "heads" and
"kv_heads" contiguously over "model" keeps each query head on the device of its KV head: attention (kernels and
the cache write) runs per shard (:func:`per_shard`, ``jax.shard_map``) with no communication. What remains are the
all-reduces of the row-parallel matmuls: after the output projection (heads contracted) and after the MLP down
projection (mlp contracted). The vocabulary is not split: the embedding lookup and the logits need no collective.

Topology (KV groups vs the model axis): ``lcx.parallel.topology`` decides "shard" or "replicate" from the head
counts alone; :func:`mesh_topology`, :func:`cache_model_config` and :func:`replicate_kv_heads` apply it on a mesh.
They read a model's head counts through ``HeadCounts`` (``n_heads``, ``n_kv_heads``): the parallel floor knows no
model config.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import einops
import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from lcx.config_base import ConfigError
from lcx.parallel.topology import (HeadCounts, check_topology, kv_replication, log_replication,
                                   valid_model_axis_sizes)

MESH_AXES = ("data", "seq", "model")

# Logical axis -> mesh axis (None: not split). The one table; model code never names a mesh axis.
LOGICAL_RULES: Mapping[str, str | None] = types.MappingProxyType({
    "batch": "data",
    "heads": "model",
    "kv_heads": "model",
    "mlp": "model",
    # Split, the vocabulary would need an all-gather of the logits (sampling reads every column); the embedding and
    # lm_head (2 x vocab x embed) stay whole on every device instead.
    "vocab": None,
    "embed": None,
    "head_dim": None,
    "norm": None,
    "layers": None,
    "length": None,  # sequence positions a kernel sees whole, and cache slots
    # The positions of a training row's activations (and its batch arrays): split over "seq" when the mesh has a
    # context-parallel axis; attention then runs lcx.parallel.context's ring or all-gather across it.
    "sequence": "seq",
    # Cache buffers: the KV heads that keep their own token set go with their KV heads (a size of 1 - one set shared
    # by all heads of a layer - is replicated); long-term memory blocks stay whole per device.
    "keep_heads": "model",
    "blocks": None,
    "groups": None,
    "block": None,
    "topk": None,
    "representatives": None,
    "route_queries": None,
    "room": None,  # the memory tier's lexical recall: one call's token ids, and the last ids read
    "lexical_tokens": None,
    "stats": None,
    "router_rank": None,
    # the bit-packed cache's code bytes, key-scale rows, value-scale groups and float window (lcx.cache.lowbit_slots)
    "packed_dim": None,
    "packed_length": None,
    "key_groups": None,
    "value_groups": None,
    "residual": None,
    # a paged cache's pool (lcx.cache.paged): the pages themselves are whole on every device of a data shard (each
    # holds its KV heads' part of every page); a row's table of page ids and the pages' slots likewise
    "pages": None,
    "page": None,
    "row_pages": None,
    "packed_page": None,  # a bit-packed pool's key code bytes of a page, and its key-scale rows
    "page_groups": None,
    "fp4_codes": None,  # fp4's code bytes and scale blocks per token and KV head (lcx.cache.storage.fp4)
    "fp4_blocks": None,
})
# Dimensions of these logical axes are replicated when their size does not divide the mesh axis (a shared keep set).
REPLICATE_IF_INDIVISIBLE = frozenset({"keep_heads"})

# Logical layouts of the arrays that cross the kernel boundary (einsum letters of ``lcx.model.attention``).
BTHD = ("batch", "length", "heads", "head_dim")  # queries and attention outputs [b, t, h, d]
BSKD = ("batch", "length", "kv_heads", "head_dim")  # keys and values [b, s, k, d]
BKSD = ("batch", "kv_heads", "length", "head_dim")  # the slot cache's keys and values [b, k, s, d]
BHD = ("batch", "heads", "head_dim")  # one decode query / output [b, h, d]
BKS = ("batch", "kv_heads", "length")  # per-KV-head slot weights and live masks [b, k, s]
BK = ("batch", "kv_heads")  # per row and KV head: offsets and lengths of caches whose KV heads keep their own slots
BT = ("batch", "length")  # per token without heads: segment ids of packed documents [b, t]
ROWS = ("batch",)  # anything per row without heads: masks [b, t, s], lengths [b], offsets [b]


# --------------------------------------------------------------------------------------------------- config
@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """``mesh: {data: D, seq: S, model: M}``: the device mesh. ``seq`` (default 1) splits each training row's
    sequence (context parallelism); ``"auto"`` for data or model fills the devices the other axes leave; with both
    ``"auto"`` the model axis is the largest size that splits the KV heads without replication (see
    :func:`resolve_mesh_shape`). ``data x seq x model`` must equal the number of devices."""

    data: int | str = "auto"
    model: int | str = "auto"
    seq: int = 1

    def __post_init__(self):
        for name in ("data", "model"):
            object.__setattr__(self, name, _axis_value(getattr(self, name), f"mesh.{name}"))
        object.__setattr__(self, "seq", _seq_value(self.seq))

    def shape(self, n_devices: int, n_kv_heads: int | None = None, n_heads: int | None = None) -> tuple[int, int]:
        """``(data, model)`` over the ``n_devices / seq`` devices each sequence shard spans."""
        return resolve_mesh_shape(self.data, self.model, _per_seq(n_devices, self.seq), n_kv_heads, n_heads)

    def make_mesh(self, devices: Sequence[Any] | None = None, n_kv_heads: int | None = None,
                  n_heads: int | None = None) -> Mesh:
        devices = list(jax.devices() if devices is None else devices)
        data, model = self.shape(len(devices), n_kv_heads, n_heads)
        return make_mesh(data, model, devices=devices, seq=self.seq)


def _seq_value(value: Any) -> int:
    """``mesh.seq``: a positive int (no ``"auto"``: nothing else fixes how far a row is split)."""
    seq = _axis_value(value, "mesh.seq")
    if seq == "auto":
        raise ConfigError("mesh.seq='auto' is invalid: the sequence axis must be a positive integer (1: none)")
    return seq


def _per_seq(n_devices: int, seq: int) -> int:
    if n_devices % seq:
        raise ConfigError(f"mesh.seq={seq} is invalid: it must divide the {n_devices} devices")
    return n_devices // seq


def _axis_value(value: Any, key: str) -> int | str:
    """A mesh axis size: a positive int (digit strings from YAML or the environment accepted) or ``"auto"``."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if value == "auto" or (isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value > 0):
        return value if value == "auto" else int(value)
    raise ConfigError(f"{key}={value!r} is invalid: must be a positive integer or 'auto'")


def _factorizations(n: int) -> list[tuple[int, int]]:
    return [(n // m, m) for m in range(1, n + 1) if n % m == 0]


def resolve_mesh_shape(data: int | str, model: int | str, n_devices: int, n_kv_heads: int | None = None,
                       n_heads: int | None = None) -> tuple[int, int]:
    """``(data, model)`` with ``"auto"`` resolved for ``n_devices``; raises ``ConfigError`` when they do not fit."""
    if data == "auto" and model == "auto":
        if n_kv_heads is None:
            return 1, n_devices
        # Largest model axis that divides both the device count and kv_heads: whole KV groups, no replication.
        model = max(m for m in range(1, n_devices + 1) if n_devices % m == 0 and n_kv_heads % m == 0)
        return n_devices // model, model
    if data == "auto" or model == "auto":
        fixed, name = (model, "model") if data == "auto" else (data, "data")
        if n_devices % fixed:
            raise ConfigError(f"mesh.{name}={fixed} is invalid: it must divide the {n_devices} devices; valid "
                                      f"(data, model): {_factorizations(n_devices)}")
        other = n_devices // fixed
        data, model = (other, fixed) if data == "auto" else (fixed, other)
    if data * model != n_devices:
        raise ConfigError(f"mesh data={data} x model={model} = {data * model} devices, but {n_devices} "
                                  f"devices are available: data x model must equal the device count; valid "
                                  f"(data, model): {_factorizations(n_devices)}")
    if n_kv_heads is not None:
        check_topology(n_kv_heads, model, n_heads)
    return data, model


_AUTO3 = (AxisType.Auto,) * len(MESH_AXES)


def abstract_mesh(data: int, model: int, seq: int = 1) -> AbstractMesh:
    """A ``("data", "seq", "model")`` mesh of shapes only (no devices): for planning placements and bytes per
    device."""
    return AbstractMesh((data, seq, model), MESH_AXES, axis_types=_AUTO3)


def make_mesh(data: int | str = "auto", model: int | str = "auto", devices: Sequence[Any] | None = None, *,
              seq: int = 1) -> Mesh:
    """A ``("data", "seq", "model")`` mesh over ``devices`` (default: all devices of all processes).

    ``data x seq x model`` must equal the number of devices (``"auto"`` for data or model fills the rest; ``seq``,
    the context-parallel axis, is 1 unless given). Axes are of type ``Auto``: arrays carry shardings, XLA's
    partitioner propagates them, and ``per_shard`` regions are manual.
    """
    devices = list(jax.devices() if devices is None else devices)
    data, model = _axis_value(data, "mesh.data"), _axis_value(model, "mesh.model")
    seq = _seq_value(seq)
    data, model = resolve_mesh_shape(data, model, _per_seq(len(devices), seq))
    return jax.make_mesh((data, seq, model), MESH_AXES, axis_types=_AUTO3, devices=devices)


def use_mesh(mesh: Mesh | None):
    """Context in which the model, ``jax.jit`` and ``per_shard`` see ``mesh`` (``jax.set_mesh``); None: no-op."""
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def axis_size(mesh, axis: str) -> int:
    """Size of mesh axis ``axis`` (1 when the mesh has no such axis or is empty)."""
    if mesh is None or mesh.empty:
        return 1
    return dict(zip(mesh.axis_names, mesh.axis_sizes)).get(axis, 1)


# --------------------------------------------------------------------------------------------------- rules
def logical_to_mesh(spec: Sequence[str | None] | PartitionSpec, rules: Mapping[str, Any] | None = None,
                     mesh_axes: Sequence[str] | None = None) -> PartitionSpec:
    """A ``PartitionSpec`` of mesh axes from one of logical names (``None`` entries stay ``None``).

    Raises ``ValueError`` for a name the rules do not know and when two dimensions would map to the same mesh axis
    (a collision). ``mesh_axes``: drop mesh axes the mesh does not have (they split nothing).
    """
    rules = LOGICAL_RULES if rules is None else rules
    out, used = [], {}
    for name in spec:
        if name is None:
            out.append(None)
            continue
        names = (name,) if isinstance(name, str) else tuple(name)
        axes = []
        for n in names:
            if n not in rules:
                raise ValueError(f"logical axis {n!r} in spec {tuple(spec)} has no sharding rule; "
                                 f"known: {sorted(rules)}")
            target = rules[n]
            targets = () if target is None else ((target,) if isinstance(target, str) else tuple(target))
            for axis in targets:
                if mesh_axes is not None and axis not in mesh_axes:
                    continue
                if axis in used:
                    raise ValueError(f"logical spec {tuple(spec)} maps both {used[axis]!r} and {n!r} to mesh axis "
                                     f"{axis!r}: a mesh axis can split only one dimension of an array; change the "
                                     f"rules so they map to different mesh axes")
                used[axis] = n
                axes.append(axis)
        out.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    return PartitionSpec(*out)


def check_rules(rules: Mapping[str, Any]) -> None:
    """Every rule maps to ``None`` or to mesh axes of ``MESH_AXES``."""
    for name, target in rules.items():
        targets = () if target is None else ((target,) if isinstance(target, str) else tuple(target))
        bad = [t for t in targets if t not in MESH_AXES]
        if bad:
            raise ValueError(f"sharding rule {name!r} -> {target!r} names unknown mesh axes {bad}; "
                             f"allowed: {list(MESH_AXES)} or None")


check_rules(LOGICAL_RULES)


# --------------------------------------------------------------------------------------------------- topology
def mesh_topology(config: HeadCounts, mesh) -> str:
    """:func:`check_topology` of ``config`` on ``mesh``'s model axis; logs a replication once."""
    m = axis_size(mesh, "model")
    topology = check_topology(config.n_kv_heads, m, config.n_heads)
    if topology == "replicate":
        log_replication(config.n_kv_heads, m)
    return topology


def cache_model_config(config: HeadCounts, mesh) -> HeadCounts:
    """The config whose ``n_kv_heads`` is the number of KV heads the model stores under ``mesh`` (kv_heads x r when
    replicated): build caches with it (``init_cache(cache_model_config(config, mesh), ...)``). ``config``: a
    frozen dataclass with ``n_heads`` and ``n_kv_heads`` (a ``ModelConfig``); the result is of its type."""
    r = kv_replication(config.n_kv_heads, axis_size(mesh, "model"), config.n_heads)
    if r == 1:
        return config
    mesh_topology(config, mesh)
    return dataclasses.replace(config, n_kv_heads=config.n_kv_heads * r)


def replicate_kv_heads(key: jax.Array, val: jax.Array, n_heads: int) -> tuple[jax.Array, jax.Array]:
    """``key, val [b, t, k, d]`` -> ``[b, t, k * r, d]`` with each KV head repeated r times under a context mesh
    whose model axis is r x kv_heads; unchanged otherwise. Query head h then maps to KV head h // (g / r), a copy of
    h // g: the attention is the same, and each device holds one KV head."""
    mesh = jax.sharding.get_abstract_mesh()
    k, m = key.shape[2], axis_size(mesh, "model")
    if m == 1 or _manual(mesh) or check_topology(k, m, n_heads) == "shard":
        return key, val
    log_replication(k, m)
    repeat = functools.partial(einops.repeat, pattern="b t k d -> b t (k r) d", r=m // k)
    return repeat(key), repeat(val)  # [b, t, k*r, d]


# --------------------------------------------------------------------------------------------------- shardings
def spec_for(logical: Sequence[str | None], shape: Sequence[int], mesh, what: str,
             replicate_kv: bool = False) -> PartitionSpec:
    """The ``PartitionSpec`` of an array of ``shape`` with ``logical`` axes on ``mesh``; ``ConfigError`` naming
    ``what`` when a split dimension is not divisible by its mesh axis. ``replicate_kv``: a ``kv_heads`` dimension
    that does not divide is replicated instead (KV heads repeated over the model axis, see ``replicate_kv_heads``)."""
    spec = logical_to_mesh(tuple(logical), mesh_axes=mesh.axis_names)
    out = list(spec) + [None] * (len(shape) - len(spec))
    for i, (axis, size) in enumerate(zip(out, shape)):
        if axis is None:
            continue
        n = math.prod(axis_size(mesh, a) for a in ((axis,) if isinstance(axis, str) else axis))
        if size % n:
            name = logical[i]
            if (replicate_kv and name == "kv_heads") or name in REPLICATE_IF_INDIVISIBLE:
                out[i] = None
                continue
            raise ConfigError(f"{what}: dimension {i} ({name!r}) has size {size}, not divisible by mesh axis "
                              f"{axis!r} of size {n}; choose a mesh whose {axis!r} axis divides {size}")
    return PartitionSpec(*out)


def named_sharding(logical: Sequence[str | None], shape: Sequence[int], mesh: Mesh, what: str,
                   replicate_kv: bool = False) -> NamedSharding:
    """:func:`spec_for` as a ``NamedSharding`` on ``mesh``."""
    return NamedSharding(mesh, spec_for(logical, shape, mesh, what, replicate_kv))


def batch_sharding(mesh: Mesh, ndim: int = 1) -> NamedSharding:
    """Leading axis over "data", the rest replicated."""
    return NamedSharding(mesh, PartitionSpec("data", *([None] * (ndim - 1))))


def sequence_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """A training batch array ``[batch, sequence, ...]``: rows over "data", positions over "seq" (context
    parallelism; the rows are laid out for it by ``lcx.parallel.context.layout_batch``)."""
    return NamedSharding(mesh, PartitionSpec("data", "seq", *([None] * (ndim - 2))))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def put(x, sharding: NamedSharding) -> jax.Array:
    """A global array with ``sharding`` from a host value every process holds identically (multi-process safe:
    each process fills only its own shards)."""
    if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding, x.ndim):
        return x
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def to_host(x) -> np.ndarray:
    """A numpy copy of a (possibly multi-process) array: every process gets the whole value."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


# --------------------------------------------------------------------------------------------------- per shard
def _manual(mesh) -> bool:
    return not mesh.empty and any(t == AxisType.Manual for t in mesh.axis_types)


def _is_logical(x) -> bool:
    return isinstance(x, tuple) and all(e is None or isinstance(e, str) for e in x)


def _shaped_specs(layouts, values, mesh, what: str):
    """``PartitionSpec`` per leaf of ``values`` from the logical ``layouts`` (same tree structure, tuples as leaves),
    with the shape checks and replication rules of :func:`spec_for`."""
    return jax.tree.map(lambda layout, x: spec_for(layout, x.shape, mesh, what), layouts, values, is_leaf=_is_logical)


def per_shard(fn: Callable, in_axes: Sequence[Any], out_axes: Any) -> Callable:
    """``fn`` run once per shard of the context mesh (``jax.shard_map``), with no communication.

    ``in_axes``: one logical layout per positional argument (a tuple such as ``BTHD``, or a pytree of them,
    e.g. a cache state of tuples); ``out_axes`` likewise for the result. Each shard sees its rows ("batch" over
    "data") and its heads ("heads" / "kv_heads" over "model"); ``fn`` must not mix rows or KV groups - true of the
    attention kernels and the cache write. Specs are made from the arguments' shapes, so a dimension the rules
    replicate when it does not divide (a shared keep set) is replicated. Without a context mesh (or inside a
    ``shard_map``) it is ``fn`` itself.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or _manual(mesh):
        return fn
    name = getattr(fn, "__name__", "kernel")

    def call(*args):
        in_specs = tuple(_shaped_specs(axes, arg, mesh, f"{name} argument {i}")
                         for i, (arg, axes) in enumerate(zip(args, in_axes)))
        out_specs = _shaped_specs(out_axes, jax.eval_shape(fn, *args), mesh, f"{name} result")
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)

    return call


__all__ = ["BHD", "BK", "BKS", "BKSD", "BSKD", "BT", "BTHD", "LOGICAL_RULES", "MESH_AXES", "ROWS", "HeadCounts",
           "MeshConfig",
           "abstract_mesh", "axis_size", "batch_sharding", "cache_model_config", "check_rules", "check_topology",
           "kv_replication", "sequence_sharding",
           "logical_to_mesh", "make_mesh", "mesh_topology", "named_sharding", "per_shard", "put",
           "replicate_kv_heads", "replicated", "resolve_mesh_shape", "spec_for", "to_host", "use_mesh",
           "valid_model_axis_sizes"]
