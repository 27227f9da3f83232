"""Paired comparison of two settings on the same prompts: the sign test, the stratified difference, the table."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from lcx.eval.paired import main, paired_table, read_outputs
from lcx.eval.stats import paired_difference, sign_test


def test_sign_test_is_the_exact_binomial_tail():
    # 9 of 10 discordant prompts one way: 2 * (C(10,0) + C(10,1)) / 2^10
    assert sign_test(9, 1) == sign_test(1, 9) == pytest.approx(2 * 11 / 1024)
    assert sign_test(0, 0) == sign_test(3, 3) == 1.0
    assert sign_test(6, 0) == pytest.approx(2 / 64)


def test_paired_difference_is_the_macro_difference_with_a_stratified_interval():
    tasks = np.array(["x"] * 4 + ["y"] * 2)
    a = np.array([1, 0, 0, 1, 0.5, 0.5])
    b = np.array([1, 1, 0, 0, 1.0, 1.0])
    r = paired_difference(a, b, tasks)
    # task x: mean difference 0 (one up, one down), task y: +0.5; macro = 0.25
    assert r.diff == pytest.approx(0.25) and (r.better, r.worse) == (3, 1)
    d_x = b[:4] - a[:4]
    half = 1.96 * math.sqrt(d_x.var(ddof=1) / 4 + 0.0) / 2  # task y's differences do not vary
    assert (r.lo, r.hi) == (pytest.approx(0.25 - half), pytest.approx(0.25 + half))
    assert r.p == pytest.approx(sign_test(3, 1))
    same = paired_difference(a, a, tasks)
    assert (same.diff, same.lo, same.hi, same.better, same.worse, same.p) == (0, 0, 0, 0, 0, 1.0)
    with pytest.raises(ValueError, match="one shape"):
        paired_difference(a, b[:3])


def test_paired_table_matches_prompts_across_files(tmp_path, capsys):
    def lines(setting, grades):
        return [{"setting": setting, "task": t, "length": 64, "depth": None, "sample": i, "answer": "1",
                 "output": "", "grade": g} for (t, i), g in grades.items()]

    base = {("x", 0): 1.0, ("x", 1): 0.0, ("y", 0): 1.0}
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text("".join(json.dumps(g) + "\n" for g in lines("full", base) + lines("tova", base)))
    # the later file's tova replaces the earlier one's; one extra prompt the baseline lacks is left out
    tova = {("x", 0): 0.0, ("x", 1): 1.0, ("y", 0): 0.0, ("y", 1): 1.0}
    second.write_text("".join(json.dumps(g) + "\n" for g in lines("tova", tova)))
    table = paired_table(read_outputs([first, second]), "full")
    row = next(line for line in table.splitlines() if line.startswith("| tova"))
    # full: x 50%, y 100% -> 75%; tova on the shared prompts: x 50%, y 0% -> 25%; difference -50 points
    assert row.startswith("| tova | 3 | 75.0% | 25.0% | -50.0 (") and "| 1 / 2 |" in row
    main([str(first), str(second), "--baseline", "full"])
    assert capsys.readouterr().out == table
    with pytest.raises(ValueError, match="baseline='snapkv' is not a setting"):
        paired_table(read_outputs([first]), "snapkv")
