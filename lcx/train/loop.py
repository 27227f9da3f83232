"""``run_training``: the training loop - data, compiled step, metrics, checkpoints, resume and Ctrl-C.

Run directory layout::

    run_dir/config.yaml     model (as trained: compute dtype, float32 params), train and data sections
    run_dir/settings.jsonl  the train / data settings per segment of steps (``lcx.train.settings``)
    run_dir/metrics.jsonl   one row per logged step (see ``lcx.train.metrics``)
    run_dir/checkpoints/    orbax: <step>/{params, train_state, meta} + lcx_checksums.json
    run_dir/lock.json       the trainer writing here (``lcx.train.run_lock``), while it runs

A run directory that already holds a checkpoint is resumed (``train.resume``): the newest checkpoint that passes
verification (``lcx.train.integrity``; a bad one is moved aside and reported) restores params, optimizer state, step
and RNG, and since batch i is a pure function of (data seed, i) the data position is the step - the resumed run
continues the identical loss curve. Resuming with other settings needs ``allow_changes`` (recorded per segment).

Failures end the run cleanly: one trainer per run directory (a second is refused), a save that fails stops the run
at the next step with one ``CheckpointSaveError``, and Ctrl-C finishes the current step, saves it (unless that step
was just saved) and raises ``TrainingInterrupted`` naming the checkpoint; a second Ctrl-C stops at once, still
saving the last finished step when its buffers are intact.
"""

from __future__ import annotations

import dataclasses
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import yaml

from lcx.config import ConfigError, ModelConfig, to_dict
from lcx.config_base import config_fields
from lcx.data.batches import BatchSource
from lcx.data.tokenizer import resolve_tokenizer
from lcx.model.attention_choice import announce_attention, resolve_attention
from lcx.train import checkpoint as ckpt
from lcx.train import integrity
from lcx.train import settings as history
from lcx.train.config import DataConfig, TrainConfig
from lcx.train.metrics import MetricsLogger, truncate_metrics
from lcx.train.optim import make_optimizer
from lcx.parallel import context as context_parallel
from lcx.parallel import sharding
from lcx.train.step import TrainState, compile_train_step, init_state, state_struct, step_shardings
from lcx.train.run_lock import RunLock
from lcx.train.warm_start import initial_params

Callback = Callable[[int, dict[str, Any] | None], None]


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped a run: ``step`` steps are done and ``checkpoint`` (None if nothing could be saved) holds them."""

    def __init__(self, step: int, checkpoint: Path | None):
        self.step, self.checkpoint = step, checkpoint
        saved = f"checkpoint {checkpoint}" if checkpoint is not None else "no new checkpoint"
        super().__init__(f"interrupted after step {step} ({saved}); rerun the same command to resume")


class _GracefulStop:
    """The first Ctrl-C asks the loop to stop after the current step; a second one interrupts at once. Only in the
    main thread (signal handlers cannot be set elsewhere); elsewhere Ctrl-C is a plain ``KeyboardInterrupt``."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print("\nlcx: stopping after this step and saving it (Ctrl-C again to stop now)", file=sys.stderr, flush=True)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """``params``: final float32 params; ``step``: steps done; ``model``: the config they were trained with."""

    params: Any
    step: int
    model: ModelConfig
    run_dir: Path
    metrics_path: Path
    checkpoint_dir: Path
    compile_s: float


def training_model(model: ModelConfig, train: TrainConfig) -> ModelConfig:
    """The model as trained: ``train.compute_dtype`` compute, float32 master params, ``train.remat`` if set, and
    ``train.context_parallel`` as its attention's strategy across a ``seq`` mesh axis."""
    remat = model.remat if train.remat is None else train.remat
    policy = model.remat_policy if train.remat_policy is None else train.remat_policy
    attention = dataclasses.replace(model.attention, context_parallel=train.context_parallel)
    return dataclasses.replace(model, dtype=train.compute_dtype, param_dtype="float32", remat=remat,
                               remat_policy=policy, attention=attention)


def _check_fit(model: ModelConfig, train: TrainConfig) -> None:
    if train.seq_len > model.max_position_embeddings:
        raise ConfigError(f"train.seq_len={train.seq_len} is invalid: must be <= model.max_position_embeddings="
                          f"{model.max_position_embeddings}; to train longer, raise max_position_embeddings (and "
                          f"set model.rope scaling for a long-context fine-tune)")


def _write_config(path: Path, model: ModelConfig, train: TrainConfig, data: DataConfig, tokenizer: str) -> None:
    # The tokenizer as resolved (``auto`` -> a path or bytes): what generate, export and later fine-tunes reuse.
    doc = {"model": to_dict(model), "train": to_dict(train), "data": {**to_dict(data), "tokenizer": tokenizer}}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))


def _with_defaults(saved: dict, cls) -> dict:
    """A section an older lcx wrote, with the fields added to ``cls`` since then at their declared defaults (so older
    runs stay resumable)."""
    defaults = {f.name: f.default for f in config_fields(cls) if f.default is not dataclasses.MISSING}
    return {**{k: v for k, v in defaults.items() if k not in saved}, **saved}


