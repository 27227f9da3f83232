"""``mixture``: examples drawn from several tasks with given weights (e.g. language modelling on a corpus plus
retrieval), so one small model learns both the text long documents are made of and to retrieve from it.

    data: {task: mixture, params: {parts: [{task: corpus, weight: 0.5, loss_weight: 0.15},
                                          {task: passkey, weight: 0.5, params: {filler_min: 0, offset: true}}]}}

``weight``: how often a part is drawn; ``loss_weight``: the loss weight of its answer tokens - every token of a
corpus window is a target, against a handful in a retrieval example, so without it the corpus would dominate the
gradient.

Batch ``index`` is a pure function of (seed, split, index): each slot's part is drawn from the weights, and each part
yields its own examples for that index (its own seed), so resuming at any step gives the same batches.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from lcx.config_base import ConfigError
from lcx.data.task import Example, Task, make_task, register, split_id


@register
@dataclasses.dataclass(frozen=True)
class Mixture(Task):
    """``parts``: a list of ``{task: NAME, params: {...}, weight: W, loss_weight: X}`` (weights normalized; default
    1 each)."""

    name: ClassVar[str] = "mixture"
    parts: tuple[Any, ...] = ()

    def __post_init__(self):
        if not self.parts:
            raise ConfigError(f"{self.key('parts')} is empty: a mixture needs at least one {{task: NAME, weight: W}}")
        built = []
        for i, part in enumerate(self.parts):
            where = self.key(f"parts[{i}]")
            if isinstance(part, tuple) and len(part) == 3 and isinstance(part[0], Task):
                built.append(part)
                continue
            if not isinstance(part, Mapping) or "task" not in part:
                raise ConfigError(f"{where}={part!r} is invalid: must be a mapping like "
                                  "{task: corpus, weight: 0.5, params: {...}}")
            unknown = sorted(set(part) - {"task", "params", "weight", "loss_weight"})
            if unknown:
                raise ConfigError(f"{where}.{unknown[0]} is not a key of a mixture part "
                                  "(allowed: task, params, weight, loss_weight)")
            weight, loss_weight = part.get("weight", 1.0), part.get("loss_weight", 1.0)
            for name, value in (("weight", weight), ("loss_weight", loss_weight)):
                if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                    raise ConfigError(f"{where}.{name}={value!r} is invalid: must be a positive "
                                      "number")
            if part["task"] == self.name:
                raise ConfigError(f"{where}.task='mixture' is invalid: mixtures do not nest")
            task = make_task(part["task"], dict(part.get("params") or {}), prefix=f"{where}.params")
            built.append((task, float(weight), float(loss_weight)))
        # every part builds its ids with the mixture's tokenizer and frame, however the mixture got them
        # (``with_tokenizer`` or ``dataclasses.replace``); a byte-level part refuses another tokenizer
        chat = self.chat is not None
        built = [(task if task.tokenizer == self.tokenizer and (task.chat is not None) == chat
                  else task.with_tokenizer(self.tokenizer, chat=chat), w, lw) for task, w, lw in built]
        built = [(dataclasses.replace(task, bos_first=self.bos_first), w, lw) for task, w, lw in built]
        object.__setattr__(self, "parts", tuple(built))

    @property
    def packed(self) -> bool:
        return any(task.packed for task, _, _ in self.parts)

    @property
    def weights(self) -> np.ndarray:
        w = np.asarray([weight for _, weight, _ in self.parts])
        return w / w.sum()

    def examples(self, seed: int, index: int, count: int, seq_len: int, split: str = "train") -> list[Example]:
        rng = np.random.default_rng([seed, split_id(split), index, len(self.parts)])
        choice = rng.choice(len(self.parts), size=count, p=self.weights)
        drawn = {}
        for i in np.unique(choice):  # each chosen part yields `count` examples for this index, with its own seed
            task, _, loss_weight = self.parts[i]
            drawn[i] = [dataclasses.replace(ex, weight=loss_weight)
                        for ex in task.examples(seed + 7919 * (i + 1), index, count, seq_len, split)]
        return [drawn[c][j] for j, c in enumerate(choice)]

    def example(self, rng: np.random.Generator, seq_len: int) -> Example:
        task = self.parts[int(rng.choice(len(self.parts), p=self.weights))][0]
        return task.example(rng, seq_len)

    def score(self, example: Example, output: str) -> float:
        raise ConfigError("task 'mixture' is for training; evaluate each part's task on its own")


__all__ = ["Mixture"]
