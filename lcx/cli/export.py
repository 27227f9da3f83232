"""``lcx export RUN --hf DIR``: an lcx run's checkpoint as a directory transformers loads (config.json + safetensors).

RUN is a run directory (``runs/NAME``: its ``finetune`` stage if it has one, else ``train``), a stage directory or a
checkpoint directory; ``--step`` picks a checkpoint (default: the latest). The weights are written in the model's
``param_dtype`` (float32 for lcx training runs) by ``lcx.checkpoints.hf.save_hf``. A run trained with a Hugging Face
tokenizer
(``data.tokenizer``) gets its ``tokenizer.json`` (and the ``tokenizer_config.json`` / ``special_tokens_map.json``
beside it) copied along; lcx's byte tokenizer has no transformers equivalent, so byte-level models get none.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lcx.config_base import ConfigError


def run(args: argparse.Namespace) -> int:
    from lcx.checkpoints import hf
    from lcx.train.checkpoint import load_checkpoint, run_checkpoint

    found = run_checkpoint(args.run)
    if found is None:
        raise ConfigError(f"RUN={args.run!r} holds no lcx checkpoint (expected runs/NAME, runs/NAME/train or a "
                          "checkpoints directory)")
    config, params = load_checkpoint(found, step=args.step)
    out = Path(args.hf)
    if out.exists() and any(out.iterdir()):
        if not args.force:
            raise ConfigError(f"--hf={args.hf!r} exists and is not empty; choose a new directory or pass --force")
        for old in [*out.glob("model*.safetensors"), *out.glob("model.safetensors.index.json")]:
            old.unlink()  # a previous export's shards would otherwise sit beside (or shadow) the new ones
    hf.save_hf(config, params, out)
    copied = _copy_tokenizer(found, out)
    print(f"lcx export: {found} -> {out} ({config.n_layers} layers, d_model {config.d_model}, "
          f"vocab {config.vocab_size}{', ' + copied if copied else ''})")
    return 0


def _copy_tokenizer(run: Path, out: Path) -> str | None:
    """Copy the run's recorded Hugging Face tokenizer files into ``out``; returns what was copied, or None."""
    import shutil

    from lcx.data.tokenizer import BYTES, run_tokenizer

    spec = run_tokenizer(run)
    if spec is None or spec == BYTES:
        return None
    file = Path(spec)
    if not file.is_file():
        raise ConfigError(f"the run was trained with the tokenizer {spec!r}, which no longer exists; the export would "
                          "have no tokenizer (restore that file and export again)")
    names = [file.name] + [n for n in ("tokenizer_config.json", "special_tokens_map.json")
                           if (file.parent / n).is_file()]
    for name in names:
        shutil.copyfile(file.parent / name, out / ("tokenizer.json" if name == file.name else name))
    return f"tokenizer from {file.parent}"


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("export", help="write an lcx run's checkpoint as a Hugging Face directory",
                              description=__doc__.splitlines()[0])
    p.add_argument("run", metavar="RUN", help="runs/NAME, one of its stages, or a checkpoints directory")
    p.add_argument("--hf", required=True, metavar="DIR", help="output directory (config.json + safetensors)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    p.add_argument("--force", action="store_true", help="write into a non-empty --hf directory")
    p.set_defaults(func=run)
    return p


__all__ = ["add_parser", "run"]
