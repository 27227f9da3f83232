"""Parameter declaration: every weight is declared once with its shape, logical axes and initializer.

``declare`` wraps Flax's ``Module.param`` with logical partitioning metadata, so ``init`` yields the values,
``jax.eval_shape`` the abstract shapes and ``nn.get_partition_spec`` the logical axes - all from one line per
parameter. Logical axis names: "vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "norm", and "layers" for
the stacked layer dimension added by ``nn.scan``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

LOGICAL_AXES = ("vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "norm", "layers")


def declare(module: nn.Module, name: str, shape: Sequence[int], axes: Sequence[str],
            init: Callable, dtype) -> jax.Array:
    """Declare parameter ``name`` of ``module``; returns its value (unboxed)."""
    if len(shape) != len(axes):
        raise ValueError(f"parameter {name!r}: {shape=} and {axes=} must have the same rank")
    unknown = [a for a in axes if a not in LOGICAL_AXES]
    if unknown:
        raise ValueError(f"parameter {name!r}: unknown logical axes {unknown}; allowed: {list(LOGICAL_AXES)}")
    return module.param(name, nn.with_logical_partitioning(init, tuple(axes)), tuple(shape), dtype)


def normal(std: float) -> Callable:
    return nn.initializers.normal(stddev=std)


zeros = nn.initializers.zeros
ones = nn.initializers.ones


def as_dtype(name: str):
    return jnp.dtype(name)
