"""``causal`` on cuDNN: lcx's whole-sequence attention contract mapped onto ``jax.nn.dot_product_attention``.

Einsum legend: b batch, t positions, h query heads, k kv heads, d head dim.

The contract (``lcx.kernels.backends``): ``q [b, t, h, d]``, ``k, v [b, t, k, d]``, ``sm_scale``, ``window`` (a query
sees the ``window`` most recent positions, its own included), ``softcap``, ``segment_ids [b, t]`` (packed documents).
How each maps (as jax 0.10.2's ``jax.nn.dot_product_attention`` and ``jax/_src/cudnn/fused_attention_stablehlo.py``
read them):

- causal -> ``is_causal=True`` (cuDNN's ``CAUSAL`` mask type: the upper triangle is never computed).
- GQA -> nothing: ``dot_product_attention`` takes ``k`` KV heads for ``h`` query heads when ``k`` divides ``h`` and
  cuDNN reads KV head ``h // (h / k)`` in place, lcx's order.
- ``window`` -> ``local_window_size=(window - 1, 0)``: with a causal mask jax hands cuDNN
  ``sliding_window_length = left + 1 = window``, which keeps keys in ``(pos - window, pos]``: the same set.
- ``sm_scale`` -> ``scale``.
- ``softcap``: no argument expresses ``c * tanh(z / c)`` -> the Pallas flash kernel.
- packed documents: ``query_seq_lengths`` / ``key_value_seq_lengths`` express one left-aligned document per row, not
  several; cuDNN's own segment offsets (``q_offsets`` / ``kv_offsets``) are not reachable through
  ``jax.nn.dot_product_attention``. A boolean ``mask`` is exact, but jax turns it into a dense additive bias
  ``[b, 1, t, t]`` (``combine_bias_and_mask``) and always exports that bias's gradient (``should_export_dbias``
  returns True): two ``t x t`` arrays per layer, what a long-context flash path exists to avoid (training with a bias
  also needs even ``t``, ``check_is_flash_attention``). So packed documents -> the Pallas flash kernel, whose
  segment ids cost ``O(t)``.
- dtypes: cuDNN takes float16 / bfloat16 (``check_layout``; fp8 is a separate API) -> float32 takes Pallas.
- head_dim: a multiple of 8, at most 256 on compute capability >= 9.0 (Hopper) and 128 before
  (``check_is_flash_attention``).

Lowering for CUDA on a CPU-only machine (``jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))``) stops in
``check_cudnn_version`` (``jax/_src/cudnn/fused_attention_stablehlo.py``), called by that module's
``dot_product_attention`` at trace time: ``jax._src.lib.cuda_versions`` is None without the CUDA plugin, so it raises
``RuntimeError("cuDNN is not detected.")``. With that one check answered, the same trace lowers to the
``__cudnn$fmhaSoftmax`` custom call (and ``__cudnn$fmhaSoftmaxBackward`` under ``jax.grad``) -
``tests/kernels/test_cudnn_backend.py`` checks it so. Its head-dim check reads the device's compute capability
(``check_compute_capability``), so on a CPU it allows only head_dim <= 128.
"""

from __future__ import annotations

import jax
import jax.extend.backend
import jax.numpy as jnp

from lcx.kernels.flash import flash_attention

CUDNN_DTYPES = ("bfloat16", "float16")
HEAD_DIM_MULTIPLE = 8
HOPPER = (9, 0)
MAX_HEAD_DIM = {True: 256, False: 128}  # Hopper or later -> largest head_dim cuDNN's flash attention takes


def cudnn_arguments(*, sm_scale: float, window: int | None = None) -> dict:
    """The ``jax.nn.dot_product_attention`` keywords of lcx's causal contract (see the module docstring)."""
    if window is not None and window < 1:
        raise ValueError(f"window={window!r} is invalid: a query sees at least itself (window >= 1) or None")
    args = {"is_causal": True, "scale": sm_scale}
    if window is not None:
        args["local_window_size"] = (window - 1, 0)  # keys pos - window + 1 .. pos, the query's own included
    return args


def max_head_dim(compute_capability: str | None) -> int:
    """cuDNN's largest head_dim on a device of ``compute_capability`` (``"9.0"``; None: unknown, jax's CPU answer)."""
    if compute_capability is None:
        return MAX_HEAD_DIM[False]
    return MAX_HEAD_DIM[tuple(int(x) for x in compute_capability.split(".")[:2]) >= HOPPER]


