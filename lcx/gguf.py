"""GGUF import (llama.cpp's model file) without torch: ``load_gguf(path) -> (ModelConfig, params)``, the tokenizer
from the file's metadata (``read_gguf_tokenizer``), and through ``lcx convert`` a Hugging Face directory.

Supported:

- ``general.architecture`` llama, mistral, qwen2 and qwen3: the dense, full-attention SwiGLU blocks lcx runs (qwen2
  with q/k/v biases; qwen3 with QK-norm; llama/mistral/qwen3 with all four attention biases or none). Tied embeddings
  = no ``output.weight``.
- gemma2 and gemma3 (text): llama.cpp's file leaves part of the model out of the metadata and its loader fills it
  in by rule; lcx applies the same rules (``GEMMA_RULES``): the layer pattern (Gemma 2: every 2nd layer global,
  the first local; Gemma 3: every 6th, or ``{arch}.attention.sliding_window_pattern`` when a file states it), the
  query scale (``query_pre_attn_scalar``: hidden / heads for the 27B models - 46 and 62 layers - else the head
  dim), Gemma 3's local RoPE base (10,000, unscaled; the global layers take ``rope.freq_base`` and its scaling),
  and Gemma 2's soft-caps (``attn_logit_softcapping`` / ``final_logit_softcapping``, 50 and 30 when absent). The
  converter stores every Gemma RMSNorm weight as ``1 + w`` (the scale the model multiplies by); the reader
  subtracts the 1. Their ``ffn_norm`` is the pre-MLP norm (``pre_feedforward_layernorm``), ``post_attention_norm``
  and ``post_ffw_norm`` the sandwich norms.
- RoPE: default, linear and YaRN (``{arch}.rope.scaling.*``), and Llama 3.x scaling, which llama.cpp stores as a
  ``rope_freqs.weight`` tensor of per-frequency factors: lcx recovers the llama3 parameters from it and refuses
  factors of any other form.
- Tensor types (``TENSOR_TYPES``): F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and the K-quants Q2_K..Q6_K,
  dequantized by the ``gguf`` package into float32, or into ``dtype``.
- Tokenizers (``tokenizer.ggml.model``): ``gpt2`` (byte-level BPE from tokens + merges, the pre-tokenizer named by
  ``tokenizer.ggml.pre``, see ``PRE_TOKENIZERS``) and ``llama`` (SentencePiece BPE with byte fallback from tokens +
  scores), built with the ``tokenizers`` package.

Anything else - another architecture, sliding-window attention or soft-capping outside Gemma, experts, partial
rotary, an i-quant, an unknown tensor - is refused by name rather than loaded wrong.

How: the metadata becomes a Hugging Face ``config.json`` dict, so ``lcx.hf.config_from_hf`` builds and validates
the ``ModelConfig`` exactly as for a HF directory, and ``GGUFTensorReader`` serves the tensors under their HF names
in HF layout, so ``lcx.hf._assemble`` does the reshapes. llama.cpp's converter permutes the rows of llama/mistral q
and k per head (from the half-split RoPE layout to the interleaved pairs its kernel rotates); the reader undoes it.
qwen2 / qwen3 files are written unpermuted (llama.cpp runs them with the half-split "NEOX" rotation).
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any

import numpy as np

from lcx.config_base import ConfigError
from lcx.hf import _assemble, config_from_hf, with_dtype
from lcx.model import rope_scaling
from lcx.model.config import ModelConfig
from lcx.model.families import hf_names

# GGUF general.architecture -> the transformers class whose config.json lcx builds
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
# What llama.cpp's loader assumes for Gemma files (src/llama-model.cpp): per architecture the period of global
# layers, the layer count of the 27B model (whose query scale is hidden / heads, not the head dim), the local RoPE
# base (None: the global one) and the soft-caps used when the file has none.
GEMMA_RULES = {"gemma2": {"pattern": 2, "layers_27b": 46, "local_theta": None,
                          "softcaps": {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}},
               "gemma3": {"pattern": 6, "layers_27b": 62, "local_theta": 10000.0, "softcaps": {}}}
_PERMUTED = ("llama", "mistral")  # q/k rows interleaved by llama.cpp's converter
TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

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
_ROPE_FREQS = "rope_freqs.weight"  # Llama 3 RoPE factors: read into the config, not a parameter

# Metadata lcx cannot honour: key (after "{arch}.") -> (what it means, the values that leave the model unchanged).
_UNSUPPORTED = {
    "expert_count": ("a mixture of experts", (0,)),
    "attn_logit_softcapping": ("attention logit soft-capping", (0,)),
    "final_logit_softcapping": ("final logit soft-capping", (0,)),
    "logit_scale": ("scaled output logits", (1.0,)),
    "embedding_scale": ("scaled embeddings", (1.0,)),
    "residual_scale": ("scaled residuals", (1.0,)),
    "attention.scale": ("a custom attention scale", ()),
    "attention.causal": ("non-causal attention", (True,)),
    "attention.sliding_window_pattern": ("interleaved sliding-window layers", ()),
    "rope.dimension_sections": ("multimodal RoPE sections", ()),
    "rope.scaling.attn_factor": ("a RoPE attention factor outside YaRN", (1.0,)),
    "rope.scaling.yarn_log_multiplier": ("YaRN's log multiplier (mscale_all_dim)", (0,)),
    "rope.scaling.yarn_ext_factor": ("a YaRN extrapolation factor other than 1", (1.0,)),
}
_LLAMA3_ORIGINAL = 8192  # llama.cpp's converter default, and the original context of every Llama 3.x


def _gguf():
    try:
        import gguf
    except ImportError as err:
        raise ConfigError("reading GGUF files needs the 'gguf' package (pip install gguf)") from err
    return gguf


# --------------------------------------------------------------------------------------------------- file
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
        self.meta = {key: _shortest(f.contents()) if f.types == float32 else f.contents()
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


def _shortest(value: float) -> float:
    # GGUF stores float32; its shortest decimal is the value the model's config had (1e-05, not 9.9999997e-06).
    return float(str(np.float32(value)))


# --------------------------------------------------------------------------------------------------- config
def hf_config(gf: GGUFFile) -> dict[str, Any]:
    """A Hugging Face ``config.json`` dict from the GGUF metadata (validated later by ``config_from_hf``)."""
    meta, where = gf.meta, str(gf.path)
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ConfigError(f"{where}: general.architecture={arch!r} is not supported; allowed: {sorted(ARCHITECTURES)}")
    _refuse_unsupported(meta, arch, where)

    def need(name: str):
        key = f"{arch}.{name}"
        if key not in meta:
            raise ConfigError(f"{where}: the metadata key {key!r} is missing (every {arch} GGUF has it)")
        return _uniform(meta[key], key, where)

    hidden, n_heads = need("embedding_length"), need("attention.head_count")
    n_kv = _uniform(meta.get(f"{arch}.attention.head_count_kv", n_heads), f"{arch}.attention.head_count_kv", where)
    head_dim = meta.get(f"{arch}.attention.key_length") or hidden // n_heads
    value_dim = meta.get(f"{arch}.attention.value_length", head_dim)
    if value_dim != head_dim:
        raise ConfigError(f"{where}: {arch}.attention.value_length={value_dim} differs from the key length "
                          f"{head_dim}; lcx needs equal key and value head dims")
    rotary = meta.get(f"{arch}.rope.dimension_count", head_dim)
    if rotary != head_dim:
        raise ConfigError(f"{where}: {arch}.rope.dimension_count={rotary} with head dim {head_dim}: partial rotary "
                          "embeddings are not supported for GGUF files (allowed: rope.dimension_count = head dim)")
    context = need("context_length")
    if arch not in GEMMA_RULES:
        _refuse_sliding_window(meta, arch, context, where)
    hf = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": "gemma3_text" if arch == "gemma3" else arch,
        "vocab_size": _vocab_size(gf, arch),
        "hidden_size": hidden,
        "num_hidden_layers": need("block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "intermediate_size": need("feed_forward_length"),
        "head_dim": head_dim,
        "max_position_embeddings": context,
        "rms_norm_eps": need("attention.layer_norm_rms_epsilon"),
        "tie_word_embeddings": "output.weight" not in gf.tensors,
        "hidden_act": "silu",
        "dtype": "float32",
        "rope_parameters": _rope_parameters(gf, arch, head_dim),
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    if arch in GEMMA_RULES:
        return hf | _gemma_config(meta, arch, hf, where)
    if arch == "qwen2":
        hf["use_sliding_window"] = False
    else:
        hf["use_sliding_window"] = False  # read by qwen3 (a window was refused above), ignored by llama
        # llama.cpp's llama block takes all four attention biases when present (HF's attention_bias)
        hf["attention_bias"] = "blk.0.attn_q.bias" in gf.tensors
        hf["mlp_bias"] = False
    if arch == "mistral":
        hf["sliding_window"] = None
    return hf


def _gemma_config(meta: dict, arch: str, hf: dict, where: str) -> dict[str, Any]:
    """The Gemma keys of the HF config: what the file states, and llama.cpp's rules (``GEMMA_RULES``) for the rest."""
    rules, n_layers = GEMMA_RULES[arch], hf["num_hidden_layers"]
    window = meta.get(f"{arch}.attention.sliding_window")
    if not isinstance(window, int) or window <= 0:
        raise ConfigError(f"{where}: {arch}.attention.sliding_window={window!r}; every {arch} GGUF states its "
                          "sliding window (a positive integer)")
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern", rules["pattern"])
    if isinstance(pattern, list):  # newer files: one flag per layer, true for a sliding-window layer
        if len(pattern) != n_layers:
            raise ConfigError(f"{where}: {arch}.attention.sliding_window_pattern has {len(pattern)} entries for "
                              f"{n_layers} layers")
        local = [bool(x) for x in pattern]
    elif isinstance(pattern, int) and pattern > 0:  # every pattern-th layer is global (llama.cpp's set_swa_pattern)
        local = [i % pattern < pattern - 1 for i in range(n_layers)]
    else:
        raise ConfigError(f"{where}: {arch}.attention.sliding_window_pattern={pattern!r}; allowed: a positive "
                          "period or one flag per layer")
    out = {"hidden_activation": "gelu_pytorch_tanh", "sliding_window": window, "attention_bias": False,
           "layer_types": ["sliding_attention" if x else "full_attention" for x in local],
           "query_pre_attn_scalar": (hf["hidden_size"] // hf["num_attention_heads"]
                                     if n_layers == rules["layers_27b"] else hf["head_dim"])}
    for name, default in rules["softcaps"].items():
        out[name] = float(meta.get(f"{arch}.{name}", default))
    if rules["local_theta"] is not None:
        out["rope_parameters"] = {"full_attention": hf["rope_parameters"],
                                  "sliding_attention": {"rope_type": "default", "rope_theta": rules["local_theta"]}}
    return out


