"""The prompt pages a server keeps: one chained-hash index (``lcx.engine.kv_store.chain``: page ``i``'s key hashes
pages ``0 .. i``) over the prefixes kept in pool pages, and the host / disk ``PageStore`` behind them.

A kept prefix is an entry keyed by its last page's chain key; every page key of every entry is in one index, so the
longest kept prefix a prompt starts with is a walk along the prompt's keys (one dict lookup per page), whatever the
number of entries. An entry holds one reference to each of its pages (``rows.hold``) and counts its ``users`` (the
running requests that read it or made it); the host reference counts of those pages (``refs``) are what the
``lcx_kv_pages_used`` gauge reads - no device read. Entries go least recently used first when pages are needed (a
spill to the store first: host memory, and disk with a directory); at most ``prefix_entries`` are kept.

The store (full policy: prompt pages; evicting: a finished request's compressed state) is reached only through here:
``stored`` finds what it holds of a prompt, ``load`` writes it into a row, ``spill`` / ``finished`` write to it.

A request's ``salt`` (``cache_salt``: a tenant's) starts its chain here and in the store (``kv_store.salted``): two
salts never share a kept or a stored page, as if their prompts differed from the first token; no salt is the
unsalted chain every request had before salts existed.
"""

from __future__ import annotations

import collections
import dataclasses

import jax.numpy as jnp
import numpy as np

from lcx.engine import rows, store_io
from lcx.engine.kv_store import chain, salted
from lcx.parallel import sharding


@dataclasses.dataclass
class Entry:
    """A kept prefix: ``tokens`` (whole pages), their chain ``keys``, the pool ``pages`` holding them, the
    running requests that read it (``users``: while any does, it is not released) and the ``salt`` its keys
    started from (its pages spill to the store under it)."""

    tokens: np.ndarray
    keys: list[str]
    pages: list[int]
    users: int = 0
    salt: str | None = None


