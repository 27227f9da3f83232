"""Token sampling: greedy, temperature, top-k, top-p - one setting per row, with explicit PRNG keys.

Every row carries its own settings and its own key (``RowSampling``): the key of a row is its *request's* (a seed
the request names, or the generator's seed folded with the request's index among the prompts given), and the token
it samples at its step s uses ``fold_in(request key, s)``. So results are reproducible for a seed, independent of
how the decode loop is segmented (resume), and a request gets the same tokens alone or in any batch, in any row.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from lcx.config_base import ConfigError


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """``temperature == 0`` is greedy; top_k / top_p restrict the candidates before sampling."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self):
        if not _real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ConfigError(f"temperature={self.temperature!r} is invalid: must be a finite number >= 0 (0 = greedy)")
        if self.top_k is not None and (not isinstance(self.top_k, int) or isinstance(self.top_k, bool)
                                       or self.top_k < 1):
            raise ConfigError(f"top_k={self.top_k!r} is invalid: must be a positive integer or None")
        if self.top_p is not None and not (_real(self.top_p) and 0 < self.top_p <= 1):  # NaN fails the comparison
            raise ConfigError(f"top_p={self.top_p!r} is invalid: must be a number in (0, 1] or None")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _real(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


def filter_logits(logits: jax.Array, top_k: int | None, top_p: float | None) -> jax.Array:
    """Set logits outside the top-k / nucleus (top-p) sets to -inf. ``logits [..., V]`` float32."""
    if top_k is not None and top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]  # [..., 1]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p is not None and top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]  # descending
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        # a token is in the nucleus if the mass before it is below top_p: the smallest set reaching top_p
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        cutoff = jnp.min(jnp.where(mass_before < top_p, sorted_logits, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return logits


def greedy(logits: jax.Array) -> jax.Array:
    """``jnp.argmax(logits, axis=-1)`` as int32 - the first maximum, or the first NaN - computed as two plain
    reductions (a max, then the smallest index holding it). XLA:CPU runs argmax as one variadic (value, index)
    reduce that it does not vectorize: 8 x 128256 float32 logits take 2.1 ms that way and 1.1 ms this way, 1 x 32000
    0.14 -> 0.02 ms (2-core VM), a cost paid every decode step."""
    top = jnp.max(logits, axis=-1, keepdims=True)  # NaN if the row has one
    index = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    hit = (logits == top) | jnp.isnan(logits)
    return jnp.min(jnp.where(hit, index, logits.shape[-1] - 1), axis=-1)


@flax.struct.dataclass
class RowSampling:
    """The sampling settings of each row, as arrays (one compiled decode program serves every mix of them)."""

    temperature: jax.Array  # [b] float32; 0 = greedy
    top_k: jax.Array  # [b] int32; 0 = no top-k
    top_p: jax.Array  # [b] float32; 1 = no nucleus
    keys: jax.Array  # [b, 2] uint32: each row's request key (raw key data, checkpointable)

    @classmethod
    def build(cls, settings: Sequence[SamplingConfig], keys: np.ndarray) -> RowSampling:
        """Host arrays for ``settings`` (one per row) and ``keys [b, 2]`` (``request_keys``)."""
        return cls(temperature=np.asarray([s.temperature for s in settings], np.float32),
                   top_k=np.asarray([s.top_k or 0 for s in settings], np.int32),
                   top_p=np.asarray([1.0 if s.top_p is None else s.top_p for s in settings], np.float32),
                   keys=np.asarray(keys, np.uint32))

    @classmethod
    def empty(cls, batch: int) -> RowSampling:
        return cls(temperature=jnp.zeros((batch,), jnp.float32), top_k=jnp.zeros((batch,), jnp.int32),
                   top_p=jnp.ones((batch,), jnp.float32), keys=jnp.zeros((batch, 2), jnp.uint32))


def row_sampling(rows: int, sampling, seeds, *, default: SamplingConfig, seed: int,
                 keys: np.ndarray | None = None) -> RowSampling:
    """Each of ``rows`` prompts' settings (``sampling``: one ``SamplingConfig`` each, None: ``default`` for all) and
    request key (``seeds``: one each; None: ``keys`` when given - a continued state's -, else ``seed`` folded with
    the prompt's index), checked: host arrays."""
    for name, value in (("sampling", sampling), ("seeds", seeds)):
        if value is not None and (isinstance(value, (str, bytes)) or not hasattr(value, "__len__")
                                  or len(value) != rows):
            raise ConfigError(f"prefill {name}={value!r:.80} is invalid: must hold one entry per prompt ({rows})")
    if sampling is not None and not all(isinstance(s, SamplingConfig) for s in sampling):
        raise ConfigError("prefill sampling=... is invalid: each entry must be a lcx.SamplingConfig")
    if seeds is not None and not all(isinstance(s, (int, np.integer)) and not isinstance(s, bool) for s in seeds):
        raise ConfigError(f"prefill seeds={list(seeds)!r:.80} is invalid: each seed must be an integer")
    settings = list(sampling) if sampling is not None else [default] * rows
    if keys is None or seeds is not None:
        keys = request_keys(seed, rows, seeds)
    return RowSampling.build(settings, keys)


def request_key(seed: int, index: int | None = None) -> np.ndarray:
    """The raw key (uint32 ``[2]``) of a request: ``key(seed)``, folded with ``index`` when the request is the
    ``index``-th prompt of a call that gave one seed for all of them (so those prompts sample different tokens)."""
    key = jax.random.key(seed)
    if index is not None:
        key = jax.random.fold_in(key, index)
    return np.asarray(jax.random.key_data(key), np.uint32)


def request_keys(seed: int, rows: int, seeds: Sequence[int] | None = None) -> np.ndarray:
    """``[rows, 2]`` request keys: ``seeds[r]`` when given, else ``seed`` folded with the row's prompt index."""
    if seeds is None:
        return np.stack([request_key(seed, r) for r in range(rows)])
    return np.stack([request_key(int(s)) for s in seeds])


def filter_rows(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """``filter_logits`` with a top-k (``[b]``, 0: none) and a top-p (``[b]``, 1: none) per row of ``logits [b, V]``:
    the same sets - ties with the k-th logit kept, the smallest nucleus reaching top_p of the top-k mass."""
    vocab = logits.shape[-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    ordered = jnp.sort(logits, axis=-1)[..., ::-1]  # descending
    kth = jnp.take_along_axis(ordered, (k - 1)[:, None], axis=-1)
    logits = jnp.where(logits < kth, -jnp.inf, logits)
    ordered = jnp.where(ordered < kth, -jnp.inf, ordered)  # the sorted top-k set (ties kept), -inf after it
    probs = jax.nn.softmax(ordered, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    cutoff = jnp.min(jnp.where(mass_before < top_p[:, None], ordered, jnp.inf), axis=-1, keepdims=True)
    cutoff = jnp.where(top_p[:, None] < 1.0, cutoff, -jnp.inf)  # top_p = 1: no nucleus (rounding cannot cut a tail)
    return jnp.where(logits < cutoff, -jnp.inf, logits)


def sample_rows(logits: jax.Array, rows: RowSampling, steps: jax.Array) -> jax.Array:
    """One token per row from ``logits [b, V]`` -> int32 ``[b]``: row r greedy when its temperature is 0, else drawn
    with ``fold_in(rows.keys[r], steps[r])`` (``steps``: each row's tokens sampled so far, ``[b]`` or a scalar).
    When every row is greedy only the argmax runs."""
    def draw():
        t = rows.temperature[:, None]
        scaled = logits.astype(jnp.float32) / jnp.where(t > 0, t, 1.0)
        # filter_rows sorts each row's vocabulary; with no top-k / top-p in the batch it returns its input, so skip
        # it (the sort and the draw were ~40% of a sampled 8-row decode step of SmolLM2 on a 2-core CPU)
        filters = jnp.any((rows.top_k > 0) | (rows.top_p < 1.0))
        scaled = jax.lax.cond(filters, lambda x: filter_rows(x, rows.top_k, rows.top_p), lambda x: x, scaled)
        keys = jax.vmap(jax.random.fold_in)(rows.keys, jnp.broadcast_to(steps, rows.temperature.shape))
        drawn = jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)
        return jnp.where(rows.temperature > 0, drawn, greedy(logits))

    return jax.lax.cond(jnp.any(rows.temperature > 0), draw, lambda: greedy(logits))
