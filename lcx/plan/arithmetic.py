"""The planner's memory arithmetic: KV bytes per token, per sequence and per device, weight bytes, the longest context.

Every number comes from the code the runtime runs: KV bytes from the storage format's own buffer declarations
(``lcx.cache.storage``: ``bytes_per_token``, ``bytes_per_row``), the GQA topology and KV-head replication from
``lcx.parallel.sharding``, weights per device from the model's parameter placement (``lcx.model.placement``), the
usable share of device memory from ``lcx.parallel.device_memory``. ``lcx.plan.inference`` builds the plan on these.

KV cache bytes = 2 (K and V) x layers x kv_heads x head_dim x bytes_per_element x tokens x batch (a quantized format:
its codes and scales per token, and a grouped one's float window per sequence).
"""

from __future__ import annotations

from lcx.cache.config import CacheConfig
from lcx.cache.hybrid import local_budget, local_room
from lcx.cache.storage import KVStorage, storage_named
from lcx.config import ConfigError, ModelConfig
from lcx.config_base import canonical_dtype, dtype_bytes
from lcx.model.placement import param_bytes_per_device
from lcx.parallel import sharding
from lcx.parallel.device_memory import UTILIZATION, usable_bytes


def kv_storage(model: ModelConfig, kv_dtype: str) -> KVStorage:
    """The storage format ``kv_dtype`` names (a ``cache.kv_dtype``, or a float dtype) for ``model``."""
    return storage_named(kv_dtype, model.dtype, "--kv-dtype")


def kv_bytes_per_token(model: ModelConfig, kv_dtype: str) -> int:
    """Bytes of K and V for one token of one sequence, all layers and all KV heads (no sharding, no replication);
    for the bit-packed caches the bytes one more key group adds, per token (codes and scales; the float window of
    ``kv_window_bytes`` is per sequence)."""
    return kv_storage(model, kv_dtype).bytes_per_token(model)


def kv_window_bytes(model: ModelConfig, kv_dtype: str) -> int:
    """Bytes per sequence that do not grow with its length: the float window of a bit-packed cache (the key group
    still filling, ``kv_residual`` 0), 0 for the others."""
    return kv_storage(model, kv_dtype).bytes_per_row(model)


def local_slots(model: ModelConfig, tokens: int, interval: int, prefill_chunk: int | None = None) -> int:
    """Slots a sliding-window layer holds for a sequence of ``tokens``: ``window - 1`` kept plus the room of one call
    (``lcx.cache.hybrid.local_room``), or the sequence when shorter; 0 for a model without such layers."""
    if model.sliding_window is None:
        return 0
    window = model.sliding_window
    return min(tokens, local_budget(window) + local_room(window, interval, prefill_chunk))


def kv_bytes_for_context(model: ModelConfig, kv_dtype: str, tokens: int, interval: int = CacheConfig.interval,
                         prefill_chunk: int | None = None) -> int:
    """Bytes of K and V for one sequence of ``tokens``: global layers hold every token, sliding-window layers their
    window's slots (``local_slots``)."""
    per_layer = kv_bytes_per_token(model, kv_dtype) // model.n_layers
    n_local = model.types.count("sliding_attention")
    return per_layer * ((model.n_layers - n_local) * tokens
                        + n_local * local_slots(model, tokens, interval, prefill_chunk)) \
        + kv_window_bytes(model, kv_dtype)


def weight_bytes(model: ModelConfig, dtype: str) -> int:
    """Bytes of all parameters stored in ``dtype``."""
    return model.num_params() * dtype_bytes(dtype)


def kv_heads_per_device(model: ModelConfig, model_axis: int) -> int:
    """KV heads each device holds when the model axis has ``model_axis`` devices (``lcx.parallel.sharding``'s topology:
    split, or one replicated head each; an invalid split counts ceil(kv_heads / model_axis))."""
    try:
        copies = sharding.kv_replication(model.n_kv_heads, model_axis, model.n_heads)
    except ConfigError:
        return -(-model.n_kv_heads // model_axis)
    return model.n_kv_heads * copies // model_axis


def kv_bytes_per_token_per_device(model: ModelConfig, kv_dtype: str, model_axis: int) -> int:
    """Bytes one device holds for one token of one sequence (linear in the KV heads it holds)."""
    return kv_bytes_per_token(model, kv_dtype) * kv_heads_per_device(model, model_axis) // model.n_kv_heads


abstract_mesh = sharding.abstract_mesh


def weight_bytes_per_device(model: ModelConfig, dtype: str, model_axis: int, data: int = 1) -> int:
    """Bytes of the parameters one device holds, as ``lcx.model.placement`` places them on a ``data x model``
    mesh (an invalid split, which checkpoint (b) fails, is counted padded)."""
    return param_bytes_per_device(model, abstract_mesh(data, model_axis), canonical_dtype(dtype))


UNBOUNDED = 2 ** 62  # ``max_context`` of a model whose every layer keeps only its window


def max_context(model: ModelConfig, *, batch: int, gpu_mem_bytes: int, devices: int, kv_dtype: str,
                weight_dtype: str, utilization: float = UTILIZATION, data: int = 1,
                interval: int = CacheConfig.interval, prefill_chunk: int | None = None) -> int:
    """The longest context (tokens per sequence) whose full cache fits next to the weights on every device of a
    ``data x (devices / data)`` mesh; 0 when the weights alone do not fit. Sliding-window layers count their
    window's slots (a fixed amount), global layers every token; ``UNBOUNDED`` when no layer is global."""
    model_axis = devices // data
    free = usable_bytes(gpu_mem_bytes, utilization) - weight_bytes_per_device(model, weight_dtype, model_axis, data)
    rows = -(-batch // data)
    per_layer = kv_bytes_per_token_per_device(model, kv_dtype, model_axis) // model.n_layers * rows
    n_local = model.types.count("sliding_attention")
    every_layer = max(free, 0) // (per_layer * model.n_layers)  # while a sequence is shorter than the local slots
    cap = local_slots(model, UNBOUNDED, interval, prefill_chunk)
    if not n_local or every_layer < cap:
        return every_layer
    if n_local == model.n_layers:
        return UNBOUNDED
    return (free - per_layer * n_local * cap) // (per_layer * (model.n_layers - n_local))


def valid_model_axis_sizes(model: ModelConfig, devices: int) -> list[int]:
    """Model-axis sizes that split the attention cleanly (``lcx.parallel.sharding.valid_model_axis_sizes``): the
    divisors of
    kv_heads, and the multiples of kv_heads up to ``devices`` that also divide n_heads (KV heads replicated)."""
    return sharding.valid_model_axis_sizes(model.n_kv_heads, model.n_heads, limit=max(devices, model.n_kv_heads))


__all__ = ["UNBOUNDED", "abstract_mesh", "kv_bytes_for_context", "kv_bytes_per_token",
           "kv_bytes_per_token_per_device", "kv_heads_per_device", "kv_storage", "kv_window_bytes", "local_slots",
           "max_context", "valid_model_axis_sizes", "weight_bytes", "weight_bytes_per_device"]
