"""The past-context grid's summary: per setting and length, each task's prompts answered, the perplexity of the same
prose tail, the wall time per prompt on this machine and the device KV bytes per sequence.

    python experiments/real_model/past_context_table.py runs/smollm2_past_context/ablate/results.csv

Prints two Markdown tables (docs/real_model/README.md, "Past the trained context"): accuracy and perplexity, and the
cost of a prompt. A cell shows ``k/n`` prompts answered (RULER's string match; passkey: the key) - with n = 2 to 4
the intervals are wide, so the tables give counts, not percentages.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

from lcx.eval.report import read_csv

TASKS = ("passkey", "niah_single_2", "niah_multikey_1")


def summary(rows: list[dict]) -> str:
    cells: dict[tuple[str, int], dict] = defaultdict(dict)
    for r in rows:
        key = (r["setting"], int(r["length"]))
        name = r["task"] or "perplexity"
        if r["metric"] == "perplexity":
            cells[key]["ppl"] = (float(r["value"]), float(r["lo"]), float(r["hi"]))
        else:
            n = int(r["samples"])
            cells[key][name] = (round(float(r["value"]) * n), n)
            cells[key].setdefault("seconds", []).append(float(r["seconds"]) / n)
        if r.get("kv_bytes") not in (None, ""):
            cells[key]["kv"] = max(cells[key].get("kv", 0), int(float(r["kv_bytes"])))
    settings = list(dict.fromkeys(r["setting"] for r in rows))
    lengths = sorted({int(r["length"]) for r in rows})
    head = "| setting | " + " | ".join(f"{n // 1024}k" for n in lengths) + " |\n|---|" + "---|" * len(lengths)
    acc = ["Prompts answered (passkey / niah_single_2 / niah_multikey_1) and perplexity of the same 256-token prose "
           "tail (95% interval):\n", head]
    cost = ["Seconds per retrieval prompt on this CPU (the cell's wall time over its prompts, compilation of the "
            "setting's first cell included) and device KV bytes per sequence:\n", head]
    for s in settings:
        a, c = [], []
        for n in lengths:
            cell = cells.get((s, n))
            if not cell:
                a.append("-")
                c.append("-")
                continue
            answered = " / ".join(f"{cell[t][0]}/{cell[t][1]}" if t in cell else "-" for t in TASKS)
            ppl = cell.get("ppl")
            a.append(answered + (f"; ppl {ppl[0]:.1f} ({ppl[1]:.1f}-{ppl[2]:.1f})" if ppl else ""))
            secs = cell.get("seconds")
            kv = cell.get("kv")
            c.append((f"{sum(secs) / len(secs):.0f} s" if secs else "-")
                     + (f", {kv / 2**20:.0f} MiB" if kv else ""))
        acc.append(f"| {s} | " + " | ".join(a) + " |")
        cost.append(f"| {s} | " + " | ".join(c) + " |")
    return "\n".join(acc) + "\n\n" + "\n".join(cost) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="the grid's results.csv")
    args = parser.parse_args(argv)
    print(summary(read_csv(args.results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
