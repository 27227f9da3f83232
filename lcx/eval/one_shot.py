"""kvpress's one-shot protocol for one or several cache settings on the same prompts: each context prefilled,
compressed once, the question read after it, then greedy generation.

Several settings of one grid cell group (same task, length, depth and prompts) share each context's expensive part:
its first ``len - TAIL`` tokens are read once by a full cache and every policy that can continues from there
(``lcx.engine.split_prefill``). A policy reads the same two calls alone (``retrieval_outputs`` with one cache), so
its answers in a group equal its answers alone. A setting that cannot split reads each context in one call, as
before the split existed (``split_refusal`` says why).
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Sequence

import numpy as np

from lcx.config import CacheConfig, ModelConfig
from lcx.data.policy_inputs import policy_inputs
from lcx.data.task import Example, Task
from lcx.engine import Generator, PositionRangeWarning, plan_capacity
from lcx.engine import split_prefill


@dataclasses.dataclass
class Measured:
    """One setting's answers on the group's prompts and what it took: ``counts`` (prompt_tokens, prefilled_tokens -
    the shared start counted for each setting that used it -, kv_bytes, held_kv_bytes) and ``seconds`` (its own
    calls plus an equal share of the shared starts)."""

    outputs: list[str]
    counts: dict
    seconds: float = 0.0


def one_shot_outputs(model: ModelConfig, params, task: Task, examples: list[Example], caches: Sequence[CacheConfig],
                     *, batches: list[list[int]], batch_size: int, max_new: int, generator_new: int,
                     capacity: int | None, unroll: bool | None) -> list[Measured]:
    """Each of ``caches`` over ``examples`` (``batches``: the example indices of each batch, grouped by question
    length): one ``Measured`` per cache, in order. ``generator_new``: the generators' ``max_new_tokens`` (the
    question's tokens and the answer's); ``capacity``: the slots of every cache (None: planned per batch - then only
    one cache)."""
    if capacity is None and len(caches) > 1:
        raise ValueError("one_shot_outputs shares a prefill between caches of one fixed capacity: pass capacity")
    tok = task.tokenizer
    gens = [Generator(model, params, max_new_tokens=generator_new, cache=c, eos_id=tok.eos_id, capacity=capacity,
                      unroll=unroll, **policy_inputs(c.make_policy(), task.frame)) for c in caches]
    splits = [split_prefill.split_refusal(model, c, g.mesh) is None for g, c in zip(gens, caches)]
    bases: dict[tuple, Generator] = {}
    out = [Measured([""] * len(examples), {"prompt_tokens": 0, "prefilled_tokens": 0, "kv_bytes": 0,
                                           "held_kv_bytes": 0}) for _ in caches]
    forks = all(g.mesh is None and g.kind.can_fork for g in gens)
    try:
        for batch in batches:
            real = len(batch)
            batch = batch + [batch[-1]] * (min(batch_size, len(examples)) - real)  # one compiled batch shape
            contexts = [examples[i].prompt_ids[:examples[i].context_len] for i in batch]
            runs = _runs(contexts) if forks else [(i, 1) for i in range(len(contexts))]
            unique = [contexts[start] for start, _ in runs]
            questions = np.stack([examples[i].prompt_ids[examples[i].context_len:] for i in batch])
            # each cache's slots for this batch (as its prefill would plan them), and whether it reads in two parts
            caps = [capacity or plan_capacity(model, g.cache_config, len(unique), max(len(c) for c in unique),
                                              g.max_new_tokens) for g in gens]
            keys = [split_prefill.base_key(c, cap) if ok and split_prefill.split(unique, cap) else None
                    for c, cap, ok in zip(caches, caps, splits)]
            starts: dict[tuple, tuple] = {}  # base key -> (start state, seconds per cache that shares it)
            for gen, key, m in zip(gens, keys, out):
                t0 = time.perf_counter()
                with warnings.catch_warnings():  # an evaluation grid measures past the trained range on purpose
                    warnings.simplefilter("ignore", PositionRangeWarning)
                    if key is not None:
                        if key not in starts:  # read once; its time shared equally by the caches of its key
                            base = bases.get(key) or bases.setdefault(key, split_prefill.base_generator(gen, key[0]))
                            t1 = time.perf_counter()
                            start = split_prefill.read_start(base, unique)
                            starts[key] = (start, (time.perf_counter() - t1) / keys.count(key))
                            t0 += time.perf_counter() - t1  # added back below, in equal shares
                        start, share = starts[key]
                        state = split_prefill.read_rest(gen, start, unique)
                        m.seconds += share
                        m.counts["prefilled_tokens"] += sum(len(c) for c in unique) - len(unique) * split_prefill.TAIL
                    else:
                        state = gen.prefill(unique)
                    if len(runs) < len(contexts):
                        state = gen.fork(state, [n for _, n in runs])
                    held = state.cache.held_bytes() // len(contexts)
                    if questions.shape[1]:
                        state, _ = gen.score(state, questions)
                    result = gen.result(gen.decode(state, steps=max_new))
                m.seconds += time.perf_counter() - t0
                m.counts["prompt_tokens"] += sum(len(c) for c in contexts)
                m.counts["kv_bytes"] = max(m.counts["kv_bytes"], result.cache_bytes // max(len(result.tokens), 1))
                m.counts["held_kv_bytes"] = max(m.counts["held_kv_bytes"], held)
                for i, tokens, n in zip(batch[:real], result.tokens, result.lengths):
                    m.outputs[i] = tok.decode(tokens[:n])
            del starts  # the shared starts' buffers, before the next batch's
        for gen, m in zip(gens, out):
            m.counts["prefilled_tokens"] += gen.prefilled_tokens
    finally:
        for gen in [*gens, *bases.values()]:
            gen.close()
    return out


def _runs(prompts: list[np.ndarray]) -> list[tuple[int, int]]:
    """(first index, length) of each run of consecutive equal prompts."""
    runs: list[tuple[int, int]] = []
    for i, ids in enumerate(prompts):
        if runs and np.array_equal(prompts[runs[-1][0]], ids):
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


__all__ = ["Measured", "one_shot_outputs"]
