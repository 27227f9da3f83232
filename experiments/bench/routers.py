"""Memory routers compared: recall@k against the full-attention oracle, and passkey retrieval beyond the training
length, for quest, infllm and a learned router distilled from the model.

1. The learned router is trained (``lcx.train.router``) on the quickstart's data mixture; its held-out recall@k
   against the teacher (the model's full attention, random and answer-predicting queries) is reported next to
   Quest's on the same blocks.
2. recall@k in generation, at the training length (so the oracle - the model's own full attention over the prompt -
   is within its trained range): passkey prompts of 128 tokens through a memory cache with a 32-token window and
   blocks of 16; for the last prompt query, the share of the oracle's top-k blocks that each router recalled
   (``lcx.eval.recall``).
3. Passkey retrieval at 4x and 8x the training length per router, at the quickstart's memory setting.

    python experiments/bench/routers.py --run runs/quickstart/train
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile

import numpy as np

import lcx
from lcx.data import make_task
from lcx.eval.evaluate import retrieval_scores
from lcx.eval.recall import block_attention, recall_at_k, trace_recall
from lcx.train import load_checkpoint
from lcx.train.config import DataConfig
from lcx.train.router import RouterConfig, train_router

MIXTURE = {"parts": [{"task": "corpus", "weight": 0.4, "loss_weight": 0.15, "params": {"bos": True}},
                     {"task": "passkey", "weight": 0.6, "params": {"instruction": False, "template": "compact",
                                                                   "filler_min": 0, "offset": True}}]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", default="runs/quickstart/train")
    parser.add_argument("--samples", type=int, default=24, help="prompts per depth")
    args = parser.parse_args()
    model, params = load_checkpoint(args.run)
    model = dataclasses.replace(model, attention=lcx.AttentionConfig("auto"), dtype="float32")
    router_dir = tempfile.mkdtemp(prefix="lcx-router-")
    summary = train_router(model, params, RouterConfig(steps=300, batch_size=16, seq_len=128, rank=32, sinks=4,
                                                       window=32, block=16, topk=2, positions="local"),
                           DataConfig(task="mixture", params=MIXTURE), router_dir, progress=False)
    print("held-out (teacher = full attention at 128 tokens):", summary)

    passkey = make_task("passkey", {"instruction": False, "template": "compact"})
    routers = {"quest": {}, "infllm": {"representatives": 4}, "learned": {"router_path": router_dir}}
    print("\n| router | recall@2 vs full attention (128 tokens) | passkey 512 (4x) | passkey 1024 (8x) |")
    print("|---|---|---|---|")
    for name, extra in routers.items():
        small = lcx.CacheConfig(policy="memory", sinks=4, window=32, block=16, topk=2, positions="local",
                                interval=16, prefill_chunk=16, router=name, **extra)
        prompts = [ex.prompt_ids for ex in passkey.examples(11, 0, 32, 128, "validation")]
        trace = trace_recall(model, params, small, prompts)
        recall = recall_at_k(trace, block_attention(model, params, prompts, trace.block_pos))
        quickstart = lcx.CacheConfig(policy="memory", budget=96, sinks=4, topk=3, block=16, positions="local",
                                     interval=16, prefill_chunk=16, router=name,
                                     **({"router_path": extra["router_path"]} if "router_path" in extra else {}))
        cells = []
        for length in (512, 1024):
            scores = np.concatenate([retrieval_scores(model, params, passkey, length=length, depth=d,
                                                      samples=args.samples, batch_size=args.samples, seed=1234,
                                                      cache=quickstart) for d in (0.1, 0.5, 0.9)])
            cells.append(f"{scores.mean():.0%}")
        print(f"| {name} | {recall:.2f} | {cells[0]} | {cells[1]} |", flush=True)


if __name__ == "__main__":
    main()
