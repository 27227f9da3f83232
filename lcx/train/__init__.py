"""Training: optax AdamW with warmup + cosine, a jitted pure train step, orbax checkpoints, resume, fine-tuning.

Entry points: ``run_training(model, train, data, run_dir)`` and ``load_checkpoint(path) -> (ModelConfig, params)``.
"""

from lcx.train.checkpoint import CheckpointError, CheckpointSaveError, load_checkpoint
from lcx.train.config import DataConfig, TrainConfig
from lcx.train.loop import TrainingInterrupted, TrainResult, run_training, training_model
from lcx.train.metrics import read_metrics
from lcx.train.optim import lr_schedule, make_optimizer
from lcx.train.step import TrainState, init_state, jit_train_step, train_step
from lcx.train.warm_start import finetune_config, initial_params, source_config

__all__ = ["CheckpointError", "CheckpointSaveError", "DataConfig", "TrainConfig", "TrainResult", "TrainState",
           "TrainingInterrupted", "finetune_config",
           "init_state", "initial_params", "jit_train_step", "load_checkpoint", "lr_schedule", "make_optimizer",
           "read_metrics", "run_training", "source_config", "train_step", "training_model"]
