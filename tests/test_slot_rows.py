"""Taskflows read a placement's slot rows in place.  Every taskflow path (the exact
executors, the runtime on two gloo ranks, the persistent kernel in the Triton
interpreter), given weights whose slots read their logical experts' rows
(``Placement.slot_weights``), computes the bits of the same path given the weights
gathered per call (``ExpertWeights.gathered``: the copy it made before) — the output and
every gradient, replicas' gradients summed into their expert's row — and copies no
expert weights: every op that reads the parameters' storage is a view or a GEMM."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from hpmoe.engine.paths import ExactPath, RegionPath, RuntimePath, TritonPath, run
from hpmoe.gpu.buffers import buffer_space
from hpmoe.ir.schedule import SchedulePolicy
from hpmoe.placement import Placement
from hpmoe.regions.base import RegionKind
from hpmoe.routing import Routing, plan_routing
from hpmoe.spec import DispatchMode, ParallelSpec, TileSpec, as_recompute, preset
from hpmoe.testing import spawn_gloo
from hpmoe.weights import ExpertWeights, SlotGradients, slot_targets

SPEC = preset("tiny", torch.float32)  # 8 experts, top-2, a shared expert
TILES = TileSpec(rows=4, gemm_rows=8, gemm_cols=16)
ACROSS = Placement((0, 1, 2, 3, 7, 0, 4, 5, 6, 7), 8, 2)  # experts 0 and 7 on both ranks
WITHIN = Placement((0, 1, 2, 0, 3, 4, 5, 6, 7, 1), 8, 2)  # and expert 0 twice on rank 0
THREE = Placement((0, 1, 0, 2, 3, 0, 4, 5, 6, 0, 7, 1), 8, 4)  # expert 0 four times, 1 twice
VIEWS = {"detach", "alias", "select", "slice", "t", "transpose", "view", "expand", "as_strided", "unsqueeze"}
GEMMS = {"mm", "addmm", "mv"}  # mv: a row dotted with an expert's down bias (its router gradient)
# gradients allocated like the weights
SHAPED_LIKE = {"full_like", "new_full", "zeros_like", "empty_like", "new_empty"}


class StorageReads(TorchDispatchMode):
    """The name of every aten op (on this thread) that takes a tensor sharing the memory
    of one of ``tensors``."""

    def __init__(self, tensors: list[torch.Tensor]):
        super().__init__()
        self.storages = {t.untyped_storage().data_ptr() for t in tensors}
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() in self.storages
               for a in tree_leaves((args, kwargs))):
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **kwargs)


@dataclasses.dataclass
class Step:
    """One training call of a path: the output and every gradient, and the ops that
    read the expert parameters' storage."""

    tensors: dict[str, torch.Tensor]
    reads: list[str]


def _logical(spec, seed=0):
    """The layer's expert tensors (w13, w2, biases) and shared ones, as leaves."""
    w = ExpertWeights.random(spec, seed)
    experts = [t.clone().requires_grad_() for t in (w.w13, w.w2, *w.biases)]
    shared = [t.clone().requires_grad_() for t in (w.shared_w13, w.shared_w2) if t is not None]
    return experts, shared


def _step(path: RegionPath, leaves, weights_of, x, ids, topk, dy, **run_args) -> Step:
    """``run(path, ...)`` forward and backward; ``leaves()``: fresh parameters (expert
    tensors, shared ones), ``weights_of(experts, shared)``: the region's weights made from
    them."""
    experts, shared = leaves()
    x, topk = x.clone().requires_grad_(), topk.clone().requires_grad_()
    with StorageReads(experts) as reads:
        out = run(path, x, Routing(ids, topk), weights_of(experts, shared), **run_args)
        out.backward(dy)
    names = ["dw13", "dw2", "db13", "db2"][:len(experts)] + ["dshared_w13", "dshared_w2"][:len(shared)]
    grads = dict(zip(names, [t.grad for t in experts + shared], strict=True))
    return Step({"out": out.detach(), "dx": x.grad, "dweights": topk.grad, **grads}, reads.ops)


def _slots(spec, placement, gathered):
    """The region's weights under ``placement``: slot rows read in place, or gathered."""
    def weights_of(experts, shared):
        shared = shared or [None, None]
        w = placement.slot_weights(ExpertWeights.routed(spec, experts[0], experts[1], *shared, *experts[2:]))
        return w.gathered() if gathered else w
    return weights_of


