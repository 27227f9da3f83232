"""Grouped-query attention: projections -> [QK-norm] -> RoPE -> attention backend (or the cache's ``attend``) -> output
projection, with the layer's ``AttentionSpec`` (window, soft-cap, scale, RoPE).

Einsum legend: b batch, t positions, e embed, h query heads, k kv heads, d head dim.
Query heads are ordered by KV group (head h belongs to KV head h // n_groups), the Hugging Face order, so that
sharding "heads" and "kv_heads" contiguously over the same mesh axis keeps each query head with its KV head.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from lcx import kernels
from lcx.parallel import context as context_parallel
from lcx.parallel import sharding
from lcx.model.config import AttentionSpec, ModelConfig
from lcx.model.layers import RMSNorm
from lcx.model.params import as_dtype, declare, normal, zeros
from lcx.model.rope import apply_rope
from lcx.parallel.sharding import BSKD, BT, BTHD


def attend_spec(config: ModelConfig, spec: AttentionSpec, tables, q, key, val, cache, positions, ok, stat_weights,
                segment_ids, probe=None):
    """One layer's attention with a static ``spec``: ``(out [b, t, h, d], cache)``. ``tables``: ``(cos, sin)`` of
    ``spec.rope`` at ``positions``. ``probe``: a reconstruction pass (``lcx.cache.reconstruct.Probe``), handed to
    the cache's ``attend``."""
    cos, sin = tables[:2]
    if cache is not None:
        if segment_ids is not None:
            raise ValueError("segment_ids (packed documents) are for training and scoring without a cache")
        # Cache kinds written before per-layer specs take no ``spec``: plain (Llama-style) models do not pass it.
        if context_parallel.sequence_axis() > 1 and q.shape[1] > 1:
            return _prefill_across_seq(config, spec, q, key, val, cache, cos, sin, positions, ok, probe)
        extra = {} if config.plain_attention else {"spec": spec}
        if probe is not None:
            extra["probe"] = probe
        if len(tables) == 4:  # rope.rerotate: the tables every cached key is rotated with (``spec_tables``)
            extra["key_tables"] = tables[2:]
        return cache.kind.attend(cache, q, key, val, cos=cos, sin=sin, positions=positions, ok=ok,
                                 stat_weights=stat_weights, **extra)
    if probe is not None:
        raise ValueError("a reconstruction probe scores a cache's slots: it needs a cache")
    q, key = apply_rope(q, cos, sin), apply_rope(key, cos, sin)
    if context_parallel.sequence_axis() > 1 and q.shape[1] > 1:  # the sequence split over seq: ring / all-gather
        return _across_seq(config, spec, q, key, val, segment_ids), None
    attend = functools.partial(kernels.backend(config.attention.impl).causal, sm_scale=spec.sm_scale,
                               **kernels.spec_kwargs(spec))
    if segment_ids is None:
        return sharding.per_shard(attend, (BTHD, BSKD, BSKD), BTHD)(q, key, val), None  # no communication
    packed = lambda q, k, v, seg: attend(q, k, v, segment_ids=seg)  # noqa: E731
    return sharding.per_shard(packed, (BTHD, BSKD, BSKD, BT), BTHD)(q, key, val, segment_ids), None


def _across_seq(config: ModelConfig, spec: AttentionSpec, q, key, val, segment_ids=None):
    """Causal attention of rotated, laid-out rows across the mesh's ``seq`` axis with the layer's spec."""
    return context_parallel.attend(q, key, val, segment_ids, strategy=config.attention.context_parallel,
                                   impl=config.attention.impl, sm_scale=spec.sm_scale, window=spec.window,
                                   softcap=spec.softcap)


def _prefill_across_seq(config: ModelConfig, spec: AttentionSpec, q, key, val, cache, cos, sin, positions, ok, probe):
    """A whole prompt in one chunk on a mesh with a ``seq`` axis (``Generator`` on such a mesh, a fresh cache): the
    chunk's causal attention runs across ``seq`` like training's (rows laid out in zig-zag order, ring or
    all-gather), then its keys and values are gathered in sequence order and the cache writes them
    (``kind.write_prompt``): the cache is whole on every ``seq`` device for decode."""
    write = getattr(cache.kind, "write_prompt", None)
    if write is None or probe is not None:
        raise ValueError(f"a prefill split over the mesh's seq axis writes its keys and values into the cache whole; "
                         f"cache type {cache.kind.name!r} cannot" + (" (nor score a reconstruction pass)"
                                                                     if probe is not None else ""))
    n = context_parallel.sequence_axis()
    q_rot, k_rot = apply_rope(q, cos, sin), apply_rope(key, cos, sin)
    out = _across_seq(config, spec, q_rot, k_rot, val)
    back = lambda x: context_parallel.unlayout(x, n)  # noqa: E731  sequence order: the cache's slot order
    return out, write(cache, back(k_rot), back(key), back(val), back(positions), back(ok))


