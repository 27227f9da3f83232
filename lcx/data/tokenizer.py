"""Tokenizers: lcx's byte-level one, and a Hugging Face ``tokenizer.json`` read with the ``tokenizers`` package.

Both offer the same small surface - ``encode(text, bos=, eos=)``, ``decode(ids)``, ``bos_id``, ``eos_id``, ``pad_id``,
``adds_bos``, ``vocab_size`` and ``spec`` (what a run records to find the tokenizer again). ``resolve_tokenizer`` turns
the ``data.tokenizer`` setting into one:

- ``bytes``: UTF-8 bytes plus PAD, BOS, EOS, SEP (260 ids);
- a path: a ``tokenizer.json`` file, a directory holding one (a Hugging Face checkpoint), or a GGUF model file
  (``.gguf``: the tokenizer in its metadata, built by ``lcx.checkpoints.gguf``);
- ``auto`` (the default): the tokenizer of the model a run starts from or evaluates - a Hugging Face directory's
  ``tokenizer.json``, a GGUF file's own, or the tokenizer an lcx run recorded - else ``bytes``.

The tokenizer must fit the model: more ids than ``model.vocab_size`` is an error, never a silent fallback to bytes.

``adds_bos``: whether a text prompt begins with BOS - what the tokenizer itself does (a GGUF's
``tokenizer.ggml.add_bos_token``, a tokenizer.json's post-processor; lcx's byte tokenizer: yes, its models were
trained so), so that lcx's prompt ids are the ones transformers, vLLM and llama.cpp feed the same model.
``encode(text, bos=...)`` still does what its caller asks; ``prompt_bos`` is the rule prompts follow.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from lcx.config_base import ConfigError

BYTES = "bytes"
AUTO = "auto"
LONG_TEXT = 1 << 16  # characters past which encoding runs without the GIL (encode_batch)


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

    @property
    def adds_bos(self) -> bool:
        """Whether a text prompt begins with BOS - yes (with a BOS id), as lcx's byte-level models were trained."""
        return self.bos_id is not None

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
    ``bos=False`` means no BOS whatever the file says. ``adds_bos``: whether the file's post-processor puts BOS
    before a single text (``tokenizers`` encodes a probe with and without special tokens) - what prompts follow.

    A ``.gguf`` path: the tokenizer built from the GGUF metadata, with its BOS/EOS/PAD ids. ``chat_template``: the
    chat template (``chat_template.jinja`` or ``tokenizer_config.json`` beside the tokenizer.json, or the GGUF's
    ``tokenizer.chat_template``), None when there is none. For a ``.gguf`` ``adds_bos`` is the file's
    ``tokenizer.ggml.add_bos_token`` (absent: llama.cpp's default - SentencePiece vocabularies add BOS, BPE ones
    do not)."""

    def __init__(self, path: str | Path):
        path = Path(path)
        if path.suffix.lower() == ".gguf" and path.is_file():
            self._from_gguf(path)
            return
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise ConfigError(f"data.tokenizer={str(path)!r} is invalid: no tokenizer.json there (expected a "
                              "tokenizer.json file, a directory holding one or a .gguf model file, or 'bytes' / "
                              "'auto')")
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
        self._set_ids(ids["bos"], ids["eos"], ids["pad"])
        self.adds_bos: bool = _post_processor_adds(self._tok, self.bos_id)
        self.chat_template: str | None = _chat_template(file.parent)

    def _from_gguf(self, path: Path) -> None:
        from lcx.checkpoints.gguf import read_gguf_tokenizer  # here: gguf and the model modules load only for a .gguf

        info = read_gguf_tokenizer(path)
        self._tok = info.tokenizer
        self.file = path.resolve()
        self._set_ids(info.bos_id, info.eos_id, info.pad_id)
        # the file's flag itself (its post-processor, built from the same flag, would say the same)
        self.adds_bos = bool(info.add_bos_token) and self.bos_id is not None
        self.chat_template = info.chat_template

    def _set_ids(self, bos: int | None, eos: int | None, pad: int | None) -> None:
        self.bos_id, self.eos_id = bos, eos
        self.pad_id = pad if pad is not None else (eos if eos is not None else 0)

    # Equal when they read the same file with the same special ids: a task compares (and hashes) its tokenizer, and
    # two loads of one checkpoint's tokenizer build the same examples.
    def __eq__(self, other) -> bool:
        return isinstance(other, HFTokenizer) and self._identity == other._identity

    def __hash__(self) -> int:
        return hash(self._identity)

    @property
    def _identity(self) -> tuple:
        return (self.spec, self.bos_id, self.eos_id, self.pad_id, self.adds_bos)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def spec(self) -> str:
        return str(self.file)

    def encode(self, text: str, *, bos: bool = True, eos: bool = False) -> list[int]:
        # tokenizers' encode_batch releases the GIL (encode does not): a long text encoded on a worker thread (the
        # server's) must not stall the other threads for seconds
        ids = (self._tok.encode_batch([text], add_special_tokens=False)[0] if len(text) > LONG_TEXT else
               self._tok.encode(text, add_special_tokens=False)).ids
        head = [self.bos_id] if bos and self.bos_id is not None else []
        tail = [self.eos_id] if eos and self.eos_id is not None else []
        return head + ids + tail

    def decode(self, ids) -> str:
        special = {self.bos_id, self.eos_id, self.pad_id}
        return self._tok.decode([int(i) for i in ids if int(i) not in special], skip_special_tokens=True)


def _post_processor_adds(tok, bos_id: int | None) -> bool:
    """Whether ``tok``'s post-processor puts ``bos_id`` before a single sequence (TemplateProcessing,
    RobertaProcessing, BertProcessing, a Sequence holding one, ...): asked of the library rather than read from the
    JSON, so every processor type answers the same way. The probe text's own first id is compared too, so a text
    that begins with the BOS token's text is not mistaken for an added one."""
    if bos_id is None:
        return False
    probe = "a"
    plain = tok.encode(probe, add_special_tokens=False).ids
    framed = tok.encode(probe, add_special_tokens=True).ids
    return len(framed) > len(plain) and framed[0] == bos_id and plain[:1] != [bos_id]


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


