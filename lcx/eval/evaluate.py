"""Measurements: retrieval accuracy (passkey / NIAH / MQAR) and perplexity, each under a cache policy.

Retrieval: greedy generation from each example's prompt; passkey is graded by the first integer generated (the
landmark-attention protocol), the other tasks by the share of reference strings found in the output (RULER).
Perplexity: prefill a prefix, then score the rest of each window token by token through the cache (``Generator.
score``), so an eviction policy is measured the way it would decode.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

from lcx.config import CacheConfig, ConfigError, ModelConfig
from lcx.data.tasks import TOKENIZER, Example, Task
from lcx.generate import Generator

_INT = re.compile(r"\d+")


def grade(task: Task, output: str, example: Example) -> float:
    """Score of one generation in [0, 1]."""
    if task.name == "passkey":
        match = _INT.search(output)
        return float(match is not None and match.group() == example.answer)
    refs = example.references
    return float(np.mean([ref in output for ref in refs])) if refs else 0.0


def with_depth(task: Task, depth: float | None) -> Task:
    if depth is None:
        return task
    if not any(f.name == "depth" for f in dataclasses.fields(task)):
        raise ConfigError(f"eval.depths is set, but task {task.name!r} has no depth parameter (only passkey does)")
    return dataclasses.replace(task, depth=depth)


def answer_tokens(examples: list[Example]) -> int:
    return max(len(TOKENIZER.encode(" " + ex.answer, bos=False)) for ex in examples) + 2


def retrieval_accuracy(model: ModelConfig, params, task: Task, *, length: int, depth: float | None, samples: int,
                       batch_size: int, seed: int, cache: CacheConfig, max_new_tokens: int | None = None,
                       capacity: int | None = None) -> float:
    """Mean grade over ``samples`` validation examples of ``length`` tokens."""
    examples = with_depth(task, depth).examples(seed, 0, samples, length, "validation")
    max_new = max_new_tokens or answer_tokens(examples)
    gen = Generator(model, params, max_new_tokens=max_new, cache=cache, eos_id=TOKENIZER.eos_id, capacity=capacity)
    scores = []
    for lo in range(0, samples, batch_size):
        batch = examples[lo:lo + batch_size]
        result = gen.result(gen.decode(gen.prefill([ex.prompt_ids for ex in batch])))
        for ex, tokens, n in zip(batch, result.tokens, result.lengths):
            scores.append(grade(task, TOKENIZER.decode(tokens[:n]), ex))
    return float(np.mean(scores))


def perplexity(model: ModelConfig, params, task: Task, *, length: int, samples: int, batch_size: int, seed: int,
               cache: CacheConfig, prefix: int | None = None) -> float:
    """exp(mean NLL) of tokens ``prefix+1 .. length`` of ``samples`` validation windows of ``length`` tokens."""
    prefix = prefix or max(1, length // 2)
    if not 0 < prefix < length:
        raise ConfigError(f"eval.ppl_prefix={prefix} is invalid: must be in [1, {length - 1}] for length {length}")
    examples = task.examples(seed, 0, samples, length, "validation")
    ids = np.stack([ex.ids[: length] for ex in examples])  # [n, length]
    gen = Generator(model, params, max_new_tokens=length - prefix, cache=cache)
    nll = []
    for lo in range(0, samples, batch_size):
        batch = ids[lo:lo + batch_size]
        state = gen.prefill(batch[:, :prefix])
        _, logprobs = gen.score(state, batch[:, prefix:])
        nll.append(-logprobs)
    return float(math.exp(np.mean(np.concatenate(nll))))
