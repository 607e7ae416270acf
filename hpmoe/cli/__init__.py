"""``hpmoe`` command line: one module per subcommand, each with ``add_parser``."""

from __future__ import annotations

import argparse
import importlib
import sys

# Subcommand modules of this package; each defines add_parser(subparsers) that sets
# ``run`` (args -> exit code) as the parser default.
COMMANDS = ("info", "calibrate", "demo", "simulate", "reproduce", "trace", "bench")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hpmoe", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(f"{__name__}.{name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except (ValueError, TypeError, FileNotFoundError) as err:  # bad input; a missing profile
        print(f"hpmoe {args.command}: error: {err}", file=sys.stderr)
        return 2
