"""The machine a figure came from: CPU model, vector capability, cores, whether it
computes bf16 natively, and the software versions; and the dtype a CPU run should
default to.

CPUs differ more than their names say: with AVX-512-BF16 or AMX a one-thread bf16 GEMM
runs faster than fp32, with AVX2 only torch emulates bf16 about 60x slower than fp32,
so a bf16 figure there measures the emulation, not hpmoe."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")  # x86 (AVX-512-BF16, AMX), arm64 (FEAT_BF16)
_X86_BELOW_AVX512 = ("DEFAULT", "AVX2")  # torch's x86 kernels below AVX-512 compute no bf16 natively


def native_bf16(flags: set[str], capability: str, x86: bool) -> bool:
    """Whether torch computes bf16 natively here: the CPU has the instructions and, on
    x86, torch dispatches to AVX-512 kernels (``ATEN_CPU_CAPABILITY=avx2`` caps it, as
    an AVX2 machine would: the flags alone would then claim bf16 that torch emulates)."""
    return any(f in flags for f in _BF16_FLAGS) and not (x86 and capability in _X86_BELOW_AVX512)


@dataclass(frozen=True)
class Machine:
    """What a benchmark records next to its figures."""

    cpu: str  # model name from /proc/cpuinfo (platform.processor() elsewhere)
    capability: str  # torch.backends.cpu.get_cpu_capability(): AVX2, AVX512, ...
    cores: int  # cores this process may run on
    native_bf16: bool
    python: str
    torch: str
    numpy: str
    triton: str | None
    hpmoe: str

    def to_json(self) -> dict:
        return asdict(self)

    def fingerprint(self) -> str:
        """The hardware alone (what a tuned choice is valid for): CPU, capability, cores."""
        return f"{self.cpu} | {self.capability} | {self.cores} cores"

    def versions(self) -> dict[str, str | None]:
        """The software a tuned choice was measured with."""
        return {"hpmoe": self.hpmoe, "torch": self.torch, "triton": self.triton}

    def line(self) -> str:
        bf16 = "native bf16" if self.native_bf16 else "no native bf16"
        return (f"{self.cpu} ({self.capability}, {bf16}), {self.cores} cores; "
                f"python {self.python}, torch {self.torch}")


def _cpuinfo() -> tuple[str, set[str]]:
    """(model name, feature flags) from /proc/cpuinfo; ('', set()) where there is none."""
    path = Path("/proc/cpuinfo")
    if not path.exists():
        return "", set()
    model, flags = "", set()
    for line in path.read_text(errors="replace").splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "cpu model") and not model:
            model = value.strip()
        elif key in ("flags", "features") and not flags:
            flags = set(value.split())
    return model, flags


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine() -> Machine:
    """This machine, as ``Machine``."""
    model, flags = _cpuinfo()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    capability = torch.backends.cpu.get_cpu_capability()
    x86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")
    return Machine(cpu=model or platform.processor() or platform.machine(), capability=capability,
                   cores=cores, native_bf16=native_bf16(flags, capability, x86),
                   python=platform.python_version(),
                   torch=torch.__version__, numpy=_version("numpy") or "?", triton=_version("triton"),
                   hpmoe=_version("hpmoe") or "checkout")


def capturing(device: torch.device) -> bool:
    """Whether a CUDA graph's capture records ``device``'s current stream: nothing a
    capture records may read the device from the host, and what it records replays as
    recorded."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def default_cpu_dtype(m: Machine | None = None) -> tuple[torch.dtype, str]:
    """bf16 where this CPU computes it natively, else fp32; with the reason, to print."""
    m = m or machine()
    if m.native_bf16:
        return torch.bfloat16, f"bf16: this CPU computes it natively ({m.capability})"
    return torch.float32, (f"fp32: this CPU ({m.capability}) has no native bf16, where torch emulates "
                           "bf16 GEMMs ~60x slower than fp32 (ask for --dtype bf16 to measure that)")


def record() -> None:
    """Print this machine as one JSON line, ``{"machine": {...}}``: every benchmark's
    output starts with it, so each figure says which CPU and versions it came from."""
    print(json.dumps({"machine": machine().to_json()}), flush=True)
