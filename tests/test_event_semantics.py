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


def device_trace(p: PackedProgram, rng: np.random.Generator, calls: int = 2) -> list[tuple]:
    """Run ``p`` as the persistent kernel does, from its arrays alone: each call starts
    the counters from zero; each queue takes its tasks in order; a task starts once its
    waited counter reaches ``wait_threshold`` and signals ``sig_event`` when it ends.  At
    every step one random queue starts its ready head or ends its running task.  (start,
    end) [n] step numbers per call."""
    traces = []
    for _ in range(calls):
        counters = np.zeros(p.num_events, np.int64)
        head = p.queue_ptr[:-1].astype(np.int64)
        running = np.full(p.num_queues, -1)
        start, end = np.full(p.num_tasks, np.nan), np.full(p.num_tasks, np.nan)
        clock = 0
        while True:
            moves = [q for q in range(p.num_queues) if running[q] >= 0 or (
                head[q] < p.queue_ptr[q + 1] and _ready(p, counters, int(p.queue_task[head[q]])))]
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


def _ready(p: PackedProgram, counters: np.ndarray, t: int) -> bool:
    ev = p.wait_event[t]
    return ev < 0 or counters[ev] >= p.wait_threshold[t]


@pytest.mark.parametrize("policy", QUEUE_POLICIES, ids=lambda p: p.value)
def test_the_packed_arrays_keep_the_reference_rule_under_random_device_interleavings(policy):
    for name, plan, s in _schedules(policy, "h100", dedup=False):
        p = pack(s, buffer_space(plan))
        for seed in range(4):
            for start, end in device_trace(p, np.random.default_rng(seed)):
                assert not np.isnan(end).any(), f"{name}: the device model stalled"
                check_trace(s.graph, start, end)


def _queues(p: PackedProgram) -> list[list[int]]:
    return [p.queue_task[p.queue_ptr[q]:p.queue_ptr[q + 1]].tolist() for q in range(p.num_queues)]


def _signals(p: PackedProgram) -> list[list[int]]:
    return [p.sig_event[p.sig_ptr[i]:p.sig_ptr[i + 1]].tolist() for i in range(p.num_tasks)]


def must_end_before(p: PackedProgram) -> list[int]:
    """Per task i of ``p``, a bitset of the tasks that end before i starts in every run
    of its arrays: the tasks before i on its queue (a queue runs one task at a time, in
    order) and, transitively, the signallers of every wait that only all of its event's
    signals meet.  i's own wait is left out: what the other waits imply of it."""
    count = np.bincount(p.sig_event, minlength=p.num_events)
    by_event: list[list[int]] = [[] for _ in range(p.num_events)]
    for i, events in enumerate(_signals(p)):
        for e in events:
            by_event[e].append(i)
    prev = [-1] * p.num_tasks
    for tasks in _queues(p):
        for a, b in zip(tasks, tasks[1:], strict=False):
            prev[b] = a
    before, ended = [0] * p.num_tasks, [None] * p.num_tasks  # ended: with i's own wait
    pending = list(range(p.num_tasks))
    while pending:  # each pass settles the tasks whose dependencies are settled
        rest = []
        for i in pending:
            e = int(p.wait_event[i])
            full = by_event[e] if e >= 0 and count[e] == p.wait_threshold[i] else []
            if any(ended[d] is None for d in [prev[i], *full] if d >= 0):
                rest.append(i)
                continue
            before[i] = 0 if prev[i] < 0 else ended[prev[i]] | 1 << prev[i]
            ended[i] = before[i]
            for d in full:
                ended[i] |= ended[d] | 1 << d
        assert len(rest) < len(pending), "the packed queues deadlock"
        pending = rest
    return before


def hold_trace(p: PackedProgram, t: int, hold: int, full: int) -> tuple[np.ndarray, np.ndarray]:
    """One call of ``p`` as ``device_trace`` runs it, by an adversary to task ``t``'s
    wait: ``t`` starts as soon as its arrays let it; ``hold`` neither starts nor ends,
    and no task ends that would bring ``t``'s event to ``full`` signals, while anything
    else can move.  (start, end) [n] step numbers."""
    queues, signals, ev = _queues(p), _signals(p), int(p.wait_event[t])
    wait, need = p.wait_event.tolist(), p.wait_threshold.tolist()
    counters, head, running = [0] * p.num_events, [0] * len(queues), [-1] * len(queues)
    start, end = np.full(p.num_tasks, np.nan), np.full(p.num_tasks, np.nan)

    def move(q: int) -> str | None:
        """What queue ``q`` can do now: t's start, a held move, any other, or nothing."""
        i = running[q]
        if i >= 0:
            return "held" if i == hold or counters[ev] + signals[i].count(ev) >= full else "any"
        if head[q] == len(queues[q]):
            return None
        i = queues[q][head[q]]
        if wait[i] >= 0 and counters[wait[i]] < need[i]:
            return None
        return "t" if i == t else "held" if i == hold else "any"
    for clock in range(2 * p.num_tasks):  # each step starts or ends one task
        first: dict[str | None, int] = {}
        for q in range(len(queues)):
            first.setdefault(move(q), q)
        q = first.get("t", first.get("any", first.get("held")))
        if q is None:
            break
        i = running[q]
        if i >= 0:
            end[i], running[q] = clock, -1
            for e in signals[i]:
                counters[e] += 1
        else:
            i = queues[q][head[q]]
            start[i], running[q], head[q] = clock, i, head[q] + 1
    return start, end


def test_every_packed_threshold_one_too_low_is_caught_or_implied_by_the_other_waits():
    """A packer that lowers one waited threshold by one, for each wait of the program in
    turn.  Where the tasks that end before the waiter anyway (``must_end_before``) bring
    its event to the full threshold, the lowered one is implied and no valid run can
    tell: an equivalent mutant (here the second and later column tiles of an expert's
    GEMM and of the shared expert's down GEMM, behind a first tile on the same queue that
    waited for the whole event, and a DISPATCH behind its own PERMUTE).  Every other
    mutant is caught: an adversary holding back one signaller the waiter need not wait
    for starts it early, and the reference names it."""
    plan, s = _forward(RoutingKind.ZIPF, SchedulePolicy.HYPERPARALLEL)
    p = pack(s, buffer_space(plan))
    before, signals = must_end_before(p), _signals(p)
    equivalent, caught = [], []
    for t in np.flatnonzero(p.wait_event >= 0).tolist():
        ev, full = int(p.wait_event[t]), int(p.wait_threshold[t])
        senders = [i for i, events in enumerate(signals) for e in events if e == ev]
        free = [i for i in senders if not before[t] >> i & 1]
        if len(senders) - len(free) >= full:
            equivalent.append(t)
            continue
        low = p.wait_threshold.copy()
        low[t] -= 1
        broken = dataclasses.replace(p, wait_threshold=low)
        for hold in free:
            start, end = hold_trace(broken, t, hold, full)
            try:
                check_trace(s.graph, start, end)
            except GraphError as err:
                assert s.graph.task(t) in str(err)
                caught.append(t)
                break
        else:
            raise AssertionError(f"lowering the threshold of {s.graph.task(t)} went unnoticed")
    assert equivalent and caught and len(equivalent) + len(caught) == int((p.wait_event >= 0).sum())


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
