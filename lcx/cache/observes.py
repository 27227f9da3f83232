"""What an eviction policy observes, declared once (``Observes``), and how the slot cache computes it.

A policy says what it needs besides positions (``EvictionPolicy.observes``); the cache derives the rest from that
value, so a new policy is one file:

- ``attention``: the per-slot attention mass, ``"sum"`` (accumulated over the counted queries: H2O, SnapKV) or
  ``"replace"`` (the last counted query's: TOVA); ``window``: only the last ``window`` prompt queries count
  (SnapKV's observation window; 1: the last query, TOVA), None: every prompt query. Decode steps always count.
- ``moments``: the running moments of the queries per query head (1: count and mean, 2: and the centered second
  moment; Expected Attention), counting queries at positions ``>= moments_from`` (sinks are outliers). The cache
  then holds :data:`QUERY_FIELDS` and the policy's ``SlotView`` carries them.
- ``kv``: the scores read the cached keys or values (K-norm, KeyDiff): a simulation without a model cannot run them.
- ``reconstructs``: scored after prefill by reconstruction passes (KVzip, ``lcx.cache.reconstruct``).
- ``calibrates``: measured on the model before use (DuoAttention's head split, ``lcx.cache.duo``).

From it derive: the statistics buffers (``fields``), which prompt and teacher-forcing queries feed the attention
statistic (``prefill_weights``, ``score_weights``), its update (``merge_attention``), the query moments' update
(``observe_queries``), and what a cache kind must be able to do to run the policy (``CacheKind.check_runs``).

Shapes: b batch, t new tokens, h query heads, H keep heads, C slots, d / e head dim.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from lcx.cache.schema import Field
from lcx.config_base import ConfigError

ATTENTION_STATS = ("sum", "replace")

# The running moments of the queries, per layer and query head (``Observes.moments``: 1 the first two, 2 all three).
# Queries are scaled by the layer's logit scale and unrotated; ``q_m2`` is the sum of outer products of their
# deviations from the mean (merged per call: Chan et al.).
QUERY_FIELDS: Mapping[str, Field] = {
    "q_count": Field(("layers", "batch"), "float32", 0.0),
    "q_mean": Field(("layers", "batch", "heads", "head_dim"), "float32", 0.0),
    "q_m2": Field(("layers", "batch", "heads", "head_dim", "head_dim"), "float32", 0.0),
}


@dataclasses.dataclass(frozen=True)
class Observes:
    """What a policy observes while the cache runs (see the module docstring). The default observes nothing: the
    policy scores positions and its own per-slot statistic only (window, StreamingLLM, the ladder, random)."""

    attention: str | None = None
    window: int | None = None
    moments: int = 0
    moments_from: int = 0
    kv: bool = False
    reconstructs: bool = False
    calibrates: bool = False

    def __post_init__(self):
        if self.attention is not None and self.attention not in ATTENTION_STATS:
            raise ConfigError(f"Observes.attention={self.attention!r} is invalid: must be None or one of "
                              f"{list(ATTENTION_STATS)}")
        if self.window is not None and (self.attention is None or self.window < 1):
            raise ConfigError(f"Observes.window={self.window!r} is invalid with attention={self.attention!r}: it "
                              "counts the last `window` >= 1 prompt queries of an attention statistic")
        if self.moments not in (0, 1, 2):
            raise ConfigError(f"Observes.moments={self.moments!r} is invalid: must be 0 (none), 1 (mean) or 2 "
                              "(mean and covariance)")
        if self.moments_from < 0:
            raise ConfigError(f"Observes.moments_from={self.moments_from} is invalid: must be >= 0")

    # ------------------------------------------------------------------------------------------- what it needs
    @property
    def prefill(self) -> bool:
        """Whether the prompt's own attention is observed - a prefill that only writes keys and values (one attended
        across a mesh's ``seq`` axis, ``write_prompt``) would lose it."""
        return self.attention is not None or self.moments > 0 or self.reconstructs

    @property
    def model_free(self) -> bool:
        """Whether positions alone decide (``lcx.cache.simulate`` runs such policies without a model)."""
        return not (self.prefill or self.kv)

    def describe(self) -> str:
        """What is observed, in words (for error messages)."""
        parts = ([f"attention statistics ({self.attention!r})"] if self.attention else []) + (
            ["the query moments"] if self.moments else []) + (["reconstruction passes"] if self.reconstructs else [])
        return ", ".join(parts) or "nothing"

    @property
    def prefill_queries(self) -> str:
        """The old name of which prompt queries count - ``"all"``, ``"last"`` (window 1) or ``"window"``."""
        return "all" if self.window is None else "last" if self.window == 1 else "window"

    # ------------------------------------------------------------------------------------------- derived buffers
    def fields(self) -> Mapping[str, Field]:
        """The statistics buffers the cache keeps besides its per-slot ``score``: the query moments asked for."""
        return {n: QUERY_FIELDS[n] for n in ("q_count", "q_mean", "q_m2")[:self.moments + 1]} if self.moments else {}

    # ------------------------------------------------------------------------------------------- which queries
    def prefill_weights(self, lengths: np.ndarray, width: int) -> np.ndarray | None:
        """Which prompt queries ``[b, width]`` feed the attention statistic (float32; None: no statistic)."""
        if self.attention is None:
            return None
        index = np.arange(width)[None, :]
        last = np.asarray(lengths)[:, None] - 1
        chosen = index <= last
        if self.window is not None:
            chosen &= index > last - self.window
        return chosen.astype(np.float32)

    def score_weights(self, n: int, width: int, batch: int) -> np.ndarray | None:
        """Which of a teacher-forcing chunk's ``n`` real queries feed the statistic so that it ends as after ``n``
        decode steps: all of them for a sum, the last for a replaced one (None: no statistic)."""
        if self.attention is None:
            return None
        index = np.arange(width)
        chosen = index == n - 1 if self.attention == "replace" else index < n
        return np.broadcast_to(chosen.astype(np.float32), (batch, width)).copy()

    def counts_query(self, positions: jax.Array, ok: jax.Array) -> jax.Array:
        """Which new queries ``[b, t]`` (at ``positions``, real where ``ok``) enter the query moments."""
        return ok & (positions >= self.moments_from) if self.moments_from else ok

    # ------------------------------------------------------------------------------------------- the updates
    def merge_attention(self, score: jax.Array, stats: jax.Array, stat_weights: jax.Array,
                        valid: jax.Array) -> jax.Array:
        """The per-slot score ``[b, H, C]`` after a call whose counted queries gave ``stats [b, H, C]``: added
        (``sum``), or in rows with a counted query replaced (``replace``); empty slots 0."""
        if self.attention == "sum":
            new = score + stats
        else:
            new = jnp.where(jnp.any(stat_weights > 0, axis=1)[:, None, None], stats, score)
        return jnp.where(valid, new, 0.0)


