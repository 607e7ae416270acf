"""The plan of the link alone (``hpmoe.schedule.link_plan``) on hand-built exchanges: which
put returns which rows, the busiest ingress port first, the stage order kept when every
port has the same work, and a skewed exchange that the stage order leaves idle."""

from __future__ import annotations

import dataclasses

import numpy as np

from hpmoe.ir.graph import TaskKind
from hpmoe.schedule import critical_path as cp
from hpmoe.schedule.link_plan import mirror_puts, planned_put_order
from hpmoe.sim.cost import task_costs
from hpmoe.sim.simulate import simulate

from .handmade import UNIT_HW, build, put

HW = dataclasses.replace(UNIT_HW, vector_workers=4)  # two link workers per rank


def _plan(tasks, ep, senders=1):
    g = build(ep, tasks, {})
    return planned_put_order(g, task_costs(g, HW), cp.put_stage(g), senders)


def test_a_combine_put_returns_the_rows_of_the_dispatch_put_with_its_index():
    tasks = [put(0, 1, 1), put(0, 1, 2), put(1, 0, 3),
             put(1, 0, 1, kind=TaskKind.COMBINE), put(1, 0, 2, kind=TaskKind.COMBINE),
             put(0, 1, 3, kind=TaskKind.COMBINE), put(0, 1, 4, kind=TaskKind.COMBINE)]
    g = build(2, tasks, {})
    assert list(mirror_puts(g, task_costs(g, HW).transfer > 0)) == [-1, -1, -1, 0, 1, 2, -1]


def test_a_rank_sends_to_the_busiest_ingress_port_first():
    # rank 0's stage order is 1 then 2, but rank 2 has 40 µs to receive and rank 1 only 10
    position = _plan([put(0, 1, 10), put(0, 2, 10), put(1, 2, 30)], 3)
    assert position[1] < position[0]


def test_equal_work_at_every_port_keeps_the_stage_order():
    tasks = [put(s, d, 10) for s in range(3) for d in range(3) if d != s]  # rank s: s+1, then s+2
    position = _plan(tasks, 3)
    for s in range(3):
        mine = [i for i, t in enumerate(tasks) if t.rank == s]
        by_stage = sorted(mine, key=lambda i: (tasks[i].peer - s) % 3)
        assert sorted(mine, key=lambda i: position[i]) == by_stage, s


def test_a_skewed_exchange_keeps_the_busiest_port_busy():
    """Pair traffic (µs) whose stage order lets ranks drift onto one ingress port at once:
    the planned order ends near the link bound, the stage order well above it."""
    pair = np.array([[0, 15, 15, 10], [5, 0, 15, 10], [5, 5, 0, 10], [5, 15, 5, 0]])
    g = build(4, [put(s, d, float(pair[s, d])) for s in range(4) for d in range(4) if d != s
                  for _ in range(2)], {})
    costs, workers = task_costs(g, HW), HW.workers
    assert cp.link_workers(workers, costs) == 2
    made = {o: simulate(cp.list_schedule(g, costs, workers, o), HW) for o in cp.PutOrder}
    bound = made[cp.PutOrder.PLANNED].bounds.link
    assert made[cp.PutOrder.PLANNED].makespan <= 1.05 * bound
    assert made[cp.PutOrder.STAGES].makespan >= 1.15 * bound
