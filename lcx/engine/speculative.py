"""Self-speculative decoding with a compressed-KV draft: ``SpeculativeConfig`` and the acceptance rules.

The same model drafts ``k`` tokens while reading a small cache (an eviction policy's budget, or 8-bit codes of the
whole context), then verifies all of them in one forward pass over the full cache and keeps the longest prefix the
full cache agrees with, plus one token of its own. Greedy rows emit exactly the tokens of plain decoding (up to the
float rounding of a ``k + 1``-query chunk against one-query steps); sampled rows keep the target distribution with
the speculative-sampling rule (Leviathan et al. 2023, Chen et al. 2023): draft token ``x ~ q`` is accepted with
probability ``min(1, p(x) / q(x))``; at the first rejection the row draws from ``norm(max(0, p - q))``, and when all
``k`` are accepted from ``p`` after them.

Decoding at long context reads the KV cache, not the weights: a draft step reads the weights and a few hundred
slots, the verification reads the full cache once for ``k + 1`` tokens. The acceptance rate (tokens accepted per
verification) is an exact measure of how often a compressed cache changes the model's next-token choice.

The compiled loop is ``lcx.engine.spec_loop``; the host side (prefill, the draft derived from it) is
``lcx.engine.spec_generator``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from lcx.cache.config import CacheConfig
from lcx.config_base import ConfigError
from lcx.engine.sampling import RowSampling, filter_rows, greedy

MAX_K = 16  # draft tokens per verification: a verification stays a few-query call (lcx.kernels.few), not a prefill
# ``min_context: auto``: the prompt length from which speculation pays, per platform (None: never). A draft step runs
# the whole model again and the verification runs it for k + 1 tokens; decoding pays that back only where a step is
# bound by reading the KV cache. On a 2-core CPU it is not: a SmolLM2 step's float32 weights (540 MB) take ~28 ms,
# the verification of 5 tokens ~2 steps, and up to 16k, at 1 or 8 rows, the best draft broke even (1.02x) and the
# others lost (docs/benchmarks.md "Self-speculative decoding"). A GPU's decode step is memory-bound at these batches
# (the setting of TriForce and MagicDec); 4096 there follows that argument and is not measured in lcx yet.
AUTO_MIN_CONTEXT = {"cpu": None, "gpu": 4096, "tpu": 4096}


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """``draft``: the cache the draft steps read, derived from the prompt's full cache (an eviction policy with a
    budget - ``streaming``, ``snapkv``, ``tova``, ``h2o``, ``kvzip``, ... - and / or ``kv_dtype`` int8 / fp8 / fp4
    codes); ``k``: draft tokens per verification; ``min_context``: ``generate`` decodes plainly when the longest
    prompt is shorter (an int; 0: always speculate); ``auto``: ``AUTO_MIN_CONTEXT`` of the platform (on a CPU:
    never - drafting costs more than it saves there). ``confidence``: adaptive ``k`` - a row stops drafting once the
    draft gave its last token a probability (temperature 1) below this, and the iteration's drafting ends when every
    row has stopped (at most ``k``); None: always ``k``. Stopping on the draft's own numbers keeps the tokens exact."""

    draft: CacheConfig
    k: int = 4
    min_context: int | str = "auto"
    confidence: float | None = None

    def __post_init__(self):
        if isinstance(self.draft, Mapping):
            object.__setattr__(self, "draft", CacheConfig.from_mapping(self.draft, "speculative.draft"))
        if not isinstance(self.draft, CacheConfig):
            raise ConfigError(f"speculative.draft={self.draft!r:.80} is invalid: must be a lcx.CacheConfig (or a "
                              "mapping of its fields), e.g. CacheConfig(policy='streaming', budget=256, sinks=4)")
        if not isinstance(self.k, int) or isinstance(self.k, bool) or not 1 <= self.k <= MAX_K:
            raise ConfigError(f"speculative.k={self.k!r} is invalid: must be an integer in [1, {MAX_K}] (draft "
                              "tokens per verification)")
        auto = self.min_context == "auto"
        if not auto and (not isinstance(self.min_context, int) or isinstance(self.min_context, bool)
                         or self.min_context < 0):
            raise ConfigError(f"speculative.min_context={self.min_context!r} is invalid: must be 'auto' or an integer "
                              ">= 0 (prompt tokens below which generate decodes plainly; 0: always speculate)")
        c = self.confidence
        if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float)) or not 0 < c < 1):
            raise ConfigError(f"speculative.confidence={c!r} is invalid: must be null (always k drafts) or a "
                              "probability in (0, 1) below which a row stops drafting")
        draft = self.draft
        if draft.layout != "contiguous":
            raise ConfigError(f"speculative.draft.layout={draft.layout!r} is invalid: a draft is a contiguous slot "
                              "cache derived from the prompt's full cache; allowed: 'contiguous'")
        policy = draft.make_policy()
        if not policy.evicts and draft.kv_dtype is None:
            raise ConfigError(f"speculative.draft=CacheConfig(policy={draft.policy!r}) holds as much as its target "
                              "(every token, in the same format): a draft must read less - an eviction policy with a "
                              "budget (e.g. policy='streaming', budget=256) or kv_dtype int8 / fp8 / fp4")
        if policy.observes.calibrates:
            raise ConfigError(f"speculative.draft.policy={draft.policy!r} is measured on the model (a calibration): "
                              "a draft is derived from the prompt's own cache; allowed: a policy that needs no "
                              "calibration")
        if draft.interval < 2:
            raise ConfigError(f"speculative.draft.interval={draft.interval} is invalid: a draft step may append 2 "
                              "tokens (the last verification's last draft and its correction): at least 2")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], prefix: str = "speculative") -> "SpeculativeConfig":
        """From a YAML mapping ``{draft: {policy: ..., budget: ...}, k: 4}``."""
        data = dict(data)
        unknown = sorted(set(data) - {"draft", "k", "min_context", "confidence"})
        if unknown:
            raise ConfigError(f"{prefix}.{unknown[0]} is not a key of {prefix}: allowed draft, k, min_context, "
                              "confidence")
        if "draft" not in data:
            raise ConfigError(f"{prefix}.draft is missing: the draft cache, e.g. {{policy: streaming, budget: 256}}")
        draft = data["draft"]
        if isinstance(draft, Mapping):
            draft = CacheConfig.from_mapping(draft, f"{prefix}.draft")
        return cls(draft=draft, k=data.get("k", 4), min_context=data.get("min_context", "auto"),
                   confidence=data.get("confidence"))

    def to_dict(self) -> dict[str, Any]:
        return {"draft": self.draft.to_dict(), "k": self.k, "min_context": self.min_context,
                "confidence": self.confidence}

    def pays(self, prompt: int, platform: str) -> bool:
        """Whether to speculate for a longest prompt of ``prompt`` tokens on ``platform`` (jax's backend name)."""
        if self.min_context == "auto":
            least = AUTO_MIN_CONTEXT.get(platform)
            return least is not None and prompt >= least
        return prompt >= self.min_context


