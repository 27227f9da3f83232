"""``lcx generate`` on a YAML model config and on an HF directory written by ``save_hf``."""

from __future__ import annotations

import pytest
import jax
import numpy as np

import lcx
from lcx import hf
from lcx.cli import main
from lcx.data import ByteTokenizer

CFG = lcx.ModelConfig(vocab_size=260, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64, init_std=0.2)


@pytest.mark.slow
def test_generate_cli_ids_from_hf_dir_match_python_api(tmp_path, capsys):
    params = lcx.init_params(CFG, jax.random.key(3))
    hf.save_hf(CFG, params, tmp_path)
    assert main(["generate", "--model", str(tmp_path), "--ids", "5,6,7", "--max-new-tokens", "6"]) == 0
    printed = [int(x) for x in capsys.readouterr().out.split()]
    expected = lcx.generate(CFG, params, [[5, 6, 7]], max_new_tokens=6).tokens[0].tolist()
    assert printed == expected


def test_generate_cli_prompt_with_byte_tokenizer(tmp_path, capsys):
    path = tmp_path / "m.yaml"
    path.write_text("model: {vocab_size: 260, d_model: 32, n_layers: 1, n_heads: 2, n_kv_heads: 1, d_ff: 64}\n")
    assert main(["generate", "--model", str(path), "--prompt", "hi", "--max-new-tokens", "4", "--seed", "1"]) == 0
    captured = capsys.readouterr()
    assert "random weights (seed 1)" in captured.err
    config = lcx.config.load_model_config(path)
    params = lcx.init_params(config, jax.random.key(1))
    tokens = lcx.generate(config, params, [ByteTokenizer().encode("hi")], max_new_tokens=4).tokens[0]
    assert captured.out.rstrip("\n") == ByteTokenizer().decode(tokens)


def test_generate_cli_errors(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path / "none"), "--ids", "1"]) == 2
    assert "does not exist" in capsys.readouterr().err
    path = tmp_path / "m.yaml"
    path.write_text("model: {vocab_size: 64, d_model: 32, n_layers: 1, n_heads: 2, n_kv_heads: 1, d_ff: 64}\n")
    assert main(["generate", "--model", str(path), "--ids", "1,x"]) == 2
    assert "--ids='1,x' is invalid" in capsys.readouterr().err
    assert main(["generate", "--model", str(path), "--prompt", "hi"]) == 2
    assert "lcx's byte tokenizer has 260 ids but model.vocab_size=64" in capsys.readouterr().err
    assert main(["generate", "--model", str(path), "--ids", "1", "--cache-policy", "nope"]) == 2
    assert "cache.policy='nope' is not a registered eviction policy" in capsys.readouterr().err


def test_byte_tokenizer_roundtrip():
    tok = ByteTokenizer()
    ids = tok.encode("héllo ✓", eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id and max(ids[1:-1]) < 256
    assert tok.decode(ids) == "héllo ✓"
    assert np.all(np.asarray(ids) < tok.vocab_size)


@pytest.mark.slow
def test_generate_cli_tokenizer_json_must_match_the_model(tmp_path, capsys):
    """A checkpoint's tokenizer.json is used, never replaced by bytes; one larger than the vocabulary is an error."""
    tokenizers = __import__("pytest").importorskip("tokenizers")
    params = lcx.init_params(CFG, jax.random.key(3))
    hf.save_hf(CFG, params, tmp_path)
    vocab = {f"w{i}": i for i in range(300)}  # 300 ids > the model's 260
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    assert main(["generate", "--model", str(tmp_path), "--prompt", "w1 w2", "--max-new-tokens", "2"]) == 2
    assert "has 300 ids but model.vocab_size=260" in capsys.readouterr().err
    small = {f"w{i}": i for i in range(200)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(small, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    assert main(["generate", "--model", str(tmp_path), "--prompt", "w5 w6 w7", "--max-new-tokens", "3"]) == 0
    expected = lcx.generate(CFG, params, [[5, 6, 7]], max_new_tokens=3).tokens[0].tolist()
    assert capsys.readouterr().out.split() == tok.decode(expected).split()  # ids past the tokenizer decode to ""
    (tmp_path / "tokenizer.json").unlink()  # an HF directory without a tokenizer: an error, not bytes
    assert main(["generate", "--model", str(tmp_path), "--prompt", "w5", "--max-new-tokens", "1"]) == 2
    assert "has no tokenizer.json; pass --tokenizer PATH" in capsys.readouterr().err
    assert main(["generate", "--model", str(tmp_path), "--prompt", "hi", "--max-new-tokens", "1",
                 "--tokenizer", "bytes"]) == 0
