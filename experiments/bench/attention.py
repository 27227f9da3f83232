"""Attention kernel benchmark: Pallas flash vs XLA vs cuDNN, forward and forward+backward.

Prints one Markdown table row per (sequence length, pass, implementation): milliseconds (median of timed runs),
TFLOP/s and XLA's compiled temp memory. FLOPs follow the FlashAttention papers: forward 4·B·H·T·S·D, halved for
causal; forward+backward 3.5× that (the backward is 2.5× the forward).

    python experiments/bench/attention.py            # full sweep (GPU): seq 1k-16k, head_dim 128, causal, bf16
    python experiments/bench/attention.py --quick    # CPU smoke run: seq 256-1024, fp32, Pallas interpret mode

Batch is chosen so every length processes ``--tokens`` tokens (16k by default), as in the FlashAttention benchmarks.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

from lcx.kernels import flash_attention  # noqa: E402
from lcx.kernels.mode import resolve_interpret  # noqa: E402


def _impls(causal: bool):
    def pallas(q, k, v):
        return flash_attention(q, k, v, causal=causal)

    def xla(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")

    def cudnn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")

    impls = {"pallas": pallas, "xla": xla}
    if jax.default_backend() == "gpu":
        impls["cudnn"] = cudnn
    return impls


def _with_backward(fn):
    def loss_and_grads(q, k, v, ct):
        out, vjp = jax.vjp(fn, q, k, v)
        return vjp(ct)

    return loss_and_grads


def _time_ms(compiled, args, iters: int) -> float:
    jax.block_until_ready(compiled(*args))  # warm-up
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run(seqs, *, heads: int, kv_heads: int, head_dim: int, tokens: int, dtype, causal: bool, passes, iters: int):
    print(f"backend={jax.default_backend()} device={jax.devices()[0].device_kind} jax={jax.__version__} "
          f"pallas_interpret={resolve_interpret(None)} host={platform.node()}")
    print(f"heads={heads} kv_heads={kv_heads} head_dim={head_dim} dtype={jnp.dtype(dtype).name} causal={causal} "
          f"tokens/batch-sweep={tokens}\n")
    print("| seq | batch | pass | impl | ms | TFLOP/s | temp MiB |")
    print("|---:|---:|---|---|---:|---:|---:|")
    for seq in seqs:
        batch = max(1, tokens // seq)
        keys = jax.random.split(jax.random.key(seq), 4)
        q = jax.random.normal(keys[0], (batch, seq, heads, head_dim), dtype)
        k = jax.random.normal(keys[1], (batch, seq, kv_heads, head_dim), dtype)
        v = jax.random.normal(keys[2], (batch, seq, kv_heads, head_dim), dtype)
        ct = jax.random.normal(keys[3], q.shape, dtype)
        fwd_flops = 4 * batch * heads * seq * seq * head_dim / (2 if causal else 1)
        for pass_ in passes:
            for name, fn in _impls(causal).items():
                f, args, flops = (fn, (q, k, v), fwd_flops) if pass_ == "fwd" else \
                    (_with_backward(fn), (q, k, v, ct), 3.5 * fwd_flops)
                try:
                    compiled = jax.jit(f).lower(*args).compile()
                    temp = compiled.memory_analysis().temp_size_in_bytes / 2**20
                    ms = _time_ms(compiled, args, iters)
                    print(f"| {seq} | {batch} | {pass_} | {name} | {ms:.3f} | {flops / ms / 1e9:.3g} | {temp:.1f} |",
                          flush=True)
                except Exception as e:  # noqa: BLE001 - one failing implementation (e.g. OOM) must not end the sweep
                    msg = str(e).splitlines()[0][:80] if str(e) else type(e).__name__
                    print(f"| {seq} | {batch} | {pass_} | {name} | failed: {msg} | | |", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small CPU-sized sweep: seq 256-1024, fp32, head_dim 64")
    p.add_argument("--seqs", type=int, nargs="*", help="sequence lengths (overrides the preset)")
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--head-dim", type=int, default=None)
    p.add_argument("--tokens", type=int, default=None, help="batch = max(1, tokens // seq)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--no-causal", action="store_true")
    p.add_argument("--pass", dest="passes", default="both", choices=["fwd", "fwdbwd", "both"])
    p.add_argument("--iters", type=int, default=None)
    a = p.parse_args(argv)
    preset = (dict(seqs=[256, 512, 1024], heads=4, kv_heads=2, head_dim=64, tokens=1024, dtype="float32", iters=3)
              if a.quick else
              dict(seqs=[1024, 2048, 4096, 8192, 16384], heads=32, kv_heads=8, head_dim=128, tokens=16384,
                   dtype="bfloat16", iters=20))
    for key in preset:
        if getattr(a, key, None) is not None:
            preset[key] = getattr(a, key)
    passes = ["fwd", "fwdbwd"] if a.passes == "both" else [a.passes]
    run(preset["seqs"], heads=preset["heads"], kv_heads=preset["kv_heads"], head_dim=preset["head_dim"],
        tokens=preset["tokens"], dtype=jnp.dtype(preset["dtype"]), causal=not a.no_causal, passes=passes,
        iters=preset["iters"])


if __name__ == "__main__":
    main()
