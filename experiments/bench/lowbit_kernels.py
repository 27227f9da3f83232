"""One decode step's attention on a bit-packed cache, per backend: the float split-K kernel on a bfloat16 cache vs
int4 / int2 codes through the fused XLA formulation and through the Pallas kernel that unpacks tile by tile.

    python experiments/bench/lowbit_kernels.py                       # a GPU: the shapes below
    python experiments/bench/lowbit_kernels.py --quick               # CPU smoke test (interpreted Pallas, tiny)

A synthetic layer (random keys and values quantized by ``lcx.cache.lowbit_slots.requantize``, every slot live, a
64-token float window): ``--batch`` rows x ``--kv-heads`` KV heads x ``--heads`` query heads of ``--head-dim``, at
each ``--contexts`` length. Per setting: the median of ``--iters`` jitted calls after one warm-up (which compiles),
the bytes a step reads (codes, scales and window, or the bfloat16 cache) and the effective bandwidth; the ratio is
to the bfloat16 Pallas decode. On a CPU the Pallas rows run in the interpreter: their times mean nothing there.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from lcx.cache import lowbit_slots
from lcx.cache.storage import PackedStorage
from lcx.kernels.decode import decode_attention
from lcx.kernels.lowbit_decode import decode_lowbit
from lcx.kernels.lowbit_pallas import decode_lowbit_tiles


def _time(fn, *args, iters: int) -> float:
    jax.block_until_ready(fn(*args))  # compile
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="tiny shapes, 2 iterations (a CPU smoke test)")
    args = ap.parse_args()
    if args.quick:
        args.contexts, args.batch, args.kv_heads, args.heads, args.head_dim, args.iters = [256], 1, 2, 4, 64, 2
    b, kvh, h, d, G = args.batch, args.kv_heads, args.heads, args.head_dim, args.group
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; batch {b}, {h} heads / {kvh} KV heads, head "
          f"dim {d}, key groups of {G}, a 64-token float window\n")
    print("| context | cache | backend | ms / step | bytes read | GB/s | vs bf16 Pallas |")
    print("|---|---|---|---|---|---|---|")
    sm = d ** -0.5
    for context in args.contexts:
        rng = np.random.default_rng(0)
        k = jnp.asarray(rng.standard_normal((b, kvh, context, d)), jnp.bfloat16)
        v = jnp.asarray(rng.standard_normal((b, kvh, context, d)), jnp.bfloat16)
        q = jnp.asarray(rng.standard_normal((b, h, d)), jnp.bfloat16)
        valid = jnp.ones((b, context), bool)
        base = _time(jax.jit(lambda q, k, v, valid: decode_attention(q, k, v, valid=valid, sm_scale=sm)), q, k, v,
                     valid, iters=args.iters)
        nbytes = 2 * k.size * 2
        print(f"| {context:,} | bfloat16 | pallas | {base * 1e3:.3f} | {nbytes:,} | {nbytes / base / 1e9:.0f} | 1 |",
              flush=True)
        count = jnp.full((b, 1), context, jnp.int32)
        for quant in ("int4", "int2"):
            fmt = PackedStorage(name=quant, group=G)
            stored = lowbit_slots.requantize(count, k, v, fmt, -(-context // G), jnp.bfloat16)
            layer = type("Layer", (), {"count": count, **stored})
            view = lowbit_slots.decode_view(layer, fmt)
            nbytes = sum(x.size * x.dtype.itemsize for x in (layer.k, layer.v, layer.k_scale, layer.k_zero,
                                                              layer.v_scale, layer.v_zero, layer.k_res, layer.v_res))
            for name, fn in (("xla", decode_lowbit), ("pallas", decode_lowbit_tiles)):
                step = jax.jit(lambda q, kc, vc, kv, valid, fn=fn: fn(q, kc, vc, kv, valid=valid, sm_scale=sm).out)
                t = _time(step, q, layer.k, layer.v, view, valid, iters=args.iters)
                print(f"| {context:,} | {quant} | {name} | {t * 1e3:.3f} | {nbytes:,} | {nbytes / t / 1e9:.0f} | "
                      f"{t / base:.2f} |", flush=True)


if __name__ == "__main__":
    main()
