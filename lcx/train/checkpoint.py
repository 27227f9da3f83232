"""Training checkpoints with orbax: save every N steps (async, keep the last k), restore, and load for evaluation.

Layout of ``run_dir/checkpoints/<step>/``: ``params`` (float32 master weights), ``train_state`` (optimizer state,
step, RNG key) and ``meta`` (JSON: step, data position, data seed, the model config) - so a checkpoint directory is
self-describing and ``load_checkpoint`` needs nothing else. The data position is the step: batches are a pure
function of (seed, step).

Every failure to find or read a checkpoint raises ``CheckpointError`` (a ``ConfigError``: the CLI reports it in one
line) naming the path; shapes are compared before reading, and a mismatch names the parameter and both shapes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from lcx.config import ConfigError, ModelConfig, from_dict, to_dict
from lcx.model.decoder import abstract_params


class CheckpointError(ConfigError):
    """A checkpoint is missing, unreadable, or does not match the configuration."""


def _handlers() -> dict[str, Any]:
    return {"params": ocp.StandardCheckpointHandler(), "train_state": ocp.StandardCheckpointHandler(),
            "meta": ocp.JsonCheckpointHandler()}


def open_manager(directory: str | Path, *, keep: int | None = None, async_save: bool = True,
                 create: bool = True) -> ocp.CheckpointManager:
    """A ``CheckpointManager`` over ``directory`` keeping the last ``keep`` checkpoints (null: all)."""
    directory = Path(directory).absolute()
    if not create and not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {str(directory)!r} does not exist")
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=create, enable_async_checkpointing=async_save)
    return ocp.CheckpointManager(directory, options=options, item_handlers=_handlers())


def save(manager: ocp.CheckpointManager, state, meta: Mapping[str, Any]) -> None:
    """Start saving ``state`` (a ``TrainState``) as step ``state.step``; returns once the arrays are copied to host
    (the write continues in the background when the manager is async). The caller decides when to save."""
    step = int(state.step)
    train_state = {"opt_state": state.opt_state, "step": state.step, "rng": state.rng}
    args = ocp.args.Composite(params=ocp.args.StandardSave(state.params),
                              train_state=ocp.args.StandardSave(train_state),
                              meta=ocp.args.JsonSave({**meta, "step": step, "data_position": step}))
    manager.save(step, args=args, force=True)


# --------------------------------------------------------------------------------------------------- shapes
def _path(keys) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in keys)


def _shapes(tree) -> dict[str, tuple[int, ...]]:
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, "shape"))[0]
    return {_path(p): tuple(x.shape) for p, x in leaves if hasattr(x, "shape")}


def check_shapes(expected, actual, source: str) -> None:
    """Raise ``ConfigError`` unless ``actual`` has exactly the parameters and shapes of ``expected``."""
    want, got = _shapes(expected), _shapes(actual)
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    if missing or extra:
        raise CheckpointError(f"{source}: parameters do not match the model config: missing {missing}, "
                              f"unexpected {extra}")
    for name in sorted(want):
        if want[name] != got[name]:
            raise CheckpointError(f"{source}: parameter {name!r} has shape {got[name]} in the checkpoint but "
                                  f"{want[name]} in the model config; architecture fields (d_model, n_layers, "
                                  f"n_heads, n_kv_heads, head_dim, d_ff, vocab_size) must match the checkpoint")


def _with_sharding(abstract, sharding=None):
    """Restore targets: ``abstract``'s shapes with ``sharding`` - one sharding for every leaf, a tree of them (a
    sharded run), or None (the first device)."""
    if sharding is None or isinstance(sharding, jax.sharding.Sharding):
        sharding = sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), abstract)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, sharding)


# --------------------------------------------------------------------------------------------------- restore
def _cause(err: BaseException) -> str:
    text = str(err).splitlines()[0] if str(err) else ""
    return f"{type(err).__name__}: {text[:300]}{'...' if len(text) > 300 else ''}"


_HINT = "; delete that step directory to fall back to the previous checkpoint"


def _read(manager: ocp.CheckpointManager, step: int, what: str, **items):
    try:
        return manager.restore(step, args=ocp.args.Composite(**items))
    except CheckpointError:
        raise
    except Exception as err:  # orbax/tensorstore raise many types; the user needs the path and the cause
        raise CheckpointError(f"checkpoint {str(manager.directory / str(step))!r} could not be read ({what}): "
                              f"{_cause(err)}{_HINT}") from err


def read_meta(manager: ocp.CheckpointManager, step: int) -> dict[str, Any]:
    meta = _read(manager, step, "meta", meta=ocp.args.JsonRestore())["meta"]
    if not isinstance(meta, Mapping) or "model" not in meta:
        raise CheckpointError(f"checkpoint {str(manager.directory / str(step))!r} has no model config in its meta")
    return dict(meta)


def _param_metadata(manager: ocp.CheckpointManager, step: int):
    try:
        meta = manager.item_metadata(step)["params"]
    except Exception as err:
        raise CheckpointError(f"checkpoint {str(manager.directory / str(step))!r} has unreadable parameter "
                              f"metadata: {_cause(err)}{_HINT}") from err
    if meta is None:
        raise CheckpointError(f"checkpoint {str(manager.directory / str(step))!r} has no parameters")
    return meta


def restore_params(manager: ocp.CheckpointManager, step: int, model: ModelConfig, sharding=None) -> dict:
    """The float32 params of ``step``, checked against ``model``'s shapes first (before any sharding is applied)."""
    abstract = abstract_params(dataclasses.replace(model, param_dtype="float32"))
    check_shapes(abstract, _param_metadata(manager, step), f"checkpoint {str(manager.directory / str(step))!r}")
    expected = _with_sharding(abstract, sharding)
    return _read(manager, step, "params", params=ocp.args.StandardRestore(expected))["params"]


