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
from lcx.data.task import TOKENIZER, Example, Task
from lcx.eval.stats import perplexity_interval, wilson_interval  # noqa: F401  (re-exported)
from lcx.generate import Generator, PositionRangeWarning


def grade(task: Task, output: str, example: Example) -> float:
    """Score of one generation in [0, 1]: the task's own grading (``Task.score``)."""
    return task.score(example, output)


def with_depth(task: Task, depth: float | None) -> Task:
    if depth is None:
        return task
    if not any(f.name == "depth" for f in dataclasses.fields(task)):
        raise ConfigError(f"eval.depths is set, but task {task.name!r} has no depth parameter (only passkey does)")
    return dataclasses.replace(task, depth=depth)


def answer_tokens(examples: list[Example]) -> int:
    return max(len(TOKENIZER.encode(" " + ex.answer, bos=False)) for ex in examples) + 2


def retrieval_scores(model: ModelConfig, params, task: Task, *, length: int, depth: float | None, samples: int,
                     batch_size: int, seed: int, cache: CacheConfig, max_new_tokens: int | None = None,
                     capacity: int | None = None) -> np.ndarray:
    """The grade of each of ``samples`` validation examples of ``length`` tokens: ``[samples]`` in [0, 1]."""
    examples = with_depth(task, depth).examples(seed, 0, samples, length, "validation")
    max_new = max_new_tokens or answer_tokens(examples)
    gen = Generator(model, params, max_new_tokens=max_new, cache=cache, eos_id=TOKENIZER.eos_id, capacity=capacity)
    scores = []
    for lo in range(0, samples, batch_size):
        batch = examples[lo:lo + batch_size]
        with warnings.catch_warnings():  # an evaluation grid measures past the trained range on purpose
            warnings.simplefilter("ignore", PositionRangeWarning)
            result = gen.result(gen.decode(gen.prefill([ex.prompt_ids for ex in batch])))
        for ex, tokens, n in zip(batch, result.tokens, result.lengths):
            scores.append(grade(task, TOKENIZER.decode(tokens[:n]), ex))
    gen.close()
    return np.asarray(scores, np.float64)


def retrieval_accuracy(model: ModelConfig, params, task: Task, *, length: int, depth: float | None, samples: int,
                       batch_size: int, seed: int, cache: CacheConfig, max_new_tokens: int | None = None,
                       capacity: int | None = None) -> float:
    """Mean grade over ``samples`` validation examples of ``length`` tokens."""
    return float(np.mean(retrieval_scores(model, params, task, length=length, depth=depth, samples=samples,
                                          batch_size=batch_size, seed=seed, cache=cache,
                                          max_new_tokens=max_new_tokens, capacity=capacity)))


def window_nll(model: ModelConfig, params, task: Task, *, length: int, samples: int, batch_size: int, seed: int,
               cache: CacheConfig, prefix: int | None = None, capacity: int | None = None,
               tail: int | None = None, longest: int | None = None) -> np.ndarray:
    """Mean negative log-likelihood (nats / token) of tokens ``prefix+1 .. length`` of each of ``samples``
    validation windows of ``length`` tokens, ``[samples]``.

    With ``tail``, the windows are the last ``length`` tokens of windows of ``longest`` tokens (the first token
    kept when it is BOS) and the last ``tail`` tokens are scored: the same text at every length."""
    if tail is not None:
        if not 0 < tail < length:
            raise ConfigError(f"eval.perplexity.tail={tail} is invalid: must be in [1, {length - 1}] for length "
                              f"{length}")
        examples = task.examples(seed, 0, samples, longest or length, "validation")
        ids = np.stack([ex.ids[:(longest or length)][-length:] for ex in examples])  # [n, length]
        starts_with_bos = np.asarray([ex.ids[0] == TOKENIZER.bos_id for ex in examples])
        ids[:, 0] = np.where(starts_with_bos, TOKENIZER.bos_id, ids[:, 0])
        prefix = length - tail
    else:
        prefix = prefix or max(1, length // 2)
        if not 0 < prefix < length:
            raise ConfigError(f"eval.ppl_prefix={prefix} is invalid: must be in [1, {length - 1}] for length "
                              f"{length}")
        examples = task.examples(seed, 0, samples, length, "validation")
        ids = np.stack([ex.ids[: length] for ex in examples])  # [n, length]
    gen = Generator(model, params, max_new_tokens=length - prefix, cache=cache, capacity=capacity)
    nll = []
    for lo in range(0, samples, batch_size):
        batch = ids[lo:lo + batch_size]
        state = gen.prefill(batch[:, :prefix])
        _, logprobs = gen.score(state, batch[:, prefix:])
        nll.append(-np.mean(logprobs, axis=1))
    gen.close()
    return np.concatenate(nll)


def perplexity(model: ModelConfig, params, task: Task, *, length: int, samples: int, batch_size: int, seed: int,
               cache: CacheConfig, prefix: int | None = None) -> float:
    """exp(mean NLL) of tokens ``prefix+1 .. length`` of ``samples`` validation windows of ``length`` tokens."""
    return float(math.exp(np.mean(window_nll(model, params, task, length=length, samples=samples,
                                             batch_size=batch_size, seed=seed, cache=cache, prefix=prefix))))
