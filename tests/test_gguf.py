"""GGUF import (``lcx.checkpoints.gguf``) and ``lcx convert``, against transformers' own GGUF loader and the source
models.

Each test writes a tiny GGUF with ``gguf.GGUFWriter`` the way llama.cpp's converter does: llama q/k rows permuted
for its interleaved RoPE, 1-D tensors in F32, metadata under llama.cpp's keys, a byte-level BPE tokenizer trained
here with ``tokenizers``. The Python ``gguf`` package cannot quantize K-quants, so those tests write random valid
blocks (scaled to the weights' size) instead of quantized weights: both loaders dequantize the same bytes.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("torch")
pytest.importorskip("transformers")

import lcx  # noqa: E402
from lcx.checkpoints import gguf as lcx_gguf  # noqa: E402
from lcx.config_base import ConfigError  # noqa: E402
from lcx.data.tokenizer import HFTokenizer  # noqa: E402
from tests.conftest import hf_logits, random_hf_model  # noqa: E402

Q = gguf.GGMLQuantizationType
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
SAMPLES = ["Hello world, it's 2024: 12345 apples and 3.14159 pies!",
           "  leading spaces,\ttabs\nand newlines\n\n  ",
           "Unicode: café naïve Straße 日本語 🦙 — done.",
           "I've been 'told' he'll RE-do it; we'D see 1000000 times."]
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")  # Llama 3's tokenizer.json
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")  # Qwen2's tokenizer.json


# --------------------------------------------------------------------------------------------------- tokenizers
def _corpus() -> str:
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    numbers = " ".join(str(n) for n in range(0, 3000, 7))  # merges across digits, which smollm / qwen2 split
    return "\n".join(topics[k] for k in sorted(topics)[:12]) + "\n" + "\n".join(SAMPLES[:2]) + ("\n" + numbers) * 20


def original_tokenizer(pre: str, vocab_size: int = 512):
    """A byte-level BPE with the normalizer / pre-tokenizer of the original tokenizer.json that llama.cpp names
    ``pre`` (what a GGUF's tokenizer must reproduce). Its merges are trained with the GPT-2 pre-tokenizer, so they
    cross the pieces the others split (digit runs, Llama 3's 1-3 digit groups): a missing split shows; for
    ``llama-bpe`` one extra word sits in the vocabulary without merges, reachable only as Llama 3's ignore_merges
    allows."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    extra = ["Ġnewlines"] if pre == "llama-bpe" else []
    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(extra), special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    trained.train_from_iterator([_corpus()], trainer)
    vocab = trained.get_vocab()
    assert not any(word in vocab for word in extra)
    vocab.update({word: len(vocab) + i for i, word in enumerate(extra)})
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
              for m in json.loads(trained.to_str())["model"]["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, ignore_merges=pre == "llama-bpe"))
    tok.add_special_tokens(SPECIALS)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre in ("gpt2", "smollm"))
    split = {"llama-bpe": LLAMA3_REGEX, "qwen2": QWEN2_REGEX}.get(pre)
    steps = ([pre_tokenizers.Digits(individual_digits=True)] if pre == "smollm" else []) + (
        [pre_tokenizers.Split(Regex(split), behavior="isolated")] if split else []) + [byte_level]
    if pre == "qwen2":
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    return tok


def gguf_vocab(tok) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) as llama.cpp's converter writes a byte-level BPE vocabulary."""
    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.get)
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    merges = json.loads(tok.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    return tokens, [3 if t in SPECIALS else 1 for t in tokens], merges


# --------------------------------------------------------------------------------------------------- writing
def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` (convert_hf_to_gguf.py): half-split RoPE rows -> interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_HF_TO_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
               "post_attention_layernorm": "ffn_norm", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm"}


# Gemma's sandwich norms (llama.cpp's converter maps pre_feedforward_layernorm to ffn_norm)
_GEMMA_TO_GGUF = _HF_TO_GGUF | {"post_attention_layernorm": "post_attention_norm",
                                "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}


def gguf_tensors(model, arch: str) -> dict[str, np.ndarray]:
    """The model's weights under GGUF names, q/k permuted as llama.cpp does for llama (not for qwen2 / qwen3 /
    gemma), Gemma's norm weights stored as the scale ``1 + w`` as its converter does."""
    cfg = model.config
    gemma = arch.startswith("gemma")
    names = _GEMMA_TO_GGUF if gemma else _HF_TO_GGUF
    out = {}
    for name, p in model.state_dict().items():
        w = p.detach().float().numpy()
        if gemma and name.endswith("norm.weight"):
            w = w + 1.0
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = w
        elif name == "model.norm.weight":
            out["output_norm.weight"] = w
        elif name == "lm_head.weight":
            if not cfg.tie_word_embeddings:
                out["output.weight"] = w
        else:
            _, _, i, rest = name.split(".", 3)
            module, suffix = rest.rsplit(".", 1)
            if arch in ("llama", "mistral") and module in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = cfg.num_attention_heads if "q_proj" in module else cfg.num_key_value_heads
                w = llama_cpp_permute(w, heads)
            out[f"blk.{i}.{names[module]}.{suffix}"] = w
    return out


def _k_quant_blocks(shape: tuple[int, ...], qtype, std: float, rng) -> np.ndarray:
    """Random valid K-quant blocks whose dequantized values have standard deviation ~``std``."""
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(*shape[:-1], shape[-1] // block, nbytes), dtype=np.uint8)
    # the f16 super-block scales (d, and dmin where there is one) at their byte offsets; the rest is any bytes
    offsets = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}[qtype]

    def set_scale(value: float):
        for off in offsets:
            raw[..., off:off + 2] = np.frombuffer(np.float16(value).tobytes(), np.uint8)

    set_scale(1.0)
    scale = std / float(np.std(gguf.quants.dequantize(raw.reshape(*shape[:-1], -1), qtype)))
    set_scale(scale)
    return raw.reshape(*shape[:-1], -1)


def encode_tensor(w: np.ndarray, qtype, rng) -> tuple[np.ndarray, object]:
    """(data, raw_dtype) for ``GGUFWriter.add_tensor``."""
    if qtype == Q.F32:
        return w.astype(np.float32), None
    if qtype == Q.F16:
        return w.astype(np.float16), None
    if qtype in (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K):
        return _k_quant_blocks(w.shape, qtype, float(np.std(w)) or 0.05, rng), qtype
    try:
        return gguf.quants.quantize(w.astype(np.float32), qtype), qtype
    except NotImplementedError:  # a type lcx refuses (e.g. an i-quant): its bytes never get read
        block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
        return rng.integers(0, 256, size=(*w.shape[:-1], w.shape[-1] // block * nbytes), dtype=np.uint8), qtype


def write_gguf(path, model, arch: str, *, types: dict | None = None, pre: str = "gpt2", tokenizer=None,
               extra=None, extra_tensors=None, name: str = "tiny test model", seed: int = 0):
    """A GGUF of ``model`` as llama.cpp writes it; ``types`` maps a tensor's role (``attn_q``, ``token_embd``, ...)
    to its type (default F32); 1-D tensors stay F32 as llama.cpp keeps them."""
    cfg = model.config
    tok = tokenizer or original_tokenizer(pre, vocab_size=cfg.vocab_size)
    tokens, token_types, merges = gguf_vocab(tok)
    assert len(tokens) == cfg.vocab_size
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    rope = cfg.rope_parameters  # Gemma 3: one entry per layer type, the file states the global layers' base
    w.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_rope_dimension_count(head_dim)
    if head_dim != cfg.hidden_size // cfg.num_attention_heads:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    for key, value in (extra or {}).items():
        getattr(w, key)(*value) if isinstance(value, tuple) else getattr(w, key)(value)
    tensors = gguf_tensors(model, arch) | (extra_tensors or {})
    for tname, array in tensors.items():
        role = tname.split(".")[-2]
        qtype = (types or {}).get(role, Q.F32) if array.ndim == 2 else Q.F32
        data, raw = encode_tensor(array, qtype, rng)
        w.add_tensor(tname, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# --------------------------------------------------------------------------------------------------- helpers
def lcx_logits(path, ids, dtype=None):
    config, params = lcx_gguf.load_gguf(path, dtype=dtype)
    return config, np.asarray(jax.jit(lcx.Decoder(config).apply)({"params": params}, jnp.asarray(ids, jnp.int32)))


def transformers_gguf_model(path):
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


def assert_logits_close(actual, expected, rel=1e-4):
    scale = float(np.max(np.abs(expected)))
    err = float(np.max(np.abs(actual - expected)))
    assert err <= rel * scale, f"max |lcx - reference| = {err:.3g} > {rel} x logit scale {scale:.3g}"


def _ids(vocab, seq=40, batch=2, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, size=(batch, seq))


VOCAB = 512
MIXED = {  # every block type on a permuted (q/k) and a plain tensor across the two cases
    "a": {"attn_q": Q.Q4_0, "attn_k": Q.Q4_1, "attn_v": Q.Q5_0, "attn_output": Q.Q5_1, "ffn_gate": Q.Q8_0,
          "ffn_up": Q.F16, "ffn_down": Q.BF16, "token_embd": Q.Q8_0, "output": Q.Q4_1},
    "b": {"attn_q": Q.Q5_1, "attn_k": Q.Q8_0, "attn_v": Q.BF16, "attn_output": Q.F16, "ffn_gate": Q.Q4_0,
          "ffn_up": Q.Q4_1, "ffn_down": Q.Q5_0, "token_embd": Q.F16, "output": Q.Q8_0},
}
K_QUANTS = {"attn_q": Q.Q4_K, "attn_k": Q.Q6_K, "attn_v": Q.Q2_K, "attn_output": Q.Q3_K, "ffn_gate": Q.Q5_K,
            "ffn_up": Q.Q4_K, "ffn_down": Q.Q6_K, "token_embd": Q.Q6_K}


# --------------------------------------------------------------------------------------------------- (a) logits
@pytest.mark.parity
@pytest.mark.parametrize("case", sorted(MIXED))
def test_quantized_llama_matches_transformers_gguf_loader(case, tmp_path):
    model = random_hf_model("llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=96)
    path = write_gguf(tmp_path / "m.gguf", model, "llama", types=MIXED[case])
    ids = _ids(VOCAB)
    config, ours = lcx_logits(path, ids)
    assert (config.n_heads, config.n_kv_heads, config.tie_embeddings, config.qkv_bias) == (4, 2, False, False)
    assert_logits_close(ours, hf_logits(transformers_gguf_model(path), ids))
    # quantization moved the logits (the file really is quantized), but only a little
    assert not np.allclose(ours, hf_logits(model, ids), atol=1e-3)


@pytest.mark.parity
def test_k_quants_tied_llama_matches_transformers_gguf_loader(tmp_path):
    model = random_hf_model("llama", vocab_size=VOCAB, hidden_size=256, intermediate_size=512,
                            num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True)
    path = write_gguf(tmp_path / "k.gguf", model, "llama", types=K_QUANTS)
    ids = _ids(VOCAB, seq=24)
    config, ours = lcx_logits(path, ids)
    assert config.tie_embeddings and config.head_dim == 64
    assert_logits_close(ours, hf_logits(transformers_gguf_model(path), ids))


@pytest.mark.parity
def test_qwen2_biases_match_transformers_gguf_loader(tmp_path):
    model = random_hf_model("qwen2", vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_key_value_heads=1)
    path = write_gguf(tmp_path / "q.gguf", model, "qwen2", pre="qwen2",
                      types={"attn_q": Q.Q8_0, "attn_k": Q.Q4_1, "attn_v": Q.F16, "ffn_up": Q.Q5_1,
                             "ffn_down": Q.Q4_0, "token_embd": Q.Q8_0, "output": Q.F16})
    ids = _ids(VOCAB)
    config, ours = lcx_logits(path, ids)
    assert config.qkv_bias and not config.o_bias
    assert_logits_close(ours, hf_logits(transformers_gguf_model(path), ids))


@pytest.mark.parity
def test_qwen3_qk_norm_matches_transformers_gguf_loader(tmp_path):
    model = random_hf_model("qwen3", vocab_size=VOCAB, hidden_size=64, intermediate_size=96)
    path = write_gguf(tmp_path / "q3.gguf", model, "qwen3", pre="qwen2", types={"attn_q": Q.Q8_0, "ffn_up": Q.Q4_1})
    ids = _ids(VOCAB)
    config, ours = lcx_logits(path, ids)
    assert config.family == "qwen3" and config.block.qk_norm
    assert_logits_close(ours, hf_logits(transformers_gguf_model(path), ids))


SOURCES = {  # case -> (family, HF config overrides, GGUFWriter calls)
    "default": ("llama", {}, {}),
    "llama_bias": ("llama", {"attention_bias": True, "num_key_value_heads": 1}, {}),  # permuted biases too
    "mistral": ("mistral", {}, {}),
    "qwen2": ("qwen2", {}, {}),
    "linear": ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}},
               {"add_rope_scaling_type": gguf.RopeScalingType.LINEAR, "add_rope_scaling_factor": 4.0}),
    # beta_fast moves the ramp's start only with an original context this long (head_dim 16)
    "yarn": ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                           "original_max_position_embeddings": 256, "beta_fast": 8.0,
                                           "attention_factor": 0.9}},
             {"add_rope_scaling_type": gguf.RopeScalingType.YARN, "add_rope_scaling_factor": 4.0,
              "add_rope_scaling_orig_ctx_len": 256, "add_rope_scaling_yarn_beta_fast": 8.0,
              "add_rope_scaling_yarn_attn_factor": 0.9}),
    # llama.cpp's rules fill in what Gemma files leave out: the layer pattern (every 2nd / 6th layer global), the
    # query scale (the head dim below 27B) and Gemma 3's local RoPE base (10k); norms stored as 1 + w
    "gemma2": ("gemma2", {"tie_word_embeddings": True, "attn_logit_softcapping": 4.0, "final_logit_softcapping": 3.0},
               {"add_sliding_window": 8, "add_attn_logit_softcapping": 4.0, "add_final_logit_softcapping": 3.0}),
    "gemma3": ("gemma3", {"tie_word_embeddings": True, "num_hidden_layers": 6,
                          "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                              "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                 "rope_theta": 1e6}}},
               {"add_sliding_window": 8, "add_rope_scaling_type": gguf.RopeScalingType.LINEAR,
                "add_rope_scaling_factor": 8.0}),
    "llama3": ("llama", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 10000.0,
                                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                             "original_max_position_embeddings": 64}}, {}),
}


def _llama3_rope_freqs(theta, dim, factor, low, high, original) -> np.ndarray:
    """llama.cpp's ``LlamaModel.generate_extra_tensors``: the rope_freqs.weight of a llama3-scaled model."""
    import math

    freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


@pytest.mark.parity
@pytest.mark.parametrize("case", sorted(SOURCES))
def test_f32_gguf_equals_the_source_model(case, tmp_path):
    """Unquantized: lcx's logits equal the HF model the GGUF was written from (the q/k un-permutation, biases,
    RoPE scaling from metadata - including Llama 3 scaling, which transformers' GGUF loader ignores)."""
    family, overrides, extra = SOURCES[case]
    model = random_hf_model(family, vocab_size=VOCAB, hidden_size=64, intermediate_size=96, **overrides)
    extra_tensors = None
    if case == "llama3":
        extra_tensors = {"rope_freqs.weight": _llama3_rope_freqs(10000.0, 16, 8.0, 1.0, 4.0, 64)}
    path = write_gguf(tmp_path / "f.gguf", model, family, pre="qwen2" if family == "qwen2" else "gpt2",
                      extra=extra, extra_tensors=extra_tensors)
    ids = _ids(VOCAB, seq=48)
    config, ours = lcx_logits(path, ids)
    assert config.rope.type == (case if case in ("linear", "yarn", "llama3") else
                                "linear" if case == "gemma3" else "default")
    assert config.o_bias == (case == "llama_bias")
    if family.startswith("gemma"):  # the rules gave the source model's layer pattern, window and query scale
        assert config.types == tuple(model.config.layer_types) and config.sliding_window == 8
        assert config.query_scale == 16 and config.tie_embeddings
    assert_logits_close(ours, hf_logits(model, ids))


@pytest.mark.parity
def test_dtype_and_mesh_and_hf_reexport(tmp_path):
    model = random_hf_model("llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=96)
    path = write_gguf(tmp_path / "m.gguf", model, "llama", types=MIXED["a"])
    config, params = lcx.hf.load_gguf(path, dtype="bfloat16")
    assert config.param_dtype == config.dtype == "bfloat16"
    assert params["layers"]["attn"]["q"].dtype == jnp.bfloat16
    host_config, host = lcx_gguf.read_gguf_params(path)
    assert lcx_gguf.read_gguf_config(path) == host_config and host_config.param_dtype == "float32"
    assert isinstance(host["embed"], np.ndarray) and host["embed"].dtype == np.float32
    np.testing.assert_allclose(np.asarray(params["embed"], np.float32), host["embed"], rtol=1e-2, atol=1e-3)
    mesh = lcx.parallel.sharding.make_mesh(1, 1)
    _, sharded = lcx_gguf.load_gguf(path, mesh=mesh)
    assert isinstance(sharded["embed"], jax.Array)
    np.testing.assert_array_equal(np.asarray(sharded["embed"]), host["embed"])
    with pytest.raises(ConfigError, match="dtype"):
        lcx_gguf.load_gguf(path, dtype="int8")


# --------------------------------------------------------------------------------------------------- (b) tokenizer
def _transformers_gguf_tokenizer(path):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


TOKENIZER_CASES = {  # pre-tokenizer -> (architecture, compare with transformers' GGUF tokenizer too)
    "gpt2": ("llama", True),
    "qwen2": ("qwen2", True),
    # transformers' GGUF converter gives every llama-architecture BPE the GPT-2 pre-tokenizer: it drops SmolLM's
    # digit split and Llama 3's regex, so these compare with the original tokenizer only
    "smollm": ("llama", False),
    "llama-bpe": ("llama", False),
}


@pytest.mark.parity
@pytest.mark.parametrize("pre", sorted(TOKENIZER_CASES))
def test_gguf_tokenizer_matches_original_and_transformers(pre, tmp_path):
    arch, with_transformers = TOKENIZER_CASES[pre]
    original = original_tokenizer(pre)
    model = random_hf_model(arch, vocab_size=original.get_vocab_size(), hidden_size=32, intermediate_size=32,
                            num_hidden_layers=1)
    path = write_gguf(tmp_path / "t.gguf", model, arch, pre=pre, tokenizer=original)
    ours = HFTokenizer(path)
    assert ours.spec == str(path.resolve()) and ours.chat_template == CHAT_TEMPLATE
    assert (ours.bos_id, ours.eos_id, ours.pad_id, ours.vocab_size) == (1, 2, 0, original.get_vocab_size())
    reference = _transformers_gguf_tokenizer(path) if with_transformers else None
    texts = SAMPLES + ["<|im_start|>user\n12 + 34 = 46<|im_end|>"]
    for text in texts:
        ids = ours.encode(text, bos=False)
        assert ids == original.encode(text, add_special_tokens=False).ids, text
        if reference is not None:
            assert ids == reference.encode(text, add_special_tokens=False), text
        if "<|" not in text:
            assert ours.decode(ids) == text
    framed = ours.encode("hi", bos=True, eos=True)
    assert (framed[0], framed[-1], len(framed)) == (1, 2, len(ours.encode("hi", bos=False)) + 2)
    if pre == "smollm":  # the point of the digit split: one token per digit
        assert len(ours.encode("1234567", bos=False)) == 7


def test_sentencepiece_tokenizer_matches_transformers(tmp_path):
    """``tokenizer.ggml.model = llama``: SentencePiece BPE with byte fallback, merges derived from the scores."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trained.train_from_iterator([_corpus()], trainers.BpeTrainer(vocab_size=300, show_progress=False))
    pieces = sorted(trained.get_vocab(), key=trained.get_vocab().get)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    w = gguf.GGUFWriter(str(tmp_path / "spm.gguf"), "llama")
    for key, value in (("block_count", 1), ("context_length", 64), ("embedding_length", 32),
                       ("feed_forward_length", 32), ("head_count", 2), ("head_count_kv", 2)):
        getattr(w, f"add_{key}")(value)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    path = tmp_path / "spm.gguf"
    ours = HFTokenizer(path)
    reference = _transformers_gguf_tokenizer(path)
    for text in SAMPLES:
        ids = ours.encode(text, bos=False)
        assert ids == reference.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == text
    info = lcx_gguf.read_gguf_tokenizer(path)
    assert info.add_bos_token and info.unk_token == "<unk>" and info.bos_token == "<s>"
    assert info.tokenizer.encode("hi").ids[0] == 1  # the post-processor adds BOS for add_bos_token


def test_hf_tokenizer_chat_template_from_files(tmp_path):
    original_tokenizer("gpt2").save(str(tmp_path / "tokenizer.json"))
    assert HFTokenizer(tmp_path).chat_template is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "A", "eos_token": "<|im_end|>"}))
    tok = HFTokenizer(tmp_path)
    assert tok.chat_template == "A" and tok.eos_id == 2
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "B"}]}))
    assert HFTokenizer(tmp_path / "tokenizer.json").chat_template == "B"
    (tmp_path / "chat_template.jinja").write_text("C")
    assert HFTokenizer(tmp_path).chat_template == "C"


# --------------------------------------------------------------------------------------------------- (c) convert
@pytest.mark.parity
def test_convert_writes_a_directory_transformers_loads(tmp_path, capsys):
    import torch
    import transformers

    from lcx.cli import main

    model = random_hf_model("llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=96)
    path = write_gguf(tmp_path / "m.gguf", model, "llama", types=MIXED["a"], pre="smollm")
    out = tmp_path / "hf"
    assert main(["convert", str(path), str(out)]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("lcx convert:") and "Q4_0" in line and len(line.splitlines()) == 1
    converted = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                                  attn_implementation="eager")
    ids = _ids(VOCAB)
    assert_logits_close(hf_logits(converted, ids), hf_logits(transformers_gguf_model(path), ids), rel=1e-5)
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE and config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (config["bos_token"], config["eos_token"], config["add_bos_token"]) == ("<|im_start|>", "<|im_end|>",
                                                                                   False)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
    tok = transformers.AutoTokenizer.from_pretrained(out)
    ours = HFTokenizer(path)
    for text in SAMPLES:
        assert tok.encode(text, add_special_tokens=False) == ours.encode(text, bos=False)
        assert tok.encode(text) == ours.encode(text, bos=False)  # add_bos_token false: nothing added
    # the written directory is an lcx HF checkpoint too: the same config and weights, and its tokenizer carries the
    # chat template
    assert HFTokenizer(out).chat_template == CHAT_TEMPLATE
    hf_config, hf_params = lcx.hf.read_hf_params(out)
    gguf_config, gguf_params = lcx_gguf.read_gguf_params(path)
    assert hf_config == gguf_config
    jax.tree.map(np.testing.assert_array_equal, hf_params, gguf_params)

    # a non-empty OUT_DIR needs --force; bfloat16 on request
    assert main(["convert", str(path), str(out)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert main(["convert", str(path), str(out), "--dtype", "bfloat16", "--force"]) == 0
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


# --------------------------------------------------------------------------------------------------- (d) refusals
@pytest.mark.parity
def test_refuses_unsupported_architecture(tmp_path):
    model = random_hf_model("llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=1)
    path = write_gguf(tmp_path / "g.gguf", model, "gemma")  # Gemma 1: no llama.cpp rules in lcx
    with pytest.raises(ConfigError, match=r"general.architecture='gemma' is not supported; allowed: \['gemma2', "
                                          r"'gemma3', 'llama', 'mistral', 'qwen2', 'qwen3'\]"):
        lcx_gguf.load_gguf(path)


@pytest.mark.parity
def test_refuses_unsupported_tensor_type(tmp_path):
    model = random_hf_model("llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=1)
    path = write_gguf(tmp_path / "iq.gguf", model, "llama", types={"ffn_up": Q.IQ4_NL})
    with pytest.raises(ConfigError, match=r"'blk.0.ffn_up.weight' has type IQ4_NL .*allowed: \['F32', 'F16'"):
        lcx_gguf.load_gguf(path)


@pytest.mark.parity
@pytest.mark.parametrize("what", ["sliding_window", "pre", "unknown_tensor", "rope_freqs", "partial_bias"])
def test_refuses_what_lcx_cannot_run(what, tmp_path):
    model = random_hf_model("llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=1)
    extra, tensors, pre, load = {}, {}, "gpt2", lcx_gguf.load_gguf
    if what == "sliding_window":
        extra, match = {"add_sliding_window": 16}, r"attention.sliding_window=16: lcx does not implement"
    elif what == "pre":
        pre, load, match = "deepseek-llm", HFTokenizer, r"tokenizer.ggml.pre='deepseek-llm' is not supported; allowed"
    elif what == "unknown_tensor":
        tensors = {"blk.0.attn_q_norm.weight": np.ones(8, np.float32)}
        match = r"\['blk.0.attn_q_norm.weight'\] are not part of the llama block"
    elif what == "partial_bias":  # q/k/v biases without the output bias HF's llama attention_bias implies
        tensors = {f"blk.0.attn_{x}.bias": np.zeros(n, np.float32) for x, n in (("q", 32), ("k", 16), ("v", 16))}
        match = r"\['blk.0.attn_output.bias'\] are missing"
    else:  # factors of no Llama 3 form
        tensors = {"rope_freqs.weight": np.linspace(1.0, 3.0, 4).astype(np.float32)[::-1].copy()}
        match = "not Llama 3 scaling"
    path = write_gguf(tmp_path / "x.gguf", model, "llama", pre=pre, extra=extra, extra_tensors=tensors)
    with pytest.raises(ConfigError, match=match):
        load(path)
