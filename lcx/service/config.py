"""``ServeConfig``: everything ``lcx serve`` is started with, checked at start (one error naming the flag, the value
and what is allowed), and ``build``: the model, the cache, the pool, the store and the engine it describes."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

from lcx.config_base import ConfigError
from lcx.engine import setup as defaults

DEFAULT_MAX_TOKENS = 256  # a chat request without max_tokens: at most this many, never past the context


def _flag(default, help: str | None = None, *, metavar: str | None = None, type=None, size: bool = False,
          flag: str | None = None, group: str | None = None):
    """A ``ServeConfig`` field and, with ``help``, its ``lcx serve`` flag (``--`` + the field's name with dashes, or
    ``flag``): ``{default}`` in ``help`` is the field's default as a user writes it; ``size``: given as a byte size
    (512MiB); ``group``: flags of one mutually exclusive group."""
    meta = {"help": help, "metavar": metavar, "type": type, "size": size, "flag": flag, "group": group}
    return dataclasses.field(default=default, metadata=meta if help is not None else {})


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """``lcx serve``'s options: each field with a ``help`` is the flag of the same name (``add_flags``), its default
    and help declared once here. ``kv_memory``: the KV budget in bytes; else ``gpu_memory_utilization`` of the
    device's free memory after the weights; else every row at its largest. ``cache_params``: the policy's parameters
    (``--cache-param key=value``). ``kv_store``: a directory for pages that survive restarts (None: host memory
    only). ``idempotency_ttl``: seconds a key is remembered; ``max_connections`` / ``header_timeout``: open
    connections at most, seconds for a request head to arrive (``lcx.service.run``); ``warmup``: prompt lengths
    whose programs are compiled before serving (``lcx.service.warmup``). ``resolve`` turns it into the one
    ``ServeSetup`` the server runs."""

    model: str = _flag(dataclasses.MISSING, "an HF directory, a .gguf file or an lcx run", metavar="MODEL")
    host: str = _flag("127.0.0.1", "address to listen on (default {default})")
    port: int = _flag(8000, "port (default {default})")
    max_num_seqs: int = _flag(defaults.MAX_NUM_SEQS, "sequences decoded together (default {default})")
    max_model_len: int = _flag(defaults.MAX_LEN, "most tokens (prompt + new) of one request (default {default})")
    page_size: int = _flag(16, "tokens per KV page (default {default})")
    kv_memory: int | None = _flag(None, "KV pool size, e.g. 512MiB", metavar="SIZE", size=True, group="budget")
    gpu_memory_utilization: float | None = _flag(
        None, "size the KV pool at F of the device's free memory less the weights (default: every sequence at "
        "--max-model-len)", metavar="F", type=float, group="budget")
    cache_policy: str = _flag("full", "eviction policy on pages (default {default})", metavar="NAME")
    cache_params: tuple[tuple[str, Any], ...] = _flag(
        (), "a cache setting or policy parameter (repeatable), e.g. budget=1024", metavar="KEY=VALUE",
        flag="--cache-param")
    kv_dtype: str | None = _flag(
        None, "int8 / fp8: 8-bit KV codes; int4 / int2: bit-packed codes in groups (--page-size a multiple of "
        "--cache-param kv_group=, default 64; kv_residual= keeps the most recent tokens in float); fp4: e2m1 codes "
        "with a float16 scale per 16 values (default: the model's dtype)")
    kv_store: str | None = _flag(
        None, "keep prompt pages (full) or each finished request's compressed state (an evicting policy but kvzip: "
        "its next turn continues it) on disk here: they survive restarts", metavar="DIR")
    kv_store_bytes: int = _flag(16 << 30, "disk bound of --kv-store (default {default}; least recently used pages "
                                "go first)", metavar="SIZE", size=True, flag="--kv-store-size")
    host_store_bytes: int = 2 << 30
    api_key: str | None = _flag(None, "require 'Authorization: Bearer KEY' on every path but /health and /metrics")
    served_model_name: str | None = _flag(None, "the model's name in requests (default: MODEL's file or directory "
                                          "name)")
    segment: int = _flag(defaults.SEGMENT, "decode steps between admissions (default {default})")
    prefill_chunk: int = _flag(defaults.PREFILL_CHUNK, "prompt tokens per sequence and step (default {default})")
    prefix_entries: int = defaults.PREFIX_ENTRIES
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    idempotency_ttl: float = 600.0
    max_body_bytes: int = _flag(32 << 20, "largest request body; larger ones get 413 unread (default {default})",
                                metavar="SIZE", size=True)
    max_connections: int = _flag(1024, "open connections at most; more are closed at once (default {default})")
    header_timeout: float = _flag(10.0, "seconds for a request head to arrive before the connection is closed "
                                  "(default {default})")
    warmup: str | None = _flag(
        None, "before accepting connections, run dummy chats of these prompt lengths (sharing the chat template's "
        "opening, or their first SHARED_TOKENS) at every concurrency up to --max-num-seqs, so the programs they use "
        "are compiled and the first requests pay no compile (default: none; minutes on a CPU, printed)",
        metavar="PROMPT_TOKENS[:NEW_TOKENS][@SHARED_TOKENS],...")
    speculative_draft: str | None = _flag(
        None, "decode every request speculatively: draft with this cache policy (e.g. streaming, snapkv; full with "
        "--speculative-param kv_dtype=int8 for 8-bit codes) and verify against the full cache; every sequence then "
        "reserves --max-model-len slots (no pages, kept prefixes or store; default: off)", metavar="POLICY")
    speculative_params: tuple[tuple[str, Any], ...] = _flag(
        (), "a draft cache setting or policy parameter (repeatable), e.g. budget=256", metavar="KEY=VALUE",
        flag="--speculative-param")
    speculative_k: int = _flag(4, "draft tokens per verification (default {default})")
    speculative_confidence: float | None = _flag(
        None, "adaptive k: a sequence stops drafting once the draft gives its last token a probability below P "
        "(default: always --speculative-k)", metavar="P", type=float)
    dtype: str | None = _flag(None, "parameter / compute dtype (default: the checkpoint's)")
    tensor_parallel_size: int = _flag(
        1, "devices the weights and the KV pool are split over, by KV head (the model axis; default {default})")
    data_parallel_size: int = _flag(
        1, "replicas, each on its own --tensor-parallel-size devices with a KV pool of its own; a request goes to "
        "the one holding its prompt's pages, else the least loaded (default {default})")

    def __post_init__(self):
        for flag, value in (("--port", self.port), ("--max-num-seqs", self.max_num_seqs),
                            ("--max-model-len", self.max_model_len), ("--page-size", self.page_size),
                            ("--segment", self.segment), ("--prefill-chunk", self.prefill_chunk),
                            ("--default-max-tokens", self.default_max_tokens),
                            ("--max-body-bytes", self.max_body_bytes), ("--max-connections", self.max_connections),
                            ("--tensor-parallel-size", self.tensor_parallel_size),
                            ("--speculative-k", self.speculative_k),
                            ("--data-parallel-size", self.data_parallel_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{flag}={value!r} is invalid: must be a positive integer")
        t = self.header_timeout
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
            raise ConfigError(f"--header-timeout={t!r} is invalid: must be a positive number of seconds")
        if self.port > 65535:
            raise ConfigError(f"--port={self.port} is invalid: must be in 1 .. 65535")
        if self.kv_memory is not None and self.gpu_memory_utilization is not None:
            raise ConfigError("--kv-memory and --gpu-memory-utilization both given: pass one (the KV budget in "
                              "bytes, or the fraction of free device memory)")
        u = self.gpu_memory_utilization
        if u is not None and (isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1):
            raise ConfigError(f"--gpu-memory-utilization={u!r} is invalid: must be a fraction in (0, 1]")
        from lcx.service.warmup import parse_warmup

        parse_warmup(self.warmup)  # a bad --warmup is refused before the model loads

    @property
    def name(self) -> str:
        """The model's name in requests and ``/v1/models``."""
        return self.served_model_name or Path(self.model).name

    def cache(self):
        """The ``CacheConfig`` of ``--cache-policy`` / ``--cache-param`` / ``--page-size`` / ``--kv-dtype``; a
        policy the server cannot run is refused with the allowed values."""
        from lcx.cache.config import CacheConfig
        from lcx.engine.setup import server_policies

        spec = {"policy": self.cache_policy, "layout": "paged", "page_size": self.page_size,
                "kv_dtype": self.kv_dtype, **dict(self.cache_params)}
        cache = CacheConfig.from_mapping(spec, prefix="--cache-param")
        allowed = server_policies()
        if cache.policy not in allowed:
            raise ConfigError(f"--cache-policy={cache.policy!r} cannot run in lcx serve (it needs calibration or "
                              f"a cache type of its own); allowed: {', '.join(allowed)}")
        return cache

    def speculative(self):
        """``(SpeculativeConfig, the target's CacheConfig)`` of ``--speculative-draft`` / ``--speculative-param`` /
        ``--speculative-k`` (the draft's ``compression`` resolved against ``--max-model-len``), or None without
        ``--speculative-draft``; the flags a speculative server cannot honour are refused by name."""
        if self.speculative_draft is None:
            if self.speculative_params:
                raise ConfigError("--speculative-param without --speculative-draft: name the draft's policy, e.g. "
                                  "--speculative-draft streaming --speculative-param budget=256")
            return None
        from lcx.cache.config import CacheConfig
        from lcx.lm import as_speculative

        refused = [(flag, value) for flag, value, default in (
            ("--cache-policy", self.cache_policy, "full"), ("--kv-store", self.kv_store, None),
            ("--kv-memory", self.kv_memory, None), ("--gpu-memory-utilization", self.gpu_memory_utilization, None),
            ("--warmup", self.warmup, None), ("--tensor-parallel-size", self.tensor_parallel_size, 1),
            ("--data-parallel-size", self.data_parallel_size, 1)) if value != default]
        if refused:
            flag, value = refused[0]
            raise ConfigError(f"{flag}={value!r} is invalid with --speculative-draft: a speculative server verifies "
                              "against the full cache, every sequence reserving --max-model-len slots on one device "
                              "(allowed with --speculative-draft: --cache-policy full, --kv-dtype, --cache-param, "
                              "--max-num-seqs, --max-model-len, --segment, --prefill-chunk)")
        target = CacheConfig.from_mapping({"kv_dtype": self.kv_dtype, **dict(self.cache_params)},
                                          prefix="--cache-param")
        from lcx.cache.policy import registered

        if self.speculative_draft not in registered():
            raise ConfigError(f"--speculative-draft={self.speculative_draft!r} is not a registered eviction policy "
                              f"(allowed: {', '.join(registered())})")
        draft = {"policy": self.speculative_draft, **dict(self.speculative_params)}
        spec = as_speculative({"draft": draft, "k": self.speculative_k, "min_context": 0,
                               "confidence": self.speculative_confidence}, self.max_model_len, 0)
        return spec, target

    def meshes(self, model, devices=None) -> list:
        """One device mesh per replica: ``--data-parallel-size`` of them, each of ``--tensor-parallel-size``
        consecutive devices of ``devices`` (None: ``jax.devices()``); ``[None]`` for one device."""
        from lcx.parallel import sharding
        from lcx.plan.serving import tensor_parallel_mesh

        d, m = self.data_parallel_size, self.tensor_parallel_size
        if d * m == 1:
            return [None]
        import jax

        devices = list(jax.devices() if devices is None else devices)
        if d * m > len(devices):
            raise ConfigError(f"--data-parallel-size={d} x --tensor-parallel-size={m} = {d * m} devices, but "
                              f"{len(devices)} are available")
        if d == 1:
            return [tensor_parallel_mesh(model, m, devices)]
        group = lambda i: devices[i * m:(i + 1) * m]  # noqa: E731
        return [tensor_parallel_mesh(model, m, group(i)) if m > 1 else sharding.make_mesh(1, 1, devices=group(i))
                for i in range(d)]

    def resolve(self, model, *, reconstruction=None, free_bytes: int | None = None, weight_bytes: int = 0,
                mesh=None):
        """The one ``lcx.engine.setup.ServeSetup`` these options describe for ``model`` (a ``ModelConfig``): the
        cache config, its policy and kind, what a store may keep, the pool (``lcx.plan.serving``: ``--kv-memory``,
        else ``--gpu-memory-utilization`` of ``free_bytes`` less ``weight_bytes``, else every row at its largest;
        the plan in ``setup.plan``). ``reconstruction``: KVzip's repeat prompt or a function making it (called only
        for a policy that reconstructs); ``mesh``: one of ``self.meshes(model)`` (budgets and ``weight_bytes`` are
        then per device). Errors name the flag."""
        from lcx.engine.setup import prefix_formats, resolve
        from lcx.plan.serving import pool_plan

        cache = self.cache()
        setup = resolve(model, cache, max_num_seqs=self.max_num_seqs, max_len=self.max_model_len,
                        segment=self.segment, prefill_chunk=self.prefill_chunk, prefix_entries=self.prefix_entries,
                        reconstruction=reconstruction, mesh=mesh)
        if self.kv_store is not None and setup.store is None:
            if not setup.pages_hold_rows:
                raise ConfigError(f"--kv-store with --kv-dtype {cache.kv_dtype}: this format keeps part of each "
                                  "request beside its pages (a bit-packed cache: its most recent tokens in a float "
                                  f"window), so pages alone are not a prefix (allowed with --kv-store: --kv-dtype "
                                  f"{', '.join(prefix_formats())} or none)")
            raise ConfigError(f"--kv-store with --cache-policy={cache.policy!r}: its reconstruction passes score a "
                              "fresh prompt, not a stored compressed state (allowed: --cache-policy full or a policy "
                              "without reconstruction, e.g. snapkv)")
        plan = pool_plan(setup, kv_memory=self.kv_memory, free_bytes=free_bytes,
                         utilization=self.gpu_memory_utilization, weight_bytes=weight_bytes)
        return dataclasses.replace(setup, pages=plan.pages, plan=plan,
                                   make_store=setup.store is not None and (setup.store == "pages"
                                                                           or self.kv_store is not None))


