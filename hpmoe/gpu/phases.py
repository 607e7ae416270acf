"""Kernel by kernel's memory-bound phases on a GPU, one Triton launch each (``TRITON``,
the ``exec.phases.Phases`` table a CUDA call runs), and the scan of a call's input.

torch needs one to six kernels a phase (the combine: gather, scale and add per slot),
each a trip through memory; here each phase reads its inputs once and writes once, in
the same fp32 operations in the same order as the torch version, so the values are the
same bit for bit where the order is (``tests/test_kernel_by_kernel.py`` and
``tests/test_gpu_phases.py`` hold them equal in the Triton interpreter; the combine's
weight gradient sums its products in another order).  A phase runs for CUDA tensors
of a dtype the kernels take (the gated activation: SiLU's plain form only), outside
``torch.compile``; anything else falls back to the torch version.  The combine is the
persistent kernel's SUM tile (``device._gather_sum``) in a plain launch.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from ..exec.arena import Arena
from ..exec.phases import Phases, glu_router_backward, permute, slot_sum, weighted_sum, weighted_sum_backward
from ..regions.backward_kernels import glu_backward
from ..regions.kernels import glu
from ..regions.slot_routing import SlotRouting
from ..regions.slot_routing import resolve_slots as torch_resolve_slots
from ..regions.slots import SlotShape
from ..routing import Scanned
from ..spec import Activation, GluForm
from .runner import TL_DTYPES, device_module

BLOCK_ROWS, BLOCK_COLS, WARPS = 32, 256, 4
BACKWARD_ROWS = 16  # a backward program keeps k dot products a row
SCAN_ROWS, SCAN_COLS = 16, 256
SLOT_IDS, SLOT_SUB = 1024, 32  # a slot program's flat ids, and how many it compares at once
SLOT_BLOCKS, SLOT_SLOTS = 16, 32  # the layout program's blocks and slots at once
SLOT_ZERO = 1024  # rows of tokens a count program zeroes at once
SLOT_ENTRIES = 256  # task-table entries a columns program writes
BIG = 1 << 62  # ``device.BIG``: "nothing found" in the scan's facts


def available(t: torch.Tensor) -> bool:
    """Whether the phases' kernels run for ``t``: a CUDA tensor of a dtype they take,
    triton installed, not inside ``torch.compile``."""
    return t.is_cuda and t.dtype in TL_DTYPES and not torch.compiler.is_compiling() and _has_triton()


def integers_launch(t: torch.Tensor) -> bool:
    """Whether the routing's integer kernels (its slots, a plan's task-table entries) run
    for ``t``: a CUDA tensor, triton installed, not inside ``torch.compile``."""
    return t.is_cuda and not torch.compiler.is_compiling() and _has_triton()


@functools.cache
def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def _blocks(rows: int, cols: int, br: int = BLOCK_ROWS, bc: int = BLOCK_COLS) -> tuple[int, int]:
    return -(-rows // br), -(-cols // bc)


# ---------------------------------------------------------------------------- phases


def triton_permute(x: torch.Tensor, order: torch.Tensor, k: int, out: torch.Tensor,
                   interpret: bool = False) -> torch.Tensor:
    """``exec.phases.permute`` in one launch: out [T*k, H] = x[order // k]."""
    if not (available(x) or interpret):
        return permute(x, order, k, out)
    t, n = out.shape
    if t and n:
        x, order = x.contiguous(), order.contiguous()
        device_module(interpret).permute_kernel[_blocks(t, n)](
            x, order, out, t, n, x.stride(0), out.stride(0), K=k, BR=BLOCK_ROWS, BC=BLOCK_COLS,
            **_launch(x.dtype, interpret, dtype_arg=False))
    return out


def _plain_silu(h: torch.Tensor, activation: Activation, form: GluForm, interpret: bool) -> bool:
    """Whether the kernels compute this gated activation: SiLU, plain form."""
    return (available(h) or interpret) and activation is Activation.SILU and form.plain


def triton_glu(h: torch.Tensor, out: torch.Tensor, activation: Activation, form: GluForm,
               interpret: bool = False) -> None:
    """``regions.kernels.glu`` in one launch: out [m, F] = silu(h[:, :F]) * h[:, F:]."""
    if not _plain_silu(h, activation, form, interpret):
        glu(h, out, activation, form)
        return
    m, f = out.shape
    if m and f:
        device_module(interpret).glu_kernel[_blocks(m, f)](
            h, out, m, f, h.stride(0), out.stride(0), BR=BLOCK_ROWS, BC=BLOCK_COLS,
            **_launch(h.dtype, interpret))


def triton_glu_backward(h: torch.Tensor, da: torch.Tensor, dh: torch.Tensor, activation: Activation,
                        tmp: torch.Tensor | None = None, form: GluForm | None = None,
                        interpret: bool = False) -> None:
    """``regions.backward_kernels.glu_backward`` in one launch: dh [m, 2F], the gradient
    of the gated activation of h given da [m, F] (``tmp``: unused)."""
    form = form or GluForm()
    if not _plain_silu(h, activation, form, interpret):
        glu_backward(h, da, dh, activation, tmp, form)
        return
    m, f = da.shape
    if m and f:
        device_module(interpret).glu_backward_kernel[_blocks(m, f)](
            h, da, dh, m, f, h.stride(0), da.stride(0), dh.stride(0), BR=BLOCK_ROWS, BC=BLOCK_COLS,
            **_launch(h.dtype, interpret))


def triton_glu_router_backward(h: torch.Tensor, d: torch.Tensor, w: torch.Tensor | None, dh: torch.Tensor,
                               a_w: torch.Tensor, activation: Activation, form: GluForm | None = None,
                               interpret: bool = False) -> torch.Tensor | None:
    """``exec.phases.glu_router_backward`` in one launch: dh, a_w and the rows' routing
    weight gradients ds [M] fp32 (None without weights) from h [M, 2F], d [M, F], w [M]."""
    form = form or GluForm()
    if not _plain_silu(h, activation, form, interpret):
        return glu_router_backward(h, d, w, dh, a_w, activation, form)
    m, f = d.shape
    ds = torch.empty(m, dtype=torch.float32, device=d.device) if w is not None else None
    if m and f:
        unread = d  # w's and ds's address without weights: never dereferenced
        device_module(interpret).glu_router_backward_kernel[(-(-m // BACKWARD_ROWS),)](
            h, d, unread if w is None else w, dh, a_w, unread if ds is None else ds, m, f, h.stride(0),
            d.stride(0), dh.stride(0), a_w.stride(0), WEIGHTED=w is not None, BR=BACKWARD_ROWS, BC=BLOCK_COLS,
            **_launch(h.dtype, interpret))
    elif ds is not None:
        ds.zero_()
    return ds


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
    device_module(interpret).combine_kernel[_blocks(t, n)](
        rows, pos, w, x, out, t, n, rows.stride(0), x.stride(0), out.stride(0), K=k,
        WEIGHTED=weights is not None, EXTRA=extra is not None, BR=BLOCK_ROWS, BC=BLOCK_COLS,
        **_launch(rows.dtype, interpret))
    return out


def slot_combine_backward(g: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor,
                          interpret: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of the weighted ``slot_combine`` given g [T, H] (any float dtype,
    read in fp32): (dw [T, k] fp32, drows [R, H] rows.dtype, each row pos[t, j] holding
    g[t] * weights[t, j]); every row of ``rows`` must be some pos[t, j] (kernel by
    kernel's sorted rows are)."""
    t, k = pos.shape
    n = rows.shape[1]
    dw = torch.empty(t, k, dtype=torch.float32, device=rows.device)
    drows = torch.empty_like(rows)
    if t == 0 or n == 0:
        return dw, drows.zero_()
    g, rows, pos, weights = g.contiguous(), rows.contiguous(), pos.contiguous(), weights.contiguous()
    device_module(interpret).combine_backward_kernel[(-(-t // BACKWARD_ROWS),)](
        rows, pos, weights, g, dw, drows, t, n, rows.stride(0), g.stride(0), drows.stride(0), K=k,
        KP=_pow2(k), BR=BACKWARD_ROWS, BC=BLOCK_COLS, **_launch(rows.dtype, interpret))
    return dw, drows


def _weighted_sum(rows: torch.Tensor, pos: torch.Tensor, w: torch.Tensor, shared: torch.Tensor | None,
                  arena: Arena) -> torch.Tensor:
    if not available(rows):
        return weighted_sum(rows, pos, w, shared, arena)
    return slot_combine(rows, pos, w, shared)


def _weighted_sum_backward(g: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor, w: torch.Tensor,
                           arena: Arena) -> tuple[torch.Tensor, torch.Tensor]:
    if not available(rows):
        return weighted_sum_backward(g, rows, pos, w, arena)
    return slot_combine_backward(g, rows, pos, w)


def _slot_sum(rows: torch.Tensor, pos: torch.Tensor, extra: torch.Tensor | None,
              arena: Arena) -> torch.Tensor:
    if not available(rows):
        return slot_sum(rows, pos, extra, arena)
    return slot_combine(rows, pos, None, extra)


TRITON = Phases(permute=triton_permute, glu=triton_glu, glu_backward=triton_glu_backward,
                weighted_sum=_weighted_sum, weighted_sum_backward=_weighted_sum_backward, slot_sum=_slot_sum,
                glu_router_backward=triton_glu_router_backward)


# ---------------------------------------------------------------------------- the input scan


def scan(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: int,
         held: torch.Tensor | None = None, interpret: bool = False) -> Scanned:
    """The scan of x [N, H], ids [N, k] int64 and weights [N, k] fp32 in two small
    launches and one copy, no host read: the facts (``device.scan_kernel``: x's first
    non-finite row, the ids' range, a non-finite weight; the clamped ids and their
    counts), then the verdict (``device.verdict_kernel``), kept also in ``held`` ([3]
    int64) unless that holds a fault already."""
    n, k = ids.shape
    facts = _start(experts, x.device).clone()  # (BIG, BIG, -BIG, 0) then zero counts
    status = torch.empty(3, dtype=torch.int64, device=x.device)
    out = torch.empty_like(ids)
    dev = device_module(interpret)
    if n:
        x, ids, weights = x.contiguous(), ids.contiguous(), weights.contiguous()
        dev.scan_kernel[(-(-n // SCAN_ROWS),)](
            x, ids, weights, out, facts, facts[4:], n, x.shape[1], x.stride(0), experts, K=k, KP=_pow2(k),
            BR=SCAN_ROWS, BC=SCAN_COLS)
    dev.verdict_kernel[(1,)](facts, status, status if held is None else held, experts,
                             MERGE=held is not None)
    return Scanned(status, out, facts[4:])


@functools.cache
def _start(experts: int, device: torch.device) -> torch.Tensor:
    """The scan's facts and counts before a call: (BIG, BIG, -BIG, 0), then zeros."""
    start = torch.zeros(4 + experts, dtype=torch.int64, device=device)
    start[:3] = torch.tensor([BIG, BIG, -BIG], dtype=torch.int64, device=device)
    return start


# ---------------------------------------------------------------------------- a routing's slots


def resolve_slots(ids: torch.Tensor, shape: SlotShape, interpret: bool = False,
                  into: tuple[torch.Tensor, torch.Tensor] | None = None) -> SlotRouting:
    """``regions.slot_routing.resolve_slots`` (the reference, which a CPU and a compiled
    graph run) in three launches and no host read, the same integers: each block of
    ``SLOT_IDS`` flat ids counted per expert (``device.slot_count_kernel``, which also
    zeroes the rows' tokens), one program's prefix over the blocks and the slot layout
    (``slot_layout_kernel``), then each id's row (``slot_rows_kernel``): where torch
    needs 33 operations, a stable sort among them.  ``into``: (tok [capacity, 1], pos
    [T, k]) int32 contiguous, a program's row indices, written too (by the launches
    themselves: no copy)."""
    if into is not None and not all(t.dtype == torch.int32 and t.is_contiguous() for t in into):
        raise ValueError("resolve_slots: into must be two contiguous int32 tensors (tok, pos), got "
                         f"{[(t.dtype, 'contiguous' if t.is_contiguous() else 'strided') for t in into]}")
    if not (integers_launch(ids) or interpret):
        slots = torch_resolve_slots(ids, shape)
        if into is not None:
            into[0].copy_(slots.row_token.view(-1, 1))
            into[1].copy_(slots.pos)
        return slots
    g, experts, k = shape.tiles.gemm_rows, shape.moe.experts, shape.moe.top_k
    flat = ids.reshape(-1).contiguous()
    n, ep, dev = flat.numel(), _pow2(experts), device_module(interpret)
    blocks = max(-(-n // SLOT_IDS), 1)

    def empty(*size: int) -> torch.Tensor:
        return torch.empty(*size, dtype=torch.int64, device=flat.device)

    hist, pos, row_token = empty(blocks, ep), empty(n), empty(shape.capacity)
    counts, first = empty(experts), empty(experts)
    slot_expert, slot_rows = empty(shape.slots), empty(shape.slots)
    tok, pos32 = into if into is not None else (row_token, pos)  # (unread without INTO)
    dev.slot_count_kernel[(blocks,)](flat, hist, row_token, tok, n, shape.capacity, EP=ep, B=SLOT_IDS,
                                     SB=SLOT_SUB, ZB=SLOT_ZERO, INTO=into is not None)
    dev.slot_layout_kernel[(1,)](hist, blocks, counts, first, slot_expert, slot_rows, experts, shape.slots, g,
                                 EP=ep, HB=SLOT_BLOCKS, SS=SLOT_SLOTS)
    dev.slot_rows_kernel[(blocks,)](flat, hist, first, pos, row_token, pos32, tok, n, experts, g, K=k, EP=ep,
                                    B=SLOT_IDS, SB=SLOT_SUB, INTO=into is not None)
    return SlotRouting(counts=counts, first=first, slot_expert=slot_expert, slot_rows=slot_rows,
                       pos=pos.view(-1, k), row_token=row_token)


# ---------------------------------------------------------------------------- launches


def _pow2(k: int) -> int:
    """``k`` rounded up to a power of two (1 at least)."""
    return 1 << max(k - 1, 0).bit_length()


def _launch(dtype: torch.dtype, interpret: bool, dtype_arg: bool = True) -> dict:
    """A launch's dtype arguments and options: on a GPU without FMA contraction, so each
    product is rounded before its add (the interpreter computes so anyway, and emulates
    bf16's rounding)."""
    import triton.language as tl

    options = {} if interpret else {"num_warps": WARPS, "enable_fp_fusion": False}
    args = {"DT": getattr(tl, TL_DTYPES[dtype]), "EMULATE": interpret} if dtype_arg else {}
    return {**args, **options}
