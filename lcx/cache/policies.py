"""The built-in eviction policies: full, window, StreamingLLM, H2O, observed attention, TOVA, SnapKV, ChunkKV,
Expected Attention, KVzip, DuoAttention, K-norm, random (the LaCache ladder is in ``ladder.py``, KeyDiff in
``keydiff.py``, CAPKV in ``capkv.py``). Each scores one layer's slots (of one KV head, for per-head policies) from
what it declares it observes (``observes``); ``compact`` does the rest.

Slots are packed at the front in position order, so slot rank ``j`` counts tokens from the oldest live one and
``count - 1 - j`` from the newest. Attention scores are probabilities summed over the counted queries and the query
heads that share the keep set (a KV head's group, or the whole layer); sums and means rank alike.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from lcx.cache.observes import Observes
from lcx.cache.policy import (PROTECT, EvictionPolicy, ScoredPolicy, future_rotation, need_budget_above,
                              need_original_positions, newest, register, top_budget)
from lcx.config_base import ConfigError


@register
@dataclasses.dataclass(frozen=True)
class Full(EvictionPolicy):
    """Keep everything: the cache grows to prompt + new tokens, and that size is checked before running."""

    name: ClassVar[str] = "full"
    evicts: ClassVar[bool] = False

    def select(self, view, budget):
        return view.valid, view.score


@register
@dataclasses.dataclass(frozen=True)
class Window(EvictionPolicy):
    """The ``budget`` most recent tokens (local attention)."""

    name: ClassVar[str] = "window"

    def scores(self, view, budget):
        return view.pos.astype(jnp.float32)


@register
@dataclasses.dataclass(frozen=True)
class Streaming(EvictionPolicy):
    """StreamingLLM: ``sinks`` first tokens (attention sinks) + the most recent ones; positions by slot rank."""

    name: ClassVar[str] = "streaming"
    position_mode: ClassVar[str] = "cache"
    sinks: int = 4

    def __post_init__(self):
        super().__post_init__()
        if self.sinks < 0:
            raise ConfigError(f"cache.sinks={self.sinks} is invalid: must be >= 0")

    def scores(self, view, budget):
        return view.pos.astype(jnp.float32) + jnp.where(view.pos < self.sinks, PROTECT, 0.0)

    def check(self, n_layers, budgets):
        need_budget_above(self.name, "cache.sinks", self.sinks, budgets)


@register
@dataclasses.dataclass(frozen=True)
class H2O(ScoredPolicy):
    """Heavy hitters: ``recent`` newest tokens + the highest accumulated attention (default recent = budget / 2),
    summed over the queries so far - as in the H2O paper, which favours old tokens (more queries saw them)."""

    name: ClassVar[str] = "h2o"
    observes: ClassVar[Observes] = Observes(attention="sum")
    recent: int | None = None

    def scores(self, view, budget):
        recent = budget // 2 if self.recent is None else self.recent
        return view.score + jnp.where(newest(view, recent), PROTECT, 0.0)

    def check(self, n_layers, budgets):
        if self.recent is not None:
            need_budget_above(self.name, "cache.recent", self.recent, budgets)


@register
@dataclasses.dataclass(frozen=True)
class Observed(ScoredPolicy):
    """Observed attention (kvpress ``ObservedAttentionPress``): the attention a token received, summed over the
    queries so far and divided by how many queries saw it - the mean attention per query, so old tokens are not
    favoured for having been seen longer (the difference from ``h2o``)."""

    name: ClassVar[str] = "observed"
    observes: ClassVar[Observes] = Observes(attention="sum")

    def scores(self, view, budget):
        seen = view.consumed()[:, None] - view.pos  # every query from the token's own on saw it
        return view.score / jnp.maximum(seen, 1).astype(jnp.float32)


@register
@dataclasses.dataclass(frozen=True)
class TOVA(ScoredPolicy):
    """Token omission via attention: evict the tokens the current query attends to least, averaged over all heads of
    the layer (as the paper does: one keep set per layer); the newest token is always kept (as kvpress does).

    With ``interval`` > 1 the ``interval`` lowest are evicted together, judged by the query of the step that
    overflows; ``interval: 1`` is the paper's one-token-per-step schedule.
    """

    name: ClassVar[str] = "tova"
    observes: ClassVar[Observes] = Observes(attention="replace", window=1)  # the last prompt query's attention
    head_mode: ClassVar[str] = "shared"

    def scores(self, view, budget):
        return view.score + jnp.where(newest(view, 1), PROTECT, 0.0)


@register
@dataclasses.dataclass(frozen=True)
class SnapKV(ScoredPolicy):
    """SnapKV (arXiv 2404.14469): the attention the last ``window`` prompt queries give each earlier token, pooled
    over ``kernel`` neighbouring positions of the prefix; the window itself is kept. Per KV head, the scores of its
    query group summed (the reference code averages over a GQA group; the same ranking).

    Defaults are the reference implementation's (``snapkv_utils.py``: window 32, kernel 5, average pooling; kvpress
    uses window 64). Pooling runs over the prefix only: the window's own columns count as zero, like the padding at
    the ends, so tokens just before the window get no credit from it. During decode the score keeps accumulating
    the new queries' attention and the newest ``window`` tokens stay protected.
    """

    name: ClassVar[str] = "snapkv"
    window: int = 32
    kernel: int = 5
    pooling: str = "avg"

    def __post_init__(self):
        super().__post_init__()
        if self.window < 1:
            raise ConfigError(f"cache.window={self.window} is invalid: must be >= 1")
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise ConfigError(f"cache.kernel={self.kernel} is invalid: must be a positive odd integer")
        if self.pooling not in ("max", "avg"):
            raise ConfigError(f"cache.pooling={self.pooling!r} is invalid: must be 'max' or 'avg'")

    @property
    def observes(self) -> Observes:
        return Observes(attention="sum", window=self.window)  # the observation window's attention

    def scores(self, view, budget):
        window = newest(view, self.window)
        s = jnp.where(view.valid & ~window, view.score, 0.0)  # the prefix: the window's columns pool as zeros
        dims, strides = (1, self.kernel), (1, 1)
        if self.pooling == "max":
            pooled = jax.lax.reduce_window(s, -jnp.inf, jax.lax.max, dims, strides, "SAME")
        else:
            pooled = jax.lax.reduce_window(s, 0.0, jax.lax.add, dims, strides, "SAME") / self.kernel
        return pooled + jnp.where(window, PROTECT, 0.0)

    def check(self, n_layers, budgets):
        need_budget_above(self.name, "cache.window", self.window, budgets)


@register
@dataclasses.dataclass(frozen=True)
class ChunkKV(SnapKV):
    """ChunkKV (arXiv 2502.00299): keep whole chunks of ``chunk`` consecutive positions instead of single tokens, so
    that a kept phrase stays whole. A chunk's score is the mean of its tokens' SnapKV scores (the observation
    window's attention, pooled; the window protected, so chunks holding it come first); the best chunks are kept
    while they fit the budget. One keep set per layer, the heads' scores summed (kvpress's ``ChunkKVPress`` over a
    SnapKV press: the same indices for every head, ``int(chunks x (1 - c))`` chunks). Chunks are fixed by original
    position (``pos // chunk``), so a chunk a decode-time eviction splits never re-forms."""

    name: ClassVar[str] = "chunkkv"
    head_mode: ClassVar[str] = "shared"
    chunk: int = 20

    def __post_init__(self):
        super().__post_init__()
        if self.chunk < 1:
            raise ConfigError(f"cache.chunk={self.chunk} is invalid: must be >= 1 (tokens per chunk)")
        if self.adaptive:
            raise ConfigError(f"cache.head_budget={self.head_budget!r} is invalid for cache.policy='chunkkv': it "
                              "keeps whole chunks per keep set; allowed: 'uniform'")

    def select(self, view, budget):
        slots = view.pos.shape[-1]
        scores = jnp.where(view.valid, self.scores(view, budget), 0.0)
        # slots are packed in position order, so a row's chunks are runs of slots: number them 0, 1, ... per row
        chunk_of = jnp.where(view.valid, view.pos // self.chunk, -1)
        starts = view.valid & (chunk_of != jnp.pad(chunk_of, ((0, 0), (1, 0)), constant_values=-1)[:, :-1])
        index = jnp.where(view.valid, jnp.cumsum(starts, axis=-1) - 1, slots)  # [b, C]; dead slots: out of range
        per_chunk = jax.vmap(lambda x, i: jax.ops.segment_sum(x, i, num_segments=slots + 1)[:slots])
        sizes = per_chunk(view.valid.astype(jnp.int32), index)  # [b, C] tokens per chunk (0: no such chunk)
        mean = per_chunk(scores, index) / jnp.maximum(sizes, 1)
        newer = jnp.broadcast_to(jnp.arange(slots), sizes.shape)
        order = jnp.lexsort((-newer, -jnp.where(sizes > 0, mean, -jnp.inf)), axis=-1)  # best first, ties: newer
        fits = jnp.cumsum(jnp.take_along_axis(sizes, order, axis=-1), axis=-1) <= budget
        kept = jnp.zeros_like(fits).at[jnp.arange(fits.shape[0])[:, None], order].set(fits)  # per chunk
        keep = view.valid & jnp.take_along_axis(kept, jnp.minimum(index, slots - 1), axis=-1)
        return keep, view.score

    def check(self, n_layers, budgets):
        super().check(n_layers, budgets)
        small = [b for b in budgets if b < self.chunk]
        if small:
            raise ConfigError(f"cache.budget={min(small)} is invalid for cache.policy='chunkkv': it must hold one "
                              f"chunk (cache.chunk={self.chunk})")


@register
@dataclasses.dataclass(frozen=True)
class ExpectedAttention(ScoredPolicy):
    """Expected Attention (kvpress ``ExpectedAttentionPress``): score each key by the attention the *future* queries
    are expected to give it. The queries seen so far (prefill and decode, all but the first ``sinks`` positions) are
    summarised by their running mean and covariance per query head (``Observes.moments``, kept by the cache); the
    rotation of the next ``horizon`` positions is averaged (RoPE is linear in its cos / sin tables, so the average
    rotation is RoPE with the averaged tables) and applied to both. For a Gaussian query ``q ~ N(mu, S)`` the
    expected ``exp(q.k)`` is ``exp(mu.k + k S k / 2)``: its softmax over the non-sink keys, averaged over a KV head's
    query group, times the value's norm (``vnorm``), is the score; the ``sinks`` first positions are always kept.
    Queries carry the layer's logit scale, so ``mu.k`` is the expected logit. Keys must stay at their original
    positions (the moments are rotated to the future positions).

    Parameters (kvpress's names): ``horizon`` (``n_future_positions``, 512), ``sinks`` (``n_sink``, 4),
    ``covariance`` (``use_covariance``), ``vnorm`` (``use_vnorm``), ``epsilon``.
    """

    name: ClassVar[str] = "expected_attention"
    sinks: int = 4
    horizon: int = 512
    covariance: bool = True
    vnorm: bool = True
    epsilon: float = 0.0

    def __post_init__(self):
        super().__post_init__()
        if self.sinks < 0:
            raise ConfigError(f"cache.sinks={self.sinks} is invalid: must be >= 0")
        if self.horizon < 1:
            raise ConfigError(f"cache.horizon={self.horizon} is invalid: must be >= 1 (future positions averaged)")
        need_original_positions(self, "it rotates the query moments to future original positions")

    @property
    def observes(self) -> Observes:  # sink queries are outliers (kvpress drops them too)
        return Observes(moments=2 if self.covariance else 1, moments_from=self.sinks, kv=True)

    def scores(self, view, budget):
        if view.q_mean is None:
            raise ValueError("expected_attention needs the query moments in its view (a slot cache built for it)")
        rotate = future_rotation(view, self.horizon)  # x [b, n, d]: each of n vectors to the next `horizon` positions
        b, g, d = view.q_mean.shape
        kv_heads = view.k.shape[2]
        keys = jnp.repeat(view.keys(), g // kv_heads, axis=2)  # [b, C, g, d] each query head's KV head
        # Legend: b batch, C slots, g query heads of these slots, d / e head dim.
        logits = jnp.einsum("bgd,bCgd->bgC", rotate(view.q_mean), keys)
        if self.covariance:
            cov = view.q_m2 / jnp.maximum(view.q_count, 1.0)[:, None, None, None]
            cov = rotate(cov.reshape(b, g * d, d)).reshape(b, g, d, d)  # S R^T
            cov = rotate(jnp.swapaxes(cov, -1, -2).reshape(b, g * d, d)).reshape(b, g, d, d)  # R S R^T
            logits += 0.5 * jnp.einsum("bCgd,bgde,bCge->bgC", keys, cov, keys)
        scored = view.valid & (view.pos >= self.sinks)
        probs = jax.nn.softmax(jnp.where(scored[:, None], logits, -jnp.inf), axis=-1)
        probs = jnp.where(scored[:, None], probs, 0.0)
        per_kv = jnp.mean(probs.reshape(b, kv_heads, g // kv_heads, -1), axis=2)  # [b, j, C] a group's mean
        if self.vnorm:
            norms = jnp.sqrt(jnp.sum(jnp.square(view.values()), axis=-1))  # [b, C, j]
            per_kv = (per_kv + self.epsilon) * jnp.swapaxes(norms, 1, 2)
        return jnp.sum(per_kv, axis=1) + jnp.where(view.valid & (view.pos < self.sinks), PROTECT, 0.0)

    def check(self, n_layers, budgets):
        need_budget_above(self.name, "cache.sinks", self.sinks, budgets)


@register
@dataclasses.dataclass(frozen=True)
class KVzip(ScoredPolicy):
    """KVzip (arXiv 2505.23416; kvpress ``KVzipPress``): score each prompt token by how much the model needs it to
    *repeat* the context. After prefill the generator runs reconstruction passes (``lcx.cache.reconstruct``: "Repeat
    the previous context exactly." and the context again, ``chunk`` tokens per pass) whose queries score every
    slot of the chunk they repeat by the largest attention it receives - per KV head, over its query group and the
    pass's queries, in a softmax over the ``sinks`` first positions, the chunk and the pass itself - and then the
    cache is compressed once by those scores. Query-agnostic: the same compressed cache serves any question.

    Per KV head by default; ``head_budget: adaptive`` spreads a layer's budget over its heads by these scores
    (kvpress's ``layerwise=True`` is ``head_floor: 0`` with a cap of all the layer's slots) and ``global`` every
    layer's too (kvpress's default: ``head_floor: 0``; a head holds at most ``head_cap x budget`` slots, the
    cache's capacity - ``head_cap: 1 / (1 - compression)`` caps nothing). The ``sinks`` first positions are always
    kept. Scores are computed once: tokens appended after the prompt score 0, so an eviction during decoding
    removes them first - KVzip is a one-shot compression (``interval`` >= prompt length - budget + the tokens to
    come).
    """

    name: ClassVar[str] = "kvzip"
    observes: ClassVar[Observes] = Observes(reconstructs=True)
    sinks: int = 4
    chunk: int = 2048

    def __post_init__(self):
        super().__post_init__()
        if self.sinks < 0:
            raise ConfigError(f"cache.sinks={self.sinks} is invalid: must be >= 0")
        if self.chunk < 1:
            raise ConfigError(f"cache.chunk={self.chunk} is invalid: must be >= 1 (context tokens per "
                              "reconstruction pass)")
        need_original_positions(self, "its reconstruction passes attend to keys at their original positions")

    def scores(self, view, budget):
        return view.score + jnp.where(view.valid & (view.pos < self.sinks), PROTECT, 0.0)

    def check(self, n_layers, budgets):
        need_budget_above(self.name, "cache.sinks", self.sinks, budgets)


@register
@dataclasses.dataclass(frozen=True)
class Duo(EvictionPolicy):
    """DuoAttention's head split (arXiv 2410.10819, ``lcx.cache.duo``): *streaming* KV heads keep the first ``sinks``
    and the ``recent`` newest tokens, *retrieval* heads keep everything (up to ``cache.budget``, past it the newest,
    sinks kept). The ``head_ratio`` share of (layer, KV head) pairs stream: those whose attention, measured on a
    calibration text, falls least outside the streaming window (``scores``, one per layer and KV head:
    ``lcx.cache.duo.head_scores`` over the last ``queries`` (32) positions of each calibration row; when not given,
    the generator calibrates on the text it is handed - evaluations hand passkey prompts with their answers,
    ``lcx.data.policy_inputs``).

    The cache holds ``budget`` slots per head for every head (the slot cache has one capacity), so the saving is in
    the tokens attended, not yet in memory: ``kept / prompt`` is ``1 - head_ratio x (1 - (sinks + recent) /
    prompt)``. Defaults: kvpress's on-the-fly DuoAttention (sinks 128, recent 256).
    """

    name: ClassVar[str] = "duo"
    head_mode: ClassVar[str] = "per_head"
    observes: ClassVar[Observes] = Observes(calibrates=True)
    sinks: int = 128
    recent: int = 256
    head_ratio: float = 0.5
    queries: int = 32
    scores: tuple[tuple[float, ...], ...] | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.queries < 1:
            raise ConfigError(f"cache.queries={self.queries} is invalid: must be >= 1 (the last positions of each "
                              "calibration row whose attention is measured)")
        if self.sinks < 0 or self.recent < 1:
            raise ConfigError(f"cache.sinks={self.sinks} / cache.recent={self.recent} are invalid: sinks >= 0 and "
                              "recent >= 1 (the streaming window)")
        if not 0.0 <= self.head_ratio <= 1.0:
            raise ConfigError(f"cache.head_ratio={self.head_ratio} is invalid: must be in [0, 1] (the share of KV "
                              "heads that stream)")
        if not self.per_head:
            raise ConfigError("cache.heads='shared' is invalid for cache.policy='duo': it splits the KV heads of a "
                              "layer; allowed: 'per_head'")

    @property
    def calibrated(self) -> bool:
        return self.scores is not None

    def calibrate(self, model, params, ids) -> "Duo":
        """This policy with ``scores`` measured on the calibration text ``ids`` (``lcx.cache.duo.head_scores``)."""
        from lcx.cache.duo import head_scores

        scores = head_scores(model, params, ids, sinks=self.sinks, recent=self.recent, queries=self.queries)
        return dataclasses.replace(self, scores=tuple(tuple(float(x) for x in row) for row in scores))

    def at_compression(self, compression, length):
        """Evicting ``compression`` of a context: the retrieval heads keep all ``length`` tokens, and the share of
        streaming heads is ``compression / (1 - (sinks + recent) / length)`` (at most 1)."""
        dropped = 1.0 - (self.sinks + self.recent) / length
        if dropped <= 0 or compression > dropped:
            raise ConfigError(f"cache.policy='duo' cannot evict {compression:g} of {length} tokens: its streaming "
                              f"heads keep sinks + recent = {self.sinks + self.recent}, at most {max(dropped, 0):.3g} "
                              "of the context can go")
        return {"head_ratio": round(compression / dropped, 3), "budget": length}

    def check_calibration(self, model) -> None:
        shape = (model.n_layers, model.n_kv_heads)
        if np.shape(self.streaming()) != shape:
            raise ConfigError(f"cache.scores has shape {np.shape(self.scores)}: it must hold one score per layer and "
                              f"KV head, {shape}")

    def streaming(self) -> np.ndarray:
        """``[L, k]`` bool: the streaming heads (``lcx.cache.duo.streaming_heads`` of ``scores``)."""
        from lcx.cache.duo import streaming_heads

        if self.scores is None:
            raise ConfigError("cache.policy='duo' has no head scores: give cache.scores (one per layer and KV head) "
                              "or a calibration text to the Generator (calibration=token ids)")
        return streaming_heads(self.scores, self.head_ratio)

    def select(self, view, budget):
        stream = jnp.asarray(self.streaming())[view.layer, view.head]
        newest = view.consumed()[:, None] - 1
        window = view.valid & ((view.pos < self.sinks) | (view.pos > newest - self.recent))
        recent_first = view.pos.astype(jnp.float32) + jnp.where(view.pos < self.sinks, PROTECT, 0.0)
        return jnp.where(stream, window, top_budget(recent_first, view, budget)), view.score

    def check(self, n_layers, budgets):
        need_budget_above(self.name, "cache.sinks + cache.recent", self.sinks + self.recent, budgets)
        if self.scores is not None and (len(self.scores) != n_layers or len({len(r) for r in self.scores}) != 1):
            raise ConfigError(f"cache.scores has {len(self.scores)} rows of lengths "
                              f"{sorted({len(r) for r in self.scores})}: it must have one row per layer ({n_layers}) "
                              "of one score per KV head")


@register
@dataclasses.dataclass(frozen=True)
class KNorm(ScoredPolicy):
    """Keep the keys with the smallest L2 norm (arXiv 2406.11430); attention-free. Per KV head by default; with a
    shared keep set the norms of the layer's KV heads are averaged."""

    name: ClassVar[str] = "knorm"
    observes: ClassVar[Observes] = Observes(kv=True)

    def scores(self, view, budget):
        norms = jnp.sqrt(jnp.sum(jnp.square(view.keys()), axis=-1))  # [b, C, k]
        return -jnp.mean(norms, axis=-1)


@register
@dataclasses.dataclass(frozen=True)
class Random(EvictionPolicy):
    """A uniformly random subset, reproducible: each (seed, layer, keep head, position) draws one fixed number."""

    name: ClassVar[str] = "random"
    seed: int = 0

    def scores(self, view, budget):
        key = jax.random.fold_in(jax.random.key(self.seed), view.layer)
        if self.per_head:
            key = jax.random.fold_in(key, view.head)
        draw = jax.vmap(lambda p: jax.random.uniform(jax.random.fold_in(key, p)))
        return draw(view.pos.reshape(-1)).reshape(view.pos.shape)
