"""CPU step time and peak memory of MoE training steps (forward + backward of a stack of layers):
``hpmoe.MoE`` with each ``recompute`` option (``hpmoe-nothing``, ``hpmoe-permutation``, the
default, and ``hpmoe-gemm``), next to autograd through the gate and ``refs.dense_moe`` on
the same parameters.

Each mode runs in two fresh subprocesses: one times the steps with the default
allocator; in the other, large allocations go through mmap (``MALLOC_MMAP_THRESHOLD_``)
so that the resident set follows live memory, and peak = the high-water mark of the
resident set during a step (reset through /proc/self/clear_refs) minus the resident
set just before it (with ``--ep``: the whole process's high-water mark).  Saved = bytes
held between forward and backward (tensors autograd saves, the taskflow's
``SavedActivations`` among them; parameters and the input excluded).

    .venv/bin/python benchmarks/bench_training.py [--preset small] [--tokens 4096]
        [--layers 1] [--virtual-ep 2 | --ep 2] [--steps 5] [--threads 1] [--backend kernel_by_kernel]
        [--schedule task-order] [--modes hpmoe-permutation,hpmoe-gemm] [--link 2gbit]

With ``--ep N`` each mode runs on N gloo ranks on the runtime (per step, the slowest
rank's time and the largest rank's peak are reported; saved bytes are the largest
rank's); dense autograd has no distributed counterpart and is left out.  ``--link RATE`` runs the
ranks in a network namespace whose loopback is shaped to RATE (``launch.netns.shaped_loopback``:
one pipe the ranks share; needs root, ``ip`` and ``tc``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, fields, replace

import torch

from hpmoe import refs
from hpmoe.cli.common import dtype_choice
from hpmoe.launch.netns import shaped_loopback
from hpmoe.machine import record
from hpmoe.nn.layer import MoE
from hpmoe.routing import route
from hpmoe.runtime import RuntimeConfig, Session
from hpmoe.schedule import SchedulePolicy
from hpmoe.spec import MoESpec, Recompute, preset
from hpmoe.testing import spawn_gloo

MODES = ("dense-autograd", *(f"hpmoe-{r.value}" for r in Recompute))


@dataclass(frozen=True)
class Measurement:
    """One mode: step time (median / min ms over the steps), peak resident-set growth
    during a step (MiB, max over the steps) and bytes saved for backward (MiB)."""

    mode: str
    median_ms: float
    min_ms: float
    peak_mib: float
    saved_mib: float


def _status(field: str) -> int:
    """A /proc/self/status field in bytes."""
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+) kB", f.read()).group(1)) * 1024


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _forward(mode: str, layers: list[MoE], x: torch.Tensor) -> torch.Tensor:
    """The stack with residuals: h <- h + layer(h), by the taskflow or by autograd
    through the gate and refs.dense_moe."""
    h = x
    for layer in layers:
        if mode == "dense-autograd":
            w = layer.expert_weights()
            h = h + refs.dense_moe(h, w, route(h, w))
        else:
            h = h + layer(h)
    return h


def _saved_bytes(mode: str, layers: list[MoE], x: torch.Tensor) -> int:
    """Bytes autograd saves for backward (distinct storages, not parameters or x; every
    path hands what it keeps to ``save_for_backward``, the taskflows' state included)."""
    skip = {p.untyped_storage().data_ptr() for layer in layers for p in layer.parameters()}
    skip.add(x.untyped_storage().data_ptr())
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _forward(mode, layers, x)
    return sum(seen.values())


@dataclass(frozen=True)
class Setting:
    """What to measure: ``layers`` MoE layers of ``preset`` in ``dtype``.  ``ep`` > 0 runs
    that many processes on the runtime (gloo group, shared-memory transport, one matrix
    and one vector worker each), each with ``tokens`` tokens; else one process with
    ``tokens`` tokens over ``virtual_ep`` virtual ranks.  ``threads``: intra-op threads
    (per worker).  ``backend``: the layers' (``hpmoe.MoE(backend=...)``; auto: AUTO's choice);
    ``schedule``: a ``SchedulePolicy`` value, or "task-order" (one process: the taskflow's
    exact executors in task-id order)."""

    preset: str = "small"
    dtype: str = "auto"  # bf16 where this CPU computes it natively, else fp32
    tokens: int = 4096
    layers: int = 1
    virtual_ep: int = 2
    ep: int = 0
    steps: int = 5
    threads: int = 1
    backend: str = "auto"
    schedule: str = "auto"  # "task-order": the taskflow in task-id order (one process: the exact executors)

    @property
    def spec(self) -> MoESpec:
        return preset(self.preset, torch.bfloat16 if self.dtype == "bf16" else torch.float32)

    def argv(self) -> list[str]:
        pairs = ((f"--{f.name.replace('_', '-')}", getattr(self, f.name)) for f in fields(self))
        return [str(v) for pair in pairs for v in pair]


def _stack(mode: str, s: Setting, session: Session | None, rank: int
           ) -> tuple[list[MoE], torch.Tensor, torch.Tensor]:
    """``s.layers`` layers (seeds 0..layers-1) on ``session`` or virtual ranks; x and dy
    [s.tokens, H] of this rank."""
    spec = s.spec
    recompute = Recompute(mode.removeprefix("hpmoe-")) if mode.startswith("hpmoe-") else Recompute.PERMUTATION
    schedule = None if s.schedule == "task-order" else SchedulePolicy(s.schedule)
    layers = [MoE(spec, ep_group=session, virtual_ep=1 if session else s.virtual_ep, recompute=recompute,
                  seed=i, backend=s.backend, schedule=schedule) for i in range(s.layers)]
    g = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(s.tokens, spec.hidden, generator=g).to(spec.dtype)
    return layers, x, torch.randn(s.tokens, spec.hidden, generator=g).to(spec.dtype)


def measure(mode: str, what: str, s: Setting, session: Session | None = None, rank: int = 0) -> list[float]:
    """Per step after a warm-up: seconds (``what="time"``) or bytes of peak resident set
    (``what="memory"``): in one process, its growth during the step; on the runtime, the
    whole process's (worker threads keep their last region's buffers alive until the
    next region starts, so growth over the step's start would undercount).  For
    memory, the bytes saved for backward are appended last."""
    layers, x, dy = _stack(mode, s, session, rank)
    _forward(mode, layers, x).backward(dy)
    samples = []
    for _ in range(s.steps):
        for layer in layers:
            layer.zero_grad(set_to_none=True)
        _reset_peak()
        before, start = 0 if session else _status("VmRSS"), time.perf_counter()
        _forward(mode, layers, x).backward(dy)
        samples.append(time.perf_counter() - start if what == "time" else _status("VmHWM") - before)
    return samples + ([float(_saved_bytes(mode, layers, x))] if what == "memory" else [])


def _rank_measure(rank: int, world: int, mode: str, what: str, s: Setting) -> list[float]:
    """``measure`` on one rank of a gloo group, every layer on one shared session."""
    config = RuntimeConfig(threads=s.threads)
    with Session(config) as session:
        return measure(mode, what, s, session, rank)


def _measure_child(mode: str, what: str, s: Setting) -> list[float]:
    """One process, or ``s.ep`` gloo ranks (per step: the slowest / largest rank)."""
    if not s.ep:
        return measure(mode, what, s)
    per_rank = spawn_gloo(_rank_measure, s.ep, mode, what, s, threads=s.threads, timeout=1800)
    return [max(values) for values in zip(*per_rank, strict=True)]


def _run_child(mode: str, what: str, s: Setting, prefix: list[str]) -> list[float]:
    """``_measure_child`` in a fresh interpreter (run after ``prefix``: inside a shaped
    namespace with ``--link``); for memory, large allocations go through mmap so the
    resident set follows live memory (this slows steps down: time is measured in a
    separate interpreter with the default allocator)."""
    env = dict(os.environ)
    if what == "memory":
        env.update(MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    cmd = [*prefix, sys.executable, __file__, "--child", mode, what, *s.argv()]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def run(mode: str, s: Setting, prefix: list[str]) -> Measurement:
    times, memory = _run_child(mode, "time", s, prefix), _run_child(mode, "memory", s, prefix)
    return Measurement(mode, statistics.median(times) * 1e3, min(times) * 1e3, max(memory[:-1]) / 2**20,
                       memory[-1] / 2**20)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for f in fields(Setting):
        ap.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    ap.add_argument("--modes", default=None, help=f"comma-separated modes to run (default: all of {MODES})")
    ap.add_argument("--link", default=None, metavar="RATE",
                    help="with --ep: the ranks in a namespace whose loopback is shaped to RATE (e.g. 2gbit)")
    ap.add_argument("--child", nargs=2, metavar=("MODE", "WHAT"), help="internal: one measurement")
    a = ap.parse_args()
    s = Setting(**{f.name: getattr(a, f.name) for f in fields(Setting)})
    torch.set_num_threads(s.threads)
    if a.child:
        print(json.dumps(_measure_child(*a.child, s)))
        return
    record()
    dtype, why = dtype_choice(s.dtype, on_this_cpu=True)
    s = replace(s, dtype=dtype)
    if why:
        print(f"dtype {why}")
    where = (f"{s.tokens} tokens per rank, EP {s.ep} processes on the runtime" if s.ep
             else f"{s.tokens} tokens, virtual EP {s.virtual_ep}")
    where += f", loopback shaped to {a.link}" if a.link else ""
    print(f"{s.preset} {s.dtype}, {s.layers} layer(s), {where}, "
          f"{s.threads} thread(s), {s.steps} steps")
    peak = "peak RSS MiB (whole process)" if s.ep else "peak MiB (growth during the step)"
    print(f"| mode | step ms (median) | step ms (min) | {peak} | saved for backward MiB |")
    print("|---|---:|---:|---:|---:|")
    modes = MODES[1:] if s.ep else MODES
    if a.modes:
        unknown = sorted(set(a.modes.split(",")) - set(modes))
        if unknown:
            ap.error(f"--modes: {unknown} not among {modes}")
        modes = tuple(m for m in modes if m in a.modes.split(","))
    if a.link and not s.ep:
        ap.error("--link shapes the link between ranks: it needs --ep")
    with shaped_loopback(a.link) if a.link else contextlib.nullcontext([]) as prefix:
        for mode in modes:
            m = run(mode, s, prefix)
            print(f"| {m.mode} | {m.median_ms:.0f} | {m.min_ms:.0f} | {m.peak_mib:.1f} | {m.saved_mib:.1f} |",
                  flush=True)


if __name__ == "__main__":
    main()
