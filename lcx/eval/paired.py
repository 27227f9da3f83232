"""Settings compared prompt by prompt: the ``outputs.jsonl`` of evaluation grids (one graded generation per line)
against one baseline setting, on the prompts both were graded on.

Two settings run on the same prompts (every grid of one seed is) differ by far less noise than their Wilson
intervals suggest, or by more: the paired difference says which. Usage::

    python -m lcx.eval.paired runs/NAME/ablate/outputs.jsonl [more outputs.jsonl ...] --baseline full
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from lcx.eval.stats import paired_difference

KEY = ("task", "length", "depth", "sample")  # what makes two lines the same prompt


def read_outputs(paths: list[Path]) -> list[dict]:
    """The graded generations of every file; a setting that appears in two files keeps the later file's lines."""
    by_setting: dict[str, list[dict]] = {}
    for path in paths:
        in_file: dict[str, list[dict]] = {}
        for line in Path(path).read_text().splitlines():
            if line.strip():
                g = json.loads(line)
                in_file.setdefault(g["setting"], []).append(g)
        by_setting.update(in_file)
    return [g for lines in by_setting.values() for g in lines]


def paired_table(generations: list[dict], baseline: str) -> str:
    """A markdown table: every other setting against ``baseline`` on their shared prompts - macro averages, the
    difference with its 95% interval, prompts graded higher / lower, and the sign test's p-value."""
    settings = list(dict.fromkeys(g["setting"] for g in generations))
    if baseline not in settings:
        raise ValueError(f"baseline={baseline!r} is not a setting of these outputs; they hold {settings}")
    grades = {s: {tuple(g[k] for k in KEY): g["grade"] for g in generations if g["setting"] == s} for s in settings}
    base = grades[baseline]
    lines = [f"| setting vs {baseline} | prompts | {baseline} | setting | difference (95% interval) | higher / lower "
             "| sign test p |", "|---|---|---|---|---|---|---|"]
    for setting in settings:
        if setting == baseline:
            continue
        shared = [k for k in grades[setting] if k in base]
        if not shared:
            raise ValueError(f"setting {setting!r} shares no prompt with {baseline!r} (prompts are matched by "
                             f"{', '.join(KEY)})")
        r = paired_difference([base[k] for k in shared], [grades[setting][k] for k in shared], [k[0] for k in shared])
        lines.append(f"| {setting} | {len(shared)} | {100 * r.mean_a:.1f}% | {100 * r.mean_b:.1f}% | "
                     f"{100 * r.diff:+.1f} ({100 * r.lo:+.1f} to {100 * r.hi:+.1f}) | {r.better} / {r.worse} | "
                     f"{r.p:.2g} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("outputs", nargs="+", type=Path, help="outputs.jsonl of lcx eval / ablate stages")
    parser.add_argument("--baseline", required=True, help="the setting every other one is compared with")
    args = parser.parse_args(argv)
    print(paired_table(read_outputs(args.outputs), args.baseline), end="")


if __name__ == "__main__":
    main()
