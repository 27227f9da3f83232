"""Keys and values between a server's page pool and its ``PageStore`` (``lcx.engine.kv_store``): the whole pages of a
prompt under the full cache, and under an evicting policy a row's whole compressed state - what a conversation's
next turn continues from.

A full cache's page depends only on the tokens up to it, so pages are stored one by one and any prompt that
starts with the same pages reads them. A compressed row is one state: its kept slots (in its pages) and the
per-row buffers that say which positions they hold and what the policy has observed (positions, live mask, counts,
scores, query moments). It is stored whole, keyed by every token the row has seen (``PageStore.put_state``), and
read back whole by a request whose prompt starts with exactly those tokens - its next turn: the prompt the client
sends (the history, the answer, the new message) continues the compressed state instead of being prefilled from the
start. The answer is then that of a session that kept its compressed cache across turns, as ``Generator.prefill(...,
state=...)`` continues one - not the answer of compressing the whole history afresh.

Array names: ``page.<buffer>`` ``[L, n, ...]`` (the row's ``n`` held pages, in order) and ``row.<buffer>`` (the
per-row buffers of a batch of one). Reads go through ``sharding.to_host``: on a mesh across processes each process
holds only its heads' part of a page, and every process reads the whole (a collective; lockstep serving).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from lcx.engine import rows
from lcx.engine.prompt_end import pl2
from lcx.parallel import sharding


def load_pages(state, row: int, n_pages: int, arrays: dict[str, np.ndarray]):
    """``state`` with row ``row`` (empty) on fresh pages holding ``n_pages`` pages of ``arrays`` (``[L, n, ...]``)."""
    width = pl2(n_pages)  # a few compiled widths: the rest is padding, never written
    pad = lambda x: np.pad(x, [(0, 0), (0, width - n_pages)] + [(0, 0)] * (x.ndim - 2))  # noqa: E731
    return rows.write_pages(state, jnp.int32(row), jnp.int32(n_pages), {n: jnp.asarray(pad(x)) for n, x in
                                                                        arrays.items()})


def store_pages(state, store, tokens: np.ndarray, pages, salt: str | None = None) -> None:
    """Write the whole pages of ``tokens`` (under ``salt``), held in the pool pages ``pages`` (in order), that
    ``store`` lacks."""
    page = state.kind.page
    n_pages = min(tokens.size // page, len(pages))
    missing = store.missing(tokens[:n_pages * page], salt) if n_pages else []
    if not missing:
        return
    ids = rows.padded([int(pages[i]) for i in missing], fill=0)
    arrays = {n: sharding.to_host(rows.take_pages(getattr(state, n), ids))[:, :len(missing)]
              for n in rows.kv_names(state)}
    store.put(tokens[:n_pages * page], missing, arrays, salt)


def snapshot(state, row: int) -> dict[str, np.ndarray]:
    """Row ``row``'s compressed state: its held pages' contents and its per-row buffers."""
    one = rows.gather(state, jnp.asarray([row], jnp.int32))
    table = sharding.to_host(one.table[0])
    held = [int(p) for p in table if p >= 0]
    ids = rows.padded(held, fill=0)
    out = {f"page.{n}": sharding.to_host(rows.take_pages(getattr(state, n), ids))[:, :len(held)]
           for n in rows.kv_names(state)}
    return out | {f"row.{n}": sharding.to_host(x) for n, x in rows.rows_of(one).items() if n != "table"}


def fits(state, arrays: dict[str, np.ndarray]) -> bool:
    """Whether ``arrays`` (a ``snapshot``) is a state of this pool's layout: every buffer named, dtypes and shapes
    equal (the held pages' count aside), no more pages than a row's table."""
    one = rows.gather(state, jnp.asarray([0], jnp.int32))
    want = {f"row.{n}": (str(x.dtype), tuple(x.shape)) for n, x in rows.rows_of(one).items() if n != "table"}
    pages = {f"page.{n}": (dtype, shape) for n, (dtype, shape) in rows.page_layout(state).items()}
    if set(arrays) != set(want) | set(pages):
        return False
    n = arrays[next(iter(pages))].shape[1]
    if not 0 < n <= state.table.shape[1]:
        return False
    got = {k: (str(x.dtype), tuple(x.shape) if k.startswith("row.") else (x.shape[0],) + tuple(x.shape[2:]))
           for k, x in arrays.items()}
    return got == want | pages and all(x.shape[1] == n for k, x in arrays.items() if k.startswith("page."))


def continued(store, state, prompt: np.ndarray, salt: str | None = None
              ) -> tuple[int, dict[str, np.ndarray] | None]:
    """``(n, arrays)``: the compressed state ``store`` keeps after the longest ``prompt[:n]`` (under ``salt``) that
    is of this pool's layout (``fits``), or ``(0, None)``."""
    return store.get_state(prompt, accept=lambda arrays: fits(state, arrays), salt=salt)


def restore(state, row: int, arrays: dict[str, np.ndarray]):
    """``state`` with row ``row`` (empty) holding the ``snapshot`` ``arrays``: fresh pages with its pages' contents,
    its per-row buffers (positions, counts, ... and the tokens it has seen) as they were."""
    pages = {k.removeprefix("page."): x for k, x in arrays.items() if k.startswith("page.")}
    state = load_pages(state, row, next(iter(pages.values())).shape[1], pages)
    at = jnp.asarray([row], jnp.int32)
    one = rows.gather(state, at)
    one = one.replace(**{k.removeprefix("row."): jnp.asarray(x) for k, x in arrays.items() if k.startswith("row.")})
    return rows.scatter(rows.rows_of(state), one, at, 1)


__all__ = ["continued", "fits", "load_pages", "restore", "snapshot", "store_pages"]
