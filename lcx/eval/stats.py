"""Uncertainty of evaluation cells: the Wilson interval of an accuracy, a perplexity's interval over windows, and the
paired difference of two settings graded on the same prompts."""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np


def wilson_interval(successes: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval (95% by default) of a binomial proportion."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def perplexity_interval(nll: np.ndarray, z: float = 1.96) -> tuple[float, float]:
    """exp(mean NLL -/+ z standard errors over windows): the 95% interval of the perplexity."""
    mean = float(np.mean(nll))
    se = float(np.std(nll, ddof=1) / math.sqrt(len(nll))) if len(nll) > 1 else 0.0
    return math.exp(mean - z * se), math.exp(mean + z * se)


class Paired(NamedTuple):
    """``b`` against ``a`` on the same prompts: the macro-average difference and its 95% interval, the prompts on
    which ``b`` grades higher / lower, the exact two-sided sign test's p-value over those prompts, and the macro
    averages of ``a`` and ``b`` themselves."""

    diff: float
    lo: float
    hi: float
    better: int
    worse: int
    p: float
    mean_a: float
    mean_b: float


def sign_test(better: int, worse: int) -> float:
    """Exact two-sided sign test: the probability, under no difference, of a split of the ``better + worse``
    discordant prompts at least as uneven as this one."""
    n = better + worse
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(better, worse) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def paired_difference(a, b, groups=None, z: float = 1.96) -> Paired:
    """Setting ``b`` minus setting ``a``, both graded on the same prompts (``[n]`` grades in [0, 1], prompt ``i`` of
    ``a`` the same as prompt ``i`` of ``b``). ``groups``: each prompt's task; the difference is then a macro average
    (the mean over tasks of each task's mean difference, as the tables report) and its interval the normal
    approximation of that stratified mean (within-task variances of the differences). Pairing removes the
    prompts' own difficulty from the comparison: two settings whose Wilson intervals overlap almost entirely can
    still differ clearly, or not at all, prompt by prompt."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"paired grades must be two [n] arrays of one shape, got {a.shape} and {b.shape}")
    groups = np.zeros(len(a), int) if groups is None else np.asarray(groups)
    if groups.shape != a.shape:
        raise ValueError(f"groups must name the task of each of the {len(a)} prompts, got shape {groups.shape}")
    d = b - a
    names = list(dict.fromkeys(groups.tolist()))
    masks = [groups == name for name in names]
    variances = [float(d[m].var(ddof=1)) / m.sum() if m.sum() > 1 else 0.0 for m in masks]
    mean_a, mean_b = (float(np.mean([x[m].mean() for m in masks])) for x in (a, b))
    diff = mean_b - mean_a  # the mean over tasks of each task's mean difference
    half = z * math.sqrt(sum(variances)) / len(names)
    better, worse = int(np.sum(d > 0)), int(np.sum(d < 0))
    return Paired(diff, diff - half, diff + half, better, worse, sign_test(better, worse), mean_a, mean_b)


__all__ = ["Paired", "paired_difference", "perplexity_interval", "sign_test", "wilson_interval"]
