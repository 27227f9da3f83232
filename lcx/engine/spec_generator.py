"""The host side of self-speculative decoding: one prefill, the draft cache derived from it, the compiled loop.

The prompt is prefilled once into a cache that holds all of it. For a draft policy that observes the prompt
(SnapKV, TOVA, H2O, KVzip, ...) that prefill runs under the draft policy's own cache kind, sized for the whole
context, so its statistics (and KVzip's reconstruction scores) are gathered as a prefill with that policy gathers
them; for one that observes nothing (StreamingLLM, LaCache: positions only) under the target kind. Then, in one
compiled call:

- the target (the full cache) is that state's keys and values, the same arrays: no copy;
- the draft is the policy's end-of-prefill compression of that state, cut to its budget + ``interval`` slots
  (eviction packs survivors at the front), keys un-rotated for a rank-rotating policy, encoded in the draft's
  ``kv_dtype``.

Nothing is prefilled twice, and the keys and values the target decodes with are a plain full-cache prefill's.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from lcx.cache import lowbit_slots, schema
from lcx.cache.base import CacheCapacityError
from lcx.cache.config import CacheConfig
from lcx.cache.kv_cache import SlotCacheKind
from lcx.config_base import ConfigError
from lcx.engine.planning import check_positions, plan_capacity
from lcx.engine.runner import build
from lcx.engine.sampling import RowSampling, SamplingConfig, row_sampling, sample_rows
from lcx.engine.spec_loop import SpecState, spec_program
from lcx.engine.speculative import SpeculativeConfig
from lcx.engine.state import GenerateResult, is_int, pad_prompts
from lcx.model.config import ModelConfig
from lcx.model.rope import apply_rope, rope_tables


@dataclasses.dataclass(frozen=True)
class SpeculativeStats:
    """``drafted`` / ``accepted``: draft tokens verified / accepted per row; ``verifications`` per row;
    ``draft_bytes``: the draft cache's KV bytes on the device (beside ``GenerateResult.cache_bytes``, the target's)."""

    drafted: np.ndarray
    accepted: np.ndarray
    verifications: np.ndarray
    draft_bytes: int

    @property
    def acceptance(self) -> float:
        """Mean tokens emitted per verification: accepted drafts + the target's own token."""
        v = int(self.verifications.sum())
        return (int(self.accepted.sum()) + v) / v if v else float("nan")

    @property
    def accept_rate(self) -> float:
        """Share of draft tokens accepted."""
        n = int(self.drafted.sum())
        return int(self.accepted.sum()) / n if n else float("nan")


