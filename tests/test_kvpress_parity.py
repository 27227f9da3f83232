"""Parity with NVIDIA kvpress, the PyTorch reference for KV-cache compression: on a random Llama written by
transformers, a kvpress press and the lcx policy of the same rule keep the same token positions per layer and KV
head, and greedy decoding after the compression gives the same tokens.

kvpress compresses once, after prefill, to ``int(P x (1 - compression_ratio))`` tokens per head; lcx does the same
when the whole prompt is one prefill chunk and ``interval`` leaves room for the decoded tokens (no decode eviction).
Positions stay the original ones (kvpress does not re-rotate keys).
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
kvpress = pytest.importorskip("kvpress")

from lcx import hf  # noqa: E402
from lcx.cache.config import CacheConfig  # noqa: E402
from lcx.engine import Generator  # noqa: E402
from tests.conftest import random_hf_model  # noqa: E402

pytestmark = pytest.mark.parity

PROMPT, RATIO, NEW = 40, 0.5, 16
KEPT = int(PROMPT * (1 - RATIO))


def _presses():
    """(kvpress press, lcx policy parameters, attention implementation kvpress needs)."""
    snap = dict(policy="snapkv", window=8, kernel=5, pooling="avg")
    return {
        "streaming": (kvpress.StreamingLLMPress(RATIO, n_sink=4), dict(policy="streaming", sinks=4), "eager"),
        "snapkv": (kvpress.SnapKVPress(RATIO, window_size=8, kernel_size=5), snap, "eager"),
        "knorm": (kvpress.KnormPress(RATIO), dict(policy="knorm"), "eager"),
        "tova": (kvpress.TOVAPress(RATIO), dict(policy="tova"), "eager"),
        "observed": (kvpress.ObservedAttentionPress(RATIO), dict(policy="observed"), "eager"),
        "adakv-snapkv": (kvpress.AdaKVPress(kvpress.SnapKVPress(RATIO, window_size=8, kernel_size=5)),
                         dict(snap, head_budget="adaptive", head_floor=0.2), "sdpa"),
        "adakv-knorm": (kvpress.AdaKVPress(kvpress.KnormPress(RATIO)),
                        dict(policy="knorm", head_budget="adaptive", head_floor=0.2), "sdpa"),
        # whole chunks of 4 by their mean SnapKV score, one set per layer: 10 chunks, 5 kept
        "chunkkv": (kvpress.ChunkKVPress(kvpress.SnapKVPress(RATIO, window_size=8, kernel_size=5), chunk_length=4),
                    dict(snap, policy="chunkkv", chunk=4), "sdpa"),
        # keys scored against the mean and covariance of the prompt's queries, rotated to the next 512 positions
        "expected_attention": (kvpress.ExpectedAttentionPress(RATIO, n_future_positions=512, n_sink=4),
                               dict(policy="expected_attention", horizon=512, sinks=4), "sdpa"),
        # keys least like their head's mean key direction (lcx/cache/keydiff.py)
        "keydiff": (kvpress.KeyDiffPress(RATIO), dict(policy="keydiff"), "eager"),
        # value leverage weighted by relevance to the prompt's mean query, rotated to the next 512 positions
        # (lcx/cache/capkv.py: the query mean is the cache's running one, Observes(moments=1))
        "capkv": (kvpress.CapPress(RATIO, tau=5.0, n_future_positions=512, n_sink=4),
                  dict(policy="capkv", tau=5.0, horizon=512, sinks=4), "sdpa"),
    }


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A 3-layer Llama with 2 KV heads of 2 query heads each; weights large enough for peaked attention."""
    path = tmp_path_factory.mktemp("llama")
    model = random_hf_model("llama", std=0.2, num_hidden_layers=3, eos_token_id=None, bos_token_id=None,
                            pad_token_id=None)
    model.save_pretrained(path)
    return path, np.random.default_rng(3).integers(0, 128, (1, PROMPT))


