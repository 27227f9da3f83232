"""KV storage formats: how a cache holds keys and values (``lcx.cache.storage.base.KVStorage``).

``FORMATS`` maps every ``cache.kv_dtype`` a user writes to its class; ``storage_for`` builds the one of a
``CacheConfig`` (None: keys and values in the cache's float dtype). A new format is one module with its class (and
its tests) plus its line here.
"""

from __future__ import annotations

from lcx.cache.storage.base import KVStorage, namespace
from lcx.cache.storage.fp4 import Fp4Storage
from lcx.cache.storage.packed import PackedStorage
from lcx.cache.storage.scaled import ScaledStorage
from lcx.cache.storage.views import FloatKV, PackedKV, ScaledKV
from lcx.config_base import ConfigError, canonical_dtype, check

FORMATS: dict[str, type[KVStorage]] = {
    "int8": ScaledStorage,
    "fp8": ScaledStorage,
    "int4": PackedStorage,
    "int2": PackedStorage,
    "fp4": Fp4Storage,
}


def check_name(kv_dtype: str | None) -> None:
    """A ``ConfigError`` naming ``cache.kv_dtype`` and every format unless it is one (or None: floats)."""
    check(kv_dtype is None or kv_dtype in FORMATS, "cache.kv_dtype", kv_dtype,
          f"must be one of {list(FORMATS)} or null (keys and values in cache.dtype)")


def storage_for(kv_dtype: str | None, dtype: str, group: int = 64, residual: int = 0) -> KVStorage:
    """The storage of ``cache.kv_dtype`` (None: floats in ``dtype``), with ``cache.kv_group`` / ``kv_residual``."""
    if kv_dtype is None:
        return KVStorage(dtype=dtype)
    if kv_dtype not in FORMATS:
        raise ValueError(f"kv_dtype={kv_dtype!r} is not a storage format; known: {list(FORMATS)}")
    return FORMATS[kv_dtype].from_settings(kv_dtype, dtype, group, residual)


def storage_named(name: str | None, dtype: str, flag: str = "cache.kv_dtype") -> KVStorage:
    """The storage a KV dtype names - a format of :data:`FORMATS`, or a float dtype (None: ``dtype``) for floats -
    as ``lcx plan --kv-dtype`` takes it; a ``ConfigError`` naming ``flag`` and every allowed name otherwise."""
    if name in FORMATS:
        return storage_for(name, canonical_dtype(dtype, "model.dtype"))
    try:
        return KVStorage(dtype=canonical_dtype(name or dtype, flag))
    except ConfigError as err:
        raise ConfigError(f"{err}, or quantized codes {list(FORMATS)}") from None


def storage_of(cache, dtype: str) -> KVStorage:
    """The storage a ``CacheConfig`` asks for, its floats in ``dtype``."""
    return storage_for(cache.kv_dtype, dtype, cache.kv_group, cache.kv_residual)


__all__ = ["FORMATS", "FloatKV", "Fp4Storage", "KVStorage", "PackedKV", "PackedStorage", "ScaledKV", "ScaledStorage",
           "check_name", "namespace", "storage_for", "storage_named", "storage_of"]