class PrefixCache:
    """Kept prefix pages and the store of one server (see the module docstring). ``setup``: the server's
    ``ServeSetup``; ``store``: a ``PageStore`` or None; ``ref``: the server's ``rows.StateRef`` (the pool)."""

    def __init__(self, setup, store, ref: rows.StateRef):
        self.page, self.evicts, self.limit = setup.page, setup.evicts, setup.prefix_entries
        self.store, self.ref = store, ref
        self.entries: collections.OrderedDict[str, Entry] = collections.OrderedDict()  # LRU order
        self._holders: dict[str, list[str]] = {}  # a page's chain key -> the entries holding that page
        self.refs: collections.Counter[int] = collections.Counter()  # pool page -> entries holding it (host)

    # ------------------------------------------------------------------------------------------- the index
    def keys(self, tokens: np.ndarray, salt: str | None = None) -> list[str]:
        """The chain keys of the whole pages of ``tokens`` under ``salt`` (no model namespace: they index this
        pool only)."""
        return chain(salted("", salt), tokens, self.page)

    def prompt_keys(self, request) -> list[str]:
        """The keys of the whole pages of ``request``'s prompt that leave it one token (computed once)."""
        if request.keys is None:
            request.keys = self.keys(request.prompt[:(request.prompt.size - 1) // self.page * self.page],
                                     request.salt)
        return request.keys

    def lookup(self, request) -> tuple[str | None, int]:
        """The kept prefix sharing the most whole pages with ``request``'s prompt (the least recently used of
        equals): ``(key, pages)``, ``(None, 0)`` if none."""
        if not self.entries:
            return None, 0
        keys, n = self.prompt_keys(request), 0
        while n < len(keys) and keys[n] in self._holders:
            n += 1
        if n == 0:
            return None, 0
        holders = set(self._holders[keys[n - 1]])
        return next(k for k in self.entries if k in holders), n

    def kept_pages_of(self, tokens, salt: str | None = None) -> int:
        """How many leading whole pages of ``tokens`` (under ``salt``) a kept prefix holds: what routing a request
        to the replica that already has its history reads (``lcx.engine.server_group``)."""
        keys, n = self.keys(np.asarray(tokens, np.int32)[:max(len(tokens) - 1, 0)], salt), 0
        while n < len(keys) and keys[n] in self._holders:
            n += 1
        return n

    def entry(self, tokens, salt: str | None = None) -> Entry | None:
        """The entry kept for exactly the whole pages ``tokens`` (under ``salt``), or None."""
        keys = self.keys(np.asarray(tokens, np.int32), salt)
        return self.entries.get(keys[-1]) if keys else None

    def kept_pages(self) -> int:
        """Pool pages the kept prefixes hold (entries overlap on shared pages: each counted once)."""
        return len(self.refs)

    def _add(self, tokens: np.ndarray, keys: list[str], pages: list[int], users: int, salt: str | None) -> str:
        self.ref.state = rows.hold(self.ref.state, rows.padded(pages), jnp.int32(1))
        self.entries[keys[-1]] = Entry(tokens, keys, pages, users, salt)
        for k in keys:
            self._holders.setdefault(k, []).append(keys[-1])
        self.refs.update(pages)
        return keys[-1]

    def _remove(self, key: str) -> None:
        entry = self.entries.pop(key)
        for k in entry.keys:
            self._holders[k].remove(key)
            if not self._holders[k]:
                del self._holders[k]
        self.refs.subtract(entry.pages)
        for p in entry.pages:
            if self.refs[p] <= 0:
                del self.refs[p]

    # ------------------------------------------------------------------------------------------- kept prefixes
    def narrow(self, key: str, shared: int) -> str:
        """The entry of the first ``shared`` pages of entry ``key``'s, an entry of its own when shorter (one more
        reference to those pages): a request pins only the pages it reads, and the longer entry stays free to go."""
        entry = self.entries[key]
        if shared == len(entry.pages):
            return key
        short = entry.keys[shared - 1]
        if short not in self.entries:
            self._add(entry.tokens[:shared * self.page], entry.keys[:shared], entry.pages[:shared], 0, entry.salt)
        return short

    def pin(self, key: str) -> list[int]:
        """A request admitted reads entry ``key`` (most recently used now, one user more): its pages."""
        self.entries.move_to_end(key)
        self.entries[key].users += 1
        return self.entries[key].pages

    def release(self, keys) -> None:
        """The requests ending read the entries ``keys`` no more (one user less each)."""
        for key in keys:
            if key in self.entries:
                self.entries[key].users -= 1

    def keep(self, request, table_row: np.ndarray) -> str | None:
        """Keep the whole pages of ``request``'s prompt (pool pages ``table_row``) for later requests, read by
        their maker until it ends; the new entry's key, or None when nothing is kept (no entries, no whole page, or
        an entry already holds them)."""
        if self.limit == 0:
            return None
        keys = self.prompt_keys(request)
        if not keys or keys[-1] in self._holders:
            return None
        pages = [int(p) for p in table_row[:len(keys)]]
        key = self._add(request.prompt[:len(keys) * self.page], keys, pages, users=1, salt=request.salt)
        while len(self.entries) > self.limit and self.drop_lru(keep=key):
            pass
        return key

    def drop_lru(self, keep=None) -> bool:
        """Release the least recently used entry no running request reads (not ``keep``); False if none. Its pages
        spill to the store first (they may serve a later request) and go back whatever the spill does."""
        for key, entry in self.entries.items():
            if entry.users == 0 and key != keep:
                try:
                    self.spill(entry.tokens, entry.pages, entry.salt)
                finally:
                    self.ref.state = rows.hold(self.ref.state, rows.padded(entry.pages), jnp.int32(-1))
                    self._remove(key)
                return True
        return False

    # ------------------------------------------------------------------------------------------- the store
    def stored(self, request, shared: int) -> int:
        """Leading pages of ``request``'s prompt the store can give (read and checked once, kept on the request
        while it waits), when that is more than the ``shared`` pages of a kept prefix; else 0. Under eviction: the
        tokens of the compressed state its prompt continues."""
        if self.store is None:
            return 0
        state = self.ref.state
        if request.stored is None and self.evicts:  # the compressed state its prompt continues, if one is kept
            request.stored = store_io.continued(self.store, state, request.prompt, request.salt)
        if request.stored is None:
            n = self.store.match(request.prompt[:(request.prompt.size - 1) // self.page * self.page], request.salt)
            # reading checks each file and its layout (the pool's: another failed the step, for every row): a bad
            # one ends the run there (and may leave fewer pages than a kept prefix)
            layout = rows.page_layout(state)
            request.stored = (self.store.get(request.prompt[:n * self.page], layout, request.salt) if n > shared
                              else (0, None))
        return request.stored[0]

    def load(self, request) -> None:
        """Row ``request.row`` (empty) gets fresh pages holding the store's pages of its prompt (full cache), or the
        compressed state its prompt continues (evicting policy)."""
        n, arrays = request.stored
        request.stored = None
        if self.evicts:
            self.ref.state = store_io.restore(self.ref.state, request.row, arrays)
        else:
            self.ref.state = store_io.load_pages(self.ref.state, request.row, n, arrays)

    def spill(self, tokens: np.ndarray, pages, salt: str | None = None) -> None:
        """Write the whole pages of ``tokens`` (under ``salt``), held in the pool pages ``pages`` (in order), that
        the store lacks (full policy only: an evicting row's pages are no prefix)."""
        if self.store is not None and not self.evicts:
            store_io.store_pages(self.ref.state, self.store, tokens, pages, salt)

    def finished(self, held: np.ndarray, row: int, salt: str | None = None) -> None:
        """A request (of ``salt``) ends holding the tokens ``held`` in row ``row``: its pages (full policy) or its
        compressed state (evicting) go to the store, where the conversation's next turn finds them."""
        if self.store is None:
            return
        if self.evicts:
            self.store.put_state(held, store_io.snapshot(self.ref.state, row), salt)
        else:
            self.spill(held, sharding.to_host(self.ref.state.table[row]), salt)


__all__ = ["Entry", "PrefixCache"]