def size_text(n: int) -> str:
    """A byte count as a flag takes it: 16GiB, 32MiB, else bytes."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def flags() -> list[dataclasses.Field]:
    """The ``ServeConfig`` fields that are ``lcx serve`` flags, in the order ``--help`` lists them."""
    return [f for f in dataclasses.fields(ServeConfig) if f.metadata.get("help")]


def flag_name(field: dataclasses.Field) -> str:
    return field.metadata["flag"] or "--" + field.name.replace("_", "-")


def add_flags(parser) -> None:
    """``parser`` takes every ``ServeConfig`` flag (``MODEL`` positional): names, help, metavars and the defaults in
    the help all come from the field declarations; an option left out keeps the field's default (``config_of``)."""
    groups: dict[str, Any] = {}
    for f in flags():
        meta = f.metadata
        shown = size_text(f.default) if meta["size"] else f"{f.default:g}" if isinstance(f.default, float) \
            else f.default
        help = meta["help"].replace("{default}", str(shown))
        if f.name == "model":
            parser.add_argument("model", metavar=meta["metavar"], help=help)
            continue
        kind = meta["type"] or (type(f.default) if isinstance(f.default, (int, float)) and not meta["size"] else None)
        kwargs = {"help": help, "metavar": meta["metavar"], "default": None}
        if isinstance(f.default, tuple):
            kwargs |= {"action": "append", "default": []}
        elif kind is not None:
            kwargs["type"] = kind
        target = parser
        if meta["group"]:
            if meta["group"] not in groups:
                groups[meta["group"]] = parser.add_mutually_exclusive_group()
            target = groups[meta["group"]]
        target.add_argument(flag_name(f), dest=f.name, **{k: v for k, v in kwargs.items() if v is not None})


