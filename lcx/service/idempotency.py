"""``Idempotency-Key``: a retried request gets the generation the first one started - same ``id``, same text,
generated once - for ``ttl`` seconds after it began; the same key with a different body is refused (422).

Keys live in the app's event loop (no lock needed) and expire; a generation that was cancelled (its client went
away) or failed is not replayed: a retry after it starts a new one.
"""

from __future__ import annotations

import hashlib
import json
import time

from lcx.service.protocol import ApiError

PRESENTATION = ("stream", "stream_options")
MAX_KEY = 255  # characters: the header of a well-behaved client is a UUID


class IdempotencyKeys:
    def __init__(self, ttl: float):
        self.ttl = ttl
        self._entries: dict[str, tuple[str, object, float]] = {}  # key -> (body digest, generation, expiry)

    @staticmethod
    def digest(endpoint: str, body: dict) -> str:
        """What a retry must repeat: the endpoint and the body but how it is delivered (``stream``,
        ``stream_options``: a retry may stream the completion the first request waited for, or the reverse)."""
        what = {k: v for k, v in body.items() if k not in PRESENTATION}
        return hashlib.sha256(json.dumps([endpoint, what], sort_keys=True).encode()).hexdigest()

    def get(self, key: str, digest: str):
        """The live generations of ``key`` (a list, one per choice; None if none); ``ApiError`` 422 if ``key`` came
        with another body."""
        if not key or len(key) > MAX_KEY:
            raise ApiError(400, f"Idempotency-Key of {len(key)} characters is invalid: must be 1 to {MAX_KEY}",
                           "Idempotency-Key")
        now = time.monotonic()
        for k in [k for k, (_, _, expiry) in self._entries.items() if expiry < now]:
            del self._entries[k]
        entry = self._entries.get(key)
        if entry is None:
            return None
        seen, gens, _ = entry
        if seen != digest:
            raise ApiError(422, f"Idempotency-Key {key!r:.80} was used with a different request body; a retry must "
                           "send the same body (or use a new key)", "Idempotency-Key", code="idempotency_key_reused")
        if any(gen.finish_reason in ("cancelled", "error") for gen in gens):
            del self._entries[key]
            return None
        return gens

    def put(self, key: str, digest: str, gens: list) -> None:
        self._entries[key] = (digest, gens, time.monotonic() + self.ttl)


__all__ = ["IdempotencyKeys"]
