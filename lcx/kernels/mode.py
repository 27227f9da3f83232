"""The one place that decides how a Pallas kernel runs: interpreted (CPU, CI) or compiled with Triton (GPU).

Every ``pallas_call`` in ``lcx.kernels`` takes its ``interpret=`` and ``compiler_params=`` from
:func:`pallas_call_kwargs`, so the choice cannot drift between kernels.

- ``interpret=None`` (the default everywhere) means: compiled when ``jax.default_backend() == "gpu"``, interpreted
  otherwise. On CPU there is no other choice: a compiled ``pallas_call`` has no CPU lowering.
- Compiled kernels get the Triton ``CompilerParams`` explicitly. Since jax 0.9 a ``pallas_call`` without compiler
  params lowers to Mosaic GPU, whose ``pallas_call`` path is deprecated and needs different kernels; the Triton
  backend is deprecated from jax 0.11 but still present, and it is the one these kernels are written for.
- Interpreted kernels get ``compiler_params=None``: the interpreter ignores them, and not importing the Triton module
  keeps CPU runs independent of its deprecation.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax


def resolve_interpret(interpret: bool | None) -> bool:
    """``True`` when kernels must run in the Pallas interpreter: explicitly asked, or no GPU backend."""
    if interpret is None:
        return jax.default_backend() != "gpu"
    if not isinstance(interpret, bool):
        raise ValueError(f"{interpret=} must be None, True or False")
    return interpret


def triton_compiler_params(*, num_warps: int, num_stages: int) -> Any:
    """``jax.experimental.pallas.triton.CompilerParams`` with the given launch settings."""
    if num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"{num_warps=} must be one of 1, 2, 4, 8, 16")
    if num_stages < 1:
        raise ValueError(f"{num_stages=} must be >= 1")
    with warnings.catch_warnings():
        # jax >= 0.11 flags the Triton backend as deprecated; it is still the backend these kernels target.
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas import triton as pltriton
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def pallas_call_kwargs(interpret: bool | None, *, num_warps: int, num_stages: int) -> dict[str, Any]:
    """Keyword arguments ``interpret`` and ``compiler_params`` for ``pl.pallas_call``."""
    if resolve_interpret(interpret):
        return {"interpret": True, "compiler_params": None}
    return {"interpret": False,
            "compiler_params": triton_compiler_params(num_warps=num_warps, num_stages=num_stages)}


__all__ = ["pallas_call_kwargs", "resolve_interpret", "triton_compiler_params"]
