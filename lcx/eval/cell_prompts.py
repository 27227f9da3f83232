"""What an evaluation grid feeds the model, without a model: the tasks as the grid runs them (``grid_tasks``: the
run's tokenizer and chat frame), every cell's prompts (``prompts``, ``CellPrompts``) and their checks before the
first cell (``check_prompts``), the new tokens a retrieval prompt may generate (``max_new_tokens``), the perplexity
windows' settings (``perplexity_args``) and whether a task's prompts lost a BOS (``dropped_bos``).
``lcx.eval.grid`` runs the cells on them (and re-exports these names).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from lcx.config import ConfigError, ModelConfig
from lcx.data.task import TOKENIZER, Example, Task
from lcx.data.tokenizer import describe
from lcx.eval.config import EvalConfig
from lcx.eval.evaluate import answer_tokens, cell_examples, check_fits, perplexity_windows, with_depth


def max_new_tokens(ev: EvalConfig, tasks: Mapping[str, object]) -> dict[str, int]:
    """New tokens per retrieval prompt of each task: ``max_new_tokens``, or the task's longest answer (of a few
    examples at the longest length) + 2 - for a task with its own generation budget (RULER's) twice that + 8, at
    most the budget, since a model may phrase the answer around the references; generation also stops at EOS."""
    if ev.metric == "perplexity":
        return {name: 0 for name in tasks}
    if ev.max_new_tokens:
        return {name: ev.max_new_tokens for name in tasks}
    out = {}
    for name, task in tasks.items():
        n = answer_tokens(with_depth(task, (ev.depths or (None,))[0]).examples(
            ev.seed, 0, min(ev.samples, 4), max(ev.lengths), "validation"), task.tokenizer)
        budget = getattr(task, "max_new_tokens", None)  # RULER's generation budget: room for a wordier answer
        out[name] = min(budget, 2 * n + 8) if budget else n
    return out


def grid_tasks(ev: EvalConfig, tokenizer=None) -> tuple[dict[str, Task], Task]:
    """The tasks of ``ev`` as the grid runs them - name -> task, and the perplexity task (``eval.perplexity``'s, or
    the one task) - built with the run's ``tokenizer`` (None: lcx's byte tokenizer), ``ev.chat`` and ``ev.bos`` (the
    retrieval tasks'; ``ConfigError`` where the tokenizer cannot follow it)."""
    tasks = {name: _with_bos(_tokenized(task, tokenizer, ev.chat), ev.bos) for name, task in ev.make_tasks().items()}
    ppl_task = (_tokenized(ev.perplexity.make_task(), tokenizer, False) if ev.perplexity is not None
                else next(iter(tasks.values())))
    return tasks, ppl_task


@dataclasses.dataclass(frozen=True, eq=False)  # arrays: compared by identity
class CellPrompts:
    """What one (task, length, depth) cell of a grid feeds the model, built by ``task`` - the task as the cell runs
    it (the run's tokenizer and chat frame, the needle at ``depth``): ``examples`` (retrieval; none for perplexity)
    and ``ids``, the token ids of each prompt or perplexity window. ``name``: the task's name in the results (empty
    for ``eval.perplexity``'s)."""

    name: str
    length: int
    depth: float | None
    metric: str
    task: Task
    ids: tuple[np.ndarray, ...]
    examples: tuple[Example, ...] = ()


def perplexity_args(ev: EvalConfig) -> dict:
    """How the grid scores perplexity: ``eval.perplexity``'s windows, or the evaluation's own (a text task)."""
    pcfg = ev.perplexity
    if pcfg is None:
        return {"samples": ev.samples, "batch_size": ev.batch_size, "prefix": ev.ppl_prefix, "tail": None,
                "buckets": ev.ppl_buckets}
    return {"samples": pcfg.samples, "batch_size": pcfg.batch_size, "prefix": pcfg.prefix, "tail": pcfg.tail,
            "buckets": ()}


def prompts(ev: EvalConfig, tokenizer=None, *, samples: int | None = None) -> list[CellPrompts]:
    """Every (task, length, depth) cell's prompts, built as the grid builds them, without a model: what a config
    will feed the model can be read (``tokenizer.decode``) before anything runs, and the grid checks them before its
    first cell. ``samples``: prompts per cell (None: the evaluation's; the first ``n`` are the same at any ``n``)."""
    tasks, ppl_task = grid_tasks(ev, tokenizer)
    out = []
    for length in ev.lengths:
        for name, task in (tasks.items() if ev.metric == "accuracy" else ()):
            for depth in (ev.depths or (None,)):
                examples = cell_examples(task, length=length, depth=depth, samples=samples or ev.samples,
                                         seed=ev.seed)
                out.append(CellPrompts(name, length, depth, "accuracy", with_depth(task, depth),
                                       tuple(ex.prompt_ids for ex in examples), tuple(examples)))
        if ev.metric == "perplexity" or ev.perplexity is not None:
            args = perplexity_args(ev)
            ids, _ = perplexity_windows(ppl_task, length=length, samples=samples or args["samples"], seed=ev.seed,
                                        prefix=args["prefix"], tail=args["tail"], longest=max(ev.lengths))
            name = "" if ev.perplexity is not None else next(iter(tasks))
            out.append(CellPrompts(name, length, None, "perplexity", ppl_task, tuple(ids)))
    return out


def check_prompts(models: Mapping[str, tuple[ModelConfig, object]], ev: EvalConfig, tokenizer=None) -> None:
    """Before anything runs: every cell's task builds its prompts with the run's ``tokenizer`` (a copy that fell
    back to lcx's byte tokenizer is an error, not a table of zeros) and in every model's vocabulary
    (``evaluate.check_fits``), from the first prompt of each cell."""
    expected = TOKENIZER if tokenizer is None else tokenizer
    for cell in prompts(ev, tokenizer, samples=1):
        if cell.task.tokenizer != expected:
            raise ConfigError(f"eval cell (task {cell.name or cell.task.name!r}, length {cell.length}, depth "
                              f"{cell.depth}) builds its prompts with {describe(cell.task.tokenizer)}, not the run's "
                              f"{describe(expected)}")
        for model, _ in models.values():
            check_fits(cell.task, model, cell.ids)


def dropped_bos(task: Task) -> bool:
    """Whether ``task``'s prompts lost the BOS they began with before lcx followed the tokenizer (CHANGELOG): the
    tokenizer has a BOS id but adds none to a text, and the prompts are plain (a chat template's own BOS text
    still decides in a chat frame) and take no explicit ``bos`` parameter (``prose``'s; unchanged when given) - or
    ``eval.bos=false`` removed it."""
    if task.tokenizer.bos_id is None or task.starts_with_bos is not False:
        return False
    return task.chat is None and getattr(task, "bos", None) is None


def _with_bos(task, bos: bool | None):
    """``task`` whose plain prompts begin with BOS as ``eval.bos`` says (None: the tokenizer's rule)."""
    if bos is None:
        return task
    if task.tokenizer.bos_id is None and bos:
        raise ConfigError(f"eval.bos=true is invalid for {describe(task.tokenizer)}: it has no BOS token; set "
                          "eval.bos=null")
    if task.tokenizer.spec == TOKENIZER.spec and not bos:
        raise ConfigError("eval.bos=false is invalid for lcx's byte tokenizer: passkey, niah and mqar build their "
                          "byte-level prompts with BOS first (as the byte-level models were trained); set "
                          "eval.bos=null")
    return dataclasses.replace(task, bos_first=bos)


def _tokenized(task, tokenizer, chat: bool):
    """``task`` building its examples with the run's tokenizer (lcx's byte tokenizer when None)."""
    if tokenizer is None:
        return task.with_tokenizer(task.tokenizer, chat=chat) if chat else task
    return task.with_tokenizer(tokenizer, chat=chat)


__all__ = ["CellPrompts", "check_prompts", "dropped_bos", "grid_tasks", "max_new_tokens", "perplexity_args",
           "prompts"]
