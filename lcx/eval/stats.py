"""Uncertainty of evaluation cells: the Wilson interval of an accuracy, and a perplexity's interval over windows."""

from __future__ import annotations

import math

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


__all__ = ["perplexity_interval", "wilson_interval"]
