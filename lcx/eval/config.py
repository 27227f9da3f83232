"""Evaluation and ablation settings (the ``eval:`` and ``ablate:`` sections of an experiment config)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from lcx.config import CacheConfig, ConfigError, RopeConfig, from_dict


def _positive_ints(values: Sequence[int], key: str) -> None:
    if not values or any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in values):
        raise ConfigError(f"{key}={list(values)!r} is invalid: must be a non-empty list of positive integers")


def _with_task_params(cls, data: Mapping[str, Any], prefix: str):
    """``cls`` from ``data`` whose ``params`` (the task's parameters, any mapping) become a sorted tuple of pairs."""
    data = dict(data)
    params = data.pop("params", None) or {}
    if not isinstance(params, Mapping):
        raise ConfigError(f"{prefix}.params={params!r} is invalid: must be a mapping of task parameters")
    return dataclasses.replace(from_dict(cls, data, prefix=prefix), params=tuple(sorted(params.items())))


@dataclasses.dataclass(frozen=True)
class PerplexityConfig:
    """``eval.perplexity``: perplexity on held-out text (a task whose every token is a target, e.g. ``corpus``) at
    the same lengths, measured next to the retrieval task: ``samples`` windows, the first ``prefix`` tokens (null:
    half the length) prefilled, the rest scored one token at a time through the cache (StreamingLLM protocol).

    ``tail``: score the same last ``tail`` tokens at every length - each length's window is the end of the same
    longest window (BOS first when the task's windows start with it) - so the lengths differ only in how much
    history precedes the scored text, not in which text is scored."""

    task: str = "corpus"
    params: tuple[tuple[str, Any], ...] = ()
    samples: int = 16
    batch_size: int = 16
    prefix: int | None = None
    tail: int | None = None

    def __post_init__(self):
        if isinstance(self.params, Mapping):
            object.__setattr__(self, "params", tuple(sorted(self.params.items())))
        for name in ("samples", "batch_size", "tail"):
            value = getattr(self, name)
            if name == "tail" and value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"eval.perplexity.{name}={value!r} is invalid: must be a positive integer")
        if self.tail is not None and self.prefix is not None:
            raise ConfigError("eval.perplexity.tail and eval.perplexity.prefix are exclusive: tail scores the last "
                              "tail tokens of every length, prefix prefills a fixed number")
        from lcx.data import make_task

        make_task(self.task, dict(self.params), prefix="eval.perplexity.params")

    def make_task(self):
        from lcx.data import make_task

        return make_task(self.task, dict(self.params), prefix="eval.perplexity.params")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], prefix: str = "eval.perplexity") -> "PerplexityConfig":
        return _with_task_params(cls, data, prefix)

    def to_dict(self) -> dict[str, Any]:
        return {**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}, "params": dict(self.params)}


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """What to measure: a retrieval ``task`` (passkey, niah, mqar -> accuracy) or ``corpus`` (-> perplexity), at each
    context length in ``lengths`` and needle depth in ``depths`` (null: a random depth per example), over
    ``samples`` examples per depth drawn from the validation split with ``seed``. ``params`` are the task's
    parameters. ``perplexity`` (optional): perplexity on held-out text measured next to it.

    Perplexity under a cache policy: the first ``ppl_prefix`` tokens (null: half the length) are prefilled, the
    rest are scored one token at a time through the cache and its eviction schedule (StreamingLLM protocol).
    """

    task: str = "passkey"
    params: tuple[tuple[str, Any], ...] = ()
    lengths: tuple[int, ...] = (256,)
    depths: tuple[float, ...] | None = None
    samples: int = 16
    batch_size: int = 16
    seed: int = 1234
    max_new_tokens: int | None = None
    ppl_prefix: int | None = None
    checkpoint: str | None = None  # params to evaluate (null: the run's latest stage)
    perplexity: PerplexityConfig | None = None

    def __post_init__(self):
        if isinstance(self.params, Mapping):
            object.__setattr__(self, "params", tuple(sorted(self.params.items())))
        _positive_ints(self.lengths, "eval.lengths")
        if self.depths is not None and any(not 0.0 <= d <= 1.0 for d in self.depths):
            raise ConfigError(f"eval.depths={list(self.depths)!r} is invalid: depths are fractions in [0, 1]")
        for name in ("samples", "batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"eval.{name}={value!r} is invalid: must be a positive integer")
        if self.samples % self.batch_size and self.samples > self.batch_size:
            raise ConfigError(f"eval.samples={self.samples} is invalid: must be a multiple of eval.batch_size="
                              f"{self.batch_size} (batches share one compiled shape)")
        from lcx.data import make_task

        make_task(self.task, dict(self.params), prefix="eval.params")  # unknown task or parameter: fail at load

    @property
    def metric(self) -> str:
        return "perplexity" if self.task == "corpus" else "accuracy"

    def make_task(self):
        from lcx.data import make_task

        return make_task(self.task, dict(self.params), prefix="eval.params")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], prefix: str = "eval") -> "EvalConfig":
        return _with_task_params(cls, data, prefix)

    def metrics(self) -> tuple[str, ...]:
        """The metrics this evaluation reports: the task's, then perplexity when ``perplexity`` is set."""
        return (self.metric,) + (("perplexity",) if self.perplexity is not None else ())

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["params"] = dict(self.params)
        out["perplexity"] = None if self.perplexity is None else self.perplexity.to_dict()
        return out


