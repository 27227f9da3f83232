"""The decoder, Flax Linen used functionally: ``init`` / ``apply`` with a plain params dict.

    embed [x sqrt(e)] -> n_layers x [RMSNorm -> Attention [-> RMSNorm] -> +res -> RMSNorm -> gated MLP [-> RMSNorm]
    -> +res] -> RMSNorm -> logits (float32) [-> soft-cap]

(brackets: by family, ``lcx.model.families``). Layers are one ``nn.scan`` over a stacked block (params carry a
leading "layers" axis), so compile time does not grow with depth; layers whose attention specs differ (sliding-window
and global layers) pick theirs inside the scan (``Attention``). ``Decoder(config, unrolled=True)`` runs the same block
once per layer instead, with per-layer params (``unroll_params``): what generation uses, where every step reads every
weight once.
Einsum legend: b batch, t positions, e embed, v vocab.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from lcx.model.config import REMAT_POLICIES, ModelConfig
from lcx.model.attention import Attention
from lcx.model.attention_choice import resolve_attention
from lcx.model.layers import MLP, RMSNorm
from lcx.model.params import as_dtype, declare, normal
from lcx.model.rope import apply_rope, rope_tables


def spec_tables(config: ModelConfig, positions: jax.Array, ok: jax.Array | None = None,
                capacity: int | None = None) -> tuple[tuple[jax.Array, ...], ...]:
    """``(cos, sin)`` at ``positions`` for each distinct attention spec (``ModelConfig.spec_table``), computed once per
    distinct RoPE; a length-dependent type's length counts only the real tokens (``ok``). A RoPE that re-rotates the
    cache (``rope.rerotate``, with a cache of ``capacity`` slots) takes each row's length from its last real token
    and adds the tables of positions ``0 .. capacity - 1``, ``[b, C, rotary_dim]`` each: every layer's keys are
    rotated with them, so the sines and cosines are computed once per call, not per layer."""
    specs, _ = config.spec_table()
    real = positions if ok is None else jnp.where(ok, positions, -1)  # a padded chunk's padding has no length
    by_rope = {}
    for spec in specs:
        if spec.rope in by_rope:
            continue
        if spec.rope.rerotate and capacity is not None:
            seq_len = jnp.max(real, axis=1) + 1  # [b]
            keys = rope_tables(config, jnp.arange(capacity, dtype=jnp.int32)[None], spec.rope, seq_len)
            by_rope[spec.rope] = (*rope_tables(config, positions, spec.rope, seq_len), *keys)
        else:  # a length-dependent type at the batch's longest real row, as transformers
            by_rope[spec.rope] = rope_tables(config, positions, spec.rope, jnp.max(real) + 1)
    return tuple(by_rope[spec.rope] for spec in specs)


class Block(nn.Module):
    """One layer. The carry is ``(x, cache, i)``: the whole cache rides in it and layer ``i`` reads its view and
    writes it back in place (``CacheState.layer`` / ``set_layer``: on a stacked cache a ``dynamic_update_slice`` of
    a loop-carried buffer, on a split one its own buffers). Passing the cache as scanned inputs and outputs instead
    would build a fresh stacked cache every call - several full copies of every layer's keys and values per decoded
    token.

    ``spec_index``: the layer's attention spec (an int, static) or None inside the scan, where the traced index
    arrives as the scanned input ``scanned_spec``."""

    config: ModelConfig
    merge_out_heads: bool = False  # see ``Attention.merge_out_heads``
    spec_index: int | None = None

    @nn.compact
    def __call__(self, carry, tables, positions: jax.Array | None, ok: jax.Array | None,
                 stat_weights: jax.Array | None, segment_ids: jax.Array | None, probe=None,
                 scanned_spec: jax.Array | None = None):
        cfg = self.config
        x, cache, i = carry
        layer = None if cache is None else cache.layer(i)
        spec = self.spec_index
        if spec is None:
            spec = 0 if len(cfg.spec_table()[0]) == 1 else scanned_spec
        sandwich = cfg.block.sandwich_norms
        with jax.named_scope("attention_block"):
            attn = Attention(cfg, merge_out_heads=self.merge_out_heads, name="attn")
            h, layer = attn(RMSNorm(cfg, name="attn_norm")(x), tables, spec, layer, positions, ok, stat_weights,
                            segment_ids, probe)
            if sandwich:
                h = RMSNorm(cfg, name="post_attn_norm")(h)
            x = x + h
        with jax.named_scope("mlp_block"):
            h = MLP(cfg, name="mlp")(RMSNorm(cfg, name="mlp_norm")(x))
            if sandwich:
                h = RMSNorm(cfg, name="post_mlp_norm")(h)
            x = x + h
        if cache is not None:
            cache = cache.set_layer(i, layer)
        return (x, cache, i + 1), None


class Decoder(nn.Module):
    """``Decoder(config).apply({"params": params}, input_ids [b, t] int32)`` -> logits ``[b, t, vocab]`` float32.

    ``positions [b, t]`` default to ``0 .. t-1`` (after the tokens already in ``cache``).
    With ``cache`` (a cache state, ``lcx.cache.base``) the call appends the tokens where ``ok [b, t]`` (default:
    all; False marks padding) and returns ``(logits, cache)``; each layer attends through the cache's own
    ``attend``. ``logits_index [b]`` computes the logits of one position per row only (e.g. the last prompt token),
    giving ``[b, 1, vocab]``. ``stat_weights [b, t]`` marks the queries whose attention feeds eviction statistics.
    ``segment_ids [b, t]`` (no cache): documents packed into one row - a token attends only within its segment;
    give ``positions`` restarting at 0 per document so each document is rotated as if it ran alone.
    ``probe`` (``lcx.cache.reconstruct.Probe``): a reconstruction pass - the tokens attend to the cache and score
    its slots but are not appended (the caller restores ``cache.lengths``).
    """

    config: ModelConfig
    unrolled: bool = False

    @nn.compact
    def __call__(self, input_ids: jax.Array, positions: jax.Array | None = None, cache=None,
                 ok: jax.Array | None = None, logits_index: jax.Array | None = None,
                 stat_weights: jax.Array | None = None, segment_ids: jax.Array | None = None, probe=None):
        cfg = self.config
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [batch, seq]; got shape {input_ids.shape}")
        b, t = input_ids.shape
        if positions is None:
            start = cache.lengths[:, None] if cache is not None else 0
            positions = start + jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        if cache is not None and ok is None:
            ok = jnp.ones((b, t), bool)
        if cache is not None and probe is None:  # a reconstruction pass appends nothing
            cache = cache.kind.observe_tokens(cache, input_ids, ok)
        init, pdt = normal(cfg.init_std), as_dtype(cfg.param_dtype)
        embedding = declare(self, "embed", (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), init, pdt)
        x = jnp.take(embedding, input_ids, axis=0).astype(cfg.dtype)  # [b, t, e]
        if cfg.block.embed_scale:  # sqrt(e) rounded to the compute dtype first, as transformers
            x = x * jnp.asarray(cfg.d_model ** 0.5, cfg.dtype)
        tables = spec_tables(cfg, positions, ok, getattr(cache, "capacity", None))
        _, spec_of_layer = cfg.spec_table()

        block = Block
        if cfg.remat:
            policy = getattr(jax.checkpoint_policies, REMAT_POLICIES[cfg.remat_policy])
            block = nn.remat(Block, prevent_cse=False, policy=policy)
        layer_inputs = (tables, positions, ok, stat_weights, segment_ids, probe)
        if self.unrolled:  # one Block per layer, params "layers_0" ... (``unroll_params``), layer i a Python int
            carry = (x, None if cache is None else cache.layers(), 0)
            for i in range(cfg.n_layers):
                carry, _ = block(cfg, merge_out_heads=True, spec_index=spec_of_layer[i], name=f"layers_{i}")(
                    carry, *layer_inputs)
            x, layer_caches, _ = carry
        else:
            layers = nn.scan(
                block,
                variable_axes={"params": 0, "intermediates": 0},
                split_rngs={"params": True},
                in_axes=(nn.broadcast,) * len(layer_inputs) + (0,),
                length=cfg.n_layers,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )(cfg, name="layers")
            carry = (x, None if cache is None else cache.layers(), jnp.zeros((), jnp.int32))
            (x, layer_caches, _), _ = layers(carry, *layer_inputs, jnp.asarray(spec_of_layer, jnp.int32))

        if logits_index is not None:
            x = jnp.take_along_axis(x, logits_index[:, None, None].astype(jnp.int32), axis=1)  # [b, 1, e]
        x = RMSNorm(cfg, name="final_norm")(x)
        if cfg.tie_embeddings:
            head = embedding.T
        else:
            head = declare(self, "lm_head", (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), init, pdt)
        logits = jnp.einsum("bte,ev->btv", x, head.astype(cfg.dtype), preferred_element_type=jnp.float32)
        if cfg.final_softcap is not None:  # Gemma 2: logits -> cap * tanh(logits / cap)
            logits = cfg.final_softcap * jnp.tanh(logits / cfg.final_softcap)
        if cache is None:
            return logits
        return logits, cache.with_layers(layer_caches, cache.lengths + jnp.sum(ok, axis=1, dtype=jnp.int32))


def unroll_params(params: dict) -> dict:
    """Params for ``Decoder(config, unrolled=True)``: the stacked ``layers`` entry (leading axis = layer) split into
    ``layers_0 .. layers_{L-1}``, each its own arrays (a copy of the layer weights; placement is kept). Params already
    unrolled are returned as they are.

    Why: the scanned decoder reads layer i's weights by slicing the stacked arrays, which on XLA:CPU copies them
    every step - decoding one token then moves the layer weights twice. A matrix-vector product straight from its
    own buffer runs at the memory bandwidth (measured: 4 x [1024, 2752] float32, 21.8 GB/s from separate arrays,
    ~10 GB/s through a scan or fori_loop slice, 3 GB/s through static slices of the stacked array)."""
    if "layers" not in params:
        return params
    stacked = params["layers"]
    n = jax.tree.leaves(stacked)[0].shape[0]
    rest = {k: v for k, v in params.items() if k != "layers"}
    return {**rest, **{f"layers_{i}": jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(n)}}


def is_unrolled(params: dict) -> bool:
    return "layers" not in params and "layers_0" in params


def attention_inputs(config: ModelConfig, params, input_ids: jax.Array, rotated: bool = True
                     ) -> tuple[jax.Array, jax.Array]:
    """Queries ``[L, b, t, h, d]`` and keys ``[L, b, t, k, d]`` of every layer for a full forward pass at positions
    ``0``-``t-1``: what each layer's attention compared (``rotated``, by RoPE at the true positions) or the
    projections before RoPE. Routers and attention statistics are computed from them."""
    _, state = Decoder(config).apply({"params": params}, input_ids, mutable=["intermediates"])
    attn = state["intermediates"]["layers"]["attn"]
    q, k = attn["q"][0], attn["k"][0]
    if rotated:
        positions = jnp.broadcast_to(jnp.arange(input_ids.shape[1], dtype=jnp.int32), input_ids.shape)
        tables = spec_tables(config, positions)  # each layer rotates with its own spec's RoPE
        _, spec_of_layer = config.spec_table()
        q = jnp.stack([apply_rope(q[i], *tables[j]) for i, j in enumerate(spec_of_layer)])
        k = jnp.stack([apply_rope(k[i], *tables[j]) for i, j in enumerate(spec_of_layer)])
    return q, k


def init_params(config: ModelConfig, key: jax.Array) -> dict:
    """Random parameters as a plain nested dict (logical-axis metadata stripped)."""
    resolve_attention(config)  # an attention.impl this machine cannot run: a ConfigError here, not inside the trace
    ids = jnp.zeros((1, 1), jnp.int32)
    variables = jax.jit(Decoder(config).init)(key, ids)
    return nn.meta.unbox(variables["params"])


def abstract_params(config: ModelConfig) -> dict:
    """``jax.ShapeDtypeStruct`` tree of the parameters, without allocating them."""
    ids = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    boxed = jax.eval_shape(Decoder(config).init, jax.random.key(0), ids)["params"]
    return nn.meta.unbox(boxed)


def param_axes(config: ModelConfig) -> dict:
    """The logical axes of every parameter, as a tree of ``PartitionSpec`` of logical names."""
    ids = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    boxed = jax.eval_shape(Decoder(config).init, jax.random.key(0), ids)["params"]
    return nn.get_partition_spec(boxed)
