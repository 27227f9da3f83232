"""Hugging Face checkpoint interop without torch: local directories of config.json + safetensors.

Supported architectures: ``LlamaForCausalLM``, ``MistralForCausalLM`` (without sliding window) and
``Qwen2ForCausalLM`` (full attention). Both config layouts are read: transformers v5 ``rope_parameters`` and the
legacy top-level ``rope_theta`` + ``rope_scaling`` of released Llama 3.x / Qwen2 checkpoints. Anything lcx does not
implement is refused with a clear error rather than loaded silently wrong.

Weight layout: HF ``nn.Linear`` weights are ``[out, in]``; lcx kernels are ``[in, ...out]`` with heads split out
(q: ``[embed, heads, head_dim]``, o: ``[heads, head_dim, embed]``), layers stacked on a leading axis. Both use the
half-split RoPE layout, so no row permutation is needed. ``_assemble`` turns any reader of HF-named tensors into lcx
params; ``lcx.gguf`` feeds it GGUF files (``load_gguf``, also reachable as ``lcx.hf.load_gguf``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from lcx.config_base import ConfigError, canonical_dtype, from_dict
from lcx.model import rope_scaling
from lcx.model.config import ModelConfig, RopeConfig

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


# --------------------------------------------------------------------------------------------------- config
def _refuse(path_hint: str, what: str) -> ConfigError:
    return ConfigError(f"{path_hint}: {what}")


def _rope_from_hf(hf: Mapping[str, Any], where: str) -> RopeConfig:
    params = dict(hf.get("rope_parameters") or {})
    legacy = hf.get("rope_scaling") or {}
    if not params:
        params = dict(legacy)
    if any(isinstance(v, Mapping) for v in params.values()):
        raise _refuse(where, "per-layer-type rope_parameters are not supported by lcx")
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


def config_from_hf(hf: Mapping[str, Any], where: str = "config.json") -> ModelConfig:
    """``ModelConfig`` from a parsed HF ``config.json`` dict; refuses what lcx does not implement."""
    archs = hf.get("architectures") or []
    model_type = hf.get("model_type")
    known = [a for a in archs if a in ARCHITECTURES]
    if not known and model_type not in ARCHITECTURES.values():
        raise _refuse(where, f"architectures={archs!r} (model_type={model_type!r}) is not supported; "
                             f"allowed: {sorted(ARCHITECTURES)}")
    family = ARCHITECTURES[known[0]] if known else model_type
    if hf.get("hidden_act", "silu") != "silu":
        raise _refuse(where, f"hidden_act={hf['hidden_act']!r} is not supported; lcx implements SwiGLU ('silu')")
    if hf.get("mlp_bias"):
        raise _refuse(where, "mlp_bias=true is not supported by lcx")
    if family == "mistral" and hf.get("sliding_window") is not None:
        raise _refuse(where, f"sliding_window={hf['sliding_window']!r}: lcx does not implement sliding-window "
                             "attention; only Mistral checkpoints with sliding_window=null load")
    if family == "qwen2":
        sliding = hf.get("use_sliding_window") or any(t != "full_attention" for t in hf.get("layer_types") or [])
        if sliding:
            raise _refuse(where, "use_sliding_window=true / sliding_attention layers are not supported by lcx")
    required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
    missing = [k for k in required if k not in hf]
    if missing:
        raise _refuse(where, f"the required key(s) {missing} are missing (a {family} config.json has "
                             f"{list(required)})")
    n_heads = hf["num_attention_heads"]
    dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    attention_bias = bool(hf.get("attention_bias", False))
    eos = hf.get("eos_token_id")
    fields = {
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
        "qkv_bias": family == "qwen2" or attention_bias,
        "o_bias": attention_bias and family != "qwen2",
        "param_dtype": canonical_dtype(dtype, "config.json dtype"),
        "dtype": canonical_dtype(dtype, "config.json dtype"),
        "bos_token_id": hf.get("bos_token_id"),
        "eos_token_id": eos[0] if isinstance(eos, list) and eos else eos,
    }
    fields = {k: v for k, v in fields.items() if v is not None}
    rope = _rope_from_hf(hf, where)
    try:
        return ModelConfig(**fields, rope=rope)
    except (TypeError, ValueError) as err:
        raise _refuse(where, str(err)) from err


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


def _rope_to_hf(config: ModelConfig) -> dict[str, Any]:
    """``rope_parameters`` of config.json: the type's registry entry says which fields it writes."""
    rope = config.rope
    kind = rope_scaling.get(rope.type)
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
    """A transformers v5 ``config.json`` dict (Llama, or Qwen2 when the config has q/k/v bias only)."""
    qwen2 = config.qkv_bias and not config.o_bias
    arch, model_type = ("Qwen2ForCausalLM", "qwen2") if qwen2 else ("LlamaForCausalLM", "llama")
    hf = {
        "architectures": [arch],
        "model_type": model_type,
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
        "hidden_act": "silu",
        "initializer_range": config.init_std,
        "dtype": config.param_dtype,
        "rope_parameters": _rope_to_hf(config),
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
    }
    if qwen2:
        hf["use_sliding_window"] = False
    else:
        hf["attention_bias"] = bool(config.qkv_bias)
        hf["mlp_bias"] = False
    return hf


