"""The model's configuration: ``ModelConfig`` (a decoder of one family), ``RopeConfig``, ``AttentionConfig`` and the
per-layer ``AttentionSpec`` derived from them.

Frozen dataclasses validated in ``__post_init__``: a bad value raises ``ConfigError`` naming the key, the value and
what is allowed, at load time. ``RopeConfig`` lives with the RoPE registry it is checked against
(``lcx.model.rope_scaling``, re-exported here), the family table in ``lcx.model.families``, attention
implementations' names in ``lcx.kernels.names``: adding any of them needs no change here, and none of them imports
this module.
"""

from __future__ import annotations

import dataclasses

from lcx.config_base import ConfigError, canonical_dtype, check, positive_int
from lcx.parallel.names import STRATEGIES
from lcx.kernels.names import IMPLS
from lcx.model.families import FAMILIES, Family, num_params
from lcx.model.rope_scaling import RopeConfig

FULL, SLIDING = "full_attention", "sliding_attention"
LAYER_TYPES = (FULL, SLIDING)  # transformers' names

# --------------------------------------------------------------------------------------------------- attention
@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Which attention implementation the model calls: a row of ``lcx.kernels.backends`` or ``auto`` (cuDNN and the
    compiled Pallas kernels on an NVIDIA GPU, the Pallas kernels on other GPUs, XLA elsewhere). Only the name is
    checked here; whether this machine can run it (``cudnn`` needs an NVIDIA GPU) is checked at setup
    (``lcx.model.attention_choice``): a config is read before JAX starts on multi-host runs. ``context_parallel``: how
    attention crosses a mesh's ``seq`` axis (``ring`` or ``all_gather``, ``lcx.parallel.context``); unused without
    one. Training sets it from ``train.context_parallel``."""

    impl: str = "auto"
    context_parallel: str = "ring"

    def __post_init__(self):
        check(self.impl in IMPLS, "attention.impl", self.impl, f"must be one of {list(IMPLS)}")
        check(self.context_parallel in STRATEGIES, "attention.context_parallel", self.context_parallel,
              f"must be one of {list(STRATEGIES)}")


# --------------------------------------------------------------------------------------------------- spec
@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """What one layer's attention computes, fixed for a run (hashable, static under jit): the kernels specialise on it.

    ``window``: a query sees the ``window`` most recent positions, its own included (None: every earlier one).
    ``softcap``: logits ``z`` (already scaled) become ``softcap * tanh(z / softcap)`` before the softmax (None: off).
    ``sm_scale``: the logit scale. ``rope``: the rotary embedding of this layer type.
    """

    layer_type: str = FULL
    window: int | None = None
    softcap: float | None = None
    sm_scale: float = 1.0
    rope: RopeConfig = dataclasses.field(default_factory=RopeConfig)


# --------------------------------------------------------------------------------------------------- model
# What a rematerialized layer keeps for the backward pass (the names of ``jax.checkpoint_policies``).
REMAT_POLICIES = {"full": "nothing_saveable", "dots": "dots_saveable",
                  "dots_no_batch": "dots_with_no_batch_dims_saveable"}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder of one ``family`` (``lcx.model.families``: llama, mistral, qwen2, qwen3, gemma2, gemma3).

    ``dtype`` is the compute dtype, ``param_dtype`` the storage dtype of the weights; softmax, norm statistics and
    logits are float32 regardless. ``remat``: recompute each layer in the backward pass, keeping what
    ``remat_policy`` saves: ``full`` (nothing but the layer's input), ``dots`` (matmul outputs), ``dots_no_batch``
    (matmul outputs without batch dimensions: the projections, not the attention scores).

    Attention per layer (as transformers): ``layer_types`` lists ``full_attention`` / ``sliding_attention`` per layer
    (None: all full); sliding layers see the ``sliding_window`` most recent positions and rotate with ``local_rope``
    (None: ``rope``). ``attn_softcap`` / ``final_softcap``: tanh soft-capping of attention logits / output logits;
    ``query_scale``: logits are scaled by ``query_scale ** -0.5`` (Gemma's ``query_pre_attn_scalar``; None: head_dim).
    """

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    head_dim: int | None = None
    max_position_embeddings: int = 4096
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    dtype: str = "float32"
    param_dtype: str = "float32"
    remat: bool = False
    remat_policy: str = "full"
    init_std: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    rope: RopeConfig = dataclasses.field(default_factory=RopeConfig)
    attention: AttentionConfig = dataclasses.field(default_factory=AttentionConfig)
    family: str = "llama"
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None
    local_rope: RopeConfig | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    query_scale: float | None = None

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff",
                     "max_position_embeddings"):
            value = getattr(self, name)
            check(isinstance(value, int) and value > 0, f"model.{name}", value, "must be a positive integer")
        check(self.family in FAMILIES, "model.family", self.family, f"must be one of {list(FAMILIES)}")
        divisors = [k for k in range(1, self.n_heads + 1) if self.n_heads % k == 0]
        check(self.remat_policy in REMAT_POLICIES, "model.remat_policy", self.remat_policy,
              f"must be one of {list(REMAT_POLICIES)}")
        check(self.n_heads % self.n_kv_heads == 0, "model.n_heads", self.n_heads,
              f"must be a multiple of model.n_kv_heads={self.n_kv_heads} (GQA groups must be whole); valid "
              f"n_kv_heads for {self.n_heads} heads: {divisors}")
        if self.head_dim is None:
            check(self.d_model % self.n_heads == 0, "model.d_model", self.d_model,
                   f"must be a multiple of model.n_heads={self.n_heads} when model.head_dim is not given")
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        check(isinstance(self.head_dim, int) and self.head_dim > 0 and self.head_dim % 2 == 0, "model.head_dim",
              self.head_dim, "must be a positive even integer (RoPE rotates pairs)")
        check(self.norm_eps > 0, "model.norm_eps", self.norm_eps, "must be > 0 (RMSNorm divides by it)")
        check(self.init_std > 0, "model.init_std", self.init_std, "must be > 0")
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype, "model.dtype"))
        object.__setattr__(self, "param_dtype", canonical_dtype(self.param_dtype, "model.param_dtype"))
        for rope in (self.rope, self.local_rope):
            if rope is None:
                continue
            rotary = int(self.head_dim * rope.partial_rotary_factor)
            check(rotary % 2 == 0 and rotary > 0, "rope.partial_rotary_factor", rope.partial_rotary_factor,
                  f"gives an odd or zero rotary dim {rotary} for head_dim={self.head_dim}")
            for name in ("short_factor", "long_factor"):
                value = getattr(rope, name)
                if value is not None and len(value) != rotary // 2:
                    raise ConfigError(f"rope.{name} has {len(value)} values; rope.type='longrope' needs rotary_dim/2 "
                                      f"= {rotary // 2} (one per frequency)")
        self._check_attention()

    def _check_attention(self):
        if self.layer_types is not None:
            types = tuple(self.layer_types)
            object.__setattr__(self, "layer_types", types)
            if len(types) != self.n_layers:
                raise ConfigError(f"model.layer_types has {len(types)} entries; model.n_layers={self.n_layers} needs "
                                  "one per layer")
            for i, t in enumerate(types):
                check(t in LAYER_TYPES, f"model.layer_types[{i}]", t, f"must be one of {list(LAYER_TYPES)}")
            if SLIDING in types and self.sliding_window is None:
                raise ConfigError(f"model.sliding_window is required: model.layer_types has {types.count(SLIDING)} "
                                  f"{SLIDING!r} layer(s) (a positive int: the positions each query sees)")
        if self.sliding_window is not None:
            check(positive_int(self.sliding_window), "model.sliding_window", self.sliding_window,
                  "must be a positive integer (positions a sliding-window query sees, its own included) or null")
        for name in ("attn_softcap", "final_softcap", "query_scale"):
            value = getattr(self, name)
            if value is not None:
                check(isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0, f"model.{name}",
                      value, "must be a positive number or null")
                object.__setattr__(self, name, float(value))

    @property
    def block(self) -> Family:
        """The family's block (norm style, activation, QK-norm, ...)."""
        return FAMILIES[self.family]

    @property
    def types(self) -> tuple[str, ...]:
        """Each layer's attention type."""
        return self.layer_types or (FULL,) * self.n_layers

    def attention_specs(self) -> tuple[AttentionSpec, ...]:
        """One ``AttentionSpec`` per layer."""
        scale = (self.query_scale or self.head_dim) ** -0.5
        local = AttentionSpec(SLIDING, self.sliding_window, self.attn_softcap, scale, self.local_rope or self.rope)
        full = AttentionSpec(FULL, None, self.attn_softcap, scale, self.rope)
        return tuple(local if t == SLIDING else full for t in self.types)

    def spec_table(self) -> tuple[tuple[AttentionSpec, ...], tuple[int, ...]]:
        """``(distinct specs in order of first use, each layer's index into them)``: layers with equal specs share
        one compiled attention."""
        specs = self.attention_specs()
        distinct = tuple(dict.fromkeys(specs))
        return distinct, tuple(distinct.index(s) for s in specs)

    @property
    def plain_attention(self) -> bool:
        """Every layer attends globally, uncapped, at scale head_dim ** -0.5 with ``rope``: what code written for
        Llama-style attention alone (the memory tier) may assume."""
        plain = AttentionSpec(FULL, None, None, self.head_dim ** -0.5, self.rope)
        return all(s == plain for s in self.attention_specs())

    @property
    def n_groups(self) -> int:
        """Query heads per KV head."""
        return self.n_heads // self.n_kv_heads

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rope.partial_rotary_factor)

    @property
    def original_max_position_embeddings(self) -> int:
        return self.rope.original_max_position_embeddings or self.max_position_embeddings

    def num_params(self) -> int:
        """Exact parameter count of this architecture (from the family's parameter table)."""
        return num_params(self)


__all__ = ["FULL", "LAYER_TYPES", "SLIDING", "AttentionConfig", "AttentionSpec", "ModelConfig", "RopeConfig"]
