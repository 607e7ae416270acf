"""A tiny training run of two hpmoe layers on gloo ranks, for the checkpoint tests: a
layer that stores every expert and rebalances (its placement grows replicas), then one
with ``shard_experts`` that moves its rows (with Adam's moments) to hand-made
placements with replicas and spares.  Kernel by kernel is pinned: every step computes
fixed bits.  Step ``REBALANCE_AT`` of each leg (before the save and after it) rebalances
the first layer and moves the second.

Launched as a rank (``python -m tests.checkpoint_run STAGE DIR``): ``SAVED`` steps, a
checkpoint in DIR, then the move of the next leg, during which rank ``KILLED`` kills
itself (SIGKILL) in STAGE (a ``MoveStage`` name); the others print
``move failed after T s: <error>``, whether their placement and rows are the old ones,
and exit 1."""

from __future__ import annotations

import os
import signal
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from hpmoe.engine.checkpoint import held
from hpmoe.migration import MoveError, MoveStage
from hpmoe.nn.checkpoint import TrainState
from hpmoe.nn.layer import MoE
from hpmoe.placement import Placement
from hpmoe.runtime import RuntimeConfig
from hpmoe.spec import preset
from hpmoe.weights import ExpertWeights

SPEC = preset("tiny")
TOKENS = 8  # per rank
SAVED = 3  # steps before the checkpoint
RESUMED = 3  # steps after it
REBALANCE_AT = 1  # the step of each leg that rebalances and moves
DEADLINE = 2.0
KILLED = 1
REDUNDANT = {1: 2, 2: 2, 4: 4}  # extra slots by EP size: the slots divide over the ranks
# per EP size, the placements the sharded layer moves to in each leg (replicas and spares)
MOVES = {2: (Placement((0, 3, 4, 5, 7, 0, 1, 2, 6, 7), 8, 2),
             Placement((0, 1, 2, 3, 7, 0, 4, 5, 6, 6), 8, 2)),
         4: (Placement((0, 1, 7, 2, 3, 0, 4, 5, 7, 6, 0, 1), 8, 4),
             Placement((7, 6, 5, 4, 3, 2, 1, 0, 0, 0, 1, 2), 8, 4))}


def build(world: int, sharded: bool = True) -> nn.Sequential:
    """The two layers on the default group (``world`` > 1) or in one process; the second
    stores only its own slots when ``sharded`` (an EP group only)."""
    group = dist.group.WORLD if world > 1 else None
    common: dict[str, Any] = dict(backend="kernel_by_kernel")
    if group is not None:
        common |= dict(ep_group=group, runtime=RuntimeConfig(deadline_s=DEADLINE))
    extra = dict(shard_experts=True, redundant=REDUNDANT[world]) if sharded and group is not None else {}
    first = MoE(SPEC, ExpertWeights.random(SPEC, 1), **common)
    return nn.Sequential(first, MoE(SPEC, ExpertWeights.random(SPEC, 2), **common, **extra))


def batch(step: int, world: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s input and output gradient of rank ``rank`` (of ``world``)."""
    g = torch.Generator().manual_seed(100 + step)
    x, dy = (torch.randn(world * TOKENS, SPEC.hidden, generator=g) for _ in range(2))
    mine = slice(rank * TOKENS, (rank + 1) * TOKENS)
    return x[mine], dy[mine]


def probe(world: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s share of a batch of ``4 * TOKENS`` tokens no step trains on (its
    whole in one process)."""
    x = torch.randn(4 * TOKENS, SPEC.hidden, generator=torch.Generator().manual_seed(99))
    per = x.shape[0] // world
    return x[rank * per:(rank + 1) * per]


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=1e-2)


def _stored(model: nn.Module) -> set[torch.Tensor]:
    return {p for m in model if m.options.shard_experts for p in m.experts.parameters()}


def step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """One Adam step on ``x``; gradients summed over the ranks as DDP does, but for the
    sharded layer's stored rows."""
    opt.zero_grad()
    out = model(x)
    (out * dy).sum().backward()
    if dist.is_initialized():
        stored = _stored(model)
        for p in model.parameters():
            if p not in stored:
                dist.all_reduce(p.grad)
    opt.step()
    return out.detach()


