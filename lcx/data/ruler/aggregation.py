"""RULER's aggregation tasks: common words extraction (``cwe``) and frequent words extraction (``fwe``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import ClassVar

import numpy as np

from lcx.config_base import ConfigError
from lcx.data.ruler.base import RulerTask, _check_int, _Prompt, words
from lcx.data.task import Example, register


# --------------------------------------------------------------------------------------------------- cwe
CWE_INSTRUCTION = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize "
                   "the ones that appear most often.")
CWE_QUESTION = "Question: What are the {num_cw} most common words in the above list?"
CWE_PREFIX = "Answer: The top {num_cw} words that appear most often in the list are:"
# RULER's one-shot examples: (distinct words, repeats of the common ones, repeats of the others), below / from 4096.
_CWE_SHOT_SHORT = (20, 3, 1)
_CWE_SHOT_LONG = (40, 10, 3)


def _numbered(items: Sequence[str]) -> str:
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(items))


def _extra_words(seed: int, count: int, exclude: set[str]) -> list[str]:
    """``count`` distinct "word-word" pairs from a generator seeded with ``seed``: for lists longer than the word
    list. The draws run in fixed batches, so asking for more gives the same pairs first (the search relies on it)."""
    gen, vocab = np.random.default_rng(seed), words()
    out: dict[str, None] = {}
    while len(out) < count:
        for a, b in gen.integers(len(vocab), size=(1024, 2)):
            if vocab[a] not in exclude and vocab[b] not in exclude:
                out.setdefault(f"{vocab[a]}-{vocab[b]}")
    return list(out)[:count]


@register
@dataclasses.dataclass(frozen=True)
class CommonWordsExtraction(RulerTask):
    """RULER's common words extraction (``common_words_extraction.py``): a numbered list "1. w 2. w ..." in which
    ``num_cw`` words occur ``freq_cw`` times and every other word ``freq_ucw`` times, shuffled; below ``short_below``
    tokens of seq_len RULER's short setting (``short_freq_cw`` / ``short_freq_ucw``). ``num_fewshot`` solved
    examples come first (RULER's: 20 words 3 / 1 times when short, else 40 words 10 / 3 times). The list has as
    many words as fit. Answer: the common words, numbered as in the example ("1. w 2. w ...")."""

    name: ClassVar[str] = "cwe"
    max_new_tokens: ClassVar[int] = 120
    freq_cw: int = 30
    freq_ucw: int = 3
    num_cw: int = 10
    short_freq_cw: int = 6
    short_freq_ucw: int = 1
    short_below: int = 4096
    num_fewshot: int = 1

    def __post_init__(self):
        for field in ("freq_ucw", "short_freq_ucw", "num_cw"):
            _check_int(getattr(self, field), self.key(field), 1)
        for field, low in (("freq_cw", "freq_ucw"), ("short_freq_cw", "short_freq_ucw")):
            _check_int(getattr(self, field), self.key(field), getattr(self, low) + 1)  # common must be more frequent
        _check_int(self.short_below, self.key("short_below"), 0)
        _check_int(self.num_fewshot, self.key("num_fewshot"), 0)
        if self.num_cw > len(words()) // 2:
            raise ConfigError(f"{self.key('num_cw')}={self.num_cw} is invalid: at most {len(words()) // 2} "
                              f"common words (the offline word list has {len(words())} words)")

    def example(self, rng: np.random.Generator, seq_len: int) -> Example:
        short = seq_len < self.short_below
        common_freq, rare_freq = (self.short_freq_cw, self.short_freq_ucw) if short else (self.freq_cw,
                                                                                           self.freq_ucw)
        shot_shape = _CWE_SHOT_SHORT if short else _CWE_SHOT_LONG
        shots = [self._shot(rng, *shot_shape) for _ in range(self.num_fewshot)]
        head = ["\n".join(shots) + "\n"] if shots else []
        vocab = words()
        order = rng.permutation(len(vocab))
        common = [vocab[i] for i in order[:self.num_cw]]
        extra_seed, shuffle_seed = (int(s) for s in rng.integers(2 ** 63, size=2))

        def make(rare: int) -> _Prompt:
            listed = [vocab[i] for i in order[self.num_cw:self.num_cw + rare]]
            listed += _extra_words(extra_seed, rare - len(listed), set(common)) if rare > len(listed) else []
            items = common * common_freq + listed * rare_freq
            items = [items[i] for i in np.random.default_rng(shuffle_seed).permutation(len(items))]
            context = [*head, CWE_INSTRUCTION + "\n", _numbered(items) + "\n"]
            question, prefix = (t.format(num_cw=self.num_cw) for t in (CWE_QUESTION, CWE_PREFIX))
            return _Prompt(context, question, prefix, _numbered(common), tuple(common))

        return self._fit(make, 0, seq_len)

    def _shot(self, rng: np.random.Generator, count: int, common_freq: int, rare_freq: int) -> str:
        """A solved example: RULER's template and answer prefix followed by the numbered answer."""
        vocab = words()
        chosen = [vocab[i] for i in rng.choice(len(vocab), size=max(count, self.num_cw + 1), replace=False)]
        common, rare = chosen[:self.num_cw], chosen[self.num_cw:]
        items = common * common_freq + rare * rare_freq
        items = [items[i] for i in rng.permutation(len(items))]
        question, prefix = (t.format(num_cw=self.num_cw) for t in (CWE_QUESTION, CWE_PREFIX))
        return f"{CWE_INSTRUCTION}\n{_numbered(items)}\n{question} {prefix} {_numbered(common)}"


# --------------------------------------------------------------------------------------------------- fwe
FWE_INSTRUCTION = ("Read the following coded text and track the frequency of each coded word. Find the three most "
                   "frequently appeared coded words.")
FWE_QUESTION = ("Question: Do not provide any explanation. Please ignore the dots '....'. What are the three most "
                "frequently appeared words in the above coded text?")
FWE_PREFIX = "Answer: According to the coded text above, the three most frequently appeared words are:"
_FWE_ANSWERS = 3


def zeta(s: float, terms: int = 64) -> float:
    """The Riemann zeta function for ``s > 1`` (RULER uses scipy's): ``terms`` terms summed, the rest by the
    Euler-Maclaurin formula (error about ``s**3 * terms**-(s + 3) / 720``: 3e-11 at s = 2)."""
    k = np.arange(1, terms, dtype=np.float64)
    n = float(terms)
    return float(np.sum(k ** -s) + n ** (1 - s) / (s - 1) + n ** -s / 2 + s * n ** (-s - 1) / 12)


def _coded_words(rng: np.random.Generator, count: int, length: int) -> list[str]:
    """``count`` distinct words of ``length`` random lower-case letters, in random order."""
    out: dict[str, None] = {}
    while len(out) < count:
        for row in rng.integers(26, size=(count, length)):
            out.setdefault("".join(chr(97 + c) for c in row))
    return list(out)[:count]


@register
@dataclasses.dataclass(frozen=True)
class FrequentWordsExtraction(RulerTask):
    """RULER's frequent words extraction (``freq_words_extraction.py``): a text of coded words (``coded_wordlen``
    random letters) from a vocabulary of ``vocab_size`` words (null: seq_len // 50, RULER's rule), the k-th most
    frequent occurring ``floor(n * k**-alpha / zeta(alpha))`` times, shuffled; the most frequent is "..." (noise).
    ``n`` is the largest that fits. Answer: the 3 most frequent coded words (ranks 2-4), joined by ", "."""

    name: ClassVar[str] = "fwe"
    max_new_tokens: ClassVar[int] = 50
    alpha: float = 2.0
    coded_wordlen: int = 6
    vocab_size: int | None = None

    def __post_init__(self):
        if not isinstance(self.alpha, (int, float)) or isinstance(self.alpha, bool) or not self.alpha > 1.0:
            raise ConfigError(f"{self.key('alpha')}={self.alpha!r} is invalid: must be a number > 1 (the zeta "
                              "distribution's exponent)")
        _check_int(self.coded_wordlen, self.key("coded_wordlen"), 3)
        if self.vocab_size is not None:
            _check_int(self.vocab_size, self.key("vocab_size"), _FWE_ANSWERS + 2)
            if self.vocab_size > 26 ** self.coded_wordlen // 2:
                raise ConfigError(f"{self.key('vocab_size')}={self.vocab_size} is invalid: too many for "
                                  f"coded_wordlen={self.coded_wordlen} letters")

    def example(self, rng: np.random.Generator, seq_len: int) -> Example:
        size = self.vocab_size if self.vocab_size is not None else seq_len // 50
        if size < _FWE_ANSWERS + 2:
            raise ConfigError(f"seq_len={seq_len} is too short for {self.task_key}='fwe': its vocabulary (seq_len "
                              f"// 50 = {size} words) needs at least {_FWE_ANSWERS + 2}; raise seq_len or set "
                              f"{self.key('vocab_size')}")
        vocab = np.asarray(["...", *_coded_words(rng, size - 1, self.coded_wordlen)])
        share = np.arange(1, size + 1, dtype=np.float64) ** -self.alpha / zeta(self.alpha)
        shuffle_seed = int(rng.integers(2 ** 63))
        answers = [str(w) for w in vocab[1:1 + _FWE_ANSWERS]]

        def make(n: int) -> _Prompt:
            counts = np.floor(n * share).astype(np.int64)
            items = np.repeat(vocab, counts)
            items = items[np.random.default_rng(shuffle_seed).permutation(len(items))]
            context = [FWE_INSTRUCTION, " " + " ".join(items) + "\n"]
            return _Prompt(context, FWE_QUESTION, FWE_PREFIX, ", ".join(answers), tuple(answers))

        return self._fit(make, self._smallest(share), seq_len)

    @staticmethod
    def _smallest(share: np.ndarray) -> int:
        """The smallest scale at which the answers outnumber every other coded word (rank 4 above rank 5)."""
        gap = share[_FWE_ANSWERS] - share[_FWE_ANSWERS + 1]
        n = np.arange(1, int(np.ceil(1 / gap)) + 2)
        ahead = np.floor(n * share[_FWE_ANSWERS]) > np.floor(n * share[_FWE_ANSWERS + 1])
        return int(n[np.argmax(ahead)])
