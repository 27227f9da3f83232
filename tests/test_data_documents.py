"""Task ``documents`` and tokenizers: local text / JSONL documents, packed with segment ids, resumable; a Hugging Face
``tokenizer.json`` from an ``init_from`` directory; a packed batch scores each document exactly as if it ran alone."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from lcx.config import AttentionConfig, ConfigError, ModelConfig
from lcx.data import BatchSource, ByteTokenizer, HFTokenizer, make_task, resolve_tokenizer
from lcx.model import Decoder, init_params
from lcx.train import DataConfig, TrainConfig, read_metrics, run_training

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex every jovial boxer".split()


def _corpus(folder, n_docs=9, seed=0):
    """A tiny corpus: a plain-text file and a JSONL file of documents of different lengths."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    docs = [" ".join(rng.choice(WORDS, size=int(rng.integers(3, 40)))) for _ in range(n_docs)]
    (folder / "first.txt").write_text(docs[0])
    (folder / "more.jsonl").write_text("\n".join(json.dumps({"text": d, "id": i}) for i, d in enumerate(docs[1:])))
    return docs


def _word_tokenizer(path, vocab_size=None):
    """A word-level tokenizer.json with <s>, </s>, <pad> and the corpus words."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "<pad>", *WORDS])}
    for i in range(len(vocab), vocab_size or 0):
        vocab[f"extra{i}"] = i
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.decoder = tokenizers.decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens(["<unk>", "<s>", "</s>", "<pad>"])  # as in a real tokenizer.json: ids kept, marked special
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                            "pad_token": "<pad>"}))
    return path


def test_documents_pack_rows_with_segments_positions_and_no_cross_document_targets(tmp_path):
    docs = _corpus(tmp_path / "docs")
    task = make_task("documents", {"path": str(tmp_path / "docs"), "val_fraction": 0.2})
    tok = ByteTokenizer()
    src = BatchSource(task, seq_len=48, batch_size=4, seed=3)
    batch = src(0)
    assert set(batch) == {"inputs", "targets", "weights", "answer", "positions", "segment_ids"}
    for row in range(4):
        seg, pos, w = batch["segment_ids"][row], batch["positions"][row], batch["weights"][row]
        starts = np.flatnonzero(np.diff(seg, prepend=-1))
        assert np.all(pos[starts] == 0)  # positions restart per document
        assert np.all(np.diff(pos)[np.diff(seg) == 0] == 1)
        # a target is weighted iff it belongs to its input's document (EOS -> next BOS is never a target)
        ends = batch["inputs"][row] == tok.eos_id
        assert np.all(w[ends] == 0) and np.all(w[~ends] == 1)
    # resumable: batch i is a pure function of (seed, i), whatever came before
    again = BatchSource(make_task("documents", {"path": str(tmp_path / "docs"), "val_fraction": 0.2}),
                        seq_len=48, batch_size=4, seed=3)
    for key in batch:
        np.testing.assert_array_equal(again(7)[key], src(7)[key])
    # nothing lost: an epoch's stream holds every training document once, in full, and its rows tile the stream
    n_rows = task.num_rows(48)
    epoch, _ = task._epoch(3, "train", 0)
    pieces = np.split(epoch, np.flatnonzero(epoch == tok.bos_id)[1:])
    assert sorted(tok.decode(p) for p in pieces) == sorted(tok.decode(d) for d in task.documents("train"))
    assert len(task.documents("train")) + len(task.documents("validation")) == len(docs)
    rows = np.concatenate([ex.ids[:-1] for ex in task.examples(3, 0, n_rows, 48)])
    np.testing.assert_array_equal(rows, epoch[:n_rows * 48])
    assert len(epoch) - 1 - n_rows * 48 < 48  # only the last partial row waits for the next epoch's order


def test_documents_errors_name_file_line_and_field(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"body": "no text"}\n')
    task = make_task("documents", {"path": str(tmp_path / "bad.jsonl")})
    with pytest.raises(ConfigError, match=r"bad\.jsonl:2: no string under data\.params\.text_field='text' "
                                          r"\(found: \['body'\]\)"):
        task.documents("train")
    (tmp_path / "broken.jsonl").write_text('{"text": \n')
    with pytest.raises(ConfigError, match=r"broken\.jsonl:1: not valid JSON"):
        make_task("documents", {"path": str(tmp_path / "broken.jsonl")}).documents("train")
    with pytest.raises(ConfigError, match=r"data\.params\.format='csv' is invalid"):
        make_task("documents", {"path": str(tmp_path), "format": "csv"})
    with pytest.raises(ConfigError, match=r"data\.params\.path='' is invalid"):
        make_task("documents", {})
    (tmp_path / "short.txt").write_text("hi")
    with pytest.raises(ConfigError, match=r"fewer than one row of seq_len \+ 1 = 65"):
        make_task("documents", {"path": str(tmp_path / "short.txt")}).num_rows(64)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_packed_batch_gives_each_document_its_own_loss(tmp_path, impl):
    """fp32: per-token nll of a packed row (segment ids + restarted positions) = each document run on its own."""
    _corpus(tmp_path / "docs", n_docs=5, seed=1)
    task = make_task("documents", {"path": str(tmp_path / "docs"), "val_fraction": 0.0})
    batch = BatchSource(task, seq_len=64, batch_size=2, seed=0)(0)
    model = ModelConfig(vocab_size=260, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, dtype="float32",
                        max_position_embeddings=64, attention=AttentionConfig(impl=impl), init_std=0.2)
    params = init_params(model, jax.random.key(0))

    def nll(inputs, targets, **kw):
        logits = Decoder(model).apply({"params": params}, jnp.asarray(inputs), **kw)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return np.asarray(-jnp.take_along_axis(logp, jnp.asarray(targets)[..., None], axis=-1)[..., 0])

    packed = nll(batch["inputs"], batch["targets"], positions=jnp.asarray(batch["positions"]),
                 segment_ids=jnp.asarray(batch["segment_ids"]))
    unpacked = nll(batch["inputs"], batch["targets"])  # the same rows without document boundaries
    checked = 0
    for row in range(2):
        seg = batch["segment_ids"][row]
        for s in np.unique(seg):
            idx = np.flatnonzero(seg == s)
            # the document alone, right-padded to the row length (causal: padding after it changes nothing), so
            # every document reuses one compiled shape
            alone_in, alone_tg = (np.zeros((1, 64), np.int32) for _ in range(2))
            alone_in[0, :len(idx)], alone_tg[0, :len(idx)] = batch["inputs"][row, idx], batch["targets"][row, idx]
            alone = nll(alone_in, alone_tg)[0, :len(idx)]
            w = batch["weights"][row, idx] > 0
            np.testing.assert_allclose(packed[row, idx][w], alone[w], rtol=1e-5, atol=1e-5)
            checked += 1
    assert checked >= 3  # at least one row really holds several documents
    assert np.max(np.abs(packed - unpacked)) > 1e-2  # and boundaries matter


def test_hf_tokenizer_resolution_and_vocab_mismatch(tmp_path):
    tok_dir = _word_tokenizer(tmp_path / "tok")
    tok = resolve_tokenizer(str(tok_dir), vocab_size=64)
    assert isinstance(tok, HFTokenizer) and (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 3)
    ids = tok.encode("the lazy dog", eos=True)
    assert ids[0] == 1 and ids[-1] == 2 and tok.decode(ids) == "the lazy dog"
    with pytest.raises(ConfigError, match=r"has 21 ids but model\.vocab_size=16; the tokenizer does not belong"):
        resolve_tokenizer(str(tok_dir), vocab_size=16)
    with pytest.raises(ConfigError, match=r"data\.tokenizer='.*nowhere' is invalid: no tokenizer\.json there"):
        resolve_tokenizer(str(tmp_path / "nowhere"))
    assert isinstance(resolve_tokenizer("auto"), ByteTokenizer)
    # a byte-level task refuses another tokenizer at config load, with what to do instead
    with pytest.raises(ConfigError, match=r"data\.task='corpus' builds byte-level examples"):
        DataConfig(task="corpus", tokenizer=str(tok_dir))


@pytest.mark.slow
def test_finetune_from_hf_directory_uses_its_tokenizer(tmp_path, hf_factory):
    """init_from an HF directory with a tokenizer.json: batches are that tokenizer's ids (text round-trips), the run
    records it, export copies it, and a model whose vocabulary is too small for it is refused."""
    hf_dir = tmp_path / "hf"
    hf_factory("llama", vocab_size=64, max_position_embeddings=64).save_pretrained(hf_dir)
    _word_tokenizer(hf_dir, vocab_size=64)
    docs = _corpus(tmp_path / "docs")
    data = DataConfig(task="documents", params={"path": str(tmp_path / "docs"), "val_fraction": 0.0})
    train = TrainConfig(steps=2, batch_size=2, seq_len=32, lr=1e-3, warmup_steps=0, log_every=1, save_every=2,
                        init_from=str(hf_dir), compute_dtype="float32", async_save=False)
    from lcx.train.warm_start import source_config

    model = dataclasses.replace(source_config(hf_dir), attention=AttentionConfig(impl="xla"))
    result = run_training(model, train, data, tmp_path / "run", progress=False)
    assert len(read_metrics(result.metrics_path)) == 2
    recorded = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["data"]["tokenizer"]
    assert recorded == str((hf_dir / "tokenizer.json").resolve())
    tok = resolve_tokenizer(recorded)
    task = make_task("documents", data.params).with_tokenizer(tok)
    batch = BatchSource(task, seq_len=32, batch_size=2, seed=0)(0)
    assert batch["inputs"].max() < 64 and (batch["inputs"] == tok.bos_id).any()
    row = batch["inputs"][0][batch["segment_ids"][0] == batch["segment_ids"][0][-1]]
    assert tok.decode(row) and any(tok.decode(row) in d for d in docs)  # the ids are the tokenizer's, not bytes

    from lcx.cli import main

    assert main(["export", str(tmp_path / "run"), "--hf", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (hf_dir / "tokenizer.json").read_bytes()

    with pytest.raises(ConfigError, match=r"has 64 ids but model\.vocab_size=32"):
        run_training(dataclasses.replace(model, vocab_size=32), dataclasses.replace(train, init_from=None),
                     dataclasses.replace(data, tokenizer=str(hf_dir)), tmp_path / "run2", progress=False)
    assert not (tmp_path / "run2" / "config.yaml").exists()
