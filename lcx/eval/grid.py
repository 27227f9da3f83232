"""Evaluation grids: ``run_eval`` (one cache setting over lengths x depths) and ``run_ablate`` (policies x budgets
x RoPE variants x lengths x depths). Every cell is checked against the cache capacity before anything runs; results
go through ``lcx.eval.report``. Cells of one cache setting share one compiled prefill and decode (fixed capacity).

Each row of the results is one (setting, length, depth, metric) cell with its value and a 95% interval: the Wilson
interval of the retrieval accuracy over the cell's prompts, and exp(mean NLL -/+ 1.96 standard errors over windows)
for perplexity. ``setting`` names the policy, its budget, every parameter that differs from the policy's default and
the RoPE variant, so two settings never share a label.

Retrieval cells also leave each prompt's generation and grade in ``outputs.jsonl`` (one JSON object per prompt:
setting, task, length, depth, sample, answer, output, grade), so two settings can be compared prompt by prompt - on
the same prompts, a paired comparison - rather than only by their averages.

The prompts themselves (tasks as the grid runs them, each cell's prompts and their checks) are
``lcx.eval.cell_prompts``; this module re-exports its names.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from lcx.config import CacheConfig, ConfigError, ModelConfig, to_dict
from lcx.eval.cells import (ONE, Cell, CellStore, Shard, assign, cell_name, count_done, order,
                             write_atomic)
from lcx.eval.config import AblateConfig, EvalConfig, RopeVariant, Setting
from lcx.data.task import TOKENIZER, Task
from lcx.eval.acceptance import acceptance, columns as acceptance_columns, draft_refusal
from lcx.eval.evaluate import cell_examples, check_fits, grades, prompt_batches, retrieval_outputs, window_nll
from lcx.eval.groups import members, share_keys
from lcx.eval.one_shot import one_shot_outputs
from lcx.eval.cell_prompts import (CellPrompts, check_prompts, dropped_bos, grid_tasks, max_new_tokens,
                                   perplexity_args, prompts)
from lcx.eval.report import write_report
from lcx.eval.stats import perplexity_interval, wilson_interval
from lcx.engine import CacheCapacityError, plan_capacity, release_compiled
from lcx.engine.split_prefill import TAIL, split_refusal

# What every cell of one cache setting shares: the grid's own knobs, not the policy's parameters.
_GRID_KEYS = ("policy", "budget", "interval", "prefill_chunk")


def setting_label(cache: CacheConfig, rope: str = "trained", setting: Setting | None = None) -> str:
    """``policy @budget k=v ... [rope]``: the budget (or ``@c=ratio``, a compression ratio), every policy parameter
    that differs from the policy's default and every cache field that differs from ``CacheConfig``'s (a paged cell's
    page size too), the protocol when not streaming, and the RoPE variant. Two settings of a grid never share a
    label: it names their cells' directories and their rows."""
    policy = cache.make_policy()
    defaults = {f.name: f.default for f in dataclasses.fields(policy) if f.default is not dataclasses.MISSING}
    extras = [f"{k}={v}" for k, v in sorted(cache.params.items()) if defaults.get(k, object()) != v]
    base = CacheConfig()
    extras += [f"{f}={getattr(cache, f)}" for f in ("budget_schedule", "dtype", "kv_dtype", "kv_group", "kv_residual",
                                                    "max_bytes", "layout")
               if getattr(cache, f) != getattr(base, f)]
    if cache.layout == "paged":  # the page size of a paged cell (its bytes differ; contiguous cells have none)
        extras.append(f"page_size={cache.page_size}")
    budget = f" @{cache.budget}" if policy.evicts and cache.budget is not None else ""
    if setting is not None and setting.compression is not None and policy.evicts:
        budget = f" @c={setting.compression:g}"
    if setting is not None and setting.protocol != "streaming" and policy.evicts:
        extras.append(setting.protocol.replace("_", "-"))
    suffix = "" if rope in ("trained", "") else f" [{rope}]"
    return f"{cache.policy}{budget}" + "".join(f" {e}" for e in extras) + suffix


_max_new = max_new_tokens  # its name before lcx.eval.cell_prompts (experiments/kvpress_eval.py imports it)

# Slots a one-shot cell keeps free after compressing the context: the question and the answer (checked per task).
ONE_SHOT_ROOM = 256


