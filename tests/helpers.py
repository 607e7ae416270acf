"""Small builders shared by the foundation tests."""

from __future__ import annotations

import time

import numpy as np
import torch

from hpmoe.ir.graph import GraphBuilder, TaskBlock, TaskGraph, TaskKind
from hpmoe.routing import RoutingKind, RoutingPlan, plan_routing, synthetic_routing
from hpmoe.schedule import Schedule, SchedulePolicy, schedule, verify_schedule
from hpmoe.sim.hardware import HardwareModel
from hpmoe.sim.simulate import simulate
from hpmoe.spec import GateKind, GluForm, MoESpec, ParallelSpec, TileSpec, preset

TINY_TILES = TileSpec(rows=3, gemm_rows=4, gemm_cols=8)
# GPT-OSS's expert form: biases, gate/up interleaved, clamped SwiGLU (a limit low enough that
# the tiny layer's pre-activations cross it on both sides), up + 1
GPT_OSS_FORM = MoESpec(hidden=24, ffn=12, experts=8, top_k=3, gate=GateKind.SOFTMAX, dtype=torch.float32,
                       expert_bias=True, glu=GluForm(interleaved=True, alpha=1.702, limit=0.5, up_shift=1.0))


def tiny_plan(kind: RoutingKind = RoutingKind.ZIPF, ep: int = 2, tokens: int = 8, seed: int = 0,
              moe: MoESpec | None = None) -> RoutingPlan:
    moe = moe or preset("tiny")
    par = ParallelSpec(ep=ep, tokens_per_rank=tokens)
    return plan_routing(synthetic_routing(kind, moe, par, seed).ids, moe, par)


def chain_graph(waits: list[int], signals: list[list[int]], thresholds: list[int]) -> TaskGraph:
    """One-rank graph of VECTOR tasks: task i waits on ``waits[i]`` (-1: none) and
    signals the events ``signals[i]``; event e has threshold ``thresholds[e]``."""
    n = len(waits)
    z = np.zeros(n, np.int64)
    flat = [e for s in signals for e in s]
    block = TaskBlock(kind=TaskKind.SWIGLU, rank=z, peer=z, expert=z - 1, row0=np.arange(n),
                      row1=np.arange(n) + 1, col0=z, col1=z, dst_row0=z, flops=z, bytes=z, link_bytes=z,
                      wait=np.array(waits),
                      sig_count=np.array([len(s) for s in signals]), sig_rank=np.zeros(len(flat), np.int64),
                      sig_event=np.array(flat, np.int64))
    b = GraphBuilder(1, (0,))
    b.add(block)
    b.set_events(0, np.array(thresholds))
    return b.freeze()


def simulated_order(graph: TaskGraph, policy: SchedulePolicy,
                    hardware: HardwareModel) -> tuple[Schedule, np.ndarray]:
    """``policy``'s schedule of ``graph`` on ``hardware`` (checked deadlock-free) and its
    tasks in the order the simulator starts them (ties: by end, then task id)."""
    sched = schedule(graph, policy, hardware)
    verify_schedule(sched)
    tl = simulate(sched, hardware).timeline
    return sched, np.lexsort((np.arange(tl.num_tasks), tl.end, tl.start))


def burn(seconds: float) -> None:
    """Spend ``seconds`` of this thread's CPU."""
    t0 = time.thread_time()
    while time.thread_time() - t0 < seconds:
        pass