class SpeculativeGenerator:
    """Generation with a compressed-KV draft (``SpeculativeConfig``) verified against ``cache`` (the target: the
    full cache by default). One device; a model whose layers are all global (a slot cache)."""

    def __init__(self, config: ModelConfig, params, *, max_new_tokens: int, speculative: SpeculativeConfig,
                 cache: CacheConfig | None = None, sampling: SamplingConfig | None = None,
                 eos_id: int | None = None, seed: int = 0, pad_id: int | None = None, strict: bool = False,
                 unroll: bool | None = None, reconstruction=None):
        if not isinstance(speculative, SpeculativeConfig):
            raise ConfigError(f"speculative={speculative!r:.80} is invalid: must be a lcx.SpeculativeConfig(draft="
                              "CacheConfig(...), k=K)")
        if not is_int(max_new_tokens) or max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens={max_new_tokens!r} is invalid: must be a positive integer")
        self.spec = speculative
        self.target = build(config, params, cache=cache, eos_id=eos_id, pad_id=pad_id, unroll=unroll)
        t = self.target
        if not isinstance(t.kind, SlotCacheKind) or t.policy.evicts or not t.kind.truncatable:
            raise ConfigError(
                f"speculative decoding verifies against cache=CacheConfig(policy={t.cache.policy!r}, kv_dtype="
                f"{t.cache.kv_dtype!r}, layout={t.cache.layout!r}) ({t.kind.name!r} cache): the target must keep every "
                "token in a contiguous slot cache of a model whose layers are all global, in a per-token format "
                "(kv_dtype null, int8, fp8 or fp4), so that rejected drafts can be forgotten")
        # the prefill: under the draft policy where it observes the prompt (its statistics), else the target's
        self.draft_kind = draft_kind = draft_kind_of(config, speculative, t.kind)
        self.observes_prefill = draft_kind.policy.evicts and draft_kind.policy.observes.prefill
        float_draft = dataclasses.replace(draft_kind, storage=t.kind.storage)
        self.prefill_runner = t if not self.observes_prefill else build(
            config, params, cache=speculative.draft, eos_id=eos_id,
            pad_id=pad_id, unroll=unroll, reconstruction=reconstruction, kind=float_draft,
            policy=float_draft.policy)
        self.config, self.max_new_tokens, self.eos_id, self.seed = config, max_new_tokens, eos_id, seed
        self.strict, self.cache_config = strict, t.cache
        self.sampling = sampling or SamplingConfig()
        self.loop = spec_program(config, eos_id, t.pad_id, t.kind, draft_kind, speculative.k, t.unrolled,
                                 speculative.confidence)

    # ------------------------------------------------------------------------------------------------ generate
    def generate(self, prompt_ids, *, sampling: Sequence[SamplingConfig] | None = None,
                 seeds: Sequence[int] | None = None, progress: bool = False) -> tuple[GenerateResult,
                                                                                   SpeculativeStats]:
        """Prefill, derive the draft, decode to ``max_new_tokens`` (or EOS): ``(result, stats)``."""
        state = self.prefill(prompt_ids, sampling=sampling, seeds=seeds, progress=progress)
        state = self.decode(state)
        return self.result(state)

    def pays(self, prompt_ids) -> bool:
        """Whether these prompts should decode speculatively (``SpeculativeConfig.min_context``); the callers of
        ``generate`` (``lcx.generate``, ``lm.generate``, ``lcx generate``) decode plainly where not."""
        ids, _ = pad_prompts(prompt_ids, pad_id=0)
        self._check_budget(ids.shape[1])
        return self.spec.pays(ids.shape[1], jax.default_backend())

    def _check_budget(self, max_len: int) -> None:
        budgets = self.draft_kind.head_budgets
        if budgets is not None and min(budgets) >= max_len:
            raise ConfigError(f"speculative.draft.budget={self.spec.draft.budget} holds the whole prompt ({max_len} "
                              "tokens): the draft would read what the target reads; allowed: a budget below the "
                              "prompt length (or no speculative decoding for prompts this short)")

    def prefill(self, prompt_ids, *, sampling=None, seeds=None, progress: bool = False) -> SpecState:
        """The prompts prefilled, the draft derived and each row's first token drawn: the state ``decode`` takes."""
        cache, logits, rows = self.prefill_cache(prompt_ids, sampling=sampling, seeds=seeds, progress=progress)
        return self.start(cache, logits, rows)

    def prefill_cache(self, prompt_ids, *, sampling=None, seeds=None, progress: bool = False):
        """``(cache, last logits [b, V], RowSampling)``: the prompts in one cache that holds them whole (the draft
        policy's kind where it observes the prompt, else the target's). ``start`` derives both caches from it; a
        benchmark may decode it plainly too (``target_view``)."""
        ids, lengths = pad_prompts(prompt_ids, pad_id=0)
        if np.any(ids < 0) or np.any(ids >= self.config.vocab_size):
            bad = int(ids[(ids < 0) | (ids >= self.config.vocab_size)][0])
            raise ConfigError(f"prompt token id {bad} is outside the vocabulary [0, {self.config.vocab_size})")
        batch, max_len = ids.shape
        rows = row_sampling(batch, sampling, seeds, default=self.sampling, seed=self.seed)
        check_positions(self.config, self.cache_config, max_len, self.max_new_tokens, self.strict)
        self._check_budget(max_len)
        # the target holds the prompt, the tokens and one verification's k + 1 past the last
        capacity = plan_capacity(self.config, self.cache_config, batch, max_len, self.max_new_tokens + self.spec.k + 1)
        runner = self.prefill_runner
        cache, logits = runner.chunks(ids, lengths, runner.kind.create(batch, capacity), capacity, progress)
        if runner.reconstruction is not None and getattr(runner.policy, "reconstructs", False):
            cache = runner.reconstruct(cache, ids, lengths, progress)
        return cache, logits, rows

    def target_view(self, cache):
        """The target cache over a ``prefill_cache`` state's own buffers (no copy)."""
        return _target(self.target.kind, cache)

    def start(self, cache, logits, rows: RowSampling, *, draft_capacity: int | None = None, limit: int | None = None,
              stops: bool = True) -> SpecState:
        """The state ``decode`` takes from a ``prefill_cache`` result: the target over its buffers, the draft derived
        from it, each row's first token drawn from ``logits`` (as plain decoding draws it). A server's row sets
        ``draft_capacity`` (every row's), ``limit`` (its ``max_new_tokens``, at most the generator's) and ``stops``
        (False: EOS does not end it)."""
        batch, max_len = logits.shape[0], int(jnp.max(cache.lengths))
        if draft_capacity is None:
            draft_capacity = self.draft_kind.plan(batch, max_len, self.max_new_tokens + self.spec.k + 1)
        limit = self.max_new_tokens if limit is None else limit
        draft = _derive(self.target.kind, self.draft_kind, draft_capacity, cache)
        rows = jax.tree.map(jnp.asarray, rows)
        first = sample_rows(logits, rows, jnp.zeros((batch,), jnp.int32))
        tokens = jnp.full((batch, self.max_new_tokens), self.target.pad_id, jnp.int32).at[:, 0].set(first)
        done = (first == self.eos_id) & stops if self.eos_id is not None else jnp.zeros((batch,), bool)
        zeros = lambda: jnp.zeros((batch,), jnp.int32)  # noqa: E731 - distinct buffers: the loop donates its state
        return SpecState(target=self.target_view(cache), draft=draft, token=first, extra=zeros(),
                         has_extra=jnp.zeros((batch,), bool), tokens=tokens, n_generated=jnp.ones((batch,), jnp.int32),
                         limit=jnp.full((batch,), limit, jnp.int32), stops=jnp.full((batch,), stops),
                         done=done | (limit <= 1), drafted=zeros(), accepted=zeros(),
                         verifications=zeros(), step=jnp.int32(0), sampling=rows)

    def decode(self, state: SpecState, iterations: int | None = None) -> SpecState:
        """Run verifications until every row is done (or ``iterations`` more)."""
        limit = int(state.step) + (self.max_new_tokens if iterations is None else iterations)
        sampled = bool(np.any(np.asarray(state.sampling.temperature) > 0))
        return self.loop(self.target.params, state, jnp.int32(limit), sampled=sampled)

    def result(self, state: SpecState) -> tuple[GenerateResult, SpeculativeStats]:
        stats = SpeculativeStats(drafted=np.asarray(state.drafted), accepted=np.asarray(state.accepted),
                                 verifications=np.asarray(state.verifications), draft_bytes=state.draft.kv_bytes())
        return GenerateResult(tokens=np.asarray(state.tokens), lengths=np.asarray(state.n_generated),
                              cache_bytes=state.target.kv_bytes()), stats


