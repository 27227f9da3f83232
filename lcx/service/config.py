"""``ServeConfig``: everything ``lcx serve`` is started with, checked at start (one error naming the flag, the value
and what is allowed), and ``build``: the model, the cache, the pool, the store and the engine it describes."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

from lcx.config_base import ConfigError

DEFAULT_MAX_TOKENS = 256  # a chat request without max_tokens: at most this many, never past the context


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """``lcx serve``'s options (the flags of the same names). ``kv_memory``: the KV budget in bytes; else
    ``gpu_memory_utilization`` of the device's free memory after the weights; else every row at its largest.
    ``cache_params``: the policy's parameters (``--cache-param key=value``). ``kv_store``: a directory for pages
    that survive restarts (None: host memory only). ``segment``: decode steps between admissions;
    ``prefill_chunk``: prompt tokens per row and step; ``idempotency_ttl``: seconds a key is remembered;
    ``max_body_bytes``: the largest request body (413 past it, read no further); ``max_connections`` /
    ``header_timeout``: open connections at most, seconds for a request head to arrive (``lcx.service.run``);
    ``warmup``: prompt lengths whose programs are compiled before serving (``--warmup``, ``lcx.service.warmup``)."""

    model: str
    host: str = "127.0.0.1"
    port: int = 8000
    max_num_seqs: int = 8
    max_model_len: int = 4096
    page_size: int = 16
    kv_memory: int | None = None
    gpu_memory_utilization: float | None = None
    cache_policy: str = "full"
    cache_params: tuple[tuple[str, Any], ...] = ()
    kv_dtype: str | None = None
    kv_store: str | None = None
    kv_store_bytes: int = 16 << 30
    host_store_bytes: int = 2 << 30
    api_key: str | None = None
    served_model_name: str | None = None
    segment: int = 8
    prefill_chunk: int = 256
    prefix_entries: int = 8
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    idempotency_ttl: float = 600.0
    dtype: str | None = None
    max_body_bytes: int = 32 << 20
    max_connections: int = 1024
    header_timeout: float = 10.0
    warmup: str | None = None

    def __post_init__(self):
        for flag, value in (("--port", self.port), ("--max-num-seqs", self.max_num_seqs),
                            ("--max-model-len", self.max_model_len), ("--page-size", self.page_size),
                            ("--segment", self.segment), ("--prefill-chunk", self.prefill_chunk),
                            ("--default-max-tokens", self.default_max_tokens),
                            ("--max-body-bytes", self.max_body_bytes), ("--max-connections", self.max_connections)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{flag}={value!r} is invalid: must be a positive integer")
        t = self.header_timeout
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
            raise ConfigError(f"--header-timeout={t!r} is invalid: must be a positive number of seconds")
        if self.port > 65535:
            raise ConfigError(f"--port={self.port} is invalid: must be in 1 .. 65535")
        if self.kv_memory is not None and self.gpu_memory_utilization is not None:
            raise ConfigError("--kv-memory and --gpu-memory-utilization both given: pass one (the KV budget in "
                              "bytes, or the fraction of free device memory)")
        u = self.gpu_memory_utilization
        if u is not None and (isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1):
            raise ConfigError(f"--gpu-memory-utilization={u!r} is invalid: must be a fraction in (0, 1]")
        from lcx.service.warmup import parse_warmup

        parse_warmup(self.warmup)  # a bad --warmup is refused before the model loads

    @property
    def name(self) -> str:
        """The model's name in requests and ``/v1/models``."""
        return self.served_model_name or Path(self.model).name

    def cache(self):
        """The ``CacheConfig`` of ``--cache-policy`` / ``--cache-param`` / ``--page-size`` / ``--kv-dtype``; a
        policy the server cannot run is refused with the allowed values."""
        from lcx.cache.config import CacheConfig
        from lcx.engine.server import server_policies

        spec = {"policy": self.cache_policy, "layout": "paged", "page_size": self.page_size,
                "kv_dtype": self.kv_dtype, **dict(self.cache_params)}
        cache = CacheConfig.from_mapping(spec, prefix="--cache-param")
        allowed = server_policies()
        if cache.policy not in allowed:
            raise ConfigError(f"--cache-policy={cache.policy!r} cannot run in lcx serve (it needs calibration or "
                              f"a cache type of its own); allowed: {', '.join(allowed)}")
        return cache


def fingerprint(params) -> str:
    """A digest of the weights' contents (dtype, shape and bytes of every leaf): pages stored for one model are
    never read by another, whatever its files are called."""
    import jax
    import numpy as np

    h = hashlib.blake2b(digest_size=16)
    for path, leaf in sorted(jax.tree_util.tree_leaves_with_path(params), key=lambda x: jax.tree_util.keystr(x[0])):
        x = np.asarray(leaf)
        h.update(f"{jax.tree_util.keystr(path)}:{x.dtype}:{x.shape}".encode())
        h.update(np.ascontiguousarray(x).tobytes())
    return h.hexdigest()


def store_namespace(params, cache, model) -> str:
    """What a stored page depends on besides its tokens: the weights, the model config and the cache settings."""
    settings = {"cache": cache.to_dict(), "model": dataclasses.asdict(model)}
    return fingerprint(params) + ":" + json.dumps(settings, sort_keys=True, default=str)


__all__ = ["DEFAULT_MAX_TOKENS", "ServeConfig", "fingerprint", "store_namespace"]
