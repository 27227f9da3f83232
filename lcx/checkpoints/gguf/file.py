"""A GGUF file's metadata and tensor index (the ``gguf`` package's reader), and the names lcx knows."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from lcx.config_base import ConfigError


# GGUF general.architecture -> the transformers class whose config.json lcx builds
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
# What llama.cpp's loader assumes for Gemma files (src/llama-model.cpp): per architecture the period of global
# layers, the layer count of the 27B model (whose query scale is hidden / heads, not the head dim), the local RoPE
# base (None: the global one) and the soft-caps used when the file has none.
GEMMA_RULES = {"gemma2": {"pattern": 2, "layers_27b": 46, "local_theta": None,
                          "softcaps": {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}},
               "gemma3": {"pattern": 6, "layers_27b": 62, "local_theta": 10000.0, "softcaps": {}}}
PERMUTED = ("llama", "mistral")  # q/k rows interleaved by llama.cpp's converter
ROPE_FREQS = "rope_freqs.weight"  # Llama 3 RoPE factors: read into the config, not a parameter
TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

def _gguf():
    try:
        import gguf
    except ImportError as err:
        raise ConfigError("reading GGUF files needs the 'gguf' package (pip install gguf)") from err
    return gguf


class GGUFFile:
    """An opened GGUF file: ``meta`` (metadata key -> Python value) and ``tensors`` (name -> the reader's tensor)."""

    def __init__(self, path: str | Path):
        gguf = _gguf()
        self.path = Path(path)
        if not self.path.is_file():
            raise ConfigError(f"{str(path)!r} does not exist or is not a file (expected a .gguf model file)")
        try:
            reader = gguf.GGUFReader(str(self.path))
        except Exception as err:  # the reader raises ValueError, struct errors, ... on a damaged or foreign file
            raise ConfigError(f"{self.path} is not a readable GGUF file ({type(err).__name__}: "
                              f"{str(err)[:200]})") from None
        float32 = [gguf.GGUFValueType.FLOAT32]
        self.meta = {key: shortest(f.contents()) if f.types == float32 else f.contents()
                     for key, f in reader.fields.items()}
        self.tensors = {t.name: t for t in reader.tensors}

    def dequantize(self, name: str) -> np.ndarray:
        """Tensor ``name`` as float32 in NumPy order (GGUF lists dims innermost first: [in, out] -> (out, in))."""
        tensor = self.tensors[name]
        kind = tensor.tensor_type.name
        if kind not in TENSOR_TYPES:
            raise ConfigError(f"{self.path}: tensor {name!r} has type {kind}, which lcx does not read; allowed: "
                              f"{list(TENSOR_TYPES)}")
        array = _gguf().quants.dequantize(tensor.data, tensor.tensor_type)
        return np.asarray(array, np.float32).reshape(tuple(int(n) for n in reversed(tensor.shape)))


def shortest(value: float) -> float:
    # GGUF stores float32; its shortest decimal is the value the model's config had (1e-05, not 9.9999997e-06).
    return float(str(np.float32(value)))


__all__ = ['ARCHITECTURES', 'GEMMA_RULES', 'GGUFFile', 'TENSOR_TYPES']
