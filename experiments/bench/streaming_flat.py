"""Per-token decode cost under a streaming budget is flat in the context: decode-only ms/token after prompts of 1k
and 16k tokens (alternating, twice), the small-32k shape of decode_sweep.py, batch 1.

    python experiments/bench/streaming_flat.py

Cache: ``CacheConfig(policy="streaming", budget=1024, sinks=4, interval=256, prefill_chunk=1024)``; each context
compiles with a full warm-up generation, then times 256 decode steps (one eviction among them) after one step.
"""

from __future__ import annotations

import time

import jax
import numpy as np

import lcx
from lcx.config import CacheConfig
from lcx.engine import Generator


def main() -> None:
    cfg = lcx.ModelConfig(vocab_size=32000, d_model=256, n_layers=4, n_heads=8, n_kv_heads=2, d_ff=688,
                          max_position_embeddings=16384)
    params = lcx.init_params(cfg, jax.random.key(0))
    cache = CacheConfig(policy="streaming", budget=1024, sinks=4, interval=256, prefill_chunk=1024)
    steps = 256
    print("| context | ms / token | device KV |\n|---|---|---|")
    for ctx in (1024, 16384, 1024, 16384):
        gen = Generator(cfg, params, max_new_tokens=steps + 1, cache=cache)
        prompt = np.random.default_rng(ctx).integers(0, cfg.vocab_size, (1, ctx))
        jax.block_until_ready(gen.decode(gen.prefill(prompt)))  # compiles every call below
        state = jax.block_until_ready(gen.decode(gen.prefill(prompt), steps=1))
        t0 = time.perf_counter()
        out = jax.block_until_ready(gen.decode(state, steps=steps))
        ms = (time.perf_counter() - t0) / steps * 1e3
        print(f"| {ctx} | {ms:.2f} | {out.cache.kv_bytes() / 2**20:.1f} MiB |", flush=True)


if __name__ == "__main__":
    main()
