"""``lcx plan --train``: bytes per device of a training run - parameters, optimizer state, gradients, activations.

Parameters (float32 master weights), AdamW moments and gradients are exact: shard shapes of the run's own state
shardings (``lcx.train.placement``: heads, KV heads and MLP columns over ``model``; with ``--fsdp`` each weight and
its moments also split over ``data``) on an abstract ``data x model`` mesh. Gradients take their parameter's
sharding (with FSDP they are reduce-scattered).

Activations are an estimate, per device, for one micro-batch of ``batch / grad_accum / data`` sequences of
``seq_len`` tokens, in the compute dtype (``c`` bytes) - per layer and token, with ``e`` d_model, ``q = heads x
head_dim``, ``kv = kv_heads x head_dim``, ``f`` d_ff, the head and MLP terms divided by the model axis:

- no remat: every tensor the backward reads - two norm inputs and outputs, q, k, v before and after RoPE, the
  attention output, gate, up and their product: ``(4e + 3q + 3kv + 3f) c``;
- ``dots`` / ``dots_no_batch`` (remat policies that keep matmul outputs): ``(2e + q + 2kv + 2f) c``;
- ``full`` remat: the layer input ``e c``, plus one layer recomputed at a time (the no-remat bytes of one layer);
- XLA attention adds the ``[heads, T, T]`` scores per layer - float32 logits and softmax, compute-dtype
  probabilities, ``heads x T x (8 + c)`` per token (kept by no-remat and ``dots``; one layer's worth under ``full`` /
  ``dots_no_batch``); flash attention keeps a float32 log-sum-exp per head and token;
- the output layer: ``LOGIT_COPIES`` float32 ``[T, vocab]`` arrays (logits, log-softmax and their gradients; the
  vocabulary is not split).

Context parallelism (``--seq N``, the mesh's ``seq`` axis): each device holds ``seq_len / N`` tokens of its rows,
so every per-token term above is divided by N, and FSDP splits weights over ``data x seq``. Attention adds, per
recomputed layer, the keys and values it gathers: ``ring`` two key chunks and their gradients in flight (``2 x 2
x T/N x kv`` in the compute dtype plus float32 gradients), ``all_gather`` the whole sequence's ``2 x T x kv``; with
``xla`` attention the scores of one block (``T / 2N`` keys for ring, ``T`` for all-gather). The ring's traffic per
device and step is reported too: per layer and row, the forward passes ``(N - 1)`` key-value chunks of ``2 x T/N x
kv x c`` bytes, the backward the same again plus ``N`` float32 key-value gradient chunks (and, with full remat,
the forward once more); all-gather moves ``(N - 1) / N`` of the sequence's keys and values per gather and
reduce-scatter.

The estimate is checked against XLA's compiled memory analysis of the real train step in the tests (CPU,
deterministic); it ignores XLA's fusion choices and workspace, so read it as +-30%.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax

from lcx.parallel import sharding
from lcx.config import ConfigError, ModelConfig
from lcx.parallel.context import check_length
from lcx.config_base import canonical_dtype, dtype_bytes, format_bytes
from lcx.parallel.device_memory import UTILIZATION, usable_bytes
from lcx.model.config import REMAT_POLICIES

REMATS = ("none", *REMAT_POLICIES)
# float32 [T, vocab] arrays alive at the loss: logits, log-softmax, and the gradient flowing back through both.
LOGIT_COPIES = 4


@dataclasses.dataclass(frozen=True)
class TrainPlanInputs:
    """A training run to plan: ``batch`` sequences of ``seq_len`` tokens per step in ``grad_accum`` micro-batches,
    on ``devices`` forming a ``data x seq x model`` mesh; ``remat`` one of ``REMATS``; ``attention`` ``flash`` or
    ``xla``; ``context_parallel`` ``ring`` or ``all_gather`` (used when ``seq > 1``)."""

    model: ModelConfig
    seq_len: int
    batch: int
    gpu_mem_bytes: int
    devices: int = 1
    data: int = 1
    fsdp: bool = False
    remat: str = "none"
    attention: str = "flash"
    compute_dtype: str = "bfloat16"
    grad_accum: int = 1
    utilization: float = UTILIZATION
    seq: int = 1
    context_parallel: str = "ring"

    def __post_init__(self):
        for name in ("seq_len", "batch", "gpu_mem_bytes", "devices", "data", "grad_accum", "seq"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"--{name.replace('_', '-')}={value!r} is invalid: must be a positive integer")
        if self.devices % (self.data * self.seq):
            raise ConfigError(f"--data={self.data} x --seq={self.seq} is invalid: must divide "
                              f"--devices={self.devices}")
        check_length(self.seq_len, self.seq, "--context", "--seq")
        if self.context_parallel not in ("ring", "all_gather"):
            raise ConfigError(f"--context-parallel={self.context_parallel!r} is invalid: must be 'ring' or "
                              "'all_gather'")
        if self.batch % (self.grad_accum * self.data):
            raise ConfigError(f"--batch={self.batch} is invalid: every micro-batch (batch / grad_accum = "
                              f"{self.batch / self.grad_accum:g}) must split evenly over --data={self.data}")
        if self.remat not in REMATS:
            raise ConfigError(f"--remat={self.remat!r} is invalid: must be one of {list(REMATS)}")
        if self.attention not in ("flash", "xla"):
            raise ConfigError(f"--attention={self.attention!r} is invalid: must be 'flash' or 'xla'")
        if self.fsdp and self.data == 1 and self.seq == 1:
            raise ConfigError("--fsdp splits weights over the data (and seq) axes: it needs --data > 1 or --seq > 1")
        object.__setattr__(self, "compute_dtype", canonical_dtype(self.compute_dtype, "--compute-dtype"))

    @property
    def model_axis(self) -> int:
        return self.devices // self.data // self.seq


@functools.lru_cache(maxsize=64)  # the longest-seq_len search asks for the same state many times
def state_bytes_per_device(model: ModelConfig, data: int, model_axis: int, fsdp: bool,
                           seq: int = 1) -> dict[str, int]:
    """Exact ``{"params", "optimizer", "gradients"}`` bytes one device holds: shard shapes of the run's state
    shardings on an abstract mesh (AdamW, float32 master weights)."""
    from lcx.train.config import TrainConfig
    from lcx.train.optim import make_optimizer
    from lcx.train.placement import state_shardings
    from lcx.train.step import state_struct

    mesh = sharding.abstract_mesh(data, model_axis, seq)
    optimizer = make_optimizer(TrainConfig(steps=10))
    arch = dataclasses.replace(model, param_dtype="float32")
    state = state_struct(arch, optimizer)
    shardings = state_shardings(arch, optimizer, state, mesh, fsdp=fsdp)

    def total(tree, sh) -> int:
        return sum(math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize
                   for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(sh)))

    params = total(state.params, shardings.params)
    return {"params": params, "optimizer": total(state.opt_state, shardings.opt_state), "gradients": params}


def activation_bytes_per_device(inputs: TrainPlanInputs) -> int:
    """The activation estimate of the module docstring, per device."""
    m, cfg, n = inputs.model_axis, inputs.model, inputs.seq
    c = dtype_bytes(inputs.compute_dtype)
    rows = inputs.batch // inputs.grad_accum // inputs.data
    tokens = rows * inputs.seq_len // n
    e, f = cfg.d_model, -(-cfg.d_ff // m)
    heads = -(-cfg.n_heads // m)
    q, kv = heads * cfg.head_dim, -(-cfg.n_kv_heads // m) * cfg.head_dim
    full_layer = (4 * e + 3 * q + 3 * kv + 3 * f) * c
    keys = inputs.seq_len if n == 1 or inputs.context_parallel == "all_gather" else inputs.seq_len // (2 * n)
    scores = heads * keys * (8 + c) if inputs.attention == "xla" else heads * 4
    kept = {"none": full_layer + scores, "dots": (2 * e + q + 2 * kv + 2 * f) * c + scores,
            "dots_no_batch": (2 * e + q + 2 * kv + 2 * f) * c, "full": e * c}[inputs.remat]
    layers = cfg.n_layers * tokens * kept
    if inputs.remat in ("full", "dots_no_batch"):  # one layer recomputed at a time, scores included
        layers += tokens * (full_layer + scores)
    if n > 1:  # keys and values in flight (ring: two chunks and their float32 gradients) or gathered (all-gather)
        ring = inputs.context_parallel == "ring"
        in_flight = 2 * (inputs.seq_len // n) * (c + 4) if ring else inputs.seq_len * (c + 4)
        layers += rows * 2 * kv * in_flight
    logits = LOGIT_COPIES * tokens * cfg.vocab_size * 4
    return layers + logits


def ring_bytes_per_step(inputs: TrainPlanInputs) -> int:
    """Bytes one device sends per optimizer step for attention across the ``seq`` axis (0 without one)."""
    n, cfg = inputs.seq, inputs.model
    if n == 1:
        return 0
    c = dtype_bytes(inputs.compute_dtype)
    kv = -(-cfg.n_kv_heads // inputs.model_axis) * cfg.head_dim
    chunk = 2 * (inputs.seq_len // n) * kv  # one device's keys and values, elements
    forwards = 2 if inputs.remat == "full" else 1  # full remat runs each layer's forward again in the backward
    if inputs.context_parallel == "ring":
        per_row = (forwards + 1) * (n - 1) * chunk * c + n * chunk * 4
    else:
        per_row = (forwards * chunk * c + chunk * 4) * (n - 1)
    return cfg.n_layers * (inputs.batch // inputs.data) * per_row


def longest_seq_len(inputs: TrainPlanInputs, limit: int = 1 << 22) -> int:
    """The longest power-of-two ``seq_len`` (>= 128, a multiple of ``2 x seq``) whose step fits; 0 when none does."""
    best, n = 0, max(128, 2 * inputs.seq)
    while n <= limit:
        if train_plan(dataclasses.replace(inputs, seq_len=n), search=False)["fits"]:
            best = n
        else:
            break
        n *= 2
    return best


def train_plan(inputs: TrainPlanInputs, *, search: bool = True) -> dict[str, Any]:
    """Bytes per device (params, optimizer, gradients exact; activations estimated), the total, whether it fits
    ``utilization`` of device memory and (``search``) the longest power-of-two sequence length that would."""
    state = state_bytes_per_device(inputs.model, inputs.data, inputs.model_axis, inputs.fsdp, inputs.seq)
    acts = activation_bytes_per_device(inputs)
    total = state["params"] + state["optimizer"] + state["gradients"] + acts
    usable = usable_bytes(inputs.gpu_mem_bytes, inputs.utilization)
    out = {**state, "activations": acts, "total": total, "usable": usable, "fits": total <= usable,
           "context_parallel_bytes_per_step": ring_bytes_per_step(inputs)}
    if search:
        out["longest_seq_len"] = longest_seq_len(inputs)
    return out


def render_train(inputs: TrainPlanInputs, plan: dict[str, Any], source: str = "") -> str:
    fb, cfg = format_bytes, inputs.model
    mesh = (f"mesh data={inputs.data} x seq={inputs.seq} x model={inputs.model_axis}"
            + (", FSDP" if inputs.fsdp else "")
            + (f", {inputs.context_parallel} attention over seq" if inputs.seq > 1 else ""))
    lines = [
        f"lcx plan --train: {source or 'model'} -- {cfg.num_params() / 1e9:.2f}e9 params, {cfg.n_layers} layers; "
        f"batch {inputs.batch} x seq_len {inputs.seq_len} (grad_accum {inputs.grad_accum}) on {inputs.devices} x "
        f"{fb(inputs.gpu_mem_bytes)} ({mesh})",
        f"params       {fb(plan['params'])} per device (float32 master weights)",
        f"optimizer    {fb(plan['optimizer'])} per device (AdamW moments, float32)",
        f"gradients    {fb(plan['gradients'])} per device",
        f"activations  {fb(plan['activations'])} per device (estimate: {inputs.attention} attention, remat "
        f"{inputs.remat}, {inputs.compute_dtype} compute)",
        f"total        {fb(plan['total'])} of {fb(plan['usable'])} usable ({inputs.utilization:.0%}): "
        f"{'fits' if plan['fits'] else 'does NOT fit'}",
    ]
    if inputs.seq > 1:
        lines.append(f"seq traffic  {fb(plan['context_parallel_bytes_per_step'])} sent per device per step "
                     f"({inputs.context_parallel} attention over seq={inputs.seq})")
    if "longest_seq_len" in plan:
        lines.append(f"longest power-of-two seq_len that fits with these settings: {plan['longest_seq_len'] or 'none'}")
    return "\n".join(lines)


__all__ = ["LOGIT_COPIES", "REMATS", "TrainPlanInputs", "activation_bytes_per_device", "longest_seq_len",
           "render_train", "ring_bytes_per_step", "state_bytes_per_device", "train_plan"]
