"""First contact with a CUDA device: what the device is, what the persistent kernel
compiles to on it, and whether each path runs and agrees with the CPU reference.

Steps (each reported, none fatal to the next):
  env        device, capability, SMs, L2, torch / triton / python versions
  resources  registers, spills, shared memory of the persistent kernel compiled for this
             device (bf16 and fp32) and the programs that stay resident
  region     ``triton_forward`` / ``triton_backward`` of a small region (EP 2) with a
             2 s per-wait deadline, against ``moe_forward`` / ``moe_forward_backward``
             on the CPU; wall time of a second run
  layer      ``hpmoe.nn.MoE`` moved to CUDA on its default path, forward and backward,
             against the same layer on the CPU and against the dense reference
  auto       the same layer with ``backend="auto"`` trained until its tuning settles:
             each candidate's steps, the winner, and every step against the default path
  deadline   a wait that can never be met, under a 0.2 s deadline: seconds until the
             ``RegionError`` that names it

    python benchmarks/gpu_smoke.py --json smoke.json

Exits 2 without a CUDA device, 1 if any step failed, else 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from hpmoe.engine import moe_forward
from hpmoe.exec.exact_backward import moe_forward_backward
from hpmoe.routing import RoutingKind, synthetic_routing
from hpmoe.spec import GateKind, MoESpec, ParallelSpec, TileSpec
from hpmoe.weights import ExpertWeights

SPEC = MoESpec(hidden=256, ffn=128, experts=16, top_k=4, shared_experts=1, gate=GateKind.SOFTMAX,
               dtype=torch.bfloat16)
TILES = TileSpec(rows=32, gemm_rows=64, gemm_cols=128)
TOKENS = 64


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 on the CPU (NaN if a holds any NaN)."""
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def to_cuda(w: ExpertWeights) -> ExpertWeights:
    return dataclasses.replace(w, **{f.name: getattr(w, f.name).cuda() for f in dataclasses.fields(w)
                                     if isinstance(getattr(w, f.name), torch.Tensor)})


def env() -> dict:
    import triton

    p = torch.cuda.get_device_properties(0)
    return {"device": p.name, "capability": list(torch.cuda.get_device_capability(0)),
            "sms": p.multi_processor_count, "l2_bytes": getattr(p, "L2_cache_size", None),
            "memory_bytes": p.total_memory, "torch": torch.__version__, "cuda": torch.version.cuda,
            "triton": triton.__version__, "python": platform.python_version()}


def resources() -> dict:
    from hpmoe.gpu.residency import SMLimits, resident_programs
    from hpmoe.gpu.runner import compiled_resources

    out = {}
    for dtype in (torch.bfloat16, torch.float32):
        for aligned in (False, True):
            res = compiled_resources(torch.device("cuda"), dtype, None, aligned)
            resident = resident_programs(res, SMLimits.of(torch.device("cuda")))
            out[f"{str(dtype)[6:]}{'-aligned' if aligned else ''}"] = {**dataclasses.asdict(res),
                                                                        "resident": resident}
    return out


