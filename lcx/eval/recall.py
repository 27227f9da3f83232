"""What the memory routers recall, and how it compares with full attention.

Shape letters: L layers, b batch, k kv heads, g query heads per kv head, K recalled blocks, N blocks, j tokens per
block, T prompt tokens.

- :func:`trace_recall` runs a prompt through the memory cache the way generation does and returns, per layer, row
  and KV head, the blocks the last query recalled and the original positions of their tokens (for notebooks and
  plots), with the device and store bytes.
- :func:`block_attention` is the oracle: the full-attention probability mass the last prompt query of each row
  gives each long-term block (summed over the query heads of the KV group), from an uncached forward pass.
- :func:`recall_at_k`: the share of the oracle's top-``K`` blocks the router recalled (per layer, row and KV head,
  averaged), the measure of a router.
"""

from __future__ import annotations

import dataclasses

import einops
import jax
import jax.numpy as jnp
import numpy as np

from lcx.cache.config import CacheConfig
from lcx.config_base import ConfigError
from lcx.engine import Generator, pad_prompts
from lcx.model import attention_inputs
from lcx.model.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class RecallTrace:
    ids: np.ndarray  # [L, b, k, K] blocks the last query recalled, ascending (-1: none)
    positions: np.ndarray  # [L, b, k, K, j] original positions of the recalled tokens (-1: none)
    block_pos: np.ndarray  # [L, b, N, j, k] original positions of every block's tokens (-1: empty)
    n_blocks: np.ndarray  # [b] long-term blocks per row
    device_bytes: int
    store_bytes: int
    recalls: np.ndarray  # [L, b] chunks / steps that recalled
    skips: np.ndarray  # [L, b] chunks / steps the gate skipped recall


def trace_recall(config: ModelConfig, params, cache: CacheConfig, prompt_ids) -> RecallTrace:
    """Prefill ``prompt_ids`` through the memory cache ``cache``; what each layer recalled for the last query."""
    if cache.make_policy().cache_type != "memory":
        raise ConfigError(f"cache.policy={cache.policy!r} has no long-term memory to trace; use policy='memory'")
    if any(spec.window is not None for spec in config.attention_specs()):
        raise ConfigError(f"model.layer_types={list(config.types)} has sliding-window layers: the recall trace "
                          "compares every layer with the memory's, so it needs global attention in every layer")
    gen = Generator(config, params, max_new_tokens=1, cache=cache)
    state = gen.prefill(prompt_ids)
    c = state.cache
    ids = np.asarray(c.recalled)
    block_pos = gen.kind.block_positions(c)  # [L, b, N, j, k]
    layers, rows, heads = np.indices(ids.shape[:3])
    positions = block_pos[layers[..., None], rows[..., None], np.maximum(ids, 0), :, heads[..., None]]
    positions = np.where((ids >= 0)[..., None], positions, -1)  # [L, b, k, K, j]
    result = gen.result(state)
    trace = RecallTrace(ids=ids, positions=positions, block_pos=block_pos, n_blocks=np.asarray(c.n_blocks[0]),
                        device_bytes=result.cache_bytes, store_bytes=result.store_bytes,
                        recalls=np.asarray(c.recalls), skips=np.asarray(c.skips))
    gen.close()
    return trace


def block_attention(config: ModelConfig, params, prompt_ids, block_pos: np.ndarray) -> np.ndarray:
    """The oracle: attention mass ``[L, b, k, N]`` the last query of each prompt gives the tokens of each block
    (``block_pos [L, b, N, j, k]``, -1 for none), summed over the query heads of each KV group."""
    ids, lengths = pad_prompts(prompt_ids)
    q, k = attention_inputs(config, params, jnp.asarray(ids))  # [L, b, T, h, d], [L, b, T, k, d]
    rows = np.arange(ids.shape[0])
    last = jnp.asarray(q)[:, rows, lengths - 1]  # [L, b, h, d]
    qg = einops.rearrange(last, "L b (k g) d -> L b k g d", k=k.shape[3])
    scores = jnp.einsum("Lbkgd,Lbtkd->Lbkgt", qg.astype(jnp.float32), k.astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST) * config.head_dim ** -0.5
    seen = jnp.arange(ids.shape[1])[None, :] < jnp.asarray(lengths)[:, None]  # [b, T]
    probs = jax.nn.softmax(jnp.where(seen[None, :, None, None], scores, -jnp.inf), axis=-1)
    mass = np.asarray(jnp.sum(probs, axis=3))  # [L, b, k, T]
    layer, row, _, _, head = np.indices(block_pos.shape)
    per_token = mass[layer, row, head, np.maximum(block_pos, 0)] * (block_pos >= 0)  # [L, b, N, j, k]
    return per_token.sum(axis=3).transpose(0, 1, 3, 2)  # [L, b, k, N]


def recall_at_k(trace: RecallTrace, oracle: np.ndarray) -> float:
    """Mean over layers, rows and KV heads of |recalled ∩ oracle top-K| / min(K, blocks)."""
    L, b, heads, topk = trace.ids.shape
    hits = []
    for layer in range(L):
        for row in range(b):
            n = int(trace.n_blocks[row])
            if n == 0:
                continue
            k = min(topk, n)
            for head in range(heads):
                best = set(np.argsort(-oracle[layer, row, head, :n], kind="stable")[:k].tolist())
                got = set(int(i) for i in trace.ids[layer, row, head] if i >= 0)
                hits.append(len(best & got) / k)
    return float(np.mean(hits)) if hits else float("nan")


__all__ = ["RecallTrace", "block_attention", "recall_at_k", "trace_recall"]