# --------------------------------------------------------------------------------------------------- acceptance
def row_probs(logits: jax.Array, rows: RowSampling) -> jax.Array:
    """Each row's sampling distribution over ``logits [b, n, V]``: temperature, then its top-k / top-p set
    (``filter_rows``, the sampler's own), softmax. A greedy row's is its temperature-1 softmax (never read)."""
    b, n, vocab = logits.shape
    t = rows.temperature[:, None, None]
    scaled = (logits.astype(jnp.float32) / jnp.where(t > 0, t, 1.0)).reshape(b * n, vocab)
    filters = jnp.any((rows.top_k > 0) | (rows.top_p < 1.0))  # else filter_rows returns its input: skip its sort
    filtered = jax.lax.cond(filters, lambda x: filter_rows(x, jnp.repeat(rows.top_k, n), jnp.repeat(rows.top_p, n)),
                            lambda x: x, scaled)
    return jax.nn.softmax(filtered, axis=-1).reshape(b, n, vocab)


def token_keys(rows: RowSampling, index: jax.Array, purpose: int) -> jax.Array:
    """``[b]`` keys of each row's output token ``index [b]`` for one ``purpose`` (1: the draft's draw, 2: the
    acceptance test, 3: the correction): functions of the row's request key and position only, so a row's tokens
    never depend on its batch-mates or on how far the others accepted."""
    keys = jax.vmap(jax.random.fold_in)(rows.keys, index)
    return jax.vmap(jax.random.fold_in)(keys, jnp.full_like(index, purpose))


