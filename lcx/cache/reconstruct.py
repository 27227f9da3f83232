"""Reconstruction scoring (KVzip, arXiv 2505.23416): queries that re-read the context score its slots and leave.

A policy that observes ``reconstructs`` (``Observes``; ``kvzip``) is scored after prefill by the model itself, asked
to repeat the context: the generator feeds a reconstruction prompt (``Reconstruction``: "Repeat the previous context
exactly.", the chat template's opening of the reply, then the context) one chunk of the context per pass. In every
layer the pass's queries

- attend to the whole cache and to themselves (causally), as a prefill chunk would - the hidden states the next
  layer sees - but their keys and values are not written: the cache keeps only the context;
- score each slot of the chunk being repeated by the largest probability any of those queries, and any query head
  of the slot's KV group, gives it in a softmax over the ``sinks`` first positions, the chunk and the pass's own
  tokens (kvpress's ``KVzipPress``). Slots outside every chunk (a chat header after the sinks) keep score 0.

Then the policy compresses once by those scores: query-agnostic, one compressed cache serves any question.

Shapes: b batch, t pass tokens, h query heads, k KV heads, g query heads per KV head, H keep heads, C slots,
W slots of one chunk, s sinks, d head dim.
"""

from __future__ import annotations

import dataclasses

import einops
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from lcx.cache.kv_view import KVView, attend_view
from lcx.cache.storage.views import FloatKV
from lcx.config_base import ConfigError
from lcx.kernels import Attended, merge_partials
from lcx.model.config import AttentionSpec
from lcx.model.rope import apply_rope
from lcx.parallel.sharding import BTHD, per_shard

BLOCK_Q = 128  # reconstruction queries scored per step: bounds the [b, h, Q, s + W + t] probabilities


