"""Host-side decisions made before anything runs: the cache type and its capacity (refused with the bytes needed,
never truncated), the prefill chunk, whether to run the unrolled decoder, and the trained-position check."""

from __future__ import annotations

import warnings
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from lcx.cache.base import AUTO_PREFILL_CHUNK, CacheCapacityError, CacheKind, round_chunk
from lcx.cache.config import CacheConfig
from lcx.config_base import ConfigError, dtype_bytes, format_bytes
from lcx.model.config import ModelConfig
from lcx.model.decoder import is_unrolled, unroll_params
from lcx.model.placement import param_bytes_per_device
from lcx.parallel import device_memory, sharding

CHUNK_MEMORY_SHARE = 0.1  # an auto prefill chunk's activations take at most this share of free device memory


def check_positions(config: ModelConfig, cache: CacheConfig, max_prompt: int, max_new_tokens: int,
                    strict: bool = False) -> None:
    """Warn (``strict``: raise) when a full cache would place tokens past ``max_position_embeddings`` with plain RoPE:
    nothing then keeps the positions inside the range the model was trained on, and the output degrades."""
    last = max_prompt + max_new_tokens
    if cache.policy != "full" or config.rope.type != "default" or last <= config.max_position_embeddings:
        return
    msg = (f"positions reach {last} (prompt {max_prompt} + max_new_tokens {max_new_tokens}), past "
           f"model.max_position_embeddings={config.max_position_embeddings}, with rope.type='default' and "
           "cache.policy='full': the model has not seen these positions; set a RoPE scaling (model.rope, e.g. "
           "yarn) or an eviction policy (e.g. cache.policy=streaming) that keeps them in range")
    if strict:
        raise ConfigError(msg)
    warnings.warn(msg, PositionRangeWarning, stacklevel=3)


class PositionRangeWarning(UserWarning):
    """Generation places tokens at positions the model was not trained on."""


# --------------------------------------------------------------------------------------------------- planning
def cache_kind(config: ModelConfig, cache: CacheConfig, mesh=None) -> CacheKind:
    """The cache type of ``cache`` for ``config`` (on a mesh that replicates KV heads: the replicated heads)."""
    model = config if mesh is None else sharding.cache_model_config(config, mesh)
    return cache.kind(model)