def _uniform(value, key: str, where: str):
    """A per-layer list (some converters write one value per block) must hold one value; lcx has no per-layer
    shapes."""
    if isinstance(value, list):
        if not value or any(v != value[0] for v in value):
            raise ConfigError(f"{where}: {key}={value!r} varies per layer; lcx needs one value for all layers")
        return value[0]
    return value


def _refuse_unsupported(meta: dict, arch: str, where: str) -> None:
    read = set(GEMMA_RULES[arch]["softcaps"]) | {"attention.sliding_window_pattern"} if arch in GEMMA_RULES else set()
    for name, (what, neutral) in _UNSUPPORTED.items():
        key = f"{arch}.{name}"
        if name in read:
            continue
        if key in meta and meta[key] not in neutral:
            raise ConfigError(f"{where}: {key}={meta[key]!r} means {what}, which lcx does not implement"
                              + (f" (allowed: {list(neutral)})" if neutral else ""))


def _refuse_sliding_window(meta: dict, arch: str, context: int, where: str) -> None:
    # A window at least as long as the context never masks anything (Qwen2 files state their full context).
    window = meta.get(f"{arch}.attention.sliding_window")
    if isinstance(window, list) or (window and window < context):
        raise ConfigError(f"{where}: {arch}.attention.sliding_window={window!r}: lcx does not implement "
                          f"sliding-window attention (allowed: absent, 0, or >= the context length {context})")


