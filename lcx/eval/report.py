"""Results of an evaluation grid: ``results.csv`` (one row per cell), ``results.md`` (a readable table: one row per
policy / budget / RoPE setting, one column per context length) and PNG plots (metric vs length; for retrieval with
depths, a depth x length heat map per setting)."""

from __future__ import annotations

import csv
from collections import defaultdict
from pathlib import Path

import numpy as np

FIELDS = ("policy", "budget", "rope", "length", "depth", "metric", "value", "samples", "seconds")


def label(row: dict) -> str:
    budget = "" if row["budget"] in (None, "") else f" @{row['budget']}"
    rope = "" if row["rope"] in ("trained", "") else f" [{row['rope']}]"
    return f"{row['policy']}{budget}{rope}"


def write_csv(rows: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: row.get(k, "") for k in FIELDS})


def read_csv(path: Path) -> list[dict]:
    with open(path) as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        row["length"] = int(row["length"])
        row["value"] = float(row["value"])
        row["depth"] = "" if row["depth"] == "" else float(row["depth"])
    return rows


def _fmt(metric: str, value: float) -> str:
    return f"{100 * value:.0f}%" if metric == "accuracy" else f"{value:.2f}"


def markdown_table(rows: list[dict], title: str) -> str:
    """One line per setting, one column per length (mean over depths)."""
    metric = rows[0]["metric"]
    lengths = sorted({r["length"] for r in rows})
    cells: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    order: list[str] = []
    for r in rows:
        key = label(r)
        if key not in cells:
            order.append(key)
        cells[key][r["length"]].append(r["value"])
    head = "| setting | " + " | ".join(f"{n} tokens" for n in lengths) + " |"
    lines = [f"### {title} ({metric})", "", head, "|---" * (len(lengths) + 1) + "|"]
    for key in order:
        values = [(_fmt(metric, float(np.mean(cells[key][n]))) if cells[key][n] else "-") for n in lengths]
        lines.append(f"| {key} | " + " | ".join(values) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], out_dir: Path, title: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric = rows[0]["metric"]
    paths = []
    by_label: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    style: dict[str, dict] = {}
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    budgets = list(dict.fromkeys(str(r["budget"]) for r in rows))
    ropes = list(dict.fromkeys(r["rope"] for r in rows))
    colors = plt.get_cmap("tab10").colors
    for r in rows:
        key = label(r)
        by_label[key][r["length"]].append(r["value"])
        # one colour per policy, a line style per budget, a marker per RoPE variant: 20+ lines stay readable
        style[key] = dict(color=colors[policies.index(r["policy"]) % len(colors)],
                          linestyle=("-", "--", ":", "-.")[budgets.index(str(r["budget"])) % 4],
                          marker="osD^v"[ropes.index(r["rope"]) % 5])
    fig, ax = plt.subplots(figsize=(8, 5))
    for key, series in by_label.items():
        xs = sorted(series)
        ax.plot(xs, [np.mean(series[x]) for x in xs], label=key, alpha=0.85, **style[key])
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel(metric)
    if metric == "accuracy":
        ax.set_ylim(-0.02, 1.02)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path = out_dir / f"{metric}_vs_length.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    paths.append(path)

    depths = sorted({r["depth"] for r in rows if r["depth"] != ""})
    if metric == "accuracy" and len(depths) > 1:
        lengths = sorted({r["length"] for r in rows})
        keys = list(by_label)
        cols = min(4, len(keys))
        nrows = -(-len(keys) // cols)
        fig, axes = plt.subplots(nrows, cols, figsize=(3.2 * cols, 2.8 * nrows), squeeze=False)
        for ax, key in zip(axes.flat, keys):
            grid = np.full((len(depths), len(lengths)), np.nan)
            for r in rows:
                if label(r) == key and r["depth"] != "":
                    grid[depths.index(r["depth"]), lengths.index(r["length"])] = r["value"]
            ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="lower")
            ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], fontsize=7)
            ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths], fontsize=7)
            ax.set_title(key, fontsize=8)
        for ax in list(axes.flat)[len(keys):]:
            ax.axis("off")
        fig.suptitle(f"{title}: accuracy by needle depth (rows) and length (columns)", fontsize=9)
        fig.tight_layout()
        path = out_dir / "accuracy_heatmap.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def write_report(rows: list[dict], out_dir: Path, title: str) -> list[Path]:
    """results.csv, results.md and the plots in ``out_dir``; returns the written paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    write_csv(rows, out_dir / "results.csv")
    (out_dir / "results.md").write_text(markdown_table(rows, title))
    return [out_dir / "results.csv", out_dir / "results.md", *plot(rows, out_dir, title)]