def _capacity(model: ModelConfig, cache: CacheConfig, ev: EvalConfig, max_new: int, length: int) -> int:
    """The slots one cache setting needs for a cell of ``length`` tokens (a retrieval prompt and its answer, or a
    perplexity window); raises naming the cell when it cannot fit."""
    batch = max(min(ev.batch_size, ev.samples), ev.perplexity.batch_size if ev.perplexity is not None else 1)
    try:
        return max(plan_capacity(model, cache, batch, length, max(max_new, 1)),
                   plan_capacity(model, cache, batch, 1, length))
    except CacheCapacityError as err:
        budget = f", budget {cache.budget}" if cache.budget else ""
        raise CacheCapacityError(f"eval grid cell (policy {cache.policy}{budget}, length {length}) does not fit the "
                                 f"cache: {err}") from err


def _cells(settings, ropes, tasks, ev: EvalConfig):
    """(setting, variant, task, length, depth, metric) in the order the tables list them."""
    for setting in settings:
        for variant in ropes:
            for length in ev.lengths:
                if not setting.runs(variant.name, length):  # a policy entry's own ``ropes`` / ``lengths``
                    continue
                for name in tasks:
                    if ev.metric == "accuracy":
                        for depth in (ev.depths or (None,)):
                            yield setting, variant, name, length, depth, "accuracy"
                    else:
                        yield setting, variant, name, length, None, "perplexity"
                if ev.perplexity is not None and setting.protocol == "streaming":
                    yield setting, variant, "", length, None, "perplexity"


def _run(models: Mapping[str, tuple[ModelConfig, object]], ev: EvalConfig, settings: list[Setting],
         ropes: tuple[RopeVariant, ...], out_dir: Path, title: str, progress: bool,
         tokenizer=None, *, shard: Shard = ONE, inputs: Mapping[str, Any] | None = None, footer: str = "",
         merge_only: bool = False) -> list[dict] | None:
    """``models``: variant name -> (model config, params) of that variant's checkpoint (RoPE overrides applied);
    ``tokenizer``: the run's (None: lcx's byte tokenizer), which builds and grades every task. ``inputs``: what
    every cell also depends on (e.g. ``{"checkpoints": {variant: {step, fingerprint}}}``), recorded per cell.

    Cells persist under ``out_dir/cells`` (``lcx.eval.cells``); this worker runs ``shard``'s share, then any cell
    nobody holds. Returns the merged rows once every cell is done (having written ``results.*`` and
    ``outputs.jsonl``, ``footer`` appended to ``results.md``), else None. ``merge_only``: run nothing; write the
    merged results of the cells done so far (results.md says how many are missing)."""
    grid = _plan(models, ev, settings, ropes, tokenizer, inputs or {})
    store = CellStore(out_dir / "cells")
    if merge_only:
        return _merge(store, grid.cells, out_dir, title, footer, partial=True)
    check_prompts(models, ev, tokenizer)  # after the capacity check (in _plan): it builds a prompt per cell
    store.clean()
    owned = assign(grid.cells, shard, grid.shares)
    done = count_done(store, grid.cells)
    if done:
        _note(f"{title}: {done} of {len(grid.cells)} cells already done in {store.root}")
    bar = tqdm(total=len(grid.cells), initial=done, desc=title + ("" if shard.count == 1 else f" [shard {shard}]"),
               unit="cell", disable=not progress, dynamic_ncols=True)
    busy = []
    for i in order(owned, len(grid.cells)):
        cell = grid.cells[i]
        if store.is_done(cell):
            continue
        with contextlib.ExitStack() as locks:  # the cell and the group-mates no other worker holds
            held = [j for j in members(grid.shares, i) if not store.is_done(grid.cells[j])
                    and locks.enter_context(store.lock(grid.cells[j]))]
            held = [j for j in held if not store.is_done(grid.cells[j])]  # finished since the check above
            if i not in held:
                if not store.is_done(cell):
                    busy.append(cell)
                continue
            release_compiled()  # programs of earlier cells, once they fill the process's memory map
            bar.set_postfix_str(cell.name[:-9] + (f" (+{len(held) - 1} sharing its prefill)" if len(held) > 1 else ""))
            t0 = time.perf_counter()
            if len(held) == 1:
                rows, outputs = _compute(grid, grid.specs[i], models, ev)
                store.save(cell, rows, outputs, time.perf_counter() - t0)
            else:
                for j, (rows, outputs) in zip(held, _compute_group(grid, [grid.specs[j] for j in held], models, ev)):
                    store.save(grid.cells[j], rows, outputs, sum(r["seconds"] for r in rows))
        bar.n = count_done(store, grid.cells)
        bar.refresh()
    bar.close()
    rows = _merge(store, grid.cells, out_dir, title, footer, partial=False)
    if rows is None:
        running = [c for c in busy if not store.is_done(c)]
        _note(f"{title}: {count_done(store, grid.cells)} of {len(grid.cells)} cells done; "
              + (f"{len(running)} running in other workers (e.g. {running[0].name}: {store.holder(running[0])}); "
                 if running else "") + "the worker that finishes the last cell writes the merged results "
              "(or `lcx ablate CONFIG --merge`)")
    return rows


