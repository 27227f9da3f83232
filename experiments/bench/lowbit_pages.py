"""What a bit-packed cache holds in pages: bytes at the peak, against a bfloat16 full cache, with and without eviction.

    python experiments/bench/lowbit_pages.py runs/models/SmolLM2-135M-Instruct --context 4096

A real checkpoint (``lcx.load``), one row, a ``--context``-token prompt of the Python reference manual's prose
(prefilled in chunks of ``--chunk``), ``--new`` greedy tokens. Per setting: ``GenerateResult.cache_bytes`` (for a
paged cache the peak pages in use plus each row's float window, from the arrays' dtypes and shapes) as a share of
the bfloat16 full cache of the same tokens, the share of the prompt evicted, and whether the greedy tokens equal the
same setting's contiguous cache (the pages are a layout, not an approximation). The float window of
``kv_residual`` (and the key group still filling) is kept in the model's dtype (float32 on this CPU); the bfloat16
column counts it as bfloat16, as a bfloat16 model would keep it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

import lcx  # noqa: E402
from lcx.config import CacheConfig  # noqa: E402
from lowbit_decode import _prompt  # noqa: E402  (the sibling script: the manual's prose, cut to a token count)

PAGE = 64


def settings(context: int) -> dict[str, dict]:
    """name -> cache settings; evicting ones keep a quarter of the prompt (compression 0.75)."""
    keep = {"budget": context // 4, "interval": 64}
    return {
        "float32, full": {},
        "int4, full": {"kv_dtype": "int4"},
        "int4 + 128-token window, full": {"kv_dtype": "int4", "kv_residual": 128},
        "float32, SnapKV c=0.75": {"policy": "snapkv", "window": 32, **keep},
        "int4, SnapKV c=0.75": {"kv_dtype": "int4", "policy": "snapkv", "window": 32, **keep},
        "int2, SnapKV c=0.75": {"kv_dtype": "int2", "policy": "snapkv", "window": 32, **keep},
        "int4, TOVA c=0.75": {"kv_dtype": "int4", "policy": "tova", **keep},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--only", type=int, nargs="*", help="run these settings only (1-based, in the table's order)")
    args = ap.parse_args()
    lm = lcx.load(args.checkpoint)
    ids = _prompt(lm, args.context)
    tokens = args.context + args.new
    bf16 = CacheConfig(dtype="bfloat16").kind(lm.config).nbytes(1, tokens)
    print(f"{args.checkpoint}: {args.context} prompt + {args.new} new tokens; bfloat16 full cache {bf16:,} bytes; "
          f"pages of {PAGE} tokens\n")
    print("| cache | layout | cache_bytes | vs bfloat16 full | float window | tokens = contiguous | seconds |")
    print("|---|---|---|---|---|---|---|")
    todo = settings(args.context)
    for i, (name, cache) in enumerate(todo.items(), 1):
        if args.only and i not in args.only:
            continue
        results = {}
        for layout in ("contiguous", "paged"):
            start = time.perf_counter()
            cfg = CacheConfig(layout=layout, page_size=PAGE, prefill_chunk=args.chunk, **cache)
            results[layout] = (lcx.generate(lm.config, lm.params, [ids], max_new_tokens=args.new, cache=cfg),
                               time.perf_counter() - start)
        (paged, seconds), (contiguous, _) = results["paged"], results["contiguous"]
        # float buffers are in the model's dtype (float32 here): counted at 2 bytes an element for the ratio
        kind = CacheConfig(layout="paged", page_size=PAGE, **cache).kind(lm.config)
        window = kind.nbytes(1, PAGE) - kind.page_nbytes()  # one row's float window (0 for a float cache)
        wide = np.dtype(lm.config.dtype).itemsize / 2
        as_bf16 = paged.cache_bytes / wide if not cache.get("kv_dtype") else paged.cache_bytes - window * (1 - 1 / wide)
        same = bool(np.array_equal(paged.tokens, contiguous.tokens))
        print(f"| {name} | paged | {paged.cache_bytes:,} | {as_bf16 / bf16:.3f} (1/{bf16 / as_bf16:.1f}) | "
              f"{window:,} | {same} | {seconds:.0f} |", flush=True)
        print(f"  [{i}/{len(todo)}] contiguous cache_bytes {contiguous.cache_bytes:,}", flush=True)


if __name__ == "__main__":
    main()
