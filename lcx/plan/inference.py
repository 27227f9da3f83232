"""``lcx plan``: KV-cache and memory arithmetic for a deployment, and the three decision checkpoints.

The planner calls the functions the runtime uses, so the two cannot drift: the memory arithmetic is
``lcx.plan.arithmetic`` (KV bytes from the storage format's own buffer declarations, ``lcx.cache.storage``; the GQA
topology and KV-head replication from ``lcx.parallel.sharding``; weights per device from the model's parameter
placement; the usable share of device memory from ``lcx.parallel.device_memory``; its names are re-exported here).
This module holds the plan: its inputs, the three checkpoints and the numbers. Pure functions (``checkpoints``,
``make_plan``); the text form is ``lcx.plan.render`` and the command line ``lcx.cli.plan``.

The memory model, per device (stated in every plan's ``assumptions``):
- the devices form a ``data x model`` mesh (``--devices`` in all, ``--data`` of them along the data axis): the
  batch splits over ``data``; query heads, KV heads and MLP columns over ``model``; the vocabulary, embedding and
  norms stay whole on every device, as ``lcx.parallel.sharding`` places them;
- KV heads: kv_heads / model per device when the model axis divides them, one replicated head per device when the
  model axis is a multiple of kv_heads (as vLLM does); other splits are invalid (checkpoint (b)) and are counted as
  ceil(kv_heads / model), the padded worst case;
- ``utilization`` (default 90%) of device memory is usable, the rest is left to the runtime (CUDA context,
  fragmentation), as serving stacks do; activations and workspace are not counted beyond that margin.
"""

from __future__ import annotations

import dataclasses
from typing import Any


from lcx.parallel import sharding
from lcx.cache.config import CacheConfig
from lcx.config import ConfigError, ModelConfig
from lcx.config_base import canonical_dtype, format_bytes
from lcx.parallel.device_memory import UTILIZATION, usable_bytes
from lcx.plan.arithmetic import (UNBOUNDED, abstract_mesh, kv_bytes_for_context, kv_bytes_per_token,  # noqa: F401
                                 kv_bytes_per_token_per_device, kv_heads_per_device, kv_storage, kv_window_bytes,
                                 local_slots, max_context, valid_model_axis_sizes, weight_bytes,
                                 weight_bytes_per_device)

# fp16 keeps finite values up to 65504; past a few thousand tokens attention logits and residual activations of
# models trained in bf16 are known to exceed it. 4096 is where the planner starts warning.
FP16_SAFE_CONTEXT = 4096
# The GQA size the planner suggests for MHA models: Llama-2/3-70B's choice, one KV group per GPU on 8-way TP.
SUGGESTED_KV_HEADS = 8
STATUSES = ("pass", "warn", "fail")