def draft_kind_of(config: ModelConfig, speculative: SpeculativeConfig, target_kind) -> SlotCacheKind:
    """The draft's cache kind, checked against ``target_kind``: a contiguous slot cache in a per-token format of the
    target's dtype, whose prefill (where it observes the prompt) stores keys the target reads."""
    draft_kind = speculative.draft.kind(config)
    if not isinstance(draft_kind, SlotCacheKind):
        raise ConfigError(
            f"speculative.draft=CacheConfig(policy={speculative.draft.policy!r}, kv_dtype="
            f"{speculative.draft.kv_dtype!r}) builds a {draft_kind.name!r} cache: a draft must be a contiguous "
            "slot cache (the full cache or an eviction policy's, in any kv_dtype)")
    if draft_kind.dtype != target_kind.dtype:
        raise ConfigError(f"speculative.draft.dtype={draft_kind.dtype!r} differs from the target's "
                          f"{target_kind.dtype!r}: the draft is derived from the target's keys and values")
    policy = draft_kind.policy
    if policy.evicts and policy.observes.prefill and policy.mode != "original":
        raise ConfigError(f"speculative.draft.policy={speculative.draft.policy!r} observes the prompt and keys its "
                          "slots by rank: its prefill would store keys the full cache cannot read; allowed: "
                          "positions: original")
    return draft_kind


