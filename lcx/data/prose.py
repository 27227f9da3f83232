"""Long English prose in any tokenizer, for perplexity (task ``prose``): offline on every machine.

Default text: the Python reference manual that the standard library ships as ``pydoc_data.topics`` (79 sections,
~465k characters - the pages of ``help("assert")`` and friends: English prose with some code), or the text files of
``path``. Documents are ranked by a CRC32 of their name and the first ``round(val_fraction * n)`` are the
validation split. Each split is one token stream - the documents in name order, each ``text`` followed by a blank
line, tokenized once with the run's tokenizer - cut into windows of ``seq_len + 1`` tokens at stride ``seq_len``
(with BOS: BOS and ``seq_len`` tokens of text, as a pretrained model reads a document). Batch ``index`` takes the
next ``count`` windows of a shuffled order (``default_rng([seed, split_id, epoch])``); every token is a target.
"""

from __future__ import annotations

import dataclasses
import zlib
from pathlib import Path
from typing import ClassVar

import numpy as np

from lcx.config_base import ConfigError
from lcx.data.task import Example, Task, register, split_id
from lcx.data.tokenizer import prompt_bos

_STREAMS: dict[tuple, np.ndarray] = {}


@register
@dataclasses.dataclass(frozen=True)
class Prose(Task):
    """``path``: a text file or folder of them (``glob``; null: ``pydoc_data.topics``); ``val_fraction``: documents
    held out as the validation split; ``bos``: each window starts with the tokenizer's BOS - null (the default):
    when the tokenizer adds one to a text (``adds_bos``, as llama.cpp's perplexity starts its windows)."""

    name: ClassVar[str] = "prose"
    metric: ClassVar[str] = "perplexity"
    path: str | None = None
    glob: str = "**/*.txt"
    val_fraction: float = 0.25
    bos: bool | None = None

    def __post_init__(self):
        if not 0.0 < self.val_fraction < 1.0:
            raise ConfigError(f"{self.key('val_fraction')}={self.val_fraction!r} is invalid: must be in (0, 1) (both "
                              "splits need documents)")

    def documents(self) -> list[tuple[str, str]]:
        """``(name, text)`` of every document, in name order."""
        if self.path is None:
            from lcx.data.haystack import prose_documents

            return list(prose_documents())
        root = Path(self.path).expanduser()
        files = [root] if root.is_file() else sorted(p for p in root.glob(self.glob) if p.is_file()
                                                     and not p.name.startswith("."))
        if not files:
            raise ConfigError(f"{self.key('path')}={self.path!r} holds no files matching {self.key('glob')}="
                              f"{self.glob!r}; the prose task reads text files")
        return [(str(f.relative_to(root) if f != root else f.name), f.read_text(errors="replace")) for f in files]

    def stream(self, split: str) -> np.ndarray:
        """The token stream of ``split`` in the run's tokenizer, int32 ``[n]`` (cached per tokenizer)."""
        key = (self.path, self.glob, self.val_fraction, split_id(split), self.tokenizer.spec)
        if key not in _STREAMS:
            docs = self.documents()
            ranked = sorted(range(len(docs)), key=lambda i: (zlib.crc32(docs[i][0].encode()), docs[i][0]))
            n_val = max(1, round(self.val_fraction * len(docs)))
            chosen = set(ranked[:n_val]) if split == "validation" else set(ranked[n_val:])
            if not chosen:
                raise ConfigError(f"{self.key('path')}={self.path!r}: the {split} split has no documents "
                                  f"({len(docs)} in all); add documents or change val_fraction")
            text = "".join(docs[i][1].rstrip() + "\n\n" for i in sorted(chosen))
            _STREAMS[key] = np.asarray(self.tokenizer.encode(text, bos=False), np.int32)
        return _STREAMS[key]

    def num_windows(self, seq_len: int, split: str) -> int:
        n = (len(self.stream(split)) - 1) // seq_len
        if n < 1:
            raise ConfigError(f"task 'prose': the {split} split has {len(self.stream(split))} tokens, fewer than one "
                              f"window of {seq_len + 1}; lower the length or add documents ({self.key('path')})")
        return n

    def examples(self, seed: int, index: int, count: int, seq_len: int, split: str = "train") -> list[Example]:
        stream, n = self.stream(split), self.num_windows(seq_len, split)
        out = []
        for pos in range(index * count, (index + 1) * count):
            order = np.random.default_rng([seed, split_id(split), pos // n]).permutation(n)
            out.append(self._window(stream, int(order[pos % n]) * seq_len, seq_len))
        return out

    def example(self, rng: np.random.Generator, seq_len: int) -> Example:
        return self._window(self.stream("train"), int(rng.integers(self.num_windows(seq_len, "train"))) * seq_len,
                            seq_len)

    @property
    def starts_with_bos(self) -> bool:
        if self.tokenizer.bos_id is None:
            return False
        return prompt_bos(self.tokenizer) if self.bos is None else self.bos

    def _window(self, stream: np.ndarray, start: int, seq_len: int) -> Example:
        if self.starts_with_bos:
            ids = np.concatenate([[self.tokenizer.bos_id], stream[start:start + seq_len]]).astype(np.int32)
        else:
            ids = stream[start:start + seq_len + 1].astype(np.int32)
        return Example(ids, np.ones(len(ids), bool), "", (), "")


__all__ = ["Prose"]
