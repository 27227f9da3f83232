"""What the RULER-style tasks share: the suite, RULER's metric, the offline word lists, parameter checks, the
prompt before tokenization and ``RulerTask`` (examples built from pieces, the largest that fits)."""

from __future__ import annotations

import dataclasses
import functools
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from lcx.config_base import ConfigError
from lcx.data.haystack import Frame, Piece, piece_ids, pieces_length, prose_text
from lcx.data.task import Example, Task

RULER_SUITE = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
               "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe")


def macro_average(scores: Mapping[str, float]) -> float:
    """RULER's average: the unweighted mean of the scores of the ``RULER_SUITE`` tasks (other names are ignored;
    a missing task is an error, since leaving it out would shift the average)."""
    missing = [name for name in RULER_SUITE if name not in scores]
    if missing:
        raise ValueError(f"macro_average needs a score for every task of RULER_SUITE; missing: {missing}")
    return float(np.mean([float(scores[name]) for name in RULER_SUITE]))


def string_match_all(output: str, references: Sequence[str]) -> float:
    """RULER's metric for its synthetic tasks: the share of ``references`` found in ``output``, ignoring case."""
    text = output.lower()
    return sum(ref.lower() in text for ref in references) / len(references)


# --------------------------------------------------------------------------------------------------- words
_WORD = re.compile(r"\b(?:[a-z]{3,10}|[A-Z][a-z]{2,9})\b")  # plain and capitalized words, not ABCMeta or 0xff


@functools.lru_cache(maxsize=1)
def words() -> tuple[str, ...]:
    """The offline word list (RULER: wonderwords' nouns, adjectives and verbs): the words of the Python reference
    manual, 3-10 letters, lower-cased, with a vowel (not ``xxx``), deduplicated and sorted."""
    found = {w.lower() for w in _WORD.findall(prose_text())}
    return tuple(sorted(w for w in found if re.search("[aeiouy]", w)))


def _pair(rng: np.random.Generator) -> str:
    """A random "word-word" key, the counterpart of RULER's adjective-noun keys (millions of them)."""
    vocab = words()
    a, b = rng.integers(len(vocab), size=2)
    return f"{vocab[a]}-{vocab[b]}"


def _random_item(rng: np.random.Generator, kind: str) -> str:
    """A key or value of RULER's ``numbers`` (7 digits), ``words`` or ``uuids`` type, drawn from ``rng``."""
    if kind == "numbers":
        return str(int(rng.integers(10 ** 6, 10 ** 7)))
    if kind == "uuids":  # from the task's rng, so that a seed gives the same uuids (never uuid4)
        return str(uuid.UUID(int=int.from_bytes(rng.bytes(16), "big"), version=4))
    return _pair(rng)


def _distinct(rng: np.random.Generator, kind: str, count: int, exclude: set[str] = frozenset()) -> list[str]:
    out: list[str] = []
    while len(out) < count:
        item = _random_item(rng, kind)
        if item not in exclude and item not in out:
            out.append(item)
    return out


# --------------------------------------------------------------------------------------------------- shared
def _frame(task: Task) -> Frame:
    """The task's ``Frame`` (``Task.frame``: plain, or the chat template of ``with_tokenizer(..., chat=True)``);
    a plain one in the task's tokenizer where a ``Task`` has no frame."""
    return getattr(task, "frame", None) or Frame(task.tokenizer)


def _check_int(value: Any, key: str, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{key}={value!r} is invalid: must be an integer >= {minimum}")


def _check_choice(value: Any, key: str, allowed: Sequence[str], hint: str = "") -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is invalid: must be one of {list(allowed)}{hint}")


@dataclasses.dataclass(frozen=True)
class _Prompt:
    """An example before tokenization: the context pieces (the user's message before the question), the question,
    the answer prefix, the answer text (after a space) and the references it is graded against."""

    context: list[Piece]
    question: str
    prefix: str
    answer: str
    references: tuple[str, ...]


def _largest_fitting(length: Callable[[int], int], lo: int, limit: int) -> int:
    """The largest ``n >= lo`` with ``length(n) <= limit``, given ``length(lo) <= limit`` - RULER's binary search
    over the haystack size, in fewer probes: the length is about linear in ``n``, so secant steps land next to the
    answer, steps that double from there bracket it, and bisection ends where ``n`` fits and ``n + 1`` does not
    (about ten probes at 128k tokens instead of thirty)."""
    memo: dict[int, int] = {}

    def size(n: int) -> int:
        if n not in memo:
            memo[n] = length(n)
        return memo[n]

    a, b = lo, lo + 16
    for _ in range(3):  # secant steps
        slope = (size(b) - size(a)) / (b - a)
        if slope <= 0:  # not growing here (too few items to tell): climb or descend from b instead
            break
        c = max(b + int((limit - size(b)) / slope), lo + 1)
        if c == b:
            break
        a, b = b, c
    step = 1
    if size(b) <= limit:  # climb from b until a length overflows
        good = b
        while size(good + step) <= limit:
            good, step = good + step, step * 2
        bad = good + step
    else:  # descend from b until a length fits
        bad = b
        while bad - step > lo and size(bad - step) > limit:
            bad, step = bad - step, step * 2
        good = max(bad - step, lo)
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if size(mid) <= limit else (good, mid)
    return good


@dataclasses.dataclass(frozen=True)
class RulerTask(Task):
    """Base of the RULER tasks: any tokenizer, RULER's ``string_match_all`` grading, examples built from pieces."""

    accepts_tokenizer: ClassVar[bool] = True
    # RULER's tokens_to_generate: the generation budget its evaluation gives the task.
    max_new_tokens: ClassVar[int] = 128

    def score(self, example: Example, output: str) -> float:
        """RULER's ``string_match_all``: the share of the references in ``output``, case-insensitive."""
        if not example.references:
            raise ValueError(f"task {self.name!r} has no references to grade a generation against")
        return string_match_all(output, example.references)

    def _length(self, prompt: _Prompt) -> int:
        """Tokens of the example ``prompt`` becomes (framed prompt, answer, EOS)."""
        frame, tok = _frame(self), self.tokenizer
        pieces = frame.wrap(prompt.context, prompt.question, prompt.prefix)
        eos = 1 if tok.eos_id is not None else 0
        return pieces_length(tok, pieces) + len(piece_ids(tok, " " + prompt.answer)) + eos

    def _build(self, prompt: _Prompt) -> Example:
        """The example, with ``context_len`` marking where the question starts."""
        return _frame(self).example(prompt.context, prompt.question, prompt.prefix, [(" " + prompt.answer, True)],
                                    prompt.answer, prompt.references, eos=True)

    def _too_short(self, seq_len: int, needed: int) -> ConfigError:
        return ConfigError(f"seq_len={seq_len} is too short for {self.task_key}={self.name!r}: its smallest example "
                           f"takes {needed} tokens (prompt, answer and EOS), more than seq_len + 1; raise seq_len or "
                           "shrink the task's parameters")

    def _fit(self, make: Callable[[int], _Prompt], lo: int, seq_len: int) -> Example:
        """The example of ``make(n)`` for the largest ``n >= lo`` that fits ``seq_len + 1`` (``make`` must be a
        pure function of ``n``: all randomness is drawn before the search)."""
        smallest = self._length(make(lo))
        if smallest > seq_len + 1:
            raise self._too_short(seq_len, smallest)
        n = _largest_fitting(lambda m: self._length(make(m)), lo, seq_len + 1)
        return self._build(make(n))
