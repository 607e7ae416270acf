"""Measure this CPU with torch and turn the figures into the ``cpu`` HardwareModel.

Plan of ``calibrate``:
  1. pin torch to ``threads`` intra-op threads (one worker = one such thread group);
  2. GEMM FLOP/s at tile shapes M x 512 x K over a grid of rows M and depths K, bf16 and
     fp32, called as the GEMM kernel calls them (a row slice of the input, an expert's
     weight columns transposed, a column slice of the output), the weights cycling through
     experts that together exceed the last-level cache, the kernel's call cost (step 5)
     taken out.  The best tile is the model's peak and the grid its ``gemm_shapes``;
  3. memory bandwidth: a large ``Tensor.copy_`` (bytes read + bytes written per second);
  4. elementwise rate: the SwiGLU kernel, ``silu(h[:, :F]) * h[:, F:]`` into a [128, F] tile
     of a [128, 2F] bf16 one (F = 1024);
  5. per-task fixed cost: a GEMM kernel's Python and torch dispatch (its views, its
     ``torch.mm``) on a 1 x 1 tile; a one-element ``torch.add`` (the put's own cost); the unpermute
     kernel (gather + ``refs.topk_sum``) on one UNPERMUTE_TILE, as bytes it moves per
     byte the lowering counts (``unpermute_traffic``);
  6. link: a put (``copy_`` into a /dev/shm-backed tensor + an int32 counter bump) of 64 B
     and of a large payload; latency = small put - task cost, bandwidth = the size slope.
Steps 2-5 are timed together in rounds (every figure once a round, the median over
rounds), so that a slow spell of the host slows them alike; the puts are medians of
repeats of their own.  Nothing here is asserted on in tests.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing import shared_memory

import torch

from hpmoe.refs import topk_sum
from hpmoe.regions.kernels import glu
from hpmoe.sim.hardware import SWIGLU_FLOPS_PER_ELEMENT, GemmShape, HardwareModel, LinkEntry
from hpmoe.sim.profile import default_profile_path, load_profile, save_profile
from hpmoe.spec import Activation

__all__ = ["CpuMeasurements", "measure", "model_from", "calibrate", "save_profile", "load_profile",
           "default_profile_path", "gemm_shapes", "KernelGemm", "WEIGHT_BYTES"]

GEMM_N = 512  # output columns of a calibration GEMM tile (the default TileSpec's)
SWIGLU_TILE = (128, 1024)  # rows x FFN columns of one SwiGLU tile (its input h is [rows, 2 FFN])
SMALL_PUT = 64  # bytes of the "empty" put that gives the link latency
UNPERMUTE_TILE = (128, 8, 256)  # tokens, top-k, hidden of the calibration unpermute (+ a shared expert)


@dataclass(frozen=True)
class _Plan:
    repeats: int
    gemm_rows: tuple[int, ...]
    gemm_ks: tuple[int, ...]
    weight_bytes: int  # the experts' weights a GEMM series cycles through
    copy_bytes: int
    put_bytes: int
    put_repeats: int  # single-call samples of the large put: cheap, and the median drops stalls
    tiny_calls: int


PUT_BYTES = 128 * 7168 * 2  # one 128-token DeepSeek-V3 bf16 tile, the paper's put granularity
# copy buffers are >= 2x a 32 MiB L3 so that the copy measures DRAM, not cache
WEIGHT_BYTES = 64 << 20  # GEMM weights cycled through: >= 2x a 32 MiB last-level cache
_QUICK = _Plan(repeats=5, gemm_rows=(32, 128), gemm_ks=(512, 2048), weight_bytes=16 << 20,
               copy_bytes=64 << 20, put_bytes=PUT_BYTES, put_repeats=31, tiny_calls=300)
_FULL = _Plan(repeats=15, gemm_rows=(8, 16, 32, 64, 128, 256),
              gemm_ks=(256, 512, 768, 1024, 1536, 2048, 4096),
              weight_bytes=WEIGHT_BYTES, copy_bytes=256 << 20, put_bytes=PUT_BYTES, put_repeats=101,
              tiny_calls=3000)


@dataclass(frozen=True)
class CpuMeasurements:
    """Raw figures of one calibration run.

    gemm_rows / gemm_ks: M and K of the M x 512 x K GEMM tiles measured; gemm_bf16 /
    gemm_fp32: FLOP/s of each (M, K), row-major over (gemm_rows, gemm_ks).
    copy_bw: bytes/s (read + write) of a large copy.  swiglu_flops: FLOP/s of the SwiGLU kernel,
    counting SWIGLU_FLOPS_PER_ELEMENT per output element.  tiny_op: seconds per one-element
    torch op from Python.  put_small: seconds per 64-byte put + signal into shared memory.
    put_bw: bytes/s of payload into shared memory.  unpermute: seconds of one
    unpermute kernel on UNPERMUTE_TILE.  kernel_call: seconds of a GEMM kernel's views
    and ``torch.mm`` on a 1 x 1 tile (a task's fixed cost in Python and torch).
    """

    threads: int
    quick: bool
    gemm_ks: tuple[int, ...]
    gemm_bf16: tuple[float, ...]
    gemm_fp32: tuple[float, ...]
    copy_bw: float
    swiglu_flops: float
    tiny_op: float
    put_small: float
    put_bw: float
    unpermute: float = 0.0
    kernel_call: float = 0.0
    gemm_rows: tuple[int, ...] = (128,)

    def __post_init__(self) -> None:
        points = len(self.gemm_rows) * len(self.gemm_ks)
        for name in ("gemm_bf16", "gemm_fp32"):
            if len(getattr(self, name)) != points:
                raise ValueError(f"CpuMeasurements.{name} has {len(getattr(self, name))} rates for "
                                 f"{len(self.gemm_rows)} rows x {len(self.gemm_ks)} depths")


def _median_time(fn: Callable[[], object], repeats: int, inner: int = 1, warmup: int = 2) -> float:
    """Median seconds of one ``fn()`` call over ``repeats`` batches of ``inner`` calls."""
    for _ in range(warmup * inner):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - t0) / inner)
    return statistics.median(samples)


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """Torch's intra-op threads of this process set to ``threads`` inside, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _expert_weights(k: int, dtype: torch.dtype, weight_bytes: int, gen: torch.Generator) -> torch.Tensor:
    """Random experts x 512 x ``k`` weights in ``dtype``: as many experts (at least 2) as
    span ``weight_bytes``."""
    experts = max(2, -(-weight_bytes // (GEMM_N * k * dtype.itemsize)))
    return torch.randn(experts, GEMM_N, k, generator=gen, device="cpu").to(dtype)


class KernelGemm:
    """An m x 512 x k GEMM tile in ``dtype`` called as the GEMM kernel calls it (rows of
    the input, an expert's weight rows transposed, columns of an output twice as wide),
    each call on the next of experts whose weights together span ``weight_bytes`` (so
    that they come from memory, as a large layer's do).  ``weights`` (experts x 512 x k
    in ``dtype``) are used instead of making new ones: tiles of one depth share them."""

    def __init__(self, m: int, k: int, dtype: torch.dtype, weight_bytes: int, gen: torch.Generator,
                 weights: torch.Tensor | None = None) -> None:
        self.w = _expert_weights(k, dtype, weight_bytes, gen) if weights is None else weights
        if self.w.shape[1:] != (GEMM_N, k) or self.w.dtype != dtype:
            raise ValueError(f"weights has shape {tuple(self.w.shape)} and dtype {self.w.dtype}, "
                             f"expected (experts, {GEMM_N}, {k}) in {dtype}")
        self.experts = self.w.shape[0]
        self.x = torch.randn(m, k, generator=gen, device="cpu").to(dtype)
        self.out = torch.empty(m, 2 * GEMM_N, dtype=dtype, device="cpu")
        self.flops, self.turn = 2.0 * m * GEMM_N * k, 0

    def __call__(self) -> None:
        self.turn = (self.turn + 1) % self.experts
        torch.mm(self.x, self.w[self.turn].t(), out=self.out[:, :GEMM_N])

    def compute_seconds(self, seconds: float, call_cost: float) -> float:
        """A call's ``seconds`` without its ``call_cost`` (at least half of it)."""
        return max(seconds - call_cost, 0.5 * seconds)


@dataclass(frozen=True)
class _Bench:
    """A micro-benchmark: ``fn`` timed in batches of ``inner`` calls."""

    fn: Callable[[], object]
    inner: int = 1


def _round_medians(benches: list[_Bench], repeats: int) -> list[float]:
    """Median seconds of one call of each bench, timed in rounds: each of ``repeats``
    rounds (after an untimed one) times a batch of every bench in turn, each batch after
    one untimed call (its operands hot, as when timed alone).  A slow spell of the host
    then slows every figure alike instead of the ones timed during it: the models use
    the figures relative to one another (the bench rescales them by a share it measures)."""
    batches: list[list[float]] = [[] for _ in benches]
    for round_ in range(repeats + 1):
        for bench, times in zip(benches, batches, strict=True):
            bench.fn()
            t0 = time.perf_counter()
            for _ in range(bench.inner):
                bench.fn()
            if round_ > 0:
                times.append((time.perf_counter() - t0) / bench.inner)
    return [statistics.median(times) for times in batches]


def _grid_tiles(dtype: torch.dtype, plan: _Plan, gen: torch.Generator) -> list[KernelGemm]:
    """A ``KernelGemm`` at every (rows, depth) of the plan, row-major; the tiles of one
    depth share their weights."""
    weights = {k: _expert_weights(k, dtype, plan.weight_bytes, gen) for k in plan.gemm_ks}
    return [KernelGemm(m, k, dtype, plan.weight_bytes, gen, weights[k])
            for m in plan.gemm_rows for k in plan.gemm_ks]


def _gemm_bench(tile: KernelGemm) -> _Bench:
    """``tile`` in batches of about 2 ms at 100 GFLOP/s (1 to 64 calls)."""
    return _Bench(tile, max(1, min(64, int(2e-3 * 1e11 / tile.flops))))


def _copy_bench(plan: _Plan) -> _Bench:
    """``dst.copy_(src)`` on ``plan.copy_bytes`` bytes."""
    src = torch.ones(plan.copy_bytes, dtype=torch.uint8, device="cpu")
    dst = torch.empty_like(src)
    return _Bench(lambda: dst.copy_(src))


def _swiglu_bench(gen: torch.Generator) -> _Bench:
    """The SwiGLU kernel (``regions.kernels.glu``: ``silu(h[:, :F]) * h[:, F:]`` into its
    output tile, the kernel itself) on one bf16 SWIGLU_TILE."""
    rows, f = SWIGLU_TILE
    h = torch.randn(rows, 2 * f, generator=gen, device="cpu").to(torch.bfloat16)
    out = torch.empty(rows, f, dtype=torch.bfloat16, device="cpu")
    return _Bench(lambda: glu(h, out, Activation.SILU))


def _unpermute_bench(gen: torch.Generator) -> _Bench:
    """The forward unpermute kernel (``regions.kernels``) on one bf16 UNPERMUTE_TILE:
    gather each token's k rows, sum them weighted in fp32 with the shared expert's row."""
    m, k, h = UNPERMUTE_TILE
    comb = torch.randn(m * k, h, generator=gen, device="cpu").to(torch.bfloat16)
    pos = torch.randperm(m * k, generator=gen, device="cpu").view(m, k)
    w = torch.rand(m, k, generator=gen, device="cpu")
    shared = torch.randn(m, h, generator=gen, device="cpu").to(torch.bfloat16)
    out = torch.empty(m, h, dtype=torch.bfloat16, device="cpu")

    def kernel() -> None:
        out[:] = topk_sum(comb[pos], w, shared, torch.bfloat16)
    return _Bench(kernel, inner=10)


def unpermute_traffic(m: CpuMeasurements) -> float:
    """Bytes the unpermute kernel moved (its seconds past the per-task cost, at the copy
    rate) per byte the lowering counts for it ((k + 2) rows of H per token), at least 1."""
    tokens, k, h = UNPERMUTE_TILE
    counted = (k + 2) * tokens * h * 2
    return max(1.0, (m.unpermute - (m.kernel_call or m.tiny_op)) * m.copy_bw / counted)


def _kernel_call_bench(plan: _Plan) -> _Bench:
    """The forward GEMM kernel's calls (``regions.kernels``: slice the input rows, the
    expert's weight columns and the output tile, ``torch.mm`` into it) on a 1 x 1 tile."""
    x = torch.ones(4, 8, dtype=torch.bfloat16, device="cpu")
    w = torch.ones(2, 8, 8, dtype=torch.bfloat16, device="cpu")
    out = torch.empty(4, 8, dtype=torch.bfloat16, device="cpu")
    return _Bench(lambda: torch.mm(x[0:1], w[1, 0:1].t(), out=out[0:1, 0:1]), inner=plan.tiny_calls)


def _tiny_op_bench(plan: _Plan) -> _Bench:
    """A one-element ``torch.add`` called from Python."""
    a, b, c = torch.ones(1, device="cpu"), torch.ones(1, device="cpu"), torch.empty(1, device="cpu")
    return _Bench(lambda: torch.add(a, b, out=c), inner=plan.tiny_calls)


def _time_puts(buf: memoryview, plan: _Plan) -> tuple[float, float]:
    """Seconds of a SMALL_PUT-byte and of a ``plan.put_bytes`` put + counter bump into ``buf``."""
    heap = torch.frombuffer(buf, dtype=torch.uint8)
    data, counter = heap[:plan.put_bytes], heap[plan.put_bytes:plan.put_bytes + 4].view(torch.int32)
    src = torch.ones(plan.put_bytes, dtype=torch.uint8, device="cpu")
    small_dst, small_src = data[:SMALL_PUT], src[:SMALL_PUT]
    small = _median_time(lambda: (small_dst.copy_(small_src), counter.add_(1)), plan.repeats,
                         inner=plan.tiny_calls)
    large = _median_time(lambda: (data.copy_(src), counter.add_(1)), plan.put_repeats)
    return small, large


def _put_figures(plan: _Plan) -> tuple[float, float]:
    """(seconds of a 64-byte put, payload bytes/s) into a /dev/shm shared-memory segment."""
    shm = shared_memory.SharedMemory(create=True, size=plan.put_bytes + 64)
    try:
        small, large = _time_puts(shm.buf, plan)
    finally:
        shm.close()
        shm.unlink()
    if not large > small:
        raise RuntimeError(f"calibration: large put ({large:.3g} s) not slower than small ({small:.3g} s)")
    return small, (plan.put_bytes - SMALL_PUT) / (large - small)


def measure(threads: int = 1, quick: bool = False,
            progress: Callable[[str], None] | None = None) -> CpuMeasurements:
    """Run every micro-benchmark with torch pinned to ``threads`` threads;
    ``progress`` gets a line before each group of them."""
    if not isinstance(threads, int) or threads <= 0:
        raise ValueError(f"threads must be a positive int, got {threads!r}")
    plan, gen = (_QUICK if quick else _FULL), torch.Generator().manual_seed(0)
    say = progress or (lambda line: None)
    with torch_threads(threads), torch.no_grad():
        say("1/2 GEMM tiles in bf16 and fp32, copies, SwiGLU, per-task costs (in rounds)")
        tiles = _grid_tiles(torch.bfloat16, plan, gen) + _grid_tiles(torch.float32, plan, gen)
        scalars = [_kernel_call_bench(plan), _tiny_op_bench(plan), _copy_bench(plan), _swiglu_bench(gen),
                   _unpermute_bench(gen)]
        seconds = _round_medians(scalars + [_gemm_bench(tile) for tile in tiles], plan.repeats)
        kernel_call, tiny, copy, swiglu, unpermute = seconds[:len(scalars)]
        rates = [tile.flops / tile.compute_seconds(t, kernel_call)
                 for tile, t in zip(tiles, seconds[len(scalars):], strict=True)]
        say("2/2 shared-memory puts")
        put_small, put_bw = _put_figures(plan)
    half = len(tiles) // 2
    return CpuMeasurements(threads=threads, quick=quick, gemm_rows=plan.gemm_rows, gemm_ks=plan.gemm_ks,
                           gemm_bf16=tuple(rates[:half]), gemm_fp32=tuple(rates[half:]),
                           copy_bw=2.0 * plan.copy_bytes / copy,
                           swiglu_flops=SWIGLU_FLOPS_PER_ELEMENT * SWIGLU_TILE[0] * SWIGLU_TILE[1] / swiglu,
                           tiny_op=tiny, put_small=put_small, put_bw=put_bw, unpermute=unpermute,
                           kernel_call=kernel_call)


def model_from(m: CpuMeasurements, matrix_workers: int = 1, vector_workers: int = 1) -> HardwareModel:
    """The ``cpu`` HardwareModel of measurements ``m``.

    The GEMM peak is the best tile measured, and the grid of tiles is ``gemm_shapes``
    (as fractions of it).  The link is one entry (EP 2) used for every EP size; link_latency is the small put
    minus a one-element op's cost (floored at 0).  task_overhead is a GEMM kernel's call
    cost (``kernel_call``; the one-element op for measurements without it)."""
    notes = (f"calibrated {time.strftime('%Y-%m-%d %H:%M:%S')}, torch {torch.__version__}, "
             f"threads={m.threads}, quick={m.quick}")
    return HardwareModel(
        name="cpu", matrix_workers=matrix_workers, vector_workers=vector_workers,
        matrix_flops_bf16=max(m.gemm_bf16), matrix_flops_fp32=max(m.gemm_fp32),
        matrix_block=1,  # measured at tile shapes: no extra padding model
        gemm_shapes=gemm_shapes(m),
        vector_flops=m.swiglu_flops, mem_bw=m.copy_bw,
        link=(LinkEntry(2, m.put_bw, m.put_bw),),
        link_latency=max(m.put_small - m.tiny_op, 0.0), task_overhead=m.kernel_call or m.tiny_op,
        unpermute_traffic=unpermute_traffic(m) if m.unpermute > 0 else 1.0, notes=notes)


def gemm_shapes(m: CpuMeasurements) -> tuple[GemmShape, ...]:
    """The measured grid as fractions of the best tile per dtype (none for one point)."""
    if len(m.gemm_bf16) < 2:
        return ()
    points = [(r, k) for r in m.gemm_rows for k in m.gemm_ks]
    top16, top32 = max(m.gemm_bf16), max(m.gemm_fp32)
    return tuple(GemmShape(rows=r, depth=k, bf16=b / top16, fp32=f / top32)
                 for (r, k), b, f in zip(points, m.gemm_bf16, m.gemm_fp32, strict=True))


def calibrate(threads: int = 1, quick: bool = False, matrix_workers: int = 1,
              vector_workers: int = 1, progress: Callable[[str], None] | None = None) -> HardwareModel:
    """Measure this CPU (``threads`` torch threads per worker) and return its HardwareModel.

    quick=True takes a few seconds with fewer repeats and smaller buffers.
    """
    return model_from(measure(threads, quick, progress), matrix_workers, vector_workers)
