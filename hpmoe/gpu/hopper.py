"""Compile the persistent kernel for Hopper (sm_90) without a GPU, and report what it uses.

``triton.compile`` with ``GPUTarget("cuda", 90, 32)`` runs the whole NVIDIA pipeline
(TTIR -> TTGIR -> LLVM -> PTX -> ptxas -> cubin) on a CPU-only machine.  The report
says whether the GEMM path uses tensor-core warpgroup MMA (``wgmma`` in the PTX), the
registers per thread and bytes of local memory (spills) that ptxas allocated (read from
the cubin with the ``cuobjdump`` bundled with triton), the shared memory, and the
programs that stay resident on an H100 (``residency``).

    python -m hpmoe.gpu.hopper [--dtype bf16|fp32] [--bm 64 --bn 64 --bk 32 --warps 4 ...]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .residency import H100, KernelResources, programs_per_sm
from .runner import KernelConfig, device_module, kernel_meta, launch_options

_POINTERS = {**{n: "*i32" for n in ("tasks", "wait_event_", "wait_threshold", "wait_step", "sig_ptr",
                                     "sig_event", "queue_ptr", "queue_task")},
             "addr": "*i64", "lds": "*i64", "counters": "*i32", "cursor": "*i32", "errors": "*i32",
             "stamps": "*i64", "clock": "*i64", "delays": "*i64"}


@dataclass(frozen=True)
class HopperReport:
    """What the sm_90 build of the persistent kernel uses."""

    dtype: str
    config: KernelConfig
    wgmma: bool  # the GEMM path issues wgmma.mma_async
    mma_sync: bool  # ... or older mma.sync tensor-core instructions
    registers: int  # per thread, as ptxas allocated them
    spill_bytes: int  # local memory per thread (spills and stack)
    shared_bytes: int
    programs_per_sm: int  # on an H100
    resident: int  # programs resident on an H100 (132 SMs)

    def line(self) -> str:
        c = self.config
        return (f"sm_90 {self.dtype} BM{c.bm} BN{c.bn} BK{c.bk} BR{c.br} BC{c.bc} warps {c.num_warps} "
                f"stages {c.num_stages} maxnreg {c.maxnreg}: wgmma={self.wgmma} registers={self.registers} "
                f"spills={self.spill_bytes} B shared={self.shared_bytes} B -> {self.programs_per_sm}/SM, "
                f"{self.resident} resident on an H100")


def compile_hopper(dtype: torch.dtype = torch.bfloat16, config: KernelConfig | None = None,
                   stamps: bool = False) -> HopperReport:
    """Compile ``taskflow_kernel`` (blocking mode) for sm_90 and report its resources."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    config = config or KernelConfig()
    meta = kernel_meta(dtype, config, False, True, 2 if stamps else 0, False)
    fn = device_module(False).taskflow_kernel
    signature = {**_POINTERS, "epoch": "i32", "deadline_ns": "i64", **{k: "constexpr" for k in meta}}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(_POINTERS))}
    src = ASTSource(fn=fn, signature=signature, constexprs=meta, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=launch_options(config))
    regs, local = cubin_usage(k.asm["cubin"])
    ptx = k.asm["ptx"]
    res = KernelResources(registers=regs, spill_bytes=local, shared_bytes=int(k.metadata.shared),
                          num_warps=config.num_warps)
    per_sm = programs_per_sm(res, H100)
    return HopperReport(dtype=str(dtype).removeprefix("torch."), config=config,
                        wgmma="wgmma.mma_async" in ptx, mma_sync=bool(re.search(r"\bmma\.sync", ptx)),
                        registers=regs, spill_bytes=local, shared_bytes=res.shared_bytes,
                        programs_per_sm=per_sm, resident=per_sm * H100.sms)


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


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    for name, default in asdict(KernelConfig()).items():
        p.add_argument(f"--{name.replace('num_', '')}", type=int, default=default, dest=name)
    p.add_argument("--no-maxnreg", action="store_const", const=None, dest="maxnreg")
    p.add_argument("--stamps", action="store_true")
    a = p.parse_args(argv)
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    config = KernelConfig(**{k: getattr(a, k) for k in asdict(KernelConfig())})
    print(compile_hopper(dtype, config, a.stamps).line())


if __name__ == "__main__":
    main()