def plan_capacity(config: ModelConfig, cache: CacheConfig, batch: int, max_prompt: int, max_new_tokens: int,
                  mesh=None) -> int:
    """Slots per layer and sequence for this generation; raises ``CacheCapacityError`` when it cannot fit.

    The cache type plans its slots (``full``: prompt + new tokens, at most ``cache.budget``; evicting policies: the
    largest layer budget + ``interval``, or less when the whole generation is shorter). Its device bytes are then
    checked against ``cache.max_bytes``, else 90% of device memory less the weights; on a ``mesh`` per device (the
    cache is split over all devices, KV heads replicated where the mesh needs it).
    """
    kind = cache_kind(config, cache, mesh)
    capacity = kind.plan(batch, max_prompt, max_new_tokens)
    need_bytes = kind.nbytes(batch, capacity)
    if mesh is not None:  # batch over data, (replicated) KV heads over model: the same bytes on every device
        need_bytes //= mesh.size
    limit = cache.max_bytes
    source = f"cache.max_bytes={cache.max_bytes}"
    if limit is None and (device_limit := device_memory.device_memory_bytes()) is not None:
        weights = (config.num_params() * dtype_bytes(config.param_dtype) if mesh is None
                   else param_bytes_per_device(config, mesh))  # the planner's placement arithmetic
        limit = device_memory.usable_bytes(device_limit) - weights
        source = f"{device_memory.UTILIZATION:.0%} of {jax.default_backend()} memory less the weights"
    if limit is not None and need_bytes > limit:
        per_token = max(kind.nbytes(batch, 1) // (mesh.size if mesh is not None else 1), 1)
        fit = max(limit // per_token, 0)
        itemsize = np.dtype(jnp.dtype(kind.kv_dtype)).itemsize
        raise CacheCapacityError(
            f"the KV cache needs {format_bytes(need_bytes)} ({capacity} tokens x batch {batch}, 2 x "
            f"{config.n_layers} layers x {config.n_kv_heads} kv heads x {config.head_dim} x {itemsize} B), more "
            f"than {source} = {format_bytes(max(limit, 0))}; at most {fit} tokens fit: " + (
                f"use an eviction budget, e.g. CacheConfig(policy='streaming', budget={fit - cache.interval}, "
                f"sinks=4, interval={cache.interval})" if fit > cache.interval + 8
                else "reduce the batch or the request, or raise the memory limit"))
    return capacity


def auto_prefill_chunk(config: ModelConfig, batch: int, max_len: int) -> int:
    """The prefill chunk of ``cache.prefill_chunk: null``: the whole prompt in one call up to
    ``AUTO_PREFILL_CHUNK`` tokens (halved while one chunk's activations would take more than ``CHUNK_MEMORY_SHARE``
    of the free device memory), else equal chunks; a chunk is rounded up to a quarter of a power of two, so padding
    stays under 25% and one octave of prompt lengths compiles at most four shapes.

    One large chunk costs no more than several small ones (attention visits only the key tiles a query block sees,
    and the output layer runs on the last position only), but saves their calls and the per-chunk copies of the
    cache; a power-of-two chunk would pad a 2,049-token prompt to 4,096."""
    itemsize = dtype_bytes(config.dtype)
    heads = (config.n_heads + config.n_kv_heads) * config.head_dim
    per_token = 2 * itemsize * (4 * config.d_model + 2 * heads + 3 * config.d_ff)  # activations, x2 for temporaries
    cap = AUTO_PREFILL_CHUNK
    free = device_memory.free_bytes()
    while free is not None and cap > 64 and batch * cap * per_token > CHUNK_MEMORY_SHARE * free:
        cap //= 2
    n_chunks = -(-max_len // cap)
    return min(cap, round_chunk(-(-max_len // n_chunks)))


def choose_unroll(config: ModelConfig, params, requested: bool | None) -> bool:
    """Whether generation runs the unrolled decoder (``Decoder(unrolled=True)``, per-layer params and, inside the
    decode loop, per-layer cache buffers): asked for, or ``None`` (auto): yes when ``params`` are already unrolled,
    or when a copy of the layer weights takes at most half the memory free now (the rest is the cache's), unless the
    RoPE re-rotates the cache (``rope.rerotate``); else the scanned decoder, which reads the stacked params without a
    copy but slices (copies) each layer's weights and keys/values every step."""
    if requested is not None:
        return bool(requested)
    if is_unrolled(params):
        return True
    if config.rope.rerotate:  # every step rotates the whole cache: on XLA:CPU the unrolled decoder takes
        return False          # 1.4-1.6x the scanned one's time (docs/benchmarks.md, "Re-rotating dynamic NTK")
    free = device_memory.free_bytes()
    layer_bytes = sum(x.nbytes for x in jax.tree.leaves(params["layers"]))
    return free is None or 2 * layer_bytes <= free


# The unrolled copy of the most recent stacked params, kept while those arrays live: fresh Generators over the same
# weights (an evaluation grid, repeated lcx.generate calls) share it instead of copying the layer weights each time
# (a 1B float32 model: 4-16 s per copy on a 2-core CPU). Keyed by the identity of every leaf, so params that differ in
# any array - even one replaced in place in the dict - never hit; a leaf's death drops the copy.
_UNROLLED: dict = {}


def kept_unrolled(params) -> dict | None:
    leaves = jax.tree.leaves(params)
    if not _UNROLLED or "layers" not in params or len(leaves) != len(_UNROLLED["refs"]):
        return None
    if all(ref() is leaf for ref, leaf in zip(_UNROLLED["refs"], leaves)):
        return _UNROLLED["unrolled"]
    return None


def keep_unrolled(params) -> dict:
    if "layers" not in params:  # already unrolled
        return params
    unrolled = unroll_params(params)
    _UNROLLED.clear()  # one model's copy at a time
    drop = lambda _: _UNROLLED.clear()  # noqa: E731
    _UNROLLED.update(refs=[weakref.ref(leaf, drop) for leaf in jax.tree.leaves(params)], unrolled=unrolled)
    return unrolled


def shared_prefixes(kind, ids: np.ndarray, lengths: np.ndarray) -> list[tuple[int, int, int]] | None:
    """With a paged cache (``kind``), runs of consecutive rows whose prompts start with the same whole pages (a
    system prompt; the questions of one haystack): ``(first row, rows, shared tokens)`` per run, every row in one, each
    row keeping at least one token of its own (whose logits start its generation). None when nothing would be
    shared (a cache whose rows share no pages, or no run of two rows sharing a page) or a row is shorter than a page."""
    if not kind.shares_pages or ids.shape[0] < 2:
        return None
    page = kind.page
    own = (lengths - 1) // page * page  # each row's whole pages before its last token
    if np.any(own == 0):
        return None
    groups, row = [], 0
    while row < ids.shape[0]:
        shared, end = int(own[row]), row + 1
        while end < ids.shape[0]:
            differ = np.flatnonzero(ids[row] != ids[end])
            common = min(int(differ[0]) if differ.size else ids.shape[1], int(own[end]), shared) // page * page
            if common == 0:
                break
            shared, end = common, end + 1
        groups.append((row, end - row, shared))
        row = end
    return groups if len(groups) < ids.shape[0] else None


__all__ = ["CHUNK_MEMORY_SHARE", "PositionRangeWarning", "auto_prefill_chunk", "cache_kind", "check_positions",
           "choose_unroll", "keep_unrolled", "kept_unrolled", "plan_capacity", "shared_prefixes"]
