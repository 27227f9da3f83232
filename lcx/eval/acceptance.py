"""How well a compressed cache drafts for the full one: the acceptance of self-speculative decoding on a grid cell's
own prompts (``eval.speculative``).

A retrieval cell under an evicting (or quantized) cache measures the task's accuracy under that cache. With
``eval.speculative`` the grid also decodes the same prompts speculatively, that cache as the draft and the full
cache as the target, and records the tokens each verification emits (accepted drafts + 1; at most ``k + 1``): an
exact measure of how often the compressed cache picks the full cache's next token, beside how often it answers
right.
"""

from __future__ import annotations

import math
import warnings

import numpy as np

from lcx.config import CacheConfig, ConfigError, ModelConfig
from lcx.data.policy_inputs import policy_inputs
from lcx.data.task import Example, Task
from lcx.engine import PositionRangeWarning
from lcx.engine.planning import cache_kind
from lcx.engine.spec_generator import SpeculativeGenerator, draft_kind_of
from lcx.engine.speculative import SpeculativeConfig

FIELDS = ("accept", "accept_lo", "accept_hi")  # results.csv columns (empty where a cell measured none)


def draft_refusal(model: ModelConfig, cache: CacheConfig, length: int, protocol: str, k: int) -> str | None:
    """Why ``cache`` cannot draft for the full cache in a ``length``-token cell (None: it can)."""
    if protocol != "streaming":
        return "a one_shot cell compresses the context alone; acceptance is measured on streaming cells"
    try:
        kind = draft_kind_of(model, SpeculativeConfig(draft=cache, k=k, min_context=0),
                             cache_kind(model, CacheConfig(dtype=cache.dtype)))
    except ConfigError as err:
        return str(err)
    if kind.head_budgets is not None and min(kind.head_budgets) >= length:
        return f"its budget holds the whole {length}-token prompt"
    return None


def acceptance(model: ModelConfig, params, task: Task, examples: list[Example], *, draft: CacheConfig, k: int,
               batch_size: int, max_new_tokens: int, unroll: bool | None = None) -> np.ndarray:
    """Tokens per verification of each example, ``[n]`` (NaN where its first token ended it: no verification):
    greedy speculative decoding of its prompt, ``draft`` drafting ``k`` tokens for the full cache."""
    tok = task.tokenizer
    inputs = policy_inputs(draft.make_policy(), task.frame)
    gen = SpeculativeGenerator(model, params, max_new_tokens=max_new_tokens,
                               speculative=SpeculativeConfig(draft=draft, k=k, min_context=0), eos_id=tok.eos_id,
                               unroll=unroll, reconstruction=inputs.get("reconstruction"))
    out = []
    for lo in range(0, len(examples), batch_size):
        with warnings.catch_warnings():  # an evaluation grid measures past the trained range on purpose
            warnings.simplefilter("ignore", PositionRangeWarning)
            _, stats = gen.generate([ex.prompt_ids for ex in examples[lo:lo + batch_size]])
        v = stats.verifications.astype(np.float64)
        out.append(np.where(v > 0, (stats.accepted + v) / np.maximum(v, 1), np.nan))
    return np.concatenate(out)


def columns(per_example: np.ndarray, k: int) -> dict[str, float]:
    """``accept`` (the mean over examples) and its 95% t-interval (``accept_lo`` / ``accept_hi``), within the
    possible values [1, ``k`` + 1]."""
    x = per_example[~np.isnan(per_example)]
    if x.size == 0:
        return {}
    mean = float(np.mean(x))
    if x.size < 2:
        return {"accept": mean}
    from scipy import stats

    half = float(stats.t.ppf(0.975, x.size - 1) * np.std(x, ddof=1) / math.sqrt(x.size))
    return {"accept": mean, "accept_lo": max(1.0, mean - half), "accept_hi": min(k + 1.0, mean + half)}


__all__ = ["FIELDS", "acceptance", "columns", "draft_refusal"]
