"""The compiled loop of self-speculative decoding (``lcx.engine.speculative``): draft, verify, accept, roll back.

One iteration, every row at once and each on its own:

1. the draft cache takes the row's pending token (and, when the last verification accepted all ``k`` drafts, that
   last draft, which it has not read yet: a 2-token chunk) and drafts ``k`` tokens, one step at a time;
2. the full cache takes the pending token and the ``k`` drafts in one ``k + 1``-token chunk: ``k + 1``
   distributions, the full cache read once;
3. the row accepts the longest agreeing prefix (``accept_greedy`` / ``accept_sampled``) and one token of the
   target's, and emits them (cut at EOS and at ``max_new_tokens``);
4. both caches forget what was rejected (``SlotCacheKind.truncate``): the full cache keeps the pending token and the
   accepted drafts, the draft cache what it read of them.

A row's pending token is emitted but in neither cache yet. Rows that are done append nothing (``ok`` False).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from lcx.cache.base import CacheState
from lcx.engine.sampling import RowSampling, greedy
from lcx.engine.speculative import accept_greedy, accept_sampled, draw, row_probs, token_keys
from lcx.model.config import ModelConfig
from lcx.model.decoder import Decoder


@flax.struct.dataclass
class SpecState:
    """What speculative decoding carries between compiled calls."""

    target: CacheState  # the full cache: the prompt, the emitted tokens but the pending one
    draft: CacheState  # the compressed cache the drafts read
    token: jax.Array  # [b] int32: the pending token (emitted, in neither cache)
    extra: jax.Array  # [b] int32: the last draft of a fully accepted verification (in the target, not the draft)
    has_extra: jax.Array  # [b] bool
    tokens: jax.Array  # [b, width] int32 emitted (pad after EOS)
    n_generated: jax.Array  # [b] int32
    limit: jax.Array  # [b] int32: the row's max_new_tokens (at most ``width``)
    stops: jax.Array  # [b] bool: EOS ends the row (False: ignore_eos, it generates ``limit`` tokens)
    done: jax.Array  # [b] bool
    drafted: jax.Array  # [b] int32: draft tokens verified
    accepted: jax.Array  # [b] int32: draft tokens accepted
    verifications: jax.Array  # [b] int32
    step: jax.Array  # int32 scalar: iterations run
    sampling: RowSampling


@functools.lru_cache(maxsize=32)
def spec_program(config: ModelConfig, eos_id: int | None, pad_id: int, target_kind: Any, draft_kind: Any, k: int,
                 unrolled: bool, confidence: float | None = None):
    """The jitted ``loop(params, state, limit, sampled)`` of one configuration: iterations until ``limit`` or until
    every row is done. ``sampled`` (static): some row samples (else the argmax-only program). ``confidence``:
    adaptive ``k`` (``SpeculativeConfig.confidence``; None: ``k`` drafts per iteration)."""
    model = Decoder(config, unrolled=unrolled)
    split = (lambda c: c.split_layers()) if unrolled else (lambda c: c)  # noqa: E731
    # calls of k + 1 queries (the verification) and 2 (the draft's catch-up) attend query by query over the caches'
    # own layout: a chunk kernel's layout would copy the whole full cache per layer and call (kv_view.attend_view)
    given = (target_kind, draft_kind)
    target_kind = dataclasses.replace(target_kind, few_queries=k + 1)
    draft_kind = dataclasses.replace(draft_kind, few_queries=2)

    def forward(params, cache, ids, ok, logits_index=None, stats=False):
        weights = ok.astype(jnp.float32) if stats else None  # a draft's decode queries feed its policy's statistics
        return model.apply({"params": params}, ids, cache=cache, ok=ok, logits_index=logits_index,
                           stat_weights=weights)

    def draft_all(params, cache, d, q, active, first, pick):
        """Drafts 1 .. k - 1 after ``d`` (draft 0), one step each: ``(cache, drafts [b, k], q [b, k, V] or None)``."""
        def step(carry, i):
            cache, d = carry
            cache = draft_kind.make_room(cache, active.astype(jnp.int32))
            logits, cache = forward(params, cache, d[:, None], active[:, None], stats=True)
            nxt, q = pick(logits[:, 0], first + i)
            return (cache, nxt), (nxt, q)

        if k == 1:
            return cache, d[:, None], None if q is None else q[:, None]
        (cache, _), (more, more_q) = jax.lax.scan(step, (cache, d), jnp.arange(1, k))
        drafts = jnp.concatenate([d[:, None], jnp.moveaxis(more, 0, 1)], axis=1)
        return cache, drafts, None if q is None else jnp.concatenate([q[:, None], jnp.moveaxis(more_q, 0, 1)], 1)

    def draft_while_sure(params, cache, d, q, logits, active, first, pick):
        """Adaptive ``k``: a row drafts on while the draft gave its last token a probability of at least
        ``confidence``; the steps end when no row drafts (or after ``k``). ``(cache, drafts [b, k] (0 past a row's
        own), q [b, k, V] or None, drafts per row [b])``."""
        b = d.shape[0]
        sure = lambda logits, token: jnp.take_along_axis(  # noqa: E731
            jax.nn.softmax(logits.astype(jnp.float32), axis=-1), token[:, None], axis=1)[:, 0] >= confidence
        drafts = jnp.zeros((b, k), jnp.int32).at[:, 0].set(d)
        qs = None if q is None else jnp.zeros((b, k) + q.shape[1:], q.dtype).at[:, 0].set(q)

        def step(carry):
            i, cache, drafting, n, drafts, qs = carry
            cache = draft_kind.make_room(cache, drafting.astype(jnp.int32))
            last = jax.lax.dynamic_index_in_dim(drafts, i - 1, axis=1, keepdims=False)
            logits, cache = forward(params, cache, last[:, None], drafting[:, None], stats=True)
            nxt, q = pick(logits[:, 0], first + i)
            drafts = jax.lax.dynamic_update_index_in_dim(drafts, jnp.where(drafting, nxt, 0), i, axis=1)
            if qs is not None:
                qs = jax.lax.dynamic_update_index_in_dim(qs, q, i, axis=1)
            return i + 1, cache, drafting & sure(logits[:, 0], nxt), n + drafting, drafts, qs

        carry = (jnp.int32(1), cache, active & sure(logits, d), active.astype(jnp.int32), drafts, qs)
        _, cache, _, n, drafts, qs = jax.lax.while_loop(lambda c: (c[0] < k) & jnp.any(c[2]), step, carry)
        return cache, drafts, qs, n

    def body(params, s: SpecState, sampled: bool) -> SpecState:
        b = s.token.shape[0]
        active = ~s.done
        first = s.n_generated  # output index of the first draft

        def pick(logits, index):  # the draft token at output index ``index`` and its distribution
            if not sampled:
                return greedy(logits), None
            q = row_probs(logits[:, None], s.sampling)[:, 0]
            drawn = draw(q, token_keys(s.sampling, index, 1))
            return jnp.where(s.sampling.temperature > 0, drawn, greedy(logits)), q

        # 1. draft: [extra, token] or [token, pad], then k - 1 one-token steps
        ids = jnp.where(s.has_extra[:, None], jnp.stack([s.extra, s.token], 1), jnp.stack([s.token, s.token], 1))
        ok = jnp.stack([active, active & s.has_extra], 1)
        draft = draft_kind.make_room(s.draft, jnp.sum(ok, axis=1, dtype=jnp.int32))
        logits, draft = forward(params, draft, ids, ok, s.has_extra.astype(jnp.int32), stats=True)
        d, q = pick(logits[:, 0], first)

        if confidence is None:
            draft, drafts, q_all = draft_all(params, draft, d, q, active, first, pick)
            n_drafts = jnp.full((b,), k, jnp.int32)
        else:
            draft, drafts, q_all, n_drafts = draft_while_sure(params, draft, d, q, logits[:, 0], active, first, pick)

        # 2. verify: the pending token and the k drafts through the full cache
        start = s.target.lengths
        ids = jnp.concatenate([s.token[:, None], drafts], axis=1)
        ok = jnp.broadcast_to(active[:, None], ids.shape)
        logits, target = forward(params, target_kind.make_room(s.target, jnp.sum(ok, 1, dtype=jnp.int32)), ids,
                                 ok)

        # 3. accept and emit
        if sampled:
            accepted, nxt = accept_sampled(row_probs(logits, s.sampling), q_all, drafts, s.sampling, first, n_drafts)
            g_accepted, g_next = accept_greedy(logits, drafts, n_drafts)
            greedy_row = s.sampling.temperature <= 0
            accepted = jnp.where(greedy_row, g_accepted, accepted)
            nxt = jnp.where(greedy_row, g_next, nxt)
        else:
            accepted, nxt = accept_greedy(logits, drafts, n_drafts)
        j = jnp.arange(k + 1)[None, :]
        out = jnp.where(j < accepted[:, None], jnp.pad(drafts, ((0, 0), (0, 1))), nxt[:, None])  # [b, k + 1]
        width = s.tokens.shape[1]
        n_emit = jnp.minimum(accepted + 1, s.limit - s.n_generated)
        if eos_id is not None:  # cut after the first EOS among the emitted
            hit = (out == eos_id) & (j < n_emit[:, None]) & s.stops[:, None]
            first_eos = jnp.argmax(hit, axis=1)
            n_emit = jnp.where(jnp.any(hit, axis=1), first_eos + 1, n_emit)
            stopped = jnp.any(hit, axis=1)
        else:
            stopped = jnp.zeros_like(active)
        n_emit = jnp.where(active, n_emit, 0)
        where = jnp.where(j < n_emit[:, None], s.n_generated[:, None] + j, width)  # past the end: dropped
        tokens = s.tokens.at[jnp.arange(b)[:, None], where].set(out, mode="drop")
        n_generated = s.n_generated + n_emit
        done = s.done | stopped | (n_generated >= s.limit)

        # 4. roll back what was rejected: the target keeps token + accepted drafts, the draft what it read of them
        target = target_kind.truncate(target, jnp.where(active, start + accepted + 1, start))
        read = jnp.where(active, start + jnp.minimum(accepted + 1, n_drafts), s.draft.lengths)
        draft = draft_kind.truncate(draft, read)
        full = active & (accepted == n_drafts)  # the last draft was accepted: the draft cache has not read it
        last = jnp.take_along_axis(drafts, jnp.maximum(n_drafts - 1, 0)[:, None], axis=1)[:, 0]
        return s.replace(target=target, draft=draft, token=jnp.where(active, nxt, s.token),
                         extra=jnp.where(full, last, s.extra), has_extra=full, tokens=tokens,
                         n_generated=n_generated, done=done, drafted=s.drafted + n_drafts * active,
                         accepted=s.accepted + jnp.where(active, accepted, 0), verifications=s.verifications + active,
                         step=s.step + 1)

    def loop(params, state: SpecState, limit, sampled: bool = True) -> SpecState:
        state = jax.lax.while_loop(lambda s: (s.step < limit) & ~jnp.all(s.done),
                                   lambda s: body(params, s, sampled),
                                   state.replace(target=split(state.target.replace(kind=target_kind)),
                                                 draft=split(state.draft.replace(kind=draft_kind))))
        return state.replace(target=state.target.stack_layers().replace(kind=given[0]),
                             draft=state.draft.stack_layers().replace(kind=given[1]))

    return jax.jit(loop, static_argnames=("sampled",), donate_argnames=("state",))


__all__ = ["SpecState", "spec_program"]
