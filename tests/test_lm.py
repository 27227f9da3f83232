"""The text-level API (``lcx.lm``): ``lcx.load`` of an HF directory and of a GGUF file, ``LM.generate`` / ``LM.score``
against the token-level API, the chat template, KVzip's repeat prompt built from the tokenizer, and refusals.

One tiny random Llama (2 layers, d_model 32) with a byte-level BPE tokenizer trained here; the GGUF holds the same
weights (written with ``gguf.GGUFWriter`` as llama.cpp lays them out, without torch)."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest

import lcx
from lcx.config import CacheConfig, ConfigError
from lcx.data.haystack import NOISE, Frame, render_chat
from lcx.data.tokenizer import ByteTokenizer
from lcx.engine import Generator
from lcx.lm import LM
from tests.tiny_chat_model import CHAT, SPECIALS, write_tokenizer

tokenizers = pytest.importorskip("tokenizers")

TEXTS = ["The grass is green.", "Here we go. There and back"]
LONG = [NOISE * 2, "The sky is blue. The sun"]  # the first evicts under a budget of 8
NEW = 6


_tokenizer = write_tokenizer  # the tiny chat model's BPE tokenizer and chat template


def _write_gguf(path, hf_dir, tok, add_bos: bool | None = None):
    """The HF directory's weights and tokenizer as llama.cpp's converter writes a llama GGUF (F32 tensors; q/k rows
    permuted to interleaved RoPE pairs); ``add_bos``: the file's ``tokenizer.ggml.add_bos_token`` (None: absent)."""
    gguf = pytest.importorskip("gguf")
    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    w = gguf.GGUFWriter(str(path), "llama")
    for name, value in (("block_count", cfg["num_hidden_layers"]), ("context_length", cfg["max_position_embeddings"]),
                        ("embedding_length", cfg["hidden_size"]), ("feed_forward_length", cfg["intermediate_size"]),
                        ("head_count", cfg["num_attention_heads"]), ("head_count_kv", cfg["num_key_value_heads"]),
                        ("rope_freq_base", cfg["rope_parameters"]["rope_theta"]),
                        ("layer_norm_rms_eps", cfg["rms_norm_eps"]), ("vocab_size", cfg["vocab_size"]),
                        ("rope_dimension_count", cfg["hidden_size"] // cfg["num_attention_heads"])):
        getattr(w, f"add_{name}")(value)
    vocab = tok.get_vocab(with_added_tokens=True)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(sorted(vocab, key=vocab.get))
    w.add_token_types([3 if t in SPECIALS else 1 for t in sorted(vocab, key=vocab.get)])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in json.loads(tok.to_str())["model"]["merges"]])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.add_chat_template(CHAT)
    parts = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    for name, x in load_file(str(hf_dir / "model.safetensors")).items():
        x = x.astype(np.float32)
        if name in top:
            w.add_tensor(top[name], x)
            continue
        _, _, i, rest = name.split(".", 3)
        module, suffix = rest.rsplit(".", 1)
        if module in ("self_attn.q_proj", "self_attn.k_proj"):  # llama.cpp's LlamaModel.permute
            heads = cfg["num_attention_heads" if "q_proj" in module else "num_key_value_heads"]
            x = x.reshape(heads, 2, x.shape[0] // heads // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)
        w.add_tensor(f"blk.{i}.{parts[module]}.{suffix}", x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(HF directory with tokenizer.json and chat template, the same model as a .gguf)."""
    folder = tmp_path_factory.mktemp("lm")
    hf_dir = folder / "hf"
    hf_dir.mkdir()
    tok = _tokenizer(hf_dir)
    config = lcx.ModelConfig(vocab_size=tok.get_vocab_size(), d_model=32, n_layers=2, n_heads=2, n_kv_heads=1,
                             d_ff=64, max_position_embeddings=256, init_std=0.2, bos_token_id=1, eos_token_id=2)
    lcx.hf.save_hf(config, lcx.init_params(config, jax.random.key(0)), hf_dir)
    gguf_path = folder / "tiny.gguf"
    _write_gguf(gguf_path, hf_dir, tok)
    return hf_dir, gguf_path


@pytest.fixture(scope="module")
def lm(files):
    return lcx.load(files[0])


def _decoded(lm, result):
    return [lm.tokenizer.decode(t[:n]) for t, n in zip(result.tokens, result.lengths)]


@pytest.mark.slow
def test_generate_equals_lcx_generate_on_the_encoded_prompts(lm):
    assert isinstance(lm, LM) and lm.source.startswith("hf ") and lm.eos_id == 2
    ids = [lm.encode(t) for t in TEXTS]
    assert ids == [lm.tokenizer._tok.encode(t).ids for t in TEXTS]  # no BOS: its tokenizer.json adds none
    expected = _decoded(lm, lcx.generate(lm.config, lm.params, ids, max_new_tokens=NEW, eos_id=2))
    assert lm.generate(TEXTS, max_new_tokens=NEW) == expected
    sampled = lcx.generate(lm.config, lm.params, ids, max_new_tokens=NEW, eos_id=2, temperature=0.9, top_p=0.95,
                           seed=7)
    assert lm.generate(TEXTS, max_new_tokens=NEW, temperature=0.9, top_p=0.95, seed=7) == _decoded(lm, sampled)
    # the generator of a setting is kept and reused; the sampling settings go with each call, the seed is its own
    assert lm.generator(NEW) is lm.generator(NEW, "full") is lm.generator(NEW, CacheConfig())
    assert lm.generator(NEW, seed=7) is not lm.generator(NEW) and len(lm._generators) == 2


def test_gguf_file_and_hf_directory_load_the_same_model(lm, files):
    g = lcx.load(files[1])
    assert g.source.startswith("gguf ") and g.config.n_layers == 2 and g.config.vocab_size == lm.config.vocab_size
    assert [g.encode(t) for t in TEXTS] == [lm.encode(t) for t in TEXTS]
    assert g.tokenizer.chat_template == lm.tokenizer.chat_template
    for a, b in zip(jax.tree.leaves(g.params), jax.tree.leaves(lm.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert g.generate(TEXTS, max_new_tokens=NEW) == lm.generate(TEXTS, max_new_tokens=NEW)


def test_chat_applies_the_template(lm):
    text = "Say hi"
    ids = lm.encode(text, chat=True)
    rendered = render_chat(CHAT, [{"role": "user", "content": text}], add_generation_prompt=True)
    assert ids == lm.tokenizer._tok.encode(rendered, add_special_tokens=False).ids  # BOS is the template's own
    assert lm.tokenizer._tok.decode(ids, skip_special_tokens=False) == rendered
    reply = lm.generate(text, max_new_tokens=NEW, chat=True)  # one string in, one out
    assert reply == _decoded(lm, lcx.generate(lm.config, lm.params, [ids], max_new_tokens=NEW, eos_id=2))[0]
    with pytest.raises(ConfigError, match="chat=True needs a chat template, and lcx's byte tokenizer has none"):
        LM(lm.config, lm.params, ByteTokenizer()).generate(text, chat=True)


@pytest.mark.slow
def test_score_equals_generator_score(lm):
    ids = [np.asarray(lm.encode(t)) for t in LONG]
    full = lm.score(LONG)
    assert [x.shape for x in full] == [(len(x) - 1,) for x in ids] and full[0].dtype == np.float32
    padded = np.zeros((len(ids), max(len(x) for x in ids)), np.int32)  # causal: padding after a text is unseen
    for row, x in zip(padded, ids):
        row[:len(x)] = x
    logits = np.asarray(jax.nn.log_softmax(lcx.Decoder(lm.config).apply({"params": lm.params}, padded)))
    for x, lp, row in zip(ids, full, logits):  # the full cache: the decoder's own next-token log-probabilities
        np.testing.assert_allclose(lp, row[np.arange(len(x) - 1), x[1:]], atol=2e-4)
    cache = {"policy": "streaming", "budget": 8, "sinks": 2, "interval": 4}
    streamed = lm.score(LONG, cache=cache)
    width = max(len(x) for x in ids) - 1
    gen = Generator(lm.config, lm.params, max_new_tokens=width, cache=CacheConfig(**cache), eos_id=2)
    rest = np.zeros((len(ids), width), np.int32)
    for row, x in zip(rest, ids):
        row[:len(x) - 1] = x[1:]
    _, want = gen.score(gen.prefill([x[:1] for x in ids]), rest)
    for lp, w, x in zip(streamed, want, ids):
        np.testing.assert_allclose(lp, w[:len(x) - 1], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(streamed[0][:8], full[0][:8], atol=2e-4)  # nothing evicted yet
    assert np.abs(streamed[0] - full[0]).max() > 1e-2  # then the policy shows


@pytest.mark.slow
def test_kvzip_gets_its_repeat_prompt_from_the_tokenizer(lm):
    cache = {"policy": "kvzip", "budget": 8, "chunk": 16, "interval": 64}
    with pytest.raises(ConfigError, match="pass Generator\\(reconstruction=...\\)"):
        Generator(lm.config, lm.params, max_new_tokens=NEW, cache=CacheConfig(**cache))
    out = lm.generate(LONG, max_new_tokens=NEW, cache=cache)
    gen = Generator(lm.config, lm.params, max_new_tokens=NEW, cache=CacheConfig(**cache), eos_id=2,
                    reconstruction=Frame(lm.tokenizer).reconstruction())
    assert out == _decoded(lm, gen.result(gen.decode(gen.prefill([lm.encode(t) for t in LONG]))))
    chat = lm.generator(NEW, cache, chat=True)  # in the chat frame: the template's header skipped, its tail after
    assert chat is not lm.generator(NEW, cache)
    assert chat.reconstruction == Frame(lm.tokenizer, lm.chat_template).reconstruction() != gen.reconstruction


@pytest.mark.slow
def test_a_compression_ratio_sizes_the_cache_for_the_prompts(lm):
    """``{"policy": ..., "compression": c}`` keeps round((1 - c) x longest prompt) tokens, compressed once after the
    whole prompt - the ablation grid's one_shot cell."""
    from lcx.eval.config import Setting
    from lcx.lm import at_compression

    longest = max(len(lm.encode(t)) for t in LONG)
    resolved = at_compression({"policy": "tova", "compression": 0.75}, longest, NEW)
    assert resolved == Setting(spec=(("policy", "tova"),), compression=0.75, protocol="one_shot").cache(longest, NEW)
    assert resolved.budget == round(0.25 * longest) and resolved.interval == longest + NEW
    out = lm.generate(LONG, max_new_tokens=NEW, cache={"policy": "tova", "compression": 0.75})
    gen = Generator(lm.config, lm.params, max_new_tokens=NEW, cache=resolved, eos_id=lm.eos_id)
    assert out == _decoded(lm, gen.result(gen.decode(gen.prefill([lm.encode(t) for t in LONG]))))
    for bad, message in (({"policy": "tova", "compression": 1.5}, "cache.compression=1.5 is invalid"),
                         ({"policy": "tova", "compression": 0.5, "budget": 8}, "give one of them"),
                         ({"compression": 0.5}, "name an evicting policy")):
        with pytest.raises(ConfigError, match=message):
            lm.generate(LONG, max_new_tokens=NEW, cache=bad)


def test_bos_as_the_tokenizer_says(lm, files, tmp_path):
    """A plain prompt begins with BOS only when the tokenizer adds one - a tokenizer.json's post-processor, a GGUF's
    tokenizer.ggml.add_bos_token - so lcx's ids are the tokenizers library's (transformers', llama.cpp's); the
    eval frame, KVzip's repeat prompt and ``lcx generate`` follow; a chat prompt keeps its template's BOS text."""
    import shutil

    from tokenizers import Tokenizer, processors

    from lcx.cli.generate import _tokenizer

    text = TEXTS[0]
    own = Tokenizer.from_file(str(files[0] / "tokenizer.json"))
    plain = own.encode(text, add_special_tokens=False).ids
    # no post-processor (SmolLM2's tokenizer.json adds no BOS either): the library's own encode, no BOS
    assert not lm.tokenizer.adds_bos and lm.encode(text) == own.encode(text).ids == plain
    assert _tokenizer(str(files[0]), lm.config)[0](text) == plain  # lcx generate --prompt
    assert lm.encode(text, chat=True)[0] == 1  # the chat template writes <|im_start|>, the BOS token
    assert Frame(lm.tokenizer).wrap(["ctx"], "q", "a")[0] == "ctx" and Frame(lm.tokenizer).reconstruction().skip == 0
    # a post-processor that adds BOS (TemplateProcessing): BOS first, as the library's encode
    own.post_processor = processors.TemplateProcessing(single="<|im_start|> $A", pair="<|im_start|> $A $B:1",
                                                       special_tokens=[("<|im_start|>", 1)])
    folder = tmp_path / "with_bos"
    folder.mkdir()
    own.save(str(folder / "tokenizer.json"))
    shutil.copy(files[0] / "tokenizer_config.json", folder)
    with_bos = lcx.load(files[0], tokenizer=str(folder))
    assert with_bos.tokenizer.adds_bos and with_bos.encode(text) == own.encode(text).ids == [1, *plain]
    frame = Frame(with_bos.tokenizer)
    assert frame.context_pieces(["ctx"]) == 2 and frame.reconstruction().skip == 1  # KVzip skips the BOS
    assert list(frame.wrap(["ctx"], "q", "a")[0]) == [1]
    # a GGUF: tokenizer.ggml.add_bos_token false / true (absent in a BPE file: llama.cpp's default, false)
    for flag in (False, True, None):
        path = tmp_path / f"bos_{flag}.gguf"
        _write_gguf(path, files[0], own, add_bos=flag)
        g = lcx.load(path)
        assert g.tokenizer.adds_bos is bool(flag) and g.encode(text) == [1] * bool(flag) + plain, flag
    # explicit callers keep encode(text, bos=...) as they ask
    assert lm.tokenizer.encode(text, bos=True) == [1, *plain] and with_bos.tokenizer.encode(text, bos=False) == plain


def test_bad_inputs_are_refused_naming_the_argument(lm, files, tmp_path):
    with pytest.raises(ConfigError, match="path='.*nowhere' does not exist"):
        lcx.load(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="tokenizer='missing.json' does not exist: must be 'auto', 'bytes' or"):
        lcx.load(files[0], tokenizer="missing.json")
    with pytest.raises(ConfigError, match="tokenizer=None is invalid: must be 'auto', 'bytes' or a path"):
        lcx.load(files[0], tokenizer=None)
    bare = tmp_path / "bare"
    lcx.hf.save_hf(lm.config, lm.params, bare)
    with pytest.raises(ConfigError, match="tokenizer='auto' found none: .* without tokenizer.json; pass tokenizer="):
        lcx.load(bare)
    assert isinstance(lcx.load(bare, tokenizer="bytes").tokenizer, ByteTokenizer)
    for kwargs, message in [
            (dict(texts=42), "texts=42 is invalid: must be a string or a non-empty list of strings"),
            (dict(texts=[]), "texts=\\[\\] is invalid"), (dict(texts=["ok", 3]), "texts=\\['ok', 3\\] is invalid"),
            (dict(cache=3.5), "cache=3.5 is invalid: must be None \\(the full cache\\), a lcx.CacheConfig, a dict"),
            (dict(cache="snapkv"), "cache.budget=None is invalid for cache.policy='snapkv'"),
            (dict(cache={"policy": "nope"}), "cache.policy='nope' is not a registered eviction policy"),
            (dict(cache={"budget": "x"}), "cache.budget"),
            (dict(temperature=-1), "temperature=-1 is invalid"), (dict(top_p=2.0), "top_p=2.0 is invalid"),
            (dict(max_new_tokens=0), "max_new_tokens=0 is invalid"), (dict(seed="a"), "seed='a' is invalid"),
            (dict(chat="yes"), "chat='yes' is invalid")]:
        with pytest.raises(ConfigError, match=message):
            lm.generate(**{"texts": "ok", **kwargs})
    with pytest.raises(ConfigError, match="prefix=0 is invalid: must be a positive integer"):
        lm.score("ok", prefix=0)
    with pytest.raises(ConfigError, match="texts\\[1\\]='o' has 1 tokens: score needs more than prefix=1"):
        lm.score(["ok", "o"])  # one character, one token: no BOS before it (the tokenizer adds none)
    with pytest.raises(ConfigError, match="texts\\[0\\]='' encodes to no tokens"):
        LM(lm.config, lm.params, ByteTokenizer(bos_id=None)).generate("")


def test_lcx_run_loads_with_its_recorded_tokenizer(lm, tmp_path):
    """An lcx run's checkpoint (written as training writes it) with the tokenizer the run recorded: bytes for one
    that recorded none."""
    from types import SimpleNamespace

    from lcx.train.checkpoint import meta_for, open_manager, save

    model = dataclasses.replace(lm.config, vocab_size=260, bos_token_id=None, eos_token_id=None)
    params = lcx.init_params(model, jax.random.key(1))
    manager = open_manager(tmp_path / "run" / "train" / "checkpoints", async_save=False)
    save(manager, SimpleNamespace(step=np.int32(1), params=params, opt_state={"mu": np.zeros(2)}, rng=np.zeros(2)),
         meta_for(model, 0))
    manager.close()
    run = lcx.load(tmp_path / "run")
    assert run.source.startswith("lcx ") and isinstance(run.tokenizer, ByteTokenizer) and run.config == model
    for a, b in zip(jax.tree.leaves(run.params), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert run.encode("hi") == [257, 104, 105] and run.eos_id == 258  # generation: as from any other source
