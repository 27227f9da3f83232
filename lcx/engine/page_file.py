"""One page of a ``PageStore`` (``lcx.engine.kv_store``) as a file: ``MAGIC``, the header's size, a JSON header
(each array's name, dtype and shape; the payload's size), the payload, and a 16-byte BLAKE2b digest of everything
before it keyed by the page's key - so a file under another page's name, or with its header edited, is as bad as a
flipped bit. Pure functions from arrays to bytes and back; the store owns the files.
"""

from __future__ import annotations

import hashlib
import json
import struct

import numpy as np

MAGIC = b"LCXKVP2\n"  # 2: the digest covers the key, the header and the payload (1: the payload only)
FAMILY = b"LCXKVP"  # what every format's magic starts with: a file of another version of it is stale, not corrupt
SUFFIX = ".kvp"
DIGEST = 16  # bytes of the trailing digest


def page_digest(key: str, body: bytes) -> bytes:
    """The digest a page file under ``key`` ends with: of ``body`` (everything before it), keyed by the key."""
    return hashlib.blake2b(body, digest_size=DIGEST, key=bytes.fromhex(key)).digest()


def encode_page(key: str, arrays: dict[str, np.ndarray]) -> bytes:
    """The file contents of page ``key`` holding ``arrays``."""
    payload = b"".join(np.ascontiguousarray(x).tobytes() for x in arrays.values())
    header = json.dumps({"arrays": [[n, str(x.dtype), list(x.shape)] for n, x in arrays.items()],
                         "nbytes": len(payload)}).encode()
    body = MAGIC + struct.pack("<Q", len(header)) + header + payload
    return body + page_digest(key, body)


def decode_page(key: str, data: bytes) -> dict[str, np.ndarray]:
    """The arrays of a page file's contents ``data`` read under ``key``; ``ValueError`` naming what is wrong."""
    import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, for dtype names read back)

    if not data.startswith(MAGIC):
        raise ValueError("bad magic")
    if len(data) < len(MAGIC) + 8 + DIGEST:
        raise ValueError("truncated")
    body = data[:-DIGEST]
    # checked before the header is parsed: nothing of a file that is not this page's is trusted
    if page_digest(key, body) != data[-DIGEST:]:
        raise ValueError("checksum (a corrupt file, or another page's)")
    try:
        (size,) = struct.unpack_from("<Q", body, len(MAGIC))
        start = len(MAGIC) + 8
        header = json.loads(body[start:start + size])
        payload = body[start + size:]
        if len(payload) != header["nbytes"]:
            raise ValueError("truncated")
        out, at = {}, 0
        for name, dtype, shape in header["arrays"]:
            dt = np.dtype(dtype)
            if any(not isinstance(s, int) or s < 0 for s in shape):
                raise ValueError(f"shape {shape}")
            n = int(np.prod(shape)) * dt.itemsize
            out[name] = np.frombuffer(payload[at:at + n], dt).reshape(shape)
            at += n
    except (KeyError, TypeError, struct.error, json.JSONDecodeError) as err:
        raise ValueError(f"header: {err}") from err
    if at != len(payload):
        raise ValueError("layout")
    return out


def layout_of(arrays: dict[str, np.ndarray]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """A page's layout: each array's name -> (dtype name, shape)."""
    return {n: (str(x.dtype), tuple(int(s) for s in x.shape)) for n, x in arrays.items()}


__all__ = ["DIGEST", "FAMILY", "MAGIC", "SUFFIX", "decode_page", "encode_page", "layout_of", "page_digest"]
