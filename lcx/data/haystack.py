"""Haystacks in any tokenizer's tokens, and examples assembled from token pieces, so that lengths are exact.

A long-context task with a subword tokenizer must size its haystack in the model's tokens: RULER searches for the
haystack size whose prompt fits the length. lcx gets an exact fit without a search: a prompt is a list of pieces -
text pieces (instruction, needles, question) encoded one by one, and haystack pieces that are slices of a text
tokenized once - so the prompt's length is the sum of its pieces' lengths, and the filler is whatever the length
leaves. Needles go at sentence starts of the haystack (token indices where a sentence begins), never inside a word.

Haystacks:

- ``noise``: the repetitive "The grass is green. ..." text of landmark attention and RULER, tokenized as one period
  of the repeated text in context (so the tokens at the seam are the ones a long repetition has);
- ``prose``: English prose every Python installation ships - the reference manual's topics of
  ``pydoc_data.topics`` (79 sections, ~465k characters: the `help()` pages), whitespace collapsed, in name order -
  the offline stand-in for RULER's essay haystack.

``ChatTemplate``: a tokenizer's chat template (the jinja2 template of ``tokenizer_config.json``, rendered the way
transformers' ``apply_chat_template`` does) split into the text before and after the user's message.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Sequence

import numpy as np

from lcx.cache.reconstruct import Reconstruction
from lcx.config_base import ConfigError
from lcx.data.example import Example
from lcx.data.tokenizer import prompt_bos

# The "noise" haystack of landmark attention and RULER: repetitive, so it carries no information to retrieve.
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
_SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(])")


# --------------------------------------------------------------------------------------------------- sources
@functools.lru_cache(maxsize=1)
def prose_documents() -> tuple[tuple[str, str], ...]:
    """``(name, text)`` of the Python reference manual's topics (``pydoc_data.topics``), sorted by name."""
    from pydoc_data.topics import topics

    return tuple((name, topics[name]) for name in sorted(topics))


@functools.lru_cache(maxsize=1)
def prose_text() -> str:
    """The topics as one running text: whitespace runs (line breaks, code indentation) collapsed to one space."""
    return " ".join(" ".join(text.split()) for _, text in prose_documents())


# --------------------------------------------------------------------------------------------------- tokens
def encode_spans(tokenizer, text: str) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of ``text`` (no BOS) and each token's ``[start, end)`` character span, ``([n], [n, 2])``."""
    inner = getattr(tokenizer, "_tok", None)
    if inner is None:  # lcx's byte tokenizer: one token per UTF-8 byte
        ids = np.asarray(tokenizer.encode(text, bos=False), np.int32)
        widths = np.asarray([len(ch.encode("utf-8")) for ch in text], np.int64)
        owner = np.repeat(np.arange(len(text)), widths)  # the character each byte belongs to
        return ids, np.stack([owner, owner + 1], axis=1)
    enc = inner.encode(text, add_special_tokens=False)
    return np.asarray(enc.ids, np.int32), np.asarray(enc.offsets, np.int64).reshape(-1, 2)


def sentence_chars(text: str) -> np.ndarray:
    """Character offsets where a sentence of ``text`` begins (0 included)."""
    return np.asarray([0] + [m.end() for m in _SENTENCE.finditer(text)], np.int64)


def _token_index(spans: np.ndarray, chars: np.ndarray) -> np.ndarray:
    """For each character offset, the first token that ends after it: cutting the ids there puts the cut just
    before the sentence (a token that carries the space before a word, as GPT-2's does, stays with the word)."""
    return np.searchsorted(spans[:, 1], chars, side="right")


