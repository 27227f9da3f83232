"""A text corpus from a folder of files, chunked into fixed windows for language modelling (task ``corpus``).

Default folder: the Python standard library's own ``.py`` sources (``sysconfig.get_paths()["stdlib"]``, without
``site-packages``), present on every machine, so a language-modelling run needs no download.

Split by file, deterministic: files are ordered by a CRC32 of their relative path and the first
``round(val_fraction * n)`` (at least one when there are two or more files) are the validation split. Each split is
one token stream - per file ``BOS, bytes..., EOS`` in path order - cut into windows of ``seq_len + 1`` tokens with
stride ``seq_len`` (a window's last target is the next window's first input). Batch ``index`` takes the next
``count`` windows of a shuffled order; epoch ``e`` is the permutation ``default_rng([seed, split_id, e])``, so a
data position is just a window counter and resume replays the identical batches.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sysconfig
import zlib
from pathlib import Path
from typing import ClassVar

import numpy as np

from lcx.config_base import ConfigError
from lcx.data.task import TOKENIZER, Example, ParamError, Task, register, split_id

_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def stdlib_path() -> str:
    return sysconfig.get_paths()["stdlib"]


@register
@dataclasses.dataclass(frozen=True)
class Corpus(Task):
    """``path``: a folder (null: the standard library); ``glob``: which files (null: ``**/*.py`` for the standard
    library, every file otherwise); hidden files and ``site-packages``/``__pycache__`` folders are skipped.
    ``bos``: start every window with BOS (then seq_len tokens of text), as language models are trained - the first
    token of every context is then the same, the token a model learns to park attention on (an attention sink).
    """

    name: ClassVar[str] = "corpus"
    metric: ClassVar[str] = "perplexity"
    accepts_tokenizer: ClassVar[bool] = False  # a byte stream; the ``prose`` and ``documents`` tasks take any
    path: str | None = None
    glob: str | None = None
    val_fraction: float = 0.05
    bos: bool = False

    def __post_init__(self):
        self._check_accepts(self.tokenizer)  # a copy given another tokenizer (dataclasses.replace) too
        if not 0.0 <= self.val_fraction < 1.0:
            raise ConfigError(f"{self.key('val_fraction')}={self.val_fraction!r} is invalid: must be in [0, 1)")

    @property
    def starts_with_bos(self) -> bool | None:
        return True if self.bos else None  # without it a window starts wherever the stream is cut

    @property
    def root(self) -> Path:
        return Path(self.path).expanduser() if self.path is not None else Path(stdlib_path())

    @property
    def pattern(self) -> str:
        if self.glob is not None:
            return self.glob
        return "**/*.py" if self.path is None else "**/*"

    def files(self, split: str) -> list[Path]:
        """The files of ``split`` (``train`` or ``validation``), in path order."""
        with self.located():
            return [self.root / rel for rel in _split_files(str(self.root), self.pattern, self.val_fraction)[split]]

    def stream(self, split: str) -> np.ndarray:
        """The token stream of ``split``: uint16 ``[n]``."""
        with self.located():
            return _stream(str(self.root), self.pattern, self.val_fraction, split)

    def num_windows(self, seq_len: int, split: str = "train") -> int:
        n = (len(self.stream(split)) - 1) // seq_len
        if n < 1:
            raise ConfigError(f"{self.key('path')}={str(self.root)!r}: the {split} split has "
                              f"{len(self.stream(split))} tokens, fewer than one window of seq_len + 1 = "
                              f"{seq_len + 1}; add files or lower seq_len")
        return n

    def examples(self, seed: int, index: int, count: int, seq_len: int, split: str = "train") -> list[Example]:
        stream, n = self.stream(split), self.num_windows(seq_len, split)
        out = []
        for pos in range(index * count, (index + 1) * count):
            window = int(_permutation(seed, split_id(split), pos // n, n)[pos % n])
            out.append(self._window(stream, window * seq_len, seq_len))
        return out

    def example(self, rng: np.random.Generator, seq_len: int) -> Example:
        """A random window (for ad-hoc use; batches go through ``examples``)."""
        stream = self.stream("train")
        return self._window(stream, int(rng.integers(0, self.num_windows(seq_len))) * seq_len, seq_len)

    def _window(self, stream: np.ndarray, start: int, seq_len: int) -> Example:
        """``seq_len + 1`` tokens from ``start`` (BOS and ``seq_len`` of them with ``bos``); all are targets."""
        if self.bos:
            ids = np.concatenate([[TOKENIZER.bos_id], stream[start: start + seq_len]]).astype(np.int32)
        else:
            ids = stream[start: start + seq_len + 1].astype(np.int32)
        return Example(ids, np.ones(len(ids), bool), "", (), "")


def _walk(root: Path, pattern: str) -> list[str]:
    if not root.is_dir():
        raise ParamError(f"{{params}}.path={str(root)!r} is not a folder; the corpus task reads a folder of files")
    found = []
    for path in root.glob(pattern):
        rel = path.relative_to(root)
        if any(part.startswith(".") or part in _SKIP_DIRS for part in rel.parts):
            continue
        if path.is_file():
            found.append(rel.as_posix())
    if not found:
        raise ParamError(f"{{params}}.path={str(root)!r} has no files matching {{params}}.glob={pattern!r}; the "
                         "corpus needs at least one non-empty file")
    return sorted(found)


@functools.lru_cache(maxsize=8)
def _split_files(root: str, pattern: str, val_fraction: float) -> dict[str, list[str]]:
    # cached per source, whichever config section names it: bad values raise ParamError (Task.located names the key)
    if pattern == "**/*.py" and Path(root) == Path(stdlib_path()):
        files = _walk_pruned(Path(root), ".py")  # rglob would also walk site-packages, 5x the files
    else:
        files = _walk(Path(root), pattern)
    ranked = sorted(files, key=lambda rel: (zlib.crc32(rel.encode()), rel))
    n_val = 0 if val_fraction == 0 or len(files) < 2 else max(1, round(val_fraction * len(files)))
    val = set(ranked[:n_val])
    return {"train": [f for f in files if f not in val], "validation": [f for f in files if f in val]}


def _walk_pruned(root: Path, suffix: str) -> list[str]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        rel_dir = Path(dirpath).relative_to(root)
        found += [(rel_dir / f).as_posix() for f in filenames if f.endswith(suffix) and not f.startswith(".")]
    if not found:
        raise ParamError(f"{{params}}.path={str(root)!r} has no {suffix} files")
    return sorted(found)


@functools.lru_cache(maxsize=8)
def _stream(root: str, pattern: str, val_fraction: float, split: str) -> np.ndarray:
    files = _split_files(root, pattern, val_fraction)[_checked(split)]
    if not files:
        raise ParamError(f"{{params}}.path={root!r}: the {split} split has no files (val_fraction={val_fraction}, "
                         f"{len(_split_files(root, pattern, val_fraction)['train'])} files in all)")
    pieces = []
    for rel in files:
        data = np.frombuffer((Path(root) / rel).read_bytes(), np.uint8)
        if data.size:
            pieces += [np.asarray([TOKENIZER.bos_id], np.uint16), data.astype(np.uint16),
                       np.asarray([TOKENIZER.eos_id], np.uint16)]
    if not pieces:
        raise ParamError(f"{{params}}.path={root!r}: every file of the {split} split is empty")
    return np.concatenate(pieces)


def _checked(split: str) -> str:
    split_id(split)  # validates
    return split


@functools.lru_cache(maxsize=4)
def _permutation(seed: int, split: int, epoch: int, n: int) -> np.ndarray:
    return np.random.default_rng([seed, split, epoch]).permutation(n)


__all__ = ["Corpus", "stdlib_path"]
