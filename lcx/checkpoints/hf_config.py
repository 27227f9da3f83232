"""The ``config.json`` dialect of Hugging Face checkpoints: ``config_from_hf`` (a parsed HF config -> ``ModelConfig``,
refusing what lcx does not implement), ``config_to_hf`` (the way back, transformers v5 layout) and ``with_dtype``.

Both checkpoint formats build on it: ``lcx.checkpoints.hf`` (safetensors directories) and ``lcx.checkpoints.gguf``
(whose metadata becomes an HF config dict first). Both config layouts are read: transformers v5
``rope_parameters`` (per layer type for Gemma 3) and the legacy top-level ``rope_theta`` + ``rope_scaling`` of
released checkpoints.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from lcx.config_base import ConfigError, canonical_dtype, from_dict
from lcx.model import families, rope_scaling
from lcx.model.config import FULL, LAYER_TYPES, SLIDING, ModelConfig, RopeConfig
from lcx.model.families import ARCHITECTURES

# transformers' model_type of each family where it differs from the family name
MODEL_TYPES = {"gemma3": "gemma3_text"}
GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")  # transformers' names of the tanh-approximated GELU


# --------------------------------------------------------------------------------------------------- config
def _refuse(path_hint: str, what: str) -> ConfigError:
    return ConfigError(f"{path_hint}: {what}")


def _rope_from_hf(hf: Mapping[str, Any], where: str) -> tuple[RopeConfig, RopeConfig | None]:
    """``(rope, local_rope)``: the RoPE of global layers and, where a config gives one per layer type (Gemma 3's
    ``rope_parameters: {full_attention: ..., sliding_attention: ...}``), that of sliding-window layers."""
    params = dict(hf.get("rope_parameters") or {})
    legacy = hf.get("rope_scaling") or {}
    if any(isinstance(v, Mapping) for v in params.values()):
        unknown = sorted(set(params) - set(LAYER_TYPES))
        if unknown:
            raise _refuse(where, f"rope_parameters has per-layer-type entries {unknown}; allowed: {list(LAYER_TYPES)}")
        full = _rope_fields(dict(params.get(FULL) or {}), hf, where)
        local = _rope_fields(dict(params[SLIDING]), hf, where) if params.get(SLIDING) else None
        return full, local
    if not params:
        params = dict(legacy)
    local = None
    if hf.get("rope_local_base_freq") is not None:  # Gemma 3 configs from before per-type rope_parameters
        local = RopeConfig(theta=float(hf["rope_local_base_freq"]))
    return _rope_fields(params, hf, where), local


def _rope_fields(params: dict[str, Any], hf: Mapping[str, Any], where: str) -> RopeConfig:
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    known = rope_scaling.hf_types()  # transformers' rope_type -> lcx type, from the RoPE registry
    if rope_type not in known:
        raise _refuse(where, f"rope_type={rope_type!r} is not supported; allowed: {sorted(known)}")
    theta = params.pop("rope_theta", None) or hf.get("rope_theta") or 10000.0
    if "partial_rotary_factor" not in params and hf.get("partial_rotary_factor") is not None:
        params["partial_rotary_factor"] = hf["partial_rotary_factor"]
    if rope_type in ("yarn", "llama3", "longrope") and hf.get("original_max_position_embeddings"):
        # Phi-3 style: the top-level value takes priority (as transformers' standardize_rope_params)
        params["original_max_position_embeddings"] = hf["original_max_position_embeddings"]
    fields = {"type": known[rope_type], "theta": float(theta)}
    keys = rope_scaling.hf_keys()
    for key, value in params.items():
        if key not in keys:
            raise _refuse(where, f"rope parameter {key!r}={value!r} is not supported; known: {sorted(keys)}")
        if value is not None:
            fields[key] = value
    return from_dict(RopeConfig, fields, prefix="rope")


def _layer_types(hf: Mapping[str, Any], family: str, n_layers: int, where: str) -> tuple[str, ...] | None:
    """Each layer's attention type (None: all global), from ``layer_types`` or, in configs written before it
    existed, the family's own rule (transformers computes the same defaults)."""
    types = hf.get("layer_types")
    window = hf.get("sliding_window")
    if types is None:
        if family == "mistral":
            types = [SLIDING if window is not None else FULL] * n_layers
        elif family in ("qwen2", "qwen3"):
            start = hf.get("max_window_layers", n_layers)
            types = [SLIDING if hf.get("use_sliding_window") and window is not None and i >= start else FULL
                     for i in range(n_layers)]
        elif family == "gemma2":
            types = [SLIDING if (i + 1) % 2 else FULL for i in range(n_layers)]
        elif family == "gemma3":
            pattern = hf.get("sliding_window_pattern", 6)
            types = [SLIDING if (i + 1) % pattern else FULL for i in range(n_layers)]
        elif window is not None:
            # a family whose attention has no window rule: dropping the key would run full attention where the
            # checkpoint states a window, so it is refused like any other unsupported field
            raise _refuse(where, f"sliding_window={window!r} is not supported for {family} (its layers have no "
                                 "window rule); allowed: null, or a layer_types list naming the sliding layers; "
                                 "families with a window rule: ['gemma2', 'gemma3', 'mistral', 'qwen2', 'qwen3']")
        else:
            types = [FULL] * n_layers
    if not isinstance(types, (list, tuple)):
        raise _refuse(where, f"layer_types={types!r} must be a list of {list(LAYER_TYPES)}, one per layer")
    types = tuple(types)
    return None if all(t == FULL for t in types) else types


