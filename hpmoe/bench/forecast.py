"""Measurements behind the bench's cost models: the calibrated ``cpu`` profile adapted
to how the runtime runs (worker counts, cores per rank, the executor's own per-task
cost, the link measured over the transport in use), agreed by every rank.  The
forecasts are ``sim.forecast``'s, the decision ``schedule.auto``'s.

Every input is measured (calibration, link, executor overhead, per-step setup
times); nothing is fitted to the outcome.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ..ir.schedule import WorkerCounts
from ..runtime.session import RuntimeConfig
from ..runtime.transport.base import TransportKind
from ..runtime.transport.dist import HEADER_TAG
from ..schedule.auto import saved_profile
from ..sim.calibrate import WEIGHT_BYTES, KernelGemm, torch_threads
from ..sim.forecast import HostCosts, runtime_hardware
from ..sim.hardware import HardwareModel
from .overhead import loaded_cost, per_call, process_cpu, wake_latency


def agreed_profile(group: dist.ProcessGroup | None) -> HardwareModel | None:
    """Group rank 0's calibrated ``cpu`` profile (None when it has none), on every rank."""
    box: list = [None]
    if dist.get_rank(group) == 0:
        profile = saved_profile()
        box[0] = None if profile is None else profile.to_dict()
    dist.broadcast_object_list(box, group=group, group_src=0)
    return None if box[0] is None else HardwareModel.from_dict(box[0])


def measure_link(group: dist.ProcessGroup | None, nbytes: int, repeats: int = 8) -> tuple[float, float]:
    """(bytes/s per rank and direction, seconds of latency) of the runtime's puts:
    every rank ``isend``s ``nbytes`` to every other rank at once, back to back as a
    region's stream of puts; the slowest rank's best of ``repeats``, latency from
    64-byte messages."""
    big = _exchange_seconds(group, nbytes, repeats, False, 0.0, min)
    small = _exchange_seconds(group, 64, repeats, False, 0.0, min)
    world = dist.get_world_size(group)
    return (world - 1) * (nbytes - 64) / max(big - small, 1e-9), small


def measure_put_cpu(group: dist.ProcessGroup | None, put_bytes: int, compute: Callable[[], object],
                    puts: int = 32, repeats: int = 3) -> float:
    """Host CPU seconds per put of the ``dist`` transport's traffic, issued as a region
    issues them: one at a time, ``compute`` (a GEMM tile) run between consecutive puts.
    Every rank sends ``puts`` puts of ``put_bytes`` to every other rank, each followed
    by its 8-byte header, every receive posted first, and a thread per peer waits on
    each header and then its data, as the transport's progress thread does.  The
    process's CPU (every thread, user and kernel) over the exchange, less the thread CPU
    of the ``compute`` calls, per put it sent (the receiving side of as many included);
    the slowest rank's median of ``repeats`` after one untimed exchange.  A burst of
    puts shares its threads' wake-ups and costs 2-3x less per put than spaced ones.
    Collective."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    peers = [p for p in range(world) if p != rank]
    data = torch.zeros(put_bytes, dtype=torch.uint8, device="cpu")
    header = torch.zeros(1, dtype=torch.int64, device="cpu")
    inbox = torch.empty(len(peers), puts, put_bytes, dtype=torch.uint8, device="cpu")
    headers = torch.empty(len(peers), puts, dtype=torch.int64, device="cpu")
    samples = []
    for _ in range(repeats + 1):
        dist.barrier(group=group)
        cpu = process_cpu()
        receivers = [threading.Thread(target=_receive, daemon=True, args=(
            [(dist.irecv(inbox[j, k], group=group, group_src=p, tag=1 + k),
              dist.irecv(headers[j, k:k + 1], group=group, group_src=p, tag=HEADER_TAG + k))
             for k in range(puts)],)) for j, p in enumerate(peers)]
        for r in receivers:
            r.start()
        sends, computing = [], 0.0
        for k in range(puts):
            sends += [dist.isend(t, group=group, group_dst=p, tag=tag) for p in peers
                      for t, tag in ((data, 1 + k), (header, HEADER_TAG + k))]
            start = time.thread_time()
            compute()
            computing += time.thread_time() - start
        for r in receivers:
            r.join()
        for w in sends:
            w.wait()
        samples.append((process_cpu() - cpu - computing) / (puts * len(peers)))
    return float(np.median(slowest_rank(np.array(samples[1:]), group)))


def _receive(works: list[tuple[dist.Work, dist.Work]]) -> None:
    """Wait on each (data, header) receive in turn, header first, as the ``dist``
    transport's progress thread does."""
    for data, head in works:
        head.wait()
        data.wait()


