"""The long run: one passkey prompt of a million tokens through the memory tier, on a CPU.

The quickstart's model was trained at 128 tokens. The prompt - a haystack of about a million tokens with the key at
``--depth``, then the question - streams through the tiered cache in chunks of 64: the device keeps 4 sinks and a
12-token window; every 16 tokens that leave it become a block in a long-term store on disk (int8), routed by Quest
in two levels (groups of 64 blocks, then the blocks of the 4 best groups) with 2 blocks recalled per KV head, at
local positions (sinks, recalled tokens, window, chunk: at most 127, inside the trained 128). The answer is graded,
and the wall time, tokens per second, device KV bytes and store bytes are reported and written to ``--out``.

    lcx run experiments/configs/quickstart.yaml          # the model (runs/quickstart/train)
    python experiments/memory_1m.py --tokens 1000000     # a few minutes on 2 cores
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path

import lcx
from lcx.data import make_task
from lcx.data.task import TOKENIZER
from lcx.train import load_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", default="runs/quickstart/train", help="an lcx run / checkpoint directory")
    parser.add_argument("--tokens", type=int, default=1_000_000, help="prompt length in tokens")
    parser.add_argument("--depth", type=float, default=0.5, help="where the key hides, 0 (start) to 1 (end)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--store-dir", default=None, help="directory for the disk store (default: a temp dir)")
    parser.add_argument("--out", default="runs/memory_1m/result.json")
    args = parser.parse_args()

    model, params = load_checkpoint(args.run)
    model = dataclasses.replace(model, attention=lcx.AttentionConfig("auto"), dtype="float32")
    task = make_task("passkey", {"instruction": False, "template": "compact", "depth": args.depth})
    t0 = time.perf_counter()
    example = task.examples(args.seed, 0, 1, args.tokens, "validation")[0]
    prompt = example.prompt_ids
    build_s = time.perf_counter() - t0

    store_dir = args.store_dir or tempfile.mkdtemp(prefix="lcx-store-")
    cache = lcx.CacheConfig(policy="memory", sinks=4, window=12, topk=2, block=16, positions="local", interval=16,
                            prefill_chunk=64, store="disk", store_dir=store_dir, memory_dtype="int8",
                            route_groups=64, route_candidates=4)
    gen = lcx.Generator(model, params, max_new_tokens=8, cache=cache, eos_id=TOKENIZER.eos_id)
    t0 = time.perf_counter()
    state = gen.prefill([prompt], progress=True)
    prefill_s = time.perf_counter() - t0
    blocks, meta_bytes = int(state.cache.n_blocks.max()), state.cache.metadata_bytes()
    t0 = time.perf_counter()
    result = gen.result(gen.decode(state))
    decode_s = time.perf_counter() - t0
    answer = TOKENIZER.decode(result.tokens[0][: result.lengths[0]])
    out = {
        "tokens": len(prompt), "depth": args.depth, "key": example.answer, "generated": answer,
        "correct": bool(task.score(example, answer)), "prefill_seconds": round(prefill_s, 1),
        "prefill_tokens_per_s": round(len(prompt) / prefill_s), "decode_seconds": round(decode_s, 2),
        "prompt_build_seconds": round(build_s, 1), "device_kv_bytes": result.cache_bytes,
        "device_meta_bytes": meta_bytes, "store_bytes": result.store_bytes,
        "store": f"disk ({store_dir}), int8", "blocks": blocks,
        "cache": cache.to_dict(),
    }
    gen.close()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
