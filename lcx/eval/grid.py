"""Evaluation grids: ``run_eval`` (one cache setting over lengths x depths) and ``run_ablate`` (policies x budgets
x RoPE variants x lengths x depths). Every cell is checked against the cache capacity before anything runs; results
go through ``lcx.eval.report``. Cells of one cache setting share one compiled prefill and decode (fixed capacity).

Each row of the results is one (setting, length, depth, metric) cell with its value and a 95% interval: the Wilson
interval of the retrieval accuracy over the cell's prompts, and exp(mean NLL -/+ 1.96 standard errors over windows)
for perplexity. ``setting`` names the policy, its budget, every parameter that differs from the policy's default and
the RoPE variant, so two settings never share a label.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from tqdm import tqdm

from lcx.config import CacheConfig, ConfigError, ModelConfig
from lcx.eval.config import AblateConfig, EvalConfig, RopeVariant
from lcx.eval.evaluate import answer_tokens, retrieval_scores, window_nll, with_depth
from lcx.eval.report import write_report
from lcx.eval.stats import perplexity_interval, wilson_interval
from lcx.generate import CacheCapacityError, plan_capacity

# What every cell of one cache setting shares: the grid's own knobs, not the policy's parameters.
_GRID_KEYS = ("policy", "budget", "interval", "prefill_chunk")


def setting_label(cache: CacheConfig, rope: str = "trained") -> str:
    """``policy @budget k=v ... [rope]``: the budget, every policy parameter that differs from the policy's default
    and every cache field that differs from ``CacheConfig``'s, and the RoPE variant."""
    policy = cache.make_policy()
    defaults = {f.name: f.default for f in dataclasses.fields(policy) if f.default is not dataclasses.MISSING}
    extras = [f"{k}={v}" for k, v in sorted(cache.params.items()) if defaults.get(k, object()) != v]
    base = CacheConfig()
    extras += [f"{f}={getattr(cache, f)}" for f in ("budget_schedule", "dtype", "max_bytes")
               if getattr(cache, f) != getattr(base, f)]
    budget = f" @{cache.budget}" if policy.evicts and cache.budget is not None else ""
    suffix = "" if rope in ("trained", "") else f" [{rope}]"
    return f"{cache.policy}{budget}" + "".join(f" {e}" for e in extras) + suffix


def _max_new(ev: EvalConfig, task) -> int:
    if ev.metric == "perplexity":
        return 0
    if ev.max_new_tokens:
        return ev.max_new_tokens
    examples = with_depth(task, (ev.depths or (None,))[0]).examples(ev.seed, 0, min(ev.samples, 4),
                                                                   max(ev.lengths), "validation")
    return answer_tokens(examples)


def _capacity(model: ModelConfig, cache: CacheConfig, ev: EvalConfig, max_new: int) -> int:
    """The slots one cache setting needs for the longest cell (a retrieval prompt and its answer, or a perplexity
    window); raises naming the cell when it cannot fit."""
    longest = max(ev.lengths)
    batch = max(min(ev.batch_size, ev.samples), ev.perplexity.batch_size if ev.perplexity is not None else 1)
    try:
        return max(plan_capacity(model, cache, batch, longest, max(max_new, 1)),
                   plan_capacity(model, cache, batch, 1, longest))
    except CacheCapacityError as err:
        budget = f", budget {cache.budget}" if cache.budget else ""
        raise CacheCapacityError(f"eval grid cell (policy {cache.policy}{budget}, length {longest}) does not fit the "
                                 f"cache: {err}") from err


def _cells(caches, ropes, ev: EvalConfig):
    """(cache, variant, length, depth, metric) in the order the tables list them."""
    for cache in caches:
        for variant in ropes:
            for length in ev.lengths:
                if ev.metric == "accuracy":
                    for depth in (ev.depths or (None,)):
                        yield cache, variant, length, depth, "accuracy"
                else:
                    yield cache, variant, length, None, "perplexity"
                if ev.perplexity is not None:
                    yield cache, variant, length, None, "perplexity"


