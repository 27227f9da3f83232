"""An experiment file as one value: ``ExperimentConfig`` (the model and cache of ``lcx.config.Config`` plus the
sections of the stages: ``train``, ``data``, ``finetune``, ``router``, ``eval``, ``ablate``, ``mesh``), loaded and
validated by ``load_experiment``; ``checkpoint:`` fills the model section from a model source
(``with_checkpoint_model``). ``finetune_sections`` / ``finetune_data`` derive the finetune stage's sections.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lcx.config import (Config, ConfigError, ModelConfig, RopeConfig, check_cache, from_dict, import_plugins,
                        load_dict, to_dict)
from lcx.config_base import config_fields, unknown_key
from lcx.eval.config import AblateConfig, EvalConfig
from lcx.parallel import context as context_parallel
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


__all__ = ["STAGES", "ExperimentConfig", "FinetuneConfig", "finetune_data", "finetune_sections", "load_experiment",
           "with_checkpoint_model"]
