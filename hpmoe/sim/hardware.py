"""Hardware models: worker counts, peak rates, memory and link figures, per preset.

A ``HardwareModel`` is what the cost model and the simulator read.  Units:

- ``matrix_flops_*`` and ``vector_flops`` are FLOP/s of ONE worker;
- ``mem_bw`` is bytes/s of device memory (bytes read + bytes written), shared by all
  workers of the device;
- link bandwidths are bytes/s of payload per rank and per direction, as the all-to-all
  benchmarks report them ("bottleneck bandwidth");
- every time is in seconds.

The cost methods are vectorised: they take numpy arrays (or scalars) and return float64
arrays of the broadcast shape.  Every preset figure carries its source; see
``docs/hardware.md``.  Figures are inputs, never fitted to make a result come out.
"""

from __future__ import annotations

import enum
import functools
import math
from dataclasses import asdict, dataclass, fields

import numpy as np
import numpy.typing as npt
import torch

from ..ir.schedule import WorkerCounts

MAX_LANES = 1 << 16  # streams a port serves at once, at most (an infinitely fast port)
SWIGLU_FLOPS_PER_ELEMENT = 5.0  # silu(g) * u: exp, add, divide, two multiplies (as lower/ counts)


class LinkDirection(enum.Enum):
    """Which all-to-all a put belongs to (measured bandwidths differ per direction)."""

    DISPATCH = "dispatch"
    COMBINE = "combine"