def _note(msg: str) -> None:
    print(f"lcx: {msg}", file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True, eq=False)
class _Grid:
    """A grid ready to run: its tasks, generation budgets, caches and capacities per cell, and its cells (the
    ``_cells`` tuples in ``specs``, the persisted identities in ``cells``, in the same order)."""

    tasks: dict
    ppl_task: Task
    per_task: dict
    max_new: int
    caches: dict
    capacities: dict
    specs: list
    cells: list
    drafts: dict  # eval.speculative: (setting, variant, length) -> whether it drafts
    shares: list  # per cell: the key of the cells computed with it, sharing prefills (lcx.eval.groups); "": alone


def _plan(models, ev: EvalConfig, settings: list[Setting], ropes: tuple[RopeVariant, ...], tokenizer,
          inputs: Mapping[str, Any]) -> _Grid:
    tasks, ppl_task = grid_tasks(ev, tokenizer)
    per_task = max_new_tokens(ev, tasks)
    max_new = max(per_task.values())  # one compiled decode loop for every task
    # Preflight: every cell must fit before anything runs.
    caches = {(s, length): s.cache(length, ONE_SHOT_ROOM) for s in settings for length in ev.lengths}
    capacities = {(s, v.name, n): _capacity(models[v.name][0], caches[(s, n)], ev,
                                            max_new + (ONE_SHOT_ROOM if s.protocol == "one_shot" else 0),
                                            max(s.lengths or ev.lengths)
                                            if s.compression is None and s.protocol == "streaming" else n)
                  for s in settings for v in ropes for n in ev.lengths if s.runs(v.name, n)}
    specs = list(_cells(settings, ropes, tasks, ev))
    drafts = _drafts(models, ev, settings, ropes, caches)
    tok = TOKENIZER if tokenizer is None else tokenizer
    cells = [_cell(spec, caches, models, ev, tasks, per_task, ppl_task, tok, inputs, drafts) for spec in specs]
    shares = share_keys(specs, caches, capacities, models, ev)
    return _Grid(tasks, ppl_task, per_task, max_new, caches, capacities, specs, cells, drafts, shares)


def _drafts(models, ev: EvalConfig, settings: list[Setting], ropes, caches) -> dict:
    """``eval.speculative``: (setting, variant, length) -> whether its cache drafts for the full cache; a setting
    that cannot is named once, with why (the full cache itself, the target, silently)."""
    if ev.speculative is None:
        return {}
    out, told = {}, set()
    for s in settings:
        for v in ropes:
            for n in ev.lengths:
                cache = caches[(s, n)]
                if cache.policy == "full" and cache.kv_dtype is None:
                    out[(s, v.name, n)] = False
                    continue
                why = draft_refusal(models[v.name][0], cache, n, s.protocol, ev.speculative.k)
                out[(s, v.name, n)] = why is None
                label = setting_label(cache, v.name, s)
                if why is not None and label not in told:
                    told.add(label)
                    _note(f"eval.speculative: {label} at {n} tokens measures no acceptance: {why}")
    return out


