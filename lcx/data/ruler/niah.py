"""RULER's retrieval tasks: needle in a haystack (``niah.py`` in RULER), eight registered variants."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import ClassVar

import numpy as np

from lcx.config_base import ConfigError
from lcx.data.haystack import Piece, haystack, nearest, piece_ids
from lcx.data.ruler.base import RulerTask, _check_choice, _check_int, _distinct, _Prompt, _random_item
from lcx.data.task import Example, register, split_id


# --------------------------------------------------------------------------------------------------- niah
NIAH_HAYSTACKS = ("noise", "prose", "needle")
NIAH_TYPES = ("words", "numbers", "uuids")
NIAH_NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NIAH_INSTRUCTION = ("Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize "
                    "it. I will quiz you about the {type_needle_v} afterwards.")
NIAH_QUESTION = "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?"
NIAH_PREFIX = "The special magic {type_needle_v} for {query} mentioned in the provided text are"
# RULER's needle depths in the essay haystack: 40 evenly spaced percentages, drawn without replacement.
_DEPTHS = np.round(np.linspace(0, 100, num=40, endpoint=True)).astype(int)


def _join_queries(keys: Sequence[str]) -> str:
    """RULER's list of queried keys: "a", "a, and b", "a, b, and c"."""
    return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + ", and " + keys[-1]


def niah_texts(type_needle_v: str, query: str, singular: bool) -> tuple[str, str, str]:
    """RULER's instruction, question and answer prefix; for a single answer RULER's rewrite to the singular
    ("Some ... are" -> "A ... is", "numbers" -> "number"), applied to the template before the keys go in."""
    texts = (NIAH_INSTRUCTION, NIAH_QUESTION, NIAH_PREFIX)
    if singular:
        texts = tuple(t.replace("Some", "A").replace("are all", "is").replace("are", "is") for t in texts)
        type_needle_v = type_needle_v[:-1]
    return tuple(t.format(type_needle_v=type_needle_v, query=query) for t in texts)


def _before_space(tokenizer, ids: np.ndarray, cut: int) -> int:
    """``cut`` moved back over a token that is only the space between two sentences (lcx's bytes, or a BPE that has
    no " Word" token for the next word), so that the space always follows the cut and a needle goes in as
    " One ... ." whatever the tokenizer. Two tokens are decoded because a sentencepiece decoder drops the leading
    space of the first."""
    if cut < 2:
        return cut
    pair, first = tokenizer.decode(ids[cut - 2:cut]), tokenizer.decode(ids[cut - 2:cut - 1])
    last = pair[len(first):]
    return cut - 1 if last and last.isspace() else cut


def _place(rng: np.random.Generator, candidates: np.ndarray, n: int, count: int, depth: float | None,
           spread: str) -> list[int]:
    """Sorted insertion points for ``count`` needles among ``candidates`` (in ``[0, n]``): all at ``depth`` when set,
    else RULER's - one of 40 evenly spaced depths each (``depths``, the essay haystack) or uniform (``uniform``)."""
    if depth is not None:
        return [nearest(candidates, depth * n)] * count
    if spread == "depths":
        drawn = rng.choice(_DEPTHS, size=count, replace=count > len(_DEPTHS)) / 100
        return sorted(nearest(candidates, d * n) for d in drawn)
    return sorted(int(c) for c in rng.choice(candidates, size=count, replace=count > len(candidates)))