def _vocab_size(gf: GGUFFile, arch: str) -> int:
    size = gf.meta.get(f"{arch}.vocab_size")
    if size is None and gf.meta.get("tokenizer.ggml.tokens"):
        size = len(gf.meta["tokenizer.ggml.tokens"])
    if size is None and "token_embd.weight" in gf.tensors:
        size = int(gf.tensors["token_embd.weight"].shape[1])
    if size is None:
        raise ConfigError(f"{gf.path}: no vocabulary size ({arch}.vocab_size, tokenizer.ggml.tokens and "
                          "token_embd.weight are all absent)")
    return int(size)


def _rope_parameters(gf: GGUFFile, arch: str, head_dim: int) -> dict[str, Any]:
    """HF ``rope_parameters`` from ``{arch}.rope.*`` (and a ``rope_freqs.weight`` tensor: Llama 3 scaling)."""
    meta, where = gf.meta, str(gf.path)
    theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    kind = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    legacy = meta.get(f"{arch}.rope.scale_linear")  # the key of older llama.cpp files
    if kind is None and legacy not in (None, 1.0):
        kind, factor = "linear", legacy
    if _ROPE_FREQS in gf.tensors:
        if kind not in (None, "none"):
            raise ConfigError(f"{where}: both {_ROPE_FREQS} (Llama 3 RoPE factors) and {arch}.rope.scaling.type="
                              f"{kind!r}; lcx supports one RoPE scaling at a time")
        return _llama3_parameters(gf.dequantize(_ROPE_FREQS), theta, head_dim, where)
    if kind in (None, "none"):
        return {"rope_type": "default", "rope_theta": theta}
    if kind not in ("linear", "yarn"):
        raise ConfigError(f"{where}: {arch}.rope.scaling.type={kind!r} is not supported; allowed: "
                          "['none', 'linear', 'yarn'] (and Llama 3 scaling as rope_freqs.weight)")
    if factor is None:
        raise ConfigError(f"{where}: {arch}.rope.scaling.type={kind!r} needs {arch}.rope.scaling.factor (missing)")
    params = {"rope_type": kind, "rope_theta": theta, "factor": float(factor)}
    if kind == "yarn":
        original = meta.get(f"{arch}.rope.scaling.original_context_length")
        if original is None:
            raise ConfigError(f"{where}: YaRN needs {arch}.rope.scaling.original_context_length (missing)")
        params["original_max_position_embeddings"] = int(original)
        # llama.cpp's converter writes HF's beta_fast / beta_slow / attention_factor under these names
        for gguf_name, hf_name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                                   ("yarn_attn_factor", "attention_factor")):
            value = meta.get(f"{arch}.rope.scaling.{gguf_name}")
            if value is not None:
                params[hf_name] = float(value)
    return params


