"""The tables of docs/real_model (l) from ``memory_router_probe.py``'s JSON lines: one row per prompt (where the
needle is, its block's rank and share of (layer, KV head) pairs recalling it, the answers in each mode the probe ran:
router, oracle, control), then the share recalling it under each routing alternative, averaged over the prompts
with a block.

    python experiments/real_model/memory_router_table.py runs/memory_probe/smollm2_16k.jsonl [more.jsonl ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def _answer(cell) -> str:
    if cell is None or cell.get("found") is None:
        return "-"
    text = " ".join(cell["output"].split())[:28].replace("|", "\\|")
    return f"{'yes' if cell['found'] else 'no'} (`{text}`)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", type=Path)
    args = ap.parse_args()
    for path in args.files:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        print(f"\n## {path.stem} ({len(rows)} prompts)\n")
        modes = [m for m in ("router", "oracle", "control") if any(m in r for r in rows)]
        print("| prompt | needle at token | blocks | (layer, head) recalling it | median rank | " + " | ".join(modes)
              + " |")
        print("|---:|---:|---:|---:|---:|" + "---|" * len(modes))
        for r in rows:
            span = r.get("needle_tokens")  # files of the probe's first version hold no span for an unranked needle
            where = ("in the window" if span is None else
                     f"{span[0]:,} of {r['length']:,}" + ("" if "in_top" in r else " (in the window)"))
            share = f"{r['in_top']:.0%}" if "in_top" in r else "-"
            rank = f"{r['median_rank']:g}" if "median_rank" in r else "-"
            print(f"| {r['prompt']} | {where} | {r.get('blocks', '-')} | {share} | {rank} | "
                  + " | ".join(_answer(r.get(m)) for m in modes) + " |")
        for mode in modes:
            done = [r[mode]["found"] for r in rows if r.get(mode) and r[mode]["found"] is not None]
            print(f"\n{mode}: {sum(done)}/{len(done)} found" + ("" if mode == "router" else
                                                              " (the prompts whose needle left the window)"))
        blocked = [r for r in rows if "alternatives" in r]
        if blocked:
            names = list(blocked[0]["alternatives"])
            print("\n| routing | (layer, head) pairs recalling the needle's block, mean over prompts | "
                  "median rank, median over prompts |\n|---|---:|---:|")
            print(f"| as configured | {np.mean([r['in_top'] for r in blocked]):.0%} | "
                  f"{np.median([r['median_rank'] for r in blocked]):g} |")
            for name in names:
                alt = [r["alternatives"][name] for r in blocked if name in r["alternatives"]]
                print(f"| {name} | {np.mean([a['in_top'] for a in alt]):.0%} | "
                      f"{np.median([a['median_rank'] for a in alt]):g} |")


if __name__ == "__main__":
    main()
