"""Config plumbing shared by every layer of lcx: the error type, dtype tables, dict <-> frozen dataclass conversion,
YAML loading with dotted ``key=value`` overrides, plugin imports, and byte formatting.

This module is the ground floor: it imports nothing from lcx, so every other module (kernels, cache, model, the
planner) may use it without creating an import cycle. OmegaConf does the parsing (YAML, dotlists, interpolation);
``from_dict`` turns the resulting plain dict into frozen dataclasses, so that a bad value fails once, at load time,
with one message naming the key, the value and what is allowed - never deep inside a traced function.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range."""


# --------------------------------------------------------------------------------------------------- dtypes
_DTYPES = {
    "float32": "float32", "fp32": "float32", "f32": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "f16": "float16",
}
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def canonical_dtype(name: str, key: str = "dtype") -> str:
    """The canonical dtype name (``float32``, ``bfloat16``, ``float16``) of ``name``, or ``ConfigError`` naming
    ``key``."""
    if not isinstance(name, str) or name.lower() not in _DTYPES:
        raise ConfigError(f"{key}={name!r} is not a dtype lcx supports; allowed: {sorted(set(_DTYPES))}")
    return _DTYPES[name.lower()]


def dtype_bytes(name: str) -> int:
    """Bytes per element of a floating dtype lcx supports."""
    return _ITEMSIZE[canonical_dtype(name)]


def check(cond: bool, key: str, value: Any, allowed: str) -> None:
    """Raise ``ConfigError("key=value is invalid: allowed")`` unless ``cond``."""
    if not cond:
        raise ConfigError(f"{key}={value!r} is invalid: {allowed}")


def positive_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value > 0