def _llama3_factors(theta: float, dim: int, factor: float, low: float, high: float, original: int) -> np.ndarray:
    """llama.cpp's ``rope_freqs``: the divisor of each base frequency under Llama 3 scaling."""
    wavelen = 2 * math.pi / rope_scaling.base_inv_freq(theta, dim)
    smooth = (original / wavelen - low) / (high - low)
    blended = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, blended))


def _llama3_parameters(freqs: np.ndarray, theta: float, dim: int, where: str) -> dict[str, Any]:
    """Llama 3 ``rope_parameters`` that reproduce llama.cpp's per-frequency factors, or a refusal.

    Between the two boundary wavelengths a factor is 1 / ((1 - s) / factor + s) with s = (original / wavelen - low)
    / (high - low): linear in 1 / wavelen, so two such points fix it. Only low / original and high / original
    matter; lcx states them against Llama 3's original context (8192), giving Llama 3.x's own low=1, high=4."""
    rf = np.asarray(freqs, np.float64).reshape(-1)
    if rf.shape != (dim // 2,):
        raise ConfigError(f"{where}: {_ROPE_FREQS} has {rf.size} values; head dim {dim} needs {dim // 2}")
    if np.allclose(rf, 1.0):
        return {"rope_type": "default", "rope_theta": theta}
    factor = _shortest(rf.max())
    low, high = 1.0, 4.0  # Llama 3.x's values, when too few factors lie between the boundaries to fit them
    wavelen = 2 * math.pi / rope_scaling.base_inv_freq(theta, dim)
    mid = (rf > 1 + 1e-6) & (rf < factor * (1 - 1e-6))
    if factor > 1 and mid.sum() >= 2:
        smooth = (1 / rf[mid] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(1 / wavelen[mid], smooth, 1)
        if slope > 0:
            low = float(f"{-intercept * _LLAMA3_ORIGINAL / slope:.6g}")
            high = float(f"{low + _LLAMA3_ORIGINAL / slope:.6g}")
    if low > 0 and high > low:
        expected = _llama3_factors(theta, dim, factor, low, high, _LLAMA3_ORIGINAL)
        if np.allclose(expected, rf, rtol=1e-4, atol=0):
            return {"rope_type": "llama3", "rope_theta": theta, "factor": factor, "low_freq_factor": low,
                    "high_freq_factor": high, "original_max_position_embeddings": _LLAMA3_ORIGINAL}
    raise ConfigError(f"{where}: {_ROPE_FREQS} holds per-frequency RoPE factors that are not Llama 3 scaling "
                      f"(max {factor:g}); lcx supports rope_freqs only in the form llama.cpp writes for "
                      "rope_type='llama3'")


# --------------------------------------------------------------------------------------------------- tensors
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
    ``lcx.hf._TensorReader``."""

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
            elif name != _ROPE_FREQS:  # rope_freqs went into the config
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
        if self.arch in _PERMUTED and (".q_proj." in name or ".k_proj." in name):
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


# --------------------------------------------------------------------------------------------------- models
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
    ``lcx.hf.read_hf_config``."""
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
    return config, _assemble(config, reader)


def load_gguf(path: str | Path, dtype: str | None = None, mesh=None) -> tuple[ModelConfig, dict]:
    """Load a GGUF file -> ``(ModelConfig, params)`` (a plain dict of jax arrays), like ``lcx.hf.load_hf``.

    ``dtype`` (float32, bfloat16, float16): the parameter and compute dtype; default float32, whatever the file's
    quantization. ``mesh``: each tensor goes from the host straight into its shards by lcx's placement rules.
    """
    import jax

    config, params = read_gguf_params(path, dtype)
    if mesh is not None:
        from lcx.model.placement import shard_params

        return config, shard_params(params, config, mesh)
    return config, jax.tree.map(jax.numpy.asarray, params)


# --------------------------------------------------------------------------------------------------- tokenizer
@dataclasses.dataclass(frozen=True)
class GGUFTokenizer:
    """A GGUF file's tokenizer: the ``tokenizers.Tokenizer`` and what a ``tokenizer_config.json`` says about it."""

    tokenizer: Any  # tokenizers.Tokenizer
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    unk_id: int | None
    add_bos_token: bool
    add_eos_token: bool
    chat_template: str | None

    def _token(self, tid: int | None) -> str | None:
        return None if tid is None else self.tokenizer.id_to_token(tid)

    @property
    def bos_token(self) -> str | None:
        return self._token(self.bos_id)

    @property
    def eos_token(self) -> str | None:
        return self._token(self.eos_id)

    @property
    def pad_token(self) -> str | None:
        return self._token(self.pad_id)

    @property
    def unk_token(self) -> str | None:
        return self._token(self.unk_id)


_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def _gpt2_pre():
    from tokenizers import pre_tokenizers

    return None, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), False


def _smollm_pre():
    # SmolLM's tokenizer.json (llama.cpp's "smollm": \p{N} then the GPT-2 regex): every digit its own piece
    from tokenizers import pre_tokenizers

    return None, pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                          pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]), False


