"""Tokenizers: lcx's byte-level one, and a Hugging Face ``tokenizer.json`` read with the ``tokenizers`` package.

Both offer the same small surface - ``encode(text, bos=, eos=)``, ``decode(ids)``, ``bos_id``, ``eos_id``, ``pad_id``,
``vocab_size`` and ``spec`` (what a run records to find the tokenizer again). ``resolve_tokenizer`` turns the
``data.tokenizer`` setting into one:

- ``bytes``: UTF-8 bytes plus PAD, BOS, EOS, SEP (260 ids);
- a path: a ``tokenizer.json`` file, or a directory holding one (a Hugging Face checkpoint);
- ``auto`` (the default): the tokenizer of the model a run starts from - a Hugging Face ``init_from`` directory's
  ``tokenizer.json``, or the tokenizer an lcx ``init_from`` run recorded - else ``bytes``.

The tokenizer must fit the model: more ids than ``model.vocab_size`` is an error, never a silent fallback to bytes.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from lcx.config_base import ConfigError

BYTES = "bytes"
AUTO = "auto"


@dataclasses.dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes plus PAD, BOS, EOS and SEP. ``vocab_size`` = 260; models using it need at least that many."""

    pad_id: int = 256
    bos_id: int = 257
    eos_id: int = 258
    sep_id: int = 259

    @property
    def vocab_size(self) -> int:
        return 260

    @property
    def spec(self) -> str:
        return BYTES

    def encode(self, text: str, *, bos: bool = True, eos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def decode(self, ids) -> str:
        """Text of the byte ids; special tokens are dropped and broken UTF-8 becomes U+FFFD."""
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``tokenizer.json`` (``tokenizers`` package). BOS/EOS/PAD ids come from the files beside it
    (``tokenizer_config.json``, then ``config.json``), else from the usual token names (``<s>``, ``</s>``,
    ``<|endoftext|>``, ...); ``encode`` adds BOS/EOS explicitly instead of running the file's post-processor, so that
    ``bos=False`` means no BOS whatever the file says."""

    def __init__(self, path: str | Path):
        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise ConfigError(f"data.tokenizer={str(path)!r} is invalid: no tokenizer.json there (expected a "
                              "tokenizer.json file or a directory holding one, or 'bytes' / 'auto')")
        try:
            from tokenizers import Tokenizer
        except ImportError as err:
            raise ConfigError(f"{file} needs the 'tokenizers' package (pip install tokenizers)") from err
        try:
            self._tok = Tokenizer.from_file(str(file))
        except Exception as err:  # the Rust library raises its own exception types
            raise ConfigError(f"{file} is not a readable tokenizer.json: {err}") from err
        self.file = file.resolve()
        ids = _special_ids(file.parent, self._tok)
        self.bos_id, self.eos_id = ids["bos"], ids["eos"]
        self.pad_id = ids["pad"] if ids["pad"] is not None else (self.eos_id if self.eos_id is not None else 0)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def spec(self) -> str:
        return str(self.file)

    def encode(self, text: str, *, bos: bool = True, eos: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        head = [self.bos_id] if bos and self.bos_id is not None else []
        tail = [self.eos_id] if eos and self.eos_id is not None else []
        return head + ids + tail

    def decode(self, ids) -> str:
        special = {self.bos_id, self.eos_id, self.pad_id}
        return self._tok.decode([int(i) for i in ids if int(i) not in special], skip_special_tokens=True)


_NAMES = {"bos": ("<s>", "<|begin_of_text|>", "<bos>", "<|endoftext|>"),
          "eos": ("</s>", "<|end_of_text|>", "<|eot_id|>", "<eos>", "<|endoftext|>"),
          "pad": ("<pad>", "<|pad|>", "[PAD]")}


def _special_ids(folder: Path, tok) -> dict[str, int | None]:
    found: dict[str, int | None] = {"bos": None, "eos": None, "pad": None}
    for name in ("tokenizer_config.json", "config.json"):
        try:
            data = json.loads((folder / name).read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict):
            continue
        for kind in found:
            if found[kind] is not None:
                continue
            token = data.get(f"{kind}_token")
            token = token.get("content") if isinstance(token, dict) else token
            tid = tok.token_to_id(token) if isinstance(token, str) else None
            if tid is None:
                raw = data.get(f"{kind}_token_id")
                tid = raw[0] if isinstance(raw, list) and raw else raw
            found[kind] = tid if isinstance(tid, int) else None
    for kind, names in _NAMES.items():
        for name in names:
            if found[kind] is None:
                found[kind] = tok.token_to_id(name)
    return found


Tokenizer = ByteTokenizer | HFTokenizer


def resolve_tokenizer(setting: str, *, init_from: str | Path | None = None, vocab_size: int | None = None,
                      key: str = "data.tokenizer") -> Tokenizer:
    """The tokenizer ``setting`` names (see the module docstring), checked against the model's ``vocab_size``."""
    if not isinstance(setting, str) or not setting:
        raise ConfigError(f"{key}={setting!r} is invalid: must be 'auto', 'bytes' or a path to a tokenizer.json")
    if setting == AUTO:
        setting = _auto_setting(init_from)
    tok = ByteTokenizer() if setting == BYTES else HFTokenizer(Path(setting).expanduser())
    if vocab_size is not None and tok.vocab_size > vocab_size:
        source = "lcx's byte tokenizer" if setting == BYTES else str(getattr(tok, "file", setting))
        raise ConfigError(f"{key}={setting!r}: {source} has {tok.vocab_size} ids but model.vocab_size={vocab_size}; "
                          "the tokenizer does not belong to this model (choose the model's own tokenizer, or a "
                          "model with a vocabulary at least that large)")
    return tok


def _auto_setting(init_from: str | Path | None) -> str:
    """``auto``: the tokenizer of the model a run starts from (HF directory or recorded by an lcx run), else bytes."""
    if init_from is None:
        return BYTES
    path = Path(init_from).expanduser()
    if (path / "config.json").is_file():  # a Hugging Face directory
        return str(path) if (path / "tokenizer.json").is_file() else BYTES
    recorded = run_tokenizer(path)
    return recorded if recorded is not None else BYTES


def run_tokenizer(path: str | Path) -> str | None:
    """The tokenizer spec an lcx run recorded (``data.tokenizer`` in its ``config.yaml``), looked up from the run,
    a stage or a checkpoint directory; None when nothing is recorded."""
    import yaml

    path = Path(path).resolve()
    for folder in (path, *path.parents[:4]):
        config = folder / "config.yaml"
        if config.is_file():
            try:
                data = yaml.safe_load(config.read_text()) or {}
            except yaml.YAMLError:
                return None
            spec = (data.get("data") or {}).get("tokenizer") if isinstance(data, dict) else None
            if isinstance(spec, str) and spec != AUTO:
                return spec
    return None


__all__ = ["AUTO", "BYTES", "ByteTokenizer", "HFTokenizer", "Tokenizer", "resolve_tokenizer", "run_tokenizer"]
