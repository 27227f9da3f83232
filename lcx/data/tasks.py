"""The built-in synthetic long-context tasks: passkey, RULER-style needle in a haystack, associative recall.

- ``passkey``: the landmark-attention passkey retrieval prompt; answer = the digits of the key.
- ``niah``: RULER-style needle in a haystack with several keys (distractors), values and queries.
- ``mqar``: multi-query associative recall; key:value pairs, then queries of keys whose values are the answers.
- ``corpus`` (``lcx.data.corpus``): windows of a folder of text files; every token is a target.

Templates: the passkey prompt of landmark attention (an instruction, a repetitive "noise" haystack, "The pass key is
K. Remember it. K is the pass key." at a chosen depth, then "What is the pass key? The pass key is"); RULER's
"One of the special magic numbers for {key} is: {value}." needles with distractor keys; MQAR's key:value pairs.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from lcx.config_base import ConfigError
from lcx.data.haystack import NOISE, haystack, nearest, pieces_length
from lcx.data.task import TOKENIZER, Example, Task, n_tokens, register, text_example



# --------------------------------------------------------------------------------------------------- helpers
def _positive(value: Any, key: str, *, zero: bool = False) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and (value >= 0 if zero else value > 0)
    if not ok:
        raise ConfigError(f"{key}={value!r} is invalid: must be a {'non-negative' if zero else 'positive'} integer")


def _fraction(value: float | None, key: str) -> None:
    if value is not None and not 0.0 <= value <= 1.0:
        raise ConfigError(f"{key}={value!r} is invalid: must be in [0, 1] (0 = start, 1 = end) or null (random)")


def noise(n: int, start: int = 0) -> str:
    """Exactly ``n`` bytes of the repeated noise haystack, beginning ``start`` bytes into it (mid-sentence)."""
    start %= len(NOISE)
    reps = (start + n) // len(NOISE) + 1
    return (NOISE * reps)[start:start + n]


def sentence_starts(text: str) -> np.ndarray:
    """Offsets where a sentence of the haystack begins, and its end: needles go there, never inside a word."""
    starts = [0] + [i + 2 for i in range(len(text) - 1) if text[i] == "." and text[i + 1] == " "]
    return np.unique(np.asarray([s for s in starts if s <= len(text)] + [len(text)]))


def nearest_start(text: str, depth: float) -> int:
    starts = sentence_starts(text)
    return int(starts[np.argmin(np.abs(starts - depth * len(text)))])


def filler_budget(seq_len: int, fixed: int, task: Task) -> int:
    """Filler bytes: ``task.filler_tokens`` or, when null, whatever fills ``seq_len + 1`` after the ``fixed``
    tokens."""
    room, filler_tokens = seq_len + 1 - fixed, task.filler_tokens
    if filler_tokens is None:
        if room < 0:
            raise ConfigError(f"seq_len={seq_len} is too short for {task.task_key}={task.name!r}: the template alone "
                              f"needs {fixed - 1} input tokens; raise seq_len or shrink the task parameters")
        return room
    if filler_tokens > room:
        raise ConfigError(f"{task.key('filler_tokens')}={filler_tokens} does not fit seq_len={seq_len} for "
                          f"{task.task_key}={task.name!r}: at most {max(room, 0)} filler tokens fit (the rest of the "
                          f"example takes {fixed} tokens)")
    return filler_tokens


# --------------------------------------------------------------------------------------------------- passkey
PASSKEY_INSTRUCTION = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize "
                       "them. I will quiz you about the important information there.")
PASSKEY_QUESTION = "What is the pass key? The pass key is"
# template -> (needle with {key}, question, answer prefix). "landmark" is landmark attention's; "compact" keeps the
# same words in a third of the tokens, which leaves a byte-level model trained at 128 tokens room for haystacks of
# useful length. Plain prompts end with the question and the prefix joined by a space (landmark: PASSKEY_QUESTION).
PASSKEY_TEMPLATES = {
    "landmark": ("The pass key is {key}. Remember it. {key} is the pass key.", "What is the pass key?",
                 "The pass key is"),
    "compact": ("The pass key is {key}.", "", "The pass key is"),
}


def _ask(question: str, prefix: str) -> str:
    return question + (" " + prefix if question and prefix else prefix)


def _is_bytes(task: Task) -> bool:
    """Byte-level examples keep their original construction (lengths in bytes), so byte-level results are unchanged;
    any other tokenizer goes through ``lcx.data.haystack`` (lengths in that tokenizer's tokens)."""
    return task.tokenizer.spec == TOKENIZER.spec and task.chat is None


@register
@dataclasses.dataclass(frozen=True)
class Passkey(Task):
    """Passkey retrieval (landmark attention): the key K hides at ``depth`` of the filler; the answer is K's digits.

    ``filler_tokens``: haystack length (null: fill to ``seq_len``); ``filler_min``: if set, each example's
    haystack length is uniform in ``[filler_min, filler_tokens]`` instead (short examples are padded), which mixes
    easy examples into training; ``depth`` in [0, 1] or null (uniform per example), snapped to the nearest sentence
    start; K uniform in ``[key_min, key_max]``; ``instruction=false`` drops the opening instruction (about 150
    tokens) for short training sequences; ``offset=true`` starts the haystack at a random point of the noise text
    (mid-sentence), as a context does that a window or an eviction policy cut out of a longer document;
    ``template``: ``landmark`` (the published needle and question) or ``compact`` (see ``PASSKEY_TEMPLATES``).
    """

    name: ClassVar[str] = "passkey"
    filler_tokens: int | None = None
    filler_min: int | None = None
    depth: float | None = None
    key_min: int = 1
    key_max: int = 50000
    instruction: bool = True
    offset: bool = False
    template: str = "landmark"

    def __post_init__(self):
        if self.filler_tokens is not None:
            _positive(self.filler_tokens, self.key("filler_tokens"), zero=True)
        if self.filler_min is not None:
            _positive(self.filler_min, self.key("filler_min"), zero=True)
            if self.filler_tokens is not None and self.filler_min > self.filler_tokens:
                raise ConfigError(f"{self.key('filler_min')}={self.filler_min} is invalid: must be <= "
                                  f"{self.key('filler_tokens')}={self.filler_tokens}")
        _fraction(self.depth, self.key("depth"))
        if self.template not in PASSKEY_TEMPLATES:
            raise ConfigError(f"{self.key('template')}={self.template!r} is invalid: must be one of "
                              f"{list(PASSKEY_TEMPLATES)}")
        entry = PASSKEY_TEMPLATES[self.template]
        if not (isinstance(entry, tuple) and len(entry) == 3):  # entries were (needle, question) pairs before
            raise ConfigError(f"PASSKEY_TEMPLATES[{self.template!r}]={entry!r} is invalid: each entry is now (needle "
                              "with {key}, question, answer prefix), e.g. ('The pass key is {key}.', 'What is the pass "
                              "key?', 'The pass key is')")
        _positive(self.key_min, self.key("key_min"), zero=True)
        if not isinstance(self.key_max, int) or self.key_max < self.key_min:
            raise ConfigError(f"{self.key('key_max')}={self.key_max!r} is invalid: must be an integer >= "
                              f"{self.key('key_min')}={self.key_min}")

    def example(self, rng: np.random.Generator, seq_len: int) -> Example:
        key = str(int(rng.integers(self.key_min, self.key_max + 1)))
        depth = float(rng.uniform()) if self.depth is None else self.depth
        template, question, prefix = PASSKEY_TEMPLATES[self.template]
        needle = template.format(key=key)
        if not _is_bytes(self):
            return self._token_example(rng, seq_len, key, depth, needle, question, prefix)
        question = _ask(question, prefix)
        head = [PASSKEY_INSTRUCTION] if self.instruction else []
        answer = " " + key
        # BOS + head + "\n".join(prefix, needle, suffix, question) + answer + EOS, with the filler split in two
        fixed = 1 + sum(n_tokens(h) + 1 for h in head) + n_tokens(needle) + n_tokens(question) + 3
        fixed += n_tokens(answer) + 1
        n_filler = self._filler_length(rng, seq_len, fixed)
        filler = noise(n_filler, int(rng.integers(len(NOISE))) if self.offset else 0)
        cut = nearest_start(filler, depth)
        prompt = "\n".join([*head, filler[:cut], needle, filler[cut:], question])
        return text_example(prompt, [(answer, True)], key, (key,), eos=True)

    def _filler_length(self, rng: np.random.Generator, seq_len: int, fixed: int) -> int:
        """Haystack length (bytes or tokens) after ``fixed`` others: ``filler_tokens``, all that fits, or a draw from
        ``[filler_min, that]``."""
        n_filler = filler_budget(seq_len, fixed, self)
        if self.filler_min is not None:
            if self.filler_min > n_filler:
                raise ConfigError(f"{self.key('filler_min')}={self.filler_min} does not fit seq_len={seq_len}: at "
                                  f"most {n_filler} filler tokens fit")
            n_filler = int(rng.integers(self.filler_min, n_filler + 1))
        return n_filler

    def _token_example(self, rng, seq_len, key, depth, needle, question, prefix) -> Example:
        """The same prompt in the run tokenizer's tokens: the noise filler takes exactly the tokens left over."""
        tok, frame = self.tokenizer, self.frame
        head = [PASSKEY_INSTRUCTION + "\n"] if self.instruction else []
        needle_piece, answer = "\n" + needle + "\n", " " + key
        fixed = (frame.overhead(question, prefix) + pieces_length(tok, [*head, needle_piece, "\n", answer])
                 + (tok.eos_id is not None))
        n_filler = self._filler_length(rng, seq_len, fixed)
        hay = haystack(tok, "noise")
        filler, starts = hay.take(n_filler, int(rng.integers(len(hay.ids))) if self.offset else 0)
        cut = nearest(starts, depth * n_filler)
        context = [*head, filler[:cut], needle_piece, filler[cut:], "\n"]
        return frame.example(context, question, prefix, [(answer, True)], key, (key,), eos=True)

    def score(self, example: Example, output: str) -> float:
        """1 if the first integer in ``output`` is the key (landmark attention's grading), else 0."""
        found = re.search(r"\d+", output)
        return float(found is not None and found.group(0) == example.answer)


# --------------------------------------------------------------------------------------------------- niah
NIAH_INSTRUCTION = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
                    "I will quiz you about the numbers afterwards.")
