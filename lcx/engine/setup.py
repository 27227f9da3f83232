"""One serve configuration, resolved once: ``resolve`` checks a paged cache config and the server's sizes against a
model and returns a ``ServeSetup`` - the cache config, its policy and cache kind, a row's pages, the pool, the
prefill chunk and what may be kept (prefixes, a store) - that ``Server`` and its parts read and never re-check.

``lcx serve`` resolves it through ``lcx.service.config.ServeConfig.resolve`` (the same function, its errors named by
flag) and ``lcx plan --serve`` sizes its pool from it (``lcx.plan.serving``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lcx.cache.config import CacheConfig
from lcx.cache.storage import FORMATS, storage_for
from lcx.config_base import ConfigError
from lcx.parallel import sharding
from lcx.model.config import ModelConfig

# The defaults of a served configuration, one place: ``Server``'s and ``lcx serve``'s (``ServeConfig``) read these
MAX_NUM_SEQS, MAX_LEN, SEGMENT, PREFILL_CHUNK, PREFIX_ENTRIES = 8, 4096, 8, 256, 8
STORE_PAGES, STORE_STATES = "pages", "states"  # what a store keeps: prompt pages (full), compressed states (evicting)


@dataclasses.dataclass(frozen=True)
class ServeSetup:
    """A resolved serve configuration (``resolve``). ``cache``: the paged cache config (its ``prefill_chunk`` the
    server's); ``policy`` / ``kind``: its eviction policy and cache kind; ``slots``: a row's planned slots;
    ``row_pages``: the most pages one row holds; ``pages``: the pool; ``chunk``: prompt tokens per row and step;
    ``prefix_entries``: prefixes kept (0 under eviction, or when the storage's pages do not hold a row);
    ``store``: what a ``PageStore`` may keep - ``"pages"`` (the full policy: prompt pages, always worth keeping),
    ``"states"`` (an evicting policy: compressed states, only when asked for) or None (no store: a bit-packed cache's
    pages are no prefix without its float window, a reconstructing policy scores a fresh prompt);
    ``reconstruction``: KVzip's repeat prompt (None unless the policy reconstructs)."""


    cache: CacheConfig
    policy: Any
    kind: Any
    max_num_seqs: int
    max_len: int
    slots: int
    row_pages: int
    pages: int
    segment: int
    chunk: int
    prefix_entries: int
    store: str | None
    reconstruction: Any = None
    settings: CacheConfig | None = None  # the cache config as given (what a store's pages are keyed by)
    mesh: Any = None  # the device mesh the server runs on (KV heads over "model"; None: one device)
    make_store: bool = False  # a store is made (``lcx serve``: always for pages, for states only with --kv-store)
    plan: Any = None  # how the pool was sized (``lcx.plan.serving.ServePlan``), when it was

    @property
    def evicts(self) -> bool:
        return self.policy.evicts

    @property
    def page(self) -> int:
        return self.kind.page

    @property
    def pages_hold_rows(self) -> bool:
        """Whether a row's pages alone hold its keys and values (its storage keeps nothing per row beside the pool):
        what kept prefixes and a page store need."""
        return self.kind.storage.pages_hold_rows


def prefix_formats() -> list[str]:
    """The ``kv_dtype`` formats whose pages alone hold a row (``KVStorage.pages_hold_rows``): those a prefix cache and
    a page store can keep."""
    return [name for name in FORMATS if storage_for(name, "float32").pages_hold_rows]


def server_policies() -> list[str]:
    """The cache policies a ``Server`` runs: those of the paged slot cache that need no calibration."""
    from lcx.cache.policy import registered_where

    return registered_where(lambda p: p.cache_type == "slots" and not p.observes.calibrates)


def store_kind(cache: CacheConfig, policy) -> str | None:
    """What a store may keep under ``cache`` / ``policy`` (``ServeSetup.store``): the one place this is decided."""
    if not cache.storage().pages_hold_rows or policy.observes.reconstructs:
        return None
    return STORE_STATES if policy.evicts else STORE_PAGES


def _positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"Server {name}={value!r} is invalid: must be a positive integer")


def resolve(model: ModelConfig, cache: CacheConfig | None = None, *, max_num_seqs: int = MAX_NUM_SEQS,
            max_len: int = MAX_LEN, pages: int | None = None, segment: int = SEGMENT,
            prefill_chunk: int = PREFILL_CHUNK, prefix_entries: int = PREFIX_ENTRIES, store: bool = False,
            reconstruction=None, mesh=None) -> ServeSetup:
    """The ``ServeSetup`` of these settings, or a ``ConfigError`` naming the setting, the value and what is allowed.
    ``pages``: the pool (None: every row at its largest); ``store``: a store will be passed (refused where none may
    keep anything); ``reconstruction``: KVzip's repeat prompt, or a function making it (called only when the policy
    reconstructs); ``mesh``: the device mesh (``lcx.parallel.sharding.make_mesh``; its ``model`` axis splits the KV
    heads - replicated where it is a multiple of them - and it has no ``data`` axis)."""
    from lcx.engine.planning import cache_kind

    cache = cache or CacheConfig(layout="paged")
    if cache.layout != "paged":
        raise ConfigError(f"cache.layout={cache.layout!r} is invalid for Server: it batches over a paged cache; "
                          "allowed: 'paged'")
    for name, value in (("max_num_seqs", max_num_seqs), ("max_len", max_len), ("segment", segment),
                        ("prefill_chunk", prefill_chunk)):
        _positive(name, value)
    policy = cache.make_policy()
    if policy.observes.calibrates:
        raise ConfigError(f"cache.policy={cache.policy!r} is invalid for Server: it calibrates over a contiguous "
                          f"cache; allowed: {', '.join(server_policies())}")
    if not policy.observes.reconstructs:
        reconstruction = None
    elif callable(reconstruction):
        reconstruction = reconstruction()
    if policy.observes.reconstructs and reconstruction is None:
        raise ConfigError(f"cache.policy={cache.policy!r} scores a prompt by asking the model to repeat it: pass "
                          "Server(reconstruction=...) (lcx.data.haystack.Frame(tokenizer, chat).reconstruction())")
    settings, cache = cache, CacheConfig(**(cache.to_dict() | {"prefill_chunk": prefill_chunk}))
    kind = cache_kind(model, cache, mesh)
    if mesh is not None:
        sharding.mesh_topology(model, mesh)  # a model axis that cannot split the KV heads, with the valid sizes
        kind.check_mesh(mesh)
    # a row's slots: every token under the full policy, the policy's plan (budget + interval) under eviction
    slots = kind.plan(1, max_len, 0) if policy.evicts else max_len
    if reconstruction is not None and slots < max_len:  # it compresses a prompt once, having read it all
        raise ConfigError(f"cache.policy={cache.policy!r} with budget + interval = {slots} < max_len={max_len}: "
                          "it compresses a prompt once, after reading all of it; set cache.interval >= "
                          f"{max_len - (slots - cache.interval)} (max_len - budget)")
    row_pages = -(-slots // kind.page)
    pages = max_num_seqs * row_pages if pages is None else pages
    if isinstance(pages, bool) or not isinstance(pages, int) or pages < 1:
        raise ConfigError(f"Server pages={pages!r} is invalid: must be a positive integer (a pool smaller "
                          f"than a request of max_len={max_len} refuses the requests it cannot hold)")
    kept = store_kind(cache, policy)
    if store and kept is None:
        if not kind.storage.pages_hold_rows:
            raise ConfigError(f"Server store= with cache.kv_dtype={cache.kv_dtype!r}: its pages are not a prefix "
                              "without what the row keeps beside them; allowed: store=None, or kv_dtype "
                              f"{prefix_formats()} or None")
        raise ConfigError(f"Server store= with cache.policy={cache.policy!r}: its reconstruction passes score a "
                          "fresh prompt, not a stored compressed state; allowed: store=None")
    return ServeSetup(cache=cache, policy=policy, kind=kind, max_num_seqs=max_num_seqs, max_len=max_len,
                      slots=slots, row_pages=row_pages, pages=pages, segment=segment,
                      chunk=kind.prefill_chunk(prefill_chunk, max_len, row_pages * kind.page),
                      prefix_entries=0 if policy.evicts or not kind.storage.pages_hold_rows else prefix_entries,
                      store=kept, reconstruction=reconstruction, settings=settings, make_store=bool(store),
                      mesh=mesh)


__all__ = ["MAX_LEN", "MAX_NUM_SEQS", "PREFILL_CHUNK", "PREFIX_ENTRIES", "SEGMENT", "STORE_PAGES", "STORE_STATES",
           "ServeSetup", "prefix_formats", "resolve", "server_policies", "store_kind"]