# --------------------------------------------------------------------------------------------------- weights
def _hf_names(i: int) -> dict[str, str]:
    p = f"model.layers.{i}."
    return {
        "q": p + "self_attn.q_proj.weight", "k": p + "self_attn.k_proj.weight", "v": p + "self_attn.v_proj.weight",
        "o": p + "self_attn.o_proj.weight", "q_bias": p + "self_attn.q_proj.bias",
        "k_bias": p + "self_attn.k_proj.bias", "v_bias": p + "self_attn.v_proj.bias",
        "o_bias": p + "self_attn.o_proj.bias", "gate": p + "mlp.gate_proj.weight", "up": p + "mlp.up_proj.weight",
        "down": p + "mlp.down_proj.weight", "attn_norm": p + "input_layernorm.weight",
        "mlp_norm": p + "post_attention_layernorm.weight",
    }


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
    return config, _assemble(config, _TensorReader(path))


def with_dtype(config: ModelConfig, dtype: str | None) -> ModelConfig:
    """``config`` with ``dtype`` (validated) as its parameter and compute dtype; unchanged when ``dtype`` is None."""
    import dataclasses

    if dtype is None:
        return config
    dt = canonical_dtype(dtype, "dtype")
    return dataclasses.replace(config, param_dtype=dt, dtype=dt)


def _layer_keys(config: ModelConfig) -> list[str]:
    """The per-layer tensors (keys of ``_hf_names``) a checkpoint of ``config`` holds."""
    keys = ["q", "k", "v", "o", "gate", "up", "down", "attn_norm", "mlp_norm"]
    if config.qkv_bias:
        keys += ["q_bias", "k_bias", "v_bias"]
    if config.o_bias:
        keys += ["o_bias"]
    return keys


def _tensor_names(config: ModelConfig) -> set[str]:
    """Every HF tensor name ``_assemble`` reads for ``config`` (importers refuse files holding others)."""
    names = {"model.embed_tokens.weight", "model.norm.weight"} | ({"lm_head.weight"} if not config.tie_embeddings
                                                                   else set())
    for i in range(config.n_layers):
        layer = _hf_names(i)
        names |= {layer[key] for key in _layer_keys(config)}
    return names


