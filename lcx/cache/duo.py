"""DuoAttention's head split (arXiv 2410.10819), calibrated on the model itself.

DuoAttention keeps the whole context only in *retrieval* heads; the other, *streaming*, heads keep the first
``sinks`` and the ``recent`` newest tokens. Which heads may stream is a property of the model, found once: the paper
optimises a gate per head on synthetic passkey data; kvpress loads those published patterns (or estimates them from
mean queries). lcx measures directly what a streaming head would lose: over a calibration text, the share of each
KV head's attention that falls outside its streaming window - on positions ``sinks .. t - recent`` for a query at
``t`` - averaged over the queries past ``sinks + recent`` and the query heads of the group (``head_scores``). The
``head_ratio`` share of (layer, KV head) pairs with the least such mass become streaming heads.

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


def head_scores(config: ModelConfig, params, ids, *, sinks: int, recent: int) -> np.ndarray:
    """``[L, k]``: the attention mass each KV head gives tokens outside its streaming window, per query (the
    queries at positions ``>= sinks + recent`` of ``ids [t]``, a full forward pass), averaged over those queries and
    the KV head's query group. ``params``: stacked (``layers``), as training writes them."""
    ids = np.asarray(ids, np.int32).reshape(1, -1)
    t = ids.shape[1]
    if t <= sinks + recent:
        raise ConfigError(f"the calibration text has {t} tokens: it must be longer than cache.sinks + cache.recent "
                          f"= {sinks + recent} (the streaming window), e.g. 4x as long")
    q, k = jax.jit(attention_inputs, static_argnums=0)(config, params, jnp.asarray(ids))  # [L, 1, t, h|k, d]
    specs = config.attention_specs()
    out = np.zeros((config.n_layers, config.n_kv_heads))
    for layer in range(config.n_layers):
        out[layer] = np.asarray(_distant_mass(q[layer, 0], k[layer, 0], specs[layer].sm_scale, specs[layer].softcap,
                                              sinks, recent))
    return out


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5))
def _distant_mass(q, k, scale, softcap, sinks, recent):
    """One layer: ``q [t, h, d]``, ``k [t, k, d]`` (rotated) -> ``[k]`` mean mass outside the streaming window."""
    t, h, _ = q.shape
    kv = k.shape[1]
    s = jnp.einsum("tkgd,skd->kgts", q.reshape(t, kv, h // kv, -1).astype(jnp.float32), k.astype(jnp.float32))
    s = s * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    rows, cols = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
    p = jax.nn.softmax(jnp.where(cols <= rows, s, -jnp.inf), axis=-1)
    distant = (cols >= sinks) & (cols <= rows - recent)  # what a streaming head drops
    mass = jnp.sum(jnp.where(distant, p, 0.0), axis=-1)  # [k, g, t]
    counted = jnp.arange(t) >= sinks + recent
    return jnp.sum(jnp.where(counted, mass, 0.0), axis=(1, 2)) / (jnp.sum(counted) * (h // kv))


def streaming_heads(scores, head_ratio: float) -> np.ndarray:
    """``[L, k]`` bool: the ``round(head_ratio x L x k)`` (layer, KV head) pairs of least ``scores`` (ties: the
    earlier pair), as kvpress's ``DuoAttentionPress`` splits its head scores."""
    scores = np.asarray(scores, np.float64)
    n = int(round(scores.size * head_ratio))
    mask = np.zeros(scores.size, bool)
    mask[np.argsort(scores, axis=None, kind="stable")[:n]] = True
    return mask.reshape(scores.shape)


__all__ = ["head_scores", "streaming_heads"]
