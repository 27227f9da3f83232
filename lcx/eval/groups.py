"""Cells of an evaluation grid computed together: one-shot cells on the same prompts share each prompt's prefill.

At long context the prefill is most of a one-shot cell's cost (a 32k prompt through Gemma-3-270M: about a minute on
a 2-core CPU), and every one-shot policy of a grid reads the same contexts. Cells of one RoPE variant, task, length,
needle depth and prompt count whose caches can read a context in two parts (``lcx.engine.split_prefill``) form a
group: each context's first ``len - 256`` tokens are prefilled once for the group, then each policy reads the rest
and compresses (``lcx.eval.one_shot``). A policy reads the same two calls alone, so a cell's answers do not depend
on which cells it was grouped with - or whether a worker found its group-mates done already.

A group is sharded as one unit (``lcx.eval.cells.assign``) and run under every member's lock; a member another
worker holds is left to it.
"""

from __future__ import annotations

import json
from collections import Counter

from lcx.engine.split_prefill import base_key, split_refusal


def share_keys(specs, caches: dict, capacities: dict, models, ev) -> list[str]:
    """One key per cell (``specs``: the grid's (setting, variant, task, length, depth, metric) tuples): equal
    non-empty keys for the cells computed together, empty for a cell computed alone."""
    keys = []
    for setting, variant, name, length, depth, metric in specs:
        cache = caches[(setting, length)]
        if metric != "accuracy" or setting.protocol != "one_shot" or split_refusal(models[variant.name][0], cache):
            keys.append("")
            continue
        keys.append(json.dumps([variant.name, name, length, depth, setting.samples or ev.samples,
                                *base_key(cache, capacities[(setting, variant.name, length)])]))
    counts = Counter(keys)
    return [k if k and counts[k] > 1 else "" for k in keys]


def members(keys: list[str], i: int) -> list[int]:
    """The cells computed with cell ``i`` (itself included), in grid order."""
    return [j for j, k in enumerate(keys) if k == keys[i]] if keys[i] else [i]


__all__ = ["members", "share_keys"]
