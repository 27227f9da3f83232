"""``lcx serve MODEL``: the OpenAI-compatible service (``lcx.service``) on uvicorn."""

from __future__ import annotations

import argparse

import yaml

from lcx.config_base import ConfigError, parse_bytes


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve", help="an OpenAI-compatible server (/v1/completions, /v1/chat/completions, /metrics)",
        description="Serve MODEL (an HF directory, a .gguf file or an lcx run) over HTTP: continuous batching over a "
                    "paged KV cache, chunked prefill between decode segments, eviction policies on pages, prompt "
                    "pages kept across requests and restarts (--kv-store). A request that can never fit the KV "
                    "budget is refused with a 400 naming a policy that would serve it.")
    p.add_argument("model", metavar="MODEL", help="an HF directory, a .gguf file or an lcx run")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--max-num-seqs", type=int, default=8, help="sequences decoded together (default 8)")
    p.add_argument("--max-model-len", type=int, default=4096, help="most tokens (prompt + new) of one request "
                   "(default 4096)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default 16)")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--kv-memory", default=None, metavar="SIZE", help="KV pool size, e.g. 512MiB")
    budget.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="F",
                        help="size the KV pool at F of the device's free memory less the weights (default: every "
                             "sequence at --max-model-len)")
    p.add_argument("--cache-policy", default="full", metavar="NAME", help="eviction policy on pages (default full)")
    p.add_argument("--cache-param", action="append", default=[], metavar="KEY=VALUE",
                   help="a cache setting or policy parameter (repeatable), e.g. budget=1024")
    p.add_argument("--kv-dtype", default=None, help="int8 / fp8: 8-bit KV codes; int4 / int2: bit-packed codes "
                   "in groups (--page-size a multiple of --cache-param kv_group=, default 64; kv_residual= keeps the "
                   "most recent tokens in float) (default: the model's dtype)")
    p.add_argument("--kv-store", default=None, metavar="DIR", help="keep prompt pages (full) or each finished "
                   "request's compressed state (an evicting policy but kvzip: its next turn continues it) on disk "
                   "here: they survive restarts")
    p.add_argument("--kv-store-size", default="16GiB", metavar="SIZE", help="disk bound of --kv-store "
                   "(default 16GiB; least recently used pages go first)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every path but "
                   "/health and /metrics")
    p.add_argument("--served-model-name", default=None, help="the model's name in requests (default: MODEL's "
                   "file or directory name)")
    p.add_argument("--segment", type=int, default=8, help="decode steps between admissions (default 8)")
    p.add_argument("--prefill-chunk", type=int, default=256, help="prompt tokens per sequence and step "
                   "(default 256)")
    p.add_argument("--max-body-bytes", default="32MiB", metavar="SIZE", help="largest request body; larger ones "
                   "get 413 unread (default 32MiB)")
    p.add_argument("--max-connections", type=int, default=1024, help="open connections at most; more are closed "
                   "at once (default 1024)")
    p.add_argument("--header-timeout", type=float, default=10.0, help="seconds for a request head to arrive "
                   "before the connection is closed (default 10)")
    p.add_argument("--warmup", default=None, metavar="PROMPT_TOKENS[:NEW_TOKENS][@SHARED_TOKENS],...",
                   help="before accepting connections, run dummy chats of these prompt lengths (sharing the chat "
                   "template's opening, or their first SHARED_TOKENS) at every concurrency up to --max-num-seqs, so "
                   "the programs they use are compiled and the first requests pay no compile (default: none; "
                   "minutes on a CPU, printed)")
    p.add_argument("--dtype", default=None, help="parameter / compute dtype (default: the checkpoint's)")
    p.add_argument("--log-level", default="info", help="uvicorn's log level (default info)")
    p.set_defaults(func=run)
    return p


def config_of(args: argparse.Namespace):
    from lcx.service.config import ServeConfig

    params = []
    for item in args.cache_param:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--cache-param {item!r} is invalid: write KEY=VALUE, e.g. budget=1024")
        params.append((key, yaml.safe_load(value)))
    return ServeConfig(model=args.model, host=args.host, port=args.port, max_num_seqs=args.max_num_seqs,
                       max_model_len=args.max_model_len, page_size=args.page_size,
                       kv_memory=None if args.kv_memory is None else parse_bytes(args.kv_memory, "--kv-memory"),
                       gpu_memory_utilization=args.gpu_memory_utilization, cache_policy=args.cache_policy,
                       cache_params=tuple(params), kv_dtype=args.kv_dtype, kv_store=args.kv_store,
                       kv_store_bytes=parse_bytes(args.kv_store_size, "--kv-store-size"), api_key=args.api_key,
                       served_model_name=args.served_model_name, segment=args.segment,
                       prefill_chunk=args.prefill_chunk, dtype=args.dtype,
                       max_body_bytes=parse_bytes(args.max_body_bytes, "--max-body-bytes"),
                       max_connections=args.max_connections, header_timeout=args.header_timeout,
                       warmup=args.warmup)


def run(args: argparse.Namespace) -> int:
    import logging

    from lcx.service.app import build_service
    from lcx.service.run import serve

    config = config_of(args)
    config.cache()  # a policy the server cannot run: refused before the model loads
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if config.warmup:
        print(f"lcx serve: warming up --warmup {config.warmup} once the model is loaded", flush=True)
    service = build_service(config)
    if service.warmup is not None:
        print(f"lcx serve: {service.warmup.line()}", flush=True)
    for line in service.plan.lines():
        print(f"lcx serve: {line}", flush=True)
    print(f"lcx serve: {config.name} on http://{config.host}:{config.port}/v1", flush=True)
    try:
        serve(service, config.host, config.port, args.log_level)
    finally:
        service.close()
    return 0
