"""Measurements: retrieval accuracy (passkey / NIAH / MQAR) and perplexity, each under a cache policy.

Retrieval: greedy generation from each example's prompt, graded by the task (``Task.score``: passkey by the first
integer generated, NIAH by the share of reference strings found, MQAR by the first query's value).
Perplexity: prefill a prefix, then score the rest of each window through the cache (``Generator.score``: in chunks
on the cache's own eviction schedule, the log-probabilities of one token per step), so an eviction policy is
measured the way it would decode.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import numpy as np

from lcx.config import CacheConfig, ConfigError, ModelConfig
from lcx.data.policy_inputs import policy_inputs
from lcx.data.task import TOKENIZER, Example, Task
from lcx.data.tokenizer import check_model_tokens
from lcx.eval.stats import perplexity_interval, wilson_interval  # noqa: F401  (re-exported)
from lcx.engine import Generator, PositionRangeWarning
from lcx.eval.one_shot import one_shot_outputs


def grade(task: Task, output: str, example: Example) -> float:
    """Score of one generation in [0, 1]: the task's own grading (``Task.score``)."""
    return task.score(example, output)


def grades(task: Task, examples: list[Example], outputs: list[str]) -> np.ndarray:
    """``[n]`` grades of each example's generation."""
    return np.asarray([grade(task, out, ex) for ex, out in zip(examples, outputs)], np.float64)


def with_depth(task: Task, depth: float | None) -> Task:
    """``task`` with its needle at ``depth`` (None: as it is). A copy keeps the task's tokenizer and chat frame."""
    if depth is None:
        return task
    if not any(f.name == "depth" for f in dataclasses.fields(task)):
        raise ConfigError(f"eval.depths is set, but task {task.name!r} has no depth parameter (passkey and the "
                          "RULER-style niah_* tasks have one)")
    return dataclasses.replace(task, depth=depth)


def cell_examples(task: Task, *, length: int, depth: float | None, samples: int, seed: int) -> list[Example]:
    """The ``samples`` validation examples of ``length`` tokens a retrieval cell asks, the needle at ``depth``."""
    return with_depth(task, depth).examples(seed, 0, samples, length, "validation")


def check_fits(task: Task, model: ModelConfig, ids) -> None:
    """Refuse, before anything runs, a task whose prompts ``ids`` (arrays) are not in ``model``'s tokens
    (``lcx.data.tokenizer.check_model_tokens``): byte ids fed to a BPE model, or ids past its vocabulary."""
    check_model_tokens(task.tokenizer, ids, model.vocab_size, f"{task.task_key}={task.name!r}")


def answer_tokens(examples: list[Example], tokenizer=TOKENIZER) -> int:
    return max(len(tokenizer.encode(" " + ex.answer, bos=False)) for ex in examples) + 2


PROTOCOLS = ("streaming", "one_shot")


def retrieval_scores(model: ModelConfig, params, task: Task, *, length: int, depth: float | None, samples: int,
                     batch_size: int, seed: int, cache: CacheConfig, max_new_tokens: int | None = None,
                     capacity: int | None = None, protocol: str = "streaming",
                     unroll: bool | None = None, buffer: int | None = None,
                     counts: dict | None = None) -> np.ndarray:
    """The grade of each of ``samples`` validation examples of ``length`` tokens: ``[samples]`` in [0, 1]
    (``retrieval_outputs`` graded by the task)."""
    examples, outputs = retrieval_outputs(model, params, task, length=length, depth=depth, samples=samples,
                                          batch_size=batch_size, seed=seed, cache=cache,
                                          max_new_tokens=max_new_tokens, capacity=capacity, protocol=protocol,
                                          unroll=unroll, buffer=buffer, counts=counts)
    return grades(task, examples, outputs)


