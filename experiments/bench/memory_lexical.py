"""What the memory tier's lexical recall (``cache.lexical``) costs per decoded token, on a real checkpoint.

Each step every layer compares its blocks' token ids with the last ``lexical_tokens`` ids read (``N * block *
lexical_tokens`` comparisons per layer, ``N`` the blocks in the store), besides Quest's routing. A prose prompt of
each context length (``pydoc_data.topics``) is prefilled, then ``--new`` tokens are decoded after a warm-up segment;
decode ms/token is the best of two segments.

    python experiments/bench/memory_lexical.py runs/models/SmolLM2-135M-Instruct --contexts 4096 16384
"""

from __future__ import annotations

import argparse
import time

import jax

import lcx

ROW = dict(policy="memory", budget=2048, sinks=4, topk=8, block=64, positions="local", router="quest", interval=64,
           prefill_chunk=512)  # the memory row of docs/real_model (f) and (l)


def prose_ids(tokenizer, n: int) -> list[int]:
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    ids = tokenizer.encode(text)
    if len(ids) < n:
        raise SystemExit(f"--contexts {n} is longer than pydoc_data.topics ({len(ids)} tokens)")
    return ids[:n]


def decode_ms(lm, ids: list[int], cache: lcx.CacheConfig, new: int) -> tuple[float, float]:
    gen = lcx.Generator(lm.config, lm.params, max_new_tokens=3 * new, cache=cache, unroll=False,
                        capacity=len(ids) + 3 * new + 128)
    t0 = time.perf_counter()
    state = gen.prefill([ids])
    jax.block_until_ready(state.logits)
    prefill_s = time.perf_counter() - t0
    state = gen.decode(state, steps=new)  # warm-up: compiles the decode loop
    jax.block_until_ready(state.tokens)
    best = float("inf")
    for _ in range(2):
        t0 = time.perf_counter()
        state = gen.decode(state, steps=new)
        jax.block_until_ready(state.tokens)
        best = min(best, time.perf_counter() - t0)
    gen.close()
    return prefill_s, 1e3 * best / new


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--new", type=int, default=32, help="decode steps per timed segment")
    ap.add_argument("--lexical", type=int, nargs="+", default=[0, 2])
    args = ap.parse_args(argv)
    lm = lcx.load(args.model)
    print("| context | lexical | prefill s | decode ms/token |")
    print("|---:|---:|---:|---:|")
    for n in args.contexts:
        ids = prose_ids(lm.tokenizer, n)
        for lexical in args.lexical:
            prefill_s, ms = decode_ms(lm, ids, lcx.CacheConfig(**ROW, lexical=lexical), args.new)
            print(f"| {n:,} | {lexical} | {prefill_s:.1f} | {ms:.1f} |", flush=True)


if __name__ == "__main__":
    main()