# --------------------------------------------------------------------------------------------------- inputs / plan
@dataclasses.dataclass(frozen=True)
class PlanInputs:
    """What to plan for. ``weight_dtype`` and ``kv_dtype`` default to the model's ``param_dtype`` and ``dtype``
    (the cache stores K and V in the compute dtype). ``budget`` is an eviction budget in tokens per sequence.
    ``devices`` form a ``data x model`` mesh with ``data`` devices along the data axis (the batch splits over it)."""

    model: ModelConfig
    context: int
    batch: int
    gpu_mem_bytes: int
    devices: int = 1
    kv_dtype: str | None = None
    weight_dtype: str | None = None
    budget: int | None = None
    utilization: float = UTILIZATION
    data: int = 1
    cache: Any = None  # a CacheConfig whose tiers to plan (e.g. policy memory): device vs host / disk bytes
    shared_prefix: int = 0  # tokens every sequence starts with (a paged cache stores their whole pages once)

    def __post_init__(self):
        if not isinstance(self.model, ModelConfig):
            raise ConfigError(f"model={type(self.model).__name__} is invalid: must be an lcx ModelConfig")
        for name, flag, what in (("context", "--context", "tokens per sequence"), ("batch", "--batch", "sequences"),
                                 ("gpu_mem_bytes", "--gpu-mem", "bytes per device"),
                                 ("devices", "--devices", "devices")):
            _positive_int(getattr(self, name), name, flag, what)
        if self.budget is not None:
            _positive_int(self.budget, "budget", "--budget", "tokens kept per sequence by the eviction policy")
        _positive_int(self.data, "data", "--data", "devices along the data axis")
        if self.devices % self.data:
            raise ConfigError(f"data={self.data} is invalid: the data axis must divide --devices={self.devices} "
                              f"(the mesh is data x model = devices)")
        if isinstance(self.utilization, bool) or not (isinstance(self.utilization, (int, float))
                                                      and 0 < self.utilization <= 1):
            raise ConfigError(f"utilization={self.utilization!r} is invalid: must be a fraction in (0, 1] "
                              f"(--utilization)")
        if isinstance(self.shared_prefix, bool) or not isinstance(self.shared_prefix, int) or not (
                0 <= self.shared_prefix <= self.context):
            raise ConfigError(f"shared_prefix={self.shared_prefix!r} is invalid: must be an integer in [0, "
                              f"{self.context}] (tokens of --context every sequence shares; --shared-prefix)")
        if self.shared_prefix and getattr(self.cache, "layout", None) != "paged":
            raise ConfigError(f"shared_prefix={self.shared_prefix} needs a paged cache to share pages: pass "
                              "--page-size N (or --cache-param layout=paged)")
        # a storage format's name (int8 / fp8 / int4 / int2 / fp4: codes with scales) stays; a float dtype is canonical
        storage = kv_storage(self.model, self.kv_dtype)
        object.__setattr__(self, "kv_dtype", storage.name or storage.dtype)
        object.__setattr__(self, "weight_dtype",
                           canonical_dtype(self.weight_dtype or self.model.param_dtype, "--weight-dtype"))


def _positive_int(value: Any, name: str, flag: str, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name}={value!r} is invalid: must be a positive integer number of {what} ({flag})")


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    name: str
    status: str  # one of STATUSES
    reason: str

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"{self.status=} must be one of {STATUSES}")


@dataclasses.dataclass(frozen=True)
class Plan:
    """Every number the planner derives; bytes are ints. ``*_per_device`` follow the module's memory model."""

    source: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    context: int
    batch: int
    devices: int
    budget: int | None
    gpu_mem_bytes: int
    utilization: float
    usable_bytes_per_device: int
    weight_dtype: str
    kv_dtype: str
    num_params: int
    weight_bytes: int
    weight_bytes_per_device: int
    kv_bytes_per_token: int
    kv_bytes_total: int  # full cache: context x batch tokens, all KV heads once
    kv_heads_per_device: int
    kv_replication: int  # copies of each KV head across the model axis (1 = none)
    kv_bytes_per_device: int
    total_bytes_per_device: int
    fits: bool
    cache_tokens: int  # min(context, budget): tokens per sequence the cache holds with the eviction budget
    budget_kv_bytes_total: int
    budget_kv_bytes_per_device: int
    budget_total_bytes_per_device: int
    fits_with_budget: bool
    max_context: int
    checkpoints: tuple[Checkpoint, ...]
    assumptions: tuple[str, ...]
    notes: tuple[str, ...]

    data: int = 1  # devices along the data axis (the batch splits over it)
    n_local_layers: int = 0  # sliding-window layers: they hold local_slots per sequence, whatever the context
    local_slots: int = 0
    sliding_window: int | None = None
    # With a cache section (``--cache-policy``): what that cache type holds for the context, per sequence batch.
    cache_policy: str | None = None
    cache_device_kv_bytes: int | None = None  # keys / values on the device (working memory, device store)
    cache_device_meta_bytes: int | None = None  # positions, masks, routing summaries on the device
    cache_store_bytes: int | None = None  # keys / values off the device (host memory or disk)
    cache_slots: int | None = None  # slots per sequence and layer (and KV head, for per-head keep sets)
    cache_keep_sets: str | None = None  # "per KV head" or "per layer" (slot caches)
    cache_page_size: int | None = None  # paged cache: tokens per page
    cache_pages: int | None = None  # pages the batch holds at the full context (shared prefix pages once)
    cache_shared_tokens: int = 0  # the shared prefix the pages were counted with

    @property
    def model_axis(self) -> int:
        return self.devices // self.data

    @property
    def status(self) -> str:
        """The worst checkpoint status."""
        return max((c.status for c in self.checkpoints), key=STATUSES.index, default="pass")

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["checkpoints"] = [dataclasses.asdict(c) for c in self.checkpoints]
        out["assumptions"] = list(self.assumptions)
        out["notes"] = list(self.notes)
        out["status"] = self.status
        return out


