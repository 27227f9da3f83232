"""Hugging Face and GGUF checkpoints, the public façade: ``lcx.hf.load_hf(path)``, ``lcx.hf.load_gguf(path)``,
``save_hf``, the config converters. The implementation lives in ``lcx.checkpoints`` (``hf``, ``gguf``)."""

from lcx.checkpoints.hf import (config_from_hf, config_to_hf, load_gguf, load_hf, read_hf_config, read_hf_params,
                                save_hf, with_dtype)

__all__ = ["config_from_hf", "config_to_hf", "load_gguf", "load_hf", "read_hf_config", "read_hf_params", "save_hf",
           "with_dtype"]


def __getattr__(name: str):
    # everything else of the implementation module (helpers tests and notebooks reach for) stays reachable here
    from lcx.checkpoints import hf as implementation

    return getattr(implementation, name)
