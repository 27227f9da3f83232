"""Which attention backend a run gets, checked and said once at setup: ``attention.impl`` resolved for this machine
(``lcx.kernels.resolve``) and, for ``cudnn``, which layers' ``causal`` cuDNN runs and why the others take Pallas.

Checked at setup (``lcx.engine.runner.build``, ``lcx.train.run_training``), not when the config loads: a config is
read before ``jax.distributed.initialize`` on multi-host runs, and ``lcx plan`` reads GPU configs on any machine -
asking JAX for its backend then would start it too early or refuse a plan.
"""

from __future__ import annotations

import logging

from lcx import kernels
from lcx.config_base import ConfigError
from lcx.kernels.cudnn import cudnn_refusal, device_head_dim_max
from lcx.model.config import ModelConfig

log = logging.getLogger("lcx")


def resolve_attention(config: ModelConfig) -> str:
    """The backend row ``config.attention.impl`` names here; ``ConfigError`` (naming what to use) when this machine
    cannot run it - e.g. ``cudnn`` without an NVIDIA GPU - before anything is traced."""
    try:
        return kernels.resolve(config.attention.impl)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _layers(indices: list[int]) -> str:
    return f"layer{'s' if len(indices) > 1 else ''} {', '.join(map(str, indices))}"


def attention_line(config: ModelConfig, resolved: str, *, packed: bool = False, head_dim_max: int = 256) -> str:
    """The log line of a run's attention: ``attention: auto -> cudnn (causal on cuDNN for ...; ...)``. Per layer
    when cuDNN runs some layers' ``causal`` and Pallas the others (a soft-capped layer, packed documents, float32)."""
    line = f"attention: {config.attention.impl} -> {resolved}"
    if resolved != "cudnn":
        return line
    specs, index = config.spec_table()
    why = [cudnn_refusal(spec, config.dtype, config.head_dim, packed=packed, head_dim_max=head_dim_max)
           for spec in specs]
    on_cudnn = [i for i, j in enumerate(index) if why[j] is None]
    if len(on_cudnn) == len(index):
        causal = f"causal on cuDNN for all {len(index)} layers"
    else:
        refusals = {}  # reason -> layers, in order of first use
        for i, j in enumerate(index):
            if why[j] is not None:
                refusals.setdefault(why[j], []).append(i)
        pallas = "; ".join(f"{_layers(ids) if on_cudnn else f'all {len(ids)} layers'}: {reason}"
                           for reason, ids in refusals.items())
        causal = (f"causal on cuDNN for {_layers(on_cudnn)}, on Pallas for {pallas}" if on_cudnn
                  else f"causal on Pallas for {pallas}")
    return f"{line} ({causal}; chunk/decode/statistics on Pallas)"


def announce_attention(config: ModelConfig, *, packed: bool = False) -> str:
    """Resolve ``config.attention.impl`` here (``resolve_attention``), log its line at INFO and return it."""
    resolved = resolve_attention(config)
    head_dim_max = device_head_dim_max() if resolved == "cudnn" else 256
    line = attention_line(config, resolved, packed=packed, head_dim_max=head_dim_max)
    log.info(line)
    return line


__all__ = ["announce_attention", "attention_line", "resolve_attention"]
