"""Log-probabilities in OpenAI's two wire shapes, from a finished ``Generation``'s ``scored`` arrays
(``lcx.engine.scoring``: position i scores token i + 1 of prompt + answer).

- ``/v1/completions``: ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``, one entry per token; with
  ``echo`` the prompt's tokens come first (the first has no condition: null log-probability and alternatives).
  ``top_logprobs[i]`` maps the ``logprobs`` most likely tokens' text to their log-probability, and always holds the
  token itself (so up to ``logprobs`` + 1 entries, as OpenAI's). ``text_offset[i]``: where token i's text starts in
  the choice's ``text``.
- ``/v1/chat/completions``: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`` for the
  answer's tokens.

A token's text is what it adds to the decoded text (``Detokenizer``); an alternative's is its text decoded alone.
Log-probabilities that are not finite (a token the model rules out) are sent as -9999.0: JSON has no -Infinity.
"""

from __future__ import annotations

import math

from lcx.service.engine import Detokenizer, Generation

FLOOR = -9999.0


def _finite(x) -> float:
    x = float(x)
    return x if math.isfinite(x) else FLOOR


def token_texts(tokenizer, ids) -> list[str]:
    """What each token of ``ids`` adds to their decoded text (an incomplete character's bytes: "" until the
    token that completes it)."""
    detok = Detokenizer(tokenizer)
    texts = [detok.add(t) for t in ids]
    if texts:
        texts[-1] += detok.flush()
    return texts


class _Alone:
    """Each id's text decoded alone, remembered (alternatives repeat across positions)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.seen = tokenizer, {}

    def __call__(self, token: int) -> str:
        token = int(token)
        if token not in self.seen:
            self.seen[token] = self.tokenizer.decode([token])
        return self.seen[token]


def completion_logprobs(gen: Generation, tokenizer, top: int, echo: bool, start: int = 0) -> dict:
    """The ``logprobs`` object of a completion choice; ``start``: where the answer's text begins in the choice's
    text (the echoed prompt's length)."""
    scored, prompt = gen.scored, len(gen.prompt)
    ids = (list(gen.prompt) if echo else []) + list(gen.tokens)
    first = 0 if echo else prompt  # index into prompt + tokens of the first reported token
    texts = token_texts(tokenizer, ids)
    alone = _Alone(tokenizer)
    tokens, values, tops, offsets = [], [], [], []
    offset = 0 if echo else start
    for j, (token, text) in enumerate(zip(ids, texts)):
        i = first + j - 1  # the scored position that predicts it; -1: the first prompt token
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if i < 0:
            values.append(None)
            tops.append(None)
            continue
        value = _finite(scored.logprobs[i])
        values.append(value)
        alternatives = {alone(t): _finite(v) for t, v in zip(scored.top_ids[i, :top], scored.top_logprobs[i, :top])}
        alternatives.setdefault(text, value)
        tops.append(alternatives)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(gen: Generation, tokenizer, top: int) -> dict:
    """The ``logprobs`` object of a chat choice: the answer's tokens."""
    scored, prompt = gen.scored, len(gen.prompt)
    texts = token_texts(tokenizer, gen.tokens)
    alone = _Alone(tokenizer)
    content = []
    for j, text in enumerate(texts):
        i = prompt + j - 1
        alternatives = [{"token": alone(t), "logprob": _finite(v), "bytes": list(alone(t).encode())}
                        for t, v in zip(scored.top_ids[i, :top], scored.top_logprobs[i, :top])]
        content.append({"token": text, "logprob": _finite(scored.logprobs[i]), "bytes": list(text.encode()),
                        "top_logprobs": alternatives})
    return {"content": content}


__all__ = ["FLOOR", "chat_logprobs", "completion_logprobs", "token_texts"]