_ADJECTIVES = ("amber", "bold", "calm", "dusty", "eager", "fancy", "gentle", "hollow", "icy", "jolly", "keen",
               "lucky", "misty", "noble", "odd", "proud", "quiet", "rapid", "silent", "tiny", "upbeat", "vivid",
               "wise", "young")
_NOUNS = ("apple", "bridge", "castle", "desert", "engine", "forest", "garden", "harbor", "island", "jungle",
          "kettle", "lantern", "meadow", "needle", "orchard", "pencil", "quarry", "river", "saddle", "tower",
          "valley", "window", "yard", "zephyr")


def _join_keys(keys: Sequence[str]) -> str:
    if len(keys) <= 2:
        return " and ".join(keys)
    return ", ".join(keys[:-1]) + ", and " + keys[-1]


@register
@dataclasses.dataclass(frozen=True)
class NeedleInHaystack(Task):
    """RULER-style NIAH: ``num_keys`` keys (those not queried are distractors), each with ``num_values`` needles
    "One of the special magic numbers for {key} is: {value}." at random sentence starts of the noise haystack;
    ``num_queries`` keys are asked. Answer: the queried keys' values in document order, joined by ", ".
    """

    name: ClassVar[str] = "niah"
    num_keys: int = 4
    num_values: int = 1
    num_queries: int = 1
    value_digits: int = 7
    filler_tokens: int | None = None
    instruction: bool = True

    def __post_init__(self):
        for field in ("num_keys", "num_values", "num_queries", "value_digits"):
            _positive(getattr(self, field), self.key(field))
        if self.filler_tokens is not None:
            _positive(self.filler_tokens, self.key("filler_tokens"), zero=True)
        if self.num_queries > self.num_keys:
            raise ConfigError(f"{self.key('num_queries')}={self.num_queries} is invalid: must be <= "
                              f"{self.key('num_keys')}={self.num_keys} (queried keys are among the inserted keys)")
        if self.num_keys > len(_ADJECTIVES) * len(_NOUNS):
            raise ConfigError(f"{self.key('num_keys')}={self.num_keys} is invalid: at most "
                              f"{len(_ADJECTIVES) * len(_NOUNS)} distinct keys exist")

    def example(self, rng: np.random.Generator, seq_len: int) -> Example:
        combos = rng.choice(len(_ADJECTIVES) * len(_NOUNS), size=self.num_keys, replace=False)
        keys = [f"{_ADJECTIVES[c // len(_NOUNS)]}-{_NOUNS[c % len(_NOUNS)]}" for c in combos]
        lo, hi = 10 ** (self.value_digits - 1), 10 ** self.value_digits
        values = rng.choice(hi - lo, size=self.num_keys * self.num_values, replace=False) + lo
        needles = [(keys[i // self.num_values], str(v)) for i, v in enumerate(values)]
        order = rng.permutation(len(needles))
        needles = [needles[i] for i in order]  # document order
        queries = [keys[i] for i in sorted(rng.choice(self.num_keys, size=self.num_queries, replace=False))]
        texts = [f"One of the special magic numbers for {k} is: {v}. " for k, v in needles]
        question = (f"What are all the special magic numbers for {_join_keys(queries)} mentioned in the provided "
                    "text?")
        prefix = f"The special magic numbers for {_join_keys(queries)} mentioned in the provided text are"
        refs = [v for k, v in needles if k in queries]
        answer = ", ".join(refs)
        if not _is_bytes(self):
            return self._token_example(rng, seq_len, needles, question, prefix, answer, refs)
        question = _ask(question, prefix)
        head = [NIAH_INSTRUCTION] if self.instruction else []
        fixed = 1 + sum(n_tokens(h) + 1 for h in head) + sum(map(n_tokens, texts)) + 1 + n_tokens(question)
        fixed += n_tokens(" " + answer) + 1
        haystack = noise(filler_budget(seq_len, fixed, self))
        starts = sentence_starts(haystack)
        cuts = np.sort(rng.choice(starts, size=len(texts), replace=True))
        pieces, last = [], 0
        for cut, text in zip(cuts, texts):
            pieces += [haystack[last:cut], text]
            last = int(cut)
        pieces.append(haystack[last:])
        prompt = "\n".join([*head, "".join(pieces), question])
        return text_example(prompt, [(" " + answer, True)], answer, refs, eos=True)


    def _token_example(self, rng, seq_len, needles, question, prefix, answer, refs) -> Example:
        """The same prompt in the run tokenizer's tokens; needles (with a leading space, as text after a sentence has
        it) at random sentence starts of the noise filler, which takes exactly the tokens left over."""
        tok, frame = self.tokenizer, self.frame
        head = [NIAH_INSTRUCTION + "\n"] if self.instruction else []
        texts = [f" One of the special magic numbers for {k} is: {v}." for k, v in needles]
        fixed = (frame.overhead(question, prefix) + pieces_length(tok, [*head, *texts, "\n", " " + answer])
                 + (tok.eos_id is not None))
        filler, starts = haystack(tok, "noise").take(filler_budget(seq_len, fixed, self))
        cuts = np.sort(rng.choice(starts, size=len(texts), replace=True))
        pieces, last = [], 0
        for cut, text in zip(cuts, texts):
            pieces += [filler[last:cut], text]
            last = int(cut)
        context = [*head, *pieces, filler[last:], "\n"]
        return frame.example(context, question, prefix, [(" " + answer, True)], answer, refs, eos=True)


# --------------------------------------------------------------------------------------------------- mqar
_LETTERS = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", np.uint8)
_DIGITS = np.frombuffer(b"0123456789", np.uint8)


@register
@dataclasses.dataclass(frozen=True)
class AssociativeRecall(Task):
    """Multi-query associative recall: ``"ab:17 cd:42 ...\\n"`` (``num_pairs`` distinct keys of ``key_len``
    letters, values of ``value_len`` digits), ``filler_tokens`` of noise, then ``num_queries`` queries
    ``"cd:42 ab:17"`` whose values are the answer tokens (no EOS). ``answer`` = the values in query order joined by
    spaces; the prompt for a generation is everything before the first queried value.
    """

    name: ClassVar[str] = "mqar"
    num_pairs: int = 8
    num_queries: int = 4
    key_len: int = 2
    value_len: int = 2
    filler_tokens: int = 0

    def __post_init__(self):
        for field in ("num_pairs", "num_queries", "key_len", "value_len"):
            _positive(getattr(self, field), self.key(field))
        _positive(self.filler_tokens, self.key("filler_tokens"), zero=True)
        if self.num_queries > self.num_pairs:
            raise ConfigError(f"{self.key('num_queries')}={self.num_queries} is invalid: must be <= "
                              f"{self.key('num_pairs')}={self.num_pairs} (each query asks a distinct key)")
        if self.num_pairs > 26 ** self.key_len:
            raise ConfigError(f"{self.key('num_pairs')}={self.num_pairs} is invalid: key_len={self.key_len} gives "
                              f"only {26 ** self.key_len} distinct keys")

    def example(self, rng: np.random.Generator, seq_len: int) -> Example:
        ids = rng.choice(26 ** self.key_len, size=self.num_pairs, replace=False)
        keys = ["".join(chr(_LETTERS[(i // 26 ** j) % 26]) for j in range(self.key_len)) for i in ids]
        values = [bytes(rng.choice(_DIGITS, size=self.value_len)).decode() for _ in keys]
        asked = rng.choice(self.num_pairs, size=self.num_queries, replace=False)
        context = " ".join(f"{k}:{v}" for k, v in zip(keys, values)) + "\n"
        if self.filler_tokens:
            context += noise(self.filler_tokens) + "\n"
        parts: list[tuple[str, bool]] = []
        for n, i in enumerate(asked):
            if n:
                parts.append((" ", False))
            parts += [(f"{keys[i]}:", False), (values[i], True)]
        answer, refs = " ".join(values[i] for i in asked), [values[i] for i in asked]
        if _is_bytes(self):
            example = text_example(context + parts[0][0], parts[1:], answer, refs, eos=False)
        else:  # the pairs, the filler in the run tokenizer's tokens, then the first query as the answer prefix
            tok = self.tokenizer
            pairs = " ".join(f"{k}:{v}" for k, v in zip(keys, values)) + "\n"
            filler = [haystack(tok, "noise").take(self.filler_tokens)[0], "\n"] if self.filler_tokens else []
            example = self.frame.example([pairs, *filler], "", parts[0][0], parts[1:], answer, refs, eos=False)
        if len(example.ids) > seq_len + 1:
            raise ConfigError(f"{self.task_key}='mqar' needs {len(example.ids) - 1} input tokens with num_pairs="
                              f"{self.num_pairs}, num_queries={self.num_queries}, filler_tokens={self.filler_tokens}; "
                              f"seq_len={seq_len} is too short")
        return example

    def score(self, example: Example, output: str) -> float:
        """A generation from ``prompt_ids`` answers the first query only: 1 if ``output`` starts with its value.
        (All queries are graded teacher-forced: the training metric ``accuracy`` over answer tokens.)"""
        return float(output.startswith(example.references[0]))


__all__ = ["NOISE", "PASSKEY_INSTRUCTION", "PASSKEY_QUESTION", "PASSKEY_TEMPLATES", "AssociativeRecall",
           "NeedleInHaystack", "Passkey"]