# --------------------------------------------------------------------------------------------------- bytes
_UNITS = {  # lower-cased unit -> bytes; decimal (KB) and binary (KiB) both, as drive and GPU vendors mix them
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_BINARY = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def format_bytes(n: int | float) -> str:
    """Binary units with two decimals: ``format_bytes(2 * 1024**3) == "2.00 GiB"``; below 1 KiB, whole bytes."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in _BINARY:
        if n >= size:
            return f"{sign}{n / size:.2f} {unit}"
    return f"{sign}{int(n)} B"


def parse_bytes(text: str | int, name: str = "--gpu-mem") -> int:
    """``"80GiB"`` -> 85899345920. Accepts B, KB/MB/GB/TB (powers of 10), KiB/MiB/GiB/TiB (powers of 2), any case,
    an optional space and a decimal number; a plain integer is bytes. Raises ``ConfigError`` naming ``name``."""
    allowed = ("expected a positive number with a unit B, KB, MB, GB, TB, KiB, MiB, GiB, TiB (e.g. 80GiB) "
               "or a plain number of bytes")
    if isinstance(text, bool):
        raise ConfigError(f"{name}={text!r} is invalid: {allowed}")
    if isinstance(text, int):
        value, unit = float(text), "b"
    else:
        match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*", str(text))
        if not match:
            raise ConfigError(f"{name}={text!r} is invalid: {allowed}")
        value, unit = float(match.group(1)), (match.group(2).lower() or "b")
        if unit not in _UNITS:
            raise ConfigError(f"{name}={text!r} is invalid: unknown unit {match.group(2)!r}; {allowed}")
    n = int(value * _UNITS[unit])
    if n <= 0:
        raise ConfigError(f"{name}={text!r} is invalid: {allowed}")
    return n


# --------------------------------------------------------------------------------------------------- dataclasses
def _unwrap_optional(tp):
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def coerce(value: Any, tp: Any, key: str) -> Any:
    """``value`` converted to type ``tp`` (dataclasses recursively), or ``ConfigError`` naming ``key``."""
    tp, optional = _unwrap_optional(tp)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{key}=None is invalid: a value of type {getattr(tp, '__name__', tp)} is required")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if hasattr(tp, "from_mapping"):
            if not isinstance(value, Mapping):
                raise ConfigError(f"{key}={value!r} is invalid: must be a mapping")
            return tp.from_mapping(value, prefix=key)
        return from_dict(tp, value, prefix=key)
    if tp is bool:
        if isinstance(value, (bool, np.bool_)):
            return bool(value)
        raise ConfigError(f"{key}={value!r} is invalid: must be true or false" + (" or null" if optional else ""))
    if tp is int:
        if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
            return int(value)
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{key}={value!r} is invalid: must be an integer")
    if tp is float:
        if isinstance(value, (int, float, np.number)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{key}={value!r} is invalid: must be a number")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}={value!r} is invalid: must be a string")
    origin = typing.get_origin(tp)
    if origin in (tuple, list, Sequence):
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            raise ConfigError(f"{key}={value!r} is invalid: must be a list")
        (item_tp, *_rest) = typing.get_args(tp) or (Any,)
        return tuple(coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value))
    return value


def unknown_key(key: str, full: str, allowed: Sequence[str]) -> ConfigError:
    """The error for a key that is not a field: with a did-you-mean when one is close."""
    close = difflib.get_close_matches(str(key), list(allowed), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return ConfigError(f"unknown key {full!r}{hint} (allowed: {sorted(allowed)})")


def run_attribute(default: Any, *, compare: bool = True) -> Any:
    """A dataclass field that is not a config key: set by the code that builds the object (a task's tokenizer),
    never read from a config mapping (``from_dict`` treats it as unknown), left out of ``to_dict``, and - unlike an
    attribute set on the instance - kept by ``dataclasses.replace`` and ``copy``. Keyword-only, so a base class can
    declare it before its subclasses' parameters."""
    return dataclasses.field(default=default, kw_only=True, repr=False, compare=compare,
                             metadata={"run_attribute": True})


def config_fields(cls) -> list[dataclasses.Field]:
    """The fields of dataclass ``cls`` (or an instance) a config mapping may set: not its ``run_attribute`` ones."""
    return [f for f in dataclasses.fields(cls) if f.init and not f.metadata.get("run_attribute")]


def from_dict(cls, data: Mapping[str, Any] | None, prefix: str = "", attributes: Mapping[str, Any] | None = None):
    """Build dataclass ``cls`` from a plain mapping, rejecting unknown keys with a did-you-mean. ``attributes``:
    fields the caller sets itself, already typed - its ``run_attribute`` fields, or a field it converted (a task's
    parameters) - passed to the constructor with the rest."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{prefix or cls.__name__}={data!r} is invalid: must be a mapping of {cls.__name__} fields")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in config_fields(cls)}
    kwargs = dict(attributes or {})
    for key, value in data.items():
        full = f"{prefix}.{key}" if prefix else str(key)
        if key not in fields:
            raise unknown_key(key, full, list(fields))
        kwargs[key] = coerce(value, hints[key], full)
    missing = [n for n, f in fields.items() if n not in kwargs and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{prefix or cls.__name__} is missing required key(s) {missing}")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{prefix or cls.__name__}: {err}") from err


def to_dict(obj) -> dict[str, Any]:
    """Plain nested dict of a config dataclass (tuples become lists), suitable for YAML or JSON."""

    def plain(v):
        if hasattr(v, "to_dict"):
            return plain(v.to_dict())
        if dataclasses.is_dataclass(v):
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)
                    if not f.metadata.get("run_attribute")}
        if isinstance(v, tuple):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v

    return plain(obj)


# --------------------------------------------------------------------------------------------------- files
def load_dict(path: str | Path | None = None, overrides: Sequence[str] = (), base: Mapping | None = None
              ) -> dict[str, Any]:
    """A YAML file (or ``base``, or nothing) with dotted ``key=value`` overrides applied; returns a plain dict."""
    import yaml
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    where = str(path) if path is not None else "<config>"
    try:
        if path is not None:
            doc = OmegaConf.load(str(path))
        else:
            doc = OmegaConf.create(dict(base or {}))
    except FileNotFoundError as err:
        raise ConfigError(f"config file {where!r} does not exist") from err
    except IsADirectoryError as err:
        raise ConfigError(f"config file {where!r} is a directory, not a YAML file") from err
    except (OmegaConfBaseException, yaml.YAMLError, UnicodeDecodeError) as err:
        raise ConfigError(f"config file {where!r} could not be parsed: {err}") from err
    if path is not None and not OmegaConf.is_dict(doc):
        raise ConfigError(f"config file {where!r} must hold a mapping of sections (model:, cache:, ...) at the top "
                          f"level, not a {type(OmegaConf.to_container(doc)).__name__}")
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is invalid: overrides are dotted key=value pairs, "
                              f"e.g. model.rope.type=yarn")
    try:
        merged = OmegaConf.merge(doc, OmegaConf.from_dotlist(list(overrides)))
        return OmegaConf.to_container(merged, resolve=True)
    except OmegaConfBaseException as err:
        raise ConfigError(f"config {where!r} with overrides {list(overrides)}: {err}") from err


def name_registry(table: dict[str, type], what: str) -> Callable[[type], type]:
    """A class decorator that files a class under its ``name`` attribute in ``table`` (policies, cache types,
    routers, tasks): a missing name or a second class under a taken name is a ``TypeError`` at import."""
    def register(cls: type) -> type:
        if not getattr(cls, "name", None):
            raise TypeError(f"{cls.__name__} needs a class attribute name")
        if cls.name in table and table[cls.name] is not cls:
            raise TypeError(f"a {what} named {cls.name!r} is already registered ({table[cls.name]})")
        table[cls.name] = cls
        return cls

    return register


def import_plugins(modules: Sequence[str]) -> None:
    """Import the modules a config lists under ``plugins`` (custom eviction policies register themselves)."""
    import importlib

    if isinstance(modules, str) or not isinstance(modules, Sequence):
        raise ConfigError(f"plugins={modules!r} is invalid: must be a list of module names")
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as err:
            raise ConfigError(f"plugins: module {name!r} could not be imported: {err}") from err


__all__ = ["ConfigError", "canonical_dtype", "check", "coerce", "config_fields", "dtype_bytes", "format_bytes",
           "from_dict", "import_plugins", "load_dict", "parse_bytes", "positive_int", "run_attribute", "to_dict",
           "unknown_key"]
