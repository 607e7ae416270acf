"""The planner's cost of moving, checked against measured migrations: 2 ranks, each a
``hpmoe.MoE`` with ``shard_experts`` (kernel by kernel, Adam state after one step),
alternate between the first placement and the planner's for two hot experts
(``layer.move_to``); each move's slowest rank's measured seconds against the seconds
``Moves.seconds`` models on three hardware models: ``measured`` (the link measured as
the baseline's models measure it, ``hpmoe.bench.forecast.measure_all_to_all``: the
median of 5 all-to-alls of ``--probe-mb`` per peer (default: the move's largest
message), a move's kind of traffic, before any move; the latency of 64-byte
exchanges; copies at
this rank's share of the measured host memory rate), ``configured`` (the shaped
``--link`` rate, measured copies) and ``nominal`` (``cpu_nominal``, the layer's default).
With ``--redundant``, the backward's sum of the replicas' gradient rows
(``replica_sum``) is timed as often as the moves, against ``replica_seconds``: what a
sharded layer's rebalance charges a plan per call.

    HPMOE_PROFILE=/nonexistent .venv/bin/python benchmarks/bench_migrate.py \
        [--preset mixtral-8x7b --hidden 1024 --ffn 3584] [--link 1gbit] [--redundant 0] [--moves 6] \
        [--probe-mb MIB]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
from datetime import timedelta

import numpy as np
import torch

from hpmoe.launch.launcher import LaunchSpec, launch
from hpmoe.launch.netns import LinkSpec
from hpmoe.machine import record


def _models(link: str | None, probe_bytes: int) -> dict:
    """The three hardware models (see the module doc).  Collective."""
    import torch.distributed as dist

    from hpmoe.bench.forecast import measure_all_to_all, measure_host_memory, measure_link
    from hpmoe.sim.hardware import LinkEntry
    from hpmoe.sim.presets import cpu_nominal

    nominal = cpu_nominal()
    latency = measure_link(None, 1 << 20)[1]  # 64-byte exchanges
    bw = measure_all_to_all(None, probe_bytes, repeats=5)
    copies = measure_host_memory(None) / dist.get_world_size()
    measured = dataclasses.replace(nominal, link=(LinkEntry(2, bw, bw),), link_latency=latency, mem_bw=copies)
    rate = LinkSpec(link).bytes_per_s if link else bw
    configured = dataclasses.replace(measured, link=(LinkEntry(2, rate, rate),))
    return {"measured": measured, "configured": configured, "nominal": nominal}


def _rank(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from hpmoe import MoE
    from hpmoe.bench.forecast import slowest_rank
    from hpmoe.migration import Moves
    from hpmoe.placement import plan_placement, starting_placement
    from hpmoe.runtime.session import RuntimeConfig
    from hpmoe.runtime.transport.base import TransportKind
    from hpmoe.spec import preset

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = preset(args.preset, torch.float32)
    spec = dataclasses.replace(spec, hidden=args.hidden or spec.hidden, ffn=args.ffn or spec.ffn)
    transport = TransportKind.DIST if args.link else TransportKind.SHM
    runtime = RuntimeConfig(transport=transport, deadline_s=600.0)
    load = np.ones(spec.experts)
    load[-2:] = 100.0  # the last two hot, on one rank (extra slots start as spares)
    first = starting_placement(spec.experts, world, args.redundant)
    places = [first, plan_placement(load, world, args.redundant, current=first)]
    largest = int(Moves.between(*places).rows().max()) * 2 * spec.ffn * spec.hidden * 4  # w13's rows, fp32
    models = _models(args.link, int(args.probe_mb * (1 << 20)) or largest)
    layer = MoE(spec, ep_group=dist.group.WORLD, backend="kernel_by_kernel", shard_experts=True,
                redundant=args.redundant, runtime=runtime, hardware=models["measured"])
    opt = torch.optim.Adam(layer.parameters(), lr=1e-3)
    layer(torch.randn(64, spec.hidden)).sum().backward()
    opt.step()
    opt.zero_grad()  # between steps: weights and Adam's two moments move
    if rank == 0:
        figures = {n: {"link_gbytes_per_s": hw.link[0].dispatch / 1e9, "latency_ms": hw.link_latency * 1e3,
                       "copy_gbytes_per_s": hw.mem_bw / 1e9} for n, hw in models.items()}
        print(json.dumps({"models": figures, "probe_bytes": int(args.probe_mb * (1 << 20)) or largest}),
              flush=True)
    for i in range(args.moves):
        dist.barrier()
        m = layer.move_to(places[(i + 1) % 2], opt)
        slowest = float(slowest_rank(np.array([m.seconds]), None)[0])
        predicted = {n: m.moves.seconds(m.row_bytes, m.tensors, hw) for n, hw in models.items()}
        if rank == 0:
            print(json.dumps({"move": i, "rows": m.moves.rows().tolist(), "row_bytes": m.row_bytes,
                              "tensors": m.tensors, "measured_s": slowest, "predicted_s": predicted}),
                  flush=True)
    _replica_sums(layer, places[1], models, args.moves, rank)
    layer.close()
    dist.destroy_process_group()


def _replica_sums(layer, plan, models: dict, calls: int, rank: int) -> None:
    """With replicas in ``plan``: ``calls`` backwards of ``replica_sum`` over tensors
    shaped like the layer's stored rows, the slowest rank's seconds of each against
    ``replica_seconds`` on every model (what the rebalance charges a plan per call)."""
    import time

    import torch.distributed as dist

    from hpmoe.bench.forecast import slowest_rank
    from hpmoe.migration import replica_seconds, replica_sum

    if not plan.spread:
        return
    per = plan.slots_per_rank
    stored = [p.detach().clone().requires_grad_() for p in layer.experts.parameters()]
    predicted = {n: replica_seconds(stored, plan, hw) for n, hw in models.items()}
    for i in range(calls):
        out = replica_sum(stored, plan.phy2log[rank * per:(rank + 1) * per], plan.spread,
                          layer.session().collectives)
        dist.barrier()
        t0 = time.perf_counter()
        torch.autograd.backward(out, [torch.ones_like(t) for t in out])
        slowest = float(slowest_rank(np.array([time.perf_counter() - t0]), None)[0])
        if rank == 0:
            print(json.dumps({"replica_sum": i, "experts": list(plan.spread), "measured_s": slowest,
                              "predicted_s": predicted}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="mixtral-8x7b")
    p.add_argument("--hidden", type=int, default=1024, help="the preset's hidden size (0: as it is)")
    p.add_argument("--ffn", type=int, default=3584, help="the preset's expert FFN size (0: as it is)")
    p.add_argument("--link", default=None, help="shape the ranks' links to this rate (e.g. 1gbit)")
    p.add_argument("--redundant", type=int, default=0)
    p.add_argument("--moves", type=int, default=6)
    p.add_argument("--probe-mb", type=float, default=0.0,
                   help="MiB each rank sends each peer to measure the link (measure_all_to_all); 0: the "
                        "move's largest message (its rows of gate_up_proj)")
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank:
        return _rank(args)
    record()
    argv = [sys.executable, os.path.abspath(__file__), "--rank", *sys.argv[1:]]
    result = launch(LaunchSpec(tuple(argv), 2, LinkSpec(args.link) if args.link else None, timeout_s=1800,
                               capture=True))
    if not result.ok:
        for r in result.ranks:
            print(f"rank {r.rank} exited {r.returncode}:\n{r.stderr[-3000:]}", file=sys.stderr)
        sys.exit(1)
    lines = [json.loads(line) for line in result.ranks[0].stdout.splitlines() if line.startswith("{")]
    moves = [m for m in lines if "move" in m]
    sums = [m for m in lines if "replica_sum" in m]
    print(json.dumps({"args": vars(args), **lines[0], "moves": moves,
                      "measured_over_predicted": _ratios(moves), "replica_sums": sums,
                      "replica_sum_measured_over_predicted": _ratios(sums)}))


def _ratios(rows: list[dict]) -> dict:
    """Per model: median, min and max of measured / predicted seconds over ``rows``."""
    if not rows:
        return {}
    ratios = {n: [m["measured_s"] / m["predicted_s"][n] for m in rows if m["predicted_s"][n]]
              for n in rows[0]["predicted_s"]}
    return {n: {"median": statistics.median(r), "min": min(r), "max": max(r)} for n, r in ratios.items()}


if __name__ == "__main__":
    main()