def _cell(spec, caches, models, ev: EvalConfig, tasks: dict, per_task: dict, ppl_task: Task, tokenizer,
          inputs, drafts: dict) -> Cell:
    """The persisted identity of one cell: a readable name and everything its rows depend on - not the grid's
    other axes, so adding a length, task or policy leaves the other cells' inputs as they were."""
    setting, variant, name, length, depth, metric = spec
    cache = caches[(setting, length)]
    label = setting_label(cache, variant.name, setting)
    record = {"setting": label, "cache": cache.to_dict(), "protocol": setting.protocol,
              "compression": setting.compression, "model": to_dict(models[variant.name][0]),
              "tokenizer": tokenizer.spec, "length": length, "metric": metric, "seed": ev.seed,
              "batch_size": ev.batch_size, **{k: v for k, v in inputs.items() if k != "checkpoints"},
              "checkpoint": (inputs.get("checkpoints") or {}).get(variant.name)}
    if metric == "accuracy":
        samples = setting.samples or ev.samples
        record.update(task=name, params=dict(ev.params) if not ev.tasks else {}, depth=depth, samples=samples,
                      chat=ev.chat, max_new_tokens=per_task[name])
        if setting.protocol == "one_shot" and length > TAIL and split_refusal(models[variant.name][0], cache) is None:
            record["split"] = TAIL  # the context read in two calls (lcx.engine.split_prefill); before: one
        if drafts.get((setting, variant.name, length)):  # only here: the grid's other cells stay done
            record["speculative"] = ev.speculative.to_dict()
        prompts_, scale = samples, 1.0
    else:
        args = perplexity_args(ev)
        record.update(task=name, perplexity=ev.perplexity.to_dict() if ev.perplexity is not None else
                      {"task": ev.task, "params": dict(ev.params)}, ppl=args,
                      longest=max(ev.lengths) if args["tail"] else None)
        prompts_, scale = args["samples"], 1.0  # a window costs about a prompt (scored in chunks)
    if dropped_bos(ppl_task if metric == "perplexity" else tasks[name]):
        record["bos"] = False  # only here: a record from before, with BOS first, is stale; the others stay done
    full = not cache.make_policy().evicts
    cost = prompts_ * length * scale * (1.0 + length / 4096 if full else 1.0)
    return Cell(cell_name(label, name, length, "" if depth is None else f"d{depth:g}", metric), record, cost)