def config_from_hf(hf: Mapping[str, Any], where: str = "config.json") -> ModelConfig:
    """``ModelConfig`` from a parsed HF ``config.json`` dict; refuses what lcx does not implement."""
    archs = hf.get("architectures") or []
    model_type = hf.get("model_type")
    model_types = {MODEL_TYPES.get(f, f): f for f in families.FAMILIES}
    known = [a for a in archs if a in ARCHITECTURES]
    if not known and model_type not in model_types:
        raise _refuse(where, f"architectures={archs!r} (model_type={model_type!r}) is not supported; "
                             f"allowed: {sorted(ARCHITECTURES)}")
    family = ARCHITECTURES[known[0]] if known else model_types[model_type]
    fam = families.FAMILIES[family]
    if fam.activation == "silu":
        if hf.get("hidden_act", "silu") != "silu":
            raise _refuse(where, f"hidden_act={hf['hidden_act']!r} is not supported; lcx implements SwiGLU ('silu') "
                                 f"for {family}")
    else:
        act = hf.get("hidden_activation") or GELU_TANH[0]  # what transformers' Gemma code reads (not hidden_act)
        if act not in GELU_TANH:
            raise _refuse(where, f"hidden_activation={act!r} is not supported; {family} runs {list(GELU_TANH)}")
    if hf.get("mlp_bias"):
        raise _refuse(where, "mlp_bias=true is not supported by lcx")
    if hf.get("use_bidirectional_attention"):
        raise _refuse(where, "use_bidirectional_attention=true (an encoder) is not supported; lcx runs causal "
                             "decoders")
    required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
    missing = [k for k in required if k not in hf]
    if missing:
        raise _refuse(where, f"the required key(s) {missing} are missing (a {family} config.json has "
                             f"{list(required)})")
    n_heads = hf["num_attention_heads"]
    dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    attention_bias = bool(hf.get("attention_bias", False))
    eos = hf.get("eos_token_id")
    types = _layer_types(hf, family, hf["num_hidden_layers"], where)
    rope, local_rope = _rope_from_hf(hf, where)
    fields = {
        "family": family,
        "vocab_size": hf["vocab_size"],
        "d_model": hf["hidden_size"],
        "n_layers": hf["num_hidden_layers"],
        "n_heads": n_heads,
        "n_kv_heads": hf.get("num_key_value_heads") or n_heads,
        "d_ff": hf["intermediate_size"],
        "head_dim": hf.get("head_dim") or hf["hidden_size"] // n_heads,
        "max_position_embeddings": hf.get("max_position_embeddings", 4096),
        "norm_eps": hf.get("rms_norm_eps", 1e-6),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "qkv_bias": fam.qkv_bias or attention_bias,
        "o_bias": attention_bias and not fam.qkv_bias,
        "param_dtype": canonical_dtype(dtype, "config.json dtype"),
        "dtype": canonical_dtype(dtype, "config.json dtype"),
        "bos_token_id": hf.get("bos_token_id"),
        "eos_token_id": eos[0] if isinstance(eos, list) and eos else eos,
        "layer_types": types,
        "sliding_window": hf.get("sliding_window") if types is not None else None,
        # Gemma 3's transformers code does not apply attn_logit_softcapping; lcx computes what transformers does
        "attn_softcap": hf.get("attn_logit_softcapping") if fam.attn_softcap else None,
        "final_softcap": hf.get("final_logit_softcapping"),
        "query_scale": hf.get("query_pre_attn_scalar") if family.startswith("gemma") else None,
        "local_rope": local_rope if types is not None and local_rope != rope else None,
    }
    fields = {k: v for k, v in fields.items() if v is not None}
    try:
        return ModelConfig(**fields, rope=rope)
    except (TypeError, ValueError) as err:
        raise _refuse(where, str(err)) from err


