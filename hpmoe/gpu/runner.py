"""The host side of the persistent kernel: upload a ``PackedProgram``, launch, read back.

``DeviceProgram(packed, device, config)`` holds the device arrays and the event
counters of one region.  ``run(addresses)`` executes every queue once:

* on a CUDA device, ONE launch of ``len(queues)`` programs (every program must be
  resident: see ``residency``); a late wait ends in a ``RegionError`` whose
  ``HangReport`` names (worker, task, event, counter);
* otherwise in the Triton interpreter, in rounds: each launch runs every program up to
  its next unsatisfied wait; a round in which no queue advances raises ``GraphError``
  naming the stuck tasks.

Every call starts the counters and cursors from zero (one memset), so a wait's threshold
is the graph's at every call: ``launch`` (a training step's, without a sync) passes the
same arguments at every step (a CUDA graph replays them), and the counters never grow
past one call's signals.  Per-task start/end
stamps (global timer on a GPU, a logical clock in the interpreter) become the
simulator's ``Timeline``.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType

import numpy as np
import torch

from .core import (
    GraphError,
    HangReport,
    RegionError,
    TaskGraph,
    Timeline,
    WorkerReport,
    WorkerStatus,
    capturing,
    deprecated,
)
from .ops import aligned_addresses, aligned_layout
from .pack import PackedProgram
from .residency import KernelResources, SMLimits, check_resident, resident_programs

TL_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@functools.cache
def device_module(interpret: bool) -> ModuleType:
    """``hpmoe.gpu.device`` compiled for the GPU, or a copy of it built for the Triton
    interpreter (``triton.jit`` reads TRITON_INTERPRET when a function is decorated)."""
    try:
        import triton  # noqa: F401
    except ImportError as e:
        raise ImportError("the triton backend needs triton: pip install 'hpmoe[gpu]'") from e
    if not interpret and os.environ.get("TRITON_INTERPRET", "0") in ("0", ""):
        from . import device
        return device
    name = "hpmoe.gpu._device_interpreted" if interpret else "hpmoe.gpu._device_compiled"
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    try:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("device.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old
    return module


@dataclass(frozen=True)
class KernelConfig:
    """Tile sizes and launch options of the persistent kernel.

    bm, bn, bk: GEMM block (tl.dot needs >= 16 each); br, bc: rows and columns of a
    vector-operation chunk; num_warps / num_stages: Triton launch options (an aligned
    program's K loop keeps ``num_stages`` A and B blocks in flight through asynchronous
    copies); maxnreg: cap on registers per thread (None: ptxas's choice).  The fields'
    defaults, 128 x 128 x 64 blocks of 8 warps 3 stages deep, are the block of Triton's
    Hopper matmul tutorial; ``for_dtype`` widens 16-bit types' to 128 x 256
    (``python -m hpmoe.gpu.hopper`` reports a build).  Vector operations take 64 x 128
    chunks: on an H200 DeepSeek-V3's permute ran at 3.1 TB/s against 1.7 with 16-row ones
    (``benchmarks/gpu_sweep.py``, docs/lab)."""

    bm: int = 128
    bn: int = 128
    bk: int = 64
    br: int = 64
    bc: int = 128
    num_warps: int = 8
    num_stages: int = 3
    maxnreg: int | None = None

    def __post_init__(self) -> None:
        if self.maxnreg is not None and (not isinstance(self.maxnreg, int) or not 16 <= self.maxnreg <= 255):
            raise ValueError(f"KernelConfig.maxnreg must be None or an int in [16, 255], got "
                             f"{self.maxnreg!r}")
        for name in ("bm", "bn", "bk", "br", "bc", "num_warps", "num_stages"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"KernelConfig.{name} must be a positive int, got {v!r}")
        for name in ("bm", "bn", "bk", "br", "bc"):
            v = getattr(self, name)
            if v & (v - 1):
                raise ValueError(f"KernelConfig.{name}={v} must be a power of two")
        if min(self.bm, self.bn, self.bk) < 16:
            raise ValueError(f"KernelConfig GEMM block {self.bm}x{self.bn}x{self.bk}: tl.dot needs >= 16")

    @staticmethod
    def for_dtype(dtype: torch.dtype) -> KernelConfig:
        """The default block of ``dtype``: 128 x 256 x 64 for 16-bit types (an H200 ran
        DeepSeek-V3's GEMM phases at 546 / 450 TFLOP/s against 435 / 381 with 128 x 128;
        the sm_90 build takes 144 KiB of shared memory, one program per SM), 128 x 128 x 64
        for fp32 (a 128 x 256 fp32 block would need more shared memory than an SM has)."""
        return KernelConfig(bn=256) if dtype.itemsize == 2 else KernelConfig()


INTERPRETER_CONFIG = KernelConfig(bm=16, bn=16, bk=16, br=16, bc=16)


def launch_options(config: KernelConfig) -> dict:
    """Triton launch/compile options of ``config`` on a GPU.  The launch is cooperative:
    the driver refuses a grid whose programs cannot all be resident at once (other
    kernels, MPS, partitions), where a normal launch would leave waiting programs
    spinning on ones that never start."""
    out = {"num_warps": config.num_warps, "num_stages": config.num_stages, "launch_cooperative_grid": True}
    if config.maxnreg is not None:
        out["maxnreg"] = config.maxnreg
    return out


@dataclass(frozen=True)
class RunInfo:
    """What one call did: launches (1 on a GPU, rounds in the interpreter), wall seconds
    on the host, and the stamps [n, 2] int64 (or None)."""

    launches: int
    seconds: float
    stamps: np.ndarray | None

    @property
    def epoch(self) -> int:
        """Deprecated: the call number the counters counted from (0 for every call now)."""
        deprecated("RunInfo.epoch", "every call starts its counters from zero, so none has a call number")
        return 0


class DeviceProgram:
    """A packed region resident on one device, with its event counters and its queues'
    cursors: one tensor, zeroed by one memset at the start of every call (``run``,
    ``launch``, ``launcher``), so a call's thresholds are the graph's and its kernel
    arguments are the same at every call (a CUDA graph replays a captured launch as it is)."""

    def __init__(self, packed: PackedProgram, device: torch.device | str, dtype: torch.dtype,
                 config: KernelConfig | None = None, interpret: bool | None = None):
        self.packed = packed
        self.device = torch.device(device)
        self.interpret = self.device.type != "cuda" if interpret is None else interpret
        if dtype not in TL_DTYPES:
            raise TypeError(f"dtype {dtype} is not supported by the triton backend ({list(TL_DTYPES)})")
        self.dtype = dtype
        self.config = config or (INTERPRETER_CONFIG if self.interpret else KernelConfig.for_dtype(dtype))
        self.arrays = {n: torch.from_numpy(a.copy()).to(self.device) for n, a in packed.arrays().items()}
        ld = packed.space.ld.reshape(-1).astype(np.int64)
        self.lds = torch.from_numpy(ld).to(self.device)
        q, n = packed.num_queues, max(packed.num_events, 1)
        # the counters, then the cursors: one memset zeroes both at each call
        self._zeroed = torch.zeros(n + q, dtype=torch.int32, device=self.device)
        self.counters = self._zeroed[:n]
        self.aligned = aligned_layout(packed.tasks, packed.space)
        # the cursors, launch()'s error rows and its unused stamp buffer
        self.launch_state = (self._zeroed[n:], torch.zeros(q, 4, dtype=torch.int32, device=self.device),
                             torch.zeros(1, 2, dtype=torch.int64, device=self.device))
        self.checked_variants: set[bool] = set()
        # launch()'s error rows as last copied to host memory (pinned on a GPU: copied without
        # waiting), read by the next launch
        self._seen = torch.zeros(q, 4, dtype=torch.int32, device="cpu", pin_memory=self.device.type == "cuda")
        self._seen_rows = self._seen.numpy()  # read without a tensor operation

    @property
    def failed(self) -> bool:
        """Deprecated: a late wait no longer puts the counters out of step (every call
        starts them from zero), so no program fails for good: always False."""
        deprecated("DeviceProgram.failed", "every call starts its counters from zero: the next call runs "
                   "after a late wait")
        return False

    def _aligned(self, addresses: torch.Tensor) -> bool:
        """The kernel variant for ``addresses``: aligned when the layout is and every
        hinted buffer starts on a 16-byte boundary (else the unhinted variant runs)."""
        return self.aligned and aligned_addresses(self.packed.tasks, addresses.cpu().numpy())

    # ------------------------------------------------------------------ launch

    def _kernel_args(self, addresses: torch.Tensor, errors: torch.Tensor, stamps: torch.Tensor,
                     clock: torch.Tensor, delays: torch.Tensor, deadline_ns: int) -> tuple:
        """The kernel's arguments (the cursors: ``launch_state``'s)."""
        return (*self.arrays.values(), addresses, self.lds, self.counters, self.launch_state[0], errors,
                stamps, clock, delays, deadline_ns)

    def run(self, addresses: torch.Tensor, *, deadline_s: float = 10.0, stamps: bool = False,
            delays_ns: np.ndarray | None = None, max_rounds: int | None = None) -> RunInfo:
        """Run every queue once and wait for it; raise ``RegionError`` (GPU: a wait
        passed ``deadline_s``) or ``GraphError`` (interpreter: no progress).  An earlier
        ``launch``'s late wait seen in host memory is raised first, as a launch raises it
        (the cursors it names are that launch's until this call starts)."""
        self.report(wait=False)
        if addresses.shape != (self.packed.space.num_buffers,) or addresses.dtype != torch.int64:
            raise ValueError(f"addresses must be int64 [{self.packed.space.num_buffers}], got "
                             f"{addresses.dtype} {tuple(addresses.shape)}")
        if delays_ns is not None and self.interpret:
            raise ValueError("delays_ns needs a GPU (the interpreter has no timer)")
        q, dev, cursor = self.packed.num_queues, self.device, self.launch_state[0]
        self._zeroed.zero_()
        errors = torch.zeros(q, 4, dtype=torch.int32, device=dev)
        stamp_buf = torch.zeros(max(self.packed.num_tasks, 1), 2, dtype=torch.int64, device=dev)
        clock = torch.zeros(1, dtype=torch.int64, device=dev)
        delays = torch.as_tensor(np.zeros(q) if delays_ns is None else delays_ns, dtype=torch.int64,
                                 device=dev)
        stamp = (1 if self.interpret else 2) if stamps else 0
        args = self._kernel_args(addresses, errors, stamp_buf, clock, delays, int(deadline_s * 1e9))
        kernel = device_module(self.interpret).taskflow_kernel
        meta = kernel_meta(self.dtype, self.config, self.interpret, not self.interpret, stamp,
                           delays_ns is not None, self._aligned(addresses))
        start = time.perf_counter()
        if self.interpret:
            launches = self._rounds(kernel, args, meta, cursor, max_rounds)
        else:
            launch = launch_options(self.config)
            compiled = kernel.warmup(*args, grid=(q,), **meta, **launch)
            check_resident(q, resident_programs(kernel_resources(compiled), SMLimits.of(dev)))
            cooperative_launch(kernel, q, args, {**meta, **launch})
            torch.cuda.synchronize(dev)
            launches = 1
            self._check_errors(cursor, errors, time.perf_counter() - start)
        return RunInfo(launches=launches, seconds=time.perf_counter() - start,
                       stamps=stamp_buf[:self.packed.num_tasks].cpu().numpy() if stamps else None)

    def launcher(self, addresses: torch.Tensor, deadline_s: float = 10.0):
        """A callable that launches one call asynchronously on the GPU (no checks, no
        synchronisation: for timing), with what each call costs (the memset that starts it
        from zero); read ``errors`` of the returned callable after synchronising to see
        late waits."""
        if self.interpret:
            raise ValueError("launcher needs a CUDA device")
        q, dev = self.packed.num_queues, self.device
        errors = torch.zeros(q, 4, dtype=torch.int32, device=dev)
        dummy = torch.zeros(1, 2, dtype=torch.int64, device=dev)
        kernel = device_module(False).taskflow_kernel
        meta = kernel_meta(self.dtype, self.config, False, True, 0, False, self._aligned(addresses))
        launch = launch_options(self.config)
        args = self._kernel_args(addresses, errors, dummy, dummy, dummy, int(deadline_s * 1e9))
        compiled = kernel.warmup(*args, grid=(q,), **meta, **launch)
        check_resident(q, resident_programs(kernel_resources(compiled), SMLimits.of(dev)))

        def go() -> None:
            self._zeroed.zero_()
            cooperative_launch(kernel, q, args, {**meta, **launch})

        go.errors = errors
        return go

    def launch(self, addresses: torch.Tensor, aligned: bool, deadline_s: float = 10.0) -> torch.Tensor:
        """Run every queue once in ONE launch without waiting for it or reading anything
        of the device's: a training step's launch (the interpreter runs it in rounds,
        whose stall raises at once).  ``aligned``: the kernel variant, which the
        caller decides from its buffers' host addresses (``ops.aligned_addresses``).  A
        late wait of an earlier launch, seen in the copy of its error rows in host memory,
        is raised first (``report``), one launch late; under a graph's capture no copy is
        made (``report(wait=True)`` reads the rows themselves).  Returns the error rows
        [Q, 4] int32 the launches write (a late wait sets its queue's row).  On a GPU the
        kernel is compiled and its residency checked on the first launch of each variant."""
        self.report(wait=False)
        q, (cursor, errors, dummy) = self.packed.num_queues, self.launch_state
        self._zeroed.zero_()
        kernel = device_module(self.interpret).taskflow_kernel
        meta = kernel_meta(self.dtype, self.config, self.interpret, not self.interpret, 0, False, aligned)
        args = self._kernel_args(addresses, errors, dummy, dummy, dummy, int(deadline_s * 1e9))
        if self.interpret:
            self._rounds(kernel, args, meta, cursor, None)
        else:
            launch = launch_options(self.config)
            if aligned not in self.checked_variants:
                compiled = kernel.warmup(*args, grid=(q,), **meta, **launch)
                check_resident(q, resident_programs(kernel_resources(compiled), SMLimits.of(self.device)))
                self.checked_variants.add(aligned)
            cooperative_launch(kernel, q, args, {**meta, **launch})
        if not capturing(self.device):
            self._seen.copy_(errors, non_blocking=True)
        return errors

    def report(self, wait: bool) -> None:
        """Raise ``RegionError`` for a late wait of an earlier ``launch``: seen in the
        copy of its error rows in host memory (a copy may still be on its way), or with
        ``wait`` after waiting for the device.  The error rows are cleared (the next
        call starts from zero as any call does)."""
        cursor, errors, _ = self.launch_state
        if not (wait or self._seen_rows[:, 0].any()):
            return
        if not self.interpret:  # the rows whole, and the last launch's cursors
            torch.cuda.synchronize(self.device)
        if not errors[:, 0].any():
            return
        report = self.hang_report(errors.cpu().numpy(), cursor.cpu().numpy(), 0.0)
        errors.zero_()
        self._seen.zero_()
        raise RegionError(replace(report, cause=f"{report.cause}, seen after its launch returned (launches "
                                                f"are checked at the next one; run() checks at once)"))

    def _rounds(self, kernel, args: tuple, meta: dict, cursor: torch.Tensor, max_rounds: int | None) -> int:
        lengths = torch.from_numpy(np.diff(self.packed.queue_ptr).astype(np.int32))
        before = cursor.clone()
        rounds = 0
        limit = self.packed.num_tasks + 1 if max_rounds is None else max_rounds
        while not torch.equal(cursor.cpu(), lengths):
            if rounds >= limit:
                raise GraphError(f"the interpreter stopped after {rounds} rounds (max_rounds={limit})")
            kernel[(self.packed.num_queues,)](*args, **meta)
            rounds += 1
            if torch.equal(cursor, before):
                raise GraphError(self._cycle_message(cursor.cpu().numpy(), rounds))
            before = cursor.clone()
        return rounds

    # ------------------------------------------------------------------ failures

    def _heads(self, cursor: np.ndarray) -> list[tuple[int, int]]:
        """(queue, task at its head) of every queue that is not done."""
        p = self.packed
        out = []
        for qi in range(p.num_queues):
            at = int(p.queue_ptr[qi]) + int(cursor[qi])
            if at < int(p.queue_ptr[qi + 1]):
                out.append((qi, int(p.queue_task[at])))
        return out

    def _cycle_message(self, cursor: np.ndarray, rounds: int) -> str:
        p, counters = self.packed, self.counters.cpu().numpy()
        lines = [f"no queue advanced in round {rounds}: the remaining tasks wait on each other (a cycle "
                 "through queue order and events)"]
        for qi, task in self._heads(cursor):
            ev = int(p.wait_event[task])
            lines.append(f"  {p.queue_names[qi]}: {p.graph.task(task)} waits on event {ev}: "
                         f"counter {int(counters[ev])} of {int(p.wait_threshold[task])}")
        return "\n".join(lines)

    def _check_errors(self, cursor: torch.Tensor, errors: torch.Tensor, elapsed: float) -> None:
        err, cur = errors.cpu().numpy(), cursor.cpu().numpy()
        done = cur == np.diff(self.packed.queue_ptr)
        if err[:, 0].any() or not done.all():
            raise RegionError(self.hang_report(err, cur, elapsed))

    def hang_report(self, errors: np.ndarray, cursor: np.ndarray, elapsed: float) -> HangReport:
        """The runtime's report from the device's error rows [Q, 4] and cursors [Q] of a call."""
        p, g = self.packed, self.packed.graph
        workers = []
        for qi in range(p.num_queues):
            lo, hi = int(p.queue_ptr[qi]), int(p.queue_ptr[qi + 1])
            n = int(cursor[qi])
            last = g.task(int(p.queue_task[lo + n - 1])) if n else ""
            common = {"name": p.queue_names[qi], "done": n, "total": hi - lo, "last_done": last}
            if errors[qi, 0]:
                task, ev, seen = (int(v) for v in errors[qi, 1:])
                workers.append(WorkerReport(status=WorkerStatus.WAITS, task=g.task(task), event=f"event {ev}",
                                            progress=seen, threshold=int(p.wait_threshold[task]), raw=seen,
                                            **common))
            else:
                status = WorkerStatus.FINISHED if lo + n == hi else WorkerStatus.STOPPED
                workers.append(WorkerReport(status=status, **common))
        late = int(errors[:, 0].sum())
        return HangReport(rank=-1, cause=f"{late} wait(s) passed the deadline on the device "
                          f"(all {p.graph.ep} virtual ranks)", workers=tuple(workers), elapsed_s=elapsed)

    # ------------------------------------------------------------------ timeline

    def timeline(self, stamps: np.ndarray) -> Timeline:
        """The simulator's ``Timeline`` from per-task [start, end] stamps (seconds from
        the first start; in the interpreter one logical tick counts as 1 ns)."""
        g, s = self.packed.graph, self.packed.schedule
        if s is None:
            raise ValueError("a timeline needs a program packed from a schedule")
        t0 = stamps[:, 0].min() if len(stamps) else 0  # the global timer does not start at 0
        nan = np.full(g.num_tasks, np.nan)
        return Timeline(ep=g.ep, workers=s.workers, kind=g.kind.astype(np.int64),
                        rank=g.rank.astype(np.int64), peer=g.peer.astype(np.int64),
                        unit=g.unit.astype(np.int64), worker=s.worker.astype(np.int64),
                        start=(stamps[:, 0] - t0) / 1e9, end=(stamps[:, 1] - t0) / 1e9,
                        link_start=nan, link_end=nan.copy())


def cooperative_launch(kernel, programs: int, args: tuple, options: dict) -> None:
    """Launch ``programs`` programs of ``kernel`` cooperatively; a failed launch is named
    with the likeliest cause (the driver refuses a cooperative grid that cannot be
    resident now)."""
    try:
        kernel[(programs,)](*args, **options)
    except RuntimeError as err:
        raise RuntimeError(f"the cooperative launch of the persistent kernel's {programs} programs failed: "
                           f"{err}.  If they cannot all be resident now (other kernels, MPS or a "
                           "partition hold SMs), run with fewer workers (TritonOptions.workers)") from err


def kernel_meta(dtype: torch.dtype, config: KernelConfig, interpret: bool, blocking: bool, stamp: int,
                delay: bool, aligned: bool) -> dict:
    """The constexpr arguments of ``taskflow_kernel`` (aligned: see ``ops.aligned_layout``)."""
    import triton.language as tl
    c = config
    return {"DT": getattr(tl, TL_DTYPES[dtype]), "BM": c.bm, "BN": c.bn, "BK": c.bk, "BR": c.br, "BC": c.bc,
            "PREC": "ieee" if dtype == torch.float32 else "tf32", "UPCAST": interpret, "BLOCKING": blocking,
            "STAMP": stamp, "DELAY": delay, "ALIGNED": aligned}


def kernel_resources(compiled: object) -> KernelResources:
    """Registers, spills, shared memory and warps of a kernel compiled for this GPU."""
    init = getattr(compiled, "_init_handles", None)
    if init is not None:
        init()
    meta = compiled.metadata
    return KernelResources(registers=int(compiled.n_regs), spill_bytes=4 * int(compiled.n_spills),
                           shared_bytes=int(meta.shared), num_warps=int(meta.num_warps))


def compiled_resources(device: torch.device, dtype: torch.dtype, config: KernelConfig | None,
                       aligned: bool) -> KernelResources:
    """Resources of the persistent kernel (blocking, no stamps) compiled for ``device``."""
    config = config or KernelConfig.for_dtype(dtype)
    i32 = torch.zeros(64, dtype=torch.int32, device=device)
    i64 = torch.zeros(64, dtype=torch.int64, device=device)
    args = (i32, i32, i32, i32, i32, i32, i32, i32, i64, i64, i32, i32, i32, i64, i64, i64, 0, 1)
    meta = kernel_meta(dtype, config, False, True, 0, False, aligned)
    kernel = device_module(False).taskflow_kernel
    launch = launch_options(config)
    return kernel_resources(kernel.warmup(*args, grid=(1,), **meta, **launch))


def resident_per_rank(graph: TaskGraph, device: torch.device, dtype: torch.dtype, config: object,
                      aligned: bool) -> int:
    """Programs of the kernel variant ``aligned`` picks that stay resident on a CUDA
    ``device``, per rank of ``graph``."""
    res = compiled_resources(device, dtype, config, aligned)
    return resident_programs(res, SMLimits.of(device)) // graph.ep
