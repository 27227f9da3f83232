"""The stages of an experiment (``lcx.experiment``): train, finetune, router, and the eval / ablate grids with their
``done.json`` (the settings and exact checkpoints a stage consumed: a rerun with the same ones is skipped).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from lcx.config import ConfigError, ModelConfig, to_dict
from lcx.data.tokenizer import BYTES
from lcx.eval.cells import ONE, Shard, write_atomic
from lcx.experiment.config import STAGES, ExperimentConfig, finetune_sections

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
        out["bos"] = "as the tokenizer adds it" if cfg.eval.bos is None else "eval.bos=false"
    if variants:
        out["variant_checkpoints"] = {name: v[2].to_dict() for name, v in sorted(variants.items())}
    out["cache" if stage == "eval" else "ablate"] = (cfg.cache.to_dict() if stage == "eval"
                                                     else cfg.ablate.to_dict())
    return json.loads(json.dumps(out, default=str))


def _dropped_bos(cfg: ExperimentConfig, tokenizer) -> bool:
    """Whether a task of the stage's grid lost the BOS its prompts began with before
    (``lcx.eval.cell_prompts.dropped_bos``)."""
    from lcx.eval.cell_prompts import dropped_bos, grid_tasks

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


__all__ = ["latest_params", "run_eval_stage", "run_finetune", "run_router", "run_tokenizer", "run_train",
           "variant_checkpoints"]
