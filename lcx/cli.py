"""The ``lcx`` command line: one subcommand per stage. Each command module contributes ``add_parser``."""

from __future__ import annotations

import argparse
import sys

from lcx.config_base import ConfigError


def build_parser() -> argparse.ArgumentParser:
    from lcx import experiment, generate_cli, plan

    parser = argparse.ArgumentParser(prog="lcx", description="Long-context decoding experiments in JAX.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    plan.add_parser(sub)
    generate_cli.add_parser(sub)
    experiment.add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ConfigError as err:
        # Bad user input: one clear line, no traceback.
        print(f"lcx {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