def _compute(grid: _Grid, spec, models, ev: EvalConfig, measured=None) -> tuple[list[dict], list[dict]]:
    """Run one cell: its rows (one, or one per perplexity bucket) and its prompts' generations. ``measured``: a
    one-shot cell's ``(examples, lcx.eval.one_shot.Measured)``, computed with its group (``_compute_group``)."""
    setting, variant, name, length, depth, metric = spec
    tasks, per_task, max_new = grid.tasks, grid.per_task, grid.max_new
    cache = grid.caches[(setting, length)]
    label = setting_label(cache, variant.name, setting)
    model, params = models[variant.name]
    # the full cache, and a one-shot cell, get one capacity for all their tasks (one compiled program each)
    fixed = (grid.capacities[(setting, variant.name, length)]
             if not cache.make_policy().evicts or setting.protocol == "one_shot" else None)
    t0 = time.perf_counter()
    counts = {}  # retrieval: the prompt tokens asked for and prefilled (shared contexts once); device KV bytes
    # whether the prompts (windows) began with BOS - the tokenizer's rule; every prompt did before (CHANGELOG)
    bos = {"bos": _bos_column((grid.ppl_task if metric == "perplexity" else tasks[name]).starts_with_bos)}
    rows, generations = [], []
    if metric == "perplexity":
        args = perplexity_args(ev)
        samples, buckets, prefix = args["samples"], args["buckets"], args["prefix"]
        nll = window_nll(model, params, grid.ppl_task, length=length, samples=samples,
                         batch_size=min(args["batch_size"], samples), seed=ev.seed, cache=cache, prefix=prefix,
                         capacity=fixed, tail=args["tail"], longest=max(ev.lengths), unroll=ev.unroll,
                         per_token=bool(buckets), counts=counts)
        if buckets:  # one row per bucket of scored positions (the window's time on the last one)
            start = prefix or max(1, length // 2)
            edges = [b for b in buckets if start < b <= length]
            for lo_edge, hi_edge in zip([start, *edges[:-1]], edges):
                part = nll[:, lo_edge - start:hi_edge - start].mean(axis=1)
                rows.append({**_row(cache, variant, hi_edge, None, metric, math.exp(float(np.mean(part))),
                                    perplexity_interval(part), label, samples,
                                    time.perf_counter() - t0 if hi_edge == edges[-1] else 0.0, name, setting,
                                    len(tasks)), **counts, **bos})
            return rows, generations
        value, (lo, hi) = math.exp(float(np.mean(nll))), perplexity_interval(nll)
    else:
        samples = setting.samples or ev.samples
        if measured is None:
            examples, outputs = retrieval_outputs(
                model, params, tasks[name], length=length, depth=depth, samples=samples,
                batch_size=min(ev.batch_size, samples), seed=ev.seed, cache=cache, max_new_tokens=per_task[name],
                capacity=fixed, protocol=setting.protocol, unroll=ev.unroll,
                buffer=max_new + (ONE_SHOT_ROOM if setting.protocol == "one_shot" else 0), counts=counts)
        else:  # its share of the group's time: the shared prefill split equally, its own calls whole
            examples, outputs, t0 = measured[0], measured[1].outputs, time.perf_counter() - measured[1].seconds
            counts.update(measured[1].counts)
        scores = grades(tasks[name], examples, outputs)
        if grid.drafts.get((setting, variant.name, length)):
            counts.update(acceptance_columns(acceptance(
                model, params, tasks[name], examples, draft=cache, k=ev.speculative.k,
                batch_size=min(ev.batch_size, samples), max_new_tokens=per_task[name], unroll=ev.unroll),
                ev.speculative.k))
        generations += [{"setting": label, "task": name, "length": length, "depth": depth, "sample": i,
                         "answer": ex.answer, "output": out, "grade": float(g)}
                        for i, (ex, out, g) in enumerate(zip(examples, outputs, scores))]
        value, (lo, hi) = float(np.mean(scores)), wilson_interval(float(np.sum(scores)), len(scores))
    rows.append({**_row(cache, variant, length, depth, metric, value, (lo, hi), label, samples,
                        time.perf_counter() - t0, name, setting, len(tasks)), **counts, **bos})
    return rows, generations


def _compute_group(grid: _Grid, specs: list, models, ev: EvalConfig) -> list[tuple[list[dict], list[dict]]]:
    """One-shot cells on the same prompts (``lcx.eval.groups``), each context's start prefilled once for all:
    ``_compute``'s result for each."""
    setting, variant, name, length, depth, _ = specs[0]
    model, params = models[variant.name]
    samples = setting.samples or ev.samples
    task = grid.tasks[name]
    examples = cell_examples(task, length=length, depth=depth, samples=samples, seed=ev.seed)
    check_fits(task, model, [ex.prompt_ids for ex in examples])
    batch = min(ev.batch_size, samples)
    measured = one_shot_outputs(model, params, task, examples, [grid.caches[(s[0], length)] for s in specs],
                                batches=prompt_batches(examples, batch, "one_shot", name), batch_size=batch,
                                max_new=grid.per_task[name], generator_new=grid.max_new + ONE_SHOT_ROOM,
                                capacity=grid.capacities[(setting, variant.name, length)], unroll=ev.unroll)
    return [_compute(grid, spec, models, ev, measured=(examples, m)) for spec, m in zip(specs, measured)]


def _merge(store: CellStore, cells: list[Cell], out_dir: Path, title: str, footer: str, *,
           partial: bool) -> list[dict] | None:
    """The grid's rows and generations from its cells' records, in grid order, written as ``results.csv``,
    ``results.md``, plots and ``outputs.jsonl`` (under the merge lock). None when a cell is missing, unless
    ``partial`` (then results.md says which share is missing)."""
    records = [store.load(c) for c in cells]
    missing = sum(r is None for r in records)
    if missing and not partial:
        return None
    rows = [row for r in records if r is not None for row in r["rows"]]
    generations = [g for r in records if r is not None for g in r["outputs"]]
    if not rows:
        raise ConfigError(f"{title}: none of the {len(cells)} cells is done in {store.root}: nothing to merge")
    note = (f"\n**Partial: {len(cells) - missing} of {len(cells)} cells done** (merged on demand; the missing cells "
            "are not in the tables).\n" if missing else "")
    with store.merging():
        write_report(rows, out_dir, title)
        if generations:
            write_atomic(out_dir / "outputs.jsonl", "".join(json.dumps(g) + "\n" for g in generations))
        if footer or note:
            with open(out_dir / "results.md", "a") as f:
                f.write(note + footer)
        if not missing:
            store.drop_locks()  # every cell done: no worker needs them (a late one re-creates, locks, finds it done)
    return None if missing else rows


def _bos_column(value: bool | None):
    """A task's ``starts_with_bos`` as the ``bos`` column holds it: true / false, empty where it varies."""
    return "" if value is None else bool(value)


def _row(cache: CacheConfig, variant: RopeVariant, length: int, depth, metric: str, value: float, interval,
         label: str, samples: int, seconds: float, task: str, setting: Setting, n_tasks: int) -> dict:
    return {"policy": cache.policy, "budget": cache.budget if cache.make_policy().evicts else "",
            "rope": variant.name, "length": length, "depth": "" if depth is None else depth, "metric": metric,
            "value": value, "lo": interval[0], "hi": interval[1], "setting": label, "samples": samples,
            "seconds": round(seconds, 2), "task": task if n_tasks > 1 else "",
            "compression": "" if setting.compression is None else setting.compression, "protocol": setting.protocol}


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
             progress: bool = True, tokenizer=None, shard: Shard = ONE, inputs: Mapping[str, Any] | None = None,
             footer: str = "", merge_only: bool = False) -> list[dict] | None:
    """The eval stage: ``cache`` over ``ev.lengths`` x ``ev.depths`` (and perplexity when ``ev.perplexity``). Cells
    persist under ``out_dir/cells``; ``shard``, ``inputs``, ``footer`` and ``merge_only`` as in ``run_ablate``."""
    ropes = (RopeVariant("trained"),)
    return _run(_models(model, params, ropes, None), ev, [AblateConfig.of_cache(cache)], ropes, out_dir,
                _title("eval", ev), progress, tokenizer, shard=shard, inputs=inputs, footer=footer,
                merge_only=merge_only)