def _assemble(config: ModelConfig, reader) -> dict:
    """lcx params (NumPy, ``config.param_dtype``) from ``reader``, anything with ``has(name)`` and ``get(name,
    shape)`` that returns HF-named tensors in HF layout (``[out, in]`` linear weights): safetensors or GGUF."""
    import jax.numpy as jnp

    e, h, k, d, f, v = (config.d_model, config.n_heads, config.n_kv_heads, config.head_dim, config.d_ff,
                        config.vocab_size)
    target = jnp.dtype(config.param_dtype)

    def conv(x: np.ndarray) -> np.ndarray:
        return np.asarray(x).astype(target)

    shapes = {"q": ((h * d, e), lambda w: w.T.reshape(e, h, d)),
              "k": ((k * d, e), lambda w: w.T.reshape(e, k, d)),
              "v": ((k * d, e), lambda w: w.T.reshape(e, k, d)),
              "o": ((e, h * d), lambda w: w.T.reshape(h, d, e)),
              "q_bias": ((h * d,), lambda w: w.reshape(h, d)),
              "k_bias": ((k * d,), lambda w: w.reshape(k, d)),
              "v_bias": ((k * d,), lambda w: w.reshape(k, d)),
              "o_bias": ((e,), lambda w: w),
              "gate": ((f, e), lambda w: w.T), "up": ((f, e), lambda w: w.T), "down": ((e, f), lambda w: w.T),
              "attn_norm": ((e,), lambda w: w), "mlp_norm": ((e,), lambda w: w)}
    wanted = _layer_keys(config)
    stacked = {}
    for key in wanted:
        shape, fn = shapes[key]
        stacked[key] = np.stack([conv(fn(reader.get(_hf_names(i)[key], shape))) for i in range(config.n_layers)])
    layers = {
        "attn": {key: stacked[key] for key in wanted if key in
                 ("q", "k", "v", "o", "q_bias", "k_bias", "v_bias", "o_bias")},
        "mlp": {key: stacked[key] for key in ("gate", "up", "down")},
        "attn_norm": {"scale": stacked["attn_norm"]},
        "mlp_norm": {"scale": stacked["mlp_norm"]},
    }
    params = {
        "embed": conv(reader.get("model.embed_tokens.weight", (v, e))),
        "layers": layers,
        "final_norm": {"scale": conv(reader.get("model.norm.weight", (e,)))},
    }
    if not config.tie_embeddings:
        params["lm_head"] = np.ascontiguousarray(conv(reader.get("lm_head.weight", (v, e)).T))
    return params


def save_hf(config: ModelConfig, params: Mapping, path: str | Path, *, max_shard_bytes: int = 4 * 1024**3) -> None:
    """Write ``params`` as a transformers-loadable directory (config.json + safetensors, sharded if large)."""
    from safetensors.numpy import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    e, h, k, d = config.d_model, config.n_heads, config.n_kv_heads, config.head_dim

    def arr(x) -> np.ndarray:
        return np.ascontiguousarray(np.asarray(x))

    tensors: dict[str, np.ndarray] = {"model.embed_tokens.weight": arr(params["embed"]),
                                      "model.norm.weight": arr(params["final_norm"]["scale"])}
    if not config.tie_embeddings:
        tensors["lm_head.weight"] = arr(np.asarray(params["lm_head"]).T)
    attn, mlp = params["layers"]["attn"], params["layers"]["mlp"]
    out = {"q": lambda w: w.reshape(e, h * d).T, "k": lambda w: w.reshape(e, k * d).T,
           "v": lambda w: w.reshape(e, k * d).T, "o": lambda w: w.reshape(h * d, e).T,
           "q_bias": lambda w: w.reshape(h * d), "k_bias": lambda w: w.reshape(k * d),
           "v_bias": lambda w: w.reshape(k * d), "o_bias": lambda w: w}
    for i in range(config.n_layers):
        names = _hf_names(i)
        for key, fn in out.items():
            if key in attn:
                tensors[names[key]] = arr(fn(np.asarray(attn[key][i])))
        for key in ("gate", "up", "down"):
            tensors[names[key]] = arr(np.asarray(mlp[key][i]).T)
        tensors[names["attn_norm"]] = arr(params["layers"]["attn_norm"]["scale"][i])
        tensors[names["mlp_norm"]] = arr(params["layers"]["mlp_norm"]["scale"][i])

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


def load_gguf(path: str | Path, dtype: str | None = None, mesh=None) -> tuple[ModelConfig, dict]:
    """A GGUF file -> ``(ModelConfig, params)``: ``lcx.gguf.load_gguf``, re-exported beside ``load_hf``."""
    import importlib

    # lcx.gguf builds on this module (config_from_hf, _assemble): it is looked up when called, so that neither
    # module imports the other at load time.
    return importlib.import_module("lcx.gguf").load_gguf(path, dtype, mesh)


__all__ = ["ARCHITECTURES", "config_from_hf", "config_to_hf", "load_gguf", "load_hf", "read_hf_config",
           "read_hf_params", "save_hf", "with_dtype"]