def config_of(args) -> ServeConfig:
    """The ``ServeConfig`` of parsed ``lcx serve`` flags: sizes read as byte sizes, ``--cache-param KEY=VALUE``
    as (key, YAML value) pairs, a flag not given as its field's default."""
    from lcx.config_base import parse_bytes

    values = {}
    for f in flags():
        value = getattr(args, f.name)
        if f.name in ("cache_params", "speculative_params"):
            value = tuple(_param(item, flag_name(f)) for item in value)
        elif value is not None and f.metadata["size"]:
            value = parse_bytes(value, flag_name(f))
        if value is not None:
            values[f.name] = value
    return ServeConfig(**values)


def _param(item: str, flag: str = "--cache-param") -> tuple[str, Any]:
    """``--cache-param KEY=VALUE`` (or ``flag``'s) as ``(key, value)``, the value read as YAML (``budget=1024`` an
    integer)."""
    import yaml

    key, sep, value = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"{flag} {item!r} is invalid: write KEY=VALUE, e.g. budget=1024")
    return key, yaml.safe_load(value)


def fingerprint(params) -> str:
    """A digest of the weights' contents (dtype, shape and bytes of every leaf): pages stored for one model are
    never read by another, whatever its files are called."""
    import jax
    import numpy as np

    h = hashlib.blake2b(digest_size=16)
    for path, leaf in sorted(jax.tree_util.tree_leaves_with_path(params), key=lambda x: jax.tree_util.keystr(x[0])):
        x = np.asarray(leaf)
        h.update(f"{jax.tree_util.keystr(path)}:{x.dtype}:{x.shape}".encode())
        h.update(np.ascontiguousarray(x).tobytes())
    return h.hexdigest()


def store_namespace(params, cache, model) -> str:
    """What a stored page depends on besides its tokens: the weights, the model config and the cache settings."""
    settings = {"cache": cache.to_dict(), "model": dataclasses.asdict(model)}
    return fingerprint(params) + ":" + json.dumps(settings, sort_keys=True, default=str)


__all__ = ["DEFAULT_MAX_TOKENS", "ServeConfig", "add_flags", "config_of", "fingerprint", "flags", "size_text",
           "store_namespace"]
