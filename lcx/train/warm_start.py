"""Initial parameters of a run: random, or from an lcx checkpoint or a Hugging Face directory (fine-tuning).

Long-context fine-tuning keeps the architecture and changes only what does not touch parameter shapes - the
``rope`` section (yarn / ntk / linear / llama3 / dynamic) and ``max_position_embeddings`` - then trains at a longer
``train.seq_len``. ``finetune_config`` derives that config from the source's own; ``initial_params`` loads the
weights and checks every shape against the config, naming the first mismatching parameter and both shapes.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from lcx.parallel import sharding
from lcx.config import AttentionConfig, ModelConfig, RopeConfig
from lcx.model.decoder import Decoder, abstract_params
from lcx.train.checkpoint import CheckpointError, check_shapes, checkpoint_config, is_checkpoint, load_checkpoint


def is_hf_dir(path: str | Path) -> bool:
    return (Path(path) / "config.json").is_file()


def _kind(path: str | Path) -> str:
    if is_hf_dir(path):
        return "hf"
    if is_checkpoint(path):
        return "lcx"
    raise CheckpointError(f"train.init_from={str(path)!r} is neither an lcx run/checkpoint directory (with "
                          "checkpoints/<step>/params) nor a Hugging Face directory (with config.json)")


def source_config(path: str | Path) -> ModelConfig:
    """The model config stored with an lcx checkpoint or a Hugging Face directory."""
    if _kind(path) == "hf":
        from lcx.checkpoints.hf import read_hf_config

        return read_hf_config(path)
    return checkpoint_config(path)


def finetune_config(base: ModelConfig, *, rope: RopeConfig | None = None,
                    max_position_embeddings: int | None = None) -> ModelConfig:
    """``base`` with a new RoPE scaling and/or context length (everything that keeps parameter shapes)."""
    changes = {}
    if rope is not None:
        changes["rope"] = rope
    if max_position_embeddings is not None:
        changes["max_position_embeddings"] = max_position_embeddings
    return dataclasses.replace(base, **changes)


@functools.lru_cache(maxsize=4)
def _jit_init(model: ModelConfig):
    # lcx.model.init_params jits a fresh function per call; keeping one per config lets repeated runs in one process
    # (tests, sweeps) skip the recompile.
    return jax.jit(Decoder(model).init)


def _random_params(model: ModelConfig, seed: int, shardings=None) -> dict:
    if shardings is not None:  # each device computes only its shards: no device ever holds the whole model
        init = lambda key: nn.meta.unbox(Decoder(model).init(key, jnp.zeros((1, 1), jnp.int32))["params"])  # noqa: E731
        return jax.jit(init, out_shardings=shardings)(jax.random.key(seed))
    variables = _jit_init(model)(jax.random.key(seed), jnp.zeros((1, 1), jnp.int32))
    return nn.meta.unbox(variables["params"])


def initial_params(model: ModelConfig, init_from: str | Path | None, seed: int, shardings=None) -> dict:
    """float32 params for ``model``: random from ``seed``, or loaded from ``init_from`` (shapes checked).
    ``shardings`` (a tree of shardings, a run on a mesh): every tensor goes from the host (or the checkpoint)
    straight into its shards."""
    if init_from is None:
        # Compute dtype, remat and attention kernel do not change the initial values: one init per architecture.
        arch = dataclasses.replace(model, param_dtype="float32", dtype="float32", remat=False,
                                   attention=AttentionConfig())
        return _random_params(arch, seed, shardings)
    if _kind(init_from) == "hf":
        from lcx.checkpoints.hf import load_hf, read_hf_params

        _, params = read_hf_params(init_from, "float32") if shardings is not None else load_hf(init_from, "float32")
    else:
        if shardings is not None:  # shapes first: the model's shardings only fit a checkpoint of the same shapes
            check_shapes(abstract_params(model), abstract_params(checkpoint_config(init_from)),
                         f"train.init_from={str(init_from)!r}")
        _, params = load_checkpoint(init_from, shardings=shardings)
    check_shapes(abstract_params(model), params, f"train.init_from={str(init_from)!r}")
    if shardings is not None:
        return jax.tree.map(lambda p, s: sharding.put(np.asarray(p, np.float32) if not isinstance(p, jax.Array)
                                                      else p.astype(jnp.float32), s), params, shardings)
    return jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), params)


__all__ = ["finetune_config", "initial_params", "is_hf_dir", "source_config"]
