"""Training checkpoints with orbax: save every N steps (async, keep the last k), restore, and load for evaluation.

Layout of ``run_dir/checkpoints/<step>/``: ``params`` (float32 master weights), ``train_state`` (optimizer state,
step, RNG key) and ``meta`` (JSON: step, data position, data seed, the model config) - so a checkpoint directory is
self-describing and ``load_checkpoint`` needs nothing else. The data position is the step: batches are a pure
function of (seed, step).

Every failure to find or read a checkpoint raises ``CheckpointError`` (a ``ConfigError``: the CLI reports it in one
line) naming the path; shapes are compared before reading, and a mismatch names the parameter and both shapes.
Every finished step gets a SHA-256 manifest (``lcx.train.integrity``), verified before it is restored: a step that
fails is never loaded silently. A save that fails raises ``CheckpointSaveError`` with the step, the path and the
cause - at the first step after a background write failed, not at the next save.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from lcx.config import ConfigError, ModelConfig, from_dict, to_dict
from lcx.model.decoder import abstract_params
from lcx.train import integrity


class CheckpointError(ConfigError):
    """A checkpoint is missing, unreadable, or does not match the configuration."""


class CheckpointSaveError(CheckpointError):
    """Writing a checkpoint failed (disk full, the path is not a writable directory, ...)."""


class _DropOrbaxErrors(logging.Filter):
    """Orbax logs a background save failure with full tracebacks from several threads (hundreds of lines); lcx reports
    it once as a ``CheckpointSaveError``, so those records are dropped while a manager of lcx is open."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and "orbax" in (record.pathname or ""))


_FILTER = _DropOrbaxErrors()


def _handlers() -> dict[str, Any]:
    return {"params": ocp.StandardCheckpointHandler(), "train_state": ocp.StandardCheckpointHandler(),
            "meta": ocp.JsonCheckpointHandler()}


def check_writable(directory: str | Path) -> None:
    """``CheckpointSaveError`` now, before training, when ``directory`` cannot hold checkpoints (a file in the way,
    no permission, a read-only file system)."""
    directory = Path(directory).absolute()
    if directory.exists() and not directory.is_dir():
        raise CheckpointSaveError(f"checkpoints cannot be written to {str(directory)!r}: it is a file, not a "
                                  "directory; move it away or choose another run directory")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / ".lcx-write-probe"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as err:
        raise CheckpointSaveError(f"checkpoints cannot be written to {str(directory)!r}: {err.strerror or err} "
                                  f"({type(err).__name__}); choose a writable run directory") from None


def open_manager(directory: str | Path, *, keep: int | None = None, async_save: bool = True,
                 create: bool = True) -> ocp.CheckpointManager:
    """A ``CheckpointManager`` over ``directory`` keeping the last ``keep`` checkpoints (null: all); each finished
    step gets its checksum manifest (after the background write, for async saves)."""
    directory = Path(directory).absolute()
    if not create and not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {str(directory)!r} does not exist")
    extra = {}
    if async_save:
        extra["async_options"] = ocp.AsyncOptions(
            post_finalization_callback=lambda: integrity.write_missing_manifests(directory))
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=create, enable_async_checkpointing=async_save,
                                           **extra)
    logging.getLogger("absl").addFilter(_FILTER)
    return ocp.CheckpointManager(directory, options=options, item_handlers=_handlers())


def _save_failed(manager: ocp.CheckpointManager, step, err: BaseException) -> CheckpointSaveError:
    release_stuck_threads()
    # the failed operation leaves coroutines orbax never awaits; Python would list each at exit
    warnings.filterwarnings("ignore", message="coroutine .* was never awaited", category=RuntimeWarning)
    where = str(manager.directory) if step is None else str(manager.directory / str(step))
    return CheckpointSaveError(f"saving checkpoint {where!r} failed: {_cause(err)}; the run stops here (free disk "
                               f"space or fix the path, then rerun to resume from the last checkpoint)")


def save(manager: ocp.CheckpointManager, state, meta: Mapping[str, Any], previous: int | None = None) -> None:
    """Start saving ``state`` (a ``TrainState``) as step ``state.step``; returns once the arrays are copied to host
    (the write continues in the background when the manager is async). The caller decides when to save;
    ``previous``: the step whose write may still run (a failure of it surfaces here and is named)."""
    step = int(state.step)
    train_state = {"opt_state": state.opt_state, "step": state.step, "rng": state.rng}
    args = ocp.args.Composite(params=ocp.args.StandardSave(state.params),
                              train_state=ocp.args.StandardSave(train_state),
                              meta=ocp.args.JsonSave({**meta, "step": step, "data_position": step}))
    try:
        check_save_errors(manager, previous)
        manager.save(step, args=args, force=True)
    except CheckpointSaveError:
        raise
    except Exception as err:
        raise _save_failed(manager, step, err) from err
    if not manager._options.enable_async_checkpointing:  # noqa: SLF001 - synchronous: the step is final now
        integrity.write_missing_manifests(manager.directory)