@dataclasses.dataclass(frozen=True)
class RopeVariant:
    """A RoPE setting to evaluate with: ``name`` for the tables, and RopeConfig fields to override (none: as
    trained). ``max_position_embeddings`` overrides the model's (dynamic NTK scales beyond it). ``checkpoint``: the
    params to evaluate for this variant instead of the stage's - a stage name of the run (``train``, ``finetune``)
    or a checkpoint path - with that checkpoint's own RoPE (e.g. a model fine-tuned with YaRN next to the
    original's raw extrapolation and dynamic NTK)."""

    name: str
    rope: tuple[tuple[str, Any], ...] = ()
    max_position_embeddings: int | None = None
    checkpoint: str | None = None

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], prefix: str) -> "RopeVariant":
        data = dict(data)
        if "name" not in data:
            raise ConfigError(f"{prefix}.name is missing: every rope variant needs a name (e.g. 'trained', 'yarn4')")
        name, mpe = data.pop("name"), data.pop("max_position_embeddings", None)
        checkpoint = data.pop("checkpoint", None)
        if checkpoint is not None and not isinstance(checkpoint, str):
            raise ConfigError(f"{prefix}.checkpoint={checkpoint!r} is invalid: a stage name or a checkpoint path")
        from_dict(RopeConfig, data, prefix=f"{prefix}")  # validate now
        return cls(name=str(name), rope=tuple(sorted(data.items())), max_position_embeddings=mpe,
                   checkpoint=checkpoint)

    def apply(self, model):
        if not self.rope and self.max_position_embeddings is None:
            return model
        rope = from_dict(RopeConfig, {**dataclasses.asdict(model.rope), **dict(self.rope)}, prefix="rope")
        mpe = self.max_position_embeddings or model.max_position_embeddings
        return dataclasses.replace(model, rope=rope, max_position_embeddings=mpe)


@dataclasses.dataclass(frozen=True)
class AblateConfig:
    """The grid: each entry of ``policies`` (a cache section without budget: ``{policy: streaming, sinks: 4}``) at
    each of ``budgets`` (ignored by ``full``) x each RoPE variant in ``ropes`` x the eval lengths and depths."""

    policies: tuple[tuple[tuple[str, Any], ...], ...] = ((("policy", "full"),),)
    budgets: tuple[int, ...] = (64,)
    ropes: tuple[RopeVariant, ...] = (RopeVariant("trained"),)
    interval: int = 32
    prefill_chunk: int = 256

    def __post_init__(self):
        _positive_ints(self.budgets, "ablate.budgets")
        for name in ("interval", "prefill_chunk"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"ablate.{name}={value!r} is invalid: must be a positive integer")
        for cache in self.caches():  # unknown policies or parameters fail at load
            cache.make_policy()

    def caches(self) -> list[CacheConfig]:
        """Every (policy, budget) cell as a CacheConfig; ``full`` once, without a budget. A policy entry may set its
        own ``interval`` and ``prefill_chunk`` (e.g. a memory tier whose local positions must stay in range)."""
        out = []
        for entry in self.policies:
            spec = {"interval": self.interval, "prefill_chunk": self.prefill_chunk, **dict(entry)}
            if spec.get("policy", "full") == "full":
                spec.pop("interval")
                out.append(CacheConfig.from_mapping(spec, prefix="ablate"))
                continue
            for budget in self.budgets:
                out.append(CacheConfig.from_mapping({**spec, "budget": budget}, prefix="ablate"))
        return out

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], prefix: str = "ablate") -> "AblateConfig":
        data = dict(data)
        policies = data.pop("policies", [{"policy": "full"}])
        if isinstance(policies, (str, Mapping)) or not isinstance(policies, Sequence):
            raise ConfigError(f"{prefix}.policies={policies!r} is invalid: must be a list of cache sections")
        entries = []
        for i, p in enumerate(policies):
            p = {"policy": p} if isinstance(p, str) else p
            if not isinstance(p, Mapping) or "budget" in p:
                raise ConfigError(f"{prefix}.policies[{i}]={p!r} is invalid: a mapping like {{policy: streaming, "
                                  f"sinks: 4}}; budgets come from {prefix}.budgets")
            entries.append(tuple(sorted(p.items())))
        ropes = data.pop("ropes", [{"name": "trained"}])
        variants = tuple(RopeVariant.from_mapping(r, f"{prefix}.ropes[{i}]") for i, r in enumerate(ropes))
        built = from_dict(cls, data, prefix=prefix)
        return dataclasses.replace(built, policies=tuple(entries), ropes=variants)

    def to_dict(self) -> dict[str, Any]:
        return {"policies": [dict(p) for p in self.policies], "budgets": list(self.budgets),
                "ropes": [{"name": r.name, **dict(r.rope),
                           **({"max_position_embeddings": r.max_position_embeddings}
                              if r.max_position_embeddings else {}),
                           **({"checkpoint": r.checkpoint} if r.checkpoint else {})} for r in self.ropes],
                "interval": self.interval, "prefill_chunk": self.prefill_chunk}