@dataclasses.dataclass(frozen=True, eq=False)
class Haystack:
    """A tokenized filler text: ``ids [n]`` and the sorted token indices ``starts`` where a sentence begins.
    ``periodic``: the ids repeat (noise) - ``take`` tiles them; otherwise ``take`` wraps around to the beginning."""

    ids: np.ndarray
    starts: np.ndarray
    periodic: bool

    def take(self, n: int, offset: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Exactly ``n`` filler tokens from token ``offset`` (mod the length), and the sentence starts among them
        (indices in ``[0, n]``; ``n`` itself - the end - is always a place a needle can go)."""
        size = len(self.ids)
        offset %= size
        reps = (offset + n) // size + 1
        ids = np.tile(self.ids, reps)[offset:offset + n]
        starts = (self.starts[None, :] + size * np.arange(reps)[:, None]).ravel() - offset
        starts = starts[(starts >= 0) & (starts <= n)]
        return ids.astype(np.int32), np.unique(np.concatenate([starts, [0, n]]))


_CACHE: dict[tuple[str, str], Haystack] = {}


def haystack(tokenizer, kind: str = "noise") -> Haystack:
    """The ``noise`` or ``prose`` haystack in ``tokenizer``'s tokens (cached per tokenizer and kind)."""
    key = (tokenizer.spec, kind)
    if key not in _CACHE:
        if kind == "noise":
            _CACHE[key] = _periodic(tokenizer, NOISE)
        elif kind == "prose":
            text = prose_text()
            ids, spans = encode_spans(tokenizer, text)
            _CACHE[key] = Haystack(ids, np.unique(_token_index(spans, sentence_chars(text))), periodic=False)
        else:
            raise ConfigError(f"haystack={kind!r} is invalid: must be 'noise' or 'prose'")
    return _CACHE[key]


def _periodic(tokenizer, period: str) -> Haystack:
    """One period of ``period`` repeated, tokenized in context: the tokens of the second of four repetitions from the
    first token boundary at or after its start (merges across the seam are kept), rotated to begin a sentence."""
    size = len(period)
    ids, spans = encode_spans(tokenizer, period * 4)
    first = int(np.searchsorted(spans[:, 0], size))
    shift = int(spans[first, 0]) - size
    last = int(np.searchsorted(spans[:, 0], 2 * size + shift))
    if last >= len(ids) or spans[last, 0] != 2 * size + shift:
        raise ConfigError(f"the tokenizer {tokenizer.spec!r} does not tokenize the repeated haystack text "
                          "periodically; use the 'prose' haystack")
    chars = sentence_chars(period * 4)
    chars = chars[(chars >= size + shift) & (chars < 2 * size + shift)]
    starts = np.unique(_token_index(spans, chars) - first)
    # rotate the period to begin with a sentence, as the repeated text does (bytes: already so)
    period = np.roll(ids[first:last], -int(starts[0]))
    return Haystack(period, np.unique((starts - starts[0]) % len(period)), periodic=True)


def nearest(starts: np.ndarray, target: float) -> int:
    """The sentence start closest to token index ``target``."""
    return int(starts[np.argmin(np.abs(starts - target))])


# --------------------------------------------------------------------------------------------------- chat
@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """The text a chat template puts before (``head``) and after (``tail``) a single user message, generation prompt
    included; ``has_bos``: the template writes the BOS token itself (then the example does not add one)."""

    head: str
    tail: str
    has_bos: bool

    @classmethod
    def from_tokenizer(cls, tokenizer) -> "ChatTemplate":
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            raise ConfigError(f"eval.chat=true, but the tokenizer {tokenizer.spec!r} has no chat template (none in "
                              "its tokenizer_config.json or GGUF metadata); set eval.chat=false")
        bos = token_text(tokenizer, tokenizer.bos_id)
        rendered = render_chat(template, [{"role": "user", "content": _MARK}], bos_token=bos or "",
                               eos_token=token_text(tokenizer, tokenizer.eos_id) or "", add_generation_prompt=True)
        if rendered.count(_MARK) != 1:
            raise ConfigError(f"the chat template of {tokenizer.spec!r} does not render a user message once; "
                              "set eval.chat=false")
        head, tail = rendered.split(_MARK)
        has_bos = bool(bos) and head.startswith(bos)
        return cls(head[len(bos):] if has_bos else head, tail, has_bos)


_MARK = "\x00lcx-user-message\x00"


def render_chat(template: str, messages: Sequence[dict], **variables) -> str:
    """A chat template rendered as transformers renders it: jinja2's sandbox, ``trim_blocks`` and ``lstrip_blocks``,
    ``raise_exception`` and ``strftime_now`` available, a ``tojson`` that keeps non-ASCII characters."""
    import datetime
    import json

    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(template).render(messages=list(messages), **variables)


def token_text(tokenizer, token_id: int | None) -> str | None:
    """The text of special token ``token_id`` (the BOS a chat template writes), or None when there is none or the
    tokenizer cannot say (lcx's byte tokenizer)."""
    inner = getattr(tokenizer, "_tok", None)
    if token_id is None or inner is None:
        return None
    return inner.id_to_token(int(token_id))


# --------------------------------------------------------------------------------------------------- examples
Piece = str | np.ndarray


def piece_ids(tokenizer, piece: Piece) -> np.ndarray:
    if isinstance(piece, str):
        return np.asarray(tokenizer.encode(piece, bos=False), np.int32) if piece else np.zeros(0, np.int32)
    return np.asarray(piece, np.int32)


def pieces_length(tokenizer, pieces: Sequence[Piece]) -> int:
    return sum(len(piece_ids(tokenizer, p)) for p in pieces)


@dataclasses.dataclass(frozen=True)
class Frame:
    """How a task's prompt is framed: plain (the question, then the answer prefix after a space) or in a chat
    template (the context and question as the user's message, the answer prefix opening the reply).
    ``bos_first``: whether a plain prompt begins with the BOS id (``eval.bos``; None: as the tokenizer adds it)."""

    tokenizer: object
    chat: ChatTemplate | None = None
    bos_first: bool | None = None

    @property
    def bos(self) -> bool:
        """Whether the prompt begins with the BOS id: plain, when the tokenizer adds one to a text (``adds_bos``)
        unless ``bos_first`` says; in a chat template, when the template writes the BOS token's text (whatever the
        tokenizer adds)."""
        if self.tokenizer.bos_id is None:
            return False
        if self.chat is not None:
            return self.chat.has_bos
        return prompt_bos(self.tokenizer) if self.bos_first is None else self.bos_first

    def wrap(self, context: Sequence[Piece], question: str, prefix: str) -> list[Piece]:
        """The prompt's pieces, BOS first where ``bos`` says; the first ``context_pieces`` of them are the context,
        the rest the question."""
        head = [np.asarray([self.tokenizer.bos_id], np.int32)] if self.bos else []
        if self.chat is None:
            ask = question + (" " + prefix if question and prefix else prefix)
            return [*head, *context, ask]
        return [*head, self.chat.head, *context, question, self.chat.tail, prefix]

    def context_pieces(self, context: Sequence[Piece]) -> int:
        """How many leading pieces of ``wrap(context, ...)`` are the context (BOS and chat header included)."""
        return int(self.bos) + (self.chat is not None) + len(context)

    def reconstruction(self) -> Reconstruction:
        """The repeat prompt of reconstruction scoring (KVzip; kvpress's wording) in this frame's tokens: the
        instruction, the chat template's close of the user message and opening of the reply (plain: a newline),
        and ``skip`` - the tokens of the frame before the context (BOS, the chat header), not repeated."""
        tok = self.tokenizer
        ids = lambda text: tuple(piece_ids(tok, text).tolist())  # noqa: E731
        skip = int(self.bos) + (len(ids(self.chat.head)) if self.chat is not None else 0)
        return Reconstruction(first=ids("\n\nRepeat the previous context exactly."),
                              later=ids("\n\nRepeat the part of the previous context exactly, starting with"),
                              suffix=ids(self.chat.tail if self.chat is not None else "\n"), skip=skip)

    def overhead(self, question: str, prefix: str) -> int:
        """Tokens the frame adds around the context (BOS, question, prefix, template)."""
        return pieces_length(self.tokenizer, self.wrap([], question, prefix))

    def example(self, context: Sequence[Piece], question: str, prefix: str, answer_parts: Sequence[tuple[str, bool]],
                answer: str, references: Sequence[str], *, eos: bool) -> Example:
        """The framed prompt and its answer as an ``Example`` that marks where the question starts."""
        return pieces_example(self.tokenizer, self.wrap(context, question, prefix), answer_parts, answer, references,
                              eos=eos, context_pieces=self.context_pieces(context))


def pieces_example(tokenizer, prompt: Sequence[Piece], answer_parts: Sequence[tuple[str, bool]], answer: str,
                   references: Sequence[str], *, eos: bool, context_pieces: int | None = None) -> Example:
    """An ``Example`` from the prompt's pieces and the (text, is_answer) pieces after it; EOS (masked) if ``eos``;
    ``context_pieces``: how many leading prompt pieces are the context (``Example.context_len``)."""
    ids = [piece_ids(tokenizer, p) for p in prompt]
    n_prompt = sum(len(i) for i in ids)
    context_len = None if context_pieces is None else sum(len(i) for i in ids[:context_pieces])
    mask = [np.zeros(n_prompt, bool)]
    for text, is_answer in answer_parts:
        piece = piece_ids(tokenizer, text)
        ids.append(piece)
        mask.append(np.full(len(piece), is_answer))
    if eos and tokenizer.eos_id is not None:
        ids.append(np.asarray([tokenizer.eos_id], np.int32))
        mask.append(np.ones(1, bool))
    flat = np.concatenate(ids).astype(np.int32)
    prompt_text = tokenizer.decode(flat[:n_prompt])
    return Example(flat, np.concatenate(mask), answer, tuple(references), prompt_text, context_len=context_len)


__all__ = ["ChatTemplate", "Frame", "Haystack", "NOISE", "encode_spans", "haystack", "nearest",
           "pieces_example", "pieces_length", "prose_documents", "prose_text", "render_chat", "sentence_chars",
           "token_text"]
