"""Results of an evaluation grid: ``results.csv`` (long format: one row per setting, length, depth and metric, with
the value and its 95% interval), ``results.md`` (one table per metric: a row per setting, a column per context
length; with several needle depths, accuracy per length and depth too) and PNG plots (metric vs length per metric -
perplexity on a log scale - and, for retrieval over depths, a depth x length heat map per setting)."""

from __future__ import annotations

import csv
import re
from collections import defaultdict
from pathlib import Path

import numpy as np

from lcx.eval.stats import wilson_interval

# new columns go last: older files keep their order (accept*: eval.speculative, lcx.eval.acceptance)
FIELDS = ("setting", "policy", "budget", "rope", "length", "depth", "metric", "value", "lo", "hi", "samples",
          "seconds", "task", "compression", "protocol", "prompt_tokens", "prefilled_tokens",
          "kv_bytes", "held_kv_bytes", "bos", "accept", "accept_lo", "accept_hi")
MACRO = "macro average"


def label(row: dict) -> str:
    """The row's setting (``policy @budget params [rope]``; older files without the column: policy, budget, rope)."""
    if row.get("setting"):
        return row["setting"]
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
        for key in ("value", "lo", "hi"):
            row[key] = float(row[key]) if row.get(key) not in (None, "") else float("nan")
        row["depth"] = "" if row["depth"] == "" else float(row["depth"])
        for key in ("task", "protocol"):
            row.setdefault(key, "")
        # whether the prompts began with BOS; empty in files (and cells) from before the column: every prompt did
        row["bos"] = {"True": True, "False": False}.get(row.get("bos") or "", "")
        row["compression"] = "" if row.get("compression") in (None, "") else float(row["compression"])
    return rows


def _fmt(metric: str, value: float) -> str:
    return f"{100 * value:.0f}%" if metric == "accuracy" else f"{value:.2f}"