def _target(target_kind: SlotCacheKind, state):
    """The target over a prefilled ``state``'s own buffers (outside jit: a jitted function would return copies)."""
    return target_kind.state_type(kind=target_kind, **{n: getattr(state, n) for n in target_kind.fields()})


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _derive(target_kind: SlotCacheKind, draft_kind: SlotCacheKind, draft_capacity: int, state):
    """The draft from a prefilled ``state`` that holds every prompt token (see the module docstring): its only
    outputs are the draft's buffers (XLA's memory analysis at 4 rows x 4,096 slots of a 16 MiB cache: a SnapKV
    draft's temporaries 5 MiB, an int8 one's - every token encoded - 16 MiB)."""
    work = dataclasses.replace(draft_kind, storage=target_kind.storage)  # the policy, on the target's floats
    sizes = work.sizes(state.batch, state.capacity)
    zeros = schema.empty({n: f for n, f in work.fields().items() if getattr(state, n, None) is None}, sizes,
                         work.kv_dtype)
    held = work.state_type(kind=work, **{n: getattr(state, n) for n in work.fields() if n not in zeros}, **zeros)
    held = work.end_prefill(held)
    cut = {}
    for name, field in work.fields().items():  # survivors are packed at the front: the first slots are the draft
        if "length" in field.axes:
            x = getattr(held, name)
            cut[name] = jax.lax.slice_in_dim(x, 0, draft_capacity, axis=field.axes.index("length"))
    held = held.replace(**cut)
    # a draft that rotates keys by rank at read time stores them unrotated (unless the target already does: rerotate)
    unrotate = work.policy.mode == "cache" and not target_kind.model.rope.rerotate
    if draft_kind.storage == work.storage and not unrotate:
        return held.replace(kind=draft_kind)
    k, v = work.storage.float_kv(held, draft_kind.dtype)  # the target's codes as values (floats: as they are)
    if unrotate:
        cos, sin = rope_tables(work.model, held.pos[:, :, 0].reshape(-1, draft_capacity))
        shape = k.shape  # [L, b, k, C, d]
        keys = jnp.moveaxis(k, 2, 3).reshape(-1, draft_capacity, shape[2], shape[4])
        keys = apply_rope(keys, cos, -sin).reshape(shape[0], shape[1], shape[3], shape[2], shape[4])
        k = jnp.moveaxis(keys, 3, 2)
    if draft_kind.storage.period > 1:  # grouped codes (int4 / int2): whole key groups quantized, the rest a window
        fmt = draft_kind.storage
        stored = {n: f for n, f in draft_kind.fields().items() if n in lowbit_slots.STORED}
        empty = schema.empty(stored, draft_kind.sizes(held.batch, draft_capacity), draft_kind.kv_dtype)
        groups, dtype = empty["k_scale"].shape[-2], empty["k_res"].dtype
        # one layer at a time: the padded float copy requantize makes is one layer's, not the cache's
        codes = jax.lax.map(lambda x: lowbit_slots.requantize(*x, fmt, groups, dtype), (held.count, k, v))
    else:
        codes = draft_kind.storage.encode(k, v)
    rest = {n: getattr(held, n) for n in draft_kind.fields() if n not in codes}
    return draft_kind.state_type(kind=draft_kind, **rest, **codes)


def generate_speculative(config: ModelConfig, params, prompt_ids, *, max_new_tokens: int, sampling: SamplingConfig,
                         eos_id: int | None, cache: CacheConfig | None, seed: int, mesh, strict: bool,
                         speculative: SpeculativeConfig) -> GenerateResult | None:
    """``lcx.generate(..., speculative=...)``: the result with its ``SpeculativeStats`` as ``.speculative``; None
    where speculation does not pay for these prompts (``SpeculativeGenerator.pays``: the caller decodes plainly)."""
    if mesh is not None:
        raise ConfigError("speculative decoding runs on one device: call lcx.generate(..., speculative=...) without "
                          "mesh")
    gen = SpeculativeGenerator(config, params, max_new_tokens=max_new_tokens, speculative=speculative, cache=cache,
                               sampling=sampling, eos_id=eos_id, seed=seed, strict=strict)
    if not gen.pays(prompt_ids):
        return None
    result, stats = gen.generate(prompt_ids)
    return dataclasses.replace(result, speculative=stats)


__all__ = ["SpeculativeGenerator", "SpeculativeStats", "draft_kind_of", "generate_speculative"]
