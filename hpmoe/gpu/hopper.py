"""Compile the persistent kernel for Hopper (sm_90) without a GPU, and report what it uses.

``triton.compile`` with ``GPUTarget("cuda", 90, 32)`` runs the whole NVIDIA pipeline
(TTIR -> TTGIR -> LLVM -> PTX -> ptxas -> cubin) on a CPU-only machine.  The report
says whether the GEMM path uses tensor-core warpgroup MMA (``wgmma`` in the PTX), the
registers per thread and bytes of local memory (spills) that ptxas allocated (read from
the cubin with the ``cuobjdump`` bundled with triton), the shared memory, and the
programs that stay resident on an H100 (``residency``).

    python -m hpmoe.gpu.hopper [--dtype bf16|fp32] [--bm 128 --bn 128 --bk 64 --warps 8 ...]
                               [--unaligned] [--json] [--ptx DIR]

Exits 1 when the build breaks an ordering or pipelining guard (``ptx_guards``).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from .residency import H100, KernelResources, programs_per_sm
from .runner import KernelConfig, device_module, kernel_meta, launch_options

_POINTERS = {**{n: "*i32" for n in ("tasks", "wait_event_", "wait_threshold", "sig_ptr", "sig_event",
                                     "queue_ptr", "queue_task")},
             "addr": "*i64", "lds": "*i64", "counters": "*i32", "cursor": "*i32", "errors": "*i32",
             "stamps": "*i64", "clock": "*i64", "delays": "*i64"}


@dataclass(frozen=True)
class HopperReport:
    """What the sm_90 build of the persistent kernel uses, and the ordering guards it
    breaks (``violations``, empty when it keeps them all: see ``ptx_guards``)."""

    dtype: str
    bm: int
    bn: int
    bk: int
    warps: int
    stages: int
    maxnreg: int | None
    aligned: bool  # built for an aligned program (the K loop can be pipelined)
    wgmma: bool  # the GEMM path issues wgmma.mma_async
    mma_sync: bool  # ... or older mma.sync tensor-core instructions
    async_copy: int  # cp.async copies into shared memory in the PTX
    cooperative: bool  # launched cooperatively (the driver refuses a grid that cannot be resident)
    registers: int  # per thread, as ptxas allocated them
    spill_bytes: int  # local memory per thread (spills and stack)
    smem_bytes: int
    programs_per_sm: int  # on an H100
    resident: int  # programs resident on an H100 (132 SMs)
    violations: tuple[str, ...]

    def line(self) -> str:
        guards = "; ".join(self.violations) or "kept"
        return (f"sm_90 {self.dtype} BM{self.bm} BN{self.bn} BK{self.bk} warps {self.warps} "
                f"stages {self.stages} maxnreg {self.maxnreg} aligned={self.aligned}: wgmma={self.wgmma} "
                f"cp.async={self.async_copy} registers={self.registers} spills={self.spill_bytes} B "
                f"shared={self.smem_bytes} B -> {self.programs_per_sm}/SM, {self.resident} resident on an "
                f"H100; cooperative={self.cooperative}; guards: {guards}")


@dataclass(frozen=True)
class HopperBuild:
    """The report, the PTX it was read from and the machine code (cubin)."""

    report: HopperReport
    ptx: str
    cubin: bytes


def compile_hopper(dtype: torch.dtype = torch.bfloat16, config: KernelConfig | None = None,
                   stamps: bool = False, aligned: bool = True) -> HopperBuild:
    """Compile ``taskflow_kernel`` (blocking mode) for sm_90 and report its resources."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    config = config or KernelConfig.for_dtype(dtype)
    meta = kernel_meta(dtype, config, False, True, 2 if stamps else 0, False, aligned)
    fn = device_module(False).taskflow_kernel
    signature = {**_POINTERS, "deadline_ns": "i64", **{k: "constexpr" for k in meta}}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(_POINTERS))}
    src = ASTSource(fn=fn, signature=signature, constexprs=meta, attrs=attrs)
    options = launch_options(config)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    regs, local = cubin_usage(k.asm["cubin"])
    ptx = k.asm["ptx"]
    res = KernelResources(registers=regs, spill_bytes=local, shared_bytes=int(k.metadata.shared),
                          num_warps=config.num_warps)
    per_sm = programs_per_sm(res, H100)
    stage_bytes = (config.bm + config.bn) * config.bk * dtype.itemsize
    report = HopperReport(
        dtype=str(dtype).removeprefix("torch."), bm=config.bm, bn=config.bn, bk=config.bk,
        warps=config.num_warps, stages=config.num_stages, maxnreg=config.maxnreg, aligned=aligned,
        wgmma="wgmma.mma_async" in ptx, mma_sync=bool(re.search(r"\bmma\.sync", ptx)),
        async_copy=len(re.findall(r"\bcp\.async\.c[ag]\.shared\.global", ptx)),
        cooperative=bool(getattr(k.metadata, "launch_cooperative_grid", False)), registers=regs,
        spill_bytes=local, smem_bytes=res.shared_bytes, programs_per_sm=per_sm, resident=per_sm * H100.sms,
        violations=tuple(ptx_guards(ptx, res.shared_bytes if aligned else None, stage_bytes)))
    return HopperBuild(report=report, ptx=ptx, cubin=k.asm["cubin"])