class Attention(nn.Module):
    """Self-attention over ``x [b, t, e]``; returns ``(out [b, t, e], cache)``.

    Without a cache the sequence attends causally to itself (within its segment when ``segment_ids [b, t]`` is
    given: packed documents). With one (a layer of a cache state, see ``lcx.cache.base``), the cache's own ``attend``
    appends the new keys and values (where ``ok``) and attends.

    ``tables`` holds ``(cos, sin)`` per distinct spec of the model (``ModelConfig.spec_table``); ``spec_index``
    picks this layer's: a Python int (static: the unrolled decoder, or a model with one spec) or, inside the layer
    scan of a model with several, a traced int - then ``lax.switch`` runs the branch of the layer's spec, so the
    compiled program holds each distinct spec once, whatever the depth.
    """

    config: ModelConfig
    # Contract the output projection over the merged (h d) axis. Contracting h and d separately lets XLA:CPU transpose
    # (copy) the whole output weight every decode step; generation's unrolled decoder merges. The scanned decoder
    # (training, scoring) keeps the separate form: the two differ in float32 rounding (~4e-7), and a training run
    # should not change with this.
    merge_out_heads: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, tables, spec_index, cache=None, positions: jax.Array | None = None,
                 ok: jax.Array | None = None, stat_weights: jax.Array | None = None,
                 segment_ids: jax.Array | None = None, probe=None):
        cfg = self.config
        e, h, k, d = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        init, pdt, dt = normal(cfg.init_std), as_dtype(cfg.param_dtype), cfg.dtype
        wq = declare(self, "q", (e, h, d), ("embed", "heads", "head_dim"), init, pdt)
        wk = declare(self, "k", (e, k, d), ("embed", "kv_heads", "head_dim"), init, pdt)
        wv = declare(self, "v", (e, k, d), ("embed", "kv_heads", "head_dim"), init, pdt)
        wo = declare(self, "o", (h, d, e), ("heads", "head_dim", "embed"), init, pdt)

        q = jnp.einsum("bte,ehd->bthd", x, wq.astype(dt))  # [b, t, h, d]
        key = jnp.einsum("bte,ekd->btkd", x, wk.astype(dt))  # [b, t, k, d]
        val = jnp.einsum("bte,ekd->btkd", x, wv.astype(dt))  # [b, t, k, d]
        if cfg.qkv_bias:
            q = q + declare(self, "q_bias", (h, d), ("heads", "head_dim"), zeros, pdt).astype(dt)
            key = key + declare(self, "k_bias", (k, d), ("kv_heads", "head_dim"), zeros, pdt).astype(dt)
            val = val + declare(self, "v_bias", (k, d), ("kv_heads", "head_dim"), zeros, pdt).astype(dt)
        if cfg.block.qk_norm:  # per head over head_dim, before RoPE (Qwen3, Gemma 3)
            q = RMSNorm(cfg, dim=d, name="q_norm")(q)
            key = RMSNorm(cfg, dim=d, name="k_norm")(key)
        key, val = sharding.replicate_kv_heads(key, val, n_heads=h)  # [b, t, k*r, d] when a mesh replicates
        if cache is None:
            # Kept only when asked for (apply(..., mutable=["intermediates"])): what routers distil from.
            self.sow("intermediates", "q", q)
            self.sow("intermediates", "k", key)

        specs, _ = cfg.spec_table()
        branches = [functools.partial(attend_spec, cfg, spec, tables[j]) for j, spec in enumerate(specs)]
        rest = (positions, ok, stat_weights, segment_ids, probe)
        with jax.named_scope(f"attention_{cfg.attention.impl}"):
            if isinstance(spec_index, int):
                out, cache = branches[spec_index](q, key, val, cache, *rest)
            else:
                out, cache = jax.lax.switch(spec_index, branches, q, key, val, cache, *rest)
        if self.merge_out_heads:  # f = (h d): a bitcast of both operands
            out = jnp.einsum("btf,fe->bte", out.astype(dt).reshape(*out.shape[:2], h * d),
                             wo.astype(dt).reshape(h * d, e))  # [b, t, e]
        else:
            out = jnp.einsum("bthd,hde->bte", out.astype(dt), wo.astype(dt))  # [b, t, e]
        if cfg.o_bias:
            out = out + declare(self, "o_bias", (e,), ("embed",), zeros, pdt).astype(dt)
        return out, cache
