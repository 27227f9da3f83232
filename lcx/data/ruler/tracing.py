"""RULER's multi-hop tracing task: variable tracking (``vt``)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np

from lcx.config_base import ConfigError
from lcx.data.haystack import NOISE, piece_ids
from lcx.data.ruler.base import RulerTask, _check_int, _largest_fitting, _Prompt
from lcx.data.task import Example, register


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
