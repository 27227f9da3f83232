"""Built-in data: the byte-level tokenizer (nothing is downloaded at run time)."""

from lcx.data.tokenizer import ByteTokenizer

__all__ = ["ByteTokenizer"]
