"""``hpmoe calibrate``: measure this host and save the ``cpu`` hardware profile."""

from __future__ import annotations

import argparse
import json
import sys

from ..sim.calibrate import calibrate
from ..sim.profile import profile_document, save_profile


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calibrate", help="measure this CPU and save the 'cpu' hardware profile")
    p.add_argument("--out", default=None,
                   help="profile path (default: $HPMOE_PROFILE, else ~/.cache/hpmoe/cpu.json)")
    p.add_argument("--quick", action="store_true", help="fewer repeats, smaller buffers (a few s)")
    p.add_argument("--json", action="store_true",
                   help="print the profile file's JSON (`hpmoe calibrate --json > p.json` is a profile)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--matrix-workers", type=int, default=1, help="matrix workers per rank")
    p.add_argument("--vector-workers", type=int, default=1, help="vector workers per rank")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Calibrate, save the profile, print it (JSON or summary)."""
    model = calibrate(threads=args.threads, quick=args.quick, matrix_workers=args.matrix_workers,
                      vector_workers=args.vector_workers,
                      progress=lambda line: print(f"hpmoe calibrate: {line}", file=sys.stderr, flush=True))
    path = save_profile(model, args.out)
    print(json.dumps(profile_document(model), indent=2) if args.json else model.summary())
    print(f"saved {path}", file=sys.stderr)
    return 0