def _run(models: Mapping[str, tuple[ModelConfig, object]], ev: EvalConfig, caches: list[CacheConfig],
         ropes: tuple[RopeVariant, ...], out_dir: Path, title: str, progress: bool) -> list[dict]:
    """``models``: variant name -> (model config, params) of that variant's checkpoint (RoPE overrides applied)."""
    task = ev.make_task()
    ppl_task = ev.perplexity.make_task() if ev.perplexity is not None else task
    max_new = _max_new(ev, task)
    # Preflight: every cell must fit before anything runs.
    capacities = {(cache, v.name): _capacity(models[v.name][0], cache, ev, max_new) for cache in caches
                  for v in ropes}
    cells = list(_cells(caches, ropes, ev))
    rows = []
    bar = tqdm(cells, desc=title, unit="cell", disable=not progress, dynamic_ncols=True)
    for cache, variant, length, depth, metric in bar:
        label = setting_label(cache, variant.name)
        bar.set_postfix_str(f"{label} {length} {metric}")
        model, params = models[variant.name]
        t0 = time.perf_counter()
        if metric == "perplexity":
            pcfg = ev.perplexity
            samples = pcfg.samples if pcfg is not None else ev.samples
            fixed = capacities[(cache, variant.name)] if not cache.make_policy().evicts else None
            nll = window_nll(model, params, ppl_task, length=length, samples=samples,
                             batch_size=min(pcfg.batch_size if pcfg else ev.batch_size, samples), seed=ev.seed,
                             cache=cache, prefix=pcfg.prefix if pcfg is not None else ev.ppl_prefix, capacity=fixed,
                             tail=pcfg.tail if pcfg is not None else None, longest=max(ev.lengths))
            value, (lo, hi) = math.exp(float(np.mean(nll))), perplexity_interval(nll)
        else:
            samples = ev.samples
            scores = retrieval_scores(
                model, params, task, length=length, depth=depth, samples=samples,
                batch_size=min(ev.batch_size, samples), seed=ev.seed, cache=cache, max_new_tokens=max_new,
                capacity=capacities[(cache, variant.name)] if not cache.make_policy().evicts else None)
            value, (lo, hi) = float(np.mean(scores)), wilson_interval(float(np.sum(scores)), len(scores))
        rows.append({"policy": cache.policy, "budget": cache.budget if cache.make_policy().evicts else "",
                     "rope": variant.name, "length": length, "depth": "" if depth is None else depth,
                     "metric": metric, "value": value, "lo": lo, "hi": hi, "setting": label, "samples": samples,
                     "seconds": round(time.perf_counter() - t0, 2)})
    write_report(rows, out_dir, title)
    return rows


def _models(model: ModelConfig, params, ropes: tuple[RopeVariant, ...], checkpoints: Mapping[str, tuple] | None
            ) -> dict[str, tuple[ModelConfig, object]]:
    out = {}
    for variant in ropes:
        if variant.checkpoint is not None:
            if not checkpoints or variant.name not in checkpoints:
                raise ConfigError(f"rope variant {variant.name!r} names checkpoint {variant.checkpoint!r}, which was "
                                  f"not loaded")
            base, weights = checkpoints[variant.name]
        else:
            base, weights = model, params
        out[variant.name] = (variant.apply(base), weights)
    return out


def run_eval(model: ModelConfig, params, ev: EvalConfig, cache: CacheConfig, out_dir: Path, *,
             progress: bool = True) -> list[dict]:
    """The eval stage: ``cache`` over ``ev.lengths`` x ``ev.depths`` (and perplexity when ``ev.perplexity``)."""
    ropes = (RopeVariant("trained"),)
    return _run(_models(model, params, ropes, None), ev, [cache], ropes, out_dir, f"eval {ev.task}", progress)


def run_ablate(model: ModelConfig, params, ev: EvalConfig, ablate: AblateConfig, out_dir: Path, *,
               progress: bool = True, checkpoints: Mapping[str, tuple] | None = None) -> list[dict]:
    """The ablate stage: every policy x budget x RoPE variant over ``ev.lengths`` x ``ev.depths``.
    ``checkpoints``: (model, params) of the variants that name a ``checkpoint``."""
    caches = ablate.caches()
    if not caches:
        raise ConfigError("ablate.policies is empty: nothing to ablate")
    labels = [setting_label(c, v.name) for c in caches for v in ablate.ropes]
    twice = sorted({x for x in labels if labels.count(x) > 1})
    if twice:
        raise ConfigError(f"ablate: settings {twice} appear twice in the grid (same policy, budget, parameters and "
                          f"RoPE variant); remove the duplicates")
    return _run(_models(model, params, ablate.ropes, checkpoints), ev, caches, ablate.ropes, out_dir,
                f"ablate {ev.task}", progress)