def draw(probs: jax.Array, keys: jax.Array) -> jax.Array:
    """One token per row from ``probs [b, V]`` with ``keys [b]``."""
    return jax.vmap(lambda key, p: jax.random.categorical(key, jnp.log(p)))(keys, probs).astype(jnp.int32)


def accept_greedy(target_logits: jax.Array, drafts: jax.Array,
                  n_drafts: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """``(accepted [b], next [b])``: the drafts ``[b, k]`` that equal the target's argmax in a row from the first,
    then the target's argmax after them (the correction, or after all ``k`` the bonus token). ``target_logits``:
    ``[b, k + 1, V]``, position ``j`` the distribution of draft ``j``. ``n_drafts [b]``: each row's real drafts
    (adaptive ``k``; the rest are not read; None: all ``k``)."""
    b, k = drafts.shape
    choice = greedy(target_logits)  # [b, k + 1]
    agree = choice[:, :k] == drafts
    if n_drafts is not None:
        agree &= jnp.arange(k)[None, :] < n_drafts[:, None]
    agree = jnp.cumprod(agree.astype(jnp.int32), axis=1)
    accepted = jnp.sum(agree, axis=1)
    return accepted, jnp.take_along_axis(choice, accepted[:, None], axis=1)[:, 0]


def accept_sampled(p: jax.Array, q: jax.Array, drafts: jax.Array, rows: RowSampling, first: jax.Array,
                   n_drafts: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """The speculative-sampling rule per row: ``p [b, k + 1, V]`` the target's distributions, ``q [b, k, V]`` the
    draft's, ``drafts [b, k]`` drawn from ``q``, ``first [b]`` the output index of the first draft. Draft ``j`` is
    accepted when ``u_j q_j(x_j) < p_j(x_j)``; ``(accepted [b], next [b])``, next drawn from ``norm(max(0, p_a -
    q_a))`` after a rejection at ``a`` and from ``p_n`` when all ``n`` drafts are accepted (``n_drafts [b]``: each
    row's real drafts, adaptive ``k``; None: all ``k``)."""
    b, k = drafts.shape
    n_drafts = jnp.full((b,), k, jnp.int32) if n_drafts is None else n_drafts
    pick = lambda d: jnp.take_along_axis(d, drafts[..., None], axis=-1)[..., 0]  # noqa: E731
    u = jnp.stack([jax.vmap(jax.random.uniform)(token_keys(rows, first + j, 2)) for j in range(k)], axis=1)
    ok = (u * pick(q) < pick(p[:, :k])) & (jnp.arange(k)[None, :] < n_drafts[:, None])
    accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
    target = jnp.take_along_axis(p, accepted[:, None, None], axis=1)[:, 0]  # [b, V]
    q_pad = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)
    q_at = jnp.take_along_axis(q_pad, accepted[:, None, None], axis=1)[:, 0]
    q_at = jnp.where((accepted < n_drafts)[:, None], q_at, 0.0)  # every draft accepted: q = 0, the residual is p
    residual = jnp.maximum(target - q_at, 0.0)
    mass = jnp.sum(residual, axis=-1, keepdims=True)
    residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), target)  # p == q: nothing to fix
    return accepted, draw(residual, token_keys(rows, first + accepted, 3))


__all__ = ["AUTO_MIN_CONTEXT", "MAX_K", "SpeculativeConfig", "accept_greedy", "accept_sampled", "draw", "row_probs",
           "token_keys"]
