"""``lcx serve MODEL``: the OpenAI-compatible service (``lcx.service``) on uvicorn. The flags are
``lcx.service.config.ServeConfig``'s fields (``add_flags``): their names, defaults and help are declared there once.
Across processes (``LCX_COORDINATOR`` ... set in each): process 0 serves, the others follow its steps
(``lcx.service.multihost``)."""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> argparse.ArgumentParser:
    from lcx.service.config import add_flags

    p = subparsers.add_parser(
        "serve", help="an OpenAI-compatible server (/v1/completions, /v1/chat/completions, /metrics)",
        description="Serve MODEL (an HF directory, a .gguf file or an lcx run) over HTTP: continuous batching over a "
                    "paged KV cache, chunked prefill between decode segments, eviction policies on pages, prompt "
                    "pages kept across requests and restarts (--kv-store). A request that can never fit the KV "
                    "budget is refused with a 400 naming a policy that would serve it.")
    add_flags(p)
    p.add_argument("--log-level", default="info", help="uvicorn's log level (default info)")
    p.set_defaults(func=run)
    return p


def config_of(args: argparse.Namespace):
    from lcx.service.config import config_of

    return config_of(args)


def run(args: argparse.Namespace) -> int:
    import logging
    import os

    from lcx.parallel import distributed
    from lcx.service import multihost
    from lcx.service.compose import build_service
    from lcx.service.run import serve

    # LCX_COORDINATOR / LCX_NUM_PROCESSES / LCX_PROCESS_ID: one server across processes (before any device is used)
    distributed.initialize_from_env()
    config = config_of(args)
    config.cache()  # a policy the server cannot run: refused before the model loads
    config.speculative()  # so is a speculative setting
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if config.warmup:
        print(f"lcx serve: warming up --warmup {config.warmup} once the model is loaded", flush=True)
    service = build_service(config)
    if not multihost.leads():  # process 1 ..: process 0 serves HTTP; this one runs the same steps until it closes
        print(f"lcx serve: process {os.environ.get('LCX_PROCESS_ID', '?')} follows process 0's steps", flush=True)
        steps = multihost.follow(service.server)
        print(f"lcx serve: process 0 closed after {steps} steps", flush=True)
        return 0
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