def _check_resume_model(path: Path, model: ModelConfig) -> None:
    if not path.exists():
        return
    saved = _with_defaults((yaml.safe_load(path.read_text()) or {}).get("model", {}), ModelConfig)
    current = to_dict(model)
    diff = sorted(k for k in set(saved) | set(current) if saved.get(k) != current.get(k))
    if diff:
        pairs = ", ".join(f"model.{k}: {saved.get(k)!r} -> {current.get(k)!r}" for k in diff)
        raise ConfigError(f"{str(path.parent)!r} holds a checkpoint of a different model ({pairs}); resume with the "
                          f"same model config, or start a new run directory with train.init_from={str(path.parent)!r}")


def run_training(model: ModelConfig, train: TrainConfig, data: DataConfig, run_dir: str | Path, *,
                 progress: bool = True, max_steps: int | None = None, callback: Callback | None = None,
                 mesh: jax.sharding.Mesh | None = None, allow_changes: bool = False) -> TrainResult:
    """Train ``model`` on ``data`` for ``train.steps`` steps (or stop after step ``max_steps``), in ``run_dir``.

    ``callback(step, row)`` runs after every step (``row``: the metrics row logged at that step, else None); an
    exception it raises stops the run with the checkpoints intact (``KeyboardInterrupt``: like Ctrl-C, the step is
    saved first). A checkpoint is written every ``train.save_every`` steps and at the last step run.
    ``allow_changes``: resume even though ``train`` / ``data`` settings differ from the run's (recorded).
    """
    if train.fsdp and mesh is None:
        raise ConfigError("train.fsdp=true splits weights over the mesh's data axis, but this run has no mesh; add "
                          "mesh: {data: D, model: M} (D > 1) or set train.fsdp=false")
    data_axis = sharding.axis_size(mesh, "data")
    if train.micro_batch_size % data_axis:
        raise ConfigError(f"train.batch_size={train.batch_size} (micro-batches of {train.micro_batch_size} with "
                          f"train.grad_accum={train.grad_accum}) is invalid on mesh.data={data_axis}: every "
                          f"micro-batch must split evenly over the data axis (a multiple of {data_axis})")
    context_parallel.check_length(train.seq_len, sharding.axis_size(mesh, "seq"), "train.seq_len")
    resolve_attention(model)  # attention.impl this machine cannot run (cudnn on a CPU): refused before the run dir
    run_dir = Path(run_dir)
    make_run_dir(run_dir)
    with RunLock(run_dir):
        return _run_locked(model, train, data, run_dir, progress=progress, max_steps=max_steps, callback=callback,
                           mesh=mesh, allow_changes=allow_changes)


