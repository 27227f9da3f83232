"""Per-KV-head vs per-layer keep sets: passkey retrieval of the score-based policies on the quickstart's model.

Each policy runs with its keep sets per KV head (the default of score-based policies, as in the papers and kvpress),
shared by the layer (``heads: shared``) and, where it applies, with AdaKV's head-adaptive budget - at the
quickstart's budget of 96 tokens, at 1x and 2x the training length (72 prompts per cell: depths 0.1, 0.5, 0.9).

    python experiments/bench/heads.py --run runs/quickstart/train
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np

import lcx
from lcx.data import make_task
from lcx.eval.evaluate import retrieval_scores
from lcx.train import load_checkpoint

POLICIES = {
    "h2o": {"policy": "h2o"},
    "observed": {"policy": "observed"},
    "snapkv": {"policy": "snapkv", "window": 16},
    "knorm": {"policy": "knorm"},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", default="runs/quickstart/train")
    parser.add_argument("--samples", type=int, default=24, help="prompts per depth")
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 256])
    args = parser.parse_args()
    model, params = load_checkpoint(args.run)
    model = dataclasses.replace(model, attention=lcx.AttentionConfig("auto"))
    task = make_task("passkey", {"instruction": False, "template": "compact"})
    modes = {"per KV head": {}, "shared": {"heads": "shared"}, "per KV head, adaptive": {"head_budget": "adaptive"}}
    print("| policy | " + " | ".join(f"{m} @ {n}" for m in modes for n in args.lengths) + " |")
    print("|---|" + "---|" * (len(modes) * len(args.lengths)))
    for name, params_ in POLICIES.items():
        cells = []
        for extra in modes.values():
            cache = lcx.CacheConfig(budget=96, interval=16, prefill_chunk=64, **params_, **extra)
            for length in args.lengths:
                scores = np.concatenate([retrieval_scores(model, params, task, length=length, depth=d,
                                                          samples=args.samples, batch_size=args.samples, seed=1234,
                                                          cache=cache) for d in (0.1, 0.5, 0.9)])
                cells.append(f"{scores.mean():.0%}")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
