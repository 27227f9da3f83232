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
cells whose recorded inputs differ from the current ones (or that are missing). ``results.md`` ends with the
checkpoint it came from.

Modules: ``config`` (``ExperimentConfig``, ``load_experiment``), ``stages`` (each stage and its ``done.json``); this
package runs them in order (``run``) and adds the stage commands to the CLI. Every public name is importable from
``lcx.experiment``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path

import yaml

from lcx.config import ConfigError, to_dict
from lcx.eval.cells import ONE, Shard, stage_lock, write_atomic
from lcx.experiment.config import (STAGES, ExperimentConfig, FinetuneConfig, finetune_data, finetune_sections,
                                   load_experiment, with_checkpoint_model)
from lcx.experiment.stages import (latest_params, run_eval_stage, run_finetune, run_router, run_tokenizer,
                                   run_train, variant_checkpoints)


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


__all__ = ["STAGES", "ExperimentConfig", "FinetuneConfig", "add_parsers", "finetune_data", "finetune_sections",
           "latest_params", "load_experiment", "run", "run_eval_stage", "run_finetune", "run_router",
           "run_tokenizer", "run_train", "variant_checkpoints", "with_checkpoint_model"]
