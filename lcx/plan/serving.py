"""What a ``lcx serve`` configuration holds: the page pool a KV budget buys, and how many sequences fit in it.

One function for the server (``ServeConfig.resolve`` sizes its pool with it at start) and ``lcx plan --serve`` (it
prints it), both from the one resolved ``lcx.engine.setup.ServeSetup``: the pool is
``--kv-memory`` bytes, or ``--gpu-memory-utilization`` of the device's free memory after the weights (the planner's
rule: a margin left to the runtime), in whole pages of ``page_size`` tokens over every layer, keys and values; it is
never larger than every row at its largest (``max_num_seqs`` rows of ``max_model_len`` tokens under the full policy,
of the policy's planned slots under an evicting one), since more pages could never be used. Key / value buffers a
row holds outside the pool (a bit-packed cache's float window, ``lcx.cache.lowbit_pages``) come off the budget first,
for every one of the ``max_num_seqs`` rows.

On a mesh (``lcx serve --tensor-parallel-size M``; ``lcx plan --serve --devices M``) every device holds every page -
its KV heads' part of it - so the budget is per device, a page costs ``1 / M`` of its bytes there, and the pool's
page count is the same on every device: what the planner prints is what each device of the server allocates.
"""

from __future__ import annotations

import dataclasses

from lcx.cache import schema
from lcx.cache.config import CacheConfig
from lcx.config_base import ConfigError
from lcx.model.config import ModelConfig
from lcx.parallel import sharding
from lcx.parallel.device_memory import usable_bytes


@dataclasses.dataclass(frozen=True)
class ServePlan:
    """The pool of a serve configuration. ``row_pages``: the most pages one sequence holds; ``pages``: the pool;
    ``at_max_length``: sequences of ``max_model_len`` tokens the pool holds at once (under eviction: at their
    planned slots); ``source``: where the budget came from."""

    page_size: int
    page_bytes: int
    row_pages: int
    pages: int
    max_num_seqs: int
    max_model_len: int
    policy: str
    source: str
    row_bytes: int = 0  # bytes every row holds outside the pool (a bit-packed cache's float window), all rows
    model_axis: int = 1  # devices the KV heads are split over; bytes above are per device

    @property
    def pool_bytes(self) -> int:
        return self.pages * self.page_bytes

    @property
    def at_max_length(self) -> int:
        return self.pages // self.row_pages

    @property
    def tokens(self) -> int:
        return self.pages * self.page_size

    def lines(self) -> list[str]:
        from lcx.config_base import format_bytes

        capped = min(self.at_max_length, self.max_num_seqs)
        where = "" if self.model_axis == 1 else (f" on each of {self.model_axis} devices (--tensor-parallel-size "
                                                 f"{self.model_axis}: each holds its KV heads' part of every page)")
        return [f"KV pool: {self.pages:,} pages of {self.page_size} tokens = {self.tokens:,} tokens, "
                f"{format_bytes(self.pool_bytes)}{where} ({format_bytes(self.page_bytes)} per page; {self.source})",
                f"one sequence holds at most {self.row_pages} pages ({self.row_pages * self.page_size:,} tokens"
                f"{'' if self.policy == 'full' else f', policy {self.policy!r} evicting past them'})",
                f"sequences at max length ({self.max_model_len:,} tokens) at once: {self.at_max_length:,} "
                f"(serving {capped} of --max-num-seqs {self.max_num_seqs}"
                f"{'' if self.at_max_length >= self.max_num_seqs else '; more wait for pages'})"] + (
                [f"beside the pool: {format_bytes(self.row_bytes)} of float windows "
                 f"({format_bytes(self.row_bytes // self.max_num_seqs)} per sequence)"] if self.row_bytes else [])