def retrieval_outputs(model: ModelConfig, params, task: Task, *, length: int, depth: float | None, samples: int,
                      batch_size: int, seed: int, cache: CacheConfig, max_new_tokens: int | None = None,
                      capacity: int | None = None, protocol: str = "streaming", unroll: bool | None = None,
                      buffer: int | None = None, counts: dict | None = None) -> tuple[list[Example], list[str]]:
    """``samples`` validation examples of ``length`` tokens and the greedy generation (decoded text) for each.

    ``protocol``: ``streaming`` prefills the whole prompt through the cache (chunks and evictions as configured);
    ``one_shot`` (kvpress's protocol) prefills the context alone, compresses it once, then reads the question
    (teacher-forced, no eviction when the cache's ``interval`` leaves room for the question and the answer) and
    generates - the question never influences what is kept. Examples are batched by question length. A policy
    that observes only a context's end reads its first ``len - 256`` tokens and its last 256 in two calls
    (``lcx.eval.one_shot``: how a grid shares the first between policies).
    ``buffer``: the generator's ``max_new_tokens`` when larger than this task's (tasks of one grid share one compiled
    decode loop; its step limit is traced, so each stops at its own ``max_new_tokens``); with ``one_shot`` it must
    also hold the question's tokens.

    Examples that share a context (a task's ``questions_per_haystack``) prefill it once where they share a batch:
    ``one_shot`` prefills each run of equal contexts for one row and forks it (``Generator.fork``; any cache), and
    ``streaming`` with a paged cache shares the whole pages consecutive prompts start with (``Generator.prefill``).
    ``counts``: a dict that receives ``prompt_tokens`` (what the batches would prefill without sharing),
    ``prefilled_tokens`` (what went through the model), ``kv_bytes`` (the device KV bytes per sequence at the
    end of generation, the most of any batch: ``GenerateResult.cache_bytes`` over its rows) and, for ``one_shot``,
    ``held_kv_bytes`` (per sequence right after the one compression: ``CacheState.held_bytes`` - a paged cache
    has given back the pages past what it keeps, while its ``kv_bytes`` is the peak of the prefill)."""
    tok = task.tokenizer
    examples = cell_examples(task, length=length, depth=depth, samples=samples, seed=seed)
    check_fits(task, model, [ex.prompt_ids for ex in examples])
    max_new = max_new_tokens or answer_tokens(examples, tok)
    # one_shot: the prefill sees the context only; the question is read after it, into the same cache - planned
    # for it as for generated tokens (a grid's ``buffer`` already holds room for it)
    question = max((ex.prompt_len - ex.context_len for ex in examples if ex.context_len is not None), default=0)
    extra = question if protocol == "one_shot" and buffer is None else 0
    batches = prompt_batches(examples, batch_size, protocol, task.name)
    if protocol == "one_shot":
        [measured] = one_shot_outputs(model, params, task, examples, [cache], batches=batches, batch_size=batch_size,
                                      max_new=max_new, generator_new=max(max_new, buffer or 0) + extra,
                                      capacity=capacity, unroll=unroll)
        if counts is not None:
            counts.update(measured.counts)
        return examples, measured.outputs
    gen = Generator(model, params, max_new_tokens=max(max_new, buffer or 0), cache=cache, eos_id=tok.eos_id,
                    capacity=capacity, unroll=unroll, **policy_inputs(cache.make_policy(), task.frame))
    outputs = [""] * samples
    asked = kv_bytes = 0
    for batch in batches:
        with warnings.catch_warnings():  # an evaluation grid measures past the trained range on purpose
            warnings.simplefilter("ignore", PositionRangeWarning)
            asked += sum(examples[i].prompt_len for i in batch)
            state = gen.prefill([examples[i].prompt_ids for i in batch])
            result = gen.result(gen.decode(state, steps=max_new))
            kv_bytes = max(kv_bytes, result.cache_bytes // max(len(result.tokens), 1))
        for i, tokens, n in zip(batch, result.tokens, result.lengths):
            outputs[i] = tok.decode(tokens[:n])
    gen.close()
    if counts is not None:
        counts.update(prompt_tokens=asked, prefilled_tokens=gen.prefilled_tokens, kv_bytes=kv_bytes)
    return examples, outputs


def prompt_batches(examples: list[Example], batch_size: int, protocol: str, name: str) -> list[list[int]]:
    """Indices of the examples per batch: in order, or (one_shot) grouped by question length, since the question is
    teacher-forced as one ``[batch, n]`` block."""
    if protocol not in PROTOCOLS:
        raise ConfigError(f"protocol={protocol!r} is invalid: must be one of {list(PROTOCOLS)}")
    order = list(range(len(examples)))
    if protocol == "streaming":
        return [order[lo:lo + batch_size] for lo in range(0, len(order), batch_size)]
    if any(ex.context_len is None for ex in examples):
        raise ConfigError(f"protocol 'one_shot' needs examples that mark where the question starts; task {name!r} "
                          "with this tokenizer does not (the byte-level synthetic tasks do not)")
    groups: dict[int, list[int]] = {}
    for i, ex in enumerate(examples):
        groups.setdefault(ex.prompt_len - ex.context_len, []).append(i)
    return [g[lo:lo + batch_size] for g in groups.values() for lo in range(0, len(g), batch_size)]


def retrieval_accuracy(model: ModelConfig, params, task: Task, *, length: int, depth: float | None, samples: int,
                       batch_size: int, seed: int, cache: CacheConfig, max_new_tokens: int | None = None,
                       capacity: int | None = None) -> float:
    """Mean grade over ``samples`` validation examples of ``length`` tokens."""
    return float(np.mean(retrieval_scores(model, params, task, length=length, depth=depth, samples=samples,
                                          batch_size=batch_size, seed=seed, cache=cache,
                                          max_new_tokens=max_new_tokens, capacity=capacity)))


def window_nll(model: ModelConfig, params, task: Task, *, length: int, samples: int, batch_size: int, seed: int,
               cache: CacheConfig, prefix: int | None = None, capacity: int | None = None,
               tail: int | None = None, longest: int | None = None, unroll: bool | None = None,
               per_token: bool = False, counts: dict | None = None) -> np.ndarray:
    """Mean negative log-likelihood (nats / token) of tokens ``prefix+1 .. length`` of each of ``samples``
    validation windows of ``length`` tokens, ``[samples]``.

    With ``tail``, the windows are the last ``length`` tokens of windows of ``longest`` tokens (the first token
    kept when it is BOS) and the last ``tail`` tokens are scored: the same text at every length. ``per_token``: the
    NLL of every scored token, ``[samples, length - prefix]``. ``counts``: a dict that receives ``kv_bytes``, the
    device KV bytes per sequence after the last scored token (the most of any batch)."""
    ids, prefix = perplexity_windows(task, length=length, samples=samples, seed=seed, prefix=prefix, tail=tail,
                                     longest=longest)
    check_fits(task, model, ids)
    gen = Generator(model, params, max_new_tokens=length - prefix, cache=cache, capacity=capacity, unroll=unroll,
                    **policy_inputs(cache.make_policy(), task.frame))
    nll = []
    kv_bytes = 0
    for lo in range(0, samples, batch_size):
        batch = ids[lo:lo + batch_size]
        state = gen.prefill(batch[:, :prefix])
        state, logprobs = gen.score(state, batch[:, prefix:])
        kv_bytes = max(kv_bytes, state.cache.kv_bytes() // len(batch))
        nll.append(-logprobs if per_token else -np.mean(logprobs, axis=1))
    gen.close()
    if counts is not None:
        counts["kv_bytes"] = kv_bytes
    return np.concatenate(nll)


def perplexity_windows(task: Task, *, length: int, samples: int, seed: int, prefix: int | None = None,
                       tail: int | None = None, longest: int | None = None) -> tuple[np.ndarray, int]:
    """The ``[samples, length]`` windows a perplexity cell scores and the ``prefix`` prefilled before the scored
    tokens (``window_nll`` explains ``tail`` and ``longest``)."""
    if tail is not None:
        if not 0 < tail < length:
            raise ConfigError(f"eval.perplexity.tail={tail} is invalid: must be in [1, {length - 1}] for length "
                              f"{length}")
        examples = task.examples(seed, 0, samples, longest or length, "validation")
        ids = np.stack([ex.ids[:(longest or length)][-length:] for ex in examples])  # [n, length]
        bos = task.tokenizer.bos_id
        if bos is not None:
            starts_with_bos = np.asarray([ex.ids[0] == bos for ex in examples])
            ids[:, 0] = np.where(starts_with_bos, bos, ids[:, 0])
        return ids, length - tail
    prefix = prefix or max(1, length // 2)
    if not 0 < prefix < length:
        raise ConfigError(f"eval.ppl_prefix={prefix} is invalid: must be in [1, {length - 1}] for length {length}")
    examples = task.examples(seed, 0, samples, length, "validation")
    return np.stack([ex.ids[: length] for ex in examples]), prefix  # [n, length]


def perplexity(model: ModelConfig, params, task: Task, *, length: int, samples: int, batch_size: int, seed: int,
               cache: CacheConfig, prefix: int | None = None) -> float:
    """exp(mean NLL) of tokens ``prefix+1``-``length`` of ``samples`` validation windows of ``length`` tokens."""
    return float(math.exp(np.mean(window_nll(model, params, task, length=length, samples=samples,
                                             batch_size=batch_size, seed=seed, cache=cache, prefix=prefix))))
