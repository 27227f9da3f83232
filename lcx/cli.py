"""The ``lcx`` command line: one subcommand per stage. Each command module contributes ``add_parser``."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from lcx.config_base import ConfigError


def build_parser() -> argparse.ArgumentParser:
    from lcx import experiment, export_cli, generate_cli, plan

    parser = argparse.ArgumentParser(prog="lcx", description="Long-context decoding experiments in JAX.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    plan.add_parser(sub)
    generate_cli.add_parser(sub)
    experiment.add_parsers(sub)
    export_cli.add_parser(sub)
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
        # Bad user input: one clear line, no traceback.
        print(f"lcx {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
