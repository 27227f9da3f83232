"""``CacheConfig``: the ``cache:`` section - which policy (and so which cache type), its budget and memory limits.

``CacheConfig(policy="full", budget=None, dtype=None, prefill_chunk=None, interval=64, max_bytes=None,
**policy_params)``: ``policy`` names a registered policy (``lcx.cache.policy``), whose parameters (``sinks``,
``span``, ``window``, ...) are validated by the policy itself; ``CacheConfig.kind(model)`` builds the cache type
that implements it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from lcx.cache.base import CacheKind, kind_class
from lcx.cache.policy import CachePolicy, make_policy
from lcx.config_base import ConfigError, canonical_dtype, check, coerce, positive_int
from lcx.cache.storage import FORMATS, KVStorage, check_name, storage_of

# The cache types that serve the global layers of a model with sliding-window layers (lcx.cache.hybrid); any other
# type is built as it is and must handle every layer's spec itself.
HYBRID_GLOBAL = ("slots", "memory")
LAYOUTS = ("contiguous", "paged")  # cache.layout: one run of slots per sequence, or pages (lcx.cache.paged)

if TYPE_CHECKING:
    from lcx.model.config import ModelConfig


@dataclasses.dataclass(frozen=True, init=False)
class CacheConfig:
    """The KV cache of generation: eviction policy, budget and memory.

    ``CacheConfig(policy="full", budget=None, dtype=None, prefill_chunk=None, interval=64, max_bytes=None,
    layout="contiguous", page_size=16, **policy_params)``. ``budget`` is the number of tokens per sequence and layer
    the cache keeps (with ``full``: the most it may hold; ``budget_schedule: pyramid`` spreads it over the layers,
    ``pyramid_beta`` setting the slope, ``lcx.cache.schedule``); ``prefill_chunk`` the most prompt tokens per compiled
    prefill call (None: chosen from the prompt and the memory plan, see ``lcx.engine.auto_prefill_chunk``);
    ``interval`` extra slots let decode compact every ``interval`` steps instead of every step; ``max_bytes`` caps
    the KV memory, checked before anything runs. Policy parameters (``sinks``, ``span``, ...) go to the policy named
    by ``policy`` and are validated by it. ``layout``: ``contiguous`` (each sequence its own slots) or ``paged`` (a
    pool of ``page_size``-token pages; sequences that share a prefix share its pages, ``lcx.cache.paged``).
    ``kv_dtype``: ``int8`` or ``fp8`` stores keys and values as 8-bit codes with one float16 scale per token and KV
    head (``lcx.kernels.quant``; composes with every eviction policy, both layouts, and the memory tier); ``int4`` or
    ``int2`` as bit-packed codes with a float16 scale and zero per group (KIVI: keys per channel over ``kv_group``
    tokens, values per token over ``kv_group`` channels, ``lcx.cache.lowbit_slots``), the ``kv_residual`` most recent
    tokens (and the key group still filling) kept in ``dtype`` - the slot cache with every eviction policy, both
    layouts (paged: ``page_size`` a multiple of ``kv_group``, ``lcx.cache.lowbit_pages``), and the memory tier's
    long-term blocks (its working window stays in ``dtype``); None stores them in ``dtype``.
    """

    policy: str = "full"
    budget: int | tuple[int, ...] | None = None
    budget_schedule: str = "uniform"
    pyramid_beta: float = 2.0
    dtype: str | None = None
    prefill_chunk: int | None = None
    interval: int = 64
    max_bytes: int | None = None
    layout: str = "contiguous"
    page_size: int = 16
    kv_dtype: str | None = None
    kv_group: int = 64
    kv_residual: int = 0
    policy_params: tuple[tuple[str, Any], ...] = ()

    def __init__(self, policy: str = "full", budget: int | Sequence[int] | None = None,
                 budget_schedule: str = "uniform", pyramid_beta: float = 2.0, dtype: str | None = None,
                 prefill_chunk: int | None = None, interval: int = 64, max_bytes: int | None = None,
                 layout: str = "contiguous", page_size: int = 16, kv_dtype: str | None = None, kv_group: int = 64,
                 kv_residual: int = 0, **policy_params):
        if isinstance(budget, Sequence) and not isinstance(budget, str):
            budget = tuple(budget)
        values = dict(policy=policy, budget=budget, budget_schedule=budget_schedule, pyramid_beta=pyramid_beta,
                      dtype=dtype, prefill_chunk=prefill_chunk, interval=interval, max_bytes=max_bytes,
                      layout=layout, page_size=page_size, kv_dtype=kv_dtype, kv_group=kv_group,
                      kv_residual=kv_residual, policy_params=tuple(sorted(policy_params.items())))
        for key, value in values.items():
            object.__setattr__(self, key, value)
        self.__post_init__()

    def __post_init__(self):
        budgets = self.budget if isinstance(self.budget, tuple) else (self.budget,)
        for value in budgets:
            check(value is None or (isinstance(value, int) and not isinstance(value, bool) and value > 0),
                  "cache.budget", self.budget, "must be a positive integer, a list of them (one per layer) or null")
        check(self.max_bytes is None or (isinstance(self.max_bytes, int) and self.max_bytes > 0), "cache.max_bytes",
              self.max_bytes, "must be a positive integer or null")
        check(self.budget_schedule in ("uniform", "pyramid"), "cache.budget_schedule", self.budget_schedule,
              "must be 'uniform' or 'pyramid'")
        check(isinstance(self.pyramid_beta, (int, float)) and not isinstance(self.pyramid_beta, bool)
              and self.pyramid_beta >= 1, "cache.pyramid_beta", self.pyramid_beta,
              "must be a number >= 1 (the deepest layer keeps budget / beta; PyramidKV uses 20)")
        check(isinstance(self.interval, int) and self.interval > 0, "cache.interval", self.interval,
              "must be a positive integer")
        check(self.prefill_chunk is None or (isinstance(self.prefill_chunk, int) and self.prefill_chunk > 0),
              "cache.prefill_chunk", self.prefill_chunk, "must be a positive integer or null (auto)")
        check(self.layout in LAYOUTS, "cache.layout", self.layout, f"must be one of {list(LAYOUTS)}")
        check(isinstance(self.page_size, int) and not isinstance(self.page_size, bool) and self.page_size > 0,
              "cache.page_size", self.page_size, "must be a positive integer (tokens per page)")
        if self.dtype is not None:
            object.__setattr__(self, "dtype", canonical_dtype(self.dtype, "cache.dtype"))
        check_name(self.kv_dtype)  # a registered storage format (lcx.cache.storage.FORMATS), or null
        check(positive_int(self.kv_group) and self.kv_group & (self.kv_group - 1) == 0, "cache.kv_group",
              self.kv_group, "must be a power of two (tokens per key scale, channels per value scale)")
        check(isinstance(self.kv_residual, int) and not isinstance(self.kv_residual, bool) and self.kv_residual >= 0,
              "cache.kv_residual", self.kv_residual, "must be a non-negative integer (recent tokens kept unquantized)")
        storage = self.storage()
        for key, default in (("kv_group", 64), ("kv_residual", 0)):  # the settings of the grouped formats
            if getattr(self, key) != default and key not in storage.settings:
                raise ConfigError(f"cache.{key}={getattr(self, key)} applies to the bit-packed caches only: set "
                                  f"cache.kv_dtype to one of {[d for d, f in FORMATS.items() if key in f.settings]} "
                                  f"(it is {self.kv_dtype!r}), or leave cache.{key} at {default}")
        policy = self.make_policy()  # validates the name and the policy's parameters
        storage.check_config(self, policy, FORMATS)  # what the format needs (group sizes, whole groups per page)
        if not storage.serves(policy.cache_type, self.layout):
            raise ConfigError(f"cache.kv_dtype={self.kv_dtype!r} with cache.policy={self.policy!r} and "
                              f"cache.layout={self.layout!r}: a quantized cache is built for the slot cache (every "
                              "eviction policy and full, layout 'contiguous' or 'paged') and the memory tier "
                              "(layout 'contiguous'); allowed: those, or kv_dtype null")
        if policy.evicts and policy.needs_budget and self.budget is None:
            raise ConfigError(f"cache.budget=None is invalid for cache.policy={self.policy!r}: an evicting policy "
                              "needs a budget (tokens kept per sequence and layer)")

    @property
    def params(self) -> dict[str, Any]:
        return dict(self.policy_params)

    @property
    def max_budget(self) -> int | None:
        if self.budget is None:
            return None
        if isinstance(self.budget, tuple):
            return max(self.budget)
        return int(round(self.budget * (2 - 1 / self.pyramid_beta))) if self.budget_schedule == "pyramid" \
            else self.budget

    def make_policy(self) -> CachePolicy:
        return make_policy(self.policy, self.params)

    def storage(self, dtype: str = "float32") -> KVStorage:
        """The KV storage format of ``kv_dtype`` (``lcx.cache.storage``), its floats in ``dtype``."""
        return storage_of(self, self.dtype or dtype)

    def kind(self, model: ModelConfig) -> CacheKind:
        """The cache type that implements this policy, for ``model`` (the KV heads the cache stores)."""
        policy = self.make_policy()
        name = policy.cache_type
        storage = self.storage(model.dtype)
        if self.layout == "paged":
            # every token: lcx.cache.paged; an evicting policy: the slot cache's eviction over pages (paged_slots)
            # (a storage with per-row buffers, a bit-packed float window: always the slot cache's pages)
            name = "paged_slots" if policy.evicts or not storage.pages_hold_rows else "paged"
        elif name in HYBRID_GLOBAL and any(s.window is not None for s in model.attention_specs()):
            name = "hybrid"  # sliding-window layers keep only their window (lcx.cache.hybrid)
            if not storage.windowed_models:
                raise ConfigError(f"cache.kv_dtype={self.kv_dtype!r}: the bit-packed cache is built for models whose "
                                  "layers are all global; this model has sliding-window layers (a hybrid cache); "
                                  f"allowed here: kv_dtype {[d for d, f in FORMATS.items() if f.windowed_models]} "
                                  "or null")
        rerotates = any(spec.rope.rerotate for spec in model.attention_specs())  # a local_rope's setting too
        if rerotates and (name != "slots" or (policy.evicts and policy.mode == "original")):
            raise ConfigError(
                f"rope.rerotate=True with cache.policy={self.policy!r}, layout={self.layout!r} ({name!r} cache): "
                "re-rotating keys with the current length's base needs them stored before rotation, which only the "
                "contiguous slot cache does, for every token (policy 'full') or for a policy that re-rotates by "
                "rank (positions: cache); allowed: one of those, or rope.rerotate false")
        return kind_class(name).from_config(model, self, policy)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], prefix: str = "cache") -> "CacheConfig":
        """From a flat mapping (a YAML ``cache:`` section): known keys are fields, the rest policy parameters."""
        data = dict(data)
        data.pop("policy_params", None)
        hints = {"dtype": str | None, "prefill_chunk": int | None, "interval": int, "max_bytes": int | None,
                 "policy": str, "budget_schedule": str, "layout": str, "page_size": int, "pyramid_beta": float,
                 "kv_dtype": str | None, "kv_group": int, "kv_residual": int}
        kwargs = {k: coerce(v, hints[k], f"{prefix}.{k}") if k in hints else v for k, v in data.items()}
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "policy_params"}
        if isinstance(out["budget"], tuple):
            out["budget"] = list(out["budget"])
        if self.layout == "contiguous":  # page_size means nothing there; configs written before layouts stay equal
            del out["layout"], out["page_size"]
        if self.pyramid_beta == 2.0:  # the default shape: configs written before it stay equal
            del out["pyramid_beta"]
        if self.kv_dtype is None:
            del out["kv_dtype"]
        for key, default in (("kv_group", 64), ("kv_residual", 0)):  # configs written before them stay equal
            if out[key] == default:
                del out[key]
        out.update(self.params)
        return out


__all__ = ["CacheConfig"]
