"""Typed, frozen configuration of training (``train:``) and its data (``data:``), validated at construction.

Both build with ``lcx.config.from_dict(TrainConfig, d, prefix="train")`` / ``from_dict(DataConfig, d,
prefix="data")``; every invalid value raises ``ConfigError`` naming the key, the value and what is allowed.
The sequence length lives in ``TrainConfig.seq_len`` only (the data pipeline is given it), so the two cannot disagree.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from lcx.config_base import ConfigError, canonical_dtype, config_fields, run_attribute
from lcx.parallel.names import STRATEGIES
from lcx.model.config import REMAT_POLICIES

COMPUTE_DTYPES = ("float32", "bfloat16")


def _int(value: Any, key: str, *, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{key}={value!r} is invalid: must be an integer >= {minimum}")


def _number(value: Any, key: str, low: float, high: float, *, low_open: bool = False,
            high_open: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = ok and (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        lo, hi = "(" if low_open else "[", ")" if high_open else "]"
        raise ConfigError(f"{key}={value!r} is invalid: must be a number in {lo}{low}, {high}{hi}")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimizer, schedule, precision, logging and checkpointing of one training run.

    ``batch_size`` sequences of ``seq_len`` input tokens per optimizer step, processed as ``grad_accum``
    micro-batches of ``batch_size / grad_accum``. Learning rate: linear warmup over ``warmup_steps`` (null: 5% of
    ``steps``) to ``lr``, then cosine decay to ``lr * min_lr_ratio`` at ``steps``. AdamW (``b1``, ``b2``, ``eps``,
    ``weight_decay`` on weight matrices only), after clipping the global gradient norm to ``grad_clip`` (null: no
    clipping).
    Master params and optimizer state are float32; ``compute_dtype`` is the matmul dtype (the model's ``dtype``).
    ``remat``: recompute each layer's activations in the backward pass (null: keep the model config's setting);
    ``remat_policy``: what a recomputed layer keeps (``full``, ``dots``, ``dots_no_batch``; null: the model's).
    ``init_from``: start from an lcx run/checkpoint directory or a Hugging Face directory instead of random params.
    ``resume``: continue from ``run_dir/checkpoints`` when it holds a checkpoint (else such a run_dir is an error).
    ``fsdp``: on a mesh, also split weights and optimizer state over the ``data`` axis (memory per device falls with
    the device count; ``lcx.train.placement``).
    ``context_parallel``: on a mesh with a ``seq`` axis (``mesh: {seq: N}``), how attention crosses it: ``ring``
    (keys and values passed around the ring, per-device memory independent of the sequence's keys) or
    ``all_gather`` (keys and values gathered per layer; faster at moderate lengths) - ``lcx.parallel.context``.
    ``profile_steps: [first, last]``: a ``jax.profiler`` trace of those steps in ``run_dir/profile`` (TensorBoard's
    profile plugin or Perfetto read it).
    """

    steps: int = 1000
    batch_size: int = 32
    seq_len: int = 256
    lr: float = 3e-4
    warmup_steps: int | None = None
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    grad_clip: float | None = 1.0
    grad_accum: int = 1
    compute_dtype: str = "bfloat16"
    remat: bool | None = None
    remat_policy: str | None = None
    seed: int = 0
    log_every: int = 10
    save_every: int = 100
    keep: int = 3
    async_save: bool = True
    init_from: str | None = None
    resume: bool = True
    fsdp: bool = False
    context_parallel: str = "ring"
    profile_steps: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.warmup_steps is None:
            object.__setattr__(self, "warmup_steps", self.steps // 20 if isinstance(self.steps, int) else 0)
        for key, minimum in (("steps", 1), ("batch_size", 1), ("seq_len", 2), ("warmup_steps", 0),
                             ("grad_accum", 1), ("seed", 0), ("log_every", 1), ("save_every", 1), ("keep", 1)):
            _int(getattr(self, key), f"train.{key}", minimum=minimum)
        _number(self.lr, "train.lr", 0.0, 1.0, low_open=True)
        _number(self.min_lr_ratio, "train.min_lr_ratio", 0.0, 1.0)
        _number(self.weight_decay, "train.weight_decay", 0.0, 1.0)
        _number(self.b1, "train.b1", 0.0, 1.0, high_open=True)
        _number(self.b2, "train.b2", 0.0, 1.0, high_open=True)
        _number(self.eps, "train.eps", 0.0, 1.0, low_open=True)
        if self.grad_clip is not None:
            _number(self.grad_clip, "train.grad_clip", 0.0, float("inf"), low_open=True)
        if self.warmup_steps > self.steps:
            raise ConfigError(f"train.warmup_steps={self.warmup_steps} is invalid: must be <= train.steps="
                              f"{self.steps}")
        if self.batch_size % self.grad_accum:
            divisors = [d for d in range(1, self.batch_size + 1) if self.batch_size % d == 0]
            raise ConfigError(f"train.grad_accum={self.grad_accum} is invalid: must divide train.batch_size="
                              f"{self.batch_size} (micro-batches are equal); allowed: {divisors}")
        dtype = canonical_dtype(self.compute_dtype, "train.compute_dtype")
        if dtype not in COMPUTE_DTYPES:
            raise ConfigError(f"train.compute_dtype={self.compute_dtype!r} is invalid: must be one of "
                              f"{list(COMPUTE_DTYPES)} (float16 would need loss scaling, which lcx does not do)")
        object.__setattr__(self, "compute_dtype", dtype)
        if self.profile_steps is not None:
            window = tuple(self.profile_steps) if isinstance(self.profile_steps, (list, tuple)) else ()
            if not (len(window) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in window)
                    and 1 <= window[0] <= window[1] <= self.steps):
                raise ConfigError(f"train.profile_steps={self.profile_steps!r} is invalid: must be [first, last] "
                                  f"with 1 <= first <= last <= train.steps={self.steps}, or null")
            object.__setattr__(self, "profile_steps", window)
        if self.context_parallel not in STRATEGIES:
            raise ConfigError(f"train.context_parallel={self.context_parallel!r} is invalid: must be one of "
                              f"{list(STRATEGIES)}")
        if self.remat_policy is not None and self.remat_policy not in REMAT_POLICIES:
            raise ConfigError(f"train.remat_policy={self.remat_policy!r} is invalid: must be one of "
                              f"{list(REMAT_POLICIES)} or null (the model's)")

    @property
    def micro_batch_size(self) -> int:
        return self.batch_size // self.grad_accum


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """What to train on: ``task`` (a name in ``lcx.data.task_names()``) with its ``params`` (that task's fields).

    ``seed``: the data seed (null: ``train.seed``); batch i is a pure function of (seed, i).
    ``prompt_loss_weight``: loss weight of non-answer tokens (0: the loss is on answer tokens only); ignored by
    ``corpus`` and ``documents``, where every token is a target.
    ``tokenizer``: ``auto`` (the tokenizer of ``train.init_from``'s model - a Hugging Face directory's
    ``tokenizer.json`` or what an lcx run recorded - else bytes), ``bytes``, or a path to a ``tokenizer.json`` (or
    a directory holding one); see ``lcx.data.tokenizer``. The synthetic tasks are byte-level only.
    ``section``: where the values were set (``data``; ``finetune.data`` for the finetune stage's), which messages
    name - not a config key.
    """

    task: str = "passkey"
    params: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    seed: int | None = None
    prompt_loss_weight: float = 0.0
    tokenizer: str = "auto"
    section: str = run_attribute("data", compare=False)

    def __post_init__(self):
        if not isinstance(self.params, Mapping):
            raise ConfigError(f"{self.section}.params={self.params!r} is invalid: must be a mapping of task "
                              "parameters")
        # Frozen and hashable like the other configs: params are kept as sorted (key, value) pairs.
        object.__setattr__(self, "params", _FrozenParams(self.params))
        if self.seed is not None:
            _int(self.seed, f"{self.section}.seed", minimum=0)
        _number(self.prompt_loss_weight, f"{self.section}.prompt_loss_weight", 0.0, 1.0)
        if not isinstance(self.tokenizer, str) or not self.tokenizer:
            raise ConfigError(f"{self.section}.tokenizer={self.tokenizer!r} is invalid: must be 'auto', 'bytes' or a "
                              "path to a tokenizer.json")
        task = self.make_task()  # validates the name and the parameters now, not at the first batch
        if self.tokenizer not in ("auto", "bytes"):
            from lcx.data.tokenizer import resolve_tokenizer

            task.with_tokenizer(resolve_tokenizer(self.tokenizer))  # the file and the task's support, now

    def make_task(self):
        from lcx.data import make_task

        return make_task(self.task, dict(self.params), prefix=f"{self.section}.params")

    def to_dict(self) -> dict[str, Any]:
        return {"task": self.task, "params": _thaw(self.params), "seed": self.seed,
                "prompt_loss_weight": self.prompt_loss_weight, "tokenizer": self.tokenizer}


class _FrozenParams(Mapping):
    """A read-only, hashable mapping (task parameters inside a frozen config)."""

    def __init__(self, data: Mapping[str, Any]):
        self._items = tuple(sorted((str(k), _freeze(v)) for k, v in data.items()))

    def __getitem__(self, key):
        return dict(self._items)[key]

    def __iter__(self):
        return iter(k for k, _ in self._items)

    def __len__(self):
        return len(self._items)

    def __hash__(self):
        return hash(self._items)

    def __eq__(self, other):
        return isinstance(other, Mapping) and dict(self._items) == dict(other)

    def __repr__(self):
        return repr(dict(self._items))


def _freeze(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, Mapping):
        return _FrozenParams(value)
    return value


def _thaw(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _thaw(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_thaw(v) for v in value]
    return value


__all__ = ["COMPUTE_DTYPES", "DataConfig", "TrainConfig"]