def cudnn_refusal(settings, dtype, head_dim: int, *, packed: bool = False, head_dim_max: int = 256) -> str | None:
    """Why cuDNN cannot run a layer's ``causal`` (None: it can). ``settings``: an ``AttentionSpec`` or the keywords
    of ``spec_kwargs`` (``softcap``, ``window``); ``packed``: the call has ``segment_ids``."""
    softcap = settings.get("softcap") if isinstance(settings, dict) else getattr(settings, "softcap", None)
    if softcap is not None:
        return f"soft-cap {softcap} (no jax.nn.dot_product_attention argument expresses it)"
    if packed:
        return "packed documents (a cuDNN mask is a dense t x t bias)"
    name = jnp.dtype(dtype).name
    if name not in CUDNN_DTYPES:
        return f"{name} (cuDNN takes {' / '.join(CUDNN_DTYPES)})"
    if head_dim % HEAD_DIM_MULTIPLE or head_dim > head_dim_max:
        return f"head_dim {head_dim} (cuDNN takes multiples of {HEAD_DIM_MULTIPLE} up to {head_dim_max} here)"
    return None


def cudnn_supports(settings, dtype, head_dim: int, *, packed: bool = False, head_dim_max: int = 256) -> bool:
    """Whether cuDNN runs a layer's ``causal`` (``cudnn_refusal`` says why not)."""
    return cudnn_refusal(settings, dtype, head_dim, packed=packed, head_dim_max=head_dim_max) is None


def cuda_gpu() -> bool:
    """Whether JAX runs on an NVIDIA GPU: the test jax's own cuDNN checks make (the platform version names CUDA;
    a ROCm GPU is also ``gpu`` but has no cuDNN)."""
    if jax.default_backend() != "gpu":
        return False
    return "cuda" in jax.extend.backend.get_backend().platform_version.lower()


def require_cuda(impl: str = "cudnn") -> None:
    """``ValueError`` naming what to use instead unless JAX runs on an NVIDIA GPU (cuDNN needs one)."""
    if not cuda_gpu():
        here = "pallas" if jax.default_backend() == "gpu" else "xla"
        raise ValueError(f"attention.impl={impl!r} needs an NVIDIA GPU (cuDNN); this machine's JAX backend is "
                         f"{jax.default_backend()!r}: use attention.impl='auto' (here: {here!r}) or 'xla'"
                         + (" or 'pallas'" if here == "pallas" else ""))


def device_head_dim_max() -> int:
    """cuDNN's largest head_dim on this process's first device (128 off a CUDA GPU, as jax's check answers)."""
    return max_head_dim(getattr(jax.devices()[0], "compute_capability", None) if cuda_gpu() else None)


def cudnn_causal(q: jax.Array, k: jax.Array, v: jax.Array, *, sm_scale: float, segment_ids: jax.Array | None = None,
                 window: int | None = None, softcap: float | None = None, implementation: str = "cudnn") -> jax.Array:
    """``causal`` through ``jax.nn.dot_product_attention(implementation=...)`` where cuDNN can run it, the Pallas flash
    kernel where it cannot (soft-cap, packed documents, float32, head_dim; decided at trace time). ``implementation``
    is ``"cudnn"`` in the backend table; tests run the same mapping with ``"xla"`` on a CPU."""
    if implementation == "cudnn":
        require_cuda()  # a clear refusal before jax's "cuDNN is not detected"
    if window is not None and window >= q.shape[1]:
        window = None  # a window that covers the sequence is plain causal: cuDNN skips its window arithmetic
    settings = {"softcap": softcap, "window": window}
    # XLA's implementation has no head-dim limit: a test of the mapping checks it at Hopper's
    limit = device_head_dim_max() if implementation == "cudnn" else MAX_HEAD_DIM[True]
    if not cudnn_supports(settings, q.dtype, q.shape[-1], packed=segment_ids is not None, head_dim_max=limit):
        return flash_attention(q, k, v, causal=True, sm_scale=sm_scale, segment_ids=segment_ids, window=window,
                               softcap=softcap)
    return jax.nn.dot_product_attention(q, k, v, **cudnn_arguments(sm_scale=sm_scale, window=window),
                                        implementation=implementation)


__all__ = ["cuda_gpu", "cudnn_arguments", "cudnn_causal", "cudnn_refusal", "cudnn_supports", "max_head_dim",
           "require_cuda"]