def measure_host_memory(group: dist.ProcessGroup | None, nbytes: int = 256 << 20,
                        seconds: float = 0.5) -> float:
    """Bytes/s (read + write) the host's memory serves while every core streams: each
    rank of ``group`` (all on this host) runs ``cores // ranks`` threads (at least one),
    each copying its own ``nbytes`` with ``Tensor.copy_`` (the calibration's ``copy_bw``,
    one intra-op thread) for ``seconds``, all at once after an untimed copy; the sum of
    every thread's rate over the group.  Collective."""
    streams = max(1, len(os.sched_getaffinity(0)) // dist.get_world_size(group))
    pairs = [(torch.ones(nbytes, dtype=torch.uint8, device="cpu"), torch.empty(nbytes, dtype=torch.uint8,
                                                                               device="cpu"))
             for _ in range(streams)]
    rates = [0.0] * streams

    def stream(j: int) -> None:
        src, dst = pairs[j]
        rates[j] = 2.0 * nbytes / per_call(lambda: dst.copy_(src), seconds)[0]
    with torch_threads(1):
        for src, dst in pairs:
            dst.copy_(src)
        dist.barrier(group=group)
        workers = [threading.Thread(target=stream, args=(j,), daemon=True) for j in range(streams)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    total = torch.tensor([sum(rates)], dtype=torch.float64, device="cpu")
    dist.all_reduce(total, group=group)
    return float(total.item())


def measure_all_to_all(group: dist.ProcessGroup | None, nbytes: int, repeats: int = 3,
                       idle_s: float = 0.02) -> float:
    """Effective bytes/s per rank and direction of the serialized baseline's
    ``all_to_all_single`` with ``nbytes`` per peer, each after ``idle_s`` of silence
    as between its compute phases (TCP restarts slow after idle): the slowest rank's
    median of ``repeats``, startup included (no separate latency)."""
    seconds = _exchange_seconds(group, nbytes, repeats, True, idle_s, np.median)
    return (dist.get_world_size(group) - 1) * nbytes / seconds


def _exchange_seconds(group: dist.ProcessGroup | None, nbytes: int, repeats: int,
                      collective: bool, idle_s: float, pick: Callable) -> float:
    """``pick`` (min, median) over ``repeats`` of the slowest rank's seconds for one
    exchange of ``nbytes`` per peer, after two untimed ones (connections warm)."""
    world = dist.get_world_size(group)
    send = torch.zeros(world * nbytes, dtype=torch.uint8, device="cpu")
    recv = torch.empty(world * nbytes, dtype=torch.uint8, device="cpu")
    times = []
    for i in range(repeats + 2):
        dist.barrier(group=group)
        time.sleep(idle_s)
        t0 = time.perf_counter()
        _exchange(group, send, recv, nbytes, collective)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return float(pick(slowest_rank(np.array(times), group)))


def _exchange(group: dist.ProcessGroup | None, send: torch.Tensor, recv: torch.Tensor, nbytes: int,
              collective: bool) -> None:
    if collective:
        dist.all_to_all_single(recv, send, group=group)
        return
    rank = dist.get_rank(group)
    peers = [p for p in range(dist.get_world_size(group)) if p != rank]
    works = [dist.isend(send[p * nbytes:(p + 1) * nbytes], group=group, group_dst=p) for p in peers]
    works += [dist.irecv(recv[p * nbytes:(p + 1) * nbytes], group=group, group_src=p) for p in peers]
    for w in works:
        w.wait()


def slowest_rank(values: np.ndarray, group: dist.ProcessGroup | None) -> np.ndarray:
    """Elementwise max over the group's ranks of ``values`` (float64 array)."""
    t = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float64)).clone()
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.numpy()


class ShareProbe:
    """The calibration's own 128 x 512 x 512 ``KernelGemm`` tile in ``dtype``, timed in
    windows while every rank of the group runs it at once: what fraction of the
    profile's GEMM rate a rank gets now (``share``).  It captures ranks sharing cores,
    whatever else runs on the host, and the host running slower or faster than when it
    was calibrated."""

    def __init__(self, profile: HardwareModel, dtype: torch.dtype) -> None:
        self.tile = KernelGemm(128, 512, dtype, WEIGHT_BYTES, torch.Generator().manual_seed(0))
        self.tile()
        self.expected = float(profile.matrix_time(128, 512, 512, dtype))
        self.call_cost = profile.task_overhead

    def window(self, seconds: float, settle: float = 0.0) -> float:
        """Seconds per tile call over ``seconds``, after ``settle`` seconds of untimed
        calls (the scheduler places every rank's thread).  Call it on every rank at once."""
        if settle > 0:
            per_call(self.tile, settle)
        return per_call(self.tile, seconds)[0]

    def share(self, per_call: list[float], group: dist.ProcessGroup | None) -> float:
        """The profile's rate over the rate of ``per_call`` (every rank's windows, taken
        at the same times): the median over windows of the slowest rank.  Above 1 when
        the host runs faster than when it was calibrated.  Collective."""
        slowest = float(np.median(slowest_rank(np.array(per_call), group)))
        return self.expected / self.tile.compute_seconds(slowest, self.call_cost)