def rebalance(model: nn.Module, opt: torch.optim.Optimizer, world: int, leg: int) -> None:
    """The first layer plans on its measured load; the second moves to ``MOVES[world][leg]``."""
    first, second = model
    first.rebalance(redundant=REDUNDANT[world], min_gain=1.0)
    if second.options.shard_experts:
        second.move_to(MOVES[world][leg], opt)


def leg(model: nn.Module, opt: torch.optim.Optimizer, rank: int, world: int,
        index: int) -> list[torch.Tensor]:
    """The steps of leg ``index`` (0: before the save, 1: after it); their outputs."""
    first, steps = (0, SAVED) if index == 0 else (SAVED, RESUMED)
    outs = []
    for s in range(steps):
        if s == REBALANCE_AT:
            rebalance(model, opt, world, index)
        outs.append(step(model, opt, *batch(first + s, world, rank)))
    return outs


def save(model: nn.Module, opt: torch.optim.Optimizer, path: str) -> None:
    dcp.save({"train": TrainState(model, opt)}, checkpoint_id=path)


def load(model: nn.Module, opt: torch.optim.Optimizer, path: str) -> None:
    dcp.load({"train": TrainState(model, opt)}, checkpoint_id=path)


def logical(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and Adam moment in logical order (a sharded layer's rows gathered
    from their ranks, each expert from its first holder), the same on every rank."""
    out = {}
    for name, p in model.named_parameters():
        state = opt.state.get(p, {})
        moments = ((f".{k}", state[k]) for k in ("exp_avg", "exp_avg_sq") if k in state)
        for key, t in (("", p.detach()), *moments):
            out[name + key] = _gathered(model[int(name[0])], t) if p in _stored(model) else t.clone()
    return out


def _gathered(layer: MoE, rows: torch.Tensor) -> torch.Tensor:
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, (held(layer._door.balance), rows))
    full = rows.new_zeros((layer.spec.experts, *rows.shape[1:]))
    for experts, r in reversed(every):
        for j, e in enumerate(experts):
            full[e] = r[j]
    return full


def placements(model: nn.Module) -> list[Placement | None]:
    return [m.placement for m in model]


# ---------------------------------------------------------------------------- a killed move


def _kill_in(layer: MoE, stage: MoveStage) -> None:
    """Make this rank SIGKILL itself when its next move enters ``stage`` (in the all-to-all:
    at its second tensor, after the first crossed)."""
    coll = layer.session().collectives
    calls = {"all_gather": coll.all_gather, "all_to_all": coll.all_to_all}
    seen = []

    def wrapped(kind: str):
        def call(*args: Any, **kwargs: Any) -> Any:
            what = args[-1] if isinstance(args[-1], str) else kwargs.get("what", "")
            if what == f"move: {stage.value}":
                seen.append(what)
                if stage is not MoveStage.EXCHANGE or len(seen) == 2:
                    os.kill(os.getpid(), signal.SIGKILL)
            return calls[kind](*args, **kwargs)
        return call

    coll.all_gather, coll.all_to_all = wrapped("all_gather"), wrapped("all_to_all")


def main(stage: str, path: str) -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)  # as spawn_gloo's ranks: the reference run's bits
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))  # far beyond the layer's deadline
    model = build(world)
    opt = optimizer(model)
    leg(model, opt, rank, world, 0)
    save(model, opt, path)
    for s in range(REBALANCE_AT):
        step(model, opt, *batch(SAVED + s, world, rank))
    second = model[1]
    if rank == KILLED:
        _kill_in(second, MoveStage[stage])
    before, rows = second.placement, [t.clone() for t in _moved(second, opt)]
    start = time.monotonic()
    try:
        second.move_to(MOVES[world][1], opt)
    except MoveError as err:
        intact = all(torch.equal(a, b) for a, b in zip(rows, _moved(second, opt), strict=True))
        print(f"move failed after {time.monotonic() - start:.3f} s: {type(err).__name__}: {err}\n"
              f"stage {err.stage.name}; old placement in effect: {second.placement == before}; "
              f"old rows intact: {intact}", file=sys.stderr, flush=True)
        os._exit(1)  # a collective may still be pending: nothing may block the exit
    return 0


def _moved(layer: MoE, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The stored rows, their gradients and Adam's moments: what a move writes."""
    out = []
    for p in layer.experts.parameters():
        out += [p.detach(), p.grad, *(v for v in opt.state[p].values() if v.dim())]
    return [t for t in out if t is not None]


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