def pool_plan(setup, *, kv_memory: int | None = None, free_bytes: int | None = None,
              utilization: float | None = None, weight_bytes: int = 0) -> ServePlan:
    """The pool of a resolved serve configuration (``lcx.engine.setup.ServeSetup``: its cache kind, a row's pages,
    the rows, its mesh); see the module docstring. ``kv_memory``: the budget in bytes (per device); else
    ``utilization`` of ``free_bytes`` (a device's free memory before the weights) less ``weight_bytes`` (those one
    device holds); else every row at its largest."""
    kind, cache, rows = setup.kind, setup.cache, setup.max_num_seqs
    model_axis = sharding.axis_size(setup.mesh, "model")  # the kind's KV heads (replicated ones too) split evenly
    page_bytes = kind.page_nbytes() // model_axis
    most = rows * setup.row_pages
    outside = {n: f for n, f in kind.fields().items() if "pages" not in f.axes}
    row_bytes = schema.nbytes(outside, kind.sizes(rows, setup.slots), kind.kv_dtype, "kv") // model_axis
    if kv_memory is not None:
        pages, source = (kv_memory - row_bytes) // page_bytes, "--kv-memory"
        if pages < 1:
            raise ConfigError(f"--kv-memory={kv_memory} bytes is invalid: one page of {cache.page_size} tokens takes "
                              f"{page_bytes:,} bytes" + (f", after {row_bytes:,} bytes of the {rows} rows' "
                                                         "float windows" if row_bytes else ""))
    elif utilization is not None and free_bytes is not None:
        if isinstance(utilization, bool) or not isinstance(utilization, (int, float)) or not 0 < utilization <= 1:
            raise ConfigError(f"--gpu-memory-utilization={utilization!r} is invalid: must be a fraction in (0, 1]")
        budget = usable_bytes(free_bytes, utilization) - weight_bytes - row_bytes
        pages, source = budget // page_bytes, f"{utilization:.0%} of free device memory less the weights"
        if pages < 1:
            raise ConfigError(f"--gpu-memory-utilization={utilization} leaves {budget:,} bytes for the KV cache: "
                              f"not one page ({page_bytes:,} bytes); raise it or pass --kv-memory")
    else:
        pages, source = most, "every sequence at its largest"
    if pages > most:
        pages, source = most, f"{source}, capped at every sequence at its largest"
    return ServePlan(page_size=cache.page_size, page_bytes=page_bytes, row_pages=setup.row_pages, pages=int(pages),
                     max_num_seqs=rows, max_model_len=setup.max_len, policy=cache.policy, source=source,
                     row_bytes=row_bytes, model_axis=model_axis)


def serve_plan(model: ModelConfig, cache: CacheConfig, *, max_num_seqs: int, max_model_len: int,
               kv_memory: int | None = None, free_bytes: int | None = None, utilization: float | None = None,
               weight_bytes: int = 0, tensor_parallel_size: int = 1) -> ServePlan:
    """``pool_plan`` of the setup ``lcx serve`` resolves for these settings (``lcx plan --serve``: nothing runs, so
    a policy's repeat prompt is not needed; the mesh of ``tensor_parallel_size`` devices is abstract)."""
    from lcx.engine.setup import resolve

    for name, value in (("--max-num-seqs", max_num_seqs), ("--max-model-len", max_model_len),
                        ("--tensor-parallel-size", tensor_parallel_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name}={value!r} is invalid: must be a positive integer")
    mesh = tensor_parallel_mesh(model, tensor_parallel_size)
    setup = resolve(model, cache, max_num_seqs=max_num_seqs, max_len=max_model_len, reconstruction=_PLANNED,
                    mesh=mesh)
    return pool_plan(setup, kv_memory=kv_memory, free_bytes=free_bytes, utilization=utilization,
                     weight_bytes=weight_bytes)


_PLANNED = object()  # a stand-in for KVzip's repeat prompt: planning the pool runs no pass


def tensor_parallel_sizes(model: ModelConfig) -> list[int]:
    """The ``--tensor-parallel-size`` values that split ``model``'s KV groups without communication in attention."""
    return sharding.valid_model_axis_sizes(model.n_kv_heads, model.n_heads)


def tensor_parallel_mesh(model: ModelConfig, size: int, devices=None):
    """The mesh of ``lcx serve --tensor-parallel-size size``: ``size`` devices on ``model`` (of ``devices``, the
    first ones; None: an abstract mesh, for planning), None for one device. A size that cannot split the model's KV
    heads is refused naming the sizes that can."""
    if size == 1:
        return None
    try:
        sharding.check_topology(model.n_kv_heads, size, model.n_heads)
    except ConfigError:
        raise ConfigError(f"--tensor-parallel-size={size} is invalid for this model ({model.n_kv_heads} KV heads, "
                          f"{model.n_heads} query heads): allowed {tensor_parallel_sizes(model)} (a divisor of the "
                          "KV heads splits them; a multiple replicates each)") from None
    if devices is None:
        return sharding.abstract_mesh(1, size)
    if size > len(devices):
        raise ConfigError(f"--tensor-parallel-size={size} is invalid: {len(devices)} devices are available")
    return sharding.make_mesh(1, size, devices=list(devices)[:size])


__all__ = ["ServePlan", "pool_plan", "serve_plan", "tensor_parallel_mesh", "tensor_parallel_sizes"]
