"""The policy plug point: ``CachePolicy`` (what ``cache.policy`` names), the ``EvictionPolicy`` ABC, their
registry, and the shared compaction.

``cache.policy`` names a registered ``CachePolicy``; its ``cache_type`` says which cache type implements it (the
slot cache ``"slots"`` for eviction policies, ``"memory"`` for the tiered working/long-term memory, or a type a
plugin registers, see ``lcx.cache.base``).

An eviction policy is a frozen dataclass (its fields are the policy's parameters, set from ``CacheConfig``)
registered by name. It is pure and jit-compatible: given one layer's slots (positions, live mask, keys, values, the
per-slot statistic), the layer index and its budget, it scores the slots (``scores``) or picks the survivors directly
(``select``); ``compact`` - shared by every policy - keeps the survivors and packs them, in position order, to the
front of the fixed capacity.

Keep sets per layer or per KV head (``heads``): ``shared`` - every KV head of a layer keeps the same positions, the
score summed over all query heads of the layer (structured policies: window, StreamingLLM, the ladder; TOVA, whose
paper averages over heads); ``per_head`` - each KV head keeps its own positions, scored by the query heads of its
group (SnapKV, H2O, K-norm, observed attention: the papers and kvpress select per head). A policy sees one (layer,
keep head) at a time. Score-based policies may also spread a layer's budget unevenly over its KV heads
(``head_budget: adaptive``, AdaKV), or the whole cache's over every layer and head (``global``): :func:`adaptive_keep`.

When it runs (``lcx.generate``): after prefill (the prompt was attended in full, then compressed), between prefill
chunks if the prompt exceeds the capacity, and during decode whenever a layer's cache would overflow
``budget + interval`` slots - i.e. every ``interval`` steps, which amortizes the gather. Between chunks and during
decode it runs per row: a row is compacted when its own cache would overflow, the others are left as they are.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from typing import Any, ClassVar

import flax.struct
import jax
import jax.numpy as jnp

from lcx.cache.observes import Observes
from lcx.config_base import ConfigError, from_dict, name_registry
from lcx.kernels.quant import dequantize
from lcx.model.rope import apply_rope, rope_tables

_REGISTRY: dict[str, type["CachePolicy"]] = {}
POSITION_MODES = ("original", "cache")
HEAD_MODES = ("shared", "per_head")
HEAD_BUDGETS = ("uniform", "adaptive", "global")


def _mapped(layers: int | None = 0, keep_heads: int | None = 1, **kwargs):
    """A ``SlotView`` array and its axes under the eviction's vmaps (``SlotView.vmap_axes``): over layers (of the
    stacked view) and over keep heads (of one layer's view; None: the array is per row, shared by the keep heads)."""
    return flax.struct.field(metadata={"vmap": {"layers": layers, "keep_heads": keep_heads}}, **kwargs)


@flax.struct.dataclass
class SlotView:
    """What a policy sees of one layer of one batch: slots ``[b, C]``, packed at the front in position order.

    ``lcx.cache.schedule`` maps the policy over layers and keep heads; each array declares its axes there
    (``_mapped``), so a new array is declared once, here."""

    layer: jax.Array = _mapped(keep_heads=None)  # int32 scalar: layer index (traced under the layer vmap)
    pos: jax.Array = _mapped()  # [b, C] original token positions, -1 in empty slots
    valid: jax.Array = _mapped()  # [b, C] live slots
    count: jax.Array = _mapped()  # [b] live slots
    k: jax.Array = _mapped()  # [b, C, j, d] the j KV heads that share these slots (zero heads in simulations); 8-bit
    v: jax.Array = _mapped()  # [b, C, j, d]                        codes in a quantized cache: read keys() / values()
    score: jax.Array = _mapped()  # [b, C] the per-slot statistic (attention mass for attention-based policies)
    head: jax.Array | int = _mapped(None, 0, default=0)  # int32 scalar: the keep head (0: the layer's heads share one)
    lengths: jax.Array | None = _mapped(None, None, default=None)  # [b] tokens consumed (None: newest position + 1)
    k_scale: jax.Array | None = _mapped(default=None)  # [b, C, j] the scales of an 8-bit cache (cache.kv_dtype)
    v_scale: jax.Array | None = _mapped(default=None)
    # The running moments of the (scaled, unrotated) queries of the query heads that read these slots, when the
    # policy observes them (``Observes.moments``; None otherwise): count [b], mean [b, g, d], centered second moment
    # [b, g, d, d] (the sum of outer products of deviations; covariance = m2 / count).
    q_count: jax.Array | None = _mapped(keep_heads=None, default=None)
    q_mean: jax.Array | None = _mapped(default=None)
    q_m2: jax.Array | None = _mapped(default=None)
    n_layers: int = flax.struct.field(pytree_node=False, default=1)
    model: Any = flax.struct.field(pytree_node=False, default=None)  # the ModelConfig (RoPE of future queries)

    def vmap_axes(self, over: str) -> "SlotView":
        """This view's ``in_axes`` for a vmap ``over`` ``"layers"`` or ``"keep_heads"`` (static fields kept)."""
        return self.replace(**{f.name: f.metadata["vmap"][over] for f in dataclasses.fields(self)
                               if "vmap" in f.metadata})

    def keys(self) -> jax.Array:
        """``[b, C, j, d]`` float32 keys (dequantized in an 8-bit cache)."""
        return dequantize(self.k, self.k_scale)

    def values(self) -> jax.Array:
        """``[b, C, j, d]`` float32 values (dequantized in an 8-bit cache)."""
        return dequantize(self.v, self.v_scale)

    def consumed(self) -> jax.Array:
        """``[b]`` tokens consumed per row: ``lengths``, or the newest cached position + 1 when not given."""
        if self.lengths is not None:
            return self.lengths
        return jnp.max(jnp.where(self.valid, self.pos, -1), axis=-1) + 1


@dataclasses.dataclass(frozen=True)
class CachePolicy(abc.ABC):
    """What ``cache.policy`` names: a frozen dataclass of the policy's parameters, registered with ``@register``.

    Class attributes: ``name`` (the registry key), ``cache_type`` (the registered cache type that implements it,
    see ``lcx.cache.base``), ``evicts`` (whether the device holds a bounded part of the context; ``full`` keeps
    everything), ``needs_budget`` (whether ``cache.budget`` is required), ``observes`` (what it observes,
    ``lcx.cache.observes.Observes``: the cache derives its statistics, the policy's view and what it refuses).
    """

    name: ClassVar[str] = ""
    cache_type: ClassVar[str] = "slots"
    evicts: ClassVar[bool] = True
    needs_budget: ClassVar[bool] = True  # an evicting policy without cache.budget is refused at load
    # What the policy observes while the cache runs (``lcx.cache.observes``); a declaration that depends on the
    # policy's parameters is a property returning one.
    observes: ClassVar[Observes] = Observes()

    def check(self, n_layers: int, budgets: tuple[int, ...]) -> None:
        """Raise ``ConfigError`` for settings that cannot work with this model (called before anything runs)."""

    def at_compression(self, compression: float, length: int) -> dict[str, Any]:
        """The cache settings that evict the share ``compression`` of a ``length``-token context (an ablation's
        ``compressions``). Default: none - the budget keeps ``(1 - compression) x length`` tokens; a policy whose
        compression is set otherwise returns its parameters (and ``budget``)."""
        return {}


@dataclasses.dataclass(frozen=True)
class EvictionPolicy(CachePolicy):
    """Base class of eviction policies. Subclasses are frozen dataclasses registered with ``@register``.

    Class attributes:

    - ``position_mode``: "original" - keys are rotated at their true positions (H2O, SnapKV, TOVA); "cache" - keys
      are stored unrotated and rotated by slot rank at attention time (StreamingLLM, LaCache), which lets decoding
      continue far past the trained context. The ``positions`` field overrides it per config.
    - ``observes`` (``Observes``): what the policy needs besides positions - attention statistics and the prompt
      queries that count (``attention``, ``window``), running query moments (``moments``, ``moments_from``),
      the cached keys or values (``kv``), reconstruction passes (``reconstructs``: KVzip, ``lcx.cache.reconstruct``)
      or a measurement on the model (``calibrates``: DuoAttention, ``calibrate``). The cache allocates and updates
      what it declares, the policy's ``SlotView`` carries it, and a cache kind that cannot provide it refuses the
      policy (``CacheKind.check_runs``).

    The old flags (``attention_stat``, ``prefill_queries``, ``query_moments``, ``counts_query``, ``reconstructs``,
    ``calibrates``) are read-only views of ``observes``; a subclass that sets one is refused at class creation.
    """

    position_mode: ClassVar[str] = "original"

    head_mode: ClassVar[str] = "shared"  # default of ``heads``

    positions: str | None = None  # override of position_mode
    heads: str | None = None  # override of head_mode: "shared" or "per_head"

    @property
    def mode(self) -> str:
        return self.positions or self.position_mode

    @property
    def per_head(self) -> bool:
        """Whether each KV head keeps its own set of positions."""
        return (self.heads or self.head_mode) == "per_head"

    @property
    def adaptive(self) -> bool:
        """Whether a layer's budget is spread over its KV heads by score (``ScoredPolicy.head_budget``)."""
        return False

    @property
    def cross_layer(self) -> bool:
        """Whether the budgets of all layers are pooled and spread over every (layer, head) by score."""
        return False

    def head_capacity(self, budget: int, kv_heads: int) -> int:
        """The most slots one keep head holds after an eviction with layer budget ``budget`` (per head)."""
        return budget

    # The old flags, read-only views of ``observes`` (other modules and plugins read them by these names).
    _DERIVED: ClassVar[tuple[str, ...]] = ("attention_stat", "prefill_queries", "query_moments", "counts_query",
                                           "reconstructs", "calibrates")

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        flags = [n for n in cls._DERIVED if n in vars(cls)]
        if flags:  # a flag set beside ``observes`` would disagree with it where the cache reads the declaration
            raise TypeError(f"{cls.__name__} sets {flags}: declare what it observes instead, e.g. observes = "
                            "Observes(attention='sum', window=32, moments=2, reconstructs=True) (lcx.cache.observes)")

    @property
    def attention_stat(self) -> str | None:
        """``observes.attention``: how the per-slot score follows attention ("sum", "replace"; None: it does not)."""
        return self.observes.attention

    @property
    def prefill_queries(self) -> str:
        """Which prompt queries feed the score - "all", "last" or "window" (``observes.window``)."""
        return self.observes.prefill_queries

    @property
    def query_moments(self) -> int:
        """``observes.moments``: 0 none, 1 the mean, 2 mean and covariance of the queries."""
        return self.observes.moments

    def counts_query(self, positions: jax.Array, ok: jax.Array) -> jax.Array:
        """Which new queries ``[b, t]`` (at ``positions``, real where ``ok``) enter the query moments."""
        return self.observes.counts_query(positions, ok)

    @property
    def reconstructs(self) -> bool:
        """``observes.reconstructs``: scored after prefill by reconstruction passes (KVzip)."""
        return self.observes.reconstructs

    @property
    def calibrates(self) -> bool:
        """``observes.calibrates``: measured on the model before use (``calibrated``, ``calibrate``)."""
        return self.observes.calibrates

    @property
    def calibrated(self) -> bool:
        """Whether a policy that ``calibrates`` has its measurements (always true for the others)."""
        return True

    def calibrate(self, model, params, ids) -> "EvictionPolicy":
        """This policy measured on ``model`` with ``params`` over the calibration tokens ``ids`` (DuoAttention's
        head split); the generator calls it when ``calibrates`` and not yet ``calibrated``."""
        return self

    def check_calibration(self, model) -> None:
        """Raise ``ConfigError`` when the measurement does not fit ``model`` (e.g. one score per KV head)."""

    def scores(self, view: SlotView, budget: jax.Array) -> jax.Array:
        """Per-slot keep scores ``[b, C]``: the ``budget`` highest are kept (ties: newer first)."""
        raise NotImplementedError(f"{type(self).__name__} must implement scores() or select()")

    def select(self, view: SlotView, budget: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Survivors ``keep [b, C]`` and the updated per-slot score. Default: the top ``budget`` of ``scores``."""
        return top_budget(self.scores(view, budget), view, budget), view.score

    def __post_init__(self):
        if self.positions is not None and self.positions not in POSITION_MODES:
            raise ConfigError(f"cache.positions={self.positions!r} is invalid: must be one of {list(POSITION_MODES)}")
        if self.heads is not None and self.heads not in HEAD_MODES:
            raise ConfigError(f"cache.heads={self.heads!r} is invalid: must be one of {list(HEAD_MODES)}")


@dataclasses.dataclass(frozen=True)
class ScoredPolicy(EvictionPolicy):
    """An eviction policy that ranks slots by ``scores``, per KV head by default, with head-adaptive budgets.

    ``head_budget``: ``uniform`` - every KV head keeps ``budget`` slots; ``adaptive`` (AdaKV, arXiv 2407.11550) -
    the layer keeps ``budget x kv_heads`` slots in all, the highest scores over all its heads, each head at least
    ``head_floor x budget`` of its own best (AdaKV's safeguard, 0.2 as in kvpress) and at most ``head_cap x budget``
    (the cache has a fixed slot count per head, so the cap sets it: capacity ``head_cap x budget + interval``).
    Composes with per-layer budgets (a list, or ``budget_schedule: pyramid``): each layer's budget is spread over
    its heads. ``global`` pools every layer's budget too: the highest scores over all (layer, head) pairs fill
    ``sum(budgets) x kv_heads`` slots under the same floor and cap (KVzip's default, kvpress ``KVzipPress``
    without ``layerwise``: a layer whose heads score high keeps more than one whose heads score low). Scores of
    different heads (and, for ``global``, layers) must be comparable - true of attention probabilities and key
    norms; ``global`` pays off for scores normalised per query (KVzip's, SnapKV's).
    """

    head_mode: ClassVar[str] = "per_head"

    head_budget: str = "uniform"
    head_floor: float = 0.2
    head_cap: float = 2.0

    def __post_init__(self):
        super().__post_init__()
        if self.head_budget not in HEAD_BUDGETS:
            raise ConfigError(f"cache.head_budget={self.head_budget!r} is invalid: must be one of "
                              f"{list(HEAD_BUDGETS)}")
        if self.head_budget == "adaptive" and not self.per_head:
            raise ConfigError(f"cache.head_budget='adaptive' needs cache.heads='per_head' (got "
                              f"cache.heads={self.heads!r}): a shared keep set has one budget per layer; "
                              "'global' spreads the budgets over layers")
        if not 0.0 <= self.head_floor <= 1.0:
            raise ConfigError(f"cache.head_floor={self.head_floor} is invalid: must be in [0, 1] (a share of the "
                              "budget every head keeps)")
        if self.head_cap < 1.0:
            raise ConfigError(f"cache.head_cap={self.head_cap} is invalid: must be >= 1 (the most a head keeps, in "
                              "multiples of the budget)")

    @property
    def adaptive(self) -> bool:
        return self.head_budget in ("adaptive", "global")

    @property
    def cross_layer(self) -> bool:
        return self.head_budget == "global"

    def head_capacity(self, budget: int, kv_heads: int) -> int:
        if self.cross_layer:  # other layers' budgets can flow to this head: only the cap bounds it
            return math.ceil(budget * self.head_cap)
        if not self.adaptive or kv_heads == 1:
            return budget
        floor = _floor_slots(budget, self.head_floor)
        return min(math.ceil(budget * self.head_cap), budget * kv_heads - (kv_heads - 1) * floor)


def _floor_slots(budget, share: float):
    """Slots every head keeps under an adaptive budget: ``floor(share x budget)``, at least 1 when ``share > 0``
    (kvpress's ``n_safe``). ``budget`` may be traced."""
    if isinstance(budget, int):
        n = int(budget * share)
        return max(1, n) if share > 0 and budget > 0 else n
    n = jnp.floor(budget * share).astype(jnp.int32)
    return jnp.maximum(n, 1) if share > 0 else n


def _rank(scores: jax.Array, valid: jax.Array, pos: jax.Array) -> jax.Array:
    """Each slot's rank along the last axis by score (descending; ties: the newer token first); dead slots last."""
    s = jnp.where(valid, scores.astype(jnp.float32), -jnp.inf)
    order = jnp.lexsort((-pos, -s), axis=-1)  # primary key last: score descending, then newest first
    return jnp.argsort(order, axis=-1)  # inverse permutation: each slot's rank


def adaptive_keep(policy: ScoredPolicy, scores: jax.Array, valid: jax.Array, pos: jax.Array,
                  budget: jax.Array) -> jax.Array:
    """AdaKV's selection for one row: ``scores, valid, pos [H, C]`` -> ``keep [H, C]``; ``budget`` scalar, or
    ``[H]`` (one per head: the rows of ``global``'s ``[L x H, C]`` come from layers with their own budgets).

    Each head's best ``floor`` slots are kept; then the highest scores over all heads fill ``sum(budget)`` slots
    (``budget x H`` for a scalar), no head beyond its best ``cap``. Greedy by score under a per-head floor and cap,
    which is the optimum of the constrained top-k; without a binding cap it is exactly kvpress's ``AdaKVPress``
    (one layer) and ``KVzipPress``'s cross-layer selection (``floor`` 0, every layer's heads as rows).
    """
    budget = jnp.broadcast_to(jnp.asarray(budget, jnp.int32), scores.shape[:1])  # [H]
    rank = _rank(scores, valid, pos)  # [H, C] within each head
    floor = _floor_slots(budget, policy.head_floor)[:, None]
    cap = jnp.floor(budget * policy.head_cap).astype(jnp.int32)[:, None]
    eligible = valid & (rank < cap)
    key = jnp.where(rank < floor, jnp.inf, scores.astype(jnp.float32))
    overall = _rank(key.reshape(-1), eligible.reshape(-1), pos.reshape(-1)).reshape(scores.shape)
    return eligible & (overall < jnp.sum(budget))


def top_budget(scores: jax.Array, view: SlotView, budget: jax.Array) -> jax.Array:
    """Mask of the ``budget`` highest-scoring live slots per row; ties go to the newer token."""
    return view.valid & (_rank(scores, view.valid, view.pos) < budget)


# ------------------------------------------------------------------------------------------- for policy authors
PROTECT = 1e30  # score of slots a policy always keeps (sinks, recent window); finite so ties still sort by age


def newest(view: SlotView, n: int | jax.Array) -> jax.Array:
    """Mask ``[b, C]`` of the ``n`` newest live slots of each row (slots are packed in position order)."""
    rank = jnp.broadcast_to(jnp.arange(view.pos.shape[-1]), view.pos.shape)
    return view.valid & (rank >= view.count[:, None] - n)


def unit(x: jax.Array, eps: float = 1e-12) -> jax.Array:
    """``x`` scaled to unit L2 norm along its last axis (torch's ``F.normalize``: norms floored at ``eps``)."""
    return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), eps)


def need_budget_above(name: str, what: str, amount: int, budgets: tuple[int, ...]) -> None:
    """The ``ConfigError`` of a budget that holds no more than what policy ``name`` always keeps (``what``)."""
    small = [b for b in budgets if b <= amount]
    if small:
        raise ConfigError(f"cache.budget={min(small)} is invalid for cache.policy={name!r}: it must exceed {what}"
                          f"={amount} (the budget would hold nothing else)")


def need_original_positions(policy: EvictionPolicy, why: str) -> None:
    """The ``ConfigError`` of a policy that needs keys at their original positions, set to ``positions: cache``."""
    if policy.mode != "original":
        raise ConfigError(f"cache.positions={policy.positions!r} is invalid for cache.policy={policy.name!r}: {why}; "
                          "allowed: 'original'")


def future_rotation(view: SlotView, horizon: int):
    """A function rotating vectors ``[b, n, d]`` by RoPE averaged over the next ``horizon`` positions of each row
    (RoPE is linear in its cos / sin tables, so the average rotation is RoPE with the averaged tables): where
    queries summarised over the past (their moments) are expected to meet keys at their original positions."""
    if view.model is None:
        raise ValueError("rotating to future positions needs the model in the policy's view (a slot cache's view)")
    future = view.consumed()[:, None] + jnp.arange(horizon)[None, :]  # [b, F]
    cos, sin = rope_tables(view.model, future)
    cos, sin = jnp.mean(cos, axis=1, keepdims=True), jnp.mean(sin, axis=1, keepdims=True)  # [b, 1, r]
    return lambda x: apply_rope(x[:, None], cos, sin)[:, 0]


def compact(view: SlotView, keep: jax.Array, score: jax.Array) -> SlotView:
    """The survivors ``keep [b, C]`` of one layer packed to the front in position order, with their new
    statistic ``score [b, C]``."""
    keep = keep & view.valid
    big = jnp.iinfo(jnp.int32).max
    order = jnp.argsort(jnp.where(keep, view.pos, big), axis=-1, stable=True)  # [b, C] kept first, by position

    def gather(x):
        idx = order.reshape(order.shape + (1,) * (x.ndim - 2))
        return jnp.take_along_axis(x, idx, axis=1)

    valid = gather(keep)
    scales = {n: gather(getattr(view, n)) for n in ("k_scale", "v_scale") if getattr(view, n) is not None}
    return view.replace(pos=jnp.where(valid, gather(view.pos), -1), valid=valid,
                        count=jnp.sum(keep, axis=-1, dtype=jnp.int32), k=gather(view.k), v=gather(view.v),
                        score=jnp.where(valid, gather(score), 0.0), **scales)


def evict(policy: EvictionPolicy, view: SlotView, budget: jax.Array) -> SlotView:
    """Apply ``policy`` to one layer (one keep head): keep its survivors and compact them to the front, in position
    order."""
    keep, score = policy.select(view, budget)
    return compact(view, keep, score)


# Class decorator: make ``cls`` available under ``cls.name`` in ``CacheConfig(policy=...)``.
register = name_registry(_REGISTRY, "cache policy")


def registered() -> list[str]:
    """The registered policy names (the built-ins are registered by ``lcx.cache``, which imports them)."""
    return sorted(_REGISTRY)


def registered_where(test) -> list[str]:
    """The registered policies whose default settings pass ``test`` (a predicate on a policy): what an error names as
    allowed. Policies that cannot be built without parameters are left out."""
    out = []
    for name in registered():
        try:
            policy = _REGISTRY[name]()
        except (ConfigError, TypeError):
            continue
        if test(policy):
            out.append(name)
    return out


def make_policy(name: str, params: dict[str, Any] | None = None) -> CachePolicy:
    """Instantiate policy ``name`` with ``params``; unknown names or parameters raise ``ConfigError``."""
    import difflib

    if name not in _REGISTRY:
        close = difflib.get_close_matches(name, registered(), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"cache.policy={name!r} is not a registered eviction policy{hint} (allowed: {registered()})")
    cls = _REGISTRY[name]
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(params or {}) - fields)
    if unknown:
        raise ConfigError(f"cache.{unknown[0]} is not a parameter of cache.policy={name!r} "
                          f"(its parameters: {sorted(fields)})")
    return from_dict(cls, params or {}, prefix="cache")
