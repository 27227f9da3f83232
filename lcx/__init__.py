"""lcx: long-context decoding in JAX.

Packages, bottom up: ``kernels`` (attention kernels), ``model`` (the decoder), ``parallel`` (meshes, context
parallelism, multi-host, device memory), ``cache`` (KV caches and eviction policies), ``engine`` (compiled programs,
``Generator``, sampling, the server's batching core), ``checkpoints`` (HF directories, GGUF files, lcx runs), ``data``,
``train``, ``eval``, ``plan`` (the planner), ``cli``. ``lcx.load`` is the text-level entry point.
"""

import importlib.abc
import importlib.util
import sys
import warnings

from lcx import hf
from lcx.cache import CacheConfig
from lcx.config import AttentionConfig, Config, ConfigError, ModelConfig, RopeConfig, load_config
from lcx.engine import GenerateResult, Generator, generate
from lcx.engine.sampling import SamplingConfig
from lcx.engine.speculative import SpeculativeConfig
from lcx.model import Decoder, init_params
from lcx.parallel.sharding import MeshConfig, make_mesh

__version__ = "0.2.0.dev0"

# Modules that moved in 0.2 (CHANGELOG.md): importing the old path gives the new module, with a DeprecationWarning.
MOVED = {"lcx.sampling": "lcx.engine.sampling", "lcx.serve": "lcx.engine.server",
         "lcx.sharding": "lcx.parallel.sharding",
         "lcx.context_parallel": "lcx.parallel.context", "lcx.distributed": "lcx.parallel.distributed",
         "lcx.device_memory": "lcx.parallel.device_memory", "lcx.gguf": "lcx.checkpoints.gguf",
         "lcx.sources": "lcx.checkpoints.sources", "lcx.plan_train": "lcx.plan.training",
         "lcx.convert_cli": "lcx.cli.convert", "lcx.export_cli": "lcx.cli.export",
         "lcx.generate_cli": "lcx.cli.generate"}
# ``lcx.generate`` is the function; the module that held it is now ``lcx.engine`` and cannot be an alias (importing
# a module of that name would replace the function on the package).
GONE = {"lcx.generate": "lcx.engine (Generator, plan_capacity, pad_prompts, ...); lcx.generate is the function"}


class _Moved(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name in GONE:
            raise ModuleNotFoundError(f"the module {name} moved to {GONE[name]}", name=name)
        if name in MOVED:
            return importlib.util.spec_from_loader(name, self)
        return None

    def create_module(self, spec):
        warnings.warn(f"{spec.name} moved to {MOVED[spec.name]}; import that instead", DeprecationWarning,
                      stacklevel=3)
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module):
        pass  # the new module is already executed


if not any(isinstance(f, _Moved) for f in sys.meta_path):
    sys.meta_path.append(_Moved())


def __getattr__(name: str):
    if name == "load":  # the text-level API imports the tokenizers on first use only
        from lcx.lm import load

        return load
    raise AttributeError(f"module 'lcx' has no attribute {name!r}")


__all__ = ["AttentionConfig", "CacheConfig", "Config", "ConfigError", "Decoder", "GenerateResult", "Generator",
           "MeshConfig", "ModelConfig", "RopeConfig", "SamplingConfig", "SpeculativeConfig", "generate", "hf",
           "init_params", "load", "load_config", "make_mesh"]
