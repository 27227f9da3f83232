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
    """``cls`` from ``data`` whose ``params`` (the task's parameters, any mapping) become a sorted tuple of pairs -
    given to the constructor with the other keys, so the task is validated once, with its parameters."""
    data = dict(data)
    params = data.pop("params", None) or {}
    if not isinstance(params, Mapping):
        raise ConfigError(f"{prefix}.params={params!r} is invalid: must be a mapping of task parameters")
    odd = [k for k in params if not isinstance(k, str)]
    if odd:
        raise ConfigError(f"{prefix}.params has the key {odd[0]!r}: parameter names are strings")
    return from_dict(cls, data, prefix=prefix, attributes={"params": tuple(sorted(params.items()))})


@dataclasses.dataclass(frozen=True)
class PerplexityConfig:
    """``eval.perplexity``: perplexity on held-out text (a task whose every token is a target: ``prose`` or your
    own ``documents`` in any tokenizer, ``corpus`` in lcx's bytes) at the same lengths, measured next to the
    retrieval task: ``samples`` windows, the first ``prefix`` tokens (null: half the length) prefilled, the rest scored
    one token at a time through the cache (StreamingLLM protocol). A ``documents`` window is a stretch of the
    validation documents' token stream (each ``BOS text EOS``), so documents shorter than the length share a window
    and the later ones are read with the earlier ones in context.

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
class SpeculativeEvalConfig:
    """``eval.speculative``: beside each retrieval cell's accuracy under its cache, that cache's acceptance as the
    draft of self-speculative decoding for the full cache on the same prompts (``lcx.eval.acceptance``): ``k``
    draft tokens per verification."""

    k: int = 4

    def __post_init__(self):
        from lcx.engine.speculative import MAX_K

        if isinstance(self.k, bool) or not isinstance(self.k, int) or not 1 <= self.k <= MAX_K:
            raise ConfigError(f"eval.speculative.k={self.k!r} is invalid: must be an integer in [1, {MAX_K}]")

    def to_dict(self) -> dict[str, Any]:
        return {"k": self.k}


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """What to measure: a retrieval ``task`` (passkey, niah, mqar, a RULER-style task -> accuracy) or a text task
    (corpus, prose, documents -> perplexity), at each context length in ``lengths`` and needle depth in ``depths``
    (null: a random depth per example), over ``samples`` examples per depth drawn from the validation split with
    ``seed``. ``params`` are the task's parameters. ``tasks``: several retrieval tasks instead of one, each with its
    defaults (``ruler``: the RULER-style suite, ``lcx.data.ruler.RULER_SUITE``); results per task and their macro
    average. ``chat``: prompts framed in the tokenizer's chat template, the answer prefix opening the reply.
    ``bos``: whether a retrieval prompt (plain, not chat) begins with the BOS id - null (the default): as the
    tokenizer adds it to a text (a GGUF's ``add_bos_token``, a tokenizer.json's post-processor); true / false force it
    (results from before lcx followed the tokenizer put BOS first on every prompt: ``bos: true`` reproduces them).
    ``eval.perplexity``'s windows have their own ``bos`` parameter.
    ``unroll``: ``Generator(unroll=)`` (null: auto, the unrolled decoder when its weight copy fits): the unrolled
    decoder's steps are faster on a CPU, but each cache setting compiles about 3x longer (a 30-layer model on 2 cores:
    ~45 s against ~15 s per setting), so a grid of many settings on a CPU finishes sooner with ``false``.
    ``perplexity`` (optional): perplexity on held-out text measured next to it. ``speculative`` (optional,
    ``{k: 4}``): each retrieval cell whose cache can draft also measures its acceptance as a draft for the full
    cache (``SpeculativeEvalConfig``; results.csv ``accept``, ``accept_lo``, ``accept_hi``).

    Lengths are in the run tokenizer's tokens (``data.tokenizer``; a checkpoint's own by default).

    Perplexity under a cache policy: the first ``ppl_prefix`` tokens (null: half the length) are prefilled, the
    rest are scored one token at a time through the cache and its eviction schedule (StreamingLLM protocol).
    ``ppl_buckets`` (positions, ascending): perplexity as the context grows, from one pass per window - each
    length's window is scored from ``ppl_prefix`` on, and each bucket's row (``length`` = its end) is the perplexity
    of the positions since the previous bucket, so one long stream gives the StreamingLLM curve.
    """

    task: str = "passkey"
    params: tuple[tuple[str, Any], ...] = ()
    tasks: tuple[str, ...] = ()
    lengths: tuple[int, ...] = (256,)
    depths: tuple[float, ...] | None = None
    samples: int = 16
    batch_size: int = 16
    seed: int = 1234
    max_new_tokens: int | None = None
    ppl_prefix: int | None = None
    ppl_buckets: tuple[int, ...] = ()
    chat: bool = False
    bos: bool | None = None
    unroll: bool | None = None
    checkpoint: str | None = None  # params to evaluate (null: the run's latest stage)
    perplexity: PerplexityConfig | None = None
    speculative: SpeculativeEvalConfig | None = None

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
        if self.ppl_buckets and (list(self.ppl_buckets) != sorted(set(self.ppl_buckets))
                                 or self.ppl_buckets[-1] > max(self.lengths) or self.ppl_buckets[0] < 1):
            raise ConfigError(f"eval.ppl_buckets={list(self.ppl_buckets)!r} is invalid: ascending positions, the "
                              f"last at most max(eval.lengths)={max(self.lengths)}")
        if self.bos is not None and not isinstance(self.bos, bool):
            raise ConfigError(f"eval.bos={self.bos!r} is invalid: true, false or null (as the tokenizer adds it)")
        if self.bos is not None and self.chat:
            raise ConfigError(f"eval.bos={str(self.bos).lower()} cannot be combined with eval.chat=true: a chat "
                              "prompt begins with what the chat template writes; set eval.bos=null")
        if self.tasks and self.params:
            raise ConfigError(f"eval.params={dict(self.params)!r} cannot be combined with eval.tasks="
                              f"{list(self.tasks)!r}: each of several tasks runs with its own defaults")
        metrics = {name: task.metric for name, task in self.make_tasks().items()}  # unknown task or parameter: now
        if self.bos is not None and "perplexity" in metrics.values():
            raise ConfigError(f"eval.bos={str(self.bos).lower()} is invalid with eval.task={self.task!r}: it sets the "
                              "BOS of retrieval prompts; perplexity windows take their task's own parameter "
                              "(eval.params.bos for prose)")
        if len(metrics) > 1 and "perplexity" in metrics.values():
            raise ConfigError(f"eval.tasks={list(self.tasks)!r} is invalid: several tasks must all be retrieval "
                              "tasks; measure perplexity with eval.perplexity")
        if self.perplexity is not None and "perplexity" in metrics.values():
            given = f"eval.tasks={list(self.tasks)!r}" if self.tasks else f"eval.task={self.task!r}"
            raise ConfigError(f"eval.perplexity is set, but {given} already measures perplexity: eval.perplexity "
                              "measures it next to a retrieval task (set the text task as eval.task with its params, "
                              "or a retrieval task here)")
        # perplexity windows must leave tokens to score at every length: checked now, naming the key
        shortest = min(self.lengths)
        for key, value in (("eval.ppl_prefix", self.ppl_prefix),
                           ("eval.perplexity.prefix", self.perplexity and self.perplexity.prefix),
                           ("eval.perplexity.tail", self.perplexity and self.perplexity.tail)):
            if value is not None and not 0 < value < shortest:
                raise ConfigError(f"{key}={value!r} is invalid: must be in [1, {shortest - 1}] (below the shortest "
                                  f"of eval.lengths={list(self.lengths)})")

    @property
    def metric(self) -> str:
        return next(iter(self.make_tasks().values())).metric

    def task_names(self) -> tuple[str, ...]:
        """The tasks to run: ``tasks`` (``ruler`` expanded to the suite) or the one ``task``."""
        if not self.tasks:
            return (self.task,)
        from lcx.data.ruler import RULER_SUITE

        return tuple(dict.fromkeys(n for t in self.tasks for n in (RULER_SUITE if t == "ruler" else (t,))))

    def make_tasks(self) -> dict[str, Any]:
        """name -> task, in order (``task`` with ``params``, or each of ``tasks`` with its defaults)."""
        from lcx.data import make_task

        if not self.tasks:
            return {self.task: make_task(self.task, dict(self.params), prefix="eval.params")}
        from lcx.data.ruler import RULER_SUITE

        keys = {}  # each task's place in the list (the suite's tasks: the place of ``ruler``)
        for i, entry in enumerate(self.tasks):
            for name in (RULER_SUITE if entry == "ruler" else (entry,)):
                keys.setdefault(name, f"eval.tasks[{i}]")
        return {name: make_task(name, {}, prefix="eval.params", name_key=keys[name]) for name in self.task_names()}

    def make_task(self):
        return next(iter(self.make_tasks().values()))

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
        out["speculative"] = None if self.speculative is None else self.speculative.to_dict()
        if self.bos is None:  # the default: a stage's done.json from before the key existed stays done
            del out["bos"]
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


PROTOCOLS = ("streaming", "one_shot")
# Keys of an ablate.policies entry that place it in the grid rather than configure its cache.
ENTRY_KEYS = ("ropes", "lengths", "samples")


@dataclasses.dataclass(frozen=True)
class Setting:
    """One row of an ablation before its length is known: a cache section, its budget or compression ratio, and
    how the prompt meets the cache (``protocol``). ``ropes`` / ``lengths``: the RoPE variants and context lengths
    this row runs at (None: all of the grid's); ``samples``: its retrieval prompts per cell (None: ``eval.samples``;
    the first n prompts are the same at any n, so a costly row on fewer prompts is paired with the others').
    """

    spec: tuple[tuple[str, Any], ...]
    budget: int | None = None
    compression: float | None = None
    protocol: str = "streaming"
    ropes: tuple[str, ...] | None = None
    lengths: tuple[int, ...] | None = None
    samples: int | None = None

    def runs(self, rope: str, length: int) -> bool:
        """Whether the grid has this row's cell at RoPE variant ``rope`` and ``length`` tokens."""
        return (self.ropes is None or rope in self.ropes) and (self.lengths is None or length in self.lengths)

    @property
    def policy(self) -> str:
        return dict(self.spec).get("policy", "full")

    def cache(self, length: int, room: int = 0) -> CacheConfig:
        """The cache of a cell of ``length`` tokens. A compression ratio keeps ``round((1 - c) * length)`` tokens;
        ``one_shot`` takes the whole context in one prefill call and leaves ``room`` slots (question and answer)
        after the compression, so nothing is evicted after it (``interval`` = the length + ``room``)."""
        spec = dict(self.spec)
        if self.policy == "full":
            return CacheConfig.from_mapping({**spec, "budget": self.budget}, prefix="ablate")
        budget = self.budget if self.compression is None else max(1, round((1.0 - self.compression) * length))
        if self.compression is not None:  # a policy whose compression is not its budget (DuoAttention's head share)
            spec.update(CacheConfig.from_mapping({**spec, "budget": length}, prefix="ablate").make_policy()
                        .at_compression(self.compression, length))
            budget = spec.pop("budget", budget)
        if self.protocol == "one_shot":
            spec["interval"] = length + room
            spec["prefill_chunk"] = 1 << max(length - 1, 1).bit_length()  # the whole context in one call
        return CacheConfig.from_mapping({**spec, "budget": budget}, prefix="ablate")


@dataclasses.dataclass(frozen=True)
class AblateConfig:
    """The grid: each entry of ``policies`` (a cache section without budget: ``{policy: streaming, sinks: 4}``) at
    each of ``budgets`` - or each compression ratio of ``compressions`` (the share of a cell's tokens evicted: 0.75
    keeps a quarter of the length) - in each of ``protocols`` (``streaming``: the prompt through the cache in chunks
    with evictions between them; ``one_shot``: kvpress's protocol - the context prefilled at once, compressed once,
    the question read after it), x each RoPE variant in ``ropes`` x the eval lengths and depths (``full``: once)."""

    policies: tuple[tuple[tuple[str, Any], ...], ...] = ((("policy", "full"),),)
    budgets: tuple[int, ...] = (64,)
    compressions: tuple[float, ...] = ()
    protocols: tuple[str, ...] = ("streaming",)
    ropes: tuple[RopeVariant, ...] = (RopeVariant("trained"),)
    interval: int = 32
    prefill_chunk: int = 256

    def __post_init__(self):
        _positive_ints(self.budgets, "ablate.budgets")
        if any(not 0.0 < c < 1.0 for c in self.compressions):
            raise ConfigError(f"ablate.compressions={list(self.compressions)!r} is invalid: ratios in (0, 1) (the "
                              "share of the context evicted)")
        if not self.protocols or any(p not in PROTOCOLS for p in self.protocols):
            raise ConfigError(f"ablate.protocols={list(self.protocols)!r} is invalid: a non-empty list of "
                              f"{list(PROTOCOLS)}")
        for name in ("interval", "prefill_chunk"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"ablate.{name}={value!r} is invalid: must be a positive integer")
        for setting in self.settings():  # unknown policies or parameters fail at load
            policy = CacheConfig.from_mapping({**dict(setting.spec), "budget": 1 << 20}, prefix="ablate").make_policy()
            if setting.protocol == "streaming" and getattr(policy, "reconstructs", False):
                raise ConfigError(f"ablate.policies entry {setting.policy!r} with protocol 'streaming': it scores the "
                                  "whole prompt once after prefill (a stream evicts between chunks); allowed: "
                                  "ablate.protocols [one_shot]")
            try:
                setting.cache(256).make_policy()
            except ConfigError:
                if setting.compression is None:
                    raise
                # a ratio only longer cells can take (DuoAttention's window): the grid checks each length before
                # anything runs
                setting.cache(1 << 20).make_policy()

    def settings(self) -> list[Setting]:
        """Every row of the grid: (policy, budget or compression, protocol); ``full`` once. A policy entry may set
        its own ``interval`` and ``prefill_chunk`` (e.g. a memory tier whose local positions must stay in range),
        restrict itself to some RoPE variants (``ropes: [names]``) and lengths (``lengths: [...]``, a subset of
        ``eval.lengths``), and run fewer (or more) prompts per cell (``samples: n``; the first n of the same
        prompts)."""
        out = []
        for entry in self.policies:
            grid = {k: v if k == "samples" else tuple(v) for k, v in entry if k in ENTRY_KEYS}
            spec = tuple(sorted({"interval": self.interval, "prefill_chunk": self.prefill_chunk,
                                 **{k: v for k, v in entry if k not in ENTRY_KEYS}}.items()))
            if dict(spec).get("policy", "full") == "full":
                out.append(Setting(tuple((k, v) for k, v in spec if k != "interval"), **grid))
                continue
            for protocol in self.protocols:
                if self.compressions:
                    out += [Setting(spec, compression=c, protocol=protocol, **grid) for c in self.compressions]
                else:
                    out += [Setting(spec, budget=b, protocol=protocol, **grid) for b in self.budgets]
        return out

    def caches(self, length: int | None = None) -> list[CacheConfig]:
        """Every row's cache for cells of ``length`` tokens."""
        if length is None:  # the argument was added with ablate.compressions
            raise TypeError("AblateConfig.caches(length) takes the cells' length in tokens: a setting of "
                            "ablate.compressions sizes its budget by it (call .settings() for the rows themselves)")
        return [s.cache(length) for s in self.settings()]

    @classmethod
    def of_cache(cls, cache: CacheConfig) -> Setting:
        """The setting of one cache section (the eval stage's)."""
        data = cache.to_dict()
        budget = data.pop("budget")
        return Setting(tuple(sorted(data.items())), budget=tuple(budget) if isinstance(budget, list) else budget)

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
        names = [v.name for v in variants]
        for i, entry in enumerate(entries):
            given = dict(entry)
            if "ropes" in given and (not isinstance(given["ropes"], Sequence) or isinstance(given["ropes"], str)
                                     or not given["ropes"] or any(r not in names for r in given["ropes"])):
                raise ConfigError(f"{prefix}.policies[{i}].ropes={given['ropes']!r} is invalid: a non-empty list of "
                                  f"the names in {prefix}.ropes {names}")
            if "lengths" in given:
                lengths = given["lengths"]
                if isinstance(lengths, str) or not isinstance(lengths, Sequence):
                    raise ConfigError(f"{prefix}.policies[{i}].lengths={lengths!r} is invalid: a non-empty list of "
                                      "context lengths from eval.lengths")
                _positive_ints(lengths, f"{prefix}.policies[{i}].lengths")
            samples = given.get("samples", 1)
            if not isinstance(samples, int) or isinstance(samples, bool) or samples < 1:
                raise ConfigError(f"{prefix}.policies[{i}].samples={samples!r} is invalid: a positive integer (this "
                                  "entry's prompts per cell; default eval.samples)")
            entries[i] = tuple((k, tuple(v) if k in ("ropes", "lengths") else v) for k, v in entry)
        built = from_dict(cls, data, prefix=prefix)
        return dataclasses.replace(built, policies=tuple(entries), ropes=variants)

    def to_dict(self) -> dict[str, Any]:
        return {"policies": [{k: list(v) if k in ("ropes", "lengths") else v for k, v in p} for p in self.policies],
                "budgets": list(self.budgets),
                "compressions": list(self.compressions), "protocols": list(self.protocols),
                "ropes": [{"name": r.name, **dict(r.rope),
                           **({"max_position_embeddings": r.max_position_embeddings}
                              if r.max_position_embeddings else {}),
                           **({"checkpoint": r.checkpoint} if r.checkpoint else {})} for r in self.ropes],
                "interval": self.interval, "prefill_chunk": self.prefill_chunk}
