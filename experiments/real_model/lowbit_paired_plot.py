"""Plot every setting's paired difference from a baseline (95% interval), from graded ``outputs.jsonl`` files.

    python experiments/real_model/lowbit_paired_plot.py runs/smollm2_ruler_lowbit/ablate/outputs.jsonl \\
        runs/hf_caches_ruler/outputs.jsonl --baseline full --out docs/real_model/kv_lowbit/ruler_paired.png

The numbers are those of ``python -m lcx.eval.paired`` (same pairing, same interval).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from lcx.eval.paired import KEY, read_outputs  # noqa: E402
from lcx.eval.stats import paired_difference  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("outputs", nargs="+", type=Path)
    ap.add_argument("--baseline", required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    generations = read_outputs(args.outputs)
    grades: dict[str, dict] = {}
    for g in generations:
        grades.setdefault(g["setting"], {})[tuple(g[k] for k in KEY)] = g["grade"]
    base = grades[args.baseline]
    rows = []
    for setting, own in grades.items():
        if setting == args.baseline:
            continue
        shared = [k for k in own if k in base]
        r = paired_difference([base[k] for k in shared], [own[k] for k in shared], [k[0] for k in shared])
        rows.append((setting, 100 * r.diff, 100 * r.lo, 100 * r.hi))
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.2))
    for i, (setting, diff, lo, hi) in enumerate(rows):
        ax.errorbar(diff, i, xerr=[[diff - lo], [hi - diff]], fmt="o", color="C3" if hi < 0 else "C0", capsize=3)
    ax.axvline(0, color="grey", lw=0.8)
    ax.axvspan(-2, 2, color="C2", alpha=0.12, label="within 2 points")
    ax.set_yticks(range(len(rows)), [r[0] for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel(f"macro-average accuracy minus {args.baseline!r}, points (paired, 95% interval)")
    ax.legend(loc="upper left")
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
