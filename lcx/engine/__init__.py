"""The engine: what runs a model over a KV cache. Floors, bottom up:

- ``sampling``: per-row sampling settings and request keys (``RowSampling``) and the sampler;
- ``state``: ``DecodeState`` (what a generation carries between compiled calls), ``GenerateResult``, prompt checks;
- ``planning``: host decisions before anything runs (cache type and capacity, prefill chunk, unrolling);
- ``programs``: the compiled functions of one configuration (``Programs``), shared by generator and server;
- ``generator``: ``Generator`` (prefill, decode, score, fork, save / restore) and ``generate``;
- ``server``: continuous batching over a paged cache (``Server``).
"""

from lcx.cache.base import CacheCapacityError
from lcx.engine.generator import SCORE_SEGMENT, Generator, generate
from lcx.engine.planning import (PositionRangeWarning, auto_prefill_chunk, cache_kind, check_positions,
                                 choose_unroll, plan_capacity)
from lcx.engine.programs import MAX_MAPPINGS, Programs, programs, release_compiled
from lcx.engine.sampling import RowSampling, SamplingConfig
from lcx.engine.state import DecodeState, GenerateResult, pad_prompts

__all__ = ["CacheCapacityError", "DecodeState", "GenerateResult", "Generator", "MAX_MAPPINGS", "PositionRangeWarning",
           "Programs", "RowSampling", "SCORE_SEGMENT", "SamplingConfig", "auto_prefill_chunk", "cache_kind",
           "check_positions", "choose_unroll", "generate", "pad_prompts", "plan_capacity", "programs",
           "release_compiled"]
