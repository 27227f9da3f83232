"""Config-driven experiments: one YAML -> train -> finetune -> eval -> ablate, in ``runs/NAME/``.

    lcx run CONFIG [key=value ...]        the stages the config lists (``stages:``), in order
    lcx train | finetune | train-router | eval | ablate CONFIG      one stage
    lcx run | eval | ablate CONFIG --shard I/N     worker I's share of the grids' cells (``lcx.eval.cells``)
    lcx run | eval | ablate CONFIG --merge         the merged results of the cells done so far

Run directory::

    runs/NAME/config.yaml                 the resolved config
    runs/NAME/train/                      metrics.jsonl, checkpoints/ (lcx.train)
    runs/NAME/finetune/                   the same, started from train/ (or finetune.init_from)
    runs/NAME/router/                     a learned memory router distilled from the model (lcx.train.router)
    runs/NAME/eval/, runs/NAME/ablate/    results.csv, results.md, outputs.jsonl, *.png, done.json
    runs/NAME/ablate/cells/<cell>/        one finished grid cell: cell.json (rows, inputs), outputs.jsonl

Evaluating a model without training: ``checkpoint: PATH`` at the top level (a Hugging Face directory, a ``.gguf``
file, or an lcx run / stage directory) with ``stages: [eval]`` or ``[ablate]``. The model section comes from the
checkpoint - keys given under ``model:`` override it (e.g. ``attention``) - and ``data.tokenizer: auto`` (the default,
also without a ``data:`` section) is the checkpoint's own tokenizer.

Rerunning a finished stage reuses its outputs: training resumes from its last checkpoint (nothing to do when it
reached ``steps``), eval, ablate and router are skipped when ``done.json`` records the same inputs - the settings
they read and the exact checkpoint (step and content fingerprint) they evaluated, so more training, a new fine-tune
or a replaced checkpoint reruns them. Within an eval / ablate grid the unit is the cell: a rerun computes only the
cells whose recorded inputs differ from the current ones (or that are missing). ``results.md`` ends with the checkpoint it came from.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from lcx.config import (Config, ConfigError, ModelConfig, RopeConfig, check_cache, from_dict, import_plugins,
                        load_dict, to_dict)
from lcx.config_base import config_fields, unknown_key
from lcx.data.tokenizer import BYTES
from lcx.parallel import context as context_parallel
from lcx.eval.cells import ONE, Shard, stage_lock, write_atomic
from lcx.eval.config import AblateConfig, EvalConfig
from lcx.parallel.sharding import MeshConfig
from lcx.train.config import DataConfig, TrainConfig
from lcx.train.router import RouterConfig

STAGES = ("train", "finetune", "router", "eval", "ablate")


@dataclasses.dataclass(frozen=True)
class FinetuneConfig:
    """Long-context fine-tuning: start from ``init_from`` (null: this run's ``train`` stage; or an lcx run /
    checkpoint or a Hugging Face directory), change ``rope`` (RopeConfig fields, replacing the model's) and
    ``max_position_embeddings``, and continue training with ``train`` / ``data`` overrides of those sections."""

    init_from: str | None = None
    rope: tuple[tuple[str, Any], ...] | None = None
    max_position_embeddings: int | None = None
    train: tuple[tuple[str, Any], ...] = ()
    data: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], prefix: str = "finetune") -> "FinetuneConfig":
        data = dict(data)
        unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            allowed = [f.name for f in dataclasses.fields(cls)]
            raise ConfigError(f"unknown key '{prefix}.{unknown[0]}' (allowed: {allowed})")
        out = {}
        for key in ("rope", "train", "data"):
            value = data.get(key)
            if value is not None and not isinstance(value, Mapping):
                raise ConfigError(f"{prefix}.{key}={value!r} is invalid: must be a mapping")
            if value is not None:
                out[key] = tuple(sorted(value.items()))
        if "rope" in out:
            from_dict(RopeConfig, dict(out["rope"]), prefix=f"{prefix}.rope")
        mpe = data.get("max_position_embeddings")
        if mpe is not None and (not isinstance(mpe, int) or mpe < 1):
            raise ConfigError(f"{prefix}.max_position_embeddings={mpe!r} is invalid: must be a positive integer")
        return cls(init_from=data.get("init_from"), max_position_embeddings=mpe, **out)

    def to_dict(self) -> dict[str, Any]:
        return {"init_from": self.init_from, "rope": None if self.rope is None else dict(self.rope),
                "max_position_embeddings": self.max_position_embeddings, "train": dict(self.train),
                "data": dict(self.data)}


@dataclasses.dataclass(frozen=True)
class ExperimentConfig(Config):
    """The root of an experiment file: the model and cache of ``Config`` plus the stages' sections."""

    stages: tuple[str, ...] = ()
    runs_dir: str = "runs"
    checkpoint: str | None = None
    mesh: MeshConfig | None = None
    train: TrainConfig | None = None
    data: DataConfig | None = None
    finetune: FinetuneConfig | None = None
    router: RouterConfig | None = None
    eval: EvalConfig | None = None
    ablate: AblateConfig | None = None

    def __post_init__(self):
        super().__post_init__()
        bad = [s for s in self.stages if s not in STAGES]
        if bad:
            raise ConfigError(f"stages={list(self.stages)!r} is invalid: {bad[0]!r} is not a stage; allowed: "
                              f"{list(STAGES)}")
        for stage in self.stages:
            self.require(stage)
        if self.finetune is not None and self.data is not None:
            finetune_data(self)  # its task and parameters, now rather than when the stage starts
        if self.ablate is not None and self.eval is not None:
            for i, entry in enumerate(self.ablate.policies):
                extra = sorted(set(dict(entry).get("lengths", ())) - set(self.eval.lengths))
                if extra:
                    raise ConfigError(f"ablate.policies[{i}].lengths has {extra}, not in eval.lengths="
                                      f"{list(self.eval.lengths)}: an entry's lengths are a subset of the grid's")
        if self.ablate is not None:  # every grid cell's policy must work with this model
            for cache in self.ablate.caches(max(self.eval.lengths) if self.eval is not None else 256):
                check_cache(cache, self.model)
        if self.train is not None and self.train.seq_len > self.model.max_position_embeddings:
            raise ConfigError(f"train.seq_len={self.train.seq_len} is invalid: must be <= "
                              f"model.max_position_embeddings={self.model.max_position_embeddings}")
        if self.train is not None and self.mesh is not None:
            context_parallel.check_length(self.train.seq_len, self.mesh.seq, "train.seq_len")

    def require(self, stage: str) -> None:
        """Raise unless the sections ``stage`` needs are present."""
        needs = {"train": ("train", "data"), "finetune": ("finetune",), "router": ("router", "data"),
                 "eval": ("eval",), "ablate": ("eval", "ablate")}[stage]
        missing = [n for n in needs if getattr(self, n) is None]
        if stage == "finetune" and self.finetune is not None and (self.train is None or self.data is None):
            missing += [n for n in ("train", "data") if getattr(self, n) is None]
        if missing:
            raise ConfigError(f"stage {stage!r} needs the config section(s) {missing}")

    @property
    def run_dir(self) -> Path:
        return Path(self.runs_dir) / self.name


def load_experiment(path: str | Path, overrides: Sequence[str] = ()) -> ExperimentConfig:
    """Load and validate an experiment YAML with dotted ``key=value`` overrides."""
    data = load_dict(path, overrides)
    import_plugins(data.get("plugins") or ())
    return from_dict(ExperimentConfig, with_checkpoint_model(data))


def with_checkpoint_model(data: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` whose ``model`` section is the top-level ``checkpoint``'s config with the given ``model:`` keys
    over it (unchanged without a checkpoint)."""
    data = dict(data)
    source = data.get("checkpoint")
    if source is None:
        return data
    if not isinstance(source, str) or not source:
        raise ConfigError(f"checkpoint={source!r} is invalid: a path to a Hugging Face directory, a .gguf file or an "
                          "lcx run / stage directory")
    from lcx.checkpoints.sources import source_config

    given = data.get("model") or {}
    if not isinstance(given, Mapping):
        raise ConfigError(f"model={given!r} is invalid: must be a mapping of keys overriding the checkpoint's")
    base = to_dict(source_config(source))
    data["model"] = _merged(base, given)
    return data


def _merged(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merged(out[key], value) if isinstance(value, Mapping) and isinstance(out.get(key), Mapping) \
            else value
    return out


# --------------------------------------------------------------------------------------------------- stages
def _say(msg: str) -> None:
    print(f"lcx: {msg}", file=sys.stderr, flush=True)


def _mesh(cfg: ExperimentConfig):
    if cfg.mesh is None:
        return None
    return cfg.mesh.make_mesh(n_kv_heads=cfg.model.n_kv_heads, n_heads=cfg.model.n_heads)


def run_train(cfg: ExperimentConfig, progress: bool = True, allow_changes: bool = False):
    from lcx.train import run_training

    cfg.require("train")
    _say(f"train -> {cfg.run_dir / 'train'}")
    return run_training(cfg.model, cfg.train, cfg.data, cfg.run_dir / "train", progress=progress, mesh=_mesh(cfg),
                        allow_changes=allow_changes)


def finetune_sections(cfg: ExperimentConfig) -> tuple[ModelConfig, TrainConfig, DataConfig]:
    """The model, train and data sections of the finetune stage."""
    ft = cfg.finetune
    model = cfg.model
    if ft.rope is not None:
        model = dataclasses.replace(model, rope=from_dict(RopeConfig, dict(ft.rope), prefix="finetune.rope"))
    if ft.max_position_embeddings is not None:
        model = dataclasses.replace(model, max_position_embeddings=ft.max_position_embeddings)
    init_from = ft.init_from or str(cfg.run_dir / "train")
    train = from_dict(TrainConfig, {**to_dict(cfg.train), "init_from": init_from, **dict(ft.train)},
                      prefix="finetune.train")
    return model, train, finetune_data(cfg)


def finetune_data(cfg: ExperimentConfig) -> DataConfig:
    """The finetune stage's data section: ``data`` with ``finetune.data``'s keys over it (messages name
    ``finetune.data``)."""
    given = dict(cfg.finetune.data)
    unknown = sorted(set(given) - {f.name for f in config_fields(DataConfig)})
    if unknown:
        raise unknown_key(unknown[0], f"finetune.data.{unknown[0]}", [f.name for f in config_fields(DataConfig)])
    return DataConfig(**{**{f.name: getattr(cfg.data, f.name) for f in config_fields(DataConfig)}, **given},
                      section="finetune.data")


def run_finetune(cfg: ExperimentConfig, progress: bool = True, allow_changes: bool = False):
    from lcx.train import run_training

    cfg.require("finetune")
    model, train, data = finetune_sections(cfg)
    _say(f"finetune (rope {model.rope.type}, seq_len {train.seq_len}) -> {cfg.run_dir / 'finetune'}")
    return run_training(model, train, data, cfg.run_dir / "finetune", progress=progress, mesh=_mesh(cfg),
                        allow_changes=allow_changes)


def run_router(cfg: ExperimentConfig, progress: bool = True) -> dict:
    """Distil a learned memory router from the run's model (``router:`` and ``data:`` sections)."""
    from lcx.train.router import train_router

    cfg.require("router")
    model, params, info = latest_params(cfg)
    source = info.path
    out_dir = cfg.run_dir / "router"
    tokenizer = run_tokenizer(cfg, model)
    settings = {"stage": "router", "checkpoint": info.to_dict(), "router": to_dict(cfg.router),
                "data": to_dict(cfg.data)}
    if tokenizer.spec != BYTES:  # distilled on byte ids before this fix (CHANGELOG): such a done.json is stale
        settings["prompt_fixes"] = ["router sequences in the run's tokenizer"]
    settings = json.loads(json.dumps(settings, default=str))
    if _done(out_dir, settings):
        _say(f"router: {out_dir} is up to date (delete done.json to rerun)")
        return json.loads((out_dir / "router.json").read_text())["heldout"]
    _say(f"router {source} -> {out_dir}")
    summary = train_router(model, params, cfg.router, cfg.data, out_dir, progress=progress, tokenizer=tokenizer)
    _finish(out_dir, settings)
    _say("router: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in summary.items()))
    return summary


def latest_params(cfg: ExperimentConfig):
    """(model config, params, ``CheckpointInfo``) to evaluate: ``eval.checkpoint``, else the experiment's
    ``checkpoint``, else the run's finetune or train stage (its newest checkpoint that passes verification)."""
    from lcx.train.checkpoint import load_checkpoint_info

    source = cfg.eval.checkpoint if cfg.eval is not None else None
    if source is None and cfg.checkpoint is not None:
        from lcx.checkpoints.sources import load_source

        # the model section already is the checkpoint's, with the experiment's overrides (attention, dtype)
        _, params, info = load_source(cfg.checkpoint, dtype=cfg.model.param_dtype)
        return cfg.model, params, info
    candidates = [Path(source)] if source else [cfg.run_dir / "finetune", cfg.run_dir / "train"]
    for path in candidates:
        if (path / "checkpoints").is_dir() or (source and path.exists()):
            model, params, info = load_checkpoint_info(path)
            # evaluate with the experiment's attention implementation and dtypes of the model section
            model = dataclasses.replace(model, attention=cfg.model.attention, dtype=cfg.model.dtype)
            return model, params, info
    raise ConfigError(f"nothing to evaluate: no checkpoint under {[str(c) for c in candidates]}; run the train stage "
                      "first or set eval.checkpoint")


def variant_checkpoints(cfg: ExperimentConfig) -> dict[str, tuple]:
    """(model, params, ``CheckpointInfo``) of the ablation's RoPE variants that name a ``checkpoint``: a stage of
    this run or a path."""
    from lcx.train.checkpoint import load_checkpoint_info

    out = {}
    for variant in cfg.ablate.ropes if cfg.ablate is not None else ():
        if variant.checkpoint is None:
            continue
        path = cfg.run_dir / variant.checkpoint if variant.checkpoint in STAGES else Path(variant.checkpoint)
        model, params, info = load_checkpoint_info(path)
        model = dataclasses.replace(model, attention=cfg.model.attention, dtype=cfg.model.dtype)
        out[variant.name] = (model, params, info)
    return out


def run_tokenizer(cfg: ExperimentConfig, model: ModelConfig):
    """The tokenizer the evaluation builds and grades its tasks with: ``data.tokenizer`` (default ``auto``: the
    tokenizer of the model evaluated - the experiment's ``checkpoint``, ``eval.checkpoint``, or what this run's
    training recorded - else lcx's byte tokenizer)."""
    from lcx.data.tokenizer import resolve_tokenizer

    setting = cfg.data.tokenizer if cfg.data is not None else "auto"
    source = (cfg.eval.checkpoint if cfg.eval is not None else None) or cfg.checkpoint or cfg.run_dir / "train"
    return resolve_tokenizer(setting, init_from=source, vocab_size=model.vocab_size)


def _check_variant_tokenizers(cfg: ExperimentConfig, variants: dict, tokenizer) -> None:
    """A RoPE variant that evaluates another checkpoint reads the run's prompts: with ``data.tokenizer: auto`` its
    own tokenizer must be the run's (an explicit ``data.tokenizer`` states that it fits every checkpoint)."""
    from lcx.data.tokenizer import describe, resolve_tokenizer

    if (cfg.data.tokenizer if cfg.data is not None else "auto") != "auto":
        return
    for name, (model, _, info) in sorted(variants.items()):
        own = resolve_tokenizer("auto", init_from=info.path, vocab_size=model.vocab_size)
        if own != tokenizer:
            raise ConfigError(f"ablate.ropes variant {name!r} evaluates {info.path}, whose tokenizer is "
                              f"{describe(own)}, not the run's {describe(tokenizer)}: every variant reads the same "
                              "prompts; compare checkpoints of one tokenizer (or set data.tokenizer)")


def _done(out_dir: Path, settings: dict) -> bool:
    marker = out_dir / "done.json"
    return marker.is_file() and json.loads(marker.read_text()) == settings


def _finish(out_dir: Path, settings: dict) -> None:
    write_atomic(out_dir / "done.json", json.dumps(settings, indent=2, sort_keys=True))


def _settings(cfg: ExperimentConfig, stage: str, info, variants: dict | None = None, tokenizer=None) -> dict:
    """What an eval / ablate stage consumes: its settings and the exact checkpoints (step + content fingerprint).

    ``prompt_fixes``: fixes that changed the prompts this stage feeds, recorded only where they did - a done.json
    written before one lacks it, so exactly the stages whose results the fix changed rerun."""
    out = {"stage": stage, "checkpoint": info.to_dict(), "model": to_dict(cfg.model), "eval": cfg.eval.to_dict(),
           "tokenizer": cfg.data.tokenizer if cfg.data is not None else "auto"}
    if cfg.eval.depths and tokenizer is not None and tokenizer.spec != BYTES:
        out["prompt_fixes"] = ["eval.depths in the run's tokenizer"]  # byte ids before (CHANGELOG)
    if tokenizer is not None and _dropped_bos(cfg, tokenizer):
        # BOS first on every prompt before (CHANGELOG); not a prompt fix: the cells that changed say so themselves
        # (their inputs record bos: false), so the others stay done
        out["bos"] = "as the tokenizer adds it"
    if variants:
        out["variant_checkpoints"] = {name: v[2].to_dict() for name, v in sorted(variants.items())}
    out["cache" if stage == "eval" else "ablate"] = (cfg.cache.to_dict() if stage == "eval"
                                                     else cfg.ablate.to_dict())
    return json.loads(json.dumps(out, default=str))


def _dropped_bos(cfg: ExperimentConfig, tokenizer) -> bool:
    """Whether a task of the stage's grid lost the BOS its prompts began with before (``lcx.eval.grid.dropped_bos``)."""
    from lcx.eval.grid import dropped_bos, grid_tasks

    tasks, ppl_task = grid_tasks(cfg.eval, tokenizer)
    return any(dropped_bos(t) for t in (*tasks.values(), ppl_task))


def run_eval_stage(cfg: ExperimentConfig, stage: str = "eval", progress: bool = True, shard: Shard = ONE,
                   merge: bool = False) -> Path:
    """Run (this worker's ``shard`` of) an eval / ablate grid; its cells persist as they finish (a rerun skips the
    done ones) and the worker that finds every cell done writes the merged results and ``done.json``. ``merge``:
    compute nothing, write the merged results of the cells done so far."""
    from lcx.eval.grid import run_ablate, run_eval

    cfg.require(stage)
    model, params, info = latest_params(cfg)
    variants = variant_checkpoints(cfg) if stage == "ablate" else {}
    out_dir = cfg.run_dir / stage
    tokenizer = run_tokenizer(cfg, model)
    settings = _settings(cfg, stage, info, variants, tokenizer)
    if _done(out_dir, settings) and not merge:
        _say(f"{stage}: {out_dir / 'results.md'} is up to date with checkpoint {info.path} (delete done.json to "
             "rerun)")
        return out_dir
    if (out_dir / "done.json").is_file() and not merge:
        _say(f"{stage}: inputs changed since the last run (now checkpoint {info.path}, step {info.step}): rerunning "
             "the cells they touch")
    _say(f"{stage} {info.path} -> {out_dir}" + ("" if shard.count == 1 else f" (shard {shard})"))
    _check_variant_tokenizers(cfg, variants, tokenizer)
    out_dir.mkdir(parents=True, exist_ok=True)
    checkpoints = {"trained": {"step": info.step, "fingerprint": info.fingerprint}}
    checkpoints.update({name: {"step": v[2].step, "fingerprint": v[2].fingerprint} for name, v in variants.items()})
    if cfg.ablate is not None and stage == "ablate":
        checkpoints.update({v.name: checkpoints["trained"] for v in cfg.ablate.ropes if v.name not in checkpoints})
    inputs = {"checkpoints": checkpoints, "prompt_fixes": settings.get("prompt_fixes", [])}
    common = dict(progress=progress, tokenizer=tokenizer, shard=shard, inputs=inputs,
                  footer=_provenance(cfg, info, variants), merge_only=merge)
    if stage == "eval":
        rows = run_eval(model, params, cfg.eval, cfg.cache, out_dir, **common)
    else:
        rows = run_ablate(model, params, cfg.eval, cfg.ablate, out_dir,
                          checkpoints={name: v[:2] for name, v in variants.items()}, **common)
    if rows is not None:  # every cell done: the stage is
        _finish(out_dir, settings)
    if rows is not None or merge:
        print((out_dir / "results.md").read_text())
    return out_dir


def _provenance(cfg: ExperimentConfig, info, variants: dict) -> str:
    """The line results.md ends with: which checkpoint(s) the numbers come from."""
    def name(i):
        try:
            return i.path.relative_to(cfg.run_dir.absolute()).as_posix()
        except ValueError:
            return str(i.path)

    extra = "".join(f"; variant {v}: `{name(c[2])}` (step {c[2].step}, {c[2].fingerprint})"
                    for v, c in sorted(variants.items()))
    return f"\nModel: checkpoint `{name(info)}` (step {info.step}, content {info.fingerprint}){extra}.\n"


def run(cfg: ExperimentConfig, stages: Sequence[str] | None = None, progress: bool = True,
        allow_changes: bool = False, shard: Shard = ONE, merge: bool = False) -> Path:
    """Run ``stages`` (default: the config's ``stages``) in order; returns the run directory. ``allow_changes``:
    training stages resume even with changed settings (recorded in their ``settings.jsonl``).

    ``shard``: this worker's share of the eval / ablate grids (``lcx.eval.cells``); a training stage runs in one
    worker at a time under a lock in the run directory - the first trains, the others wait for it, then find it
    done. ``merge``: only write the merged results of the eval / ablate cells done so far (nothing runs)."""
    stages = list(stages or cfg.stages)
    if not stages:
        raise ConfigError("stages is empty: list the stages to run (e.g. stages: [train, eval, ablate])")
    from lcx.train.loop import make_run_dir

    make_run_dir(cfg.run_dir)
    write_atomic(cfg.run_dir / "config.yaml", yaml.safe_dump(to_dict(cfg), sort_keys=False))
    if merge:
        grids = [s for s in stages if s in ("eval", "ablate")]
        if not grids:
            raise ConfigError(f"--merge merges the cells of eval / ablate stages; stages {stages} have none")
        for stage in grids:
            run_eval_stage(cfg, stage, progress, merge=True)
        return cfg.run_dir
    for stage in stages:
        if stage in ("eval", "ablate"):
            run_eval_stage(cfg, stage, progress, shard)
            continue
        with stage_lock(cfg.run_dir / f".{stage}.lock") if shard.count > 1 else contextlib.nullcontext():
            if stage == "train":
                run_train(cfg, progress, allow_changes)
            elif stage == "finetune":
                run_finetune(cfg, progress, allow_changes)
            else:
                run_router(cfg, progress)
    return cfg.run_dir


# --------------------------------------------------------------------------------------------------- cli
def add_parsers(subparsers) -> None:
    for name, helptext in (("run", "run the stages a config lists (train -> finetune -> eval -> ablate)"),
                           ("train", "run the train stage"), ("finetune", "run the finetune stage"),
                           ("train-router", "distil a learned memory router from the run's model"),
                           ("eval", "run the eval stage"), ("ablate", "run the ablate stage")):
        p = subparsers.add_parser(name, help=helptext, description=helptext)
        p.add_argument("config", metavar="CONFIG", help="experiment YAML")
        p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. train.steps=100")
        p.add_argument("--no-progress", action="store_true", help="no progress bars")
        p.add_argument("--allow-changes", action="store_true",
                       help="resume training with changed train / data settings (recorded per segment of steps)")
        if name in ("run", "eval", "ablate"):
            p.add_argument("--shard", metavar="I/N", default=None,
                           help="run worker I's share (0-based) of N of the grid's cells: N processes or machines "
                                "sharing the run directory split one grid; the last to finish writes the merged "
                                "results")
            p.add_argument("--merge", action="store_true",
                           help="run nothing: write the merged results of the cells done so far")
        p.set_defaults(func=_cli, stage=None if name == "run" else name.replace("train-router", "router"))


def _cli(args) -> int:
    shard = Shard.parse(args.shard) if getattr(args, "shard", None) is not None else ONE
    merge = getattr(args, "merge", False)
    if merge and shard.count > 1:
        raise ConfigError(f"--merge and --shard {shard} are exclusive: --merge runs no cells")
    cfg = load_experiment(args.config, args.overrides)
    run(cfg, None if args.stage is None else [args.stage], progress=not args.no_progress,
        allow_changes=args.allow_changes, shard=shard, merge=merge)
    return 0


__all__ = ["ExperimentConfig", "FinetuneConfig", "STAGES", "add_parsers", "finetune_sections", "latest_params",
           "load_experiment", "run"]
