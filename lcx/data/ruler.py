"""RULER's synthetic suite, generated offline in any tokenizer's tokens.

RULER (Hsieh et al., NVIDIA 2024, "RULER: What's the Real Context Size of Your Long-Context Language Models?",
github.com/NVIDIA/RULER) measures long-context models with 13 tasks; this module has its 11 synthetic ones (the two
QA tasks need SQuAD / HotpotQA), registered under RULER's names with the settings of RULER's ``synthetic.yaml`` as
field defaults, RULER's instruction / question / answer-prefix texts (``scripts/data/synthetic/constants.py``), and
RULER's metric ``string_match_all`` (the share of references found in the output, case-insensitive) as ``score``:

- ``niah_single_1`` / ``_2`` / ``_3``: one needle "One of the special magic numbers for {key} is: {value}." in the
  noise haystack (word key, 7-digit value), in prose (word key, number), in prose (word key, UUID value);
- ``niah_multikey_1``: prose with 4 needles, 1 queried and 3 distractors; ``niah_multikey_2``: the haystack is
  made of distractor needles (word keys, numbers); ``niah_multikey_3``: the same with UUID keys and UUID values;
- ``niah_multivalue``: 4 values for one key, all asked; ``niah_multiquery``: 4 keys, all asked;
- ``vt`` (variable tracking): one chain ``VAR A = 12345``, ``VAR B = VAR A``, ... of 4 hops hidden among noise
  lines, after a one-shot example (RULER's in-context example of about 500 tokens); answer: the chain's 5 names;
- ``cwe`` (common words extraction): a numbered list "1. w 2. w ..." in which 10 words occur 30 times and the others
  3 times (below 4096 tokens RULER's short setting: 6 times and once), after a one-shot example; answer: the 10;
- ``fwe`` (frequent words extraction): coded words (6 random letters) with counts from a zeta distribution
  (alpha 2.0), the most frequent one replaced by "..." as noise; answer: the 3 next most frequent.

Every example is at most ``seq_len + 1`` tokens: the prompt (framed plainly or in a chat template by
``haystack.Frame``, with the answer prefix after the question or opening the reply), the answer tokens and EOS
(``loss_mask`` on the answer and EOS). The NIAH tasks fit exactly: the instruction, needles, question, prefix and
answer are pieces of known length and the haystack (``haystack.Haystack.take``) gets the rest. ``vt``, ``cwe`` and
``fwe`` search, like RULER, for the largest number of noise lines / listed words / coded words whose example fits,
so that one more would not.

Differences from RULER:

- Offline word lists instead of ``wonderwords``: ``words()`` are the alphabetic words of the Python reference manual
  (``haystack.prose_text()``; 3-10 letters, lower-cased, with a vowel, deduplicated and sorted, ~2.5k words, which
  depend on the Python version like the prose itself). NIAH keys and word values are two of them joined by "-"
  (RULER: adjective-noun); ``cwe`` lists them, then hyphenated pairs once a list needs more words than there are
  (RULER then switches to a larger English word list).
- The prose haystack (``haystack.prose_text()``, from a random sentence start) replaces Paul Graham's essays; the
  noise haystack runs on as one text ("... back again. The grass ...") with needles between its sentences, where
  RULER puts noise repetitions and needles on lines of their own. Needles never open the haystack or close it
  (RULER's depth 0 / 100): they go after its first sentence and before its last, possibly cut, one.
- The ``needle`` haystack fits exactly: it opens with the end of one more distractor line (as a window cut from a
  longer list would) to use up the tokens a whole line would overflow.
- Distractor keys differ from the queried keys, values of one example differ, and chains get distinct values (RULER
  draws them independently and may repeat one).
- The example holds the reference answer, not RULER's generation budget (``tokens_to_generate``, kept here as
  ``max_new_tokens`` for an evaluation to use); one-shot examples are plain text at the start of the user message
  (RULER formats ``cwe``'s with the model's chat template too).
"""

from __future__ import annotations

import dataclasses
import functools
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from lcx.config_base import ConfigError
from lcx.data.haystack import NOISE, Frame, Piece, haystack, nearest, pieces_length
from lcx.data.haystack import piece_ids, prose_text
from lcx.data.task import Example, Task, register, split_id

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


# --------------------------------------------------------------------------------------------------- vt
VT_INSTRUCTION = "Memorize and track the chain(s) of variable assignment hidden in the following text."
VT_QUESTION = "Question: Find all variables that are assigned the value {query} in the text above."
VT_PREFIX = ("Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
             "assigned the value {query}, they are:")
_NOISE_LINE = NOISE.strip()  # RULER's noise haystack for vt: this text once per line


