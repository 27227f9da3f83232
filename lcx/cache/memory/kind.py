"""The tiered cache type (``cache_type = "memory"``): working memory on the device, long-term blocks in a store.

Shape letters: L layers, b batch, W working slots, N long-term block capacity, j tokens per block, K recalled blocks
per KV head, k kv heads, d head dim.

Device state (:class:`MemoryCache`, declared once in ``MemoryKind.fields``): the working memory (``k, v [L, b, W,
k, d]`` packed in position order like the slot cache: the sinks first, then the recent tokens), the routing
summaries of every long-term block (``[L, b, N, k, ...]``, small: a few vectors per block), the number of blocks,
the blocks each layer recalled last (introspection), gate counters and, for ``store: device``, the blocks themselves
with their positions.

Between jitted calls ``sync`` spills: while a row's working memory holds ``spill_tokens`` more than sinks + window,
the oldest run of non-sink tokens leaves - formed into blocks (``blocks.py``), summarized by the router (on the
device), and appended to the store (``store.py``; for ``store: host`` / ``disk`` this is the only time keys and
values travel to the host). The working memory then has room for the next prefill chunk or decode segment, so every
token is always in exactly one tier, and attention over the two tiers is exact when every block is recalled.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from pathlib import Path
from typing import ClassVar

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from lcx.cache.base import CacheKind, CacheState, register_kind
from lcx.cache.memory import attend as memory_attend
from lcx.cache.memory import learned
from lcx.cache.memory.blocks import form_blocks
from lcx.cache.memory.formats import STORE_AXES, FloatBlocks, block_format  # noqa: F401 - STORE_AXES re-exported
from lcx.cache.memory.policy import MemoryPolicy
from lcx.cache.memory.routers import Router, make_router
from lcx.cache.memory.store import BlockStore, get_store, register_store, release_store
from lcx.cache.schema import Field
from lcx.config_base import ConfigError
from lcx.cache.storage import KVStorage, namespace, storage_of
from lcx.model.config import ModelConfig

SLOTS = ("layers", "batch", "length")
MEMORY_ROOM = 512  # tokens one jitted call may append when cache.prefill_chunk is auto: the working memory's slack


@flax.struct.dataclass
class MemoryCache(CacheState):
    """The buffers ``MemoryKind.fields`` declares; the optional ones are None when the configuration has none."""

    k: jax.Array  # [L, b, W, k, d] working keys (rotated in "original" mode)
    v: jax.Array  # [L, b, W, k, d]
    pos: jax.Array  # [L, b, W] int32 original positions; -1 empty
    valid: jax.Array  # [L, b, W] bool
    count: jax.Array  # [L, b] int32 occupied working slots
    n_blocks: jax.Array  # [L, b] int32 long-term blocks written
    recalled: jax.Array  # [L, b, k, K] int32 the blocks the last query recalled (-1: none)
    recalls: jax.Array  # [L, b] int32 steps (or chunks) that recalled
    skips: jax.Array  # [L, b] int32 steps the gate skipped recall
    layer_id: jax.Array  # [L] int32
    store_id: jax.Array  # [L] int32 the host store's id (-1: none)
    recent_q: jax.Array  # [L, b, R, h, d] float32 the last queries routing pools
    recent_n: jax.Array  # [L, b] int32 valid entries of recent_q (the newest, at the end)
    lengths: jax.Array | None  # [b] int32
    block_pos: jax.Array | None = None  # [L, b, N, j, k] int32 positions of each block's tokens (store: device)
    received: jax.Array | None = None  # [L, b, k, W] attention each working token received (InfLLM)
    kmin: jax.Array | None = None  # [L, b, N, k, d] Quest
    kmax: jax.Array | None = None
    gmin: jax.Array | None = None  # [L, b, N / G, k, d] Quest over groups of blocks (route_groups)
    gmax: jax.Array | None = None
    reps: jax.Array | None = None  # [L, b, N, k, R, d] InfLLM
    kstats: jax.Array | None = None  # [L, b, N, k, 3, d] learned
    k_scale: jax.Array | None = None  # [L, b, W, k] float16 scales of 8-bit working keys (cache.kv_dtype)
    v_scale: jax.Array | None = None
    store_k: jax.Array | None = None  # [L, b, N, j, k, d] store: device
    store_v: jax.Array | None = None
    store_scale_k: jax.Array | None = None  # [L, b, N, k] int8 storage
    store_scale_v: jax.Array | None = None
    # bit-packed blocks (store_k, store_v: [L, b, N, j, k, d * bits / 8] codes): blocks.quantize_lowbit's groups
    store_k_scale: jax.Array | None = None  # [L, b, N, k, d] float16
    store_k_zero: jax.Array | None = None
    store_v_scale: jax.Array | None = None  # [L, b, N, j, k, d / G] float16
    store_v_zero: jax.Array | None = None
    # lexical recall (cache.lexical): token ids, the same in every layer (each layer writes and spills its own copy)
    tok: jax.Array | None = None  # [L, b, W] int32 working tokens' ids; -1 empty
    new_tok: jax.Array | None = None  # [L, b, room] int32 this call's ids (``observe_tokens``), -1 padding
    block_tok: jax.Array | None = None  # [L, b, N, j] int32 each long-term block's token ids
    recent_tok: jax.Array | None = None  # [L, b, lexical_tokens] int32 the last ids read, newest at the end
    w_query: jax.Array | None = None  # learned router parameters (per layer)
    w_block: jax.Array | None = None
    gate_w: jax.Array | None = None
    gate_b: jax.Array | None = None
    kind: "MemoryKind" = flax.struct.field(pytree_node=False, default=None)

    @property
    def capacity(self) -> int:
        """Tokens the long-term store was planned for (the block capacity times the block size)."""
        return self.n_blocks_capacity * self.kind.policy.block

    @property
    def n_blocks_capacity(self) -> int:
        name = next(iter(self.kind.router.summary_fields()))
        return self.shape_of(name)[2]


@register_kind
@dataclasses.dataclass(frozen=True)
class MemoryKind(CacheKind):
    """Sinks + window on the device, older tokens in blocks in a store, recalled by a router. ``room``: the most
    tokens one jitted call appends (a prefill chunk or a decode segment of ``interval`` steps).
    ``route_each_query``: every query of a call routes on its own (teacher forcing, ``scoring()``); otherwise a call
    routes once with its pooled last queries (a prompt's end)."""

    name: ClassVar[str] = "memory"
    state_type: ClassVar[type] = MemoryCache

    model: ModelConfig
    policy: MemoryPolicy
    window: int
    dtype: str = "float32"
    interval: int = 64
    room: int = 512
    route_each_query: bool = False
    storage: KVStorage | None = None
    group: int = 64

    def __post_init__(self):
        if self.storage is None:
            object.__setattr__(self, "storage", KVStorage(dtype=self.dtype))

    @classmethod
    def from_config(cls, model, cache, policy) -> "MemoryKind":
        if isinstance(cache.budget, tuple):
            raise ConfigError("cache.budget for cache.policy='memory' is one number (the device budget per layer)")
        if any(spec.window is not None for spec in model.attention_specs()):
            raise ConfigError(f"cache.policy='memory' needs global attention in every layer; model.family="
                              f"{model.family!r} has sliding-window layers (layer_types), which the memory tier "
                              "does not serve yet: use a slot policy (its sliding layers keep only their window)")
        window = policy.resolve_window(cache.budget)
        if policy.lexical and policy.lexical_tokens > window:  # the oldest ids read would be in blocks: self-matches
            raise ConfigError(f"cache.lexical_tokens={policy.lexical_tokens} is invalid with a working window of "
                              f"{window} tokens: the ids matched must still be in the window (older ones have "
                              f"spilled into blocks, which would match themselves); use at most {window}")
        if policy.router == "learned":
            learned.check(policy.router_path, model, policy.positions)
        dtype = cache.dtype or model.dtype
        kind = cls(model=model, policy=policy, window=window, dtype=dtype, interval=cache.interval,
                   room=max(cache.prefill_chunk or MEMORY_ROOM, cache.interval), storage=storage_of(cache, dtype),
                   group=cache.kv_group)
        kind.blocks.check(model.head_dim)  # the blocks' codes fit the head
        return kind

    # ------------------------------------------------------------------------------------------- derived settings
    @functools.cached_property
    def router(self) -> Router:
        return make_router(self.policy.router, self.policy.representatives)

    @property
    def working_slots(self) -> int:
        """W: sinks + window, what a spill may leave short of a full run, and the room of one jitted call."""
        p = self.policy
        return p.sinks + self.window + p.spill_tokens - 1 + self.room

    @property
    def working(self) -> KVStorage:
        """The working memory's storage (``cache.kv_dtype`` int8 / fp8: 8-bit codes). Under ``int4`` / ``int2`` the
        working memory - the sinks and the recent window - stays in ``dtype``: it is the tier's float residual
        (KIVI's), and the long-term blocks hold the codes."""
        return self.storage.working()

    @property
    def store_dtype(self) -> str:
        """The long-term blocks' dtype: ``memory_dtype``, else the bit-packed ``kv_dtype``, else int8 (per-block
        scales) under an 8-bit working cache, else the cache dtype (``KVStorage.block_name``)."""
        return self.policy.memory_dtype or self.storage.block_name

    @property
    def blocks(self) -> FloatBlocks:
        """The long-term blocks' format (``lcx.cache.memory.formats``)."""
        return block_format(self.store_dtype, self.value_group)

    @property
    def value_group(self) -> int:
        """Channels per value scale of bit-packed blocks (``cache.kv_group``, at most the head)."""
        return min(self.group, self.model.head_dim)

    @property
    def decode_segment(self) -> int:
        return self.interval

    # ------------------------------------------------------------------------------------------- declaration
    def fields(self) -> Mapping[str, Field]:
        p = self.policy
        out = {
            **working_fields(self.working),
            "pos": Field(SLOTS, "int32", -1), "valid": Field(SLOTS, "bool", False),
            "count": Field(("layers", "batch"), "int32"), "n_blocks": Field(("layers", "batch"), "int32"),
            "recalled": Field(("layers", "batch", "kv_heads", "topk"), "int32", -1),
            "recalls": Field(("layers", "batch"), "int32"), "skips": Field(("layers", "batch"), "int32"),
            "layer_id": Field(("layers",), "int32"), "store_id": Field(("layers",), "int32", -1),
            "recent_q": Field(("layers", "batch", "route_queries", "heads", "head_dim"), "float32"),
            "recent_n": Field(("layers", "batch"), "int32"),
            "lengths": Field(("batch",), "int32"),
        }
        if self.router.needs_attention:
            out["received"] = Field(("layers", "batch", "kv_heads", "length"), "float32")
        out.update(self.router.summary_fields())
        if p.route_groups:
            group = ("layers", "batch", "groups", "kv_heads", "head_dim")
            out["gmin"] = Field(group, "float32", float("inf"))
            out["gmax"] = Field(group, "float32", float("-inf"))
        if p.store == "device":  # the blocks themselves, and their positions (a host store keeps those)
            out["block_pos"] = Field(("layers", "batch", "blocks", "block", "kv_heads"), "int32", -1)
            out.update(self.blocks.fields())
        if p.router == "learned":
            out.update(learned.param_fields())
        if p.lexical:
            out["tok"] = Field(SLOTS, "int32", -1)
            out["new_tok"] = Field(("layers", "batch", "room"), "int32", -1)
            out["block_tok"] = Field(("layers", "batch", "blocks", "block"), "int32", -1)
            out["recent_tok"] = Field(("layers", "batch", "lexical_tokens"), "int32", -1)
        return out

    def sizes(self, batch: int, capacity: int) -> dict[str, int]:
        m, p = self.model, self.policy
        runs = -(-capacity // p.spill_tokens)
        return {"layers": m.n_layers, "batch": batch, "length": self.working_slots, "kv_heads": m.n_kv_heads,
                "head_dim": m.head_dim, "blocks": runs * (p.spill_tokens // p.block), "block": p.block,
                "topk": p.topk, "representatives": p.representatives, "stats": 3, "route_queries": p.route_queries,
                "groups": -(-runs * (p.spill_tokens // p.block) // max(p.route_groups, 1)),
                "heads": m.n_heads, "room": self.room, "lexical_tokens": p.lexical_tokens,
                **learned.sizes(p.router_path),
                **self.blocks.sizes(m.head_dim)}

    @property
    def kv_dtype(self) -> str:
        return self.working.buffer_dtype

    def create(self, batch: int, capacity: int) -> MemoryCache:
        state = super().create(batch, capacity)
        state = state.replace(layer_id=jnp.arange(self.model.n_layers, dtype=jnp.int32))
        if self.policy.router == "learned":
            loaded = learned.load(self.policy.router_path, self.model)
            state = state.replace(**{name: jnp.asarray(value) for name, value in loaded.items()})
        return state

    # ------------------------------------------------------------------------------------------- planning
    def plan(self, batch: int, max_prompt: int, max_new_tokens: int) -> int:
        spill = self.policy.spill_tokens
        return -(-(max_prompt + max_new_tokens) // spill) * spill

    def prefill_chunk(self, requested: int, max_len: int, capacity: int) -> int:
        return min(super().prefill_chunk(requested, max_len, capacity), self.room)

    def prefill_weights(self, lengths: np.ndarray, width: int) -> np.ndarray | None:
        if not self.router.needs_attention:
            return None
        return (np.arange(width)[None, :] < lengths[:, None]).astype(np.float32)

    # ------------------------------------------------------------------------------------------- teacher forcing
    def score_width(self, tokens: int) -> int:
        """A decode segment at a time: one-token steps sync (spill) every ``interval`` steps."""
        return self.interval

    def score_weights(self, n: int, width: int, batch: int) -> np.ndarray | None:
        if not self.router.needs_attention:
            return None
        return np.broadcast_to((np.arange(width) < n).astype(np.float32), (batch, width)).copy()

    def scoring(self) -> "MemoryKind":
        return dataclasses.replace(self, route_each_query=True)

    def observe_tokens(self, state: MemoryCache, input_ids, ok) -> MemoryCache:
        """Stage the call's token ids for ``attend`` to write beside the keys (``lexical`` recall only)."""
        if not self.policy.lexical:
            return state
        t = input_ids.shape[1]
        if t > self.room:
            raise ValueError(f"a call of {t} tokens exceeds the memory tier's room of {self.room} tokens per call "
                             "(cache.prefill_chunk / cache.interval)")
        ids = jnp.pad(jnp.where(ok, input_ids, -1).astype(jnp.int32), ((0, 0), (0, self.room - t)),
                      constant_values=-1)
        if state.split:  # the unrolled decoder's form: one buffer per layer
            return state.replace(new_tok=tuple(ids for _ in state.new_tok))
        return state.replace(new_tok=jnp.broadcast_to(ids, (state.new_tok.shape[0],) + ids.shape))

    # ------------------------------------------------------------------------------------------- attention
    def attend(self, layer, q, key, val, *, cos, sin, positions, ok, stat_weights, spec=None):
        return memory_attend.attend(self, layer, q, key, val, cos=cos, sin=sin, positions=positions, ok=ok,
                                    stat_weights=stat_weights, spec=spec or self.model.attention_specs()[0])

    # ------------------------------------------------------------------------------------------- tiers
    def evict(self, state: MemoryCache):
        """Spill the runs above sinks + window to long-term blocks: ``(state, left)``; ``left`` holds the new
        blocks (``k, v, pos`` and, for int8 storage, scales) and ``new [b]`` blocks per row."""
        return _spill(self, state)

    def open(self, state: MemoryCache):
        if self.policy.store == "device":
            return state, None
        b = state.pos.shape[1]
        m = self.model
        directory = None if self.policy.store != "disk" else Path(self.policy.store_dir) / f"store-{id(state)}"
        store = BlockStore(m.n_layers, b, state.n_blocks_capacity, self.policy.block, m.n_kv_heads, m.head_dim,
                           self.store_dtype, directory, value_group=self.value_group)
        handle = register_store(store)
        return state.replace(store_id=jnp.full((m.n_layers,), handle, jnp.int32)), handle

    def close(self, handle) -> None:
        if handle is not None:
            release_store(handle)

    def sync(self, state: MemoryCache) -> MemoryCache:
        p = self.policy
        counts = np.asarray(state.count[0])
        if not np.any(counts - p.sinks - self.window >= p.spill_tokens):
            return state
        state, left = _spill_jit(self)(state)
        if p.store != "device":
            store = get_store(int(np.asarray(state.store_id)[0]))
            host = jax.device_get(left)
            store.append(host["k"], host["v"], host["pos"], host["new"], host.get("scale"), host.get("groups"))
        return state

    def store_bytes(self, state: MemoryCache) -> int:
        if self.policy.store == "device":
            return 0
        store = get_store(int(np.asarray(state.store_id)[0]))
        return 0 if store is None else store.nbytes()

    def store_nbytes(self, batch: int, capacity: int) -> int:
        if self.policy.store == "device":
            return 0
        m, sizes = self.model, self.sizes(batch, capacity)
        tokens = sizes["blocks"] * self.policy.block
        blocks = self.blocks  # per token: keys, values and a position per KV head; per block: its scales
        return m.n_layers * batch * m.n_kv_heads * (tokens * blocks.token_bytes(m.head_dim)
                                                    + sizes["blocks"] * blocks.block_bytes(m.head_dim))

    def block_positions(self, state: MemoryCache) -> np.ndarray:
        """Original positions ``[L, b, N, j, k]`` of every long-term block's tokens (-1: empty), wherever they live."""
        if state.block_pos is not None:
            return np.asarray(state.block_pos)
        store = get_store(int(np.asarray(state.store_id)[0]))
        return np.asarray(store.pos)

    def save_host(self, state: MemoryCache, path) -> None:
        store = get_store(int(np.asarray(state.store_id)[0]))
        if store is not None:
            store.save(Path(path) / "store")

    def restore_host(self, state: MemoryCache, path):
        if self.policy.store == "device" or not (Path(path) / "store").is_dir():
            return state, None
        directory = None if self.policy.store != "disk" else Path(self.policy.store_dir) / f"store-{id(state)}"
        handle = register_store(BlockStore.load(Path(path) / "store", directory))
        return state.replace(store_id=jnp.full((self.model.n_layers,), handle, jnp.int32)), handle


# --------------------------------------------------------------------------------------------------- spilling
@functools.lru_cache(maxsize=32)
def _spill_jit(kind: MemoryKind):
    return jax.jit(functools.partial(_spill, kind), donate_argnums=(0,))  # updates the state's buffers in place


def _spill(kind: MemoryKind, state: MemoryCache):
    """Move every whole run above ``sinks + window`` out of the working memory (all layers, each row its own)."""
    p = kind.policy
    sinks, run = p.sinks, p.spill_tokens
    slots = state.pos.shape[-1]
    runs_max = max(1, (run - 1 + kind.room) // run)
    out_tokens = runs_max * run
    count = state.count  # [L, b]
    runs = jnp.clip((count - sinks - kind.window) // run, 0, runs_max)  # [L, b]
    moved = runs * run  # tokens leaving per row
    # The leaving tokens: slots [sinks, sinks + out_tokens), of which the first `moved` are real.
    take = jnp.minimum(sinks + jnp.arange(out_tokens), slots - 1)  # [T]
    working = working_fields(kind.working)
    leaving = namespace(**{n: getattr(state, n)[:, :, take] for n in working})
    left_k, left_v = kind.working.float_kv(leaving, jnp.float32)  # [L, b, T, k, d] float32 values
    left_pos = state.pos[:, :, take]  # [L, b, T]
    leaving_tok = None if state.tok is None else state.tok[:, :, take]  # [L, b, T]
    received = (state.received[..., take] if state.received is not None
                else jnp.zeros(state.pos.shape[:2] + (state.k.shape[3], out_tokens), jnp.float32))  # [L, b, k, T]
    # Compact the working memory: the sinks stay, the rest shifts down by `moved`.
    j = jnp.arange(slots)
    src = jnp.where(j[None, None, :] < sinks, j, j + moved[..., None])  # [L, b, W]
    inside = src < slots
    src = jnp.minimum(src, slots - 1)
    gather = lambda x, axis: jnp.take_along_axis(  # noqa: E731
        x, src.reshape(src.shape[:2] + (1,) * (axis - 2) + (slots,) + (1,) * (x.ndim - axis - 1)), axis=axis)
    new_count = count - moved
    valid = jnp.where(inside, gather(state.valid, 2), False) & (j[None, None, :] < new_count[..., None])
    state = state.replace(
        **{n: gather(getattr(state, n), 2) for n in working}, pos=jnp.where(valid, gather(state.pos, 2), -1),
        valid=valid, count=new_count,
        received=None if state.received is None else jnp.where(valid[:, :, None], gather(state.received, 3), 0.0),
        tok=None if state.tok is None else jnp.where(valid, gather(state.tok, 2), -1))

    # Blocks, per layer (vmapped): [L, b, n, j, k, ...]
    cluster_run = run if p.blocks == "cluster" else 0
    form = functools.partial(form_blocks, block=p.block, cluster_run=cluster_run, iters=p.kmeans_iters)
    bk, bv, bpos, brec = jax.vmap(form)(left_k, left_v, left_pos, jnp.swapaxes(received, 2, 3))
    new_blocks = moved[0] // p.block  # [b] the same for every layer
    summaries = jax.vmap(kind.router.summarize)(bk, brec)  # {name: [L, b, n, k, ...]}
    n_out = bk.shape[2]
    at = state.n_blocks[..., None] + jnp.arange(n_out)  # [L, b, n] destination block index
    at = jnp.where(jnp.arange(n_out) < new_blocks[None, :, None], at, state.n_blocks_capacity)  # drop the rest
    layers, rows = jnp.arange(at.shape[0])[:, None, None], jnp.arange(at.shape[1])[None, :, None]
    updates = {name: getattr(state, name).at[layers, rows, at].set(value, mode="drop")
               for name, value in summaries.items()}
    if p.lexical:  # contiguous blocks: the leaving tokens in order, `block` at a time
        left_tok = leaving_tok.reshape(leaving_tok.shape[:2] + (n_out, p.block))
        updates["block_tok"] = state.block_tok.at[layers, rows, at].set(left_tok, mode="drop")
    if p.route_groups:  # a group's bounds cover its blocks'
        groups = state.gmin.shape[2]
        group = jnp.where(at < state.n_blocks_capacity, at // p.route_groups, groups)
        updates["gmin"] = state.gmin.at[layers, rows, group].min(summaries["kmin"], mode="drop")
        updates["gmax"] = state.gmax.at[layers, rows, group].max(summaries["kmax"], mode="drop")
    left = {"pos": bpos, "new": new_blocks}
    left |= kind.blocks.encode(bk, bv)  # k, v as stored, and their scale / groups
    if p.store == "device":
        updates["block_pos"] = state.block_pos.at[layers, rows, at].set(bpos, mode="drop")
        for name, value in kind.blocks.device(left).items():
            updates[name] = getattr(state, name).at[layers, rows, at].set(value, mode="drop")
    state = state.replace(n_blocks=state.n_blocks + new_blocks[None, :], **updates)
    return state, left


def working_fields(storage: KVStorage) -> dict[str, Field]:
    """The working memory's key / value buffers: ``storage``'s slot buffers with the slots before the KV heads
    (``[L, b, W, k, ...]``, as the tier writes and compacts them per row)."""
    swap = {"kv_heads": "length", "length": "kv_heads"}
    return {n: dataclasses.replace(f, axes=tuple(swap.get(a, a) for a in f.axes))
            for n, f in storage.slot_fields().items()}


__all__ = ["MemoryCache", "MemoryKind", "working_fields"]
