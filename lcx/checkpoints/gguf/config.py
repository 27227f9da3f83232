"""A GGUF file's metadata as a Hugging Face ``config.json`` dict (``hf_config``): what llama.cpp's loader
assumes, RoPE scaling (Llama 3's factors recovered from ``rope_freqs.weight``), and refusals by name."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from lcx.config_base import ConfigError
from lcx.model import rope_scaling
from lcx.checkpoints.gguf.file import ARCHITECTURES, GEMMA_RULES, ROPE_FREQS, GGUFFile, shortest


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
    if ROPE_FREQS in gf.tensors:
        if kind not in (None, "none"):
            raise ConfigError(f"{where}: both {ROPE_FREQS} (Llama 3 RoPE factors) and {arch}.rope.scaling.type="
                              f"{kind!r}; lcx supports one RoPE scaling at a time")
        return _llama3_parameters(gf.dequantize(ROPE_FREQS), theta, head_dim, where)
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
        raise ConfigError(f"{where}: {ROPE_FREQS} has {rf.size} values; head dim {dim} needs {dim // 2}")
    if np.allclose(rf, 1.0):
        return {"rope_type": "default", "rope_theta": theta}
    factor = shortest(rf.max())
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
    raise ConfigError(f"{where}: {ROPE_FREQS} holds per-frequency RoPE factors that are not Llama 3 scaling "
                      f"(max {factor:g}); lcx supports rope_freqs only in the form llama.cpp writes for "
                      "rope_type='llama3'")


__all__ = ['hf_config']
