"""The ``lcx`` command line: one subcommand per stage. Each command module contributes ``add_parser``."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from lcx.config_base import ConfigError


def build_parser() -> argparse.ArgumentParser:
    from lcx import experiment
    from lcx.cli import convert, export, generate, plan, serve

    parser = argparse.ArgumentParser(prog="lcx", description="Long-context decoding experiments in JAX.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    plan.add_parser(sub)
    generate.add_parser(sub)
    experiment.add_parsers(sub)
    export.add_parser(sub)
    convert.add_parser(sub)
    serve.add_parser(sub)
    return parser


def _persistent_compilation_cache() -> None:
    """Compiled programs persist across ``lcx`` runs (a rerun or resume skips compiling): JAX's cache in
    ``$LCX_CACHE_DIR`` (default ``~/.cache/lcx/jax``), unless JAX_COMPILATION_CACHE_DIR already names one."""
    import jax

    if jax.config.jax_compilation_cache_dir is None:
        default = Path.home() / ".cache" / "lcx" / "jax"
        jax.config.update("jax_compilation_cache_dir", os.environ.get("LCX_CACHE_DIR", str(default)))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _persistent_compilation_cache()
    try:
        return int(args.func(args) or 0)
    except ConfigError as err:
        # Bad user input or a failed save: one clear line, no traceback.
        print(f"lcx {args.command}: error: {err}", file=sys.stderr)
        _exit_if_stuck(2)
        return 2
    except KeyboardInterrupt as err:
        print(f"lcx {args.command}: {err or 'interrupted'}", file=sys.stderr)
        _exit_if_stuck(130)
        return 130


def _exit_if_stuck(code: int) -> None:
    """Exit now when orbax's writer threads are still alive after a failed save (waiting on signals that will never
    come, for 20 minutes): the interpreter would wait for them at exit. Other threads are left alone."""
    import threading

    stuck = [t for t in threading.enumerate() if type(t).__module__.startswith("orbax") and not t.daemon]
    for t in stuck:
        t.join(timeout=2.0)
    if any(t.is_alive() for t in stuck):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
