"""The persistent kernel's forward under a sweep of its knobs, on one GPU: the rows of a
vector-operation chunk (``KernelConfig.br``) and the share of the resident programs that
run matrix tasks (``TritonOptions.workers``; 0: the backend's default, measured); or
(``--gemm``) GEMM blocks, warps, stages and register caps.  Per shape and setting: the
HYPERPARALLEL forward and its PERMUTE and UNPERMUTE phases alone, or its GEMM_UP and
GEMM_DOWN phases alone; medians of CUDA-event timings; a run with a late wait is not
timed.

    python benchmarks/gpu_sweep.py --out DIR [--shapes small deepseek-v3-fit] [--br 16 64]
                                   [--share 0 0.5 0.67]
    python benchmarks/gpu_sweep.py --out DIR --gemm 128,128,64,8,3,0 128,256,64,8,3,0 ...
                                   (bm,bn,bk,warps,stages,maxnreg; maxnreg 0: none)

Writes DIR/gpu_sweep.json; prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gpu import TILES, late_waits, phase_programs, shape_inputs, shapes  # noqa: E402

from hpmoe.gpu.backend import TritonOptions, triton_forward  # noqa: E402
from hpmoe.gpu.residency import SMLimits, resident_programs  # noqa: E402
from hpmoe.gpu.runner import KernelConfig, compiled_resources  # noqa: E402
from hpmoe.gpu.split import cuda_ms  # noqa: E402
from hpmoe.ir.graph import TaskKind  # noqa: E402
from hpmoe.ir.schedule import WorkerCounts  # noqa: E402
from hpmoe.schedule import SchedulePolicy  # noqa: E402


def sweep_shape(name: str, br_values: list[int], shares: list[float], reps: int, warmup: int) -> list[dict]:
    spec = shapes(torch.device("cuda"))[name]
    x, w, routing, _ = shape_inputs(spec, 1)
    rows = []
    for br in br_values:
        config = dataclasses.replace(KernelConfig.for_dtype(spec.dtype), br=br)
        resident = resident_programs(compiled_resources(torch.device("cuda"), spec.dtype, config, True),
                                     SMLimits.of(torch.device("cuda")))
        for share in shares:
            workers = None
            if share:
                matrix = max(1, min(resident - 1, round(resident * share)))
                workers = WorkerCounts(matrix=matrix, vector=resident - matrix)

            def fill(row: dict, config=config, workers=workers, phases=share == shares[0],
                     resident=resident) -> None:
                fwd = triton_forward(x, w, routing, 1, TILES, TritonOptions(
                    policy=SchedulePolicy.HYPERPARALLEL, workers=workers, config=config))
                ws = fwd.region.schedule.workers
                row["workers"] = [ws.matrix, ws.vector]
                go = fwd.region.program.launcher(fwd.region.arena.addresses())
                row["fwd_ms"] = cuda_ms(go, reps, warmup)
                row["error"] = late_waits((go,))
                for p in phase_programs(fwd.region, resident) if phases else ():
                    if p.kind in (TaskKind.PERMUTE, TaskKind.UNPERMUTE):
                        ms = cuda_ms(p.launch, reps, warmup)
                        row[f"{p.kind.name.lower()}_ms"] = ms
                        row[f"{p.kind.name.lower()}_gbs"] = p.bytes / (ms / 1e3) / 1e9
            rows.append(measured({"shape": name, "br": br, "share": share, "resident": resident}, fill))
    return rows


def measured(row: dict, fill: Callable[[dict], None]) -> dict:
    """``row`` with what ``fill`` measured into it (or the error it raised), printed."""
    try:
        fill(row)
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    print(json.dumps(row), flush=True)
    torch.cuda.empty_cache()
    return row


def sweep_gemm(name: str, configs: list[str], reps: int, warmup: int) -> list[dict]:
    """GEMM_UP and GEMM_DOWN of the forward alone under each ``bm,bn,bk,warps,stages,maxnreg``
    (the programs split 3:1, as measured best on an H200)."""
    spec = shapes(torch.device("cuda"))[name]
    x, w, routing, _ = shape_inputs(spec, 1)
    rows = []
    for text in configs:
        bm, bn, bk, warps, stages, maxnreg = (int(v) for v in text.split(","))
        config = KernelConfig(bm=bm, bn=bn, bk=bk, num_warps=warps, num_stages=stages,
                              maxnreg=maxnreg or None)
        def fill(row: dict, config=config) -> None:
            res = compiled_resources(torch.device("cuda"), spec.dtype, config, True)
            resident = resident_programs(res, SMLimits.of(torch.device("cuda")))
            row.update(resident=resident, registers=res.registers, spill_bytes=res.spill_bytes,
                       smem_bytes=res.shared_bytes)
            matrix = round(resident * 0.75)
            fwd = triton_forward(x, w, routing, 1, TILES, TritonOptions(
                workers=WorkerCounts(matrix=matrix, vector=resident - matrix), config=config))
            for p in phase_programs(fwd.region, resident):
                if p.kind in (TaskKind.GEMM_UP, TaskKind.GEMM_DOWN):
                    ms = cuda_ms(p.launch, reps, warmup)
                    row[f"{p.kind.name.lower()}_tflops"] = p.flops / (ms / 1e3) / 1e12
                    row["error"] = row.get("error", "") + late_waits((p.launch,))
        rows.append(measured({"shape": name, "config": text}, fill))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--shapes", nargs="*", default=["small", "deepseek-v3-fit"])
    p.add_argument("--br", nargs="*", type=int, default=[16, 64])
    p.add_argument("--share", nargs="*", type=float, default=[0.0, 0.5, 0.67])
    p.add_argument("--gemm", nargs="*", default=None, help="bm,bn,bk,warps,stages,maxnreg per config")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_sweep.py needs a CUDA device; none is available", file=sys.stderr)
        return 2
    a.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in a.shapes:
        if a.gemm:
            rows += sweep_gemm(name, a.gemm, a.reps, a.warmup)
        else:
            rows += sweep_shape(name, a.br, a.share, a.reps, a.warmup)
        meta = {"device": torch.cuda.get_device_name(), "command": " ".join(sys.argv), "rows": rows}
        (a.out / "gpu_sweep.json").write_text(json.dumps(meta, indent=1))
    for r in rows if not a.gemm else ():
        nan = float("nan")
        print(f"{r['shape']:>16} br {r['br']:>3} share {r['share']:.2f} workers {r.get('workers')} "
              f"fwd {r.get('fwd_ms', nan):8.3f} ms  permute {r.get('permute_ms', nan):7.3f} ms "
              f"unpermute {r.get('unpermute_ms', nan):7.3f} ms {r.get('error', '')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
