"""Longest trainable sequence at a fixed memory budget: flash (Pallas) vs XLA attention, with and without remat.

For each setting the train step (forward, backward, AdamW update; batch 1) is compiled ahead of time for sequence
lengths doubling from ``--start``, and XLA's compiled memory analysis gives the bytes the step needs: arguments
(params, optimizer state, batch) + outputs + temporaries, minus the donated state counted twice. Deterministic on
CPU, nothing runs. The longest length under ``--budget`` is reported per setting. On a CPU the Pallas kernels
compile in interpret mode, whose buffers follow the same tiling as on a GPU: XLA attention materializes the
``[heads, T, T]`` scores (quadratic), flash keeps ``[T, block]`` tiles (linear).

    python experiments/bench/train_memory.py --budget 2GiB
"""

from __future__ import annotations

import argparse
import dataclasses

import lcx
from lcx.config_base import format_bytes, parse_bytes
from lcx.train import TrainConfig
from lcx.train.loop import training_model
from lcx.train.step import compile_train_step

MODEL = lcx.ModelConfig(vocab_size=32000, d_model=512, n_layers=4, n_heads=8, n_kv_heads=2, d_ff=1408,
                        max_position_embeddings=1 << 20)


def step_bytes(model: lcx.ModelConfig, train: TrainConfig) -> int:
    m = compile_train_step(training_model(model, train), train).memory_analysis()
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="2GiB", help="bytes one device may use for the step")
    parser.add_argument("--start", type=int, default=1024)
    parser.add_argument("--max", type=int, default=65536)
    args = parser.parse_args()
    budget = parse_bytes(args.budget, "--budget")
    print(f"model: {MODEL.n_layers} layers, d_model {MODEL.d_model}, {MODEL.n_heads} heads / {MODEL.n_kv_heads} KV, "
          f"vocab {MODEL.vocab_size}; bf16 compute, fp32 master + AdamW; batch 1; budget {format_bytes(budget)}")
    print("| attention | remat | " + " | ".join(f"{n}" for n in _lengths(args)) + " | longest under budget |")
    print("|---|---|" + "---|" * len(_lengths(args)) + "---|")
    for impl in ("xla", "pallas"):
        for remat in (False, True):
            model = dataclasses.replace(MODEL, attention=lcx.AttentionConfig(impl))
            cells, longest = [], None
            for n in _lengths(args):
                train = TrainConfig(steps=10, batch_size=1, seq_len=n, compute_dtype="bfloat16", remat=remat)
                used = step_bytes(model, train)
                cells.append(format_bytes(used))
                if used <= budget:
                    longest = n
            print(f"| {impl} | {'full' if remat else 'none'} | " + " | ".join(cells) + f" | {longest} |", flush=True)


def _lengths(args) -> list[int]:
    out, n = [], args.start
    while n <= args.max:
        out.append(n)
        n *= 2
    return out


if __name__ == "__main__":
    main()
