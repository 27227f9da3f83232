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

from lcx.cache.hybrid import HybridKind
from lcx.cache.kv_cache import METADATA, KVCache, SlotCacheKind
from lcx.config import CacheConfig, ModelConfig
from lcx.engine.generator import Generator
from lcx.engine.planning import cache_kind
from lcx.engine.state import DecodeState
from lcx.model import rope_scaling

TAIL = 256  # a context's last tokens, read by each policy: at least any observation window split_refusal allows


def split_refusal(model: ModelConfig, cache: CacheConfig, mesh=None) -> str | None:
    """Why ``cache`` cannot read a context in two parts with the first shared (None: it can)."""
    kind = cache_kind(model, cache, mesh)
    slots = kind.glob if isinstance(kind, HybridKind) else kind  # sliding-window layers keep their window
    if type(slots) is not SlotCacheKind or mesh is not None:
        return "only the contiguous slot cache on one device shares a prefill"
    if slots.budgets is None:
        return "the full cache compresses nothing: nothing to share"
    if slots.storage.slot_fields().keys() != {"k", "v"}:
        return f"its {slots.kv_dtype} storage is written as the prefill reads it (only float slots are shared)"
    if slots.policy.mode != "original" or model.rope.rerotate:
        return "its keys are not stored rotated at their original positions"
    if any(rope_scaling.get(spec.rope.type).length_dependent for spec in model.attention_specs()):
        return "its RoPE frequencies depend on the length a call reaches (a shared start would rotate by another)"
    extra = [n for n, x in vars(slots.abstract(1, 4 * TAIL)).items()
             if n not in ("k", "v", "kind", *METADATA) and x is not None]
    if extra:
        return f"it keeps statistics of every query ({', '.join(extra)})"
    weights = slots.prefill_weights(np.asarray([4 * TAIL]), 4 * TAIL)
    if weights is not None and np.any(weights[:, :3 * TAIL]):
        return f"it observes queries before a context's last {TAIL} tokens"
    return None


def base_generator(gen: Generator, capacity: int) -> Generator:
    """The full cache that reads the shared part for ``gen``'s policy (and every policy of the same storage): the
    same model, dtype, prefill chunk and ``interval`` (a sliding-window layer's room), ``capacity`` slots - the
    policies' own."""
    own = gen.cache_config
    cache = CacheConfig(dtype=own.dtype, prefill_chunk=own.prefill_chunk, interval=own.interval)
    return Generator(gen.config, gen.params, max_new_tokens=1, cache=cache, capacity=capacity, unroll=gen.unrolled,
                     strict=gen.strict)


def base_key(cache: CacheConfig, capacity: int) -> tuple:
    """What the shared start depends on besides the contexts: caches of one key can share it."""
    return capacity, cache.dtype, cache.prefill_chunk, cache.interval


def adopt(kind, cache):
    """``cache`` (a full cache that observed nothing) as a fresh state of ``kind`` (a slot cache, or a hybrid one
    over sliding-window layers): new buffers (the policy's calls donate their input) holding its keys and values,
    its slot metadata broadcast over ``kind``'s keep heads and its slots padded to ``kind``'s, scores zero."""
    if isinstance(kind, HybridKind):
        local = None if cache.loc is None else _slots(kind.loc, cache.loc, kind.local_capacity(cache.planned))
        return kind.state_type(kind=kind, planned=cache.planned, lengths=jnp.array(cache.lengths, copy=True),
                               glob=_slots(kind.glob, cache.glob, cache.glob.capacity), loc=local)
    return _slots(kind, cache, cache.capacity)


def _slots(kind: SlotCacheKind, cache: KVCache, capacity: int) -> KVCache:
    batch = int(cache.k.shape[1])
    shapes = kind.abstract(batch, capacity)
    if shapes.k.shape[:-2] != cache.k.shape[:-2] or shapes.k.dtype != cache.k.dtype or capacity < cache.capacity:
        raise ValueError(f"a {cache.k.dtype} cache of keys {cache.k.shape} cannot become a {kind.policy.name} cache "
                         f"of keys {shapes.k.shape} ({shapes.k.dtype})")

    def grow(x, axis: int, fill):  # the slot axis padded with empty slots (a new array: never the input)
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, capacity - x.shape[axis])
        return jnp.pad(x, widths, constant_values=fill) if capacity > x.shape[axis] else jnp.array(x, copy=True)

    heads = {n: jnp.broadcast_to(getattr(cache, n), getattr(shapes, n).shape[:-1] + getattr(cache, n).shape[-1:])
             for n in ("pos", "valid")}
    return kind.state_type(
        kind=kind, k=grow(cache.k, -2, 0), v=grow(cache.v, -2, 0), pos=grow(heads["pos"], -1, -1),
        valid=grow(heads["valid"], -1, False), count=jnp.array(jnp.broadcast_to(cache.count, shapes.count.shape)),
        score=jnp.zeros(shapes.score.shape, shapes.score.dtype),
        lengths=None if cache.lengths is None else jnp.array(cache.lengths, copy=True))


def split(contexts: list[np.ndarray], capacity: int) -> bool:
    """Whether the contexts are read in two parts by a cache of ``capacity`` slots: each is longer than the tail, and
    the cache holds the longest whole - a one-shot compression (a smaller cache evicts while it reads, observing
    each chunk's end, which one call does too)."""
    return min(len(c) for c in contexts) > TAIL and capacity >= max(len(c) for c in contexts)


def read_start(base: Generator, contexts: list[np.ndarray]) -> DecodeState:
    """Step 1: the contexts' first ``len - TAIL`` tokens in ``base``'s full cache."""
    return base.prefill([np.asarray(c)[:-TAIL] for c in contexts])


def read_rest(gen: Generator, start: DecodeState, contexts: list[np.ndarray]) -> DecodeState:
    """Step 2: the contexts' last ``TAIL`` tokens through ``gen``'s policy after ``start`` (not consumed: each policy
    of a group reads from the same start), then its one compression."""
    state = start.replace(cache=adopt(gen.kind, start.cache))
    return gen.prefill([np.asarray(c)[-TAIL:] for c in contexts], state=state, whole=[np.asarray(c) for c in contexts])


__all__ = ["TAIL", "adopt", "base_generator", "base_key", "read_rest", "read_start", "split", "split_refusal"]
