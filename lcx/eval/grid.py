"""Evaluation grids: ``run_eval`` (one cache setting over lengths x depths) and ``run_ablate`` (policies x budgets
x RoPE variants x lengths x depths). Every cell is checked against the cache capacity before anything runs; results
go through ``lcx.eval.report``. Cells of one cache setting share one compiled prefill and decode (fixed capacity)."""

from __future__ import annotations

import time
from pathlib import Path

from tqdm import tqdm

from lcx.config import CacheConfig, ConfigError, ModelConfig
from lcx.eval.config import AblateConfig, EvalConfig, RopeVariant
from lcx.eval.evaluate import answer_tokens, perplexity, retrieval_accuracy, with_depth
from lcx.eval.report import write_report
from lcx.generate import CacheCapacityError, plan_capacity


def _max_new(ev: EvalConfig, task) -> int:
    if ev.metric == "perplexity":
        return 0
    if ev.max_new_tokens:
        return ev.max_new_tokens
    examples = with_depth(task, (ev.depths or (None,))[0]).examples(ev.seed, 0, min(ev.samples, 4),
                                                                   max(ev.lengths), "validation")
    return answer_tokens(examples)


def _capacity(model: ModelConfig, cache: CacheConfig, ev: EvalConfig, max_new: int) -> int:
    """The slots one cache setting needs for the longest cell; raises naming the cell when it cannot fit."""
    longest = max(ev.lengths)
    batch = min(ev.batch_size, ev.samples)
    try:
        return plan_capacity(model, cache, batch, longest, max(max_new, 1))
    except CacheCapacityError as err:
        budget = f", budget {cache.budget}" if cache.budget else ""
        raise CacheCapacityError(f"eval grid cell (policy {cache.policy}{budget}, length {longest}) does not fit the "
                                 f"cache: {err}") from err


def _cells(model, caches, ropes, ev: EvalConfig):
    for cache in caches:
        for variant in ropes:
            for length in ev.lengths:
                for depth in (ev.depths or (None,)):
                    yield cache, variant, length, depth


def _run(model: ModelConfig, params, ev: EvalConfig, caches: list[CacheConfig], ropes: tuple[RopeVariant, ...],
         out_dir: Path, title: str, progress: bool) -> list[dict]:
    task = ev.make_task()
    max_new = _max_new(ev, task)
    capacities = {cache: _capacity(model, cache, ev, max_new) for cache in caches}  # preflight: fail before running
    cells = list(_cells(model, caches, ropes, ev))
    rows = []
    bar = tqdm(cells, desc=title, unit="cell", disable=not progress, dynamic_ncols=True)
    for cache, variant, length, depth in bar:
        bar.set_postfix_str(f"{cache.policy} {cache.budget or ''} {variant.name} {length}")
        m = variant.apply(model)
        t0 = time.perf_counter()
        common = dict(length=length, samples=ev.samples, batch_size=min(ev.batch_size, ev.samples), seed=ev.seed,
                      cache=cache)
        if ev.metric == "perplexity":
            value = perplexity(m, params, task, prefix=ev.ppl_prefix, **common)
        else:
            value = retrieval_accuracy(m, params, task, depth=depth, max_new_tokens=max_new,
                                       capacity=capacities[cache] if not cache.make_policy().evicts else None,
                                       **common)
        rows.append({"policy": cache.policy, "budget": cache.budget if cache.make_policy().evicts else "",
                     "rope": variant.name, "length": length, "depth": "" if depth is None else depth,
                     "metric": ev.metric, "value": value, "samples": ev.samples,
                     "seconds": round(time.perf_counter() - t0, 2)})
    write_report(rows, out_dir, title)
    return rows


def run_eval(model: ModelConfig, params, ev: EvalConfig, cache: CacheConfig, out_dir: Path, *,
             progress: bool = True) -> list[dict]:
    """The eval stage: ``cache`` over ``ev.lengths`` x ``ev.depths``."""
    return _run(model, params, ev, [cache], (RopeVariant("trained"),), out_dir, f"eval {ev.task}", progress)


def run_ablate(model: ModelConfig, params, ev: EvalConfig, ablate: AblateConfig, out_dir: Path, *,
               progress: bool = True) -> list[dict]:
    """The ablate stage: every policy x budget x RoPE variant over ``ev.lengths`` x ``ev.depths``."""
    caches = ablate.caches()
    if not caches:
        raise ConfigError("ablate.policies is empty: nothing to ablate")
    return _run(model, params, ev, caches, ablate.ropes, out_dir, f"ablate {ev.task}", progress)