def check_save_errors(manager: ocp.CheckpointManager, step: int | None = None) -> None:
    """Raise ``CheckpointSaveError`` if the background write of ``step`` (the last one started) has failed; cheap,
    call every training step - the failure then stops the run at once, not at the next save."""
    try:
        manager.check_for_errors()
        if not manager.is_saving_in_progress():
            manager.wait_until_finished()  # returns at once, or raises what the finished write stored
    except Exception as err:
        raise _save_failed(manager, step, err) from err


def finish_saves(manager: ocp.CheckpointManager, step: int | None = None) -> None:
    """Wait for the background write (of ``step``); give every finished step its manifest."""
    try:
        manager.wait_until_finished()
    except Exception as err:
        raise _save_failed(manager, step, err) from err
    integrity.write_missing_manifests(manager.directory)


def release_stuck_threads() -> None:
    """After a failed write, orbax's signalling threads wait (20 min by default) for signals the failed operation
    never sends, and being non-daemon they would hold the process open: send those signals so they end now."""
    try:
        from orbax.checkpoint._src.futures import future as _future
    except ImportError:
        return
    for thread in threading.enumerate():
        if type(thread).__name__ == "_SignalingThread" and thread.is_alive():
            try:
                thread.cancel()
                _future.set_signals(thread._receive_signals, operation_id=thread._operation_id)  # noqa: SLF001
            except Exception:  # best effort: an orbax version without these internals keeps its timeout
                pass


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


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """Which checkpoint was loaded: its step directory, step and content fingerprint (``integrity.fingerprint``)."""

    path: Path
    step: int
    fingerprint: str

    def to_dict(self) -> dict[str, Any]:
        return {"path": str(self.path), "step": self.step, "fingerprint": self.fingerprint}


def load_checkpoint(path: str | Path, step: int | None = None, shardings=None) -> tuple[ModelConfig, dict]:
    """``(ModelConfig, params)`` of the latest (or ``step``) checkpoint under ``path`` - a run directory, its
    ``checkpoints`` directory or one step directory. Params are float32 jax arrays on the default device, or read
    straight into ``shardings`` (a tree of shardings, e.g. a mesh's) whatever mesh saved them. The newest step that
    passes verification is used (a damaged one is skipped and reported); a requested ``step`` must pass."""
    model, params, _ = load_checkpoint_info(path, step, shardings)
    return model, params


def load_checkpoint_info(path: str | Path, step: int | None = None, shardings=None
                         ) -> tuple[ModelConfig, dict, CheckpointInfo]:
    """``load_checkpoint`` plus the ``CheckpointInfo`` of the step it read (what an evaluation records)."""
    root, found = resolve(path)
    step = found if step is None else step
    manager = open_manager(root, create=False, async_save=False)
    try:
        steps = manager.all_steps()
        if not steps:
            raise CheckpointError(f"no checkpoint in {str(root)!r} (expected step directories written by "
                                  f"lcx training, e.g. {str(root / '100')!r})")
        if step is None:
            step = integrity.newest_good_step(root, move_bad=False)
            if step is None:
                raise CheckpointError(f"every checkpoint in {str(root)!r} failed verification (steps "
                                      f"{sorted(steps)}); see the messages above")
        elif step not in steps:
            raise CheckpointError(f"checkpoint step {step} is not in {str(root)!r}; available: {sorted(steps)}")
        else:
            problem = integrity.verify(root / str(step))
            if problem not in (None, "unverified"):
                raise CheckpointError(f"checkpoint {str(root / str(step))!r} failed verification ({problem}); "
                                      "choose another step")
        meta = read_meta(manager, step)
        model = from_dict(ModelConfig, meta["model"], prefix="model")
        params = restore_params(manager, step, model, shardings)
    finally:
        manager.close()
    return model, params, CheckpointInfo(root / str(step), step, integrity.fingerprint(root / str(step)))


def meta_for(model: ModelConfig, data_seed: int, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The JSON saved with each checkpoint."""
    return {"model": to_dict(model), "data_seed": int(data_seed), **(extra or {})}


__all__ = ["CheckpointError", "CheckpointInfo", "CheckpointSaveError", "check_save_errors", "check_shapes",
           "check_writable", "finish_saves", "is_checkpoint", "load_checkpoint", "load_checkpoint_info", "meta_for",
           "open_manager", "read_meta", "release_stuck_threads", "resolve", "restore_params", "restore_state", "save"]
