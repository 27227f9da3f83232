"""The Gemma-3 long-context grids' summary: per setting and length, each task's prompts answered with the Wilson
interval, all tasks pooled, the seconds per prompt and the device KV per sequence after the compression - and a plot.

    python experiments/real_model/long_context_table.py runs/gemma3_long_context/ablate/results.csv \
        runs/gemma3_memory/ablate/results.csv --plot docs/real_model/gemma3/accuracy.png

Prints Markdown tables (docs/real_model/README.md, "Gemma-3-270M inside its trained context").
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

from lcx.eval.report import read_csv
from lcx.eval.stats import wilson_interval

TASKS = ("passkey", "niah_single_2", "niah_multikey_1")


def cells(rows: list[dict]) -> dict:
    """(setting, length) -> {task: (answered, prompts), "seconds": [per prompt], "kv": bytes}; a grid of one task
    leaves its rows' ``task`` empty: its ``_task`` (set by ``main``) names it."""
    out: dict[tuple[str, int], dict] = defaultdict(dict)
    for r in rows:
        if r["metric"] != "accuracy":
            continue
        n = int(r["samples"])
        cell = out[(r["setting"], int(r["length"]))]
        cell[r["task"] or r.get("_task", "")] = (round(float(r["value"]) * n), n)
        cell.setdefault("seconds", []).append(float(r["seconds"]) / n)
        kv = r.get("held_kv_bytes") or r.get("kv_bytes")
        if kv not in (None, ""):
            cell["kv"] = max(cell.get("kv", 0), int(float(kv)))
    return out


def table(rows: list[dict]) -> str:
    data = cells(rows)
    settings = list(dict.fromkeys(r["setting"] for r in rows))
    lines = []
    for length in sorted({n for _, n in data}):
        lines += [f"\n{length:,} tokens: prompts answered (95% Wilson interval), seconds per prompt on this CPU (two "
                  "processes on 2 cores; a one-shot group's shared prefill split equally) and device KV per sequence "
                  "(after the compression):\n",
                  "| setting | " + " | ".join(TASKS) + " | all tasks | s / prompt | KV |",
                  "|---|" + "---|" * (len(TASKS) + 3)]
        for s in settings:
            cell = data.get((s, length))
            if not cell:
                continue
            parts = []
            for t in TASKS:
                k, n = cell.get(t, (0, 0))
                lo, hi = wilson_interval(k, n) if n else (0.0, 0.0)
                parts.append(f"{k}/{n} ({100 * lo:.0f}-{100 * hi:.0f}%)" if n else "-")
            k = sum(cell[t][0] for t in TASKS if t in cell)
            n = sum(cell[t][1] for t in TASKS if t in cell)
            lo, hi = wilson_interval(k, n)
            secs = cell["seconds"]
            lines.append(f"| {s} | " + " | ".join(parts) + f" | **{100 * k / n:.0f}%** ({100 * lo:.0f}-{100 * hi:.0f})"
                         f" | {sum(secs) / len(secs):.0f} | {cell.get('kv', 0) / 2**20:.0f} MiB |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    data = cells(rows)
    settings = list(dict.fromkeys(r["setting"] for r in rows))
    length = max(n for _, n in data)
    settings = [s for s in settings if (s, length) in data]
    tasks = [t for t in TASKS if any(t in data[(s, length)] for s in settings)]  # a task not run: no bar
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(tasks)
    for j, t in enumerate(tasks):
        values, errs = [], [[], []]
        for s in settings:
            k, n = data[(s, length)].get(t, (0, 0))
            lo, hi = wilson_interval(k, n) if n else (0.0, 0.0)
            values.append(k / n if n else np.nan)  # this setting did not run the task: no bar, no error bar
            errs[0].append(k / n - lo if n else 0.0)
            errs[1].append(hi - k / n if n else 0.0)
        ax.bar(np.arange(len(settings)) + (j - (len(tasks) - 1) / 2) * width, values, width, yerr=errs, capsize=2,
               label=t)
    ax.set_xticks(np.arange(len(settings)), settings, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("prompts answered (95% Wilson interval)")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"Gemma-3-270M, {length:,} tokens (trained context 32,768)")
    ax.legend(fontsize=8, loc="upper center", ncol=len(tasks))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", type=Path, help="results.csv of the grids")
    parser.add_argument("--plot", type=Path, help="write a bar chart of the longest length here")
    args = parser.parse_args()
    rows = []
    for path in args.results:  # a one-task grid's results.md is titled by its task
        md = path.parent / "results.md"
        text = md.read_text() if md.is_file() else ""
        names = [n for n in TASKS if f"### ablate {n} (" in text]
        rows += [{**r, "_task": names[0] if len(names) == 1 else ""} for r in read_csv(path)]
    print(table(rows), end="")
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
