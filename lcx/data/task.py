"""What a task is: the ``Example`` it yields, the ``Task`` base class, and the registry that looks tasks up by name.

Every task turns a ``numpy.random.Generator`` into one ``Example``: byte-level token ids (``ByteTokenizer``, BOS
first), a loss mask marking the answer tokens, the answer text and the reference strings an evaluation grades a
generation against. An example holds at most ``seq_len + 1`` tokens, so that after the one-token shift of language
modelling the model sees exactly ``seq_len`` input positions (the last token is only ever a target).

Tasks are frozen dataclasses whose fields are their parameters, validated in ``__post_init__`` (``ConfigError``
naming the key where the parameter was set, ``Task.key``: ``data.params.<field>``, ``eval.params.<field>`` ...) and
registered with ``@register``; ``make_task(name, params)`` builds one. Five more fields are not parameters but the
run's: the tokenizer, the chat frame, whether plain prompts begin with BOS (``eval.bos``) and where the task was set in
the config (``with_tokenizer``, ``make_task(prefix=, name_key=)``). They are fields so that every copy of a task keeps
them; a config's ``params`` cannot set them. The built-in tasks live in ``tasks.py``, ``ruler/``, ``corpus.py``,
``prose.py``, ``documents.py`` and ``mixture.py`` and are registered when ``lcx.data`` is imported.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import difflib
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from lcx.config_base import ConfigError, from_dict, name_registry, run_attribute
from lcx.data.example import Example
from lcx.data.tokenizer import ByteTokenizer

TOKENIZER = ByteTokenizer()
SPLITS = {"train": 0, "validation": 1}
_REGISTRY: dict[str, type["Task"]] = {}


class ParamError(ConfigError):
    """A bad parameter value found by a helper that tasks of every config section share (a cached reader of a
    corpus or a folder of documents: one cache entry per source, whichever section names it). ``template`` names
    the parameters' keys as ``{params}.path``; ``Task.located`` re-raises it with the section the task's parameters
    came from (``data.params`` until then)."""

    def __init__(self, template: str):
        self.template = template
        super().__init__(self.at("data.params"))

    def at(self, params_key: str) -> str:
        """The message with the parameters' key ``params_key`` (``eval.perplexity.params``)."""
        return self.template.replace("{params}", params_key)


def text_example(prompt: str, answer_parts: Sequence[tuple[str, bool]], answer: str,
                 references: Sequence[str], *, eos: bool) -> Example:
    """Build an ``Example`` from the prompt and the following (text, is_answer) pieces; EOS (masked) if ``eos``."""
    ids = [TOKENIZER.bos_id, *TOKENIZER.encode(prompt, bos=False)]
    mask = [False] * len(ids)
    for text, is_answer in answer_parts:
        piece = TOKENIZER.encode(text, bos=False)
        ids += piece
        mask += [is_answer] * len(piece)
    if eos:
        ids.append(TOKENIZER.eos_id)
        mask.append(True)
    return Example(np.asarray(ids, np.int32), np.asarray(mask, bool), answer, tuple(references), prompt)


def n_tokens(text: str) -> int:
    return len(text.encode("utf-8"))


