"""Byte-level tokenizer: ids 0-255 are the UTF-8 bytes, followed by a few special tokens."""

from __future__ import annotations

import dataclasses


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

    def encode(self, text: str, *, bos: bool = True, eos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def decode(self, ids) -> str:
        """Text of the byte ids; special tokens are dropped and broken UTF-8 becomes U+FFFD."""
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")