def compile_combine(dtype: torch.dtype = torch.bfloat16, slots: int = 8, fp_fusion: bool = False,
                    backward: bool = False) -> str:
    """The sm_90 PTX of ``combine_kernel`` (kernel by kernel's weighted combine; with
    ``backward``, ``combine_backward_kernel``) as ``hpmoe.gpu.phases`` launches it
    (``fp_fusion`` False: no FMA contraction)."""
    from .phases import BACKWARD_ROWS, BLOCK_COLS, BLOCK_ROWS

    dt = _PTX_TYPES[dtype]
    common = {"K": slots, "DT": dtype, "BC": BLOCK_COLS, "EMULATE": False}
    if backward:
        meta = {**common, "KP": 1 << max(slots - 1, 0).bit_length(), "BR": BACKWARD_ROWS}
        args = {"rows": f"*{dt}", "pos": "*i64", "w": "*fp32", "g": f"*{dt}", "dw": "*fp32",
                "drows": f"*{dt}", "t": "i32", "n": "i32", "ld_rows": "i32", "ld_g": "i32", "ld_drows": "i32"}
        return compile_phase("combine_backward_kernel", args, meta, fp_fusion)
    meta = {**common, "WEIGHTED": True, "EXTRA": True, "BR": BLOCK_ROWS}
    args = {"rows": f"*{dt}", "pos": "*i64", "w": "*fp32", "extra": f"*{dt}", "out": f"*{dt}",
            "t": "i32", "n": "i32", "ld_rows": "i32", "ld_extra": "i32", "ld_out": "i32"}
    return compile_phase("combine_kernel", args, meta, fp_fusion)


