"""Log-probabilities of whole token sequences, with each position's most likely alternatives: what a server's
``echo`` / ``logprobs`` answers report (the prompt's tokens and the generated ones).

    scorer = Scorer(config, params, cache, eos_id=2, max_len=4096)
    scored = scorer.score([5, 17, 99, 3])   # Scored: logprobs [3], top_logprobs [3, 20], top_ids [3, 20]

A sequence is scored as ``lcx.LM.score`` scores a text: its first token prefilled, the rest teacher-forced through a
contiguous cache of the server's policy and KV dtype (``Generator.score_top``). So the numbers never depend on how
the server got a prompt's keys and values - prefilled, shared from a kept prefix or loaded from the store - nor on
its batch-mates. One generator per power-of-two length (at least ``MIN_BUCKET`` tokens), the tokens padded to it,
keeps the compiled programs few: a request of any length reuses its bucket's.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from lcx.cache.config import CacheConfig
from lcx.config_base import ConfigError
from lcx.engine.generator import Generator
from lcx.model.config import ModelConfig

MAX_TOP = 20  # alternatives per position (OpenAI's limit for logprobs / top_logprobs)
MIN_BUCKET = 64  # the smallest scored length compiled for


@dataclasses.dataclass(frozen=True)
class Scored:
    """``logprobs[i]`` = log p(ids[i + 1] | ids[:i + 1]); ``top_logprobs[i]`` / ``top_ids[i]``: the ``MAX_TOP``
    most likely tokens at that position, most likely first (natural log, float32)."""

    logprobs: np.ndarray
    top_logprobs: np.ndarray
    top_ids: np.ndarray


class Scorer:
    """Scores token sequences of at most ``max_len`` tokens under ``cache`` (its policy and KV dtype; the layout
    is contiguous whatever ``cache`` says). Not thread-safe: one caller (a server's engine thread)."""

    def __init__(self, config: ModelConfig, params, cache: CacheConfig, *, eos_id: int | None, max_len: int,
                 reconstruction=None, mesh=None):
        self.config, self.params, self.eos_id, self.max_len = config, params, eos_id, max_len
        self.mesh = mesh  # the server's mesh (tensor parallel): scoring splits the weights the same way
        self.reconstruction = reconstruction  # KVzip's repeat prompt (a Generator of that policy needs one)
        self.cache = CacheConfig(**(cache.to_dict() | {"layout": "contiguous"}))
        self._generators: dict[int, Generator] = {}

    def _generator(self, n: int) -> tuple[Generator, int]:
        bucket = min(max(MIN_BUCKET, 1 << max(n - 1, 1).bit_length()), self.max_len)
        gen = self._generators.get(bucket)
        if gen is None:
            gen = self._generators[bucket] = Generator(self.config, self.params, max_new_tokens=bucket,
                                                       cache=self.cache, eos_id=self.eos_id,
                                                       reconstruction=self.reconstruction, mesh=self.mesh)
        return gen, bucket

    def score(self, ids) -> Scored:
        """``ids`` (at least 2 tokens, at most ``max_len``) scored after their first token."""
        ids = np.asarray(ids, np.int32)
        if ids.ndim != 1 or not 2 <= ids.size <= self.max_len:
            raise ConfigError(f"Scorer.score: ids must be 2 to {self.max_len} token ids, got shape {ids.shape}")
        n = ids.size - 1
        gen, bucket = self._generator(n)
        # The tokens padded to the bucket: the chunk widths, and so the compiled programs, are the bucket's whatever
        # the length (a harness's prompts of every length compile once). Causal attention and an eviction schedule
        # counted in tokens keep the real tokens' numbers those of scoring them alone.
        forced = np.zeros((1, bucket), np.int32)
        forced[0, :n] = ids[1:]
        try:
            state = gen.prefill([ids[:1]])
            _, logprobs, top, top_ids = gen.score_top(state, forced, MAX_TOP)
        finally:
            gen.close()
        return Scored(logprobs=logprobs[0, :n], top_logprobs=top[0, :n], top_ids=top_ids[0, :n])


__all__ = ["MAX_TOP", "MIN_BUCKET", "Scored", "Scorer"]
