"""Kernel by kernel's combines on a GPU: ``weighted_sum`` (the forward's unpermute), its
gradient and ``slot_sum`` (the backward's unpermute) as one Triton launch each, where
torch needs three to six kernels per slot (gather, scale, add, ...), each a trip
through memory.

Each row of the result reads its k gathered rows once and writes once, in the same fp32
operations in the same order as the torch version: the same values bit for bit
(``tests/test_kernel_by_kernel.py`` holds them equal in the Triton interpreter).  The
forward is the persistent kernel's SUM tile (``device._gather_sum``) in a plain launch.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from .runner import TL_DTYPES, device_module

BLOCK_ROWS, BLOCK_COLS, WARPS = 32, 256, 4
BACKWARD_ROWS = 16  # a backward program keeps k dot products a row


def available(rows: torch.Tensor) -> bool:
    """Whether ``slot_combine`` runs for ``rows``: a CUDA tensor of a dtype the kernels
    take, triton installed, not inside ``torch.compile``."""
    return rows.is_cuda and rows.dtype in TL_DTYPES and not torch.compiler.is_compiling() and _has_triton()


@functools.cache
def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def slot_combine(rows: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor | None,
                 extra: torch.Tensor | None, interpret: bool = False) -> torch.Tensor:
    """out [T, H] rows.dtype: out[t] = sum_j weights[t, j] * rows[pos[t, j]] (fp32, slot 0
    first; without weights the rows alone, from 0) + extra[t].  rows [R, H]; pos [T, k]
    int64; weights [T, k] fp32 or None; extra [T, H] or None.  interpret: run in the
    Triton interpreter (a CPU's tensors)."""
    t, k = pos.shape
    n = rows.shape[1]
    out = torch.empty(t, n, dtype=rows.dtype, device=rows.device)
    if t == 0 or n == 0:
        return out
    rows, pos = rows.contiguous(), pos.contiguous()
    w = weights.contiguous() if weights is not None else pos  # not read without weights
    x = extra.contiguous() if extra is not None else out  # not read without extra
    grid = (-(-t // BLOCK_ROWS), -(-n // BLOCK_COLS))
    device_module(interpret).combine_kernel[grid](
        rows, pos, w, x, out, t, n, rows.stride(0), x.stride(0), out.stride(0), K=k,
        WEIGHTED=weights is not None, EXTRA=extra is not None, BR=BLOCK_ROWS, BC=BLOCK_COLS,
        **_launch(rows.dtype, interpret))
    return out


def slot_combine_backward(g: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor,
                          interpret: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of the weighted ``slot_combine`` given g [T, H] fp32: (dw [T, k] fp32,
    drows [R, H] rows.dtype, each row pos[t, j] holding g[t] * weights[t, j]); every row
    of ``rows`` must be some pos[t, j] (kernel by kernel's sorted rows are)."""
    t, k = pos.shape
    n = rows.shape[1]
    dw = torch.empty(t, k, dtype=torch.float32, device=rows.device)
    drows = torch.empty_like(rows)
    if t == 0 or n == 0:
        return dw, drows.zero_()
    g, rows, pos, weights = g.contiguous(), rows.contiguous(), pos.contiguous(), weights.contiguous()
    device_module(interpret).combine_backward_kernel[(-(-t // BACKWARD_ROWS),)](
        rows, pos, weights, g, dw, drows, t, n, rows.stride(0), g.stride(0), drows.stride(0), K=k,
        KP=1 << max(k - 1, 0).bit_length(), BR=BACKWARD_ROWS, BC=BLOCK_COLS, **_launch(rows.dtype, interpret))
    return dw, drows


def _launch(dtype: torch.dtype, interpret: bool) -> dict:
    """A launch's dtype arguments and options: on a GPU without FMA contraction, so each
    product is rounded before its add (the interpreter computes so anyway, and emulates
    bf16's rounding)."""
    import triton.language as tl

    options = {} if interpret else {"num_warps": WARPS, "enable_fp_fusion": False}
    return {"DT": getattr(tl, TL_DTYPES[dtype]), "EMULATE": interpret, **options}
