"""Training noise in the quickstart: train + ablate it with several seeds and say which results hold on every seed.

    python experiments/quickstart_seeds.py [--seeds 0 1 2] [--out docs/quickstart/seeds.md]

Seed s runs ``lcx run experiments/configs/quickstart.yaml name=quickstart_seed{s} train.seed={s}`` (seed 0 is the
main job's own run, ``runs/quickstart``; a finished run is reused). ``train.seed`` draws the initial weights and the
training batches. The report puts the seeds' numbers side by side - passkey accuracy pooled over the three depths
(72 prompts), perplexity of the same held-out tails - and lists, per length, every ordering of two policies that holds
on every seed and every one that flips.
"""

from __future__ import annotations

import argparse
import itertools
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

from lcx.eval.report import read_csv

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "experiments" / "configs" / "quickstart.yaml"


def run_name(seed: int) -> str:
    return "quickstart" if seed == 0 else f"quickstart_seed{seed}"


def run_seed(seed: int, runs: Path) -> Path:
    """The seed's ablate results (trained and ablated first when missing)."""
    results = runs / run_name(seed) / "ablate" / "results.csv"
    cmd = ["lcx", "run", str(CONFIG), f"name={run_name(seed)}", f"train.seed={seed}", f"runs_dir={runs}"]
    print(f"seed {seed}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)
    return results


def table(paths: dict[int, Path]) -> dict[tuple[str, str, int], dict[int, float]]:
    """(metric, setting, length) -> seed -> value (accuracy pooled over depths: the mean of equal-size cells)."""
    cells: dict[tuple, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for seed, path in paths.items():
        for row in read_csv(path):
            cells[(row["metric"], row["setting"], int(row["length"]))][seed].append(float(row["value"]))
    return {key: {s: float(np.mean(v)) for s, v in by_seed.items()} for key, by_seed in cells.items()}


def report(values: dict, seeds: list[int]) -> str:
    settings = list(dict.fromkeys(k[1] for k in values))
    lengths = sorted({k[2] for k in values})
    out = [f"# Quickstart across training seeds {', '.join(map(str, seeds))}\n",
           f"`python experiments/quickstart_seeds.py --seeds {' '.join(map(str, seeds))}`: the main job's train + "
           "ablate, once per `train.seed` (initial weights and batches). Each cell lists the seeds' values in order; "
           "spread = max - min.\n"]
    for metric, fmt in (("accuracy", lambda v: f"{100 * v:.0f}%"), ("perplexity", lambda v: f"{v:.2f}")):
        out.append(f"\n## {'Passkey accuracy (72 prompts, pooled over depths)' if metric == 'accuracy' else 'Perplexity'}\n")
        out.append("| setting | " + " | ".join(f"{n}" for n in lengths) + " |")
        out.append("|---|" + "---|" * len(lengths))
        for s in settings:
            cells = []
            for n in lengths:
                v = values.get((metric, s, n), {})
                if not v:
                    cells.append("-")
                    continue
                vals = [v[k] for k in seeds if k in v]
                spread = max(vals) - min(vals)
                cells.append(" / ".join(fmt(x) for x in vals) + f" (spread {fmt(spread)})")
            out.append(f"| {s} | " + " | ".join(cells) + " |")
        out.append("")
        better = (lambda a, b: a > b) if metric == "accuracy" else (lambda a, b: a < b)
        for n in lengths:
            hold, flip = [], []
            for a, b in itertools.combinations(settings, 2):
                va, vb = values.get((metric, a, n)), values.get((metric, b, n))
                if not va or not vb:
                    continue
                wins = [better(va[k], vb[k]) for k in seeds]
                losses = [better(vb[k], va[k]) for k in seeds]
                if all(wins):
                    hold.append(f"{a} > {b}")
                elif all(losses):
                    hold.append(f"{b} > {a}")
                elif any(wins) and any(losses):
                    flip.append(f"{a} vs {b}")
            out.append(f"- **{n} tokens** ({metric}; '>' = better): {len(hold)} orderings hold on every seed, "
                       f"{len(flip)} flip" + (f": {'; '.join(flip)}" if flip else "") + ".")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--runs", type=Path, default=ROOT / "runs")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "quickstart" / "seeds.md")
    args = parser.parse_args(argv)
    paths = {s: run_seed(s, args.runs) for s in args.seeds}
    text = report(table(paths), args.seeds)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