def _split_pre(regex: str):
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _llama3_pre():
    # Llama 3's tokenizer.json also sets ignore_merges: a pre-token that is itself in the vocabulary is one token
    return None, _split_pre(_LLAMA3_REGEX), True


def _qwen2_pre():
    from tokenizers import normalizers

    return normalizers.NFC(), _split_pre(_QWEN2_REGEX), False


# tokenizer.ggml.pre -> () -> (normalizer, pre-tokenizer, ignore_merges) of the original tokenizer.json
PRE_TOKENIZERS = {"default": _gpt2_pre, "gpt2": _gpt2_pre, "gpt-2": _gpt2_pre, "smollm": _smollm_pre,
                  "llama-bpe": _llama3_pre, "llama3": _llama3_pre, "qwen2": _qwen2_pre}
_CONTROL, _USER_DEFINED, _UNKNOWN = 3, 4, 2  # llama.cpp token types


def read_gguf_tokenizer(path: str | Path) -> GGUFTokenizer:
    """The tokenizer in a GGUF file's metadata (no model tensors are read)."""
    gf = GGUFFile(path)
    return tokenizer_from_metadata(gf.meta, str(gf.path))


def tokenizer_from_metadata(meta: dict[str, Any], where: str) -> GGUFTokenizer:
    model = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if model not in ("gpt2", "llama"):
        raise ConfigError(f"{where}: tokenizer.ggml.model={model!r} is not supported; allowed: ['gpt2', 'llama']")
    if not tokens:
        raise ConfigError(f"{where}: tokenizer.ggml.tokens is missing or empty; the file has no tokenizer")
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    if model == "llama" and unk is None:
        unk = next((i for i, t in enumerate(types) if t == _UNKNOWN), None)
    tok = _bpe(meta, tokens, where) if model == "gpt2" else _sentencepiece(meta, tokens, unk, where)
    _add_special(tok, tokens, types)
    info = GGUFTokenizer(
        tokenizer=tok, bos_id=meta.get("tokenizer.ggml.bos_token_id"), eos_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_id=meta.get("tokenizer.ggml.padding_token_id"), unk_id=unk,
        # llama.cpp's defaults: SentencePiece vocabularies add BOS, byte-level BPE ones (GPT-2) do not
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", model == "llama")),
        add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        chat_template=meta.get("tokenizer.chat_template"))
    _post_processor(info)
    return info


