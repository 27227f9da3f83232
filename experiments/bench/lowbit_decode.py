"""Decode step time with the quantized caches at a long context: float vs int8 / int4 / int2 (``cache.kv_dtype``).

    python experiments/bench/lowbit_decode.py runs/models/SmolLM2-135M-Instruct --context 8192

A real checkpoint (``lcx.load``; a Hugging Face directory or a .gguf), one row, a ``--context``-token prompt of the
Python reference manual's prose prefilled in 2,048-token chunks, then ``--steps`` greedy decode steps timed after
one warm-up segment of the same length (which compiles the loop). Per setting: the step time, its ratio to the
float cache, and the cache's bytes (``GenerateResult.cache_bytes``'s count, from the arrays). Each setting runs in
turn in this process, the order alternated over ``--repeats`` rounds; the best round is reported.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import lcx
from lcx.config import CacheConfig
from lcx.engine import Generator

SETTINGS = {"float": {}, "int8": {"kv_dtype": "int8"}, "int4": {"kv_dtype": "int4"}, "int2": {"kv_dtype": "int2"}}


def _prompt(lm, tokens: int) -> list[int]:
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    ids = lm.tokenizer.encode(text)
    if len(ids) < tokens:
        raise SystemExit(f"the prose has {len(ids)} tokens, fewer than --context {tokens}")
    return ids[:tokens]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, of {list(SETTINGS)}")
    args = ap.parse_args()
    lm = lcx.load(args.checkpoint)
    prompt = _prompt(lm, args.context)
    names = args.settings.split(",")
    gens = {n: Generator(lm.config, lm.params, max_new_tokens=2 * args.steps + 1,
                         cache=CacheConfig(prefill_chunk=2048, **SETTINGS[n])) for n in names}
    best, nbytes = {n: float("inf") for n in names}, {}
    for r in range(args.repeats):
        for n in (names if r % 2 == 0 else names[::-1]):
            gen = gens[n]
            t0 = time.perf_counter()
            state = gen.decode(gen.prefill([prompt]), steps=args.steps + 1)  # compiles on the first round
            state.tokens.block_until_ready()
            prefill_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            state = gen.decode(state, steps=args.steps)
            state.tokens.block_until_ready()
            step_ms = (time.perf_counter() - t0) / args.steps * 1e3
            best[n], nbytes[n] = min(best[n], step_ms), state.cache.kv_bytes()
            print(f"round {r} {n}: {step_ms:.1f} ms/step (prefill + warm-up {prefill_s:.0f} s)", flush=True)
    base = best.get("float")
    print(f"\n### Decode at {args.context} tokens, {lm.config.n_layers} layers ({args.checkpoint}; best of "
          f"{args.repeats} rounds of {args.steps} steps)\n")
    print("| cache | ms / step | x float | cache bytes | x float bytes |\n|---|---|---|---|---|")
    for n in names:
        ratio = f"{best[n] / base:.2f}" if base else "-"
        br = f"{nbytes[n] / nbytes['float']:.3f}" if "float" in nbytes else "-"
        print(f"| {n} | {best[n]:.1f} | {ratio} | {nbytes[n] / 2**20:.1f} MiB | {br} |")


if __name__ == "__main__":
    main()
