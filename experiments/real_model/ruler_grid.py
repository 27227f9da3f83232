"""One table and one plot of a RULER-style grid (one run, or several merged): the macro average (95% interval) of
every setting at every compression ratio, from the ``results.csv`` of ``lcx run`` (and of
``experiments/kvpress_eval.py``).

A row is a setting without its ratio (``snapkv window=32 kernel=5``), a column a compression ratio; ``full`` and
other settings that do not compress fill their own column. Where two files hold the same cell the later argument
wins. ``head_cap`` is dropped from the labels: a cap of at least ``1 / (1 - c)`` never binds (a head cannot hold
more than the context), so KVzip's pooled runs with caps 2, 4 and 8 are one setting; so is DuoAttention's
``head_ratio``, which the compression ratio sets.

Usage::

    python experiments/real_model/ruler_grid.py runs/smollm2_ruler_grid/ablate/results.csv \
        runs/kvpress_ruler_075/results.csv --out runs/ruler_grid
    python experiments/real_model/ruler_grid.py docs/real_model/ruler_grid_tasks.csv --out docs/real_model/ruler_grid
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from lcx.eval.report import MACRO, label, macro_rows, read_csv

NONE = "none"  # the column of settings that do not compress


def variant(row: dict) -> str:
    text = re.sub(r" @c=[0-9.]+| one-shot| head_cap=\S+| head_ratio=\S+", "", label(row))
    return text.replace("kvpress:", "kvpress ")


def cells(paths: list[Path]) -> dict[tuple[str, str], dict]:
    """(variant, ratio) -> the macro-average row; later files replace earlier ones."""
    out: dict[tuple[str, str], dict] = {}
    for path in paths:
        rows = [r for r in read_csv(path) if r["metric"] == "accuracy"]
        for row in macro_rows(rows):
            ratio = NONE if row["compression"] == "" else f"{float(row['compression']):g}"
            out[(variant(row), ratio)] = {**row, "file": str(path)}
    return out


def _order(name: str) -> tuple:
    """full first, then by policy; kvpress's press and the int8 cache under the lcx setting they repeat."""
    base = name.replace("kvpress ", "").replace(" kv_dtype=int8", "")
    return base != "full", base, name.startswith("kvpress"), "int8" in name


TITLE = "# RULER-style grid: macro average accuracy (11 tasks, 2,048 tokens) by policy and compression ratio"


def table(grid: dict[tuple[str, str], dict]) -> str:
    ratios = sorted({r for _, r in grid if r != NONE}, key=float)
    columns = ([NONE] if any(r == NONE for _, r in grid) else []) + ratios
    names = sorted(dict.fromkeys(v for v, _ in grid), key=_order)
    best = {r: max(cell["value"] for (v, c), cell in grid.items() if c == r and not v.startswith("kvpress"))
            for r in ratios}
    head = "| setting | " + " | ".join("no compression" if c == NONE else f"c = {c}" for c in columns) + " |"
    lines = [head, "|---" * (len(columns) + 1) + "|"]
    for name in names:
        parts = []
        for c in columns:
            cell = grid.get((name, c))
            if cell is None:
                parts.append("")
                continue
            text = f"{100 * cell['value']:.0f}% ({100 * cell['lo']:.0f}–{100 * cell['hi']:.0f})"
            bold = c != NONE and not name.startswith("kvpress") and cell["value"] == best[c]
            parts.append(f"**{text}**" if bold else text)
        lines.append(f"| {name} | " + " | ".join(parts) + " |")
    n = {int(cell["samples"]) for cell in grid.values()}
    return "\n".join(lines) + (f"\n\n{MACRO} over 11 tasks, {'/'.join(map(str, sorted(n)))} prompts per cell; "
                               "bold: the best lcx setting at each ratio.\n")


def plot(grid: dict[tuple[str, str], dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    names = sorted(dict.fromkeys(v for v, r in grid if r != NONE), key=_order)
    bases = list(dict.fromkeys(_order(n)[1] for n in names))
    colors = plt.get_cmap("tab20").colors
    for name in names:  # one color per setting; kvpress's press (x, dotted) and the int8 cache (square, dashed)
        pts = sorted((float(r), cell["value"]) for (v, r), cell in grid.items() if v == name and r != NONE)
        kvpress, int8 = name.startswith("kvpress"), "int8" in name
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="x" if kvpress else ("s" if int8 else "o"),
                linestyle=":" if kvpress else ("--" if int8 else "-"), markersize=8 if kvpress else 5,
                color=colors[bases.index(_order(name)[1]) % 20], label=name)
    for (name, r), cell in grid.items():
        if r == NONE:
            ax.axhline(cell["value"], color="black", linestyle=":" if "int8" not in name else "-.",
                       label=f"{name} (no compression)")
    ax.set_xlabel("compression ratio (share of the context evicted)")
    ax.set_ylabel("macro average accuracy (11 tasks)")
    ax.set_ylim(-0.02, 0.8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.0, 0.5))
    ax.set_title("SmolLM2-135M-Instruct, RULER-style suite at 2,048 tokens, one-shot compression", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, nargs="+", help="results.csv files (a later one wins a cell)")
    parser.add_argument("--out", type=Path, required=True, help="writes OUT.md, OUT.csv and OUT.png")
    args = parser.parse_args(argv)
    grid = cells(args.results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(f"{TITLE}\n\n{table(grid)}")
    with open(args.out.with_suffix(".csv"), "w") as f:
        f.write("setting,compression,value,lo,hi,samples,file\n")
        for (name, ratio), cell in grid.items():
            f.write(f"\"{name}\",{ratio},{cell['value']:.4f},{cell['lo']:.4f},{cell['hi']:.4f},{cell['samples']},"
                    f"{cell['file']}\n")
    plot(grid, args.out.with_suffix(".png"))
    print(table(grid))


if __name__ == "__main__":
    main()
