"""Where the default path's time goes on one GPU, against torch's grouped-GEMM layer.

Runs only on a CUDA device.  For one shape of ``bench_gpu.py`` (4096 tokens, balanced
routing, bf16): the layer's default path (kernel by kernel, grouped GEMMs) called
directly and through ``hpmoe.MoE.region`` (what a user calls), and the
``torch-grouped-mm`` variant, forward and forward+backward, each ``--calls`` times under
``torch.profiler`` after warm-ups.  Per variant: the wall time per call (CUDA events
around all calls), the kernels' busy time per call, the GPU's idle share (what the host
leaves unfilled: Python, launches, syncs), kernels per call and the ten kernels that
take longest in total.

    python benchmarks/gpu_profile.py --out DIR [--shape deepseek-v3-fit] [--calls 10]

Writes DIR/gpu_profile.json; prints a table.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gpu import TOKENS, Peer, grouped_forward, layer_step, shape_inputs, shapes, torch_step  # noqa: E402

from hpmoe.exec.arena import ArenaPool  # noqa: E402
from hpmoe.exec.kernel_by_kernel import kbk_backward, kbk_forward  # noqa: E402
from hpmoe.nn.layer import MoE  # noqa: E402


def profile(fn: Callable[[], object], calls: int, warmup: int) -> dict:
    """One variant: wall and kernel time per call, idle share, kernels per call, top kernels."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
    wall_ms = start.elapsed_time(end) / calls
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_us = sum(e.self_device_time_total for e in kernels) / calls
    count = sum(e.count for e in kernels) / calls
    top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:10]
    return {"wall_ms": wall_ms, "kernel_ms": busy_us / 1e3, "idle_share": 1 - busy_us / 1e3 / wall_ms,
            "kernels_per_call": count,
            "top": [{"name": e.key[:90], "ms_per_call": e.self_device_time_total / 1e3 / calls,
                     "count_per_call": e.count / calls} for e in top]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--shape", default="deepseek-v3-fit")
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_profile.py needs a CUDA device; none is available", file=sys.stderr)
        return 2
    spec = shapes(torch.device("cuda"))[a.shape]
    x, w, routing, dy = shape_inputs(spec, 1)
    pool, peer = ArenaPool(), Peer.of(routing, spec)
    def default_step() -> object:
        return kbk_backward(kbk_forward(x, routing, w, pool=pool, save=True)[1], dy, pool)

    layer = MoE(spec, w)
    variants = {
        "kernel-by-kernel/fwd": lambda: kbk_forward(x, routing, w, pool=pool),
        "kernel-by-kernel/fwd+bwd": default_step,
        "default/fwd": layer_step(layer, x, routing, dy, False),
        "default/fwd+bwd": layer_step(layer, x, routing, dy, True),
        "torch-grouped-mm/fwd": torch_step(grouped_forward, x, w, routing, dy, peer, False),
        "torch-grouped-mm/fwd+bwd": torch_step(grouped_forward, x, w, routing, dy, peer, True),
    }
    report = {"shape": a.shape, "tokens": TOKENS, "device": torch.cuda.get_device_name(), "variants": {}}
    for name, fn in variants.items():
        r = profile(fn, a.calls, a.warmup)
        report["variants"][name] = r
        print(f"{name:>26}  wall {r['wall_ms']:8.3f} ms  kernels {r['kernel_ms']:8.3f} ms  "
              f"idle {r['idle_share']:5.1%}  {r['kernels_per_call']:6.1f} kernels/call", flush=True)
        for k in r["top"]:
            print(f"{'':>28}{k['ms_per_call']:8.3f} ms  x{k['count_per_call']:5.1f}  {k['name']}")
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "gpu_profile.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