def make_run_dir(run_dir: Path) -> None:
    """Create ``run_dir``; a path that cannot be a directory is one clear ``ConfigError``."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"run directory {str(run_dir)!r} cannot be created: {err.strerror or err} "
                          f"({type(err).__name__}); choose another runs_dir / name") from None


def _run_locked(model, train, data, run_dir: Path, *, progress, max_steps, callback, mesh, allow_changes):
    model = training_model(model, train)
    _check_fit(model, train)
    data_seed = train.seed if data.seed is None else data.seed
    tokenizer = resolve_tokenizer(data.tokenizer, init_from=train.init_from, vocab_size=model.vocab_size)
    task = data.make_task().with_tokenizer(tokenizer)
    announce_attention(model, packed=task.packed)  # as trained: compute dtype, packed documents
    source = BatchSource(task, seq_len=train.seq_len, batch_size=train.batch_size, seed=data_seed,
                         prompt_loss_weight=data.prompt_loss_weight)
    optimizer = make_optimizer(train)

    state_sh, batch_sh = step_shardings(model, train, mesh, task.packed) if mesh is not None else (None, None)

    seq_axis = sharding.axis_size(mesh, "seq")

    def next_batch(index: int):
        batch = source(index)
        if seq_axis > 1:  # rows laid out for the zig-zag assignment of context parallelism
            batch = context_parallel.layout_batch(batch, seq_axis)
        return batch if mesh is None else {k: sharding.put(v, batch_sh[k]) for k, v in batch.items()}

    ckpt_dir = run_dir / "checkpoints"
    ckpt.check_writable(ckpt_dir)
    if train.resume:  # bad checkpoints are moved aside before orbax (and its retention) sees them
        integrity.newest_good_step(ckpt_dir, move_bad=True)
    manager = ckpt.open_manager(ckpt_dir, keep=train.keep, async_save=train.async_save)
    saved_step = None
    state = None
    try:
        state = _initial_state(manager, run_dir, model, train, optimizer, state_sh)
        start = int(state.step)
        saved_step = start if start > 0 else None
        stop = train.steps if max_steps is None else min(train.steps, max_steps)
        batch = next_batch(start)  # also surfaces data errors (e.g. an empty corpus) before writing anything
        current = {"train": to_dict(train), "data": {**to_dict(data), "tokenizer": tokenizer.spec}}
        history.record(run_dir, start, current, allow_changes=allow_changes,
                       previous=_saved_settings(run_dir / "config.yaml") if start > 0 else None)
        _write_config(run_dir / "config.yaml", model, train, data, tokenizer.spec)
        metrics_path = run_dir / "metrics.jsonl"
        truncate_metrics(metrics_path, start)
        t0 = time.perf_counter()
        step_fn = compile_train_step(model, train, mesh=mesh, packed=task.packed) if start < stop else None
        compile_s = time.perf_counter() - t0

        meta = ckpt.meta_for(model, data_seed, {"task": data.task})
        logger = MetricsLogger(metrics_path, log_every=train.log_every, tokens_per_step=train.batch_size *
                               train.seq_len, total_steps=train.steps, start_step=start, progress=progress)
        tracing = False
        try:
            with _GracefulStop() as stopper:
                for index in range(start, stop):
                    batch = batch if index == start else next_batch(index)
                    if train.profile_steps and index + 1 == train.profile_steps[0]:
                        jax.profiler.start_trace(str(run_dir / "profile"))
                        tracing = True
                    state, metrics = step_fn(state, batch)
                    step = index + 1
                    if tracing and step == train.profile_steps[1]:
                        jax.block_until_ready(state)
                        jax.profiler.stop_trace()
                        tracing = False
                    row = logger.add(step, metrics, force=step == stop)
                    ckpt.check_save_errors(manager, saved_step)  # a failed background write stops the run now
                    if step % train.save_every == 0 or step == stop:
                        ckpt.save(manager, state, meta, previous=saved_step)
                        saved_step = step
                    if callback is not None:
                        callback(step, row)
                    if stopper.requested:
                        raise KeyboardInterrupt
        finally:
            if tracing:  # interrupted inside the profiled window: keep what was traced
                jax.profiler.stop_trace()
            logger.close()
        ckpt.finish_saves(manager, saved_step)
    except KeyboardInterrupt:
        saved = _save_on_interrupt(manager, state, saved_step, meta if "meta" in locals() else None)
        raise TrainingInterrupted(saved or 0, None if saved is None else ckpt_dir / str(saved)) from None
    except ckpt.CheckpointSaveError:
        raise
    except BaseException:
        # Any other failure: let an in-flight async save complete, so the last checkpoint stays restorable.
        _finish_quietly(manager)
        raise
    finally:
        _close_quietly(manager)
    return TrainResult(params=state.params, step=max(start, stop), model=model, run_dir=run_dir,
                       metrics_path=metrics_path, checkpoint_dir=ckpt_dir, compile_s=compile_s)


def _save_on_interrupt(manager, state, saved_step: int | None, meta) -> int | None:
    """Save the last finished step unless it is saved already (or its buffers were donated to an unfinished step);
    returns the step the newest checkpoint holds."""
    step = None
    if state is not None and meta is not None:
        leaves = jax.tree.leaves(state)
        if not any(getattr(x, "is_deleted", lambda: False)() for x in leaves):
            step = int(state.step)
    if step is not None and step != saved_step and step > 0:
        ckpt.save(manager, state, meta, previous=saved_step)
        saved_step = step
    ckpt.finish_saves(manager, saved_step)
    return saved_step


def _finish_quietly(manager) -> None:
    try:
        ckpt.finish_saves(manager)
    except ckpt.CheckpointSaveError as err:
        print(f"lcx: {err}", file=sys.stderr, flush=True)


def _close_quietly(manager) -> None:
    try:
        manager.close()
    except Exception:  # a failed save re-raises here; it was reported already
        ckpt.release_stuck_threads()


def _saved_settings(path: Path) -> dict | None:
    """The train / data settings a run without a history wrote in its config.yaml (fields added since take their
    defaults; such runs were byte-level)."""
    if not path.is_file():
        return None
    saved = yaml.safe_load(path.read_text()) or {}
    data_saved = {"tokenizer": "bytes", **(saved.get("data") or {})}
    return {"train": _with_defaults(saved.get("train") or {}, TrainConfig),
            "data": _with_defaults(data_saved, DataConfig)}


def _initial_state(manager, run_dir: Path, model: ModelConfig, train: TrainConfig, optimizer,
                   shardings: TrainState | None = None) -> TrainState:
    """Restored from ``run_dir``'s latest checkpoint, else fresh (random or ``train.init_from`` params); with
    ``shardings`` (a run on a mesh) every array is created or read directly in its shards."""
    if manager.latest_step() is None:
        params = initial_params(model, train.init_from, train.seed,
                                shardings=None if shardings is None else shardings.params)
        # One compiled init instead of one small compile per optimizer-state leaf shape run eagerly.
        return jax.jit(lambda p: init_state(p, optimizer, train.seed), out_shardings=shardings)(params)
    if not train.resume:
        raise ConfigError(f"run directory {str(run_dir)!r} already holds checkpoints (latest step "
                          f"{manager.latest_step()}) and train.resume=false; choose a new run directory")
    _check_resume_model(run_dir / "config.yaml", model)
    state, _meta = ckpt.restore_state(manager, state_struct(model, optimizer), shardings=shardings)
    return state


__all__ = ["TrainResult", "run_training", "training_model"]
