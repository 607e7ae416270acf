"""The MoE region kernel by kernel, on the fastest kernels this CPU offers.

No tiles and no overlap: each phase is one pass over all its rows, as the serialized
baseline (``refs.serialized_ep_forward``) runs, but with grouped GEMMs per phase,
buffers reused across steps (``Arena``), a SwiGLU backward that writes both halves of
its gradient in place, and no zero-filling of weight gradients that the GEMMs write
whole.  It is the path ``SchedulePolicy.AUTO`` falls back to when no taskflow pays.

Forward, per rank (one process runs the whole batch as one rank, whatever virtual_ep):
  1. permute: stable sort of the T*k (token, slot) rows by global expert, one gather;
  2. dispatch (ep > 1): counts and rows over ``all_to_all_single`` (each under the
     session's deadline: ``runtime.collective.Collectives``), then one gather
     into expert-major order (expert, then source rank: global token order per expert);
  3. experts: GEMM up per expert into one [M, 2F] buffer, the gated activation
     (``spec.activation``), GEMM down;
  4. combine (ep > 1): rows back over ``all_to_all_single``; then the fixed-order
     weighted sum of ``refs.topk_sum`` (fp32, slot 0 first) plus the shared experts.
Backward mirrors it: the routing-weight gradient and the scattered output gradient,
dispatch, GEMMs (input and weight gradients), the gated activation's backward in place
(recomputing its output first with ``recompute``), combine, sum over slots in fp32 in
slot order.  Scratch buffers come from the layer's ``ArenaPool``; what backward needs
is allocated apart and handed to ``ctx.save_for_backward``, so saved-tensor hooks
(non-reentrant activation checkpointing) free it.

On the CPU the experts run one after another, each its whole-expert GEMMs (``torch.mm``
into a slice of a shared buffer, ``F.grouped_mm``'s bits: tested) with its activation
between them, so an expert's intermediates are still in cache when the next GEMM reads
them (``GemmPath.PER_EXPERT``).  On a CUDA GPU that runs them (bf16, sm_90 or newer,
dimensions in multiples of 8) each GEMM of every expert is one grouped GEMM
(``GemmPath.GROUPED``: ``torch._grouped_mm``, forward, input and weight gradients) and
the activation one pass over all rows.
With the same GEMM shapes as ``refs.dense_moe`` the forward output is bitwise that of the
reference (silu; other activations up to torch's vectorised-vs-scalar last bit).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property

import torch
import torch.nn.functional as F

from ..comm import Collectives
from ..refs import inverse_permutation
from ..regions.kernels import gemm_bias
from ..routing import Routing, check_input, expert_counts
from ..spec import PLAIN_GLU, Activation, GluForm, MoESpec, Recompute, as_recompute
from ..weights import ExpertWeights
from .arena import Arena, ArenaPool
from .exact_backward import Gradients
from .phases import TORCH, Phases

Segments = list[tuple[int, int, int]]  # (local expert, first row, end row) of non-empty experts


def segments(counts: list[int]) -> Segments:
    """Non-empty row ranges of experts whose rows are contiguous, in expert order."""
    out, start = [], 0
    for e, n in enumerate(counts):
        if n:
            out.append((e, start, start + n))
        start += n
    return out


@dataclass(frozen=True)
class Groups:
    """The rows of each local expert, contiguous in expert order: counts int64 [L] on the
    rows' device, or None for one expert of every one of ``rows`` rows (the shared
    expert: a plain GEMM, nothing counted).  A grouped GEMM reads their offsets on the
    device; a per-expert loop reads ``segments`` on the host (one device sync, on first
    use), so the grouped path makes none."""

    counts: torch.Tensor | None
    rows: int = 0

    @staticmethod
    def one(rows: int) -> Groups:
        """A single expert of ``rows`` rows (the shared expert)."""
        return Groups(None, rows)

    def offsets(self) -> torch.Tensor:
        """int32 [L] end row of each expert's rows (empty experts included), as
        ``grouped_mm``'s ``offs``."""
        return self.counts.cumsum(0).to(torch.int32)

    def mm(self, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None) -> torch.Tensor:
        """``torch._grouped_mm(a, b, offs=offs)`` over these groups (a [M, K] and b [G, K,
        N] -> [M, N]; a [K, M] and b [M, N] -> [G, K, N]); one group of every row: a plain
        GEMM, no offsets."""
        if self.counts is not None:
            return _GROUPED_MM(a, b, offs=offs)
        return torch.mm(a, b[0]) if b.dim() == 3 else torch.mm(a, b).unsqueeze(0)

    @cached_property
    def segments(self) -> Segments:
        if self.counts is None:
            return [(0, 0, self.rows)] if self.rows else []
        return segments(self.counts.tolist())