# --------------------------------------------------------------------------------------------------- checkpoints
def longest(tokens: int) -> str:
    return "unbounded (every layer keeps only its window)" if tokens >= UNBOUNDED else f"{tokens} tokens"


def _memory_checkpoint(inputs: PlanInputs, n: dict[str, Any]) -> Checkpoint:
    """(a) context vs memory budget."""
    model, usable = inputs.model, n["usable"]
    need = (f"weights {format_bytes(n['w_dev'])} + KV {format_bytes(n['kv_dev'])} = "
            f"{format_bytes(n['total_dev'])} per device")
    of = f"{inputs.utilization:.0%} of {format_bytes(inputs.gpu_mem_bytes)} = {format_bytes(usable)}"
    if n["fits"]:
        return Checkpoint("context_vs_memory", "pass",
                          f"{need} fits in {of} ({format_bytes(usable - n['total_dev'])} to spare); "
                          f"longest context that fits: {longest(n['max_context'])}")
    if inputs.budget is not None and n["fits_budget"]:
        return Checkpoint("context_vs_memory", "warn",
                          f"the full cache does not fit ({need} > {of}); with the eviction budget of "
                          f"{n['cache_tokens']} tokens the cache is {format_bytes(n['b_kv_dev'])} per device and "
                          f"fits, at the cost of evicted tokens; longest full-cache context: "
                          f"{longest(n['max_context'])}")
    advice = []
    if n["max_context"] > 0:
        advice.append(f"longest context that fits: {n['max_context']} tokens")
        advice.append(f"an eviction budget that fits: cache.policy=streaming cache.budget={n['max_context']}")
    else:
        advice.append(f"the weights alone ({format_bytes(n['w_dev'])} per device) exceed {format_bytes(usable)}")
    if model.n_kv_heads == model.n_heads and model.n_heads > SUGGESTED_KV_HEADS \
            and model.n_heads % SUGGESTED_KV_HEADS == 0:
        saved = n["kv_total"] - n["kv_total"] * SUGGESTED_KV_HEADS // model.n_heads
        advice.append(f"GQA with {SUGGESTED_KV_HEADS} KV heads would shrink the cache "
                      f"{model.n_heads // SUGGESTED_KV_HEADS}x, saving {format_bytes(saved)} of "
                      f"{format_bytes(n['kv_total'])} (needs uptraining)")
    if model.attention.impl not in ("pallas", "cudnn"):
        advice.append("flash kernels (attention.impl=pallas) so prefill never holds the T x T scores")
    more = _devices_that_fit(inputs)
    advice.append(f"{more} devices (tensor parallel {more}) would fit" if more is not None
                  else f"no clean tensor-parallel size up to n_heads={model.n_heads} devices fits")
    return Checkpoint("context_vs_memory", "fail", f"{need} exceeds {of}; options: " + "; ".join(advice))


