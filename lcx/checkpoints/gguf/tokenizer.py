"""The tokenizer stored in a GGUF file's metadata, rebuilt with the ``tokenizers`` package (``read_gguf_tokenizer``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from lcx.config_base import ConfigError
from lcx.checkpoints.gguf.file import GGUFFile


@dataclasses.dataclass(frozen=True)
class GGUFTokenizer:
    """A GGUF file's tokenizer: the ``tokenizers.Tokenizer`` and what a ``tokenizer_config.json`` says about it."""

    tokenizer: Any  # tokenizers.Tokenizer
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    unk_id: int | None
    add_bos_token: bool
    add_eos_token: bool
    chat_template: str | None

    def _token(self, tid: int | None) -> str | None:
        return None if tid is None else self.tokenizer.id_to_token(tid)

    @property
    def bos_token(self) -> str | None:
        return self._token(self.bos_id)

    @property
    def eos_token(self) -> str | None:
        return self._token(self.eos_id)

    @property
    def pad_token(self) -> str | None:
        return self._token(self.pad_id)

    @property
    def unk_token(self) -> str | None:
        return self._token(self.unk_id)


_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def _gpt2_pre():
    from tokenizers import pre_tokenizers

    return None, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), False


def _smollm_pre():
    # SmolLM's tokenizer.json (llama.cpp's "smollm": \p{N} then the GPT-2 regex): every digit its own piece
    from tokenizers import pre_tokenizers

    return None, pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                          pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]), False


def _split_pre(regex: str):
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _llama3_pre():
    # Llama 3's tokenizer.json also sets ignore_merges: a pre-token that is itself in the vocabulary is one token
    return None, _split_pre(_LLAMA3_REGEX), True


def _qwen2_pre():
    from tokenizers import normalizers

    return normalizers.NFC(), _split_pre(_QWEN2_REGEX), False


# tokenizer.ggml.pre -> () -> (normalizer, pre-tokenizer, ignore_merges) of the original tokenizer.json
PRE_TOKENIZERS = {"default": _gpt2_pre, "gpt2": _gpt2_pre, "gpt-2": _gpt2_pre, "smollm": _smollm_pre,
                  "llama-bpe": _llama3_pre, "llama3": _llama3_pre, "qwen2": _qwen2_pre}
_CONTROL, _USER_DEFINED, _UNKNOWN = 3, 4, 2  # llama.cpp token types


def read_gguf_tokenizer(path: str | Path) -> GGUFTokenizer:
    """The tokenizer in a GGUF file's metadata (no model tensors are read)."""
    gf = GGUFFile(path)
    return tokenizer_from_metadata(gf.meta, str(gf.path))


def tokenizer_from_metadata(meta: dict[str, Any], where: str) -> GGUFTokenizer:
    model = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if model not in ("gpt2", "llama"):
        raise ConfigError(f"{where}: tokenizer.ggml.model={model!r} is not supported; allowed: ['gpt2', 'llama']")
    if not tokens:
        raise ConfigError(f"{where}: tokenizer.ggml.tokens is missing or empty; the file has no tokenizer")
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    if model == "llama" and unk is None:
        unk = next((i for i, t in enumerate(types) if t == _UNKNOWN), None)
    tok = _bpe(meta, tokens, where) if model == "gpt2" else _sentencepiece(meta, tokens, unk, where)
    _add_special(tok, tokens, types)
    info = GGUFTokenizer(
        tokenizer=tok, bos_id=meta.get("tokenizer.ggml.bos_token_id"), eos_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_id=meta.get("tokenizer.ggml.padding_token_id"), unk_id=unk,
        # llama.cpp's defaults: SentencePiece vocabularies add BOS, byte-level BPE ones (GPT-2) do not
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", model == "llama")),
        add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        chat_template=meta.get("tokenizer.chat_template"))
    _post_processor(info)
    return info


def _merges(meta: dict[str, Any], where: str) -> list[tuple[str, str]] | None:
    raw = meta.get("tokenizer.ggml.merges")
    if raw is None:
        return None
    merges = []
    for merge in raw:
        # "left right"; the separator is the first space after the first character (as llama.cpp splits them)
        cut = merge.find(" ", 1)
        if cut < 0:
            raise ConfigError(f"{where}: tokenizer.ggml.merges holds {merge!r}, not a 'left right' pair")
        merges.append((merge[:cut], merge[cut + 1:]))
    return merges


