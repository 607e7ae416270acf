"""``hpmoe`` command line: one module per subcommand, each with ``add_parser``."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import sys
from typing import NoReturn

from ..launch.launcher import Interrupted
from ..launch.netns import TopologyError

DESCRIPTION = """\
hpmoe compiles the expert-parallel MoE-FFN region (dispatch, expert GEMMs + SwiGLU,
combine) into statically scheduled tile tasks, simulates them on hardware models,
and runs them on CPU ranks.  Start with `hpmoe demo`; every subcommand has --help."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, unless it is None/False or the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


# Subcommand modules of this package; each defines add_parser(subparsers) that sets
# ``run`` (args -> exit code) as the parser default.
COMMANDS = ("info", "calibrate", "demo", "simulate", "reproduce", "trace", "bench", "tune")


def version() -> str:
    try:
        return importlib.metadata.version("hpmoe")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hpmoe", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"hpmoe {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"{__name__}.{name}").add_parser(sub)
    for p in sub.choices.values():  # every flag's help shows its default
        p.formatter_class = HelpFormatter
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except (ValueError, TypeError, FileNotFoundError, ImportError, TopologyError) as err:
        # bad input, a missing profile or optional dependency, a network that cannot be built
        print(f"hpmoe {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        _leave(f"hpmoe {args.command}: interrupted", 130)
    except Interrupted as err:  # the launcher stopped its ranks and removed what they held
        _leave(f"hpmoe {args.command}: {err}; ranks stopped, nothing left behind", 128 + err.signum)


def _leave(line: str, code: int) -> NoReturn:
    """Print ``line`` and exit at once: everything is cleaned up, and tearing the
    interpreter down (torch's modules) would keep a stopped command alive seconds longer."""
    print(line, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(code)