def _rope_to_hf(config: ModelConfig, rope: RopeConfig) -> dict[str, Any]:
    """``rope_parameters`` of config.json: the type's registry entry says which fields it writes."""
    kind = rope_scaling.get(rope.type)
    if rope.rerotate:
        raise ConfigError(f"rope.rerotate=True (type {rope.type!r}) has no transformers config.json form: its cache "
                          "keeps every key rotated with the base of the call that wrote it; export with "
                          "rope.rerotate false (the weights are the same)")
    if kind.to_hf is not None:
        out = kind.to_hf(rope, config.rotary_dim)
    else:
        out = {"rope_type": kind.hf_name, "rope_theta": rope.theta}
        for field in kind.hf_fields:
            value = getattr(rope, field)
            if field == "original_max_position_embeddings":
                value = config.original_max_position_embeddings
            if value is not None:
                out[field] = list(value) if isinstance(value, tuple) else value
    if rope.partial_rotary_factor != 1.0:
        out["partial_rotary_factor"] = rope.partial_rotary_factor
    return out


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """A transformers v5 ``config.json`` dict of ``config.family``.

    A ``llama`` config with q/k/v biases but no output bias (configs written before ``family`` existed) is written as
    Qwen2, whose block it is: a Llama ``config.json`` can only state all four attention biases or none."""
    if config.family == "llama" and config.qkv_bias and not config.o_bias:
        config = dataclasses.replace(config, family="qwen2")
    fam = config.block
    if config.family == "mistral" and config.layer_types is not None and len(set(config.layer_types)) > 1:
        raise ConfigError(f"model.layer_types={list(config.layer_types)} mixes layer types, which a Mistral "
                          "config.json cannot express (its sliding_window applies to every layer)")
    hf = {
        "architectures": [fam.architecture],
        "model_type": MODEL_TYPES.get(config.family, config.family),
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "intermediate_size": config.d_ff,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.norm_eps,
        "tie_word_embeddings": config.tie_embeddings,
        "initializer_range": config.init_std,
        "dtype": config.param_dtype,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "layer_types": list(config.types),
        "sliding_window": config.sliding_window,
    }
    if fam.activation == "silu":
        hf["hidden_act"] = "silu"
    else:
        hf["hidden_activation"] = GELU_TANH[0]
    rope = _rope_to_hf(config, config.rope)
    if config.family == "gemma3":
        hf["rope_parameters"] = {FULL: rope, SLIDING: _rope_to_hf(config, config.local_rope or config.rope)}
    else:
        hf["rope_parameters"] = rope
    if config.family.startswith("gemma"):
        hf["query_pre_attn_scalar"] = config.query_scale or config.head_dim
        hf["final_logit_softcapping"] = config.final_softcap
        hf["attn_logit_softcapping"] = config.attn_softcap
    if config.family in ("qwen2", "qwen3"):
        hf["use_sliding_window"] = config.layer_types is not None
    if config.family == "mistral":
        del hf["layer_types"]
    if not fam.qkv_bias:
        hf["attention_bias"] = bool(config.qkv_bias)
        hf["mlp_bias"] = False
    return hf


def with_dtype(config: ModelConfig, dtype: str | None) -> ModelConfig:
    """``config`` with ``dtype`` (validated) as its parameter and compute dtype; unchanged when ``dtype`` is None."""
    if dtype is None:
        return config
    dt = canonical_dtype(dtype, "dtype")
    return dataclasses.replace(config, param_dtype=dt, dtype=dt)


__all__ = ["GELU_TANH", "MODEL_TYPES", "config_from_hf", "config_to_hf", "with_dtype"]
