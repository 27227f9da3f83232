"""Memory-tier benchmark: decode time per token and device / store bytes vs context length, host vs device store.

For each context length a prompt is prefilled through the cache, then ``--new`` tokens are decoded and timed (a
warm-up decode first, so compilation is not counted); the device KV bytes (``GenerateResult.cache_bytes``) and the
store's host / disk bytes are read from the result. Settings: the memory tier with its store in host memory and on
the device (the cost of offload), streaming at the same device budget, and the full cache where it fits.

    python experiments/bench/memory.py                       # quickstart-size model, random weights
    python experiments/bench/memory.py --run runs/quickstart/train --contexts 1024 4096 16384
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import numpy as np

import lcx
from lcx.config_base import format_bytes

QUICKSTART = lcx.ModelConfig(vocab_size=260, d_model=128, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=256,
                             max_position_embeddings=128)


def settings() -> dict[str, lcx.CacheConfig]:
    memory = dict(policy="memory", budget=96, sinks=4, topk=3, block=16, positions="local", interval=16,
                  prefill_chunk=16)
    return {
        "memory (host store)": lcx.CacheConfig(**memory, store="host"),
        "memory (device store)": lcx.CacheConfig(**memory, store="device"),
        "memory (host, 2-level routing)": lcx.CacheConfig(**memory, store="host", route_groups=32),
        "streaming @96": lcx.CacheConfig(policy="streaming", budget=96, sinks=4, interval=16, prefill_chunk=64),
        "full": lcx.CacheConfig(prefill_chunk=256),
    }


def run(model, params, context: int, cache: lcx.CacheConfig, new: int) -> dict:
    prompt = np.random.default_rng(context).integers(3, model.vocab_size, (1, context)).tolist()
    gen = lcx.Generator(model, params, max_new_tokens=3 * new, cache=cache)
    t0 = time.perf_counter()
    state = gen.prefill(prompt)
    jax.block_until_ready(state.logits)
    prefill_s = time.perf_counter() - t0
    state = gen.decode(state, steps=new)  # warm-up: compiles the decode loop
    jax.block_until_ready(state.tokens)
    decode_s = float("inf")
    for _ in range(2):  # best of two timed segments: a stray recompile or a busy core does not set the number
        t0 = time.perf_counter()
        state = gen.decode(state, steps=new)
        jax.block_until_ready(state.tokens)
        decode_s = min(decode_s, time.perf_counter() - t0)
    result = gen.result(state)
    gen.close()
    return {"prefill_tok_s": context / prefill_s, "decode_ms": 1e3 * decode_s / new, "device": result.cache_bytes,
            "store": result.store_bytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", default=None, help="an lcx checkpoint (default: random quickstart-size weights)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--new", type=int, default=64, help="decode steps timed per setting")
    args = parser.parse_args()
    if args.run:
        from lcx.train import load_checkpoint

        model, params = load_checkpoint(args.run)
    else:
        model, params = QUICKSTART, lcx.init_params(QUICKSTART, jax.random.key(0))
    model = dataclasses.replace(model, dtype="float32", attention=lcx.AttentionConfig("auto"),
                                max_position_embeddings=max(args.contexts) * 2)  # full attention may run past 128
    print("| setting | context | prefill tok/s | decode ms/token | device KV | store (host) |")
    print("|---|---|---|---|---|---|")
    for name, cache in settings().items():
        for context in args.contexts:
            r = run(model, params, context, cache, args.new)
            print(f"| {name} | {context} | {r['prefill_tok_s']:.0f} | {r['decode_ms']:.2f} | "
                  f"{format_bytes(r['device'])} | {format_bytes(r['store'])} |", flush=True)


if __name__ == "__main__":
    main()