def concurrent_share(probe: ShareProbe, group: dist.ProcessGroup | None, seconds: float = 0.5,
                     windows: int = 5) -> float:
    """``probe.share`` now: ``windows`` windows over ``seconds`` after a settling window,
    every rank at once.  Collective."""
    dist.barrier(group=group)
    window = seconds / windows
    per_call = [probe.window(window, settle=window if i == 0 else 0.0) for i in range(windows)]
    return probe.share(per_call, group)


@dataclass(frozen=True)
class Models:
    """runtime: the cost model of hpmoe's runtime on its transport.  baseline: the
    same with the link the serialized baseline gets from ``all_to_all_single``, no host
    CPU per put (its exchanges run between compute phases, their CPU inside the
    measured rate), no wake latency (it runs in one thread) and no launch (no
    executor).  link, a2a: (bytes/s, latency s) of torch.distributed point-to-point and
    of ``all_to_all_single`` (None for one rank).  host: the runtime's measured costs
    on this host (``HostCosts``: ``concurrent_share``, the executor's CPU per task, the
    vector slowdown and the launch from ``loaded_cost``, the ``dist`` transport's
    ``measure_put_cpu``, ``overhead.wake_latency``, each the slowest rank's;
    ``measure_host_memory``).  probe: the ``ShareProbe`` the share was measured with
    (this process's, for measuring it again).  The rest are the inputs both models were
    built from (``at_share`` rebuilds them)."""

    runtime: HardwareModel
    baseline: HardwareModel
    link: tuple[float, float] | None
    a2a: tuple[float, float] | None
    host: HostCosts
    profile: HardwareModel
    transport: TransportKind
    workers: WorkerCounts
    probe: ShareProbe

    @property
    def share(self) -> float:
        return self.host.share

    def at_share(self, share: float, group: dist.ProcessGroup | None) -> Models:
        """The same models with compute rates for ``share`` instead.  Collective."""
        return _build(self.profile, self.transport, self.workers, self.link, self.a2a,
                      dataclasses.replace(self.host, share=share), group, self.probe)


def agreed_models(profile: HardwareModel, runtime: RuntimeConfig, workers: WorkerCounts,
                  dtype: torch.dtype, nbytes: int, put_bytes: int, group: dist.ProcessGroup | None,
                  link_rate: float | None = None) -> Models:
    """Both models, built on group rank 0 from measurements and used by every rank
    (schedules computed from them must agree).  Each path's link is measured with its
    own traffic, ``nbytes`` per peer (a balanced dispatch): back-to-back point-to-point
    transfers for the runtime's stream of puts — or, for a shaped link, its configured
    ``link_rate`` (bytes/s), with the measured latency — and ``all_to_all_single``
    after an idle gap for the baseline's bursts between compute phases.  The ``dist``
    transport's host CPU per put is measured with ``put_bytes`` puts.  Every rank
    measures at once.  Collective."""
    world = dist.get_world_size(group)
    link = measure_link(group, nbytes) if world > 1 else None
    if link is not None and link_rate is not None:
        link = (link_rate, link[1])
    a2a = (measure_all_to_all(group, nbytes), 0.0) if world > 1 else None
    probe = ShareProbe(profile, dtype)
    share = concurrent_share(probe, group)  # ends in an all-reduce: the ranks start together
    host_bw = measure_host_memory(group)
    loaded = loaded_cost(thread_cpu=runtime.thread_cpu)
    dist.barrier(group=group)
    wake = wake_latency()
    outside, slowdown, wake, launch = slowest_rank(
        np.array([loaded.outside_s, loaded.vector_slowdown, wake, loaded.launch_s]), group)
    own_cpu = world > 1 and runtime.transport is TransportKind.DIST
    put_cpu = measure_put_cpu(group, put_bytes, probe.tile) if own_cpu else 0.0
    host = HostCosts(share=share, executor_overhead=float(outside), vector_slowdown=float(slowdown),
                     put_cpu=put_cpu, wake_latency=float(wake), host_mem_bw=host_bw,
                     launch_overhead=float(launch))
    return _build(profile, runtime.transport, workers, link, a2a, host, group, probe)


def _build(profile: HardwareModel, transport: TransportKind, workers: WorkerCounts,
           link: tuple[float, float] | None, a2a: tuple[float, float] | None, host: HostCosts,
           group: dist.ProcessGroup | None, probe: ShareProbe) -> Models:
    """``Models`` from agreed measurements, built on group rank 0.  Collective."""
    world = dist.get_world_size(group)
    box: list = [None]
    if dist.get_rank(group) == 0:
        own = link if transport is TransportKind.DIST else None
        one_thread = dataclasses.replace(host, put_cpu=0.0, wake_latency=0.0, launch_overhead=0.0)
        box[0] = (runtime_hardware(profile, workers, own, host, world).to_dict(),
                  runtime_hardware(profile, workers, a2a, one_thread, world).to_dict())
    dist.broadcast_object_list(box, group=group, group_src=0)
    runtime, baseline = (HardwareModel.from_dict(d) for d in box[0])
    return Models(runtime, baseline, link=link, a2a=a2a, host=host, profile=profile, transport=transport,
                  workers=workers, probe=probe)