def _bpe(meta: dict[str, Any], tokens: list[str], where: str):
    from tokenizers import Tokenizer, decoders
    from tokenizers.models import BPE

    pre = meta.get("tokenizer.ggml.pre") or "default"
    if pre not in PRE_TOKENIZERS:
        raise ConfigError(f"{where}: tokenizer.ggml.pre={pre!r} is not supported; allowed: {sorted(PRE_TOKENIZERS)}")
    merges = _merges(meta, where)
    if merges is None:
        raise ConfigError(f"{where}: a 'gpt2' tokenizer needs tokenizer.ggml.merges (missing)")
    normalizer, pre_tokenizer, ignore_merges = PRE_TOKENIZERS[pre]()
    tok = Tokenizer(BPE({t: i for i, t in enumerate(tokens)}, merges, dropout=None, continuing_subword_prefix="",
                        end_of_word_suffix="", fuse_unk=False, byte_fallback=False, ignore_merges=ignore_merges))
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(meta: dict[str, Any], tokens: list[str], unk: int | None, where: str):
    """SentencePiece BPE with byte fallback, "▁" for spaces, as Llama 2's own tokenizer.json.

    The space prefix is a normalizer (prepend "▁" to every text segment) rather than a Metaspace pre-tokenizer with
    prepend_scheme="first": Metaspace skips the prefix when the text already starts with a space and after special
    tokens, where SentencePiece and llama.cpp add it."""
    from tokenizers import Tokenizer, decoders, normalizers
    from tokenizers.models import BPE

    merges = _merges(meta, where)
    if merges is None:
        scores = meta.get("tokenizer.ggml.scores")
        if not scores or len(scores) != len(tokens):
            raise ConfigError(f"{where}: a 'llama' tokenizer needs tokenizer.ggml.merges or one score per token "
                              "(tokenizer.ggml.scores)")
        merges = _merges_from_scores(tokens, scores)
    tok = Tokenizer(BPE({t: i for i, t in enumerate(tokens)}, merges, unk_token=None if unk is None else tokens[unk],
                        fuse_unk=True, byte_fallback=True))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    tok.normalizer = normalizers.Sequence(([normalizers.Prepend("▁")] if prefix else [])
                                          + [normalizers.Replace(" ", "▁")])
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(content=" ", left=1, right=0)] if prefix else []))
    return tok


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges of a SentencePiece vocabulary: every split of a piece into two pieces, ordered by the merged
    piece's score (then the parts' scores) - transformers' GGUFTokenizerSkeleton, with dict lookups."""
    score = {t: scores[i] for i, t in enumerate(tokens)}
    merges = []
    for piece, piece_score in score.items():
        local = [(piece[:k], piece[k:], piece_score) for k in range(1, len(piece))
                 if piece[:k] in score and piece[k:] in score]
        local.sort(key=lambda m: (score[m[0]], score[m[1]]), reverse=True)
        merges.extend(local)
    merges.sort(key=lambda m: m[2], reverse=True)
    return [(left, right) for left, right, _ in merges]


def _add_special(tok, tokens: list[str], types: list[int]) -> None:
    """Control (and unknown) tokens become special added tokens, user-defined ones plain added tokens: matched
    in the raw text before pre-tokenization, as llama.cpp and transformers do."""
    from tokenizers import AddedToken

    special = [AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, types)
               if k in (_CONTROL, _UNKNOWN)]
    user = [AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types) if k == _USER_DEFINED]
    if special:
        tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)


def _post_processor(info: GGUFTokenizer) -> None:
    """BOS/EOS added by ``encode(add_special_tokens=True)`` as ``add_bos_token`` / ``add_eos_token`` say (lcx's own
    ``HFTokenizer`` adds them itself; this is for transformers and the ``tokenizers`` package)."""
    from tokenizers import processors

    head = [info.bos_token] if info.add_bos_token and info.bos_token is not None else []
    tail = [info.eos_token] if info.add_eos_token and info.eos_token is not None else []
    if not head and not tail:
        return
    ids = {info.bos_token: info.bos_id, info.eos_token: info.eos_id}
    single = " ".join([f"{t}:0" for t in head] + ["$A:0"] + [f"{t}:0" for t in tail])
    pair = single + " " + " ".join([f"{t}:1" for t in head] + ["$B:1"] + [f"{t}:1" for t in tail])
    info.tokenizer.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[(t, ids[t]) for t in dict.fromkeys(head + tail)])


__all__ = ["ARCHITECTURES", "PRE_TOKENIZERS", "TENSOR_TYPES", "GGUFFile", "GGUFTensorReader", "GGUFTokenizer",
           "assemble", "hf_config", "load_gguf", "read_gguf", "read_gguf_config", "read_gguf_params",
           "read_gguf_tokenizer", "tokenizer_from_metadata"]


__all__ = ['GGUFTokenizer', 'PRE_TOKENIZERS', 'read_gguf_tokenizer', 'tokenizer_from_metadata']
