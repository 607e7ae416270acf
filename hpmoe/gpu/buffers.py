"""Every buffer a GPU taskflow touches, named, per virtual rank, and the arena that holds them.

A ``BufferSpace`` lists the buffers of the forward and backward regions of one
``RoutingPlan``: per EP rank, each field is a row-major 2-D view ``[rows, ld]``
(``ld``: elements per row).  Packing refers to a buffer by its id in the space; the
device reads its address from an int64 table bound at launch, so packing stays a
pure function of the plan and the schedule.

Element classes: DATA buffers hold ``spec.dtype``; F32 and I32 hold float32 routing
weights / router gradients and int32 row indices.

Experts reading slot rows in place (``ExpertWeights.slot_rows``): every rank's
``w13``/``w2`` buffer is the whole stored tensor and its expert e reads row
``read[rank, e]``; its gradient lands in row ``write[rank, e]`` of the whole ``dw13``/
``dw2`` gradient, or, for a later replica of a row (``scratch``), of the scratch
``dw13x``/``dw2x`` that the host folds in afterwards (``weights.SlotGradients``).

The ``Arena``: every rank's work buffers (send, recv, h, a, y, comb, ... and their
gradients) are regions of one flat tensor per element class on one device, so a put
from rank r to rank p is a copy into p's region of the same allocation.  Inputs,
weights and full-size outputs are the caller's tensors, viewed per rank.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from .core import MoESpec, RoutingPlan, SlotShape, row_width, slot_targets


class Elem(enum.IntEnum):
    """Element class of a buffer."""

    DATA = 0  # spec.dtype
    F32 = 1
    I32 = 2


@dataclass(frozen=True)
class BufferField:
    """One field of every rank: ``rows`` x ``ld`` elements of class ``elem``.
    ``work``: allocated in the arena (else a view of a caller's tensor);
    ``replicated``: every rank reads the same caller tensor (shared-expert weights)."""

    name: str
    elem: Elem
    work: bool
    replicated: bool = False


def _fields() -> tuple[BufferField, ...]:
    data_work = ["send", "recv", "h", "a", "y", "comb", "sh", "sa", "so", "gsend", "grecv", "da", "aw", "dh",
                 "dxe", "gcomb", "sda", "sdh", "sdx", "dsw13", "dsw2"]
    data_view = ["x", "out", "dy", "dx", "w13", "w2", "dw13", "dw2", "dw13x", "dw2x"]
    return tuple([BufferField(n, Elem.DATA, True) for n in data_work]
                 + [BufferField(n, Elem.DATA, False) for n in data_view]
                 + [BufferField(n, Elem.DATA, False, replicated=True) for n in ("sw13", "sw2")]
                 + [BufferField("roww", Elem.F32, True), BufferField("topk", Elem.F32, False),
                    BufferField("dweights", Elem.F32, False), BufferField("tok", Elem.I32, True),
                    BufferField("pos", Elem.I32, True)])


FIELDS: tuple[BufferField, ...] = _fields()
FIELD_INDEX: dict[str, int] = {f.name: i for i, f in enumerate(FIELDS)}


@dataclass(frozen=True)
class BufferSpace:
    """Shapes of every (field, rank) buffer of one plan.

    rows, ld: [len(FIELDS), ep] int64.  Buffer id of (field f, rank r): ``f * ep + r``.
    dims: (T, k, H, F, Fs, L) tokens per rank, top-k, hidden, expert FFN, shared FFN,
    local experts.  read, write [ep, L] int64: the expert row of the rank's weight buffers
    each of its experts reads, and of its gradient buffers (its scratch buffers where
    ``scratch`` [ep, L] bool) its gradient lands in (without slot rows: its own, e)."""

    ep: int
    rows: np.ndarray
    ld: np.ndarray
    dims: tuple[int, int, int, int, int, int]
    read: np.ndarray
    write: np.ndarray
    scratch: np.ndarray

    @property
    def num_buffers(self) -> int:
        return len(FIELDS) * self.ep

    def ids(self, name: str, rank: np.ndarray | int) -> np.ndarray:
        """Buffer ids of field ``name`` on ``rank`` (array or int)."""
        return FIELD_INDEX[name] * self.ep + np.asarray(rank, np.int64)

    def shape(self, name: str, rank: int) -> tuple[int, int]:
        f = FIELD_INDEX[name]
        return int(self.rows[f, rank]), int(self.ld[f, rank])


def buffer_space(plan: RoutingPlan, slot_rows: tuple[int, ...] | None = None, stored: int = 0) -> BufferSpace:
    """The buffers of ``plan``'s forward and backward regions, per rank; ``slot_rows``:
    the row of the ``stored`` rows of the expert tensors each expert reads in place
    (None: each its own)."""
    moe, ep = plan.moe, plan.par.ep
    t = plan.par.tokens_per_rank
    recv = np.array([plan.recv_rows(r) for r in range(ep)], np.int64)
    return _space(moe, ep, t, plan.local_experts, recv, np.full(ep, t * moe.top_k), slot_rows, stored)


def slot_buffer_space(shape: SlotShape, slot_rows: tuple[int, ...] | None = None,
                      stored: int = 0) -> BufferSpace:
    """The buffers of the per-shape plan of ``shape`` (one rank): every permuted buffer
    (send, recv, h, a, y, comb, the row indices and weights) holds the ``shape.capacity``
    rows of the slot layout; ``slot_rows``, ``stored``: as in ``buffer_space``."""
    rows = np.array([shape.capacity], np.int64)
    return _space(shape.moe, 1, shape.tokens, shape.moe.experts, rows, rows, slot_rows, stored)


def _space(moe: MoESpec, ep: int, t: int, el: int, recv: np.ndarray, permuted: np.ndarray,
           slot_rows: tuple[int, ...] | None, stored: int) -> BufferSpace:
    """Every field's [rows, ld] per rank: ``t`` tokens a rank, ``el`` local experts,
    ``recv`` [ep] rows received, ``permuted`` [ep] rows of a rank's permuted buffers."""
    k, h, f, fs, w = moe.top_k, moe.hidden, moe.ffn, moe.shared_ffn, row_width(moe.hidden)
    read, write, scratch, stored, extra = _expert_rows(slot_rows, stored, ep, el)
    p = permuted
    shapes = {"send": (p, h), "recv": (recv, h), "h": (recv, 2 * f), "a": (recv, f), "y": (recv, h),
              "comb": (p, h), "sh": (t, 2 * fs), "sa": (t, fs), "so": (t, h), "gsend": (p, w),
              "grecv": (recv, w), "da": (recv, f), "aw": (recv, f), "dh": (recv, 2 * f), "dxe": (recv, w),
              "gcomb": (p, w), "sda": (t, fs), "sdh": (t, 2 * fs), "sdx": (t, h), "dsw13": (2 * fs, h),
              "dsw2": (h, fs), "x": (t, h), "out": (t, h), "dy": (t, h), "dx": (t, h),
              "w13": (stored * 2 * f, h), "w2": (stored * h, f), "sw13": (2 * fs, h), "sw2": (h, fs),
              "dw13": (stored * 2 * f, h), "dw2": (stored * h, f), "dw13x": (extra * 2 * f, h),
              "dw2x": (extra * h, f), "roww": (p, 1), "topk": (t, k),
              "dweights": (t, k), "tok": (p, 1), "pos": (t, k)}
    rows = np.zeros((len(FIELDS), ep), np.int64)
    ld = np.zeros((len(FIELDS), ep), np.int64)
    for name, (r, c) in shapes.items():
        rows[FIELD_INDEX[name]] = r
        ld[FIELD_INDEX[name]] = c
    return BufferSpace(ep=ep, rows=rows, ld=ld, dims=(t, k, h, f, fs, el), read=read, write=write,
                       scratch=scratch)


def _expert_rows(slot_rows: tuple[int, ...] | None, stored: int, ep: int,
                 local: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
    """(read, write, scratch as in ``BufferSpace``, expert rows of a rank's weight and
    gradient buffers, rows of its scratch buffers): without slot rows a rank's buffers
    are its own experts' rows; with them every rank's are the whole stored tensors."""
    if slot_rows is None:
        own = np.tile(np.arange(local, dtype=np.int64), (ep, 1))
        return own, own, np.zeros((ep, local), bool), local, 0
    if len(slot_rows) != ep * local or min(slot_rows) < 0 or max(slot_rows) >= stored:
        raise ValueError(f"slot_rows must give a row in 0..{stored - 1} for each of the {ep * local} experts "
                         f"(every one stored here), got {slot_rows}")
    target, extra = slot_targets(slot_rows, stored)
    write = np.array(target, np.int64)
    scratch = write >= stored
    write[scratch] -= stored
    read, shape = np.array(slot_rows, np.int64), (ep, local)
    return read.reshape(shape), write.reshape(shape), scratch.reshape(shape), stored, len(extra)


_TORCH = {Elem.F32: torch.float32, Elem.I32: torch.int32}


class Arena:
    """Every rank's work buffers as regions of one flat tensor per element class.

    ``views[(name, rank)]``: [rows, ld] tensors (arena regions, or the caller's tensors
    after ``bind``).  ``addresses()``: int64 [num_buffers] device addresses by buffer id."""

    def __init__(self, space: BufferSpace, dtype: torch.dtype, device: torch.device | str,
                 fill: float = float("nan")):
        self.space, self.dtype, self.device = space, dtype, torch.device(device)
        self.views: dict[tuple[str, int], torch.Tensor] = {}
        self.flat: dict[Elem, torch.Tensor] = {}
        for elem in Elem:
            self._carve(elem, fill)

    def _carve(self, elem: Elem, fill: float) -> None:
        names = [f.name for f in FIELDS if f.work and f.elem is elem]
        sizes = [(n, r, *self.space.shape(n, r)) for n in names for r in range(self.space.ep)]
        total = sum(_padded(rows * ld) for _, _, rows, ld in sizes)
        dtype = self.dtype if elem is Elem.DATA else _TORCH[elem]
        flat = torch.empty(max(total, 1), dtype=dtype, device=self.device)
        flat.fill_(-1 if elem is Elem.I32 else fill)
        self.flat[elem] = flat
        at = 0
        for n, r, rows, ld in sizes:
            self.views[(n, r)] = flat[at:at + rows * ld].view(rows, ld)
            at += _padded(rows * ld)

    def bind(self, name: str, tensor: torch.Tensor) -> None:
        """Use ``tensor`` (all ranks' rows of field ``name``, stacked in rank order) as
        that field's buffers: rank r gets the next ``rows[r]`` rows (a replicated field:
        every rank the whole tensor).  Shapes and dtype are checked; the tensor must be
        contiguous and on the arena's device."""
        f = FIELDS[FIELD_INDEX[name]]
        want = self.dtype if f.elem is Elem.DATA else _TORCH[f.elem]
        if tensor.dtype != want or tensor.device != self.device or not tensor.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous {want} tensor on {self.device}, got "
                             f"{tensor.dtype} on {tensor.device} (contiguous={tensor.is_contiguous()})")
        rows = self.space.rows[FIELD_INDEX[name]]
        ld = int(self.space.ld[FIELD_INDEX[name], 0])
        if f.replicated:
            rows = rows[:1]
        if tensor.numel() != int(rows.sum()) * ld:
            raise ValueError(f"{name}: {tuple(tensor.shape)} holds {tensor.numel()} elements, expected "
                             f"{int(rows.sum())} rows of {ld}")
        parts = [(tensor.reshape(-1, ld).narrow(0, int(rows[:r].sum()), n) if ld else tensor.new_empty(n, 0))
                 for r, n in enumerate(rows.tolist())]
        for r in range(self.space.ep):
            self.views[(name, r)] = parts[0 if f.replicated else r]

    def bind_shared(self, name: str, tensor: torch.Tensor) -> None:
        """Use ``tensor`` as every rank's buffer ``name`` (the whole stored expert tensor
        that experts reading slot rows index, ``BufferSpace.read``)."""
        for r in range(self.space.ep):
            self.bind_rank(name, r, tensor)

    def bind_rank(self, name: str, rank: int, tensor: torch.Tensor) -> None:
        """Use ``tensor`` as rank ``rank``'s buffer ``name`` (any shape holding
        ``rows x ld`` contiguous elements of the field's dtype, on the arena's device)."""
        f = FIELDS[FIELD_INDEX[name]]
        want = self.dtype if f.elem is Elem.DATA else _TORCH[f.elem]
        rows, ld = self.space.shape(name, rank)
        if (tensor.dtype != want or tensor.device != self.device or not tensor.is_contiguous()
                or tensor.numel() != rows * ld):
            raise ValueError(f"{name} of rank {rank}: expected {rows}x{ld} contiguous {want} on "
                             f"{self.device}, got {tuple(tensor.shape)} {tensor.dtype} on {tensor.device}")
        self.views[(name, rank)] = tensor.view(rows, ld)

    def bind_all(self, tensors: Mapping[str, torch.Tensor]) -> None:
        for name, tensor in tensors.items():
            self.bind(name, tensor)

    def unbind(self, names: Iterable[str]) -> None:
        """Drop every rank's view of fields ``names`` (a call's own tensors, once its
        region is launched): a view kept here would keep its tensor referenced, and
        autograd copies a gradient that anything else references instead of taking it."""
        for name in names:
            for r in range(self.space.ep):
                self.views.pop((name, r), None)

    def rank_view(self, name: str, rank: int) -> torch.Tensor:
        return self.views[(name, rank)]

    def gather(self, name: str) -> torch.Tensor:
        """Field ``name`` of every rank, concatenated in rank order."""
        return torch.cat([self.views[(name, r)] for r in range(self.space.ep)])

    def host_addresses(self) -> np.ndarray:
        """int64 [num_buffers] address of every buffer (0 for unbound ones)."""
        ep = self.space.ep
        out = np.zeros(self.space.num_buffers, np.int64)
        for (name, r), t in self.views.items():
            out[FIELD_INDEX[name] * ep + r] = t.data_ptr()
        return out

    def addresses(self) -> torch.Tensor:
        """``host_addresses()`` on the device."""
        return torch.from_numpy(self.host_addresses()).to(self.device)


def _padded(elements: int) -> int:
    """``elements`` rounded up to 16, so that every region of a flat arena tensor starts
    16-element (at least 16-byte) aligned, as the device's aligned loads need."""
    return -(-elements // 16) * 16