def observe_queries(layer, q: jax.Array, counted: jax.Array, scale: float, moments: int):
    """Merge the ``counted [b, t]`` queries ``q [b, t, h, d]`` (unrotated), scaled by ``scale``, into the layer's
    running moments (``QUERY_FIELDS``): the count, the mean and, with ``moments`` 2, the centered second moment -
    each call's own moments merged with the running ones (Chan et al.'s pairwise update: no cancellation of large
    raw sums)."""
    w = counted.astype(jnp.float32)
    x = q.astype(jnp.float32) * scale
    n_new = jnp.sum(w, axis=1)  # [b]
    mean_new = jnp.einsum("bt,bthd->bhd", w, x) / jnp.maximum(n_new, 1.0)[:, None, None]
    n_old = layer.q_count
    n = n_old + n_new
    delta = mean_new - layer.q_mean  # [b, h, d]
    updates = dict(q_count=n, q_mean=layer.q_mean + delta * (n_new / jnp.maximum(n, 1.0))[:, None, None])
    if moments > 1:
        dev = x - mean_new[:, None]
        between = jnp.einsum("bhd,bhe->bhde", delta, delta) * (n_old * n_new / jnp.maximum(n, 1.0))[:, None, None, None]
        updates["q_m2"] = layer.q_m2 + jnp.einsum("bt,bthd,bthe->bhde", w, dev, dev) + between
    return layer.replace(**updates)


__all__ = ["ATTENTION_STATS", "Observes", "QUERY_FIELDS", "observe_queries"]