def _by_setting(rows: list[dict]) -> tuple[list[str], dict[str, dict[int, list[dict]]]]:
    order: list[str] = []
    cells: dict[str, dict[int, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        key = label(r)
        if key not in cells:
            order.append(key)
        cells[key][r["length"]].append(r)
    return order, cells


def _pooled(metric: str, cell: list[dict]) -> tuple[float, float, float]:
    """One (value, lo, hi) for the rows of a table cell (several needle depths: their pooled accuracy)."""
    if len(cell) == 1:
        r = cell[0]
        return r["value"], r.get("lo", float("nan")), r.get("hi", float("nan"))
    if metric == "accuracy" and all(r.get("samples") not in (None, "") for r in cell):
        n = sum(int(r["samples"]) for r in cell)
        hits = sum(r["value"] * int(r["samples"]) for r in cell)
        return (hits / n, *wilson_interval(hits, n))
    return float(np.mean([r["value"] for r in cell])), float("nan"), float("nan")


def macro_rows(rows: list[dict]) -> list[dict]:
    """The macro average over tasks of each (setting, length) accuracy cell, as rows of task ``macro average``
    (tasks weigh equally; with equal samples per task the pooled Wilson interval is the average's)."""
    tasks = list(dict.fromkeys(r["task"] for r in rows if r["metric"] == "accuracy" and r.get("task")))
    if len(tasks) < 2:
        return []
    order, cells = _by_setting([r for r in rows if r["metric"] == "accuracy" and r.get("task")])
    out = []
    for key in order:
        for length, cell in cells[key].items():
            per_task = [_pooled("accuracy", [r for r in cell if r["task"] == t]) for t in tasks
                        if any(r["task"] == t for r in cell)]
            n = sum(int(r["samples"]) for r in cell)
            value = float(np.mean([v for v, _, _ in per_task]))
            lo, hi = wilson_interval(value * n, n)
            accept = [float(r["accept"]) for r in cell if r.get("accept") not in (None, "")]
            out.append({**cell[0], "task": MACRO, "depth": "", "value": value, "lo": lo, "hi": hi, "samples": n,
                        "seconds": round(sum(float(r["seconds"] or 0) for r in cell), 2),
                        # tokens per verification over every task's cells (their intervals are per task)
                        "accept": float(np.mean(accept)) if accept else "", "accept_lo": "", "accept_hi": ""})
    return out


def markdown_table(rows: list[dict], title: str) -> str:
    """One table per metric (and per task when there are several, then their macro average): one line per setting,
    one column per length (accuracy pooled over depths), each cell with its 95% interval."""
    tasks = list(dict.fromkeys(r.get("task", "") for r in rows if r.get("task")))
    if len(tasks) > 1:
        rows = rows + macro_rows(rows)
        parts = [markdown_table([r for r in rows if r.get("task") == t], f"{title}: {t}") for t in [MACRO, *tasks]]
        rest = [r for r in rows if not r.get("task")]
        return "\n".join(parts + ([markdown_table(rest, title)] if rest else []))
    out = []
    for metric in dict.fromkeys(r["metric"] for r in rows):
        sub = [r for r in rows if r["metric"] == metric]
        order, cells = _by_setting(sub)
        lengths = sorted({r["length"] for r in sub})
        out.append(_table(f"{title} ({metric}, 95% interval)", metric, order, [f"{n} tokens" for n in lengths],
                          [lambda key, n=n: cells[key][n] for n in lengths]))
        depths = sorted({r["depth"] for r in sub if r["depth"] != ""})
        if metric == "accuracy" and len(depths) > 1:  # where in the context a policy loses the needle
            columns = sorted({(r["length"], r["depth"]) for r in sub if r["depth"] != ""})
            out.append(_table(f"{title} (accuracy by needle depth, 95% interval)", metric, order,
                              [f"{n} @ {d:.0%}" for n, d in columns],
                              [lambda key, n=n, d=d: [r for r in cells[key][n] if r["depth"] == d]
                               for n, d in columns]))
    return "\n".join(out)


def _table(heading: str, metric: str, order: list[str], labels: list[str], columns: list) -> str:
    """A markdown table: a line per setting of ``order``, a column per label; ``columns[j](setting)`` gives the
    column's rows of that setting (pooled into one value with its interval; none: ``-``)."""
    lines = [f"### {heading}", "", "| setting | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    for key in order:
        values = []
        for column in columns:
            cell = column(key)
            if not cell:
                values.append("-")
                continue
            value, lo, hi = _pooled(metric, cell)
            values.append(_fmt(metric, value) + ("" if np.isnan(lo) else f" ({_fmt(metric, lo)}–{_fmt(metric, hi)})"))
        lines.append(f"| {key} | " + " | ".join(values) + " |")
    return "\n".join(lines) + "\n"


def _style(rows: list[dict], plt) -> dict[str, dict]:
    """One colour per policy, a line style per budget, a marker per RoPE variant: many lines stay readable."""
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    budgets = list(dict.fromkeys(str(r["budget"]) for r in rows))
    ropes = list(dict.fromkeys(r["rope"] for r in rows))
    colors = plt.get_cmap("tab10").colors
    return {label(r): dict(color=colors[policies.index(r["policy"]) % len(colors)],
                           linestyle=("-", "--", ":", "-.")[budgets.index(str(r["budget"])) % 4],
                           marker="osD^v"[ropes.index(r["rope"]) % 5]) for r in rows}


def plot(rows: list[dict], out_dir: Path, title: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    style = _style(rows, plt)
    for metric in dict.fromkeys(r["metric"] for r in rows):
        sub = [r for r in rows if r["metric"] == metric]
        order, cells = _by_setting(sub)
        fig, ax = plt.subplots(figsize=(8, 5))
        for key in order:
            xs = sorted(cells[key])
            pooled = [_pooled(metric, cells[key][x]) for x in xs]
            ax.plot(xs, [p[0] for p in pooled], label=key, alpha=0.85, **style[key])
            lo, hi = [p[1] for p in pooled], [p[2] for p in pooled]
            if not any(np.isnan(lo)):
                ax.fill_between(xs, lo, hi, color=style[key]["color"], alpha=0.08)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel(metric)
        if metric == "accuracy":
            ax.set_ylim(-0.02, 1.02)
        else:
            ax.set_yscale("log")
        ax.set_title(f"{title}: {metric}")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        path = out_dir / f"{metric}_vs_length.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)

    if any(r.get("compression") not in (None, "") for r in rows):
        paths.append(plot_compression(rows, out_dir, title, plt))
    acc = [r for r in rows if r["metric"] == "accuracy" and r.get("task") in (None, "", MACRO)]
    depths = sorted({r["depth"] for r in acc if r["depth"] != ""})
    if len(depths) > 1:
        lengths = sorted({r["length"] for r in acc})
        keys = list(dict.fromkeys(label(r) for r in acc))
        cols = min(4, len(keys))
        nrows = -(-len(keys) // cols)
        fig, axes = plt.subplots(nrows, cols, figsize=(3.2 * cols, 2.8 * nrows), squeeze=False)
        for ax, key in zip(axes.flat, keys):
            grid = np.full((len(depths), len(lengths)), np.nan)
            for r in acc:
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


def _without_compression(setting: str) -> str:
    """The setting's label with its ``@c=…`` removed: the cells one line of a compression plot joins."""
    return re.sub(r"\s*@c=[0-9.]+", "", setting).strip()


def plot_compression(rows: list[dict], out_dir: Path, title: str, plt) -> Path:
    """The grid's metric vs compression ratio: accuracy (the macro average over tasks when there are several), or
    for a perplexity grid the perplexity of the last position bucket; a line per setting without its ratio (policy,
    cache dtype, protocol), a panel per length; ``full`` as a dotted horizontal line."""
    metric = "accuracy" if any(r["metric"] == "accuracy" for r in rows) else "perplexity"
    tasks = {r.get("task") for r in rows if r["metric"] == metric}
    macro = metric == "accuracy" and len(tasks - {""}) > 1
    cells = macro_rows(rows) if macro else [r for r in rows if r["metric"] == metric]
    if metric == "perplexity":
        # Perplexity rows are position buckets of one window length: the last bucket is the whole window.
        last = max(int(r["length"]) for r in cells)
        cells = [r for r in cells if int(r["length"]) == last]
    lengths = sorted({r["length"] for r in cells})
    fig, axes = plt.subplots(1, len(lengths), figsize=(5 * len(lengths), 4), squeeze=False)
    colors = plt.get_cmap("tab10").colors
    lines = list(dict.fromkeys(_without_compression(label(r)) for r in cells if r.get("compression") != ""))
    for ax, length in zip(axes.flat, lengths):
        cell = [r for r in cells if r["length"] == length]
        for i, line in enumerate(lines):
            pts = sorted((float(r["compression"]), r["value"]) for r in cell
                         if r.get("compression") != "" and _without_compression(label(r)) == line)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=colors[i % len(colors)],
                    linestyle="--" if "one-shot" in line or "one_shot" in line else "-", label=line)
        for r in cell:
            if r.get("compression") == "":
                ax.axhline(r["value"], color="black", linestyle=":", label=f"{label(r)} (no compression)")
        ax.set_xlabel("compression ratio (share of the context evicted)")
        ax.set_ylabel(metric + (" (macro average)" if macro else ""))
        if metric == "accuracy":
            ax.set_ylim(-0.02, 1.02)
        else:
            ax.set_yscale("log")
        ax.set_title(f"{length} tokens", fontsize=9)
        ax.grid(alpha=0.3, which="both")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(f"{title}: {metric} vs compression", fontsize=10)
    fig.tight_layout()
    path = out_dir / f"{metric}_vs_compression.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def prefill_note(rows: list[dict]) -> str:
    """A line on the prompt tokens shared contexts saved (``prompt_tokens`` asked, ``prefilled_tokens`` run through
    the model); empty when nothing was shared."""
    asked = sum(int(r.get("prompt_tokens") or 0) for r in rows)
    run = sum(int(r.get("prefilled_tokens") or 0) for r in rows)
    if not asked or run >= asked:
        return ""
    return (f"\nPrefill: {run:,} of {asked:,} prompt tokens went through the model; shared contexts saved "
            f"{asked - run:,} ({(asked - run) / asked:.0%}).\n")


def bos_note(rows: list[dict]) -> str:
    """A line saying whether the prompts began with the BOS token (the ``bos`` column: the tokenizer's rule, or a
    chat template's BOS text, or ``eval.bos``); empty when no row records it."""
    words = {frozenset({True}): "with", frozenset({False}): "without", frozenset({True, False}): "with and without"}
    parts = []
    for metric in dict.fromkeys(r["metric"] for r in rows):
        seen = frozenset(r.get("bos") for r in rows if r["metric"] == metric) - {"", None}
        if seen:
            parts.append(f"{metric} prompts {words[seen]} BOS first")
    why = "as the tokenizer adds it, the chat template writes it, or eval.bos says"
    return f"\nBOS: {', '.join(parts)} ({why}).\n" if parts else ""


def acceptance_table(rows: list[dict]) -> str:
    """``eval.speculative``: each setting's acceptance as a draft for the full cache beside its accuracy, a line per
    (setting, task), a column per length: "accuracy / tokens per verification (its 95% interval)"; empty without."""
    cells = [r for r in rows if r.get("accept") not in (None, "") and r.get("task") != MACRO]
    if not cells:
        return ""
    lengths = sorted({r["length"] for r in cells})
    keys = list(dict.fromkeys((label(r), r.get("task", "")) for r in cells))
    named = any(task for _, task in keys)  # one task: its rows name none
    lines = ["", "", "Draft acceptance (eval.speculative): accuracy under the setting's cache / tokens emitted per "
             "verification when it drafts for the full cache (95% t-interval over prompts)", "",
             "| setting | " + ("task | " if named else "") + " | ".join(f"{n} tokens" for n in lengths) + " |",
             "|---|" + ("---|" if named else "") + "---|" * len(lengths)]
    for key in keys:
        out = []
        for n in lengths:
            hit = [r for r in cells if (label(r), r.get("task", "")) == key and r["length"] == n]
            if not hit:
                out.append("-")
                continue
            r = hit[0]
            interval = "" if r.get("accept_lo") in (None, "") else \
                f" ({float(r['accept_lo']):.2f}-{float(r['accept_hi']):.2f})"
            out.append(f"{_fmt('accuracy', float(r['value']))} / {float(r['accept']):.2f}{interval}")
        lines.append(f"| {key[0]} | " + (f"{key[1]} | " if named else "") + " | ".join(out) + " |")
    return "\n".join(lines) + "\n"


def write_report(rows: list[dict], out_dir: Path, title: str) -> list[Path]:
    """results.csv, results.md and the plots in ``out_dir``; returns the written paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    write_csv(rows, out_dir / "results.csv")
    (out_dir / "results.md").write_text(markdown_table(rows, title) + prefill_note(rows) + bos_note(rows)
                                        + acceptance_table(rows))
    return [out_dir / "results.csv", out_dir / "results.md", *plot(rows, out_dir, title)]
