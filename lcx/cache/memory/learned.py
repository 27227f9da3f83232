"""Parameters of the learned memory router: their declaration in the cache state, and loading them by path.

Per layer: ``w_query [d, r]`` and ``w_block [3, d, r]`` project the pooled query and the block's (mean, min, max)
keys to a rank-``r`` space where their dot product scores the block; ``gate_w [d]``, ``gate_b`` decide whether to
recall at all. They are trained by distillation with the base model frozen (``lcx train-router CONFIG``,
``lcx.train.router``) and saved with orbax in a directory holding ``params/`` and ``router.json``.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np

from lcx.cache.schema import Field
from lcx.config_base import ConfigError

PARAM_NAMES = ("w_query", "w_block", "gate_w", "gate_b")


def param_fields() -> dict[str, Field]:
    return {"w_query": Field(("layers", "head_dim", "router_rank"), "float32"),
            "w_block": Field(("layers", "stats", "head_dim", "router_rank"), "float32"),
            "gate_w": Field(("layers", "head_dim"), "float32"),
            "gate_b": Field(("layers",), "float32")}


def meta(path: str | Path) -> dict:
    file = Path(path) / "router.json"
    if not file.is_file():
        raise ConfigError(f"cache.router_path={str(path)!r} holds no trained router (no router.json); train one with "
                          f"lcx train-router CONFIG")
    return json.loads(file.read_text())


def sizes(path: str | Path | None) -> dict[str, int]:
    """The ``router_rank`` axis of a trained router (empty without one)."""
    return {} if path is None else {"router_rank": int(meta(path)["rank"])}


@functools.lru_cache(maxsize=8)
def _load(path: str) -> dict[str, np.ndarray]:
    import orbax.checkpoint as ocp

    restored = ocp.StandardCheckpointer().restore(Path(path).absolute() / "params")
    return {name: np.asarray(restored[name], np.float32) for name in PARAM_NAMES}


def check(path: str | Path, model, positions: str) -> None:
    """``ConfigError`` unless ``path`` holds a router trained for ``model``'s shape and these positions."""
    info = meta(path)
    if info["n_layers"] != model.n_layers or info["head_dim"] != model.head_dim:
        raise ConfigError(f"cache.router_path={str(path)!r} was trained for {info['n_layers']} layers and head_dim "
                          f"{info['head_dim']}; this model has {model.n_layers} and {model.head_dim}")
    if info.get("positions", "original") != positions:
        raise ConfigError(f"cache.router_path={str(path)!r} was trained with positions={info.get('positions')!r}; "
                          f"cache.positions={positions!r} compares differently rotated keys: train it for these "
                          f"positions (router.positions)")


def load(path: str | Path, model) -> dict[str, np.ndarray]:
    """The router parameters saved under ``path`` (checked against ``model`` by :func:`check`)."""
    return _load(str(Path(path).absolute()))


def save(path: str | Path, params: dict, model, rank: int, extra: dict | None = None) -> None:
    """Write ``params`` (the four arrays, with a leading layer axis) and ``router.json``."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    path.mkdir(parents=True, exist_ok=True)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path / "params", {n: np.asarray(params[n]) for n in PARAM_NAMES}, force=True)
    checkpointer.wait_until_finished()
    info = {"n_layers": model.n_layers, "head_dim": model.head_dim, "rank": rank, **(extra or {})}
    (path / "router.json").write_text(json.dumps(info, indent=2))


__all__ = ["PARAM_NAMES", "check", "load", "meta", "param_fields", "save", "sizes"]