def restore_state(manager: ocp.CheckpointManager, abstract_state, step: int | None = None, shardings=None):
    """``(TrainState, meta)`` of ``step`` (default: latest) with the structure of ``abstract_state``, each array read
    directly into its shards when ``shardings`` (a ``TrainState`` of shardings) is given - whatever mesh wrote it."""
    step = manager.latest_step() if step is None else step
    if step is None:
        raise CheckpointError(f"no checkpoint in {str(manager.directory)!r}")
    where = f"checkpoint {str(manager.directory / str(step))!r}"
    check_shapes(abstract_state.params, _param_metadata(manager, step), where)
    rest = {"opt_state": abstract_state.opt_state, "step": abstract_state.step, "rng": abstract_state.rng}
    rest_sh = None if shardings is None else {"opt_state": shardings.opt_state, "step": shardings.step,
                                               "rng": shardings.rng}
    target = _with_sharding(rest, rest_sh)
    params = _read(manager, step, "params", params=ocp.args.StandardRestore(
        _with_sharding(abstract_state.params, None if shardings is None else shardings.params)))
    try:
        out = _read(manager, step, "optimizer state", train_state=ocp.args.StandardRestore(target),
                    meta=ocp.args.JsonRestore())
    except CheckpointError as err:
        raise CheckpointError(f"{err}; or, if the optimizer settings (e.g. train.grad_clip) changed since it was "
                              f"written, start a new run directory with train.init_from") from err
    ts = out["train_state"]
    state = abstract_state.replace(step=ts["step"], params=params["params"], opt_state=ts["opt_state"], rng=ts["rng"])
    return state, dict(out["meta"])


# --------------------------------------------------------------------------------------------------- loading
def resolve(path: str | Path) -> tuple[Path, int | None]:
    """``(checkpoint root, step or None)`` from a run dir, its ``checkpoints`` dir, or one ``<step>`` dir."""
    path = Path(path).expanduser().absolute()
    if not path.exists():
        raise CheckpointError(f"checkpoint path {str(path)!r} does not exist")
    if (path / "checkpoints").is_dir():
        return path / "checkpoints", None
    if path.name.isdigit() and (path / "params").is_dir():
        return path.parent, int(path.name)
    return path, None


def is_checkpoint(path: str | Path) -> bool:
    """True if ``path`` resolves to a directory holding at least one lcx checkpoint step."""
    try:
        root, step = resolve(path)
    except CheckpointError:
        return False
    return step is not None or any(p.name.isdigit() and (p / "params").is_dir() for p in root.iterdir())


def run_checkpoint(path: str | Path) -> Path | None:
    """Where the latest model of ``path`` lives: a run directory's ``finetune`` stage, else its ``train`` stage,
    else ``path`` itself (a stage or checkpoints directory); None when none holds a checkpoint."""
    path = Path(path)
    return next((c for c in (path / "finetune", path / "train", path) if is_checkpoint(c)), None)


def checkpoint_config(path: str | Path) -> ModelConfig:
    """The model config of the latest checkpoint under ``path``, read from its meta (no parameter is loaded)."""
    root, found = resolve(path)
    manager = open_manager(root, create=False, async_save=False)
    try:
        step = found if found is not None else manager.latest_step()
        if step is None:
            raise CheckpointError(f"no checkpoint in {str(root)!r}")
        return from_dict(ModelConfig, read_meta(manager, step)["model"], prefix="model")
    finally:
        manager.close()


def load_checkpoint(path: str | Path, step: int | None = None, shardings=None) -> tuple[ModelConfig, dict]:
    """``(ModelConfig, params)`` of the latest (or ``step``) checkpoint under ``path`` - a run directory, its
    ``checkpoints`` directory or one step directory. Params are float32 jax arrays on the default device, or read
    straight into ``shardings`` (a tree of shardings, e.g. a mesh's) whatever mesh saved them."""
    root, found = resolve(path)
    step = found if step is None else step
    manager = open_manager(root, create=False, async_save=False)
    try:
        steps = manager.all_steps()
        if not steps:
            raise CheckpointError(f"no checkpoint in {str(root)!r} (expected step directories written by "
                                  f"lcx training, e.g. {str(root / '100')!r})")
        if step is None:
            step = max(steps)
        elif step not in steps:
            raise CheckpointError(f"checkpoint step {step} is not in {str(root)!r}; available: {sorted(steps)}")
        meta = read_meta(manager, step)
        model = from_dict(ModelConfig, meta["model"], prefix="model")
        params = restore_params(manager, step, model, shardings)
    finally:
        manager.close()
    return model, params


def meta_for(model: ModelConfig, data_seed: int, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The JSON saved with each checkpoint."""
    return {"model": to_dict(model), "data_seed": int(data_seed), **(extra or {})}


__all__ = ["CheckpointError", "check_shapes", "is_checkpoint", "load_checkpoint", "meta_for", "open_manager",
           "read_meta", "resolve", "restore_params", "restore_state", "save"]