def _inputs(spec, placement, tokens, seed=0):
    """x, dy [N, H] and routing spread over every slot (replicas and spares too)."""
    g = torch.Generator().manual_seed(seed)
    x, dy = (torch.randn(tokens, spec.hidden, generator=g).to(spec.dtype) for _ in range(2))
    ids = torch.stack([torch.randperm(placement.slots, generator=g)[:spec.top_k] for _ in range(tokens)])
    return x, ids, torch.rand(tokens, spec.top_k, generator=g), dy


def _assert_same_bits(got: Step, want: Step) -> None:
    assert got.tensors.keys() == want.tensors.keys()
    for name, t in want.tensors.items():
        assert torch.equal(got.tensors[name], t), name
    assert got.tensors["dw13"][0].abs().sum() > 0  # the replicated expert has a gradient


def _assert_read_in_place(got: Step, want: Step) -> None:
    assert set(got.reads) <= VIEWS | GEMMS | SHAPED_LIKE and "mm" in got.reads, sorted(set(got.reads))
    assert "index_select" in want.reads  # the gathered weights were a copy


# ---------------------------------------------------------------------------- the table


def test_a_later_replica_of_a_row_writes_a_scratch_row_folded_in_slot_order():
    assert slot_targets((0, 1, 2, 0, 3, 1), 4) == ((0, 1, 2, 4, 3, 5), (0, 1))
    assert slot_targets((2, 0, 1), 3) == ((2, 0, 1), ())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_folded_gradients_are_index_add_bits(dtype):
    """Four slots of row 0 and two of row 1: the fold gives ``index_add_``'s bits (in
    fp32 for bf16, rounded once), what the gathered weights' backward computes."""
    spec = dataclasses.replace(SPEC.with_dtype(dtype), experts=6, groups=1, top_groups=1, shared_experts=0)
    rows = (0, 1, 0, 2, 0, 1)
    w = ExpertWeights.routed(spec, torch.zeros(3, 2 * spec.ffn, spec.hidden, dtype=dtype),
                             torch.zeros(3, spec.hidden, spec.ffn, dtype=dtype), slot_rows=rows)
    g = torch.Generator().manual_seed(3)
    scale = torch.logspace(-3, 3, 6)[:, None, None]  # rounding depends on the order
    per_slot = torch.randn(6, 2 * spec.ffn, spec.hidden, generator=g) * scale
    slots = SlotGradients.of(w, slice(None))
    for s, view in enumerate(slots.views(slice(0, 6))["dw13"]):
        view.copy_(per_slot[s])
    slots.fold()
    want = torch.zeros(3, 2 * spec.ffn, spec.hidden, dtype=dtype).index_add_(0, torch.tensor(rows),
                                                                              per_slot.to(dtype))
    assert torch.equal(slots.full["dw13"], want)


def test_slots_not_stored_here_are_refused_naming_them():
    spec = dataclasses.replace(SPEC, experts=4, groups=1, top_groups=1, shared_experts=0)
    w13, w2 = torch.zeros(2, 2 * spec.ffn, spec.hidden), torch.zeros(2, spec.hidden, spec.ffn)
    w = ExpertWeights.routed(spec, w13, w2, slot_rows=(-1, -1, 0, 1))
    assert w.local(slice(2, 4)).w13[1].data_ptr() == w.w13[1].data_ptr()
    with pytest.raises(ValueError, match=r"ExpertWeights.local: experts 0..1 include slots not stored here"):
        w.local(slice(0, 2))
    with pytest.raises(ValueError, match=r"SlotGradients: slots 0..3 include slots not stored here"):
        SlotGradients.of(w, slice(None))
    plan = plan_routing(torch.zeros(4, 2, dtype=torch.int64), spec, ParallelSpec(2, 2))
    with pytest.raises(ValueError, match=r"slot_rows must give a row in 0..1 for each of the 4 experts"):
        buffer_space(plan, (-1, -1, 0, 1), 2)


# ---------------------------------------------------------------------------- exact executors

EXACT = {"per expert": (SPEC, WITHIN, TileSpec(), False),
         "per rank, recomputed": (SPEC, ACROSS, TileSpec(dispatch=DispatchMode.PER_RANK), True),
         "expert biases": (dataclasses.replace(SPEC, expert_bias=True), WITHIN, TILES, False),
         "bf16, four replicas": (SPEC.with_dtype(torch.bfloat16), THREE, TILES, False)}


