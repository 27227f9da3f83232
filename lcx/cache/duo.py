"""DuoAttention's head split (arXiv 2410.10819), calibrated on the model itself.

DuoAttention keeps the whole context only in *retrieval* heads; the other, *streaming*, heads keep the first
``sinks`` and the ``recent`` newest tokens. Which heads may stream is a property of the model, found once: the paper
optimises a gate per head on synthetic passkey retrieval; kvpress loads those published patterns (or estimates them
from mean queries). lcx measures directly what a streaming head would lose where retrieval matters: on passkey
prompts with their answers (``lcx.data.policy_inputs``), the share of each KV head's attention that the last
``queries`` positions (the question and the answer) give tokens outside its streaming window - positions ``sinks ..
t - recent`` for a query at ``t`` - averaged over those queries and the query heads of the group (``head_scores``).
The ``head_ratio`` share of (layer, KV head) pairs with the least such mass become streaming heads.

Shapes: L layers, t tokens, h query heads, k KV heads, g query heads per KV head, d head dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from lcx.config_base import ConfigError
from lcx.model.config import ModelConfig
from lcx.model.decoder import attention_inputs


def head_scores(config: ModelConfig, params, ids, *, sinks: int, recent: int, queries: int | None = None
                ) -> np.ndarray:
    """``[L, k]``: the attention mass each KV head gives tokens outside its streaming window, per query, averaged over
    the scored queries and the KV head's query group. ``ids [t]`` or ``[n, t]`` (rows averaged): a full forward pass
    each; the scored queries are those past ``sinks + recent`` - of them only the last ``queries`` of each row when
    given (a passkey prompt's question and answer: the queries that must reach the key). ``params``: stacked
    (``layers``), as training writes them."""
    ids = np.atleast_2d(np.asarray(ids, np.int32))
    t = ids.shape[1]
    if t <= sinks + recent:
        raise ConfigError(f"the calibration text has {t} tokens: it must be longer than cache.sinks + cache.recent "
                          f"= {sinks + recent} (the streaming window), e.g. 4x as long")
    first = sinks + recent if queries is None else max(sinks + recent, t - queries)
    inputs = jax.jit(attention_inputs, static_argnums=0)
    specs = config.attention_specs()
    out = np.zeros((config.n_layers, config.n_kv_heads))
    for row in ids:
        q, k = inputs(config, params, jnp.asarray(row[None]))  # [L, 1, t, h|k, d]
        for layer in range(config.n_layers):
            out[layer] += np.asarray(_distant_mass(q[layer, 0], k[layer, 0], specs[layer].sm_scale,
                                                   specs[layer].softcap, sinks, recent, first)) / len(ids)
    return out


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5, 6))
def _distant_mass(q, k, scale, softcap, sinks, recent, first):
    """One layer: ``q [t, h, d]``, ``k [t, k, d]`` (rotated) -> ``[k]`` mean mass outside the streaming window over
    the queries at positions ``>= first``."""
    t, h, _ = q.shape
    kv = k.shape[1]
    s = jnp.einsum("tkgd,skd->kgts", q[first:].reshape(t - first, kv, h // kv, -1).astype(jnp.float32),
                   k.astype(jnp.float32)) * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    rows, cols = jnp.arange(first, t)[:, None], jnp.arange(t)[None, :]
    p = jax.nn.softmax(jnp.where(cols <= rows, s, -jnp.inf), axis=-1)
    distant = (cols >= sinks) & (cols <= rows - recent)  # what a streaming head drops
    return jnp.mean(jnp.sum(jnp.where(distant, p, 0.0), axis=-1), axis=(1, 2))


def streaming_heads(scores, head_ratio: float) -> np.ndarray:
    """``[L, k]`` bool: the ``round(head_ratio x L x k)`` (layer, KV head) pairs of least ``scores`` (ties: the
    earlier pair), as kvpress's ``DuoAttentionPress`` splits its head scores."""
    scores = np.asarray(scores, np.float64)
    n = int(round(scores.size * head_ratio))
    mask = np.zeros(scores.size, bool)
    mask[np.argsort(scores, axis=None, kind="stable")[:n]] = True
    return mask.reshape(scores.shape)


__all__ = ["head_scores", "streaming_heads"]