def run_ablate(model: ModelConfig, params, ev: EvalConfig, ablate: AblateConfig, out_dir: Path, *,
               progress: bool = True, checkpoints: Mapping[str, tuple] | None = None, tokenizer=None,
               shard: Shard = ONE, inputs: Mapping[str, Any] | None = None, footer: str = "",
               merge_only: bool = False) -> list[dict] | None:
    """The ablate stage: every policy x budget (or compression) x protocol x RoPE variant over ``ev.lengths`` x
    ``ev.depths``. ``checkpoints``: (model, params) of the variants that name a ``checkpoint``.

    Each cell persists under ``out_dir/cells/`` when it finishes (``lcx.eval.cells``): a rerun skips the cells done
    with the same inputs. ``shard``: this worker's share of the cells (others may run the rest, in other processes
    or machines sharing ``out_dir``). ``inputs``: what every cell also depends on (``{"checkpoints": {variant:
    {"step", "fingerprint"}}}`` and more), recorded per cell. Returns the merged rows once every cell is done
    (results written, ``footer`` ending results.md), else None. ``merge_only``: compute nothing, merge what is
    done."""
    settings = ablate.settings()
    if not settings:
        raise ConfigError("ablate.policies is empty: nothing to ablate")
    # the same setting may appear in two entries at different lengths (e.g. more prompts at the longest one)
    labels = [(setting_label(s.cache(max(ev.lengths), ONE_SHOT_ROOM), v.name, s), n) for s in settings
              for v in ablate.ropes for n in ev.lengths if s.runs(v.name, n)]
    twice = sorted({x for x, _ in labels if labels.count((x, _)) > 1})
    if twice:
        raise ConfigError(f"ablate: settings {twice} appear twice in the grid (same policy, budget, parameters and "
                          f"RoPE variant); remove the duplicates")
    return _run(_models(model, params, ablate.ropes, checkpoints), ev, settings, ablate.ropes, out_dir,
                _title("ablate", ev), progress, tokenizer, shard=shard, inputs=inputs, footer=footer,
                merge_only=merge_only)


def _title(stage: str, ev: EvalConfig) -> str:
    names = ev.task_names()
    return f"{stage} {names[0]}" if len(names) == 1 else f"{stage} {len(names)} tasks"