@pytest.mark.parametrize("case", EXACT)
def test_the_exact_executors_read_the_slots_in_place_with_the_gathered_bits(case):
    spec, placement, tiles, recompute = EXACT[case]
    x, ids, topk, dy = _inputs(spec, placement, 16 * placement.ranks)
    path = ExactPath(placement.ranks, tiles, recompute=as_recompute(recompute))
    leaves = lambda: _logical(spec)  # noqa: E731
    got, want = (_step(path, leaves, _slots(spec, placement, g), x, ids, topk, dy) for g in (False, True))
    _assert_same_bits(got, want)
    _assert_read_in_place(got, want)


# ---------------------------------------------------------------------------- runtime


def _runtime_rank(rank: int, world: int, tiles: TileSpec, sharded: bool) -> dict:
    """This rank's steps on ``ACROSS``: slot rows read in place and gathered (its own
    slots); ``sharded``: it stores only its own slots' rows (the others -1)."""
    from hpmoe.runtime.session import RuntimeConfig, Session
    from hpmoe.sim.presets import cpu_nominal

    p, per = ACROSS, ACROSS.slots_per_rank
    own = slice(rank * per, (rank + 1) * per)
    x, ids, topk, dy = (t[rank * 24:(rank + 1) * 24] for t in _inputs(SPEC, p, 48, seed=5))
    session = Session(RuntimeConfig(deadline_s=60.0), dist.group.WORLD)
    path = RuntimePath(session, tiles, SchedulePolicy.HYPERPARALLEL, cpu_nominal())

    def leaves():
        experts, shared = _logical(SPEC)
        if sharded:  # this rank's stored rows: its slots' logical experts'
            experts = [t.detach()[list(p.phy2log[own])].requires_grad_() for t in experts]
        return experts, shared

    def weights_of(gathered: bool):
        def made(experts, shared):
            if not sharded:
                w = _slots(SPEC, p, False)(experts, shared)
            else:
                rows = tuple(s - own.start if own.start <= s < own.stop else -1 for s in range(p.slots))
                w = ExpertWeights.routed(p.physical_spec(SPEC), *experts, *shared, slot_rows=rows)
            return w.gathered(own) if gathered else w
        return made

    steps = []
    for gathered in (False, True):
        session.open_call(RegionKind.FORWARD, weights_of(gathered)(*leaves()), tiles, 24)
        steps.append(_step(path, leaves, weights_of(gathered), x, ids, topk, dy, own=own, session=session,
                           tiles=tiles))
    session.close()
    return {"steps": steps}


RUNTIME = {"per expert": (TileSpec(), False), "per rank": (TileSpec(dispatch=DispatchMode.PER_RANK), False),
           "own slots stored": (TileSpec(), True)}


@pytest.mark.parametrize("case", RUNTIME)
def test_the_runtime_reads_its_slots_in_place_with_the_gathered_bits(case):
    """Two gloo ranks, experts 0 and 7 on both: each rank's output and gradients equal
    those of its gathered slots; nothing on the calling thread copies the weights (its
    worker threads run the GEMMs); with only its own slots stored too."""
    for rank in spawn_gloo(_runtime_rank, 2, *RUNTIME[case], timeout=180):
        got, want = rank["steps"]
        for name, t in want.tensors.items():
            assert torch.equal(got.tensors[name], t), name
        assert set(got.reads) <= VIEWS | SHAPED_LIKE, sorted(set(got.reads))
        assert "index_select" in want.reads


# ---------------------------------------------------------------------------- persistent kernel


def test_the_persistent_kernel_reads_the_stored_rows_with_the_gathered_bits():
    """In the Triton interpreter: every rank's weight operand is the parameter itself
    (the slot's operand row points at its stored row), and the bits are the gathered
    weights'."""
    pytest.importorskip("triton")
    x, ids, topk, dy = _inputs(SPEC, WITHIN, 16)
    path = TritonPath(2, TILES)
    leaves = lambda: _logical(SPEC)  # noqa: E731
    got, want = (_step(path, leaves, _slots(SPEC, WITHIN, g), x, ids, topk, dy) for g in (False, True))
    _assert_same_bits(got, want)
    assert "index_select" not in got.reads and "index_select" in want.reads
    experts, shared = _logical(SPEC)
    w = _slots(SPEC, WITHIN, False)(experts, shared)
    _, state = path.forward(x, Routing(ids, topk), w, save=True)
    arena = state.forward.region.arena
    for r in range(2):
        assert arena.rank_view("w13", r).data_ptr() == experts[0].data_ptr()
        assert arena.rank_view("w2", r).data_ptr() == experts[1].data_ptr()