@dataclasses.dataclass(frozen=True)
class Niah(RulerTask):
    """RULER's needle in a haystack (``niah.py``). ``type_haystack``: ``noise`` (the repeated "The grass is green."
    text), ``prose`` (RULER's ``essay``: here the Python reference manual) or ``needle`` (distractor needles);
    ``type_needle_k`` / ``type_needle_v``: ``words`` ("word-word"), ``numbers`` (7 digits) or ``uuids``;
    ``num_needle_k`` keys with ``num_needle_v`` values each, ``num_needle_q`` of them asked (RULER raises the key
    count to the query count); ``depth`` in [0, 1] puts every needle at that depth (null: RULER's placement);
    ``questions_per_haystack``: examples come in runs of this many that share one haystack, each asking its own
    keys (the haystack then holds enough of them); an evaluation prefills a shared haystack once
    (``lcx.eval.evaluate``). Answer: the asked keys' values, joined by ", "."""

    max_new_tokens: ClassVar[int] = 128
    type_haystack: str = "prose"
    type_needle_k: str = "words"
    type_needle_v: str = "numbers"
    num_needle_k: int = 1
    num_needle_v: int = 1
    num_needle_q: int = 1
    depth: float | None = None
    questions_per_haystack: int = 1

    def __post_init__(self):
        _check_choice(self.type_haystack, self.key("type_haystack"), NIAH_HAYSTACKS,
                      " (RULER's 'essay' is 'prose' here)")
        _check_choice(self.type_needle_k, self.key("type_needle_k"), NIAH_TYPES)
        _check_choice(self.type_needle_v, self.key("type_needle_v"), NIAH_TYPES)
        for field in ("num_needle_k", "num_needle_v", "num_needle_q", "questions_per_haystack"):
            _check_int(getattr(self, field), self.key(field), 1)
        if self.depth is not None and not 0.0 <= self.depth <= 1.0:
            raise ConfigError(f"{self.key('depth')}={self.depth!r} is invalid: must be in [0, 1] (0 = start, 1 = end) "
                              "or null (RULER's placement)")

    def examples(self, seed: int, index: int, count: int, seq_len: int, split: str = "train") -> list[Example]:
        """``count`` examples; with ``questions_per_haystack = q`` they come in runs of q that share one context
        (instruction, haystack and needles: the same ``prompt_ids[:context_len]``) and ask q different keys."""
        if self.questions_per_haystack == 1:
            return super().examples(seed, index, count, seq_len, split)
        rng = np.random.default_rng([seed, split_id(split), index])
        out: list[Example] = []
        while len(out) < count:
            out += self._haystack(rng, seq_len, self.questions_per_haystack)
        return out[:count]

    def example(self, rng: np.random.Generator, seq_len: int) -> Example:
        return self._haystack(rng, seq_len, 1)[0]

    def _haystack(self, rng: np.random.Generator, seq_len: int, questions: int) -> list[Example]:
        """One haystack and ``questions`` examples asking about it, each asking ``num_needle_q`` keys no other asks
        (the haystack holds ``max(num_needle_k, num_needle_q x questions)`` keys). The haystack leaves room for the
        longest question and answer: that example has exactly ``seq_len + 1`` tokens, the others fewer."""
        asks_per = self.num_needle_q
        num_keys = max(self.num_needle_k, asks_per * questions)
        keys = _distinct(rng, self.type_needle_k, num_keys)
        values = _distinct(rng, self.type_needle_v, num_keys * self.num_needle_v)
        needles = [NIAH_NEEDLE.format(type_needle_v=self.type_needle_v, key=keys[i // self.num_needle_v], value=v)
                   for i, v in enumerate(values)]
        needles = [needles[i] for i in rng.permutation(len(needles))]  # RULER shuffles the needles
        asked = [int(i) for i in rng.choice(num_keys, size=asks_per * questions, replace=False)]
        prompts = []
        for j in range(questions):
            mine = asked[j * asks_per:(j + 1) * asks_per]
            references = tuple(v for i in mine for v in values[i * self.num_needle_v:(i + 1) * self.num_needle_v])
            instruction, question, prefix = niah_texts(self.type_needle_v, _join_queries([keys[i] for i in mine]),
                                                       singular=asks_per * self.num_needle_v == 1)
            prompts.append((instruction, question, prefix, ", ".join(references), references))
        head = prompts[0][0] + "\n"  # the instruction does not depend on the keys asked
        asks = [(question, prefix, answer) for _, question, prefix, answer, _ in prompts]
        if self.type_haystack == "needle":
            body = self._needle_body(rng, seq_len, head, needles, set(keys), asks)
        else:
            body = self._filler_body(rng, seq_len, head, needles, asks)
        examples = [self._build(_Prompt([head, *body], question, prefix, answer, references))
                    for _, question, prefix, answer, references in prompts]
        longest = max(len(ex.ids) for ex in examples)
        if longest != seq_len + 1:  # the pieces' lengths add up by construction
            raise RuntimeError(f"{self.name}: built {longest} tokens for seq_len + 1 = {seq_len + 1}")
        return examples

    def _budget(self, seq_len: int, context: list[Piece], asks: list[tuple[str, str, str]]) -> int:
        """Haystack tokens left once the fixed pieces and the longest of ``asks`` (question, prefix, answer) are
        in (``ConfigError`` naming seq_len if none are)."""
        fixed = max(self._length(_Prompt(context, question, prefix, answer, ())) for question, prefix, answer in asks)
        if fixed > seq_len + 1:
            raise self._too_short(seq_len, fixed)
        return seq_len + 1 - fixed

    def _filler_body(self, rng, seq_len, head, needles, asks) -> list[Piece]:
        """Noise or prose with the needles between sentences (RULER joins essay sentences and needles by spaces)."""
        hay = haystack(self.tokenizer, self.type_haystack)
        texts = [" " + needle for needle in needles]  # the space between sentences follows every cut
        n = self._budget(seq_len, [head, *texts, "\n"], asks)
        inner = hay.starts[hay.starts > 0]
        # prose starts at a random sentence (RULER always starts its essays at the beginning); noise at a sentence
        offset = int(rng.choice(inner)) if self.type_haystack == "prose" and len(inner) else int(hay.starts[0])
        ids, starts = hay.take(n, offset)
        # needles go between sentences: not before the first (the instruction's line break is there), nor at the
        # end, which may be mid-sentence (unless a haystack shorter than a sentence leaves nothing else)
        candidates = starts[(starts > 0) & (starts < n)]
        candidates = candidates if len(candidates) else np.asarray([n])
        spread = "depths" if self.type_haystack == "prose" else "uniform"
        cuts = sorted(_before_space(self.tokenizer, ids, c)
                      for c in _place(rng, candidates, n, len(texts), self.depth, spread))
        body: list[Piece] = []
        last = 0
        for cut, text in zip(cuts, texts):
            body += [ids[last:cut], text]
            last = cut
        return [*body, ids[last:], "\n"]

    def _needle_body(self, rng, seq_len, head, needles, keys, asks) -> list[Piece]:
        """Lines of distractor needles (random keys other than the example's) with the needles among them; the
        first line is the tail of one more distractor, so that the lines fill the length exactly."""
        lines = [n + "\n" for n in needles]
        room = self._budget(seq_len, [head, *lines], asks)
        distractors: list[Piece] = []
        tail: list[Piece] = []
        while room > 0:
            key = _distinct(rng, self.type_needle_k, 1, exclude=keys)[0]
            value = _random_item(rng, self.type_needle_v)
            ids = piece_ids(self.tokenizer, NIAH_NEEDLE.format(type_needle_v=self.type_needle_v, key=key,
                                                               value=value) + "\n")
            if len(ids) > room:
                tail = [ids[len(ids) - room:]]
                break
            distractors.append(ids)
            room -= len(ids)
        count = len(distractors)
        cuts = _place(rng, np.arange(count + 1), count, len(lines), self.depth, "uniform")
        body, last = [*tail], 0
        for cut, line in zip(cuts, lines):
            body += [*distractors[last:cut], line]
            last = cut
        return [*body, *distractors[last:]]


def _niah(name: str, doc: str, **defaults) -> type[Niah]:
    """A registered ``Niah`` whose field defaults are RULER's settings for ``name`` (``synthetic.yaml``)."""
    fields = [(key, type(value), dataclasses.field(default=value)) for key, value in defaults.items()]
    cls = dataclasses.make_dataclass(name.title().replace("_", ""), fields, bases=(Niah,), frozen=True,
                                     namespace={"name": name, "__doc__": doc, "__module__": __name__})
    return register(cls)


NiahSingle1 = _niah("niah_single_1", "RULER niah_single_1: one word key with a number in the noise haystack.",
                    type_haystack="noise")
NiahSingle2 = _niah("niah_single_2", "RULER niah_single_2: one word key with a number in prose.")
NiahSingle3 = _niah("niah_single_3", "RULER niah_single_3: one word key with a UUID in prose.",
                    type_needle_v="uuids")
NiahMultikey1 = _niah("niah_multikey_1", "RULER niah_multikey_1: 4 word keys in prose, one asked (3 distractors).",
                      num_needle_k=4)
NiahMultikey2 = _niah("niah_multikey_2", "RULER niah_multikey_2: a word key with a number among distractor "
                      "needles.", type_haystack="needle")
NiahMultikey3 = _niah("niah_multikey_3", "RULER niah_multikey_3: a UUID key with a UUID among distractor needles.",
                      type_haystack="needle", type_needle_k="uuids", type_needle_v="uuids")
NiahMultivalue = _niah("niah_multivalue", "RULER niah_multivalue: 4 numbers for one word key in prose, all asked.",
                       num_needle_v=4)
NiahMultiquery = _niah("niah_multiquery", "RULER niah_multiquery: 4 word keys in prose, all asked.",
                       num_needle_q=4)