def _kvpress_run(path, press, attn: str, prompt: np.ndarray):
    """kvpress: prefill under the press, kept positions ``[L, k, P]`` bool, then greedy tokens as kvpress's
    pipeline decodes (explicit position ids from the context length on)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn).eval()
    ids = torch.as_tensor(prompt)
    with torch.no_grad():
        full = transformers.DynamicCache()
        model(input_ids=ids, past_key_values=full)
        cache = transformers.DynamicCache()
        with press(model):
            out = model(input_ids=ids, past_key_values=cache)
        kept = []
        for layer, attention in enumerate(model.model.layers):
            masked = getattr(attention.self_attn, "masked_key_indices", None)
            if masked is not None:  # AdaKV: the cache keeps every key, the masked ones can never be attended
                keep = np.ones(full.layers[layer].keys.shape[1:3], bool)
                keep[masked[1].numpy(), masked[2].numpy()] = False
            else:  # the compressed keys are rows of the full keys, in the press's order
                ref, got = full.layers[layer].keys[0], cache.layers[layer].keys[0]  # [k, P, d], [k, n, d]
                match = torch.cdist(got, ref).argmin(-1).numpy()  # [k, n]
                keep = np.zeros(ref.shape[:2], bool)
                np.put_along_axis(keep, match, True, axis=1)
                assert keep.sum(-1).tolist() == [got.shape[1]] * ref.shape[0], "duplicate key rows"
            kept.append(keep)
        tokens, position = [out.logits[0, -1].argmax()], PROMPT
        for _ in range(NEW - 1):
            out = model(input_ids=tokens[-1].reshape(1, 1), past_key_values=cache,
                        position_ids=torch.tensor([[position]]))
            tokens.append(out.logits[0, -1].argmax())
            position += 1
    return np.stack(kept), np.array([int(t) for t in tokens])


def _lcx_run(path, params: dict, prompt: np.ndarray):
    config, weights = hf.load_hf(path)
    cache = CacheConfig(budget=KEPT, interval=64, prefill_chunk=PROMPT, positions="original", **params)
    gen = Generator(config, weights, max_new_tokens=NEW, cache=cache)
    state = gen.prefill(prompt.tolist())
    pos, valid = np.asarray(state.cache.pos)[:, 0], np.asarray(state.cache.valid)[:, 0]  # [L, H, C]
    kept = np.zeros((config.n_layers, config.n_kv_heads, PROMPT), bool)
    for layer in range(config.n_layers):
        for head in range(config.n_kv_heads):
            h = head if pos.shape[1] > 1 else 0  # a shared keep set serves every KV head
            kept[layer, head, pos[layer, h][valid[layer, h]]] = True
    return kept, np.asarray(gen.result(gen.decode(state)).tokens[0])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(_presses()))
def test_kept_positions_and_greedy_tokens_equal_kvpress(name, checkpoint):
    path, prompt = checkpoint
    press, params, attn = _presses()[name]
    ref_kept, ref_tokens = _kvpress_run(path, press, attn, prompt)
    kept, tokens = _lcx_run(path, params, prompt)
    assert ref_kept.sum() == kept.sum() == ref_kept.shape[0] * ref_kept.shape[1] * KEPT
    for layer in range(kept.shape[0]):
        for head in range(kept.shape[1]):
            np.testing.assert_array_equal(np.flatnonzero(kept[layer, head]), np.flatnonzero(ref_kept[layer, head]),
                                          err_msg=f"{name}: layer {layer} KV head {head}")
    np.testing.assert_array_equal(tokens, ref_tokens)
    assert len(set(ref_tokens.tolist())) > 3  # a non-degenerate continuation


def test_per_head_sets_differ_where_kvpress_is_per_head(checkpoint):
    """The point of per-head sets: kvpress's K-norm keeps different tokens in the two KV heads of a layer."""
    path, prompt = checkpoint
    press, params, attn = _presses()["knorm"]
    ref_kept, _ = _kvpress_run(path, press, attn, prompt)
    assert any((ref_kept[layer, 0] != ref_kept[layer, 1]).any() for layer in range(ref_kept.shape[0]))


def _byte_tokenizer(folder) -> None:
    """A byte-level BPE without merges (one id per byte; 256 ids) and no chat template, as kvpress's KVzip loads it
    from the checkpoint's folder."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))


@pytest.mark.slow
def test_kvzip_reconstruction_scores_keep_what_kvpress_keeps(tmp_path):
    """KVzip: the context is repeated in chunks of 16 (three passes, the later two led by kvpress's second prompt
    and the previous chunk's last 8 tokens); each layer keeps its 2 x 20 best (KV head, position) scores
    (kvpress ``layerwise=True``; lcx: an adaptive head budget without floor, capped at the whole layer) - or the
    cache keeps its 3 x 2 x 20 best over every layer (kvpress's default; lcx ``head_budget: global``)."""
    from lcx.data.haystack import Frame
    from lcx.data.tokenizer import HFTokenizer

    model = random_hf_model("llama", std=0.2, num_hidden_layers=3, vocab_size=256, eos_token_id=None,
                            bos_token_id=None, pad_token_id=None)
    model.save_pretrained(tmp_path)
    _byte_tokenizer(tmp_path)
    prompt = np.random.default_rng(3).integers(0, 256, (1, PROMPT))
    reconstruction = Frame(HFTokenizer(tmp_path)).reconstruction()
    assert reconstruction.skip == 0 and len(reconstruction.first) > 30  # a byte per character, no BOS or header
    config, weights = hf.load_hf(tmp_path)
    for layerwise, head_budget in ((True, "adaptive"), (False, "global")):
        press = kvpress.KVzipPress(RATIO, layerwise=layerwise, n_sink=4, chunk_size=16)
        ref_kept, ref_tokens = _kvpress_run(tmp_path, press, "sdpa", prompt)
        cache = CacheConfig(policy="kvzip", budget=KEPT, interval=64, prefill_chunk=PROMPT, sinks=4, chunk=16,
                            head_budget=head_budget, head_floor=0.0, head_cap=PROMPT / KEPT)
        gen = Generator(config, weights, max_new_tokens=NEW, cache=cache, reconstruction=reconstruction)
        state = gen.prefill(prompt.tolist())
        pos, valid = np.asarray(state.cache.pos)[:, 0], np.asarray(state.cache.valid)[:, 0]  # [L, k, C]
        kept = np.zeros_like(ref_kept)
        for layer in range(config.n_layers):
            for head in range(config.n_kv_heads):
                kept[layer, head, pos[layer, head][valid[layer, head]]] = True
        assert ref_kept.sum() == kept.sum() == config.n_layers * config.n_kv_heads * KEPT
        assert any(k.sum(-1).tolist() != [KEPT, KEPT] for k in kept)  # the heads' shares differ somewhere
        if not layerwise:  # and the layers' shares
            assert len(set(kept.sum(axis=(1, 2)).tolist())) > 1, kept.sum(axis=(1, 2))
        np.testing.assert_array_equal(kept, ref_kept, err_msg=head_budget)
        np.testing.assert_array_equal(np.asarray(gen.result(gen.decode(state)).tokens[0]), ref_tokens,
                                      err_msg=head_budget)