def _devices_that_fit(inputs: PlanInputs) -> int | None:
    """The smallest clean model-axis size above the current one on which the full cache fits, if any."""
    model = inputs.model
    candidates = [d for d in valid_model_axis_sizes(model, model.n_heads) if d > inputs.devices // inputs.data]
    for d in candidates:
        if max_context(model, batch=inputs.batch, gpu_mem_bytes=inputs.gpu_mem_bytes, devices=d * inputs.data,
                       kv_dtype=inputs.kv_dtype, weight_dtype=inputs.weight_dtype, utilization=inputs.utilization,
                       data=inputs.data) >= inputs.context:
            return d
    return None


def _gqa_checkpoint(inputs: PlanInputs, n: dict[str, Any]) -> Checkpoint:
    """(b) GQA groups vs tensor-parallel degree (the model axis)."""
    model, g = inputs.model, inputs.devices // inputs.data
    k, h = model.n_kv_heads, model.n_heads
    if g == 1:
        where = "1 device" if inputs.devices == 1 else f"model axis of 1 ({inputs.devices} devices on the data axis)"
        return Checkpoint("gqa_vs_tensor_parallel", "pass",
                          f"{where}: no tensor parallelism; all {k} KV heads on it")
    if g == k and h % g == 0:
        return Checkpoint("gqa_vs_tensor_parallel", "pass",
                          f"{k} KV heads over {g} devices: one KV group ({h // k} query heads) per device, "
                          f"attention needs no communication")
    if k % g == 0:
        return Checkpoint("gqa_vs_tensor_parallel", "pass",
                          f"{k} KV heads over {g} devices: {k // g} whole KV groups per device, attention needs no "
                          f"communication (ideal: {k} devices, one group each)")
    valid = valid_model_axis_sizes(model, g)
    if g % k == 0 and h % g == 0:
        extra = n["kv_dev"] * inputs.devices - n["kv_total"]
        return Checkpoint("gqa_vs_tensor_parallel", "warn",
                          f"{g} devices > {k} KV heads: each KV head is replicated {g // k}x (as vLLM does), "
                          f"the cache takes {format_bytes(n['kv_dev'] * inputs.devices)} over all devices instead of "
                          f"{format_bytes(n['kv_total'])} (+{format_bytes(extra)}); a model axis of {k} with a "
                          f"data axis of {g // k} avoids it")
    fitting = [d for d in valid if d <= g]
    why = (f"n_heads={h} is not divisible by {g}" if g % k == 0
           else f"{g} neither divides kv_heads={k} nor is a multiple of it")
    return Checkpoint("gqa_vs_tensor_parallel", "fail",
                      f"{k} KV heads cannot be split over a model axis of {g} devices ({why}); valid model-axis "
                      f"sizes: {', '.join(map(str, valid))} (divisors of kv_heads={k}, and multiples of it up to "
                      f"{g} that divide n_heads={h}); the largest on {g} devices is {fitting[-1]}")


def _is_fp16(dtype: str) -> bool:
    return dtype == "float16"


def _precision_checkpoint(inputs: PlanInputs) -> Checkpoint:
    """(c) precision consistency. The training dtype is taken to be ``model.param_dtype``."""
    model = inputs.model
    trained = model.param_dtype
    warnings = []
    long = inputs.context > FP16_SAFE_CONTEXT
    in_fp16 = [what for what, dtype in (("compute", model.dtype), ("KV cache", inputs.kv_dtype)) if _is_fp16(dtype)]
    if long and in_fp16:
        warnings.append(f"fp16 {' and '.join(in_fp16)}: fp16 max 65504: attention logits/activations may overflow "
                        f"on long sequences (context {inputs.context} > {FP16_SAFE_CONTEXT}); use bf16")
    # fp32 and bf16 share an 8-bit exponent; fp16 has 5. Crossing that line either overflows (8 -> 5 bits) or
    # loses mantissa (fp16's 11 significant bits -> bf16's 8).
    # a KV cache scaled per token or group has no exponent range to cross (its storage's exponent_dtype is None)
    for what, dtype in (("KV cache", kv_storage(model, inputs.kv_dtype).exponent_dtype),
                        ("weights", inputs.weight_dtype)):
        if dtype is None:
            continue
        if _is_fp16(dtype) != _is_fp16(trained):
            if _is_fp16(dtype):
                warnings.append(f"{what} in float16 but the model was trained in {trained}: values beyond 65504 "
                                f"overflow (different exponent range)")
            else:
                warnings.append(f"{what} in {dtype} but the model was trained in float16: fewer mantissa bits "
                                f"(different exponent range); prefer float16 or float32")
    facts = (f"compute {model.dtype}, weights {inputs.weight_dtype}, KV cache {inputs.kv_dtype}; RMSNorm statistics "
             f"in float32 (always, in lcx); norm_eps={model.norm_eps:g} (from the config); no dropout at inference "
             f"(lcx has none)")
    if warnings:
        return Checkpoint("precision", "warn", "; ".join(warnings) + "; " + facts)
    return Checkpoint("precision", "pass", facts)


def checkpoints(inputs: PlanInputs) -> list[Checkpoint]:
    """The three decision checkpoints: (a) context vs memory, (b) GQA vs tensor parallel, (c) precision."""
    return _checkpoints(inputs, _numbers(inputs))


def _checkpoints(inputs: PlanInputs, n: dict[str, Any]) -> list[Checkpoint]:
    return [_memory_checkpoint(inputs, n), _gqa_checkpoint(inputs, n), _precision_checkpoint(inputs)]


# --------------------------------------------------------------------------------------------------- plan
def _numbers(inputs: PlanInputs) -> dict[str, Any]:
    model, m, data = inputs.model, inputs.devices // inputs.data, inputs.data
    rows = -(-inputs.batch // data)  # sequences per device: the batch splits over the data axis
    usable = usable_bytes(inputs.gpu_mem_bytes, inputs.utilization)
    w_total = weight_bytes(model, inputs.weight_dtype)
    w_dev = weight_bytes_per_device(model, inputs.weight_dtype, m, data)
    per_token = kv_bytes_per_token(model, inputs.kv_dtype)
    interval, chunk = (inputs.cache or CacheConfig()).interval, (inputs.cache or CacheConfig()).prefill_chunk
    kv_of = lambda tokens: kv_bytes_for_context(model, inputs.kv_dtype, tokens, interval, chunk)  # noqa: E731
    on_device = lambda nbytes: nbytes * kv_heads_per_device(model, m) // model.n_kv_heads  # noqa: E731
    cache_tokens = min(inputs.context, inputs.budget) if inputs.budget is not None else inputs.context
    kv_dev = on_device(kv_of(inputs.context)) * rows
    b_kv_dev = on_device(kv_of(cache_tokens)) * rows
    return dict(
        usable=usable, w_total=w_total, w_dev=w_dev, per_token=per_token,
        kv_total=kv_of(inputs.context) * inputs.batch, kv_dev=kv_dev, total_dev=w_dev + kv_dev,
        fits=w_dev + kv_dev <= usable, cache_tokens=cache_tokens,
        b_kv_total=kv_of(cache_tokens) * inputs.batch, b_kv_dev=b_kv_dev, b_total_dev=w_dev + b_kv_dev,
        fits_budget=w_dev + b_kv_dev <= usable,
        max_context=max_context(model, batch=inputs.batch, gpu_mem_bytes=inputs.gpu_mem_bytes,
                                devices=inputs.devices, kv_dtype=inputs.kv_dtype, weight_dtype=inputs.weight_dtype,
                                utilization=inputs.utilization, data=data, interval=interval, prefill_chunk=chunk),
        n_local=model.types.count("sliding_attention"),
        local_slots=local_slots(model, inputs.context, interval, chunk),
    )


def _assumptions(inputs: PlanInputs) -> tuple[str, ...]:
    g, data = inputs.devices // inputs.data, inputs.data
    placement = ("weights placed as lcx places them: heads, KV heads and MLP columns split, vocabulary, embedding "
                 "and norms whole on every device")
    return (
        f"tensor parallel over all {g} device(s): {placement}; KV heads split (replicated when the model axis "
        f"exceeds kv_heads)" if g > 1 and data == 1
        else f"mesh data={data} x model={g}: {placement}" if g > 1
        else "model axis of 1: all weights and KV heads on every device",
        "batch not split across devices (no data parallelism)" if data == 1
        else f"batch split over the data axis: ceil(batch / {data}) sequences per device",
        f"{inputs.utilization:.0%} of device memory usable (the rest for the runtime); activations and workspace "
        f"not counted",
        f"weights in {inputs.weight_dtype}, KV cache in {inputs.kv_dtype}; training dtype taken as model.param_dtype",
    )


def _notes(inputs: PlanInputs) -> tuple[str, ...]:
    model, notes = inputs.model, []
    if inputs.context > model.max_position_embeddings:
        notes.append(f"context {inputs.context} > model.max_position_embeddings={model.max_position_embeddings} "
                     f"(rope.type={model.rope.type}): beyond the trained length quality needs RoPE scaling "
                     f"(rope.type=yarn/llama3/...) or an eviction policy with cache-local positions")
    if model.attention.impl == "reference":
        heads = -(-model.n_heads // (inputs.devices // inputs.data))
        scores = -(-inputs.batch // inputs.data) * heads * inputs.context * inputs.context * 4
        notes.append(f"attention.impl=reference materializes float32 scores [batch, heads, T, T] in prefill: "
                     f"{format_bytes(scores)} per device per layer for one {inputs.context}-token pass; use "
                     f"attention.impl=pallas (flash) for long prompts")
    return tuple(notes)


def _tier_numbers(inputs: PlanInputs) -> dict[str, Any]:
    """Bytes the cache type of ``inputs.cache`` holds for the context, from its own buffer declaration."""
    if inputs.cache is None:
        return {}
    # the run's policy over the planned storage: its format (codes and scales), or the cache's own in a float dtype
    storage = kv_storage(inputs.model, inputs.kv_dtype)
    cache = CacheConfig.from_mapping({**inputs.cache.to_dict(), "kv_dtype": storage.name or inputs.cache.kv_dtype})
    kind = cache.kind(dataclasses.replace(inputs.model, dtype=storage.dtype))
    capacity = kind.plan(inputs.batch, inputs.context, 0)
    if hasattr(kind, "pages_for"):  # a paged kind: pages in use (the shared prefix's whole pages once, if kept whole)
        pages = kind.pages_for(inputs.batch, inputs.context, inputs.shared_prefix)
        return {"cache_policy": inputs.cache.policy, "cache_device_kv_bytes": pages * kind.page_nbytes(),
                "cache_device_meta_bytes": kind.nbytes(inputs.batch, capacity, role="meta"),
                "cache_store_bytes": 0, "cache_slots": capacity, "cache_page_size": kind.page, "cache_pages": pages,
                "cache_shared_tokens": inputs.shared_prefix if kind.shares_pages else 0}
    return {"cache_policy": inputs.cache.policy, "cache_device_kv_bytes": kind.nbytes(inputs.batch, capacity),
            "cache_device_meta_bytes": kind.nbytes(inputs.batch, capacity, role="meta"),
            "cache_store_bytes": kind.store_nbytes(inputs.batch, capacity), "cache_slots": capacity,
            "cache_keep_sets": None if getattr(kind, "keep_heads", None) is None else
            ("per KV head" if kind.keep_heads > 1 else "per layer")}


def _replication(model: ModelConfig, model_axis: int) -> int:
    try:
        return sharding.kv_replication(model.n_kv_heads, model_axis, model.n_heads)
    except ConfigError:
        return 1


def make_plan(inputs: PlanInputs, source: str = "") -> Plan:
    """All numbers, the checkpoints, the assumptions and notes for ``inputs``; ``source`` names the config."""
    model, n = inputs.model, _numbers(inputs)
    return Plan(
        source=source, n_layers=model.n_layers, n_heads=model.n_heads, n_kv_heads=model.n_kv_heads,
        head_dim=model.head_dim, max_position_embeddings=model.max_position_embeddings,
        context=inputs.context, batch=inputs.batch, devices=inputs.devices, budget=inputs.budget,
        gpu_mem_bytes=inputs.gpu_mem_bytes, utilization=inputs.utilization, usable_bytes_per_device=n["usable"],
        weight_dtype=inputs.weight_dtype, kv_dtype=inputs.kv_dtype, num_params=model.num_params(),
        weight_bytes=n["w_total"], weight_bytes_per_device=n["w_dev"],
        kv_bytes_per_token=n["per_token"], kv_bytes_total=n["kv_total"],
        kv_heads_per_device=kv_heads_per_device(model, inputs.devices // inputs.data),
        kv_replication=_replication(model, inputs.devices // inputs.data),
        kv_bytes_per_device=n["kv_dev"], total_bytes_per_device=n["total_dev"], fits=n["fits"],
        cache_tokens=n["cache_tokens"], budget_kv_bytes_total=n["b_kv_total"], budget_kv_bytes_per_device=n["b_kv_dev"],
        budget_total_bytes_per_device=n["b_total_dev"], fits_with_budget=n["fits_budget"],
        max_context=n["max_context"], data=inputs.data, n_local_layers=n["n_local"], local_slots=n["local_slots"],
        sliding_window=model.sliding_window if n["n_local"] else None, **_tier_numbers(inputs),
        checkpoints=tuple(_checkpoints(inputs, n)),
        assumptions=_assumptions(inputs), notes=_notes(inputs),
    )