def _chat_template(folder: Path) -> str | None:
    """The chat template beside a tokenizer.json: ``chat_template.jinja`` (where transformers v5 saves it), else
    ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of named templates: the "default" one)."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    try:
        data = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    template = data.get("chat_template") if isinstance(data, dict) else None
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


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
        source = describe(tok)
        raise ConfigError(f"{key}={setting!r}: {source} has {tok.vocab_size} ids but model.vocab_size={vocab_size}; "
                          "the tokenizer does not belong to this model (choose the model's own tokenizer, or a "
                          "model with a vocabulary at least that large)")
    return tok


def prompt_bos(tokenizer) -> bool:
    """Whether a text prompt in ``tokenizer``'s ids begins with its BOS: the tokenizer's ``adds_bos`` (an object
    without it - a tokenizer written for lcx before it existed - keeps the old rule: BOS whenever there is an id)."""
    if tokenizer.bos_id is None:
        return False
    return bool(getattr(tokenizer, "adds_bos", True))


def describe(tokenizer) -> str:
    """A tokenizer as messages name it: lcx's byte tokenizer, or its file."""
    return "lcx's byte tokenizer" if tokenizer.spec == BYTES else str(tokenizer.spec)


def check_model_tokens(tokenizer, ids, vocab_size: int, what: str) -> None:
    """Refuse token ids that are not the model's before they reach it (``what`` names their source, e.g. ``task
    'passkey'``): a ``tokenizer`` with more ids than the model's ``vocab_size``, one that covers under half of it,
    or any of ``ids`` (arrays) past the vocabulary.

    Under half: lcx's 260 byte ids fed to a 49,152-token BPE model is what a task that lost the run's tokenizer
    looks like, and it runs without an error - the model reads garbage and every score is 0. Checkpoints pad their
    vocabulary by far less (Qwen2 0.2%, Gemma 3 0.02%); a byte-level lcx model has 260 rows."""
    n = tokenizer.vocab_size
    if n > vocab_size or 2 * n < vocab_size:
        relation = "more ids than" if n > vocab_size else "under half of"
        raise ConfigError(f"{what} builds its tokens with {describe(tokenizer)} ({n} ids), {relation} the model's "
                          f"vocabulary of {vocab_size}: these are not the model's tokens. Build the task with the "
                          "model's own tokenizer: data.tokenizer: auto takes a checkpoint's tokenizer.json or GGUF "
                          "metadata (a directory without tokenizer.json falls back to bytes), data.tokenizer: PATH "
                          "names one; Task.with_tokenizer in code")
    top = max((int(np.max(row)) for row in ids if len(row)), default=-1)
    low = min((int(np.min(row)) for row in ids if len(row)), default=0)
    if top >= vocab_size or low < 0:
        bad = top if top >= vocab_size else low
        raise ConfigError(f"{what} has token id {bad} in its prompts, outside the model's vocabulary [0, {vocab_size})"
                          f" ({describe(tokenizer)})")


def _auto_setting(init_from: str | Path | None) -> str:
    """``auto``: the tokenizer of the model a run starts from (HF directory or recorded by an lcx run), else bytes."""
    if init_from is None:
        return BYTES
    path = Path(init_from).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":  # the tokenizer lives in the model file's metadata
        return str(path.resolve())
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


__all__ = ["AUTO", "BYTES", "ByteTokenizer", "HFTokenizer", "Tokenizer", "check_model_tokens", "describe",
           "prompt_bos", "resolve_tokenizer", "run_tokenizer"]
