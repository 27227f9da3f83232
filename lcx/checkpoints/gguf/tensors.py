"""A GGUF file's tensors under their Hugging Face names and layout (``GGUFTensorReader``), and the model
loaders built on it (``load_gguf``, ``read_gguf_params``)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from lcx.config_base import ConfigError
from lcx.checkpoints.hf_config import config_from_hf, with_dtype
from lcx.model import families
from lcx.model.config import ModelConfig
from lcx.model.families import hf_names
from lcx.checkpoints.gguf.config import hf_config
from lcx.checkpoints.gguf.file import GEMMA_RULES, PERMUTED, ROPE_FREQS, TENSOR_TYPES, GGUFFile
from lcx.checkpoints.gguf.tokenizer import GGUFTokenizer, tokenizer_from_metadata


# GGUF tensor names -> HF names: the model-level ones, and per block ``blk.{i}.{part}.{weight|bias}``
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
_BLOCK = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}  # the last two: qwen3
# Gemma names its norms after their place in the sandwich block (llama's ffn_norm is the pre-MLP norm in both)
_GEMMA_BLOCK = _BLOCK | {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
                         "post_ffw_norm": "post_feedforward_layernorm"}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def _block_names(arch: str) -> dict[str, str]:
    return _GEMMA_BLOCK if arch in GEMMA_RULES else _BLOCK


def _to_hf(name: str, arch: str) -> str | None:
    """The HF name of GGUF tensor ``name``; None for a name lcx does not know."""
    if name in _GLOBAL:
        return _GLOBAL[name]
    m, block = _BLOCK_RE.fullmatch(name), _block_names(arch)
    if m is None or m.group(2) not in block:
        return None
    return f"model.layers.{m.group(1)}.{block[m.group(2)]}.{m.group(3)}"


class GGUFTensorReader:
    """The tensors of a GGUF file under their Hugging Face names, dequantized to float32 in HF layout (``[out, in]``
    linear weights; llama/mistral q and k rows un-permuted; Gemma norms back to ``w`` from ``1 + w``) - the interface of
    ``lcx.checkpoints.hf._TensorReader``."""

    def __init__(self, gf: GGUFFile, config: ModelConfig, arch: str):
        self.gf, self.config, self.arch = gf, config, arch
        _check_types(gf)  # before anything is dequantized
        self._names = self._map_names()

    def _map_names(self) -> dict[str, str]:
        """HF name -> GGUF name for every tensor; refuses a file whose tensors differ from what the config needs."""
        names, unknown = {}, []
        for name in self.gf.tensors:
            hf_name = _to_hf(name, self.arch)
            if hf_name is not None:
                names[hf_name] = name
            elif name != ROPE_FREQS:  # rope_freqs went into the config
                unknown.append(name)
        expected = hf_names(self.config)
        extra = unknown + [names[n] for n in sorted(set(names) - expected)]
        if extra:
            raise ConfigError(f"{self.gf.path}: tensor(s) {extra[:5]} are not part of the {self.arch} block lcx runs "
                              f"(config: {self.config.n_layers} layers, qkv_bias={self.config.qkv_bias}, o_bias="
                              f"{self.config.o_bias}); ignoring them would compute a different model")
        missing = sorted(expected - set(names))
        if missing:
            raise ConfigError(f"{self.gf.path}: tensor(s) {[self.gguf_name(n) for n in missing[:5]]} are missing "
                              f"({len(missing)} in all); the file is incomplete or not a {self.arch} model")
        return names

    def gguf_name(self, hf_name: str) -> str:
        """The GGUF name of an HF tensor name (for messages)."""
        if hf_name in getattr(self, "_names", {}):
            return self._names[hf_name]
        inverse = {v: k for k, v in _GLOBAL.items()}
        if hf_name in inverse:
            return inverse[hf_name]
        i, rest = hf_name.removeprefix("model.layers.").split(".", 1)
        module, suffix = rest.rsplit(".", 1)
        part = next(k for k, v in _block_names(self.arch).items() if v == module)
        return f"blk.{i}.{part}.{suffix}"

    def has(self, name: str) -> bool:
        return name in self._names

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in self._names:
            raise ConfigError(f"{self.gf.path}: tensor {self.gguf_name(name)!r} ({name}) is missing from the file")
        gguf_name = self._names[name]
        array = self.gf.dequantize(gguf_name)
        if tuple(array.shape) != tuple(shape):
            raise ConfigError(f"{self.gf.path}: tensor {gguf_name!r} has shape {tuple(array.shape)}, the metadata "
                              f"implies {tuple(shape)}")
        if self.arch in PERMUTED and (".q_proj." in name or ".k_proj." in name):
            heads = self.config.n_heads if ".q_proj." in name else self.config.n_kv_heads
            array = _unpermute(array, heads)
        if self.arch in GEMMA_RULES and "norm." in name:  # stored as the scale 1 + w (llama.cpp's converter)
            array = array - 1.0
        return array


def _check_types(gf: GGUFFile) -> None:
    bad = sorted((t.tensor_type.name, n) for n, t in gf.tensors.items() if t.tensor_type.name not in TENSOR_TYPES)
    if bad:
        raise ConfigError(f"{gf.path}: tensor {bad[0][1]!r} has type {bad[0][0]} (types lcx does not read in this "
                          f"file: {sorted({k for k, _ in bad})}); allowed: {list(TENSOR_TYPES)}")


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's converter permutation ``w.reshape(n_head, 2, rows // n_head // 2, ...).swapaxes(1,
    2)``, which reorders each head's rows from the half-split RoPE pairs (i, i + d/2) to adjacent ones (2i, 2i+1);
    biases (1-D) too. transformers' ``LlamaTensorProcessor._reverse_permute_weights`` is the same map."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf(path: str | Path) -> tuple[dict[str, Any], GGUFTensorReader, GGUFTokenizer | None]:
    """``(HF config.json dict, tensor reader, tokenizer or None)`` of a GGUF file; nothing dequantized yet."""
    gf = GGUFFile(path)
    hf = hf_config(gf)
    config = config_from_hf(hf, where=str(gf.path))
    reader = GGUFTensorReader(gf, config, gf.meta["general.architecture"])
    tokenizer = tokenizer_from_metadata(gf.meta, str(gf.path)) if "tokenizer.ggml.tokens" in gf.meta else None
    return hf, reader, tokenizer


def read_gguf_config(path: str | Path) -> ModelConfig:
    """``ModelConfig`` of a GGUF file (metadata only; a ``rope_freqs`` tensor is the one read), like
    ``lcx.checkpoints.hf.read_hf_config``."""
    gf = GGUFFile(path)
    return config_from_hf(hf_config(gf), where=str(gf.path))


def read_gguf_params(path: str | Path, dtype: str | None = None) -> tuple[ModelConfig, dict]:
    """``load_gguf`` on the host: ``(ModelConfig, params)`` with NumPy arrays (float32 unless ``dtype``)."""
    gf = GGUFFile(path)
    hf = hf_config(gf)
    return assemble(GGUFTensorReader(gf, config_from_hf(hf, where=str(gf.path)), gf.meta["general.architecture"]),
                    dtype)


def assemble(reader: GGUFTensorReader, dtype: str | None = None) -> tuple[ModelConfig, dict]:
    """Dequantize every tensor of ``reader`` into lcx params: ``(ModelConfig, params)`` with NumPy arrays."""
    config = with_dtype(reader.config, dtype)
    return config, families.assemble(config, reader)


def load_gguf(path: str | Path, dtype: str | None = None, mesh=None) -> tuple[ModelConfig, dict]:
    """Load a GGUF file -> ``(ModelConfig, params)`` (a plain dict of jax arrays), like ``lcx.checkpoints.hf.load_hf``.

    ``dtype`` (float32, bfloat16, float16): the parameter and compute dtype; default float32, whatever the file's
    quantization. ``mesh``: each tensor goes from the host straight into its shards by lcx's placement rules.
    """
    import jax

    config, params = read_gguf_params(path, dtype)
    if mesh is not None:
        from lcx.model.placement import shard_params

        return config, shard_params(params, config, mesh)
    return config, jax.tree.map(jax.numpy.asarray, params)


__all__ = ['GGUFTensorReader', 'assemble', 'load_gguf', 'read_gguf', 'read_gguf_config', 'read_gguf_params']
