"""Every clock's interpretation of the IR's waits, thresholds and signals against the one
reference (``ir.semantics.EventCounts``, which the exact executor runs under): the
simulator's replay, the GPU kernel's packed arrays run by a model of the device that
reads nothing but them, and the runtime's measured timelines on two ranks — over random
graphs (forward and backward regions, per expert and deduplicated, random routings) and
random device interleavings.  The check itself fails on a trace that breaks the rule,
and on packed arrays with one threshold lowered."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from hpmoe.exec.program import compile_region
from hpmoe.gpu.buffers import buffer_space
from hpmoe.gpu.pack import PackedProgram, pack
from hpmoe.ir.analysis import GraphError
from hpmoe.ir.schedule import QUEUE_POLICIES, SchedulePolicy
from hpmoe.ir.semantics import Signals, check_trace
from hpmoe.regions.family import region_family
from hpmoe.routing import Routing, RoutingKind, synthetic_routing
from hpmoe.sim.presets import cpu_nominal, hardware_preset
from hpmoe.sim.simulate import simulate
from hpmoe.spec import DispatchMode, ParallelSpec, preset
from hpmoe.testing import spawn_gloo
from hpmoe.weights import ExpertWeights

from .helpers import TINY_TILES, tiny_plan

DEDUP = dataclasses.replace(TINY_TILES, dispatch=DispatchMode.PER_RANK)
KINDS = (RoutingKind.ZIPF, RoutingKind.BALANCED, RoutingKind.HOT)
HW = {"h100": dataclasses.replace(hardware_preset("h100"), matrix_workers=2, vector_workers=3),
      "cpu": dataclasses.replace(cpu_nominal(), matrix_workers=2, vector_workers=2)}


def _schedules(policy: SchedulePolicy, hw: str, dedup: bool = True):
    """(name, plan, schedule) of random graphs: three routings, EP 2 and 4, forward and
    backward, per expert (and deduplicated with ``dedup``)."""
    for seed, kind in enumerate(KINDS):
        for ep in (2, 4):
            plan = tiny_plan(kind, ep=ep, tokens=5 + 3 * seed, seed=seed)
            for tiles in (TINY_TILES, DEDUP) if dedup else (TINY_TILES,):
                family = region_family(tiles)
                layout = family.layout(plan, tiles)
                for region in (family.forward(layout), family.backward(layout, False)):
                    name = f"{kind.value}/ep{ep}/{tiles.dispatch.value}/{region.kind.value}"
                    yield name, plan, compile_region(plan, region, tiles, policy, HW[hw])


def _forward(kind: RoutingKind, policy: SchedulePolicy):
    """The per-expert forward of 8 tokens per rank on 2 ranks: (plan, schedule)."""
    plan = tiny_plan(kind, ep=2, tokens=8)
    family = region_family(TINY_TILES)
    return plan, compile_region(plan, family.forward(family.layout(plan, TINY_TILES)), TINY_TILES, policy,
                                HW["h100"])


@pytest.mark.parametrize("hw", sorted(HW))
@pytest.mark.parametrize("policy", QUEUE_POLICIES, ids=lambda p: p.value)
def test_the_simulators_replay_keeps_the_reference_rule(policy, hw):
    for name, _, s in _schedules(policy, hw):
        t = simulate(s, HW[hw]).timeline
        check_trace(s.graph, t.start, t.end)  # raises naming the task that started early
        assert t.end.max() > 0, name


# ---------------------------------------------------------------------------- the device


def device_trace(p: PackedProgram, rng: np.random.Generator, epochs: int = 2) -> list[tuple]:
    """Run ``p`` as the persistent kernel does, from its arrays alone: each queue takes
    its tasks in order; a task starts once its waited counter reaches ``epoch *
    wait_step + wait_threshold`` (counters are never reset between calls) and signals
    ``sig_event`` when it ends.  At every step one random queue starts its ready head or
    ends its running task.  (start, end) [n] step numbers per call."""
    counters = np.zeros(p.num_events, np.int64)
    traces = []
    for epoch in range(epochs):
        head = p.queue_ptr[:-1].astype(np.int64)
        running = np.full(p.num_queues, -1)
        start, end = np.full(p.num_tasks, np.nan), np.full(p.num_tasks, np.nan)
        clock = 0
        while True:
            moves = [q for q in range(p.num_queues) if running[q] >= 0 or (
                head[q] < p.queue_ptr[q + 1] and _ready(p, counters, int(p.queue_task[head[q]]), epoch))]
            if not moves:
                break
            q = moves[int(rng.integers(len(moves)))]
            if running[q] >= 0:
                t = running[q]
                end[t], running[q] = clock, -1
                np.add.at(counters, p.sig_event[p.sig_ptr[t]:p.sig_ptr[t + 1]], 1)  # an event may repeat
            else:
                t = int(p.queue_task[head[q]])
                start[t], running[q], head[q] = clock, t, head[q] + 1
            clock += 1
        traces.append((start, end))
    return traces


def _ready(p: PackedProgram, counters: np.ndarray, t: int, epoch: int) -> bool:
    ev = p.wait_event[t]
    return ev < 0 or counters[ev] >= epoch * p.wait_step[t] + p.wait_threshold[t]


@pytest.mark.parametrize("policy", QUEUE_POLICIES, ids=lambda p: p.value)
def test_the_packed_arrays_keep_the_reference_rule_under_random_device_interleavings(policy):
    for name, plan, s in _schedules(policy, "h100", dedup=False):
        p = pack(s, buffer_space(plan))
        for seed in range(4):
            for start, end in device_trace(p, np.random.default_rng(seed)):
                assert not np.isnan(end).any(), f"{name}: the device model stalled"
                check_trace(s.graph, start, end)


def test_a_packed_threshold_one_too_low_is_caught():
    """A packer that lowers one waited threshold by one: some interleaving starts that
    task early, and the reference says which."""
    plan, s = _forward(RoutingKind.ZIPF, SchedulePolicy.HYPERPARALLEL)
    p = pack(s, buffer_space(plan))
    waits = np.flatnonzero(p.wait_event >= 0)
    caught = 0
    for t in waits[::max(1, len(waits) // 8)]:
        low = p.wait_threshold.copy()
        low[t] -= 1
        broken = dataclasses.replace(p, wait_threshold=low)
        for seed in range(16):
            start, end = device_trace(broken, np.random.default_rng(seed), epochs=1)[0]
            try:
                check_trace(s.graph, start, end)
            except GraphError as err:
                assert s.graph.task(int(t)) in str(err)
                caught += 1
                break
    assert caught >= len(waits[::max(1, len(waits) // 8)]) // 2, caught


def test_the_check_names_a_task_that_starts_before_its_signaller_ends():
    _, s = _forward(RoutingKind.BALANCED, SchedulePolicy.SERIAL)
    t = simulate(s, HW["h100"]).timeline
    g = s.graph
    waiter = int(np.flatnonzero(g.wait_global() >= 0)[0])
    start = t.start.copy()
    start[waiter] = -1.0  # before anything has ended
    with pytest.raises(GraphError, match="starts before its event"):
        check_trace(g, start, t.end)
    with pytest.raises(ValueError, match="a trace holds"):
        check_trace(g, t.start[:-1], t.end[:-1])


# ---------------------------------------------------------------------------- the runtime


def _runtime_traces(rank: int, world: int) -> list[dict]:
    from hpmoe.runtime import ForwardOptions, ForwardRunner, RuntimeConfig, Session

    moe = preset("tiny")
    out = []
    with Session(RuntimeConfig(deadline_s=20.0)) as session:
        for seed, kind in enumerate(KINDS):
            par = ParallelSpec(ep=world, tokens_per_rank=7)
            routing = synthetic_routing(kind, moe, par, seed=seed)
            x = torch.randn(world * 7, moe.hidden, generator=torch.Generator().manual_seed(seed))
            mine = slice(rank * 7, (rank + 1) * 7)
            weights = ExpertWeights.random(moe, seed)
            for policy in QUEUE_POLICIES:
                for tiles in (TINY_TILES, DEDUP):
                    options = ForwardOptions(tiles=tiles, policy=policy, hardware=HW["cpu"])
                    fwd = ForwardRunner(session, weights, options)(x[mine], Routing(routing.ids[mine],
                                                                                   routing.weights[mine]))
                    t = fwd.timeline
                    origin = t.origin_ns / 1e9
                    out.append({"name": f"{kind.value}/{policy.value}/{tiles.dispatch.value}",
                                "graph": fwd.schedule.graph, "task": fwd.program.task_ids[t.task],
                                "start": origin + t.start, "end": origin + t.end})
    return out


def test_the_runtimes_measured_timelines_keep_the_reference_rule():
    """Both ranks' timelines (one monotonic clock on one host) merged: a put's signals of
    its peer land while it runs, every other signal after its task ends."""
    ranks = spawn_gloo(_runtime_traces, 2, timeout=240)
    for runs in zip(*ranks, strict=True):
        g = runs[0]["graph"]
        start, end = np.full(g.num_tasks, np.nan), np.full(g.num_tasks, np.nan)
        for r in runs:
            start[r["task"]], end[r["task"]] = r["start"], r["end"]
        check_trace(g, start, end, Signals.PUTS_LAND_DURING)