@dataclasses.dataclass(frozen=True)
class Task(abc.ABC):
    """Base class of tasks: ``examples(seed, index, count, seq_len, split)`` is a pure function of its arguments.

    Synthetic tasks implement ``example(rng, seq_len)``; batch ``index`` of a split draws its examples in order from
    ``np.random.default_rng([seed, split_id, index])``, so a data position is just an index (resume = same index).
    """

    name: ClassVar[str] = ""
    # Tasks that build their ids through ``self.tokenizer`` accept any tokenizer (``with_tokenizer``); a task
    # that is byte-level only refuses another one.
    accepts_tokenizer: ClassVar[bool] = True
    # what an evaluation measures: "accuracy" (generations graded by ``score``) or "perplexity" (every token a target)
    metric: ClassVar[str] = "accuracy"
    # Not parameters (a config's params cannot set them) but fields all the same, so that every copy of a task -
    # ``dataclasses.replace(task, depth=0.5)`` in an evaluation grid, ``copy.copy`` - keeps them: the tokenizer that
    # builds the ids, the ``haystack.ChatTemplate`` framing prompts (``with_tokenizer(chat=True)``), whether plain
    # prompts begin with BOS (``eval.bos``; None: as the tokenizer adds it), and the config
    # section the parameters came from (``data``, ``eval``, ``eval.perplexity``), which messages name.
    tokenizer: Any = run_attribute(TOKENIZER)
    chat: Any = run_attribute(None)
    bos_first: bool | None = run_attribute(None)
    section: str = run_attribute("data", compare=False)
    name_key: str | None = run_attribute(None, compare=False)  # where the name was set, if not ``{section}.task``

    @property
    def packed(self) -> bool:
        """Whether batches carry segment ids and positions (several documents per row)."""
        return False

    @property
    def frame(self):
        """How prompts are framed - plain, or in the chat template (``lcx.data.haystack.Frame``)."""
        from lcx.data.haystack import Frame

        return Frame(self.tokenizer, self.chat, self.bos_first)

    @property
    def starts_with_bos(self) -> bool | None:
        """Whether this task's prompts begin with the BOS id (results record it, the ``bos`` column): the frame's
        rule - plain prompts when the tokenizer adds BOS (or as ``eval.bos`` forces it), chat prompts when the
        template writes it; None where it varies (windows cut from a stream of documents)."""
        return self.frame.bos

    def with_tokenizer(self, tokenizer, *, chat: bool = False) -> "Task":
        """This task producing ids with ``tokenizer`` (``ConfigError`` for a byte-level task and another one);
        ``chat``: prompts framed as a user message of the tokenizer's chat template, the answer prefix opening
        the reply."""
        if tokenizer.spec == self.tokenizer.spec and not chat and self.chat is None:
            return self
        self._check_accepts(tokenizer)
        template = None
        if chat:
            from lcx.data.haystack import ChatTemplate

            template = ChatTemplate.from_tokenizer(tokenizer)
        return dataclasses.replace(self, tokenizer=tokenizer, chat=template)

    def _check_accepts(self, tokenizer) -> None:
        """Refuse another tokenizer than lcx's bytes for a byte-level task (``accepts_tokenizer = False``)."""
        if self.accepts_tokenizer or tokenizer.spec == TOKENIZER.spec:
            return
        if self.section.startswith("eval"):
            hint = ("for perplexity in a checkpoint's own tokens use task 'prose' (long English prose, any tokenizer) "
                    "or 'documents' (your files)")
        else:
            hint = "set data.tokenizer=bytes (the model then learns lcx's byte ids) or train on task 'documents'"
        raise ConfigError(f"{self.task_key}={self.name!r} builds byte-level examples and cannot use the tokenizer "
                          f"{tokenizer.spec!r}; {hint}")

    def key(self, param: str) -> str:
        """Where parameter ``param`` is set in the config (``data.params.depth``, ``eval.perplexity.params.path``):
        what a message about its value names."""
        return f"{self.params_key}.{param}"

    @property
    def params_key(self) -> str:
        """Where this task's parameters are set in the config (``data.params``, ``eval.perplexity.params``)."""
        return f"{self.section}.params"

    @contextlib.contextmanager
    def located(self):
        """Re-raise a shared helper's ``ParamError`` naming this task's keys."""
        try:
            yield
        except ParamError as err:
            raise ConfigError(err.at(self.params_key)) from None

    @property
    def task_key(self) -> str:
        """Where this task is named in the config (``data.task``, ``eval.perplexity.task``, ``eval.tasks[1]``)."""
        return self.name_key or f"{self.section}.task"

    def examples(self, seed: int, index: int, count: int, seq_len: int, split: str = "train") -> list[Example]:
        rng = np.random.default_rng([seed, split_id(split), index])
        return [self.example(rng, seq_len) for _ in range(count)]

    @abc.abstractmethod
    def example(self, rng: np.random.Generator, seq_len: int) -> Example:
        """One example of at most ``seq_len + 1`` tokens; raise ``ConfigError`` if the parameters cannot fit."""

    def score(self, example: Example, output: str) -> float:
        """Grade a generation ``output`` (the text after ``example.prompt_ids``) in [0, 1]. Default: the share of
        ``example.references`` found in it (RULER's string-match metric)."""
        if not example.references:
            raise ValueError(f"task {self.name!r} has no references to grade a generation against")
        return sum(ref in output for ref in example.references) / len(example.references)


def split_id(split: str) -> int:
    if split not in SPLITS:
        raise ConfigError(f"split={split!r} is invalid: must be one of {list(SPLITS)}")
    return SPLITS[split]


register = name_registry(_REGISTRY, "task")


def task_names() -> list[str]:
    """The registered task names (``lcx.data`` registers the built-ins when it is imported)."""
    return sorted(_REGISTRY)


def make_task(name: str, params: Mapping[str, Any] | None = None, prefix: str = "data.params", *,
              name_key: str | None = None) -> Task:
    """The task registered as ``name`` with ``params`` (unknown names and keys: ``ConfigError`` with did-you-mean).
    ``prefix``: where ``params`` sit in the config (``eval.perplexity.params``); every message about them - now or
    when the task builds examples - names its keys under it. ``name_key``: where ``name`` was set (default: the
    ``task`` key beside ``params``)."""
    section = prefix.removesuffix(".params")
    names = task_names()
    if name not in _REGISTRY:
        close = difflib.get_close_matches(str(name), names, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"{name_key or section + '.task'}={name!r} is not a known task{hint} (allowed: {names})")
    return from_dict(_REGISTRY[name], dict(params or {}), prefix=prefix,
                     attributes={"section": section, "name_key": name_key})


__all__ = ["Example", "ParamError", "SPLITS", "TOKENIZER", "Task", "make_task", "n_tokens", "register", "split_id",
           "task_names", "text_example"]
