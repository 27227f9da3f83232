"""The engine: what runs a model over a KV cache. Floors, bottom up:

- ``sampling``: per-row sampling settings and request keys (``RowSampling``) and the sampler;
- ``state``: ``DecodeState`` (what a generation carries between compiled calls), ``GenerateResult``, prompt checks;
- ``planning``: host decisions before anything runs (cache type and capacity, prefill chunk, unrolling);
- ``programs``: the compiled functions of one configuration (``Programs``), shared by generator and server;
- ``runner``: ``build`` -> ``Runner`` (placed params, cache kind and policy, programs; prompts and decode segments
  over states it is handed), what ``Generator`` and ``Server`` both run on;
- ``generator``: ``Generator`` (prefill, decode, score, fork, save / restore) and ``generate``;
- ``setup``: ``resolve`` -> ``ServeSetup``, a serve configuration checked once;
- ``scheduler`` (``Scheduler``: queue, admission, reservation, cancellation), ``prefix_cache`` (``PrefixCache``: kept
  prompt pages under one chained-hash index, the store) and ``server`` (``Server``, their composition): continuous
  batching over a paged cache.
"""

from lcx.cache.base import CacheCapacityError
from lcx.engine.generator import SCORE_SEGMENT, Generator, generate
from lcx.engine.planning import (PositionRangeWarning, auto_prefill_chunk, cache_kind, check_positions,
                                 choose_unroll, plan_capacity)
from lcx.engine.programs import MAX_MAPPINGS, Programs, programs, release_compiled
from lcx.engine.runner import Runner, build
from lcx.engine.sampling import RowSampling, SamplingConfig
from lcx.engine.state import DecodeState, GenerateResult, pad_prompts

__all__ = ["CacheCapacityError", "DecodeState", "GenerateResult", "Generator", "MAX_MAPPINGS",
           "PositionRangeWarning", "Programs", "RowSampling", "Runner", "SCORE_SEGMENT", "SamplingConfig",
           "auto_prefill_chunk", "build", "cache_kind", "check_positions", "choose_unroll", "generate",
           "pad_prompts", "plan_capacity", "programs", "release_compiled"]