def _check_int(owner: str, name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{owner}.{name} must be a positive int, got {value!r}")


def _check_rate(owner: str, name: str, value: object, allow_zero: bool = False) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{owner}.{name} must be a finite number {bound}, got {value!r}")


@dataclass(frozen=True)
class LinkEntry:
    """Measured all-to-all bandwidth at one EP size: bytes/s per rank, per direction."""

    ep: int
    dispatch: float
    combine: float

    def __post_init__(self) -> None:
        _check_int("LinkEntry", "ep", self.ep)
        _check_rate("LinkEntry", "dispatch", self.dispatch)
        _check_rate("LinkEntry", "combine", self.combine)

    def bandwidth(self, direction: LinkDirection) -> float:
        """Bytes/s per rank in ``direction``."""
        return self.dispatch if direction is LinkDirection.DISPATCH else self.combine


@dataclass(frozen=True)
class GemmShape:
    """Measured rate of one GEMM tile shape, as fractions of the model's peak
    (``matrix_flops_bf16`` / ``matrix_flops_fp32``): ``rows`` x ``depth`` (M x K) tiles
    of the calibration's output width."""

    rows: int
    depth: int
    bf16: float
    fp32: float

    def __post_init__(self) -> None:
        _check_int("GemmShape", "rows", self.rows)
        _check_int("GemmShape", "depth", self.depth)
        for name in ("bf16", "fp32"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and 0 < value <= 1):
                raise ValueError(f"GemmShape.{name} must be in (0, 1], got {value!r}")


def shape_grid(shapes: tuple[GemmShape, ...]) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """(log2 rows, log2 depths, {dtype name: [rows, depths] efficiencies}) of a full grid;
    ValueError naming the missing or repeated point otherwise."""
    rows, depths = sorted({s.rows for s in shapes}), sorted({s.depth for s in shapes})
    at = {}
    for s in shapes:
        if (s.rows, s.depth) in at:
            raise ValueError(f"HardwareModel.gemm_shapes repeats rows={s.rows}, depth={s.depth}")
        at[s.rows, s.depth] = s
    missing = [(r, d) for r in rows for d in depths if (r, d) not in at]
    if missing:
        raise ValueError(f"HardwareModel.gemm_shapes must be a full rows x depth grid; missing "
                         f"rows={missing[0][0]}, depth={missing[0][1]}")
    table = {n: np.array([[getattr(at[r, d], n) for d in depths] for r in rows]) for n in ("bf16", "fp32")}
    return np.log2(rows), np.log2(depths), table


def _interp_rows(x: np.ndarray, grid: np.ndarray, values: np.ndarray) -> np.ndarray:
    """values [len(grid), n] interpolated linearly at x [n] along the grid axis (clamped)."""
    if len(grid) == 1:
        return values[0]
    i = np.clip(np.searchsorted(grid, x, side="right") - 1, 0, len(grid) - 2)
    t = np.clip((x - grid[i]) / (grid[i + 1] - grid[i]), 0.0, 1.0)
    cols = np.arange(values.shape[1])
    return values[i, cols] * (1 - t) + values[i + 1, cols] * t


def _as_seconds(x: npt.ArrayLike) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def _nonneg(name: str, x: npt.ArrayLike) -> np.ndarray:
    """``x`` as a float64 array; ValueError naming ``name`` and the value if any entry < 0."""
    a = np.asarray(x, dtype=np.float64)
    bad = ~((a >= 0) & np.isfinite(a))
    if bad.any():
        raise ValueError(f"{name} must be finite and >= 0, got {a[bad].flat[0]!r}")
    return a


@dataclass(frozen=True)
class HardwareModel:
    """Per-worker rates and shared resources of one device (one rank).

    name: preset or profile name.
    matrix_workers / vector_workers: worker queues of each unit kind per rank.
    matrix_flops_bf16 / matrix_flops_fp32: FLOP/s of ONE matrix worker per GEMM dtype.
    matrix_block: native tile edge; GEMM M, N, K are padded up to multiples of it.
    vector_flops: elementwise FLOP/s of ONE vector worker.
    mem_bw: device-memory bytes/s (read + write), shared by every worker.
    link: measured (ep, dispatch, combine) bytes/s per rank, sorted by ep, ep unique.
    link_latency: seconds, the fixed cost of one message: after its transfer, before its
      signal lands (the per-message alpha).
    task_overhead: seconds, the fixed cost of running any task.
    l2_mb: MiB of last-level cache (L2) per rank holding GEMM operands; 0: none.
    matrix_efficiency: fraction of the peak matrix rate a GEMM tile reaches when both its
      rows and columns are at least ``matrix_full_edge``; narrower tiles lose in proportion.
    matrix_full_edge: tile edge (rows, columns) from which ``matrix_efficiency`` holds.
    gemm_shapes: measured rates over a grid of tile rows x depths (``hpmoe calibrate``);
      a tile's rate is interpolated in log2 rows and log2 depth (held at the grid's
      edges) and multiplies ``tile_efficiency``.  Empty: every shape at the peak.
    stream_bw: bytes/s one put stream (one issuing worker) moves at most; 0: one stream
      can fill a port.  A port then serves ``round(port bandwidth / stream_bw)`` puts at once.
    inter_link_bw: bytes/s per rank and direction between nodes (the second link tier);
      0: every rank is in one node (the ``link`` table covers the whole EP group).
    inter_latency: seconds, the per-message fixed cost between nodes.
    shared_hbm: the simulator's memory model: True, an L2 per rank and HBM shared by every
      running task; False, the per-worker roofline (each worker its unit's share of
      ``mem_bw``, no cache), for models fitted per worker.
    matrix_memory: whether the per-worker roofline (``shared_hbm`` False) bounds a matrix
      task by its bytes.  False: the matrix rate was fitted to measured matrix-task
      durations (``hpmoe.gpu.calibrate``), which already hold their memory stalls; the
      vector workers' share of ``mem_bw`` (a fitted per-program bandwidth) says nothing
      of what a GEMM tile streams.
    host_cores: cores the ranks of one node share (a CPU host: every rank's worker threads
      time-share them); the replay shares them among running tasks (processor sharing, a
      task at most one core) and a task's work on its core is ``task_overhead`` + max(compute,
      bytes / ``mem_bw``), ``mem_bw`` then being one core's streaming rate, not a shared
      HBM.  0: every worker has its own core (accelerators).
    host_mem_bw: bytes/s (read + write) a ``host_cores`` host's memory serves while every
      core streams: the replay shares it among the host's tasks moving bytes, each at most
      ``mem_bw``.  0: each core streams at ``mem_bw`` whatever the others do.
    unpermute_traffic: bytes the unpermute kernel moves per byte the lowering counts (the
      compulsory ones): 1 for a fused kernel; the CPU's ``refs.topk_sum`` builds fp32
      temporaries per term (``hpmoe calibrate`` measures it).
    put_cpu: seconds of the host's CPU a remote put burns while on the link, beside the
      workers (a replay with ``host_cores`` charges it to the host's cores, gating
      nothing): a transport whose sends and receives run on the host's cores (TCP: both
      ends' copies, its threads); 0 for a device link or one-sided copies.
    wake_latency: seconds from an event to the start of the task a worker sleeps on it
      for (a CPU thread's futex wake; a replay with ``host_cores`` adds it); 0: workers
      that spin.
    launch_overhead: seconds a taskflow region costs outside its tasks, before its workers
      start and after its last task (the CPU runtime's executor building the tasks' calls,
      finishing the transport, settling its events); ``forecast_region`` adds it to the
      replay, which does not have it.  0: none modelled.
    notes: provenance (free text).
    """

    name: str
    matrix_workers: int
    vector_workers: int
    matrix_flops_bf16: float
    matrix_flops_fp32: float
    matrix_block: int
    vector_flops: float
    mem_bw: float
    link: tuple[LinkEntry, ...]
    link_latency: float
    task_overhead: float
    l2_mb: float = 0.0
    matrix_efficiency: float = 1.0
    matrix_full_edge: int = 1
    stream_bw: float = 0.0
    inter_link_bw: float = 0.0
    inter_latency: float = 0.0
    shared_hbm: bool = True
    matrix_memory: bool = True
    host_cores: float = 0.0
    host_mem_bw: float = 0.0
    unpermute_traffic: float = 1.0
    gemm_shapes: tuple[GemmShape, ...] = ()
    put_cpu: float = 0.0
    wake_latency: float = 0.0
    launch_overhead: float = 0.0
    notes: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"HardwareModel.name must be a non-empty str, got {self.name!r}")
        for name in ("matrix_workers", "vector_workers", "matrix_block"):
            _check_int("HardwareModel", name, getattr(self, name))
        for name in ("matrix_flops_bf16", "matrix_flops_fp32", "vector_flops", "mem_bw"):
            _check_rate("HardwareModel", name, getattr(self, name))
        for name in ("link_latency", "task_overhead", "l2_mb", "stream_bw", "inter_link_bw",
                     "inter_latency", "host_cores", "host_mem_bw", "put_cpu", "wake_latency",
                     "launch_overhead"):
            _check_rate("HardwareModel", name, getattr(self, name), allow_zero=True)
        _check_int("HardwareModel", "matrix_full_edge", self.matrix_full_edge)
        _check_rate("HardwareModel", "unpermute_traffic", self.unpermute_traffic)
        if not self.matrix_memory and self.shared_hbm:
            raise ValueError("HardwareModel.matrix_memory=False needs shared_hbm=False: it is a rule of the "
                             "per-worker roofline (the shared HBM charges every task's traffic)")
        if not (isinstance(self.matrix_efficiency, int | float) and 0 < self.matrix_efficiency <= 1):
            raise ValueError("HardwareModel.matrix_efficiency must be in (0, 1], "
                             f"got {self.matrix_efficiency!r}")
        object.__setattr__(self, "link", tuple(self.link))
        self._check_link()
        object.__setattr__(self, "gemm_shapes", tuple(self.gemm_shapes))
        if not all(isinstance(s, GemmShape) for s in self.gemm_shapes):
            raise ValueError(f"HardwareModel.gemm_shapes must hold GemmShape, got {self.gemm_shapes!r}")
        if self.gemm_shapes:
            self._grid  # noqa: B018  (a full grid, or ValueError naming the missing point; cached)

    def _check_link(self) -> None:
        if not self.link or not all(isinstance(e, LinkEntry) for e in self.link):
            raise ValueError(f"HardwareModel.link must be a non-empty tuple of LinkEntry, got {self.link!r}")
        eps = [e.ep for e in self.link]
        if eps != sorted(set(eps)):
            raise ValueError(f"HardwareModel.link EP sizes must be unique and increasing, got {eps}")

    # --- rates -------------------------------------------------------------------------
    @property
    def workers(self) -> WorkerCounts:
        """The worker queues per rank: the one place worker counts come from."""
        return WorkerCounts(matrix=self.matrix_workers, vector=self.vector_workers)

    def matrix_flops(self, dtype: torch.dtype) -> float:
        """FLOP/s of one matrix worker for GEMMs in ``dtype`` (torch.bfloat16 or torch.float32)."""
        if dtype == torch.bfloat16:
            return self.matrix_flops_bf16
        if dtype == torch.float32:
            return self.matrix_flops_fp32
        raise TypeError(f"dtype must be torch.bfloat16 or torch.float32, got {dtype}")

    def link_bandwidth(self, ep: int, direction: LinkDirection) -> float:
        """Bytes/s per rank for an all-to-all over ``ep`` ranks in ``direction``.

        The measured entry at a measured EP size; between measured sizes, linear in
        log2(ep); outside the measured range, the nearest end entry (held constant).
        """
        _check_int("link_bandwidth", "ep", ep)
        if not isinstance(direction, LinkDirection):
            raise TypeError(f"direction must be a LinkDirection, got {direction!r}")
        eps = np.log2([e.ep for e in self.link])
        bws = [e.bandwidth(direction) for e in self.link]
        return float(np.interp(math.log2(ep), eps, bws))

    # --- costs (vectorised) ------------------------------------------------------------
    def matrix_time(self, m: npt.ArrayLike, n: npt.ArrayLike, k: npt.ArrayLike,
                    dtype: torch.dtype) -> np.ndarray:
        """Seconds of compute for GEMM tiles (m x k) @ (k x n) on one matrix worker.

        Each of m, n, k is padded up to a multiple of ``matrix_block``; 2 FLOP per MAC, at
        ``tile_efficiency(m, n)`` times ``shape_efficiency(m, k)`` of the peak.  Compute
        only: memory traffic is the simulator's business.
        """
        b = self.matrix_block
        pm, pn, pk = (np.ceil(_nonneg(s, x) / b) * b for s, x in (("m", m), ("n", n), ("k", k)))
        eff = self.tile_efficiency(pm, pn) * self.shape_efficiency(pm, pk, dtype)
        return _as_seconds(2.0 * pm * pn * pk / (self.matrix_flops(dtype) * eff))

    @functools.cached_property
    def _grid(self) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
        """``shape_grid`` of ``gemm_shapes`` (derived once; not a field)."""
        return shape_grid(self.gemm_shapes)

    def shape_efficiency(self, m: npt.ArrayLike, k: npt.ArrayLike, dtype: torch.dtype) -> np.ndarray:
        """Fraction of the peak rate ``gemm_shapes`` gives m x k tiles (1 without a table)."""
        m, k = np.broadcast_arrays(np.asarray(m, np.float64), np.asarray(k, np.float64))
        if not self.gemm_shapes:
            return np.ones(m.shape)
        self.matrix_flops(dtype)  # rejects other dtypes
        rows, depths, table = self._grid
        name = "bf16" if dtype == torch.bfloat16 else "fp32"
        lm, lk = (np.log2(np.maximum(x.ravel(), 1.0)) for x in (m, k))
        per_row = np.stack([np.interp(lk, depths, row) for row in table[name]])
        return _interp_rows(lm, rows, per_row).reshape(m.shape)

    def tile_efficiency(self, m: npt.ArrayLike, n: npt.ArrayLike) -> np.ndarray:
        """Fraction of the peak rate an m x n GEMM tile reaches: ``matrix_efficiency`` times
        min(1, m / matrix_full_edge) times min(1, n / matrix_full_edge) (at least one row)."""
        edge = float(self.matrix_full_edge)
        fm = np.minimum(1.0, np.maximum(np.asarray(m, np.float64), 1.0) / edge)
        fn = np.minimum(1.0, np.maximum(np.asarray(n, np.float64), 1.0) / edge)
        return self.matrix_efficiency * fm * fn

    @property
    def l2_bytes(self) -> float:
        """L2 capacity in bytes."""
        return self.l2_mb * 2**20

    def stream_lanes(self, port_bw: float) -> int:
        """Puts a port of ``port_bw`` bytes/s serves at once (each at port_bw / lanes)."""
        if self.stream_bw <= 0 or self.stream_bw >= port_bw:
            return 1
        return int(min(MAX_LANES, max(1, round(port_bw / self.stream_bw))))

    def vector_time(self, elements: npt.ArrayLike, flops_per_element: float = 1.0) -> np.ndarray:
        """Seconds for one vector worker to do ``elements * flops_per_element`` elementwise FLOP.

        Pass FLOP counts with the default, or element counts with e.g.
        ``SWIGLU_FLOPS_PER_ELEMENT``.
        """
        return _as_seconds(_nonneg("elements", elements) * flops_per_element / self.vector_flops)

    def memory_time(self, nbytes: npt.ArrayLike, sharers: npt.ArrayLike = 1) -> np.ndarray:
        """Seconds to move ``nbytes`` (read + write) when ``sharers`` workers split ``mem_bw``."""
        share = np.asarray(sharers, dtype=np.float64)
        if not (share >= 1).all():
            raise ValueError(f"sharers must be >= 1, got {share[~(share >= 1)].flat[0]!r}")
        return _as_seconds(_nonneg("nbytes", nbytes) * share / self.mem_bw)

    def put_time(self, nbytes: npt.ArrayLike, ep: int, direction: LinkDirection) -> np.ndarray:
        """Seconds for one put of ``nbytes`` payload: link_latency + nbytes / link_bandwidth."""
        bw = self.link_bandwidth(ep, direction)
        return _as_seconds(self.link_latency + _nonneg("nbytes", nbytes) / bw)

    # --- (de)serialisation -------------------------------------------------------------
    def to_dict(self) -> dict:
        """JSON-ready dict (link as a list of {ep, dispatch, combine})."""
        d = asdict(self)
        d["link"] = [asdict(e) for e in self.link]
        d["gemm_shapes"] = [asdict(s) for s in self.gemm_shapes]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> HardwareModel:
        """Inverse of ``to_dict``; unknown or missing keys raise ValueError naming them."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"HardwareModel: unknown fields {unknown}")
        try:
            return cls(**{**d, "link": tuple(LinkEntry(**e) for e in d.get("link", ())),
                          "gemm_shapes": tuple(GemmShape(**s) for s in d.get("gemm_shapes", ()))})
        except TypeError as err:
            raise ValueError(f"HardwareModel: {err}") from err

    def summary(self) -> str:
        """Human-readable figures, one per line."""
        lines = [f"{self.name}: {self.matrix_workers} matrix + {self.vector_workers} vector workers",
                 f"  matrix  bf16 {self.matrix_flops_bf16 / 1e12:.4g} TFLOP/s, fp32 "
                 f"{self.matrix_flops_fp32 / 1e12:.4g} TFLOP/s per worker, block {self.matrix_block}",
                 f"  vector  {self.vector_flops / 1e9:.4g} GFLOP/s per worker",
                 f"  memory  {self.mem_bw / 1e9:.4g} GB/s shared",
                 f"  latency put {self.link_latency * 1e6:.3g} us, task {self.task_overhead * 1e6:.3g} us"]
        lines.append(f"  L2 {self.l2_mb:.4g} MiB, GEMM efficiency {self.matrix_efficiency:.3g} "
                     f"(full from edge {self.matrix_full_edge}), stream {self.stream_bw / 1e9:.4g} GB/s, "
                     f"inter-node {self.inter_link_bw / 1e9:.4g} GB/s + {self.inter_latency * 1e6:.3g} us")
        if self.gemm_shapes:
            rows, depths, table = self._grid
            lines.append(f"  GEMM tiles measured at rows {[int(x) for x in np.exp2(rows)]} x depth "
                         f"{[int(x) for x in np.exp2(depths)]}: bf16 {table['bf16'].min():.2f}-"
                         f"{table['bf16'].max():.2f}, fp32 {table['fp32'].min():.2f}-"
                         f"{table['fp32'].max():.2f} of the peak")
        if (self.host_cores or self.unpermute_traffic != 1.0 or self.put_cpu or self.wake_latency
                or self.launch_overhead):
            lines.append(f"  host cores {self.host_cores:.4g} (0: one per worker), host memory "
                         f"{self.host_mem_bw / 1e9:.4g} GB/s (0: per core), unpermute traffic "
                         f"x{self.unpermute_traffic:.3g}, host CPU per remote put "
                         f"{self.put_cpu * 1e6:.3g} us, wake {self.wake_latency * 1e6:.3g} us, launch "
                         f"{self.launch_overhead * 1e6:.3g} us")
        lines += [f"  link EP{e.ep}: dispatch {e.dispatch / 1e9:.4g} GB/s, combine {e.combine / 1e9:.4g} GB/s"
                  for e in self.link]
        return "\n".join(lines + ([f"  notes: {self.notes}"] if self.notes else []))


# --- what-if overrides ----------------------------------------------------------------
# ``--set NAME=VALUE`` names in convenient units: NAME -> (field, factor to the field's unit)
