"""Would the question's words find the needle's block where its query vectors do not? (docs/real_model (l)).

The memory tier's router ranks long-term blocks by the question's queries (Quest's bound on ``q . k``); on numbers
hidden in prose it recalls the needle's block in 14% of (layer, KV head) pairs (``memory_router_probe.py``). This
script scores the same blocks by the tokens they share with the question - no model, the tokenizer only:

- ``count``: how many distinct question tokens the block holds;
- ``idf``: the same, each token weighted by ``log(n / df)`` over the ``n`` long-term blocks (``df``: the blocks
  holding it), so the template words every needle and the question share weigh little.

The long-term blocks are the context's tokens between the ``sinks`` and the working ``window`` in blocks of
``block`` (the tier's contiguous blocks, up to where its spills fall); a needle still in the window has no rank.

    python experiments/real_model/lexical_router_probe.py runs/models/SmolLM2-135M-Instruct \
        --config experiments/configs/smollm2_past_context.yaml --task niah_single_2 --length 16384 --samples 8 \
        --window 1532

This measures a signal, not a router lcx ships: the tier routes on key and query vectors only.
"""

from __future__ import annotations

import argparse
import collections
import math
import sys
from pathlib import Path

import numpy as np

import lcx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory_router_probe import examples, needle_span, prompt_arguments  # noqa: E402  (a sibling script, not a package)

SCORINGS = ("count", "idf")


def block_scores(blocks: list[list[int]], question: list[int]) -> dict[str, np.ndarray]:
    """Per scoring of :data:`SCORINGS`, one score per block (higher: recalled first)."""
    df = collections.Counter(t for b in blocks for t in set(b))
    asked = set(question)
    n = len(blocks)
    shared = [set(b) & asked for b in blocks]
    return {"count": np.array([len(s) for s in shared], dtype=np.float64),
            "idf": np.array([sum(math.log(n / df[t]) for t in s) for s in shared])}


def rank_of(scores: np.ndarray, wanted: list[int]) -> int:
    """The best rank (0: the top) of the ``wanted`` blocks; ties ranked against the wanted block."""
    best = max(scores[b] for b in wanted)
    return int(np.sum(scores > best))


def probe(ids: list[int], cut: int, span: tuple[int, int], sinks: int, block: int, window: int, asked: int = 0
          ) -> dict:
    """One prompt: the needle's blocks and their rank under each scoring (None while the needle is in the window).
    ``asked``: match the prompt's last ``asked`` tokens (``cache.lexical_tokens``); 0: the question's."""
    end_store = max(sinks, len(ids) - window)
    starts = range(sinks, end_store - block + 1, block)
    blocks = [ids[s:s + block] for s in starts]
    wanted = [i for i, s in enumerate(starts) if s < span[1] and span[0] < s + block]
    row = {"blocks": len(blocks), "needle": span[0]}
    if not wanted:
        return row | {s: None for s in SCORINGS}
    scores = block_scores(blocks, ids[-asked:] if asked else ids[cut:])
    return row | {s: rank_of(scores[s], wanted) for s in SCORINGS}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    prompt_arguments(ap)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--window", type=int, required=True, help="the working window, tokens")
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--asked", type=int, default=0,
                    help="match the prompt's last N tokens (cache.lexical_tokens); 0: the question's tokens")
    args = ap.parse_args(argv)
    for name in ("sinks", "block", "window", "topk", "samples", "length", "asked", "start"):
        least = 0 if name in ("sinks", "asked", "start") else 1
        if getattr(args, name) < least:
            ap.error(f"--{name}={getattr(args, name)} is invalid: must be an integer >= {least}")
    lm = lcx.load(args.model)
    _, exs = examples(lm, args.config, args.task, args.length, args.samples, args.start)
    rows = []
    for i, ex in enumerate(exs, start=args.start):
        ids = list(map(int, ex.prompt_ids))
        row = probe(ids, ex.context_len, needle_span(lm.tokenizer, ids, ex.references[0]), args.sinks, args.block,
                    args.window, args.asked)
        rows.append(row)
        ranks = "in the window" if row["idf"] is None else ", ".join(f"{s} rank {row[s]}" for s in SCORINGS)
        print(f"prompt {i}: needle at token {row['needle']:,} of {len(ids):,}, {row['blocks']} blocks: {ranks}")
    ranked = [r for r in rows if r["idf"] is not None]
    for s in SCORINGS:
        hits = sum(r[s] < args.topk for r in ranked)
        median = float(np.median([r[s] for r in ranked])) if ranked else float("nan")
        print(f"{s}: the needle's block in the top {args.topk} for {hits} of {len(ranked)} prompts "
              f"(median rank {median:g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