_PTX_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def compile_phase(fn: str, args: dict[str, str], meta: dict[str, object], fp_fusion: bool = False,
                  rows: tuple[str, ...] = ("t", "m")) -> str:
    """The sm_90 PTX of the plain kernel ``fn`` of ``gpu.device`` (one of
    ``gpu.phases``'s launches), compiled on any machine: ``args`` its runtime arguments'
    types (``*bf16``, ``i32``, ...), ``meta`` its constexprs (a torch dtype stands for its
    Triton type); pointers 16-byte aligned and sizes and strides multiples of 16 but the
    row counts ``rows``, as a launch sees them (``fp_fusion`` False: no FMA contraction,
    as ``phases`` launches)."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from .phases import WARPS
    from .runner import TL_DTYPES

    meta = {k: getattr(tl, TL_DTYPES[v]) if isinstance(v, torch.dtype) else v for k, v in meta.items()}
    signature = {**args, **{k: "constexpr" for k in meta}}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(args) if name not in rows}
    src = ASTSource(fn=getattr(device_module(False), fn), signature=signature, constexprs=meta, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": WARPS, "enable_fp_fusion": fp_fusion})
    return k.asm["ptx"]


_ORDERING = re.compile(r"\b(bar\.sync|barrier\.sync|st\.global|red\.global|atom\.global)")


def ptx_guards(ptx: str, smem_bytes: int | None, stage_bytes: int) -> list[str]:
    """The ordering and pipelining rules ``ptx`` breaks (empty: none):

    * every wait polls with acquire semantics (``ld``/``atom ... .gpu.acquire``) and
      nothing reads through the non-coherent path (``ld.global.nc``), which may return
      data another program wrote before the wait was satisfied;
    * every release atomic (a signal) has a ``bar.sync`` as the last ordering
      instruction before it, so the whole program's stores precede the signal;
    * (``smem_bytes`` given: an aligned build) the GEMM's K loop copies asynchronously
      (``cp.async``) into shared memory holding at least two stages of A and B blocks
      (``stage_bytes`` each)."""
    lines = ptx.splitlines()
    out = []
    if not re.search(r"\b(ld|atom)\.global\.gpu\.acquire", ptx):
        out.append("no wait polls with acquire semantics")
    if re.search(r"\bld\.global\.nc", ptx):
        out.append("a load goes through the non-coherent path (ld.global.nc)")
    releases = [i for i, line in enumerate(lines) if re.search(r"\b(atom|red)\.global\.gpu\.release", line)]
    if not releases:
        out.append("no signal is a release atomic")
    for i in releases:
        before = [m.group(1) for line in lines[:i] if (m := _ORDERING.search(line))]
        if not before or before[-1] not in ("bar.sync", "barrier.sync"):
            out.append(f"PTX line {i + 1}: a release atomic follows {before[-1] if before else 'nothing'}, "
                       "not bar.sync")
    if smem_bytes is not None:
        if not re.search(r"\bcp\.async\.c[ag]\.shared\.global", ptx):
            out.append("the GEMM's K loop issues no asynchronous copies (cp.async): it is not pipelined")
        if smem_bytes < 2 * stage_bytes:
            out.append(f"shared memory {smem_bytes} B holds fewer than two stages of A and B blocks "
                       f"({stage_bytes} B each)")
    return out


def cubin_usage(cubin: bytes) -> tuple[int, int]:
    """(registers per thread, local bytes per thread) of the one kernel in ``cubin``."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "kernel.cubin"
        path.write_bytes(cubin)
        out = subprocess.run([str(tool), "-res-usage", str(path)], capture_output=True, text=True,
                             check=True).stdout
    regs = re.search(r"REG:(\d+)", out)
    local = re.search(r"LOCAL:(\d+)", out)
    if regs is None or local is None:
        raise RuntimeError(f"cuobjdump printed no register usage: {out!r}")
    return int(regs.group(1)), int(local.group(1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    for name in asdict(KernelConfig()):
        p.add_argument(f"--{name.replace('num_', '')}", type=int, default=None, dest=name,
                       help="default: KernelConfig.for_dtype's")
    p.add_argument("--unaligned", action="store_true", help="the build for a program that is not aligned")
    p.add_argument("--stamps", action="store_true")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--ptx", type=Path, default=None, help="write the PTX into this folder")
    a = p.parse_args(argv)
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    given = {k: getattr(a, k) for k in asdict(KernelConfig()) if getattr(a, k) is not None}
    config = replace(KernelConfig.for_dtype(dtype), **given)
    build = compile_hopper(dtype, config, a.stamps, not a.unaligned)
    if a.ptx is not None:
        a.ptx.mkdir(parents=True, exist_ok=True)
        (a.ptx / f"taskflow_kernel-{a.dtype}.ptx").write_text(build.ptx)
    print(json.dumps(asdict(build.report)) if a.json else build.report.line())
    return 1 if build.report.violations else 0


if __name__ == "__main__":
    sys.exit(main())
