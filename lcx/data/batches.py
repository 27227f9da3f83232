"""Fixed-shape training batches from a task: a pure function of (task, seed, batch index).

A batch is four arrays of shape ``[batch, seq_len]`` (the one-token shift of language modelling is done here, once):
``inputs`` int32 token ids, ``targets`` int32 the next token, ``weights`` float32 the loss weight of each target -
1 on answer tokens, ``prompt_loss_weight`` on other real tokens, 0 on padding - and ``answer`` float32, 1 where the
target is an answer token (what the answer metrics average over, whatever the prompt weight). Examples shorter than
``seq_len + 1`` tokens are right-padded with PAD, so every batch has the same shape and the step compiles once.
A packed batch (``packed=True``: several documents per row) also has ``positions`` and ``segment_ids`` int32 (0 on
padding), and a target in another segment than its input token carries no loss.
"""

from __future__ import annotations

import numpy as np

from lcx.config_base import ConfigError
from lcx.data.task import TOKENIZER, Example, Task


def pack(examples: list[Example], seq_len: int, prompt_loss_weight: float = 0.0, *, packed: bool = False,
         pad_id: int = TOKENIZER.pad_id) -> dict[str, np.ndarray]:
    """Stack ``examples`` into ``{"inputs", "targets", "weights", "answer"}`` (and with ``packed``, ``positions``
    and ``segment_ids``), each ``[len(examples), seq_len]``."""
    b = len(examples)
    tokens = np.full((b, seq_len + 1), pad_id, np.int32)
    weights = np.zeros((b, seq_len + 1), np.float32)
    answer = np.zeros((b, seq_len + 1), np.float32)
    segments = np.zeros((b, seq_len + 1), np.int32)
    positions = np.zeros((b, seq_len + 1), np.int32)
    for i, ex in enumerate(examples):
        n = len(ex.ids)
        if n > seq_len + 1:
            raise ConfigError(f"an example of {n} tokens does not fit seq_len={seq_len} (at most seq_len + 1 = "
                              f"{seq_len + 1} tokens, the last one only a target)")
        tokens[i, :n] = ex.ids
        weights[i, :n] = np.where(ex.loss_mask, ex.weight, prompt_loss_weight)
        answer[i, :n] = ex.loss_mask
        segments[i, :n] = 1 if ex.segments is None else ex.segments
        positions[i, :n] = np.arange(n) if ex.positions is None else ex.positions
    out = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": weights[:, 1:], "answer": answer[:, 1:]}
    if packed:
        same = segments[:, 1:] == segments[:, :-1]  # a target starting the next document is not predicted
        out["weights"] = out["weights"] * same
        out["answer"] = out["answer"] * same
        out |= {"positions": positions[:, :-1], "segment_ids": segments[:, :-1]}
    elif any(ex.segments is not None for ex in examples):
        raise ValueError("examples with segments (packed documents) need pack(..., packed=True)")
    return out


class BatchSource:
    """``source(index, split="train")`` -> the batch ``index`` of ``split``; same arguments, same arrays."""

    def __init__(self, task: Task, *, seq_len: int, batch_size: int, seed: int, prompt_loss_weight: float = 0.0):
        if seq_len < 1 or batch_size < 1:
            raise ConfigError(f"seq_len={seq_len} and batch_size={batch_size} must be positive")
        self.task, self.seq_len, self.batch_size, self.seed = task, seq_len, batch_size, seed
        self.prompt_loss_weight = prompt_loss_weight

    def examples(self, index: int, split: str = "train") -> list[Example]:
        return self.task.examples(self.seed, index, self.batch_size, self.seq_len, split)

    def __call__(self, index: int, split: str = "train") -> dict[str, np.ndarray]:
        return pack(self.examples(index, split), self.seq_len, self.prompt_loss_weight, packed=self.task.packed,
                    pad_id=self.task.tokenizer.pad_id)


__all__ = ["BatchSource", "pack"]