def _merges(meta: dict[str, Any], where: str) -> list[tuple[str, str]] | None:
    raw = meta.get("tokenizer.ggml.merges")
    if raw is None:
        return None
    merges = []
    for merge in raw:
        # "left right"; the separator is the first space after the first character (as llama.cpp splits them)
        cut = merge.find(" ", 1)
        if cut < 0:
            raise ConfigError(f"{where}: tokenizer.ggml.merges holds {merge!r}, not a 'left right' pair")
        merges.append((merge[:cut], merge[cut + 1:]))
    return merges


def _bpe(meta: dict[str, Any], tokens: list[str], where: str):
    from tokenizers import Tokenizer, decoders
    from tokenizers.models import BPE

    pre = meta.get("tokenizer.ggml.pre") or "default"
    if pre not in PRE_TOKENIZERS:
        raise ConfigError(f"{where}: tokenizer.ggml.pre={pre!r} is not supported; allowed: {sorted(PRE_TOKENIZERS)}")
    merges = _merges(meta, where)
    if merges is None:
        raise ConfigError(f"{where}: a 'gpt2' tokenizer needs tokenizer.ggml.merges (missing)")
    normalizer, pre_tokenizer, ignore_merges = PRE_TOKENIZERS[pre]()
    tok = Tokenizer(BPE({t: i for i, t in enumerate(tokens)}, merges, dropout=None, continuing_subword_prefix="",
                        end_of_word_suffix="", fuse_unk=False, byte_fallback=False, ignore_merges=ignore_merges))
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(meta: dict[str, Any], tokens: list[str], unk: int | None, where: str):
    """SentencePiece BPE with byte fallback, "▁" for spaces, as Llama 2's own tokenizer.json.

    The space prefix is a normalizer (prepend "▁" to every text segment) rather than a Metaspace pre-tokenizer with
    prepend_scheme="first": Metaspace skips the prefix when the text already starts with a space and after special
    tokens, where SentencePiece and llama.cpp add it."""
    from tokenizers import Tokenizer, decoders, normalizers
    from tokenizers.models import BPE

    merges = _merges(meta, where)
    if merges is None:
        scores = meta.get("tokenizer.ggml.scores")
        if not scores or len(scores) != len(tokens):
            raise ConfigError(f"{where}: a 'llama' tokenizer needs tokenizer.ggml.merges or one score per token "
                              "(tokenizer.ggml.scores)")
        merges = _merges_from_scores(tokens, scores)
    tok = Tokenizer(BPE({t: i for i, t in enumerate(tokens)}, merges, unk_token=None if unk is None else tokens[unk],
                        fuse_unk=True, byte_fallback=True))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    tok.normalizer = normalizers.Sequence(([normalizers.Prepend("▁")] if prefix else [])
                                          + [normalizers.Replace(" ", "▁")])
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(content=" ", left=1, right=0)] if prefix else []))
    return tok


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges of a SentencePiece vocabulary: every split of a piece into two pieces, ordered by the merged
    piece's score (then the parts' scores) - transformers' GGUFTokenizerSkeleton, with dict lookups."""
    score = {t: scores[i] for i, t in enumerate(tokens)}
    merges = []
    for piece, piece_score in score.items():
        local = [(piece[:k], piece[k:], piece_score) for k in range(1, len(piece))
                 if piece[:k] in score and piece[k:] in score]
        local.sort(key=lambda m: (score[m[0]], score[m[1]]), reverse=True)
        merges.extend(local)
    merges.sort(key=lambda m: m[2], reverse=True)
    return [(left, right) for left, right, _ in merges]


