"""What re-rotating dynamic NTK costs a decode step: tokens/s of greedy decoding after a prose prompt, with the model's
trained RoPE, dynamic NTK as transformers caches it (each key keeps the base of the call that wrote it) and dynamic
NTK that re-rotates every cached key with the current length's base (``rope.rerotate``).

    python experiments/bench/rerotate.py runs/models/SmolLM2-135M-Instruct --contexts 4096 8192 16384 \
        --out docs/bench/data/rerotate_decode.csv

For each context: one prompt of prose (``pydoc_data.topics``) cut to ``context`` tokens, prefilled in chunks of
``--chunk``, then ``--new`` tokens decoded greedily (the first step, which compiles, is not timed), by the
unrolled decoder (``Generator``'s default where memory allows) and the scanned one. The three RoPE settings share
the weights; each is its own compiled program. ``prefill_s`` includes compilation.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import sys
import time
from pathlib import Path

import jax
import numpy as np

import lcx
from lcx.config import CacheConfig, RopeConfig
from lcx.engine import Generator

COLUMNS = ("context", "decoder", "rope", "tokens_per_s", "ms_per_token", "vs_trained", "decode_s", "prefill_s")


def ropes(trained: RopeConfig, factor: float) -> dict[str, RopeConfig]:
    dynamic = RopeConfig(type="dynamic", theta=trained.theta, factor=factor)
    return {"trained": trained, "dynamic": dynamic, "dynamic-rerotate": dataclasses.replace(dynamic, rerotate=True)}


def prose(lm, context: int) -> list[int]:
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[name] for name in sorted(topics))
    return lm.encode(text[:8 * context])[:context]


def timed(fn):
    start = time.perf_counter()
    out = fn()
    jax.block_until_ready(jax.tree.leaves(out))
    return out, time.perf_counter() - start


def one(lm, rope: RopeConfig, prompt: list[int], new: int, chunk: int, unroll: bool) -> dict:
    config = dataclasses.replace(lm.config, rope=rope)
    gen = Generator(config, lm.params, max_new_tokens=new, cache=CacheConfig(prefill_chunk=chunk), unroll=unroll)
    state, prefill_s = timed(lambda: gen.prefill([prompt]))
    state, _ = timed(lambda: gen.decode(state, steps=1))  # compiles
    before = int(np.sum(np.asarray(state.n_generated)))
    state, decode_s = timed(lambda: gen.decode(state))
    tokens = int(np.sum(np.asarray(state.n_generated))) - before
    return dict(tokens_per_s=tokens / decode_s, ms_per_token=1000 * decode_s / tokens, decode_s=decode_s,
                prefill_s=prefill_s)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a model directory or GGUF file (lcx.load)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--factor", type=float, default=4.0, help="dynamic NTK's rope.factor")
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk")
    parser.add_argument("--decoders", nargs="+", choices=["unrolled", "scanned"], default=["unrolled", "scanned"],
                        help="the decoder's layers unrolled (the default where memory allows) or scanned")
    parser.add_argument("--out", type=Path, default=None, help="CSV of the rows")
    args = parser.parse_args(argv)

    lm = lcx.load(args.model)
    rows = []
    for context in args.contexts:
        prompt = prose(lm, context)
        if len(prompt) < context:
            raise SystemExit(f"--contexts {context}: the prose has only {len(prompt)} tokens")
        for decoder in args.decoders:
            base = None
            for name, rope in ropes(lm.config.rope, args.factor).items():
                row = dict(context=context, decoder=decoder, rope=name,
                           **one(lm, rope, prompt, args.new, args.chunk, decoder == "unrolled"))
                base = base or row["tokens_per_s"]
                row["vs_trained"] = row["tokens_per_s"] / base
                rows.append(row)
                print(f"ctx {context:6d} {decoder:8s} {name:17s} {row['tokens_per_s']:7.2f} tok/s "
                      f"({row['ms_per_token']:6.1f} ms) x{row['vs_trained']:.2f}  prefill {row['prefill_s']:.0f} s",
                      file=sys.stderr, flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS)
            writer.writeheader()
            for row in rows:
                writer.writerow({c: (f"{row[c]:.4g}" if isinstance(row[c], float) else row[c]) for c in COLUMNS})


if __name__ == "__main__":
    main()
