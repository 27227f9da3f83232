"""Where a model comes from: a Hugging Face directory, a GGUF file or an lcx run / stage / checkpoint directory.

One place answers, for any of them, what an evaluation or ``lcx generate`` needs: the model config (``source_config``,
no weights read), the weights with a record of exactly which ones (``load_source`` -> ``CheckpointInfo``: path, step,
content fingerprint). The tokenizer that belongs to them is ``lcx.data.tokenizer.resolve_tokenizer("auto",
init_from=path)``.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from lcx.config_base import ConfigError
from lcx.model.config import ModelConfig

KINDS = ("hf", "gguf", "lcx")


def source_kind(path: str | Path, key: str = "checkpoint") -> str:
    """``hf`` (a directory with config.json), ``gguf`` (a ``.gguf`` file) or ``lcx`` (a run, stage or checkpoints
    directory); anything else is a ``ConfigError`` naming ``key``."""
    p = Path(path).expanduser()
    if p.is_file() and p.suffix.lower() == ".gguf":
        return "gguf"
    if p.is_dir() and (p / "config.json").is_file():
        return "hf"
    from lcx.train.checkpoint import run_checkpoint  # orbax (and what it pulls in): only for an lcx run

    if p.is_dir() and run_checkpoint(p) is not None:
        return "lcx"
    what = "does not exist" if not p.exists() else "is none of them"
    raise ConfigError(f"{key}={str(path)!r} {what}: expected a Hugging Face directory (config.json + safetensors), "
                      "a .gguf file, or an lcx run / stage / checkpoints directory")


def source_config(path: str | Path, key: str = "checkpoint") -> ModelConfig:
    """The model config of ``path`` (reads metadata only)."""
    kind = source_kind(path, key)
    if kind == "hf":
        from lcx.checkpoints.hf import read_hf_config

        return read_hf_config(path)
    if kind == "gguf":
        from lcx.checkpoints.gguf import GGUFFile, hf_config
        from lcx.checkpoints.hf_config import config_from_hf

        return config_from_hf(hf_config(GGUFFile(path)), where=str(path))
    from lcx.train.checkpoint import checkpoint_config, run_checkpoint

    return checkpoint_config(run_checkpoint(Path(path).expanduser()))


def load_source(path: str | Path, dtype: str | None = None, key: str = "checkpoint"):
    """``(ModelConfig, params, CheckpointInfo)`` of ``path``. A Hugging Face directory or GGUF file is step 0 with
    a SHA-256 of its weight files as the fingerprint (a replaced file reruns what evaluated it)."""
    from lcx.train.checkpoint import CheckpointInfo, load_checkpoint_info, run_checkpoint

    kind = source_kind(path, key)
    p = Path(path).expanduser().resolve()
    if kind == "lcx":
        return load_checkpoint_info(run_checkpoint(p))
    if kind == "hf":
        from lcx.checkpoints.hf import load_hf

        config, params = load_hf(p, dtype=dtype)
        files = sorted(p.glob("*.safetensors"))
    else:
        from lcx.checkpoints.gguf import load_gguf

        config, params = load_gguf(p, dtype=dtype)
        files = [p]
    return config, params, CheckpointInfo(p, 0, _digest(files))


def _digest(files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in files:
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 24), b""):
                h.update(block)
    return "sha256:" + h.hexdigest()[:16]


__all__ = ["KINDS", "load_source", "source_config", "source_kind"]