@dataclasses.dataclass(frozen=True)
class Reconstruction:
    """The token ids of the reconstruction prompt, for one tokenizer and prompt framing (``lcx.data.haystack
    .Frame.reconstruction`` builds it from a tokenizer and its chat template).

    The first pass reads ``first + suffix + chunk_0``, pass i ``later + (the last tail tokens of chunk i-1) + suffix
    + chunk_i``. ``skip``: the prompt tokens before the context (BOS, the chat header), never reconstructed."""

    first: tuple[int, ...]
    later: tuple[int, ...]
    suffix: tuple[int, ...]
    skip: int = 0
    tail: int = 8

    def __post_init__(self):
        for name in ("first", "later", "suffix"):
            object.__setattr__(self, name, tuple(int(i) for i in getattr(self, name)))
        if not self.first or not self.later:
            raise ConfigError("Reconstruction.first and .later must be non-empty token ids (the repeat instruction)")
        if self.skip < 0 or self.tail < 0:
            raise ConfigError(f"Reconstruction.skip={self.skip} and .tail={self.tail} must be >= 0")

    def width(self, chunk: int) -> int:
        """Tokens of one pass (every pass padded to it: one compiled shape)."""
        return max(len(self.first), len(self.later) + self.tail) + len(self.suffix) + chunk

    def passes(self, ids: np.ndarray, lengths: np.ndarray, chunk: int):
        """The passes over prompts ``ids [b, n]`` (real tokens ``lengths [b]``): ``(tokens [b, width], ok [b,
        width], lo, hi [b])`` each, the context positions ``lo .. hi - 1`` of each row repeated (``hi = lo`` for a
        row whose context has ended; its tokens are all padding)."""
        width = self.width(chunk)
        longest = int(np.max(lengths)) - self.skip
        out = []
        for c in range(max(0, -(-longest // chunk))):
            lo = self.skip + c * chunk
            tokens = np.zeros((len(ids), width), np.int32)
            ok = np.zeros((len(ids), width), bool)
            hi = np.minimum(lengths, lo + chunk).astype(np.int32)
            for r in range(len(ids)):
                if hi[r] <= lo:
                    hi[r] = lo
                    continue
                lead = self.first if c == 0 else self.later + tuple(ids[r, max(self.skip, lo - self.tail):lo])
                row = np.concatenate([np.asarray(lead + self.suffix, np.int32), ids[r, lo:hi[r]]])
                tokens[r, :len(row)], ok[r, :len(row)] = row, True
            out.append((tokens, ok, np.int32(lo), hi))
        return out


@flax.struct.dataclass
class Probe:
    """One reconstruction pass, as the layers see it: the chunk's positions ``lo`` (int32, every row) to ``hi [b]``
    (exclusive); ``sinks`` and ``width`` (the chunk size: slots scored per pass) are static."""

    lo: jax.Array
    hi: jax.Array
    sinks: int = flax.struct.field(pytree_node=False, default=4)
    width: int = flax.struct.field(pytree_node=False, default=2048)


def attend(kind, layer, q, key, val, *, cos, sin, ok, spec: AttentionSpec, probe: Probe, storage=None):
    """``SlotCacheKind.attend`` for a reconstruction pass: ``q [b, t, h, d]`` attends to the cache and to the pass's
    own ``key, val [b, t, k, d]`` (causal, padding ``ok`` False hidden) - two partial attentions merged exactly - and
    the chunk's slots are scored (``chunk_scores``). Returns ``(out, layer)`` with only ``layer.score`` changed.
    ``storage``: what ``layer`` holds (default ``kind.storage``; ``KVStorage.readable`` gives it)."""
    storage = storage or kind.storage
    if kind.policy.mode != "original" or spec.window is not None:
        raise ConfigError("reconstruction scoring needs keys at their original positions on global-attention layers "
                          "(cache.positions 'original', no sliding window)")
    q, key = apply_rope(q, cos, sin), apply_rope(key, cos, sin)
    b = q.shape[0]
    heads, kv_heads = layer.pos.shape[1], layer.k.shape[1]
    per_kv = (lambda x: x[:, 0]) if heads == 1 else (  # noqa: E731
        lambda x: einops.repeat(x, "b H ... -> b (H j) ...", j=kv_heads // heads))
    # Every query sees every live slot (all older than the pass): not causal. Before the compression the slots are
    # the prompt's positions, packed.
    stored = storage.view(layer, q.dtype, impl=kind.model.attention.impl, queries=q.shape[1], counted=False,
                          codes=True)
    cached = KVView(kv=stored, lengths=per_kv(layer.count), offsets=jnp.zeros_like(per_kv(layer.count)), causal=False)
    n = jnp.sum(ok, axis=1, dtype=jnp.int32)
    own = KVView(kv=FloatKV(k=key.swapaxes(1, 2), v=val.swapaxes(1, 2)), lengths=n, offsets=jnp.zeros((b,), jnp.int32))
    residual = Attended(out=BTHD, m=BTHD[:3], l=BTHD[:3])
    core = lambda q, view: attend_view(kind.model.attention.impl, q, view, spec, residuals=True)  # noqa: E731
    parts = [per_shard(core, (BTHD, view.axes()), residual)(q, view) for view in (cached, own)]
    out, _, _ = merge_partials(*parts)
    return out.astype(q.dtype), layer.replace(score=chunk_scores(layer, q, key, ok, spec, probe, storage))


def chunk_scores(layer, q, key, ok, spec: AttentionSpec, probe: Probe, storage) -> jax.Array:
    """``layer.score [b, H, C]`` with KVzip's statistic written into the slots of the chunk ``probe.lo .. probe.hi``
    (rotated ``q [b, t, h, d]``, ``key [b, t, k, d]``; other slots keep theirs). Per query, a softmax over the sinks
    (positions ``< min(sinks, lo)``), the chunk and the pass's own tokens up to it; a slot's score is the largest
    probability it gets from any real query and any query head of its KV group (max over the KV heads of a shared
    keep set). Only the ``W = min(width, C)`` slots from the chunk's start are read (``storage``: what ``layer``
    holds, whose float keys they are)."""
    b, t, h, d = q.shape
    heads, kv_heads, slots = layer.pos.shape[1], layer.k.shape[1], layer.pos.shape[-1]
    width, sinks = min(probe.width, slots), min(probe.sinks, slots)
    start = jnp.clip(probe.lo, 0, slots - width)
    take = lambda x: jax.lax.dynamic_slice_in_dim(x, start, width, axis=2)  # noqa: E731  [b, k|H, C, ...] -> W
    k_chunk = storage.float_keys(layer, take)  # [b, k, W, d] float32
    k_sink = storage.float_keys(layer, lambda x: x[:, :, :sinks])  # [b, k, s, d]
    pos_chunk, valid_chunk = take(layer.pos), take(layer.valid)  # [b, H, W]
    in_chunk = valid_chunk & (pos_chunk >= probe.lo) & (pos_chunk < probe.hi[:, None, None])
    in_sink = layer.valid[..., :sinks] & (layer.pos[..., :sinks] < jnp.minimum(probe.sinks, probe.lo))
    per_kv = lambda x: einops.repeat(x, "b H S -> b (H j) S", j=kv_heads // heads)  # noqa: E731
    keys = jnp.concatenate([k_sink, k_chunk, key.swapaxes(1, 2).astype(jnp.float32)], axis=2)  # [b, k, s+W+t, d]
    seen = jnp.concatenate([per_kv(in_sink), per_kv(in_chunk), jnp.broadcast_to(ok[:, None], (b, kv_heads, t))],
                           axis=2)  # [b, k, s+W+t]
    blocks = -(-t // BLOCK_Q)
    qb = jnp.pad(q.astype(jnp.float32), ((0, 0), (0, blocks * BLOCK_Q - t), (0, 0), (0, 0)))
    qb = einops.rearrange(qb, "b (n Q) (k g) d -> n b k g Q d", Q=BLOCK_Q, k=kv_heads)
    okb = einops.rearrange(jnp.pad(ok, ((0, 0), (0, blocks * BLOCK_Q - t))), "b (n Q) -> n b Q", Q=BLOCK_Q)
    own = jnp.arange(keys.shape[2]) - (sinks + width)  # the pass token each key is (negative: a cache slot)

    def block(best, x):
        i, qi, oki = x
        s = jnp.einsum("bkgQd,bkSd->bkgQS", qi, keys) * spec.sm_scale
        if spec.softcap is not None:
            s = spec.softcap * jnp.tanh(s / spec.softcap)
        row = i * BLOCK_Q + jnp.arange(BLOCK_Q)  # the queries' indices in the pass
        visible = seen[:, :, None, None, :] & (own[None, :] <= row[:, None])[None, None, None]
        p = jax.nn.softmax(jnp.where(visible, s, -jnp.inf), axis=-1, where=visible)
        p = jnp.where(visible & oki[:, None, None, :, None], p, 0.0)[..., sinks:sinks + width]  # [b, k, g, Q, W]
        return jnp.maximum(best, jnp.max(p, axis=(2, 3))), None

    best, _ = jax.lax.scan(block, jnp.zeros((b, kv_heads, width), jnp.float32), (jnp.arange(blocks), qb, okb))
    score = einops.reduce(best, "b (H j) W -> b H W", "max", H=heads)
    return jax.lax.dynamic_update_slice_in_dim(layer.score, jnp.where(in_chunk, score, take(layer.score)), start,
                                               axis=-1)


__all__ = ["Probe", "Reconstruction", "attend", "chunk_scores"]