def region() -> dict:
    from hpmoe.gpu.backend import TritonOptions, triton_backward, triton_forward

    ep = 2
    w = ExpertWeights.random(SPEC, 0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(ep * TOKENS, SPEC.hidden, generator=g).to(SPEC.dtype)
    dy = torch.randn(ep * TOKENS, SPEC.hidden, generator=g).to(SPEC.dtype)
    routing = synthetic_routing(RoutingKind.ZIPF, SPEC, ParallelSpec(ep, TOKENS), 0)
    want = moe_forward_backward(x, w, routing, dy, ep, TILES)
    croute = dataclasses.replace(routing, weights=routing.weights.cuda())
    t0 = time.perf_counter()
    fwd = triton_forward(x.cuda(), to_cuda(w), croute, ep, TILES, TritonOptions(deadline_s=2.0))
    first_s = time.perf_counter() - t0
    grads = triton_backward(fwd, dy.cuda())
    again = fwd.region.run()
    return {"first_call_s": first_s, "second_run_s": again.seconds,
            "queues": fwd.region.program.packed.num_queues,
            "tasks": fwd.region.program.packed.num_tasks,
            "out_rel": rel(fwd.out, want.out),
            "out_vs_moe_forward_rel": rel(fwd.out, moe_forward(x, w, routing, ep, TILES)),
            **{f"{n}_rel": rel(getattr(grads.grads, n), getattr(want.backward.grads, n))
               for n in ("dx", "dweights", "dw13", "dw2")}}


def _step(m: torch.nn.Module, x: torch.Tensor, reference: bool = False) -> tuple[torch.Tensor, ...]:
    """(y, x.grad, the experts' gate_up_proj.grad) of one step of layer ``m`` on ``x``
    ([2, 32, H], the layer's dtype; loss: the sum of y squared in fp32); ``reference``:
    by autograd through the gate and ``refs.dense_moe`` on ``m``'s parameters instead."""
    from hpmoe.refs import dense_moe
    from hpmoe.routing import route

    x = x.detach().clone().requires_grad_(True)
    if reference:
        flat = x.reshape(-1, m.spec.hidden)
        w = m.expert_weights()
        y = dense_moe(flat, w, route(flat, w)).view(x.shape)
    else:
        y = m(x)
    y.float().square().sum().backward()
    return y, x.grad, m.experts.gate_up_proj.grad


def layer(device: str = "cuda") -> dict:
    """The layer's default path on ``device``, fp32 and bf16 (on a Hopper GPU bf16 takes
    the grouped-GEMM path), against the same layer on the CPU (``*_rel``) and against
    the dense reference by autograd on the CPU (``*_ref_rel``)."""
    from hpmoe.exec.kernel_by_kernel import Experts, gemm_path
    from hpmoe.nn.layer import MoE

    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        spec = SPEC.with_dtype(dtype)
        x = torch.randn(2, 32, spec.hidden, generator=torch.Generator().manual_seed(2)).to(dtype)
        m = MoE(spec, seed=0).to(device)
        got = _step(m, x.to(device))
        cpu, ref = _step(MoE(spec, seed=0), x), _step(MoE(spec, seed=0), x, reference=True)
        w13 = m.experts.gate_up_proj
        ex = Experts(w13, m.experts.down_proj, tuple(range(w13.shape[0])), spec.activation)
        name = str(dtype)[6:]
        out[f"{name}_gemm_path"] = gemm_path(x.to(device).view(-1, spec.hidden), ex).value
        for i, what in enumerate(("y", "dx", "dw13")):
            out[f"{name}_{what}_rel"] = rel(got[i], cpu[i])
            out[f"{name}_{what}_ref_rel"] = rel(got[i], ref[i])
    return out


def auto() -> dict:
    """``backend="auto"`` on CUDA (bf16): the steps until the tuning settles, each against
    the default path's output, and the tuner's result."""
    from hpmoe.nn.layer import MoE
    from hpmoe.schedule.tune import Budget

    spec = SPEC.with_dtype(torch.bfloat16)
    x = torch.randn(TOKENS, spec.hidden, generator=torch.Generator().manual_seed(3)).to(spec.dtype).cuda()
    base, layer = MoE(spec, seed=0, tiles=TILES).cuda(), MoE(spec, seed=0, tiles=TILES, backend="auto").cuda()
    want, worst, steps = base(x).float(), 0.0, 0
    while layer.tuned(TOKENS) is None and steps < Budget().max_steps + 2:
        y = layer(x)
        y.float().square().sum().backward()
        worst, steps = max(worst, rel(y, want)), steps + 1
    result = layer.tuned(TOKENS)
    return {"steps": steps, "worst_y_rel": worst, "result": result.to_json() if result else None}


def deadline() -> dict:
    """A region whose last wait can never be met, run with a 0.2 s deadline: the seconds
    until ``RegionError`` names that wait (the goal: the deadline plus at most 0.2 s)."""
    import numpy as np

    from hpmoe.gpu.backend import triton_forward
    from hpmoe.gpu.runner import DeviceProgram
    from hpmoe.runtime.forensics import RegionError, WorkerStatus

    ep, w = 2, ExpertWeights.random(SPEC, 0)
    x = torch.randn(ep * TOKENS, SPEC.hidden, generator=torch.Generator().manual_seed(4)).to(SPEC.dtype)
    routing = synthetic_routing(RoutingKind.ZIPF, SPEC, ParallelSpec(ep, TOKENS), 0)
    croute = dataclasses.replace(routing, weights=routing.weights.cuda())
    fwd = triton_forward(x.cuda(), to_cuda(w), croute, ep, TILES)
    packed = fwd.region.program.packed
    task = int(np.flatnonzero(packed.wait_event >= 0)[-1])
    threshold = packed.wait_threshold.copy()
    threshold[task] += 1_000_000
    stuck = DeviceProgram(dataclasses.replace(packed, wait_threshold=threshold), "cuda", SPEC.dtype)
    t0 = time.perf_counter()
    try:
        stuck.run(fwd.region.arena.addresses(), deadline_s=0.2)
    except RegionError as err:
        waits = [r.task for r in err.report.workers if r.status is WorkerStatus.WAITS]
        return {"deadline_s": 0.2, "raised_after_s": time.perf_counter() - t0,
                "names_the_wait": waits == [packed.graph.task(task)]}
    raise AssertionError("a wait that can never be met ran to the end")


STEPS: dict[str, Callable[[], dict]] = {"env": env, "resources": resources, "region": region, "layer": layer,
                                        "auto": auto, "deadline": deadline}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--steps", nargs="*", default=list(STEPS), choices=list(STEPS))
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_smoke.py needs a CUDA device; none is available", file=sys.stderr)
        return 2
    report: dict[str, dict] = {}
    for name in a.steps:
        t0 = time.perf_counter()
        try:
            report[name] = {"ok": True, **STEPS[name]()}
        except Exception as e:
            report[name] = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
        report[name]["seconds"] = round(time.perf_counter() - t0, 3)
        print(name, json.dumps(report[name], default=str)[:2000], flush=True)
        if a.json:
            a.json.write_text(json.dumps(report, indent=1, default=str))
    return 0 if all(r["ok"] for r in report.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