# ---------------------------------------------------------------------------- experts


@dataclass(frozen=True)
class Experts:
    """The experts one GEMM loop runs: expert e reads row ``rows[e]`` of w13 [R, 2F, H],
    w2 [R, H, F] (and of biases b13 [R, 2F] / b2 [R, H] or None) in place, and its
    gradients go to the same rows (replicas of one row summed); their gated activation."""

    w13: torch.Tensor
    w2: torch.Tensor
    rows: tuple[int, ...]
    activation: Activation
    glu: GluForm = PLAIN_GLU
    b13: torch.Tensor | None = None
    b2: torch.Tensor | None = None

    @staticmethod
    def routed(weights: ExpertWeights, mine: slice) -> Experts:
        spec = weights.spec
        return Experts(weights.w13, weights.w2, weights.rows_of(mine), spec.activation, spec.glu,
                       *weights.biases)

    @staticmethod
    def shared(weights: ExpertWeights) -> Experts:
        return Experts(weights.shared_w13[None], weights.shared_w2[None], (0,), weights.spec.activation)

    def span(self) -> slice | None:
        """The rows as a slice where they are consecutive, else None."""
        lo = self.rows[0]
        return slice(lo, lo + len(self.rows)) if self.rows == tuple(range(lo, lo + len(self.rows))) else None

    def stacked(self, t: torch.Tensor) -> torch.Tensor:
        """[len(rows), ...] the rows of ``t`` these experts read (a view where they are
        consecutive, else a copy): a grouped GEMM's weights."""
        span = self.span()
        return t[span] if span is not None else t.index_select(0, torch.tensor(self.rows, device=t.device))

    def put(self, g: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """``g`` [R, ...] with local [len(rows), ...] gradients in their rows (replicas
        summed); ``local`` itself where these experts are all of g's rows (no copy)."""
        span = self.span()
        if span == slice(0, g.shape[0]):
            return local
        if span is not None:
            g[span] = local
        else:
            index = torch.tensor(self.rows, device=g.device)
            g.index_fill_(0, index, 0).index_add_(0, index, local)
        return g


class GemmPath(enum.Enum):
    """How the experts' GEMMs run: one ``torch.mm`` per expert (each expert's intermediates
    stay in a CPU's cache), or one grouped GEMM over every expert (a GPU)."""

    PER_EXPERT = "per-expert"
    GROUPED = "grouped"


_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def gemm_path(xs: torch.Tensor, ex: Experts) -> GemmPath:
    """GROUPED where torch's grouped GEMM runs and computes what the loop does: experts
    without biases (it adds none yet), a CUDA device of compute capability 9.0 or newer,
    bf16, every dimension a multiple of 8 (16-byte strides); else PER_EXPERT."""
    dims = (*ex.w13.shape[1:], ex.w2.shape[1])
    if (_GROUPED_MM is None or ex.b13 is not None or not xs.is_cuda or xs.dtype != torch.bfloat16
            or any(d % 8 for d in dims) or torch.cuda.get_device_capability(xs.device) < (9, 0)):
        return GemmPath.PER_EXPERT
    return GemmPath.GROUPED


def _grouped(path: GemmPath | None, xs: torch.Tensor, ex: Experts) -> bool:
    path = path or gemm_path(xs, ex)
    if path is GemmPath.GROUPED and ex.b13 is not None:
        raise ValueError("GemmPath.GROUPED: torch's grouped GEMM adds no expert biases; biased experts run "
                         "GemmPath.PER_EXPERT")
    return path is GemmPath.GROUPED


def experts_forward(xs: torch.Tensor, groups: Groups, ex: Experts, keep: Arena, tag: str,
                    path: GemmPath | None = None, phases: Phases = TORCH
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h [M, 2F], a [M, F], y [M, H]) of experts on expert-major rows xs [M, H]:
    h = xs @ w13[e]^T + b13[e], a = the gated activation (``phases.glu``), y = a @
    w2[e]^T + b2[e] (``refs.expert_ffn``).  PER_EXPERT (in ``keep``): one expert after
    another so that its h and a are still in cache for the next GEMM; GROUPED: a grouped
    GEMM each (path None: ``gemm_path``)."""
    m, f, dtype = xs.shape[0], ex.w2.shape[2], xs.dtype
    a = keep.take(tag + "a", (m, f), dtype)
    if _grouped(path, xs, ex):
        offs = groups.offsets() if groups.counts is not None else None
        h = groups.mm(xs, ex.stacked(ex.w13).transpose(1, 2), offs)
        phases.glu(h, a, ex.activation, ex.glu)
        return h, a, groups.mm(a, ex.stacked(ex.w2).transpose(1, 2), offs)
    h = keep.take(tag + "h", (m, 2 * f), dtype)
    y = keep.take(tag + "y", (m, ex.w2.shape[1]), dtype)
    for e, s, t in groups.segments:
        r = ex.rows[e]
        gemm_bias(xs[s:t], ex.w13[r], None if ex.b13 is None else ex.b13[r], h[s:t])
        phases.glu(h[s:t], a[s:t], ex.activation, ex.glu)
        gemm_bias(a[s:t], ex.w2[r], None if ex.b2 is None else ex.b2[r], y[s:t])
    return h, a, y


def experts_up(xs: torch.Tensor, groups: Groups, ex: Experts, arena: Arena, tag: str,
               path: GemmPath | None = None) -> torch.Tensor:
    """h [M, 2F] = xs @ w13[e]^T + b13[e]: the first GEMM of ``experts_forward`` alone
    (a backward that recomputes it)."""
    if _grouped(path, xs, ex):
        offs = groups.offsets() if groups.counts is not None else None
        return groups.mm(xs, ex.stacked(ex.w13).transpose(1, 2), offs)
    h = arena.take(tag + "h", (xs.shape[0], ex.w13.shape[1]), xs.dtype)
    for e, s, t in groups.segments:
        r = ex.rows[e]
        gemm_bias(xs[s:t], ex.w13[r], None if ex.b13 is None else ex.b13[r], h[s:t])
    return h


@dataclass
class ExpertGrads:
    """Where ``experts_backward`` writes weight gradients: dw13 [R, 2F, H], dw2 [R, H, F]
    (and db13 [R, 2F], db2 [R, H] for biased experts), shaped like the experts' tensors:
    expert e's at row ``Experts.rows[e]``."""

    dw13: torch.Tensor
    dw2: torch.Tensor
    db13: torch.Tensor | None = None
    db2: torch.Tensor | None = None


def experts_backward(g: torch.Tensor, xs: torch.Tensor, h: torch.Tensor, w: torch.Tensor | None,
                     groups: Groups, ex: Experts, grads: ExpertGrads, arena: Arena, tag: str,
                     path: GemmPath | None = None, phases: Phases = TORCH
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dxs [M, H], ds [M] fp32) given g [M, H], each row's unweighted output gradient
    (its token's), w [M] fp32 each row's routing weight (None: 1, the shared expert), the
    rows xs and their pre-activation h: the rows' input gradient and the gradient of each
    row's routing weight (None without weights), <g, y> with y never kept: from
    d = g @ w2[e] and the gated activation recomputed from h (``phases.glu_router_backward``,
    which also forms da = w * d and w * a).  Writes the weight gradients of every local
    expert into ``grads`` (zeros for experts without rows), one expert after another
    (PER_EXPERT) or in grouped GEMMs (GROUPED; None: ``gemm_path``; its GEMMs' outputs
    replace grads' tensors where they cover every row)."""
    m, f = h.shape[0], h.shape[1] // 2
    dh = arena.take(tag + "dh", (m, 2 * f), g.dtype)
    a_w = arena.take(tag + "aw", (m, f), h.dtype)
    if _grouped(path, xs, ex):
        offs = groups.offsets() if groups.counts is not None else None
        d = groups.mm(g, ex.stacked(ex.w2), offs)
        ds = phases.glu_router_backward(h, d, w, dh, a_w, ex.activation, ex.glu)
        grads.dw2 = ex.put(grads.dw2, groups.mm(g.t(), a_w, offs))
        grads.dw13 = ex.put(grads.dw13, groups.mm(dh.t(), xs, offs))
        return groups.mm(dh, ex.stacked(ex.w13), offs), ds
    d = arena.take(tag + "d", (m, f), g.dtype)
    dxs = arena.take(tag + "dxs", (m, xs.shape[1]), g.dtype)
    ds = torch.zeros(m, dtype=torch.float32, device=g.device) if w is not None else None
    written = [t for t in (grads.dw13, grads.dw2, grads.db13, grads.db2) if t is not None]
    segs = groups.segments
    for r in set(ex.rows) - {ex.rows[e] for e, _, _ in segs}:
        for t in written:
            t[r].zero_()
    done: set[int] = set()
    for e, s, t in segs:
        r = ex.rows[e]
        add = r in done  # a second replica of the row on this rank: sum into it
        done.add(r)
        ws = w[s:t] if w is not None else None
        torch.mm(g[s:t], ex.w2[r], out=d[s:t])
        part = phases.glu_router_backward(h[s:t], d[s:t], ws, dh[s:t], a_w[s:t], ex.activation, ex.glu)
        _mm_into(grads.dw2[r], g[s:t].t(), a_w[s:t], add)
        _mm_into(grads.dw13[r], dh[s:t].t(), xs[s:t], add)
        torch.mm(dh[s:t], ex.w13[r], out=dxs[s:t])
        if part is not None:
            ds[s:t] = part
        if grads.db13 is not None:
            _bias_grads(g[s:t], ws, dh[s:t], ex.b2[r], grads, r, add, None if ds is None else ds[s:t])
    return dxs, ds


def _bias_grads(g: torch.Tensor, w: torch.Tensor | None, dh: torch.Tensor, b2: torch.Tensor,
                grads: ExpertGrads, r: int, add: bool, ds: torch.Tensor | None) -> None:
    """An expert's bias gradients (db2: its rows' w * g summed, db13: dh summed) and the
    bias's part of its rows' routing-weight gradient (<g, b2>, added into ``ds``)."""
    dy = g if w is None else (g.float() * w.unsqueeze(1)).to(g.dtype)
    _sum_into(grads.db2[r], dy, add)
    _sum_into(grads.db13[r], dh, add)
    if ds is not None:
        ds.add_(g.float() @ b2.float())


def _mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, add: bool) -> None:
    if add:
        out.addmm_(a, b)
    else:
        torch.mm(a, b, out=out)


def _sum_into(out: torch.Tensor, rows: torch.Tensor, add: bool) -> None:
    if add:
        out.add_(rows.sum(0))
    else:
        torch.sum(rows, 0, out=out)


# ---------------------------------------------------------------------------- routing


@dataclass(frozen=True)
class Permutation:
    """This rank's rows sorted by global expert (stable: token order within an expert).

    order: [T*k] int64 flat index ``t*k + j`` of each sorted row; pos: [T, k] int64
    sorted position of (t, j); send: [ep, L] int64 rows for local expert e of rank d."""

    order: torch.Tensor
    pos: torch.Tensor
    send: torch.Tensor

    @staticmethod
    def of(ids: torch.Tensor, experts: int, ep: int, counts: torch.Tensor | None = None) -> Permutation:
        """``counts``: [experts] rows per expert, where the caller has counted them."""
        flat = ids.reshape(-1)
        order = torch.argsort(flat.to(_sort_key(experts)), stable=True)
        pos = inverse_permutation(order).view(ids.shape)
        counts = expert_counts(flat, experts) if counts is None else counts
        return Permutation(order, pos, counts.view(ep, experts // ep))


def _sort_key(experts: int) -> torch.dtype:
    """The narrowest integer dtype holding every expert id: a radix sort makes one pass
    per byte of key (8 for int64, on a GPU and for torch's CPU sort), and a stable sort's
    order does not depend on the key's width (``routing.plan_routing`` does the same)."""
    return torch.uint8 if experts <= 256 else torch.int16 if experts <= 32767 else torch.int32


@dataclass(frozen=True)
class Exchange:
    """The all-to-all of an EP group (``coll``: its deadline-bounded collectives): send /
    recv [ep, L] int64 rows per (peer, local expert); regroup: [R] int64, the
    dispatch-order row of each expert-major row; unregroup: its inverse."""

    coll: Collectives
    send: torch.Tensor
    recv: torch.Tensor
    regroup: torch.Tensor
    unregroup: torch.Tensor

    @staticmethod
    def of(send: torch.Tensor, coll: Collectives, received: torch.Tensor | None = None) -> Exchange:
        """The exchange of ``send``; ``received``: what each rank sends this one, known
        already (its own row is ``send``'s: a layer's padding rows stay on their rank),
        else counted in one all-to-all."""
        if received is None:
            recv = torch.empty_like(send)
            coll.all_to_all(recv, send.contiguous(), None, None, "kernel by kernel: count exchange")
        else:
            recv = received.to(send.device, copy=True)
            recv[coll.rank] = send[coll.rank]
        ep, local = recv.shape
        key = (torch.arange(local, device=recv.device) * ep
               + torch.arange(ep, device=recv.device)[:, None]).reshape(-1)  # [s, e] -> e*ep + s
        regroup = torch.argsort(torch.repeat_interleave(key, recv.reshape(-1)), stable=True)
        return Exchange(coll, send, recv, regroup, inverse_permutation(regroup))

    def dispatch(self, rows: torch.Tensor, arena: Arena, keep: Arena, tag: str) -> torch.Tensor:
        """rows [T*k, C] in sorted order -> [R, C] received rows, expert-major (in
        ``keep``); C columns of any dtype (a ``RowLayout``'s bytes)."""
        got = arena.take(tag + "recv", (int(self.recv.sum()), rows.shape[1]), rows.dtype)
        self.coll.all_to_all(got, rows, self.recv.sum(1).tolist(), self.send.sum(1).tolist(),
                             f"kernel by kernel: {tag}dispatch")
        xs = keep.take(tag + "xs", tuple(got.shape), got.dtype)
        return torch.index_select(got, 0, self.regroup, out=xs)

    def combine(self, rows: torch.Tensor, arena: Arena, keep: Arena, tag: str) -> torch.Tensor:
        """rows [R, C] expert-major -> [T*k, C] this rank's rows back, in sorted order
        (in ``keep``)."""
        out = torch.index_select(rows, 0, self.unregroup, out=arena.take(tag + "send", tuple(rows.shape),
                                                                           rows.dtype))
        back = keep.take(tag + "back", (int(self.send.sum()), rows.shape[1]), rows.dtype)
        self.coll.all_to_all(back, out, self.send.sum(1).tolist(), self.recv.sum(1).tolist(),
                             f"kernel by kernel: {tag}combine")
        return back

    def local_rows(self) -> torch.Tensor:
        return self.recv.sum(0)


@dataclass(frozen=True)
class RowLayout:
    """A row that travels with a number: ``width`` elements of ``dtype`` and one fp32
    (a row's routing weight to the expert's rank, its gradient back) in the same bytes,
    so an all-to-all moves both.  The row is padded to 16 bytes (a GEMM reads the
    elements in place)."""

    width: int
    dtype: torch.dtype

    @property
    def head(self) -> int:
        """The elements' bytes, padded to 4 (the fp32's offset)."""
        return -(-self.width * self.dtype.itemsize // 4) * 4

    @property
    def nbytes(self) -> int:
        return -(-(self.head + 4) // 16) * 16

    def buffer(self, rows: int, arena: Arena, name: str) -> torch.Tensor:
        return arena.take(name, (rows, self.nbytes), torch.uint8)

    def elements(self, buf: torch.Tensor) -> torch.Tensor:
        """[rows, width] ``dtype``: a view of ``buf``'s elements."""
        return buf[:, :self.width * self.dtype.itemsize].view(self.dtype)

    def number(self, buf: torch.Tensor) -> torch.Tensor:
        """[rows] fp32: a view of ``buf``'s numbers."""
        return buf[:, self.head:self.head + 4].view(torch.float32)[:, 0]


def _group_size(coll: Collectives | None) -> int:
    return coll.world if coll is not None else 1


# ---------------------------------------------------------------------------- region


@dataclass
class KernelByKernelState:
    """What the backward needs from the forward: the permutation, the exchange (None in
    one process), the groups and the rows' layout on an EP group (routing metadata, kept
    as they are), what ``recompute`` leaves to keep, and the tensors ``TENSORS`` lists for
    ``save_for_backward``: the experts' input rows ``rows`` (one process: xs [M, H];
    an EP group: the received rows with their routing weights, ``layout``'s bytes) and
    their pre-activation h [M, 2F] where kept, the shared expert's pre-activation sh
    [T, 2Fs], the input x where the rows are gathered again or the shared expert reads
    it, the top-k weights and the weights.  Neither gated activation nor expert output
    is kept (the backward recomputes the one and needs not the other)."""

    perm: Permutation
    exchange: Exchange | None
    groups: Groups
    layout: RowLayout | None
    recompute: Recompute
    rows: torch.Tensor | None
    h: torch.Tensor | None
    sh: torch.Tensor | None
    x: torch.Tensor | None
    topk_weights: torch.Tensor | None
    weights: ExpertWeights | None
    spec: MoESpec | None = None  # the weights' spec while they are packed away
    slot_rows: tuple[int, ...] | None = None  # and their slot rows
    phases: Phases = TORCH  # the forward's memory-bound phases, which the backward runs too

    TENSORS = ("rows", "h", "sh", "x", "topk_weights")
    WEIGHTS = ("w13", "w2", "shared_w13", "shared_w2", "b13", "b2")

    def pack(self) -> tuple[list[torch.Tensor | None], KernelByKernelState]:
        """Every tensor of the state (for ``save_for_backward``) and the state without them."""
        w = self.weights
        tensors = [getattr(self, n) for n in self.TENSORS] + [getattr(w, n) for n in self.WEIGHTS]
        return tensors, replace(self, **dict.fromkeys(self.TENSORS), weights=None, spec=w.spec,
                                slot_rows=w.slot_rows)

    def activations(self) -> tuple[int, ...]:
        """The places of the kept rows, h and sh among ``pack``'s tensors."""
        return tuple(self.TENSORS.index(n) for n in ("rows", "h", "sh"))

    def unpack(self, tensors: Sequence[torch.Tensor | None]) -> KernelByKernelState:
        """The inverse of ``pack``: this state with its tensors put back."""
        n = len(self.TENSORS)
        weights = ExpertWeights.routed(self.spec, *tensors[n:], slot_rows=self.slot_rows, checked=True)
        return replace(self, **dict(zip(self.TENSORS, tensors[:n], strict=True)), weights=weights)


def _local_slice(weights: ExpertWeights, coll: Collectives | None) -> slice:
    ep = _group_size(coll)
    if weights.spec.experts % ep:
        raise ValueError(f"EP group size {ep} does not divide MoESpec.experts={weights.spec.experts}")
    local = weights.spec.experts // ep
    rank = coll.rank if coll is not None else 0
    return slice(rank * local, (rank + 1) * local)


def kbk_forward(x: torch.Tensor, routing: Routing, weights: ExpertWeights, coll: Collectives | None = None,
                pool: ArenaPool | None = None, save: bool = False,
                recompute: Recompute | bool = Recompute.PERMUTATION, received: torch.Tensor | None = None,
                checked: bool = False, phases: Phases = TORCH
                ) -> tuple[torch.Tensor, KernelByKernelState | None]:
    """This rank's forward region: x [T, H] spec.dtype, routing ids/weights [T, k] of these
    tokens -> (out [T, H] spec.dtype, the state for ``kbk_backward`` when ``save``).

    coll: the EP group's deadline-bounded collectives (a runtime ``Session``'s; None:
    one process, every expert here); every rank calls collectively.  pool: where scratch
    buffers come from (None: fresh ones), given back however the call ends; saved
    tensors are always fresh ones.  recompute: what the backward computes again instead
    of finding it kept (``spec.Recompute``; on an EP group gathering the rows again
    dispatches x again, each row beside its gradient row in the backward's one dispatch:
    only ``GEMM`` does, ``PERMUTATION`` keeps the received rows, the dispatch's doubled
    bytes having cost 4-7% of a CPU training step over loopback gloo, 12-17% over a 2 Gbit/s
    link, 9-19% with the first GEMM recomputed).
    received: [ep, L] int64 rows each rank routes to this rank's experts, where the
    caller's agreement carried them (a rank's rows to itself are taken from ``routing``);
    None: counted in a count exchange first.  checked: the caller has checked x and
    routing (``routing.check_input``: the layer's call protocol does).  phases: the
    functions of the memory-bound phases (``exec.phases``: torch's, or a device's)."""
    spec = weights.spec
    if not checked:
        check_input(x, routing, spec)
    arena = pool.acquire(x.device) if pool is not None else Arena(x.device)
    try:
        return _forward(x, routing, weights, coll, arena, Arena(x.device) if save else arena, save,
                        as_recompute(recompute), received, phases)
    finally:
        if pool is not None:
            pool.release(arena)


def _forward(x: torch.Tensor, routing: Routing, weights: ExpertWeights, coll: Collectives | None,
             arena: Arena, keep: Arena, save: bool, recompute: Recompute, received: torch.Tensor | None,
             phases: Phases) -> tuple[torch.Tensor, KernelByKernelState | None]:
    spec = weights.spec
    mine, k = _local_slice(weights, coll), spec.top_k
    perm = Permutation.of(routing.ids, spec.experts, _group_size(coll), routing.counts)
    exchange = Exchange.of(perm.send, coll, received) if _group_size(coll) > 1 else None
    if exchange is None:  # the rows are the experts' input (in ``keep`` if the backward reads them)
        layout = None
        kept = save and recompute is Recompute.NOTHING
        rows = (keep if kept else arena).take("rows", (perm.order.numel(), spec.hidden), x.dtype)
        xs = rows = phases.permute(x, perm.order, k, rows)
        groups = Groups(perm.send.reshape(-1))
    else:  # each row travels with its routing weight, which the backward reads on the expert's rank
        layout = RowLayout(spec.hidden, x.dtype)
        sent = layout.buffer(perm.order.numel(), arena, "rows")
        phases.permute(x, perm.order, k, layout.elements(sent))
        torch.index_select(routing.weights.reshape(-1), 0, perm.order, out=layout.number(sent))
        rows = exchange.dispatch(sent, arena, keep, "d.")
        xs, groups = layout.elements(rows), Groups(exchange.local_rows())
    h, a, y = experts_forward(xs, groups, Experts.routed(weights, mine), keep, "e.", phases=phases)
    y = exchange.combine(y, arena, arena, "c.") if exchange is not None else y
    sh = sy = None
    if weights.has_shared:
        sh, _, sy = experts_forward(x, Groups.one(x.shape[0]), Experts.shared(weights), keep, "s.",
                                    phases=phases)
    out = phases.weighted_sum(y, perm.pos, routing.weights, sy, arena)
    if not save:
        return out, None
    gemm = recompute is Recompute.GEMM
    gathered_again = gemm if exchange is not None else recompute is not Recompute.NOTHING
    kept_rows = None if gathered_again else rows
    kept_x = x if kept_rows is None or weights.has_shared else None
    return out, KernelByKernelState(perm, exchange, groups, layout, recompute, kept_rows, None if gemm else h,
                                    None if gemm else sh, kept_x, routing.weights, weights, phases=phases)


def kbk_backward(state: KernelByKernelState, dout: torch.Tensor, pool: ArenaPool | None = None) -> Gradients:
    """Gradients of ``kbk_forward`` given dout [T, H]: dx [T, H], dweights [T, k] fp32,
    full-size dw13 [E, 2F, H] / dw2 [E, H, F] (this rank's experts; zeros for other
    ranks' experts), this rank's shared-expert gradients.  Collective with a group."""
    arena = pool.acquire(dout.device) if pool is not None else Arena(dout.device)
    try:
        return _backward(state, dout, arena)
    finally:
        if pool is not None:
            pool.release(arena)


def _backward(s: KernelByKernelState, dout: torch.Tensor, arena: Arena) -> Gradients:
    """1. each (token, slot) row's gradient, unweighted: dout gathered in sorted order (on
    an EP group dispatched to the experts' ranks); 2. the experts' backward on the rows
    kept or gathered again (and their pre-activation kept or recomputed), which gives each
    row's routing-weight gradient too; 3. the rows' input gradients summed per token (on
    an EP group combined back, each with its routing-weight gradient); 4. the shared
    expert's backward."""
    w, dtype = s.weights, s.weights.spec.dtype
    ex = Experts.routed(w, _local_slice(w, s.exchange.coll if s.exchange is not None else None))
    grads = ExpertGrads(*(_weight_buffer(t, ex) for t in (w.w13, w.w2, *w.biases)))
    if s.exchange is None:
        g = _sorted_rows(s, dout, arena.take("g", (s.perm.order.numel(), dout.shape[1]), dout.dtype))
        xs = s.rows if s.rows is not None else _sorted_rows(s, s.x, arena.take(
            "xs", (s.perm.order.numel(), s.x.shape[1]), s.x.dtype))
        h = s.h if s.h is not None else experts_up(xs, s.groups, ex, arena, "e.")
        w_rows = s.topk_weights.reshape(-1).index_select(0, s.perm.order)
        dxs, ds = experts_backward(g, xs, h, w_rows, s.groups, ex, grads, arena, "e.", phases=s.phases)
    else:
        dxs, ds = _exchanged_backward(s, dout, ex, grads, arena)
    dweights = ds.index_select(0, s.perm.pos.reshape(-1)).view(s.perm.pos.shape)
    dsw13 = dsw2 = dx_shared = None
    if w.has_shared:
        sg = ExpertGrads(torch.empty_like(w.shared_w13)[None], torch.empty_like(w.shared_w2)[None])
        one, shared = Groups.one(s.x.shape[0]), Experts.shared(w)
        sh = s.sh if s.sh is not None else experts_up(s.x, one, shared, arena, "s.")
        gs = dout.to(dtype).contiguous()
        dx_shared, _ = experts_backward(gs, s.x, sh, None, one, shared, sg, arena, "s.", phases=s.phases)
        dsw13, dsw2 = sg.dw13[0], sg.dw2[0]
    dx = s.phases.slot_sum(dxs, s.perm.pos, dx_shared, arena)
    return Gradients(dx=dx, dweights=dweights, dw13=grads.dw13, dw2=grads.dw2, dshared_w13=dsw13,
                     dshared_w2=dsw2, db13=grads.db13, db2=grads.db2)


def _sorted_rows(s: KernelByKernelState, t: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out [T*k, C] = the rows of ``t`` [T, C] of the sorted (token, slot) pairs."""
    return s.phases.permute(t, s.perm.order, s.perm.pos.shape[1], out)


def _exchanged_backward(s: KernelByKernelState, dout: torch.Tensor, ex: Experts, grads: ExpertGrads,
                        arena: Arena) -> tuple[torch.Tensor, torch.Tensor]:
    """An EP group's experts' backward: the rows' gradients dispatched (with the rows
    themselves and their weights where the forward kept none), the experts' backward on
    the received rows and their weights, the input gradients combined back each with
    its routing-weight gradient; (dxs [T*k, H], ds [T*k] fp32) in sorted order."""
    lay = s.layout
    if s.rows is not None:
        g = _sorted_rows(s, dout, arena.take("g", (s.perm.order.numel(), dout.shape[1]), dout.dtype))
        got = s.exchange.dispatch(g, arena, arena, "gd.")
        xs, w_rows = lay.elements(s.rows), lay.number(s.rows)
    else:
        got, xs, w_rows = _dispatched_again(s, dout, arena)
    h = s.h if s.h is not None else experts_up(xs, s.groups, ex, arena, "e.")
    dxs, ds = experts_backward(got, xs, h, w_rows, s.groups, ex, grads, arena, "e.", phases=s.phases)
    sent = lay.buffer(dxs.shape[0], arena, "gc.rows")
    lay.elements(sent).copy_(dxs)
    lay.number(sent).copy_(ds)
    back = s.exchange.combine(sent, arena, arena, "gc.")
    return lay.elements(back), lay.number(back)


def _dispatched_again(s: KernelByKernelState, dout: torch.Tensor, arena: Arena
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One dispatch of each row's gradient (dout's rows in sorted order) beside the row of
    x it came from and its routing weight (``RowLayout`` of 2H elements), each gathered
    straight into the send buffer: on the experts' rank (the rows' gradients, the rows,
    their weights), each [R, ...] expert-major."""
    h = dout.shape[1]
    both = RowLayout(2 * h, dout.dtype)
    sent = both.buffer(s.perm.order.numel(), arena, "gd.rows")
    elements = both.elements(sent)
    _sorted_rows(s, dout, elements[:, :h])
    _sorted_rows(s, s.x, elements[:, h:])
    torch.index_select(s.topk_weights.reshape(-1), 0, s.perm.order, out=both.number(sent))
    got = s.exchange.dispatch(sent, arena, arena, "gd.")
    return both.elements(got)[:, :h], both.elements(got)[:, h:], both.number(got)


def _weight_buffer(w: torch.Tensor, ex: Experts) -> torch.Tensor:
    """A full-size gradient of ``w`` [R, ...] whose rows other than ``ex.rows`` are zero
    (those are written by the GEMMs)."""
    out = torch.empty_like(w)
    span = ex.span()
    if span is not None:  # this rank's experts without a placement
        out[:span.start].zero_()
        out[span.stop:].zero_()
    elif idle := sorted(set(range(w.shape[0])) - set(ex.rows)):
        out.index_fill_(0, torch.tensor(idle, device=w.device), 0)
    return out
