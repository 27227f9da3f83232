"""Hugging Face checkpoint interop without torch: local directories of config.json + safetensors.

Supported architectures (``lcx.model.families``): ``LlamaForCausalLM``, ``MistralForCausalLM`` (with or without a
sliding window), ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM`` (sliding-window layers too), ``Gemma2ForCausalLM`` and
``Gemma3ForCausalLM`` (text). Both config layouts are read: transformers v5 ``rope_parameters`` (per layer type for
Gemma 3) and the legacy top-level ``rope_theta`` + ``rope_scaling`` of released checkpoints. Anything lcx does not
implement is refused with a clear error rather than loaded silently wrong.

Weight layout: HF ``nn.Linear`` weights are ``[out, in]``; lcx kernels are ``[in, ...out]`` with heads split out
(q: ``[embed, heads, head_dim]``, o: ``[heads, head_dim, embed]``), layers stacked on a leading axis. Both use the
half-split RoPE layout, so no row permutation is needed. Each family's table (``lcx.model.families``) maps names and
layouts both ways; ``families.assemble`` reads it from any reader of HF-named tensors (safetensors here, GGUF in
``lcx.checkpoints.gguf``). The ``config.json`` dialect (``config_from_hf``, ``config_to_hf``, ``with_dtype``) is
``lcx.checkpoints.hf_config``, which both formats build on; this module re-exports it, and ``load_gguf`` (GGUF's
loader) beside ``load_hf``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from lcx.checkpoints.gguf import load_gguf
from lcx.checkpoints.hf_config import GELU_TANH, MODEL_TYPES, config_from_hf, config_to_hf, with_dtype
from lcx.config_base import ConfigError
from lcx.model import families
from lcx.model.config import ModelConfig
from lcx.model.families import ARCHITECTURES


# --------------------------------------------------------------------------------------------------- config
def read_hf_config(path: str | Path) -> ModelConfig:
    """``ModelConfig`` of a local HF checkpoint directory (reads ``config.json`` only)."""
    cfg_path = Path(path) / "config.json"
    if not cfg_path.is_file():
        raise ConfigError(f"{str(path)!r} is not a Hugging Face checkpoint directory: {cfg_path} does not exist")
    try:
        hf = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{cfg_path} is not valid JSON: {err}") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"{cfg_path} holds a JSON {type(hf).__name__}, not an object of model settings; it is not "
                          "a Hugging Face config.json")
    return config_from_hf(hf, where=str(cfg_path))


# --------------------------------------------------------------------------------------------------- weights
class _TensorReader:
    """Reads tensors by name from one safetensors file or a sharded index, without torch."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        index = path / "model.safetensors.index.json"
        single = path / "model.safetensors"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                files = sorted(set(weight_map.values()))
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as err:
                raise ConfigError(f"{index} is not a valid safetensors index (a JSON object with a 'weight_map' of "
                                  f"tensor name -> shard file): {type(err).__name__}: {err}") from None
            absent = [f for f in files if not (path / f).is_file()]
            if absent:
                raise ConfigError(f"{index} lists shard(s) {absent[:3]} that are missing from {str(path)!r}; "
                                  "download or copy the complete checkpoint")
        elif single.is_file():
            files = ["model.safetensors"]
            weight_map = None
        else:
            raise ConfigError(f"{str(path)!r} holds no model.safetensors or model.safetensors.index.json "
                              "(lcx reads safetensors only; convert .bin checkpoints with transformers first)")
        self._handles = {}
        for f in files:
            try:
                self._handles[f] = safe_open(str(path / f), framework="numpy")
            except Exception as err:  # safetensors raises its own SafetensorError
                raise ConfigError(f"{path / f} is not a readable safetensors file ({type(err).__name__}: "
                                  f"{str(err)[:200]}); the file is truncated or damaged - copy it again") from None
        self._where = {}
        for f, h in self._handles.items():
            for name in h.keys():
                self._where[name] = f
        if weight_map is not None:
            missing = [n for n in weight_map if n not in self._where]
            if missing:
                raise ConfigError(f"{index}: tensors {missing[:3]} listed in the index are missing from the shards")
        self.path = path

    def has(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in self._where:
            raise ConfigError(f"{self.path}: tensor {name!r} is missing from the checkpoint")
        try:
            array = self._handles[self._where[name]].get_tensor(name)
        except Exception as err:
            raise ConfigError(f"{self.path / self._where[name]}: tensor {name!r} cannot be read ({type(err).__name__}: "
                              f"{str(err)[:200]}); the file is truncated or damaged") from None
        if tuple(array.shape) != tuple(shape):
            raise ConfigError(f"{self.path}: tensor {name!r} has shape {tuple(array.shape)}, the config implies "
                              f"{tuple(shape)}")
        return array


def load_hf(path: str | Path, dtype: str | None = None, mesh=None) -> tuple[ModelConfig, dict]:
    """Load a local HF checkpoint directory -> ``(ModelConfig, params)`` (params a plain dict of jax arrays).

    ``dtype`` overrides the storage dtype of the parameters (and the compute dtype); default: the checkpoint's.
    ``mesh``: each tensor goes from the host straight into its shards by lcx's placement rules (no device holds
    the whole model).
    """
    import jax

    config, params = read_hf_params(path, dtype)
    if mesh is not None:
        from lcx.model.placement import shard_params

        return config, shard_params(params, config, mesh)
    return config, jax.tree.map(jax.numpy.asarray, params)


def read_hf_params(path: str | Path, dtype: str | None = None) -> tuple[ModelConfig, dict]:
    """``load_hf`` on the host: ``(ModelConfig, params)`` with NumPy arrays, for placing them elsewhere."""
    path = Path(path)
    config = with_dtype(read_hf_config(path), dtype)
    return config, families.assemble(config, _TensorReader(path))


def save_hf(config: ModelConfig, params: Mapping, path: str | Path, *, max_shard_bytes: int = 4 * 1024**3) -> None:
    """Write ``params`` as a transformers-loadable directory (config.json + safetensors, sharded if large)."""
    from safetensors.numpy import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = families.to_hf_tensors(config, params)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, t in tensors.items():
        if size and size + t.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(path / "model.safetensors"), metadata=meta)
    else:
        weight_map = {}
        n = len(shards)
        for j, shard in enumerate(shards):
            fname = f"model-{j + 1:05d}-of-{n:05d}.safetensors"
            save_file(shard, str(path / fname), metadata=meta)
            weight_map.update({name: fname for name in shard})
        total = sum(t.nbytes for t in tensors.values())
        (path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (path / "config.json").write_text(json.dumps(config_to_hf(config), indent=2))


__all__ = ["ARCHITECTURES", "config_from_hf", "config_to_hf", "load_gguf", "load_hf", "read_hf_config",
           "read_hf_params", "save_hf", "with_dtype"]
