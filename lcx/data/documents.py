"""Your own long documents (task ``documents``): local text or JSONL files, tokenized, shuffled, packed into rows.

    data: {task: documents, tokenizer: auto, params: {path: corpus/, format: auto, text_field: text}}

Documents. ``path`` is a file or a folder (``glob`` picks files; hidden files are skipped). A ``.jsonl`` file
(``format: auto``) holds one document per line, its text under ``text_field``; any other file is one plain-text
document. Each document is tokenized once with the run's tokenizer (``data.tokenizer``) as ``BOS text EOS``.

Split by document, deterministic: documents are ranked by a CRC32 of their name (``file`` or ``file:line``) and the
first ``round(val_fraction * n)`` (at least one of two or more) form the validation split.

Packing. Epoch ``e`` of a split is its documents in the order ``default_rng([seed, split_id, e]).permutation``,
concatenated into one token stream; row ``r`` of the epoch is the window of ``seq_len + 1`` tokens starting at
``r * seq_len``, and batch ``index`` takes the next ``batch_size`` rows - a pure function of (seed, split, index),
so a resumed run replays the identical batches. Nothing is dropped: a document longer than a row continues in the
next row (at position 0 again: each row is a context of its own), only the stream's last partial row is left to the
next epoch's order. Within a row every document (or piece) gets its own segment id and positions restarting at 0:
the attention never crosses a document boundary (segment ids in the flash kernel and the XLA path) and each
document is rotated as if it ran alone. The target that would predict the next document's BOS from this one's EOS
carries no loss.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import zlib
from pathlib import Path
from typing import ClassVar

import numpy as np

from lcx.config_base import ConfigError
from lcx.data.task import Example, ParamError, Task, register, split_id
from lcx.data.tokenizer import Tokenizer

FORMATS = ("auto", "text", "jsonl")


@register
@dataclasses.dataclass(frozen=True)
class Documents(Task):
    """``path``: a file or folder of documents; ``glob``: which files of a folder (default every file);
    ``format``: ``auto`` (``.jsonl`` = JSON lines, else text), ``text`` or ``jsonl``; ``text_field``: the JSONL key
    holding a document's text; ``val_fraction``: documents held out for validation."""

    name: ClassVar[str] = "documents"
    metric: ClassVar[str] = "perplexity"
    accepts_tokenizer: ClassVar[bool] = True
    path: str = ""
    glob: str = "**/*"
    format: str = "auto"
    text_field: str = "text"
    val_fraction: float = 0.05

    @property
    def starts_with_bos(self) -> None:
        return None  # every document starts with BOS, a window wherever the packed stream is cut

    def __post_init__(self):
        if not isinstance(self.path, str) or not self.path:
            raise ConfigError(f"{self.key('path')}={self.path!r} is invalid: the documents task needs a file or "
                              "folder of text / JSONL documents")
        if self.format not in FORMATS:
            raise ConfigError(f"{self.key('format')}={self.format!r} is invalid: must be one of {list(FORMATS)}")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ConfigError(f"{self.key('val_fraction')}={self.val_fraction!r} is invalid: must be in [0, 1)")

    def documents(self, split: str) -> list[np.ndarray]:
        """The token ids of every document of ``split`` (BOS text EOS), in name order."""
        source = (self.path, self.glob, self.format, self.text_field)
        with self.located():
            docs = _tokenized(*source, self.tokenizer)
            return [docs[i] for i in _split(tuple(_names(*source)), self.val_fraction)[split_id(split)]]

    def num_rows(self, seq_len: int, split: str = "train") -> int:
        total = sum(len(d) for d in self.documents(split))
        n = (total - 1) // seq_len
        if n < 1:
            raise ConfigError(f"{self.key('path')}={self.path!r}: the {split} split holds {total} tokens, fewer than "
                              f"one row of seq_len + 1 = {seq_len + 1}; add documents or lower seq_len")
        return n

    def examples(self, seed: int, index: int, count: int, seq_len: int, split: str = "train") -> list[Example]:
        n = self.num_rows(seq_len, split)
        out = []
        for pos in range(index * count, (index + 1) * count):
            tokens, segments = self._epoch(seed, split, pos // n)
            start = (pos % n) * seq_len
            out.append(_row(tokens[start:start + seq_len + 1], segments[start:start + seq_len + 1]))
        return out

    def example(self, rng: np.random.Generator, seq_len: int) -> Example:
        """A random row (for ad-hoc use; batches go through ``examples``)."""
        return self.examples(int(rng.integers(2 ** 31)), 0, 1, seq_len)[0]

    @property
    def packed(self) -> bool:
        return True

    def _epoch(self, seed: int, split: str, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        return _epoch_stream(self, seed, split, epoch)

    def score(self, example: Example, output: str) -> float:
        raise ConfigError("task 'documents' is language modelling: evaluate its perplexity, not generations")


def _row(tokens: np.ndarray, segments: np.ndarray) -> Example:
    """One packed row: segment ids renumbered from 1 within the row, positions restarting at each segment."""
    starts = np.flatnonzero(np.diff(segments, prepend=segments[0] - 1) != 0)
    seg = np.cumsum(np.diff(segments, prepend=segments[0] - 1) != 0).astype(np.int32)
    positions = np.arange(len(tokens), dtype=np.int32) - np.repeat(starts, np.diff(np.append(starts, len(tokens))))
    return Example(tokens.astype(np.int32), np.ones(len(tokens), bool), "", (), "", segments=seg,
                   positions=positions.astype(np.int32))


@functools.lru_cache(maxsize=2)
def _epoch_stream(task: Documents, seed: int, split: str, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    # the task's hash covers its tokenizer (a field): another tokenizer, another entry
    docs = task.documents(split)
    order = np.random.default_rng([seed, split_id(split), epoch]).permutation(len(docs))
    tokens = np.concatenate([docs[i] for i in order])
    segments = np.repeat(np.arange(len(docs), dtype=np.int32), [len(docs[i]) for i in order])
    return tokens, segments


def _files(path: str, glob: str) -> list[Path]:
    # read through caches shared by every config section: bad values raise ParamError (Task.located names the key)
    root = Path(path).expanduser()
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise ParamError(f"{{params}}.path={path!r} does not exist: the documents task reads a file or a folder")
    files = sorted(p for p in root.glob(glob) if p.is_file()
                   and not any(part.startswith(".") for part in p.relative_to(root).parts))
    if not files:
        raise ParamError(f"{{params}}.path={path!r} has no files matching {{params}}.glob={glob!r}")
    return files


def _is_jsonl(file: Path, fmt: str) -> bool:
    return fmt == "jsonl" or (fmt == "auto" and file.suffix.lower() == ".jsonl")


@functools.lru_cache(maxsize=4)
def _texts(path: str, glob: str, fmt: str, field: str) -> tuple[tuple[str, str], ...]:
    """``(name, text)`` of every document, in file then line order."""
    out = []
    for file in _files(path, glob):
        try:
            raw = file.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise ConfigError(f"{file}: not UTF-8 text ({err.reason} at byte {err.start}); the documents task reads "
                              "text and JSONL files") from err
        if not _is_jsonl(file, fmt):
            if raw:
                out.append((str(file), raw))
            continue
        for n, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ConfigError(f"{file}:{n}: not valid JSON ({err.msg}); each line of a JSONL file is one "
                                  "document") from err
            text = record.get(field) if isinstance(record, dict) else None
            if not isinstance(text, str):
                keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise ParamError(f"{file}:{n}: no string under {{params}}.text_field={field!r} (found: {keys})")
            if text:
                out.append((f"{file}:{n}", text))
    if not out:
        raise ParamError(f"{{params}}.path={path!r}: every document is empty")
    return tuple(out)


def _names(path: str, glob: str, fmt: str, field: str) -> list[str]:
    return [name for name, _ in _texts(path, glob, fmt, field)]


@functools.lru_cache(maxsize=4)
def _tokenized(path: str, glob: str, fmt: str, field: str, tokenizer: Tokenizer) -> list[np.ndarray]:
    return [np.asarray(tokenizer.encode(text, bos=True, eos=True), np.int32)
            for _, text in _texts(path, glob, fmt, field)]


@functools.lru_cache(maxsize=4)
def _split(names: tuple[str, ...], val_fraction: float) -> dict[int, list[int]]:
    ranked = sorted(range(len(names)), key=lambda i: (zlib.crc32(names[i].encode()), names[i]))
    n_val = 0 if val_fraction == 0 or len(names) < 2 else max(1, round(val_fraction * len(names)))
    val = set(ranked[:n_val])
    return {split_id("train"): [i for i in range(len(names)) if i not in val],
            split_id("validation"): sorted(val)}


__all__ = ["Documents"]