def _add_special(tok, tokens: list[str], types: list[int]) -> None:
    """Control (and unknown) tokens become special added tokens, user-defined ones plain added tokens: matched
    in the raw text before pre-tokenization, as llama.cpp and transformers do."""
    from tokenizers import AddedToken

    special = [AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, types)
               if k in (_CONTROL, _UNKNOWN)]
    user = [AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types) if k == _USER_DEFINED]
    if special:
        tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)


def _post_processor(info: GGUFTokenizer) -> None:
    """BOS/EOS added by ``encode(add_special_tokens=True)`` as ``add_bos_token`` / ``add_eos_token`` say (lcx's own
    ``HFTokenizer`` adds them itself; this is for transformers and the ``tokenizers`` package)."""
    from tokenizers import processors

    head = [info.bos_token] if info.add_bos_token and info.bos_token is not None else []
    tail = [info.eos_token] if info.add_eos_token and info.eos_token is not None else []
    if not head and not tail:
        return
    ids = {info.bos_token: info.bos_id, info.eos_token: info.eos_id}
    single = " ".join([f"{t}:0" for t in head] + ["$A:0"] + [f"{t}:0" for t in tail])
    pair = single + " " + " ".join([f"{t}:1" for t in head] + ["$B:1"] + [f"{t}:1" for t in tail])
    info.tokenizer.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[(t, ids[t]) for t in dict.fromkeys(head + tail)])


__all__ = ["ARCHITECTURES", "PRE_TOKENIZERS", "TENSOR_TYPES", "GGUFFile", "GGUFTensorReader", "GGUFTokenizer",
           "assemble", "hf_config", "load_gguf", "read_gguf", "read_gguf_config", "read_gguf_params",
           "read_gguf_tokenizer", "tokenizer_from_metadata"]
