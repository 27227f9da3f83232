"""The compiled programs of one configuration (model, cache type, EOS / pad ids, mesh, unrolled or not), built in
one place and shared by every ``Generator`` and ``Server`` of it: ``programs(...)`` returns a ``Programs`` whose
named fields are the jitted functions, each donating its cache (``donate_argnames``) so XLA updates it in place.

Sampling settings are not part of the configuration: they travel in the decode state (``RowSampling``, one per
row), so requests with any mix of settings share one compiled decode loop; its static ``sampled`` flag compiles a
second, argmax-only variant for batches whose every row is greedy (what most decoding is), which skips the
sampler's branch in each step (measured: ~0.08 ms of a 0.3 ms step of a tiny model on a 2-core CPU).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from lcx.cache.base import CacheKind, CacheState
from lcx.cache.reconstruct import Probe
from lcx.engine.sampling import RowSampling, greedy, sample_rows
from lcx.engine.state import DecodeState
from lcx.model import Decoder
from lcx.model.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Programs:
    """The jitted functions of one configuration; see ``programs``. Their arguments are named as below."""

    prefill_chunk: Callable  # (params, cache, ids, ok, last_index, last_logits, stat_weights, positions=None)
    end_prefill: Callable  # (cache) -> cache compressed after the prompt
    decode_loop: Callable  # (params, state, limit, sampled) -> state after sampling up to step ``limit``
    forced_loop: Callable  # (params, cache, logits, tokens, n, top) -> teacher forcing one token per step
    forced_chunk: Callable  # (params, cache, logits, tokens, n, stat_weights, top) -> teacher forcing as one chunk
    probe_chunk: Callable  # (params, cache, ids, ok, lo, hi) -> a reconstruction pass scored into the cache
    serve_segment: Callable  # (params, cache, token, active, left, eos_stops, rows, steps, n_steps, sampled) -> steps
    model: Decoder


def logprob_top(logits, ids, top: int):
    """``(log p(ids), the top log-probabilities, their ids)`` of ``logits [..., V]``: the gathered logit minus the
    log-sum-exp (no log-softmax over the vocabulary is materialized); ``top`` = 0 gives empty ``[..., 0]`` arrays."""
    lse = jax.nn.logsumexp(logits, axis=-1)
    logprob = jnp.take_along_axis(logits, ids[..., None], axis=-1)[..., 0] - lse
    if top == 0:
        empty = logits[..., :0]
        return logprob, empty, empty.astype(jnp.int32)
    values, best = jax.lax.top_k(logits, top)
    return logprob, values - lse[..., None], best.astype(jnp.int32)


@functools.lru_cache(maxsize=128)
def programs(config: ModelConfig, eos_id: int | None, pad_id: int, kind: CacheKind, mesh=None,
             unrolled: bool = False) -> Programs:
    """The jitted prefill-chunk, end-of-prefill, decode-loop, teacher-forcing, reconstruction and server-segment
    functions of one configuration (each compiled on first use, once per shape). The cache type is ``kind``; this
    code only calls its contract (``lcx.cache.base``).

    With a ``mesh`` they must be called under ``sharding.use_mesh(mesh)`` (the model reads it at trace time); the
    cache keeps its sharding (batch over data, KV heads over model) through every step. ``unrolled``: the params
    are ``unroll_params``'s and the decode loops carry the cache split per layer (``CacheState.split_layers``),
    stacking it again on the way out: between calls a state is always stacked.
    """
    model = Decoder(config, unrolled=unrolled)
    split = (lambda c: c.split_layers()) if unrolled else (lambda c: c)  # noqa: E731
    forcing = kind.scoring()  # the kind a teacher-forcing chunk attends with

    def pin(cache: CacheState) -> CacheState:
        if mesh is None:
            return cache
        return jax.lax.with_sharding_constraint(cache, kind.shardings(cache, mesh))

    def prefill_chunk(params, cache, ids, ok, last_index, last_logits, stat_weights, positions=None):
        # last_index [b]: index of the row's last prompt token within this chunk, or -1. positions: given for a
        # chunk laid out over a seq mesh axis (lcx.parallel.context), else the cache's next positions.
        cache = kind.make_room(cache, jnp.sum(ok, axis=1, dtype=jnp.int32))  # room for each row's real tokens
        logits, cache = model.apply({"params": params}, ids, positions=positions, cache=cache, ok=ok,
                                    logits_index=jnp.maximum(last_index, 0), stat_weights=stat_weights)
        last_logits = jnp.where((last_index >= 0)[:, None], logits[:, 0], last_logits)
        return pin(cache), last_logits

    def end_prefill(cache):
        return pin(kind.end_prefill(cache))

    def probe_chunk(params, cache, ids, ok, lo, hi):
        """One reconstruction pass (``lcx.cache.reconstruct``): the tokens score the cache's slots and leave."""
        policy = kind.policy
        probe = Probe(lo=lo, hi=hi, sinks=policy.sinks, width=policy.chunk)
        _, out = model.apply({"params": params}, ids, cache=cache, ok=ok, logits_index=jnp.zeros_like(hi),
                             probe=probe)
        return pin(out.replace(lengths=cache.lengths))

    def step(params, cache, token):
        """Append one token per row (making room first) and return the next logits ``[b, V]``."""
        cache = kind.make_room(cache, 1)
        weights = jnp.ones((token.shape[0], 1), jnp.float32)  # every decode query counts for statistics
        logits, cache = model.apply({"params": params}, token[:, None], cache=cache, stat_weights=weights)
        return pin(cache), logits[:, 0]

    def decode_loop(params, state: DecodeState, limit, sampled: bool = True):
        def cond(s: DecodeState):
            return (s.step < limit) & ~jnp.all(s.done)

        def body(s: DecodeState):
            token = sample_rows(s.logits, s.sampling, s.step) if sampled else greedy(s.logits)
            token = jnp.where(s.done, pad_id, token)
            tokens = s.tokens.at[:, s.step].set(token)
            n_generated = s.n_generated + (~s.done).astype(jnp.int32)
            done = s.done | (token == eos_id) if eos_id is not None else s.done
            cache, logits = step(params, s.cache, token)
            return s.replace(cache=cache, logits=logits, tokens=tokens, n_generated=n_generated, done=done,
                             step=s.step + 1)

        state = jax.lax.while_loop(cond, body, state.replace(cache=split(state.cache)))
        return state.replace(cache=state.cache.stack_layers())

    def forced_loop(params, cache, logits, tokens, n, top: int = 0):
        """Teacher forcing of the first ``n`` of ``tokens [b, width]`` (the rest padding: one compiled program for
        every segment length): the log-probability of each given token, then append it (evicting as decode does).
        ``top``: also the ``top`` most likely tokens at each position (``[b, width, top]`` log-probabilities, ids)."""
        def body(carry):
            i, cache, logits, logprobs, best, best_ids = carry
            token = jax.lax.dynamic_index_in_dim(tokens, i, axis=1, keepdims=False)
            logprob, values, ids = logprob_top(logits, token, top)
            if top == 0:  # perplexity as it always was computed (the same float32 rounding)
                logprob = jnp.take_along_axis(jax.nn.log_softmax(logits), token[:, None], axis=-1)[:, 0]
            cache, logits = step(params, cache, token)
            return (i + 1, cache, logits, logprobs.at[:, i].set(logprob), best.at[:, i].set(values),
                    best_ids.at[:, i].set(ids))

        b, w = tokens.shape
        start = (jnp.int32(0), split(cache), logits, jnp.zeros(tokens.shape, logits.dtype),
                 jnp.zeros((b, w, top), logits.dtype), jnp.zeros((b, w, top), jnp.int32))
        _, cache, logits, logprobs, best, best_ids = jax.lax.while_loop(lambda c: c[0] < n, body, start)
        return cache.stack_layers(), logits, logprobs, best, best_ids

    def forced_chunk(params, cache, logits, tokens, n, stat_weights, top: int = 0):
        """Teacher forcing of ``n`` given tokens (``tokens [b, width]``, the rest padding) in one model call, like a
        prefill chunk: the log-probability of each (from the logits before it) and the logits after the last;
        ``top``: also each position's ``top`` most likely tokens (log-probabilities and ids, ``[b, width, top]``)."""
        width = tokens.shape[1]
        ok = jnp.broadcast_to(jnp.arange(width)[None, :] < n, tokens.shape)
        cache = kind.make_room(cache, n).replace(kind=forcing)
        out, cache = model.apply({"params": params}, tokens, cache=cache, ok=ok, stat_weights=stat_weights)
        cache = cache.replace(kind=kind)
        # Token i's distribution: the carried logits for the first, position i - 1's for the rest. Gathered logit
        # minus log-sum-exp, so no [b, width, V] log-softmax (or concatenated copy of the logits) is materialized.
        first = logprob_top(logits, tokens[:, 0], top)
        rest = logprob_top(out[:, :-1], tokens[:, 1:], top)
        logprobs, best, best_ids = (jnp.concatenate([a[:, None], b], axis=1) for a, b in zip(first, rest))
        return (pin(cache), jax.lax.dynamic_index_in_dim(out, n - 1, axis=1, keepdims=False), logprobs, best,
                best_ids)

    def serve_segment(params, cache, token, active, left, eos_stops, rows: RowSampling, steps, n_steps: int,
                      sampled: bool = True):
        """``n_steps`` steps of a server's active rows (``lcx.engine.server``): append ``token [b]``, sample the next
        one (``rows``; ``steps [b]``: each row's tokens so far, the key index of its next), stop a row at EOS (where
        ``eos_stops [b]``: a request may ask to ignore it) or when ``left [b]`` tokens are emitted. Returns
        ``(cache, tokens [S, b], emitted [S, b])``."""
        def body(carry, _):
            cache, token, active, left, steps = carry
            cache = kind.make_room(cache, active.astype(jnp.int32))
            # an active row's query counts for eviction statistics, as in ``step`` (H2O / TOVA / SnapKV score decode
            # queries); without the weights the server's evictions kept other slots than generate's
            weights = active[:, None].astype(jnp.float32)
            logits, cache = model.apply({"params": params}, token[:, None], cache=cache, ok=active[:, None],
                                        stat_weights=weights)
            nxt = sample_rows(logits[:, 0], rows, steps) if sampled else greedy(logits[:, 0])
            left = left - active
            stop = (left <= 0) | (((nxt == eos_id) & eos_stops) if eos_id is not None else False)
            return (cache, jnp.where(active, nxt, token), active & ~stop, left, steps + active), (nxt, active)

        carry = (split(cache), token, active, left, steps)
        (cache, *_), (tokens, emitted) = jax.lax.scan(body, carry, None, length=n_steps)
        return cache.stack_layers(), tokens, emitted

    return Programs(
        prefill_chunk=jax.jit(prefill_chunk, donate_argnames=("cache",)),
        end_prefill=jax.jit(end_prefill, donate_argnames=("cache",)),
        decode_loop=jax.jit(decode_loop, static_argnames=("sampled",), donate_argnames=("state",)),
        forced_loop=jax.jit(forced_loop, static_argnames=("top",)),
        forced_chunk=jax.jit(forced_chunk, static_argnames=("top",)),
        probe_chunk=jax.jit(probe_chunk, donate_argnames=("cache",)),
        serve_segment=jax.jit(serve_segment, static_argnames=("n_steps", "sampled"), donate_argnames=("cache",)),
        model=model)


MAX_MAPPINGS = 30_000  # memory regions a process may hold before release_compiled drops programs (Linux allows 65,530)


def release_compiled(max_mappings: int = MAX_MAPPINGS) -> bool:
    """Drop every compiled program jax and this module keep once the process holds more than ``max_mappings`` memory
    regions; returns whether it did. XLA:CPU maps each compiled program's code into regions of its own (~3 per
    kernel) and jax keeps every program alive: a long evaluation grid of a 30-layer model, each cell compiling its
    prefill, reconstruction and decode programs, crossed Linux's ``vm.max_map_count`` and died in LLVM ("Unable to
    allocate section memory"). Later calls compile again (or read the persistent compilation cache)."""
    import gc

    try:
        with open("/proc/self/maps") as maps:
            count = sum(1 for _ in maps)
    except OSError:  # not Linux: no such limit to watch
        return False
    if count <= max_mappings:
        return False
    programs.cache_clear()
    jax.clear_caches()
    gc.collect()
    return True


__all__ = ["MAX_MAPPINGS", "Programs", "programs", "release_compiled"]
