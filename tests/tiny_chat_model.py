"""A tiny random-weight model with a real BPE tokenizer and a chat template, written as an HF directory: what the
service tests serve (built in a second, offline)."""

from __future__ import annotations

import json
from pathlib import Path

import jax

import lcx
from lcx.data.haystack import NOISE

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2: pad, BOS, EOS
CHAT = ("{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n'}}{% endfor %}"
        "{% if add_generation_prompt %}{{'<|im_start|>assistant\n'}}{% endif %}")


def write_tokenizer(folder: Path):
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([NOISE * 20, "Say hi, user and assistant: here we go again and again."], trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": CHAT}))
    return tok


def write_model(folder: Path, *, max_position_embeddings: int = 4096, seed: int = 0) -> Path:
    """An HF directory at ``folder`` (created) holding the model, its tokenizer and chat template."""
    folder.mkdir(parents=True, exist_ok=True)
    tok = write_tokenizer(folder)
    config = lcx.ModelConfig(vocab_size=tok.get_vocab_size(), d_model=32, n_layers=2, n_heads=2, n_kv_heads=1,
                             d_ff=64, max_position_embeddings=max_position_embeddings, init_std=0.2, bos_token_id=1,
                             eos_token_id=2)
    lcx.hf.save_hf(config, lcx.init_params(config, jax.random.key(seed)), folder)
    return folder


if __name__ == "__main__":  # python tests/tiny_chat_model.py DIR
    import sys

    print(write_model(Path(sys.argv[1])))
