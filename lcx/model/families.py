"""Model families: what sets each decoder block apart, and its parameter tree declared once.

A ``Family`` is a row of flags (norm style, sandwich norms, MLP activation, embedding scale, QK-norm, biases) and
``tensors(config)`` is its parameter tree: for every weight the lcx path, the Hugging Face name, the lcx shape and
how the HF layout maps onto it. Loading (safetensors, GGUF), saving and ``ModelConfig.num_params`` all read this one
table; a test checks it against the shapes the model code declares. Adding a family is one row here (plus, for a
genuinely new block, the block code it needs).

Why per-family name maps and not one: Llama's ``post_attention_layernorm`` is the norm *before* the MLP, Gemma's is
the norm *after* attention (its pre-MLP norm is ``pre_feedforward_layernorm``) - same name, same shape, different
meaning. Each family maps names to lcx's own (``attn_norm``, ``post_attn_norm``, ``mlp_norm``, ``post_mlp_norm``),
and a checkpoint with tensors its family does not declare is refused.

HF layouts: ``nn.Linear`` weights are ``[out, in]``; lcx keeps ``[in, ...out]`` with heads split out.

The tables read a config through ``ModelShape`` (its family, sizes and biases): ``lcx.model.config`` builds on this
module (``ModelConfig.block``, ``num_params``), not the other way round.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Protocol

import numpy as np


@dataclasses.dataclass(frozen=True)
class Family:
    """The block of one architecture family (``ModelConfig.family``)."""

    name: str
    architecture: str  # HF ``architectures[0]``
    norm_offset: bool = False  # RMSNorm scales by (1 + w), in float32 before the cast (Gemma); weights init at 0
    sandwich_norms: bool = False  # a norm after attention and after the MLP too, before each residual add (Gemma)
    activation: str = "silu"  # gated MLP activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma)
    embed_scale: bool = False  # embeddings times sqrt(d_model), rounded to the compute dtype (Gemma)
    qk_norm: bool = False  # RMSNorm over head_dim of every query and key head, before RoPE (Qwen3, Gemma 3)
    qkv_bias: bool = False  # q / k / v projections always have biases (Qwen2)
    attn_softcap: bool = False  # reads ``attn_logit_softcapping`` (Gemma 2; Gemma 3's transformers code ignores it)


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llama", "LlamaForCausalLM"),
    Family("mistral", "MistralForCausalLM"),
    Family("qwen2", "Qwen2ForCausalLM", qkv_bias=True),
    Family("qwen3", "Qwen3ForCausalLM", qk_norm=True),
    Family("gemma2", "Gemma2ForCausalLM", norm_offset=True, sandwich_norms=True, activation="gelu_tanh",
           embed_scale=True, attn_softcap=True),
    Family("gemma3", "Gemma3ForCausalLM", norm_offset=True, sandwich_norms=True, activation="gelu_tanh",
           embed_scale=True, qk_norm=True),
)}
ARCHITECTURES = {f.architecture: f.name for f in FAMILIES.values()}


class ModelShape(Protocol):
    """What the parameter table reads of a model config (``lcx.model.config.ModelConfig`` has all of it)."""

    @property
    def family(self) -> str: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def d_model(self) -> int: ...
    @property
    def n_layers(self) -> int: ...
    @property
    def n_heads(self) -> int: ...
    @property
    def n_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int | None: ...
    @property
    def d_ff(self) -> int: ...
    @property
    def qkv_bias(self) -> bool: ...
    @property
    def o_bias(self) -> bool: ...
    @property
    def tie_embeddings(self) -> bool: ...
    @property
    def param_dtype(self) -> str: ...


# --------------------------------------------------------------------------------------------------- tensors
@dataclasses.dataclass(frozen=True)
class Tensor:
    """One weight: ``path`` in the lcx tree (per layer: inside ``layers``), ``hf`` its HF name (per layer: after
    ``model.layers.{i}.``), ``shape`` in lcx, ``kind`` the layout map (see ``KINDS``)."""

    path: tuple[str, ...]
    hf: str
    shape: tuple[int, ...]
    kind: str

    @property
    def hf_shape(self) -> tuple[int, ...]:
        return KINDS[self.kind][0](self.shape)

    def from_hf(self, w: np.ndarray) -> np.ndarray:
        return KINDS[self.kind][1](w, self.shape)

    def to_hf(self, w: np.ndarray) -> np.ndarray:
        return KINDS[self.kind][2](w, self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)


# kind -> (HF shape from the lcx shape, HF -> lcx, lcx -> HF)
KINDS = {
    "same": (lambda s: s, lambda w, s: w, lambda w, s: w),
    # a linear layer: HF [out, in], lcx [in, out]
    "linear": (lambda s: s[::-1], lambda w, s: w.T, lambda w, s: w.T),
    # q / k / v: HF [(n d), e], lcx [e, n, d]
    "heads_in": (lambda s: (s[1] * s[2], s[0]), lambda w, s: w.T.reshape(s),
                 lambda w, s: w.reshape(s[0], s[1] * s[2]).T),
    # o: HF [e, (h d)], lcx [h, d, e]
    "heads_out": (lambda s: (s[2], s[0] * s[1]), lambda w, s: w.T.reshape(s),
                  lambda w, s: w.reshape(s[0] * s[1], s[2]).T),
    # q / k / v bias: HF [(n d)], lcx [n, d]
    "head_bias": (lambda s: (s[0] * s[1],), lambda w, s: w.reshape(s), lambda w, s: w.reshape(-1)),
}


def layer_tensors(config: ModelShape) -> tuple[Tensor, ...]:
    """The tensors of one layer of ``config``'s family (lcx shapes without the layer axis)."""
    fam = FAMILIES[config.family]
    e, h, k, d, f = config.d_model, config.n_heads, config.n_kv_heads, config.head_dim, config.d_ff
    a = "self_attn."
    out = [Tensor(("attn", "q"), a + "q_proj.weight", (e, h, d), "heads_in"),
           Tensor(("attn", "k"), a + "k_proj.weight", (e, k, d), "heads_in"),
           Tensor(("attn", "v"), a + "v_proj.weight", (e, k, d), "heads_in"),
           Tensor(("attn", "o"), a + "o_proj.weight", (h, d, e), "heads_out")]
    if config.qkv_bias:
        out += [Tensor(("attn", "q_bias"), a + "q_proj.bias", (h, d), "head_bias"),
                Tensor(("attn", "k_bias"), a + "k_proj.bias", (k, d), "head_bias"),
                Tensor(("attn", "v_bias"), a + "v_proj.bias", (k, d), "head_bias")]
    if config.o_bias:
        out.append(Tensor(("attn", "o_bias"), a + "o_proj.bias", (e,), "same"))
    if fam.qk_norm:
        out += [Tensor(("attn", "q_norm", "scale"), a + "q_norm.weight", (d,), "same"),
                Tensor(("attn", "k_norm", "scale"), a + "k_norm.weight", (d,), "same")]
    out += [Tensor(("mlp", "gate"), "mlp.gate_proj.weight", (e, f), "linear"),
            Tensor(("mlp", "up"), "mlp.up_proj.weight", (e, f), "linear"),
            Tensor(("mlp", "down"), "mlp.down_proj.weight", (f, e), "linear"),
            Tensor(("attn_norm", "scale"), "input_layernorm.weight", (e,), "same")]
    if fam.sandwich_norms:
        out += [Tensor(("post_attn_norm", "scale"), "post_attention_layernorm.weight", (e,), "same"),
                Tensor(("mlp_norm", "scale"), "pre_feedforward_layernorm.weight", (e,), "same"),
                Tensor(("post_mlp_norm", "scale"), "post_feedforward_layernorm.weight", (e,), "same")]
    else:
        out.append(Tensor(("mlp_norm", "scale"), "post_attention_layernorm.weight", (e,), "same"))
    return tuple(out)


