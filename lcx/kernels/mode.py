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
- ``with lowering_for("gpu"):`` traces as a GPU process would on any host: inside it ``interpret=None`` compiles
  (Triton) and every platform choice lcx makes at trace time (``target_backend()``: ``attention.impl: auto``, the
  CPU-only upcasts and blocked paths) is the GPU's. With ``jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))``
  it builds the program a GPU would run - on a CPU machine, so CI catches a kernel Triton would refuse
  (``tests/kernels/test_cuda_lowering.py``).
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings
from collections.abc import Iterator
from typing import Any

import jax

_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("lcx_kernel_target", default=None)
PLATFORMS = ("cpu", "gpu", "tpu")


def target_backend() -> str:
    """The platform lcx traces for: ``jax.default_backend()``, or the one a ``lowering_for`` block names."""
    return _TARGET.get() or jax.default_backend()


@contextlib.contextmanager
def lowering_for(platform: str) -> Iterator[None]:
    """Trace for ``platform`` (``"gpu"``, ``"cpu"``, ``"tpu"``) whatever this process runs on; see the module
    docstring. Only tracing is affected: run the result where it was lowered for."""
    if platform not in PLATFORMS:
        raise ValueError(f"lowering_for platform={platform!r} is not known; allowed: {list(PLATFORMS)}")
    token = _TARGET.set(platform)
    try:
        yield
    finally:
        _TARGET.reset(token)


def resolve_interpret(interpret: bool | None) -> bool:
    """``True`` when kernels must run in the Pallas interpreter: explicitly asked, or no GPU backend."""
    if interpret is None:
        return target_backend() != "gpu"
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


__all__ = ["lowering_for", "pallas_call_kwargs", "resolve_interpret", "target_backend", "triton_compiler_params"]
