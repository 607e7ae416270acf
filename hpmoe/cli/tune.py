"""``hpmoe tune``: AUTO's tuning, run ahead of training for given shapes, saved to the
tuning cache (``schedule.tune_cache``) that layers and ``hpmoe bench`` read; ``--show``
prints the cache.

Each rank steps an ``hpmoe.MoE`` layer (AUTO, on an EP group over the chosen transport)
on random tokens until its tuning settles: the very search a layer makes in training
(forward and backward unless ``--forward-only``, which is what ``hpmoe bench`` times).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from ..launch.netns import LinkSpec
from ..machine import machine
from ..nn.layer import MoE
from ..runtime.session import RuntimeConfig, Session
from ..schedule.tune import Budget, TuneResult
from ..schedule.tune_cache import TuneCache
from ..spec import MoESpec, preset
from .bench import _transport, join_group, launch_ranks, rank_failed
from .common import DTYPES, dtype_choice, emit

_OPTIONS = ("preset", "tokens", "dtype", "transport", "link", "deadline", "seed")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tune", help="tune AUTO's choice for given shapes and save it for layers and bench")
    p.set_defaults(run=run)
    p.add_argument("--show", action="store_true", help="print the tuning cache as a table and exit")
    p.add_argument("--preset", default="small", help="MoE shape (a preset name)")
    p.add_argument("--tokens", default="1024", help="tokens per rank, comma-separated (e.g. 256,1024,4096)")
    p.add_argument("--ep", type=int, default=None, help="expert-parallel ranks (default 2)")
    p.add_argument("--dtype", default="auto", choices=["auto", *sorted(DTYPES)], help="compute dtype")
    p.add_argument("--transport", choices=["shm", "dist"], default=None,
                   help="shm (one host) or dist; default shm, dist with --link")
    p.add_argument("--link", default=None, metavar="RATE", help="ranks in namespaces joined by links of RATE")
    p.add_argument("--forward-only", action="store_true",
                   help="tune the forward alone (inference; what hpmoe bench times)")
    p.add_argument("--seed", type=int, default=0, help="seed of the layer's weights and tokens")
    p.add_argument("--deadline", type=float, default=60.0, help="seconds any wait may take")
    p.add_argument("--timeout", type=float, default=1800.0, help="launcher: wall-time limit (s)")
    p.add_argument("--json", action="store_true", help="print JSON")


def _tokens(text: str) -> list[int]:
    parts = text.split(",")
    if not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"--tokens={text!r} must be positive ints, comma-separated")
    return [int(p) for p in parts]


def run(args: argparse.Namespace) -> int:
    if args.show:
        return _show(args.json)
    moe = preset(args.preset)
    link = LinkSpec(args.link) if args.link else None
    _tokens(args.tokens)
    _transport(args)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _rank_main(args, link)
    argv = [f"--{n}={getattr(args, n)}" for n in _OPTIONS if getattr(args, n) is not None]
    argv += ["--forward-only"] * args.forward_only + ["--json"] * args.json
    return launch_ranks("tune", args, moe.experts, link, argv)


def _rank_main(args: argparse.Namespace, link: LinkSpec | None) -> int:
    group = join_group(args, link)
    dtype = DTYPES[dtype_choice(args.dtype, on_this_cpu=True)[0]]
    config = RuntimeConfig(transport=_transport(args), deadline_s=args.deadline, network=args.link or "")
    rows = []
    try:
        with Session(config, group) as session:
            for tokens in _tokens(args.tokens):
                rows.append((tokens, _tune_one(session, preset(args.preset, dtype), tokens, args)))
    except (RuntimeError, ValueError) as err:
        rank_failed(err)
    if dist.get_rank() == 0:
        if args.json:
            tuned = [{"tokens": t} | r.to_json() for t, r in rows]
            emit({"machine": machine().to_json(), "tuned": tuned}, True)
        else:
            for tokens, r in rows:
                print(f"hpmoe tune: {args.preset}, {tokens} tokens/rank: {r.describe()}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _tune_one(session: Session, moe: MoESpec, tokens: int, args: argparse.Namespace) -> TuneResult:
    """Step a layer until its tuning for ``tokens`` settles (the layer saves it)."""
    layer = MoE(moe, seed=args.seed, ep_group=session)
    g = torch.Generator().manual_seed(args.seed + session.rank)
    x = torch.randn(tokens, moe.hidden, generator=g, device="cpu").to(moe.dtype)
    backward = not args.forward_only
    for _ in range(Budget().max_steps + 2):
        if layer.tuned(tokens, backward=backward) is not None:
            break
        if backward:
            xg = x.clone().requires_grad_()
            layer(xg).sum().backward()
        else:
            with torch.no_grad():
                layer(x)
    result = layer.tuned(tokens, backward=backward)
    if result is None:
        raise RuntimeError(f"tuning {tokens} tokens/rank did not settle in {Budget().max_steps + 2} steps")
    return result


def _show(as_json: bool) -> int:
    cache = TuneCache()
    entries = cache.entries()
    here = machine()
    if as_json:
        emit({"path": str(cache.path), "entries": [e.to_json() for e in entries]}, True)
        return 0
    print(f"tuning cache {cache.path}: {len(entries)} entries")
    if not entries:
        return 0
    print("| layer | ep | network | dtype | tokens | backward | winner | ms | runner-up, gain | kbk ms "
          "| steps (s) | current |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for e in entries:
        k, r = e.key, e.result
        current = "yes" if k.machine == here.fingerprint() and e.versions == here.versions() else "stale"
        up = f"{r.runner_up.name}, {r.gain_over_runner_up:.2f}x" if r.runner_up else "-"
        kbk = f"{r.kernel_by_kernel_s * 1e3:.3f}" if r.kernel_by_kernel_s is not None else "-"
        layer = f"{k.moe}, placement {k.placement:08x}" if k.placement else k.moe
        print(f"| {layer} | {k.ep} | {k.transport} | {k.dtype} | {k.tokens} | {k.backward} | {r.winner.name} "
              f"| {r.winner_s * 1e3:.3f} | {up} | {kbk} | {r.steps} ({r.seconds:.2f}) | {current} |")
    return 0
