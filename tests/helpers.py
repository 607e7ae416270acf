"""Small builders shared by the foundation tests."""

from __future__ import annotations

import dataclasses
import threading
import time
import types
from dataclasses import dataclass

import numpy as np
import torch

from hpmoe.engine import ExactPath, KernelByKernelPath, TritonPath
from hpmoe.engine.door import CallRecord
from hpmoe.ir.graph import GraphBuilder, TaskBlock, TaskGraph, TaskKind
from hpmoe.nn.conformance import PERSISTENT_TILES
from hpmoe.nn.layer import MoE
from hpmoe.routing import RoutingKind, RoutingPlan, plan_routing, synthetic_routing
from hpmoe.schedule import Schedule, SchedulePolicy, schedule, verify_schedule
from hpmoe.schedule.auto import Path
from hpmoe.sim.hardware import HardwareModel
from hpmoe.sim.simulate import simulate
from hpmoe.spec import GateKind, GluForm, MoESpec, ParallelSpec, TileSpec, preset
from hpmoe.weights import ExpertWeights

TINY_TILES = TileSpec(rows=3, gemm_rows=4, gemm_cols=8)
# the CUDA tests' layer (pytest -m gpu): big enough for Triton's smallest dot tiles
GPU_SPEC = MoESpec(hidden=256, ffn=128, experts=16, top_k=4, shared_experts=1, gate=GateKind.SOFTMAX,
                   dtype=torch.float32)
GPU_TILES = TileSpec(rows=32, gemm_rows=64, gemm_cols=128)
GPU_TOKENS = 64
GRAD_NAMES = ("dx", "dweights", "dw13", "dw2", "dshared_w13", "dshared_w2")
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


class KernelClock:
    """A clock that only the code under test advances, in place of the host's: ``spend``
    adds seconds to the wall clock and to the calling thread's CPU (a kernel computing),
    ``idle`` to the wall clock only (a kernel sleeping), ``outside`` to the process's CPU
    only (work no kernel's thread clock sees).  A figure computed from its readings is
    exact, whatever else runs on the host."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.wall, self.beside = 0.0, 0.0
        self._cpu: dict[int, float] = {}

    def spend(self, seconds: float) -> None:
        with self._lock:
            self.wall += seconds
            me = threading.get_ident()
            self._cpu[me] = self._cpu.get(me, 0.0) + seconds

    def idle(self, seconds: float) -> None:
        with self._lock:
            self.wall += seconds

    def outside(self, seconds: float) -> None:
        with self._lock:
            self.beside += seconds

    def perf_counter(self) -> float:
        return self.wall

    def perf_counter_ns(self) -> int:
        return round(self.wall * 1e9)

    def thread_time(self) -> float:
        return self._cpu.get(threading.get_ident(), 0.0)

    def thread_time_ns(self) -> int:
        return round(self.thread_time() * 1e9)

    def process_cpu(self) -> float:
        """CPU seconds of every thread, and what was spent outside them."""
        with self._lock:
            return sum(self._cpu.values()) + self.beside

    def time_module(self) -> types.SimpleNamespace:
        """A stand-in for the ``time`` module: these clocks, the host's ``monotonic``
        (deadlines and polls keep running on it) and ``sleep``."""
        return types.SimpleNamespace(perf_counter=self.perf_counter, perf_counter_ns=self.perf_counter_ns,
                                     thread_time=self.thread_time, thread_time_ns=self.thread_time_ns,
                                     monotonic=time.monotonic, sleep=time.sleep, strftime=time.strftime)


def ran(where: object, path: type | tuple[type, ...], tokens: int | None = None, trial: bool | None = None,
        **fields: object) -> list[CallRecord]:
    """Assert that the last region call of ``where`` ran ``path`` (``hpmoe.engine.ExactPath``,
    ``RuntimePath``, ``TritonPath``, ``KernelByKernelPath``; a tuple of them: any one, as a
    tuning trial may run) with the path object's ``fields`` (``ep=2``, ``tiles=...``,
    ``policy=...``) and, where given, ``tokens`` per (virtual) rank after padding and
    ``trial`` (a tuning trial or not).  ``where``: an ``hpmoe.MoE``, a model holding some
    (every one that has run; one at least), a ``CallRecord``, or a sequence of any of
    these.  Returns the records; raises AssertionError naming what ran instead."""
    records = _records(where)
    if not records:
        raise AssertionError(f"no hpmoe.MoE in {type(where).__name__} has run a region call")
    for record in records:
        got = record.path
        if not isinstance(got, path):
            names = " or ".join(p.__name__ for p in (path if isinstance(path, tuple) else (path,)))
            raise AssertionError(f"ran {type(got).__name__}, not {names}: {record}")
        wrong = {k: getattr(got, k, "(no such field)") for k, v in fields.items()
                 if getattr(got, k, object()) != v}
        mine = {k: v for k, v in (("tokens", tokens), ("trial", trial)) if v is not None}
        wrong |= {k: getattr(record, k) for k, v in mine.items() if getattr(record, k) != v}
        if wrong:
            want = {k: {**fields, **mine}[k] for k in wrong}
            raise AssertionError(f"ran {type(got).__name__} with {wrong}, not {want}")
    return records


def _records(where: object) -> list[CallRecord]:
    """The last call of each hpmoe.MoE in ``where`` that has run (see ``ran``)."""
    if isinstance(where, CallRecord):
        return [where]
    if isinstance(where, MoE):
        if where.last_call is None:
            raise AssertionError("the layer has run no region call")
        return [where.last_call]
    if isinstance(where, torch.nn.Module):
        return [m.last_call for m in where.modules() if isinstance(m, MoE) and m.last_call is not None]
    return [r for item in where for r in _records(item)]


@dataclass(frozen=True)
class Pin:
    """A one-process path pinned: the ``hpmoe.MoE`` options that pin it, and the path
    object's class and fields that ``ran`` then expects of a call."""

    options: dict
    kind: type
    fields: dict


def pin(path: Path, ep: int = 1, tiles: TileSpec | None = None) -> Pin:
    """``path`` pinned on ``ep`` virtual ranks: TASKFLOW (the exact executors in task-id
    order), KERNEL_BY_KERNEL or PERSISTENT (``backend="triton"``: on the CPU, the Triton
    interpreter); ``tiles``: default TINY_TILES, PERSISTENT_TILES for PERSISTENT."""
    if tiles is None:
        tiles = PERSISTENT_TILES if path is Path.PERSISTENT else TINY_TILES
    where = dict(virtual_ep=ep, tiles=tiles)
    if path is Path.TASKFLOW:
        return Pin(dict(schedule=None, **where), ExactPath, dict(ep=ep, tiles=tiles, order=None))
    if path is Path.KERNEL_BY_KERNEL:
        return Pin(dict(backend="kernel_by_kernel", **where), KernelByKernelPath, dict(session=None))
    if path is Path.PERSISTENT:
        return Pin(dict(backend="triton", **where), TritonPath, dict(ep=ep, tiles=tiles))
    raise ValueError(f"path={path!r}: TASKFLOW, KERNEL_BY_KERNEL or PERSISTENT")


def weights_on(w: ExpertWeights, device: torch.device) -> ExpertWeights:
    """``w`` with every tensor it holds moved to ``device``."""
    moved = {f.name: getattr(w, f.name).to(device) for f in dataclasses.fields(w)
             if isinstance(getattr(w, f.name), torch.Tensor)}
    return dataclasses.replace(w, **moved)
