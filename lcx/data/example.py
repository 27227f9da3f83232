"""``Example``: one sequence of a task - its ids, which of them are the answer, and what grades a generation."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True, eq=False)
class Example:
    """One sequence: ``ids [n]`` int32 (BOS first, n <= seq_len + 1) and ``loss_mask [n]`` bool on answer tokens.

    ``answer`` is the answer text (passkey: the key's digits; niah: the values joined by ", "; mqar: the queried
    values joined by spaces); ``references`` the strings a generation is graded against (``Task.score``);
    ``prompt`` the text before the first answer token, so that an evaluation with another tokenizer can re-encode it.
    ``weight``: the loss weight of the answer tokens (a mixture balances its parts with it).
    ``context_len``: the prompt tokens before the question (BOS and chat header included), for evaluations that
    compress the context with the question excluded; None where a task does not mark it.
    ``segments`` / ``positions`` (packed rows of several documents, ``lcx.data.documents``): each token's segment id
    (>= 1) and its position within its segment; None for a single sequence (positions 0 .. n-1).
    """

    ids: np.ndarray
    loss_mask: np.ndarray
    answer: str
    references: tuple[str, ...]
    prompt: str
    weight: float = 1.0
    segments: np.ndarray | None = None
    positions: np.ndarray | None = None
    context_len: int | None = None

    @property
    def prompt_len(self) -> int:
        """Tokens before the first answer token (BOS included) - ``ids[:prompt_len]`` is what a model is given."""
        hits = np.flatnonzero(self.loss_mask)
        return int(hits[0]) if hits.size else len(self.ids)

    @property
    def prompt_ids(self) -> np.ndarray:
        return self.ids[: self.prompt_len]


__all__ = ["Example"]
