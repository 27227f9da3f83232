"""A one-shot context read in two parts, so several eviction policies can share the expensive one.

kvpress's protocol (``lcx.eval.evaluate``, ``protocol: one_shot``) prefills a context, lets the policy score it and
compresses it once. For most one-shot policies the scores come only from the context's last queries (SnapKV's
window, TOVA's last token), from the model repeating the context afterwards (KVzip) or from the keys themselves
(K-norm, StreamingLLM): the forward pass over everything before those last queries is the same computation for every
policy. So a context is read as

1. its first ``len - TAIL`` tokens, by a full (non-evicting) cache of the same storage: nothing observed, nothing
   evicted (``base_generator``) - done once, shared by every policy of an evaluation grid's cell group;
2. for each policy: that state re-laid as the policy's cache (``adopt``: keys and values as they are, every keep head
   holding every slot, scores zero), then the last ``TAIL`` tokens read through the policy's generator
   (``Generator.prefill(state=...)``: observed as the policy observes a prompt's end, then its one compression;
   KVzip repeats the whole context, ``whole=``).

A policy runs the same two calls whether it shares the first or not, so its tokens are the same in a group as alone.
``split_refusal`` says why a cache cannot be read this way (the single-call protocol reads it then): a policy that
observes queries before the tail (H2O's sum over every query), keeps per-query moments (Expected Attention), keys
at cache positions (StreamingLLM's re-positioning), quantized storage, pages, a mesh, a re-rotating RoPE.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from lcx.cache.kv_cache import METADATA, KVCache, SlotCacheKind
from lcx.config import CacheConfig, ModelConfig
from lcx.engine.generator import Generator
from lcx.engine.planning import cache_kind
from lcx.engine.state import DecodeState

TAIL = 256  # a context's last tokens, read by each policy: at least any observation window split_refusal allows


def split_refusal(model: ModelConfig, cache: CacheConfig, mesh=None) -> str | None:
    """Why ``cache`` cannot read a context in two parts with the first shared (None: it can)."""
    kind = cache_kind(model, cache, mesh)
    if type(kind) is not SlotCacheKind or mesh is not None:
        return "only the contiguous slot cache on one device shares a prefill"
    if kind.budgets is None:
        return "the full cache compresses nothing: nothing to share"
    if kind.storage.slot_fields().keys() != {"k", "v"}:
        return f"its {kind.kv_dtype} storage is written as the prefill reads it (only float slots are shared)"
    if kind.policy.mode != "original" or model.rope.rerotate:
        return "its keys are not stored rotated at their original positions"
    extra = [n for n, x in vars(kind.abstract(1, 4 * TAIL)).items()
             if n not in ("k", "v", "kind", *METADATA) and x is not None]
    if extra:
        return f"it keeps statistics of every query ({', '.join(extra)})"
    weights = kind.prefill_weights(np.asarray([4 * TAIL]), 4 * TAIL)
    if weights is not None and np.any(weights[:, :3 * TAIL]):
        return f"it observes queries before a context's last {TAIL} tokens"
    return None


def base_generator(gen: Generator, capacity: int) -> Generator:
    """The full cache that reads the shared part for ``gen``'s policy (and every policy of the same storage): the
    same model, dtype and prefill chunk, ``capacity`` slots - the policies' own."""
    cache = CacheConfig(dtype=gen.cache_config.dtype, prefill_chunk=gen.cache_config.prefill_chunk)
    return Generator(gen.config, gen.params, max_new_tokens=1, cache=cache, capacity=capacity, unroll=gen.unrolled,
                     strict=gen.strict)


def adopt(kind: SlotCacheKind, cache: KVCache) -> KVCache:
    """``cache`` (a full slot cache that observed nothing) as a fresh state of ``kind``: its keys and values copied
    (the policy's calls donate their input), its slot metadata broadcast over ``kind``'s keep heads, scores zero."""
    batch, capacity = int(cache.lengths.shape[0]), cache.capacity
    shapes = kind.abstract(batch, capacity)
    if shapes.k.shape != cache.k.shape or shapes.k.dtype != cache.k.dtype:
        raise ValueError(f"a {cache.k.dtype} cache of keys {cache.k.shape} cannot become a {kind.policy.name} cache "
                         f"of keys {shapes.k.shape} ({shapes.k.dtype})")
    copy = {n: jnp.array(getattr(cache, n), copy=True) for n in ("k", "v", "lengths")}
    spread = {n: jnp.array(jnp.broadcast_to(getattr(cache, n), getattr(shapes, n).shape), copy=True)
              for n in ("pos", "valid", "count")}
    return kind.state_type(kind=kind, score=jnp.zeros(shapes.score.shape, shapes.score.dtype), **copy, **spread)


def split(contexts: list[np.ndarray]) -> bool:
    """Whether every context is long enough to be read in two parts."""
    return min(len(c) for c in contexts) > TAIL


def read_start(base: Generator, contexts: list[np.ndarray]) -> DecodeState:
    """Step 1: the contexts' first ``len - TAIL`` tokens in ``base``'s full cache."""
    return base.prefill([np.asarray(c)[:-TAIL] for c in contexts])


def read_rest(gen: Generator, start: DecodeState, contexts: list[np.ndarray]) -> DecodeState:
    """Step 2: the contexts' last ``TAIL`` tokens through ``gen``'s policy after ``start`` (not consumed: each policy
    of a group reads from the same start), then its one compression."""
    state = start.replace(cache=adopt(gen.kind, start.cache))
    return gen.prefill([np.asarray(c)[-TAIL:] for c in contexts], state=state, whole=[np.asarray(c) for c in contexts])


__all__ = ["TAIL", "adopt", "base_generator", "read_rest", "read_start", "split", "split_refusal"]