def global_tensors(config: ModelShape) -> tuple[Tensor, ...]:
    """The tensors outside the layers: embedding, final norm and (untied) output head."""
    e, v = config.d_model, config.vocab_size
    out = [Tensor(("embed",), "model.embed_tokens.weight", (v, e), "same"),
           Tensor(("final_norm", "scale"), "model.norm.weight", (e,), "same")]
    if not config.tie_embeddings:
        out.append(Tensor(("lm_head",), "lm_head.weight", (e, v), "linear"))
    return tuple(out)


def layer_name(i: int, tensor: Tensor) -> str:
    """The HF name of ``tensor`` in layer ``i``."""
    return f"model.layers.{i}.{tensor.hf}"


def hf_names(config: ModelShape) -> set[str]:
    """Every HF tensor name a checkpoint of ``config`` holds."""
    return ({t.hf for t in global_tensors(config)}
            | {layer_name(i, t) for i in range(config.n_layers) for t in layer_tensors(config)})


def num_params(config: ModelShape) -> int:
    return (sum(t.size for t in global_tensors(config))
            + config.n_layers * sum(t.size for t in layer_tensors(config)))


def _put(tree: dict, path: tuple[str, ...], value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _get(tree, path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree


def assemble(config: ModelShape, reader) -> dict:
    """lcx params (NumPy, ``config.param_dtype``, layers stacked) from ``reader``: anything with ``get(name,
    hf_shape)`` returning HF-named tensors in HF layout (safetensors, GGUF)."""
    import jax.numpy as jnp

    target = jnp.dtype(config.param_dtype)
    conv = lambda x: np.ascontiguousarray(np.asarray(x).astype(target))  # noqa: E731
    params: dict = {}
    for t in layer_tensors(config):
        stacked = np.stack([conv(t.from_hf(reader.get(layer_name(i, t), t.hf_shape)))
                            for i in range(config.n_layers)])
        _put(params, ("layers", *t.path), stacked)
    for t in global_tensors(config):
        _put(params, t.path, conv(t.from_hf(reader.get(t.hf, t.hf_shape))))
    return params


def to_hf_tensors(config: ModelShape, params) -> dict[str, np.ndarray]:
    """HF-named tensors in HF layout from lcx ``params`` (stacked layers)."""
    arr = lambda x: np.ascontiguousarray(np.asarray(x))  # noqa: E731
    out = {t.hf: arr(t.to_hf(np.asarray(_get(params, t.path)))) for t in global_tensors(config)}
    for t in layer_tensors(config):
        stacked = np.asarray(_get(params["layers"], t.path))
        for i in range(config.n_layers):
            out[layer_name(i, t)] = arr(t.to_hf(stacked[i]))
    return out


__all__ = ["ARCHITECTURES", "FAMILIES", "Family", "ModelShape", "Tensor", "assemble", "global_tensors", "hf_names",
           "layer_name", "layer_tensors", "num_params", "to_hf_tensors"]
