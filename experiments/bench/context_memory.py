"""Context parallelism: per-device memory of the train step, and the longest trainable sequence at a fixed
per-device budget, as the ``seq`` mesh axis grows (1, 2, 4, 8 fake CPU devices).

For each ``seq`` the train step (forward, backward, AdamW; batch 1, remat, FSDP over ``seq``) is compiled ahead of
time on a ``data=1, seq=N, model=1`` mesh for lengths doubling from ``--start``; XLA's compiled memory analysis of
the SPMD program gives the bytes one device needs (arguments + outputs + temporaries - donated aliases). Nothing
runs. ``seq=1`` is the plain one-device step. Attention: the Pallas flash kernels (interpret mode on a CPU, the
buffers follow the GPU's tiling: linear in the length), ring or all-gather.

    python experiments/bench/context_memory.py --budget 1GiB
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import time  # noqa: E402

import lcx  # noqa: E402
from lcx.parallel import sharding  # noqa: E402
from lcx.config_base import format_bytes, parse_bytes  # noqa: E402
from lcx.train import TrainConfig  # noqa: E402
from lcx.train.loop import training_model  # noqa: E402
from lcx.train.step import compile_train_step  # noqa: E402

MODEL = lcx.ModelConfig(vocab_size=32000, d_model=512, n_layers=4, n_heads=8, n_kv_heads=2, d_ff=1408,
                        max_position_embeddings=1 << 20, attention=lcx.AttentionConfig("pallas"))


def step_bytes(model: lcx.ModelConfig, train: TrainConfig, seq: int) -> int:
    """Bytes one device needs for the compiled step (``seq`` devices on the sequence axis; 1: no mesh)."""
    mesh = None if seq == 1 else sharding.make_mesh(1, 1, seq=seq, devices=lcx_devices(seq))
    m = compile_train_step(training_model(model, train), train, mesh=mesh).memory_analysis()
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)


def lcx_devices(n: int):
    import jax

    return jax.devices()[:n]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="1GiB", help="bytes one device may use for the step")
    parser.add_argument("--start", type=int, default=2048)
    parser.add_argument("--max", type=int, default=65536)
    parser.add_argument("--strategies", nargs="+", default=["ring", "all_gather"])
    args = parser.parse_args()
    budget = parse_bytes(args.budget, "--budget")
    lengths = []
    n = args.start
    while n <= args.max:
        lengths.append(n)
        n *= 2
    print(f"model: {MODEL.n_layers} layers, d_model {MODEL.d_model}, {MODEL.n_heads} heads / {MODEL.n_kv_heads} KV, "
          f"vocab {MODEL.vocab_size}; bf16 compute, fp32 master + AdamW, remat, FSDP over seq; batch 1; budget "
          f"{format_bytes(budget)} per device; Pallas flash blocks")
    print("| strategy | seq | " + " | ".join(str(n) for n in lengths) + " | longest under budget |")
    print("|---|---|" + "---|" * len(lengths) + "---|")
    for strategy in args.strategies:
        for seq in (1, 2, 4, 8):
            if seq == 1 and strategy != args.strategies[0]:
                continue
            cells, longest, t0 = [], None, time.perf_counter()
            for n in lengths:
                train = TrainConfig(steps=10, batch_size=1, seq_len=n, compute_dtype="bfloat16", remat=True,
                                    fsdp=seq > 1, context_parallel=strategy)
                used = step_bytes(MODEL, train, seq)
                cells.append(format_bytes(used))
                if used <= budget:
                    longest = n
            name = "one device" if seq == 1 else strategy
            print(f"| {name} | {seq} | " + " | ".join(cells) + f" | {longest} |  ({time.perf_counter() - t0:.0f} s)",
                  flush=True)


if __name__ == "__main__":
    main()
