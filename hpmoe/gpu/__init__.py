"""The GPU backend: a region's whole taskflow as ONE persistent Triton kernel.

Compile path: task graph -> ``Schedule`` (every virtual rank) -> ``pack`` (flat int32
arrays) -> ``DeviceProgram`` (one launch per call on a CUDA device; rounds in the
Triton interpreter on a CPU).  Only ``runner``/``device`` import triton, and only when a
region runs, so ``import hpmoe`` works without the ``gpu`` extra.
"""

from .backend import (
           PreparedRegion,
           TritonForward,
           TritonGradients,
           TritonOptions,
           triton_backward,
           triton_forward,
)
from .buffers import Arena, BufferSpace, buffer_space
from .ops import COLUMNS, Op, describe
from .pack import PackedProgram, pack
from .runner import DeviceProgram, KernelConfig, RunInfo

__all__ = ["COLUMNS", "Arena", "BufferSpace", "DeviceProgram", "KernelConfig", "Op", "PackedProgram",
           "PreparedRegion", "RunInfo", "TritonForward", "TritonGradients", "TritonOptions", "buffer_space",
           "describe", "pack", "triton_backward", "triton_forward"]