@dataclasses.dataclass(frozen=True)
class _Chains:
    """Variable chains: the statements of each chain, each statement's place (uniform in [0, 1), sorted within a
    chain) and rank in its chain, the first chain's names (the answer) and its value (the query)."""

    statements: list[str]
    places: np.ndarray
    ranks: np.ndarray
    names: list[str]
    value: str

    @classmethod
    def draw(cls, rng: np.random.Generator, num_chains: int, num_hops: int, letters: int) -> "_Chains":
        names: list[str] = []
        while len(names) < num_chains * (num_hops + 1):  # distinct upper-case names, as RULER's
            name = "".join(chr(65 + c) for c in rng.integers(26, size=letters))
            if name not in names:
                names.append(name)
        values = [str(v) for v in rng.choice(np.arange(10000, 99999), size=num_chains, replace=False)]
        statements, places = [], []
        for c in range(num_chains):
            chain = names[c * (num_hops + 1):(c + 1) * (num_hops + 1)]
            statements += [f"VAR {chain[0]} = {values[c]}"] + [f"VAR {b} = VAR {a}" for a, b in zip(chain, chain[1:])]
            places += sorted(rng.uniform(size=num_hops + 1))
        ranks = np.tile(np.arange(num_hops + 1), num_chains)
        return cls(statements, np.asarray(places), ranks, names[:num_hops + 1], values[0])

    def text(self, noise_lines: int) -> str:
        """The statements among ``noise_lines`` noise lines, one per line. As in RULER (distinct insertion points
        among the noise lines), the statements of a chain have noise lines between them and are never last: the
        j-th follows ``floor(u * (noise_lines - hops)) + j`` noise lines for its place ``u``, the same places for
        every count, so that the search compares like with like."""
        hops = int(self.ranks.max())
        before = np.floor(self.places * max(noise_lines - hops, 0)).astype(np.int64) + self.ranks
        before = np.minimum(before, noise_lines)
        lines: list[str] = []
        done = 0
        for i in np.lexsort((self.places, before)):
            lines += [_NOISE_LINE] * int(before[i] - done) + [self.statements[i]]
            done = int(before[i])
        return "\n".join(lines + [_NOISE_LINE] * (noise_lines - done))


def _vt_texts(chains: _Chains, num_hops: int) -> tuple[str, str]:
    return (VT_QUESTION.format(query=chains.value),
            VT_PREFIX.format(num_v=num_hops + 1, query=chains.value))


@register
@dataclasses.dataclass(frozen=True)
class VariableTracking(RulerTask):
    """RULER's variable tracking (``variable_tracking.py``): ``num_chains`` chains ``VAR A = 12345``, ``VAR B = VAR
    A``, ... of ``num_hops`` hops (5-letter names, 5-digit values), each statement on a line among repeated noise
    lines; the question gives the first chain's value and asks for every variable that holds it. With ``fewshot``
    the prompt opens with RULER's worked example (3-letter names, at most ``min(num_hops, 10)`` hops, sized to
    ``fewshot_tokens``). Answer: the first chain's names in order, joined by spaces."""

    name: ClassVar[str] = "vt"
    max_new_tokens: ClassVar[int] = 30
    num_chains: int = 1
    num_hops: int = 4
    fewshot: bool = True
    fewshot_tokens: int = 500

    def __post_init__(self):
        _check_int(self.num_chains, self.key("num_chains"), 1)
        _check_int(self.num_hops, self.key("num_hops"), 1)
        _check_int(self.fewshot_tokens, self.key("fewshot_tokens"), 0)
        if not isinstance(self.fewshot, bool):
            raise ConfigError(f"{self.key('fewshot')}={self.fewshot!r} is invalid: must be true or false")

    def example(self, rng: np.random.Generator, seq_len: int) -> Example:
        shot = [self._shot(rng)] if self.fewshot else []
        chains = _Chains.draw(rng, self.num_chains, self.num_hops, letters=5)
        question, prefix = _vt_texts(chains, self.num_hops)
        head = VT_INSTRUCTION + "\n\n"

        def make(noise_lines: int) -> _Prompt:
            context = [*shot, head, chains.text(noise_lines) + "\n"]
            return _Prompt(context, question, prefix, " ".join(chains.names), tuple(chains.names))

        return self._fit(make, 0, seq_len)

    def _shot(self, rng: np.random.Generator) -> str:
        """RULER's in-context example: a whole solved prompt with as many noise lines as fit ``fewshot_tokens``."""
        hops = min(self.num_hops, 10)
        chains = _Chains.draw(rng, self.num_chains, hops, letters=3)
        question, prefix = _vt_texts(chains, hops)

        def text(noise_lines: int) -> str:
            return (f"{VT_INSTRUCTION}\n\n{chains.text(noise_lines)}\n{question} {prefix} "
                    f"{' '.join(chains.names)}\n\n")

        def length(noise_lines: int) -> int:
            return len(piece_ids(self.tokenizer, text(noise_lines)))

        lines = _largest_fitting(length, 0, self.fewshot_tokens) if length(0) <= self.fewshot_tokens else 0
        return text(lines)


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


__all__ = ["CWE_INSTRUCTION", "FWE_INSTRUCTION", "NIAH_INSTRUCTION", "NIAH_NEEDLE", "RULER_SUITE", "VT_INSTRUCTION",
           "CommonWordsExtraction", "FrequentWordsExtraction", "Niah", "RulerTask", "VariableTracking",
           "macro_average", "niah_texts", "string_match_all", "words", "zeta"]
