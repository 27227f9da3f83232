"""The folder corpus: split by file, windows, deterministic order, errors."""

from __future__ import annotations

import numpy as np
import pytest

from lcx.config import ConfigError
from lcx.data import BatchSource, ByteTokenizer, make_task

TOK = ByteTokenizer()


def _folder(tmp_path, n=10, size=300):
    rng = np.random.default_rng(0)  # random letters: no two windows alike
    for i in range(n):
        sub = tmp_path / ("pkg" if i % 2 else "")
        sub.mkdir(exist_ok=True)
        (sub / f"file{i}.txt").write_text(f"# file {i}\n" + "".join(chr(97 + c) for c in rng.integers(0, 26, size)))
    (tmp_path / ".hidden.txt").write_text("never read")
    return tmp_path


def test_corpus_split_by_file_is_deterministic_and_disjoint(tmp_path):
    corpus = make_task("corpus", {"path": str(_folder(tmp_path)), "val_fraction": 0.2})
    train, val = corpus.files("train"), corpus.files("validation")
    assert len(val) == 2 and len(train) == 8 and not set(train) & set(val)
    assert all(".hidden" not in p.name for p in train + val)
    again = make_task("corpus", {"path": str(tmp_path), "val_fraction": 0.2})
    assert again.files("validation") == val


def test_corpus_stream_and_windows(tmp_path):
    corpus = make_task("corpus", {"path": str(_folder(tmp_path)), "val_fraction": 0.2})
    stream = corpus.stream("train")
    assert stream[0] == TOK.bos_id and stream[-1] == TOK.eos_id
    assert (stream == TOK.bos_id).sum() == 8
    n = corpus.num_windows(64)
    assert n == (len(stream) - 1) // 64
    # one epoch of batches covers every window exactly once, in a seed-dependent order
    src = BatchSource(corpus, seq_len=64, batch_size=n, seed=5)
    epoch = src(0)
    windows = {bytes(row.astype(np.uint16).tobytes()) for row in epoch["inputs"]}
    assert len(windows) == n
    assert (epoch["weights"] == 1).all()
    np.testing.assert_array_equal(epoch["targets"][:, :-1], epoch["inputs"][:, 1:])
    assert not np.array_equal(BatchSource(corpus, seq_len=64, batch_size=n, seed=6)(0)["inputs"], epoch["inputs"])
    np.testing.assert_array_equal(src(0)["inputs"], epoch["inputs"])


def test_corpus_windows_are_stream_slices(tmp_path):
    corpus = make_task("corpus", {"path": str(_folder(tmp_path)), "val_fraction": 0.0})
    stream = corpus.stream("train").astype(np.int32)
    for ex in corpus.examples(0, 2, 3, 32):
        hits = [s for s in range(0, len(stream) - 32, 32) if np.array_equal(stream[s: s + 33], ex.ids)]
        assert len(hits) == 1


def test_corpus_empty_folder_error(tmp_path):
    corpus = make_task("corpus", {"path": str(tmp_path)})
    with pytest.raises(ConfigError, match=r"has no files matching data.params.glob='\*\*/\*'"):
        corpus.examples(0, 0, 1, 32)


def test_corpus_missing_folder_and_too_small(tmp_path):
    with pytest.raises(ConfigError, match="is not a folder"):
        make_task("corpus", {"path": str(tmp_path / "nope")}).examples(0, 0, 1, 32)
    (tmp_path / "a.txt").write_text("tiny")
    with pytest.raises(ConfigError, match="fewer than one window"):
        make_task("corpus", {"path": str(tmp_path), "val_fraction": 0.0}).examples(0, 0, 1, 32)
    with pytest.raises(ConfigError, match="the validation split has no files"):
        make_task("corpus", {"path": str(tmp_path)}).examples(0, 0, 1, 2, split="validation")


def test_corpus_default_is_stdlib_sources():
    corpus = make_task("corpus")
    train = corpus.files("train")
    assert len(train) > 100 and all(p.suffix == ".py" for p in train[:50])
    assert not any("site-packages" in p.parts for p in train)
    assert set(corpus.files("validation")).isdisjoint(train)
    ex = corpus.examples(0, 0, 2, 128)
    assert len(ex) == 2 and all(len(e.ids) == 129 for e in ex)
