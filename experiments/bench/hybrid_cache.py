"""Sliding-window layers' bounded cache: device KV and decode speed of a Gemma-3-shaped model, hybrid vs all-global.

The same random-weight model twice: with Gemma 3's layer pattern (five sliding-window layers per global one; the
sliding layers keep ``window - 1 + interval`` slots, ``lcx.cache.hybrid``) and with every layer global (the cache a
model without windows needs). Both through the public API, default settings (``cache.policy: full``): prefill a
prompt of ``--context`` tokens, then decode ``--new`` tokens. Prints one Markdown row per setting: the device KV
(``GenerateResult.cache_bytes``: the arrays' sizes), the planner's figure for the same shape, prefill seconds and
decode milliseconds per token (after a warm-up run of the same shapes).

    python experiments/bench/hybrid_cache.py                     # 6 layers (5 local + 1 global), 8K context
    python experiments/bench/hybrid_cache.py --context 32768     # the issue's 32K
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

import lcx  # noqa: E402
from lcx.config_base import format_bytes  # noqa: E402
from lcx.engine import Generator  # noqa: E402
from lcx.plan import kv_bytes_for_context  # noqa: E402


def model(layers: int, window: int, hybrid: bool) -> lcx.ModelConfig:
    types = tuple("full_attention" if (i + 1) % 6 == 0 or not hybrid else "sliding_attention" for i in range(layers))
    return lcx.ModelConfig(vocab_size=512, d_model=128, n_layers=layers, n_heads=4, n_kv_heads=2, d_ff=256,
                           family="gemma3", layer_types=types, sliding_window=window if hybrid else None,
                           max_position_embeddings=131072, local_rope=lcx.RopeConfig(theta=10000.0) if hybrid else None,
                           rope=lcx.RopeConfig(theta=1e6))


def run(config: lcx.ModelConfig, params, prompt: np.ndarray, new: int, interval: int) -> dict:
    def once():
        gen = Generator(config, params, max_new_tokens=new, cache=lcx.CacheConfig(interval=interval))
        start = time.perf_counter()
        state = gen.prefill(prompt)
        jax.block_until_ready(state.logits)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        state = gen.decode(state)
        jax.block_until_ready(state.tokens)
        return gen.result(state), prefill, time.perf_counter() - start

    once()  # compile
    result, prefill, decode = once()
    return {"kv": result.cache_bytes, "prefill_s": prefill, "decode_ms": 1e3 * decode / new,
            "tokens": result.tokens}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--interval", type=int, default=64)
    args = p.parse_args(argv)
    hybrid = model(args.layers, args.window, True)
    params = lcx.init_params(hybrid, jax.random.key(0))
    prompt = np.random.default_rng(0).integers(0, 512, (1, args.context))
    print(f"{jax.devices()[0].device_kind}, {args.layers} layers, window {args.window}, context {args.context}, "
          f"{args.new} new tokens, interval {args.interval}\n")
    print("| layers | device KV (cache_bytes) | planner | prefill s | decode ms/token |")
    print("|---|---|---|---|---|")
    rows = {}
    for name, config in (("5:1 sliding / global", hybrid), ("all global", model(args.layers, args.window, False))):
        got = run(config, params, prompt, args.new, args.interval)
        planned = kv_bytes_for_context(config, config.dtype, args.context + args.new, args.interval)
        rows[name] = got
        print(f"| {name} | {format_bytes(got['kv'])} | {format_bytes(planned)} | {got['prefill_s']:.2f} | "
              f"{got['decode_ms']:.2f} |")
    ratio = rows["5:1 sliding / global"]["kv"] / rows["all global"]["kv"]
    print(f"\nhybrid / all-global device KV: {ratio:.3f}")


if __name__ == "__main__":
    main()
