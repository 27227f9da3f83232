"""``lcx convert MODEL.gguf OUT_DIR``: a GGUF file (llama.cpp) as a directory transformers loads.

Writes ``config.json`` + ``model.safetensors`` (by ``lcx.checkpoints.hf.save_hf``, in ``--dtype``, default float32: the
dequantized weights, so a Q4 file becomes a float32 model that computes what the Q4 file computes),
``tokenizer.json`` (the tokenizer built from the GGUF metadata), ``tokenizer_config.json`` (special tokens,
``add_bos_token``, ``chat_template``) and ``generation_config.json`` (BOS/EOS ids). What ``lcx.checkpoints.gguf``
does not
support is refused before anything is written; a non-empty OUT_DIR needs ``--force``.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from lcx.config_base import ConfigError

DTYPES = ("float32", "bfloat16", "float16")


def run(args: argparse.Namespace) -> int:
    from lcx.checkpoints import gguf
    from lcx.checkpoints import hf

    src, out = Path(args.model), Path(args.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"OUT_DIR={args.out!r} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not args.force:
        raise ConfigError(f"OUT_DIR={args.out!r} exists and is not empty; choose a new directory or pass --force")
    if args.dtype not in DTYPES:
        raise ConfigError(f"--dtype={args.dtype!r} is invalid: must be one of {list(DTYPES)}")
    _, reader, tokenizer = gguf.read_gguf(src)  # validates everything before the weights are dequantized
    if tokenizer is None:
        raise ConfigError(f"{src} holds no tokenizer (tokenizer.ggml.tokens); transformers could not use the result")
    config, params = gguf.assemble(reader, dtype=args.dtype)
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("model*.safetensors"), *out.glob("model.safetensors.index.json")]:
        old.unlink()  # a previous conversion's shards would otherwise sit beside (or shadow) the new ones
    hf.save_hf(config, params, out)
    _write_tokenizer(tokenizer, config, out)
    types = Counter(t.tensor_type.name for t in reader.gf.tensors.values())
    print(f"lcx convert: {src} -> {out} ({reader.arch}, {config.n_layers} layers, d_model {config.d_model}, vocab "
          f"{config.vocab_size}, {', '.join(f'{n} {k}' for k, n in types.most_common())} tensors -> {args.dtype})")
    return 0


def _write_tokenizer(tok, config, out: Path) -> None:
    tok.tokenizer.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tok.bos_token, "eos_token": tok.eos_token, "pad_token": tok.pad_token,
        "unk_token": tok.unk_token, "add_bos_token": tok.add_bos_token, "add_eos_token": tok.add_eos_token,
        "model_max_length": config.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
    }
    if tok.chat_template is not None:
        tokenizer_config["chat_template"] = tok.chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False))
    generation = {key: value for key, value in (("bos_token_id", tok.bos_id), ("eos_token_id", tok.eos_id),
                                                ("pad_token_id", tok.pad_id)) if value is not None}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("convert", help="write a GGUF model file as a Hugging Face directory",
                              description=__doc__.splitlines()[0])
    p.add_argument("model", metavar="MODEL.gguf", help="a llama / mistral / qwen2 GGUF file")
    p.add_argument("out", metavar="OUT_DIR", help="output directory (config.json, safetensors, tokenizer files)")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="dtype of the written weights")
    p.add_argument("--force", action="store_true", help="write into a non-empty OUT_DIR")
    p.set_defaults(func=run)
    return p


__all__ = ["add_parser", "run"]
