"""``hpmoe calibrate``: measure this host and save the ``cpu`` hardware profile."""

from __future__ import annotations

import argparse

from ..sim.calibrate import add_calibrate_parser, run_calibrate


def add_parser(sub: argparse._SubParsersAction) -> None:
    add_calibrate_parser(sub).set_defaults(run=run_calibrate)
