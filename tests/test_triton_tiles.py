"""Every tile function of the GPU backend in the Triton interpreter, on one-task tables,
against the torch kernel of the same task: moved data bit for bit, math within the
dtype's tolerance.  The device writes straight into the exact executor's buffers (bound
into the arena), so both sides see the same inputs; the output field starts as NaN on
both sides, so a row written on one side only shows."""

import dataclasses

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from hpmoe.exec.exact import execute_forward  # noqa: E402
from hpmoe.exec.exact_backward import execute_backward  # noqa: E402
from hpmoe.gpu.backend import fill_indices  # noqa: E402
from hpmoe.gpu.buffers import FIELDS, Arena, buffer_space  # noqa: E402
from hpmoe.gpu.ops import COL, DESCRIBE, Op, describe  # noqa: E402
from hpmoe.gpu.pack import pack_tasks  # noqa: E402
from hpmoe.gpu.runner import DeviceProgram, device_module  # noqa: E402
from hpmoe.ir.graph import (
    TaskKind,  # noqa: E402
    tiles_of,  # noqa: E402
)
from hpmoe.regions.backward_kernels import (  # noqa: E402
    BACKWARD_RECOMPUTE,
    BackwardContext,
    SavedActivations,
    rider,
)
from hpmoe.regions.dedup import PER_RANK_KINDS  # noqa: E402
from hpmoe.regions.kernels import FORWARD, RankContext  # noqa: E402
from hpmoe.routing import RoutingKind, synthetic_routing  # noqa: E402
from hpmoe.spec import ParallelSpec, TileSpec, preset  # noqa: E402
from hpmoe.weights import ExpertWeights  # noqa: E402

TILES = TileSpec(rows=3, gemm_rows=4, gemm_cols=8)  # ragged tiles: every mask is exercised
EP, TOKENS = 2, 8
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}
FORWARD_FIELDS = ("x", "send", "recv", "h", "a", "y", "comb", "out", "sh", "sa", "so")
BACKWARD_FIELDS = ("dy", "gsend", "grecv", "da", "aw", "dh", "dxe", "gcomb", "dx", "dw13", "dw2", "sda",
                   "sdh", "sdx", "dsw13", "dsw2")
SAVED = {"x": "x", "recv": "xe", "h": "h", "sh": "sh", "sa": "sa"}


def _moves_data(row: np.ndarray) -> bool:
    """Puts and unscaled gathers only move data: their output must be bit-identical."""
    op = int(row[COL["op"]])
    return op == Op.COPY or (op == Op.GATHER and row[COL["w_buf"]] < 0)


class Setup:
    """Exact forward and backward runs of one small layer, and arenas bound to their buffers."""

    def __init__(self, dtype: torch.dtype, top_k: int = 2):
        spec = dataclasses.replace(preset("tiny").with_dtype(dtype), top_k=top_k, groups=1, top_groups=1)
        self.w = ExpertWeights.random(spec, 0)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(EP * TOKENS, spec.hidden, generator=g).to(dtype)
        dy = torch.randn(EP * TOKENS, spec.hidden, generator=g).to(dtype)
        self.routing = synthetic_routing(RoutingKind.ZIPF, spec, ParallelSpec(EP, TOKENS), 0)
        self.fwd = execute_forward(x, self.w, self.routing, EP, TILES)
        plan = self.fwd.plan
        self.plan, self.space = plan, buffer_space(plan)
        saved = [SavedActivations.from_forward(b, True) for b in self.fwd.buffers]
        self.bwd = execute_backward(saved, plan, dy, self.w, self.routing, TILES, recompute=True)
        self.fctx = [RankContext.build(self.w, plan, self.routing, r) for r in range(EP)]
        tw = self.routing.weights.chunk(EP)
        self.bctx = [BackwardContext.build(self.w, plan, tw[r], r) for r in range(EP)]
        self.farena = self._arena(dtype, self._forward_views)
        self.barena = self._arena(dtype, self._backward_views)

    def _arena(self, dtype, views) -> Arena:
        arena = Arena(self.space, dtype, "cpu")
        fill_indices(arena, self.plan, self.routing.weights)
        for r in range(EP):
            for name, t in views(r).items():
                arena.bind_rank(name, r, t)
        return arena

    def _weights(self, r: int) -> dict:
        ctx = self.fctx[r]
        return {"w13": ctx.w13, "w2": ctx.w2, "sw13": self.w.shared_w13, "sw2": self.w.shared_w2,
                "topk": ctx.topk_weights}

    def _forward_views(self, r: int) -> dict:
        b = self.fwd.buffers[r]
        return {**{n: getattr(b, n) for n in FORWARD_FIELDS}, **self._weights(r)}

    def _backward_views(self, r: int) -> dict:
        b = self.bwd.buffers[r]
        views = {n: getattr(b, n) for n in BACKWARD_FIELDS}
        views.update({n: getattr(b.saved, s) for n, s in SAVED.items()}, dweights=b.dw)
        return {**views, **self._weights(r)}


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def setup(request) -> Setup:
    return Setup(request.param)


def _check_one(s: Setup, kind: TaskKind, forward: bool) -> int:
    graph = s.fwd.graph if forward else s.bwd.graph
    arena = s.farena if forward else s.barena
    region = FORWARD if forward else BACKWARD_RECOMPUTE
    buffers = s.fwd.buffers if forward else s.bwd.buffers
    contexts = s.fctx if forward else s.bctx
    ids = np.flatnonzero(graph.kind == kind)
    rows = describe(graph, s.space)
    tiles = tiles_of(graph)
    for t in (ids[0], ids[-1]):
        written = _written(rows[t])
        outs = {f: [arena.rank_view(f, r) for r in range(EP)] for f in written}
        _poison(outs)
        program = DeviceProgram(pack_tasks(graph, s.space, np.array([t]), 1), "cpu", s.w.spec.dtype)
        info = program.run(arena.addresses())
        assert info.launches == 1
        device = {f: [o.clone() for o in v] for f, v in outs.items()}
        _poison(outs)
        tile = tiles[t]
        kind = TaskKind(tile.kind)
        if kind in region.puts:
            region.puts[kind].copy(tile, buffers[tile.rank], buffers[tile.peer])
        else:
            region.kernels[kind](tile, buffers[tile.rank], buffers[tile.peer], contexts[tile.rank])
        for f, riding in written.items():
            for r in range(EP):
                got, want = device[f][r], outs[f][r]
                if riding:  # only the float32 riding after each row is this task's
                    got, want = rider(got), rider(want)
                assert torch.equal(got.isnan(), want.isnan()), f"{graph.task(t)}: {f} rows differ on r{r}"
                if _moves_data(rows[t]):
                    assert torch.equal(got[~got.isnan()], want[~want.isnan()]), f"{graph.task(t)} on r{r}"
                else:
                    tol = TOL[torch.float32 if riding else s.w.spec.dtype]
                    torch.testing.assert_close(got, want, equal_nan=True, **tol,
                                               msg=lambda m, t=t, f=f: f"{graph.task(t)} {f}: {m}")
    return len(ids)


def _written(row: np.ndarray) -> dict[str, bool]:
    """The fields a task writes: C's, and the routed SwiGLU backward's S and the router
    gradients riding in I's rows (True: only the riding float32)."""
    def name(col: str) -> str:
        return FIELDS[int(row[COL[col]]) // EP].name
    out = {name("c_buf"): False}
    if row[COL["op"]] == Op.SWIGLU_BWD and row[COL["variant"]] == 1:
        out.update({name("s_buf"): False, name("i_buf"): True})
    return out


def _poison(outs: dict[str, list[torch.Tensor]]) -> None:
    for views in outs.values():
        for o in views:
            o.fill_(float("nan"))


FORWARD_KINDS = [k for k in TaskKind if k in FORWARD.kernels or k in FORWARD.puts]
BACKWARD_KINDS = [k for k in TaskKind if k in BACKWARD_RECOMPUTE.kernels or k in BACKWARD_RECOMPUTE.puts]


@pytest.mark.parametrize("kind", FORWARD_KINDS, ids=[k.name for k in FORWARD_KINDS])
def test_forward_tile_matches_its_torch_kernel(setup, kind):
    assert _check_one(setup, kind, forward=True) > 0


@pytest.mark.parametrize("kind", BACKWARD_KINDS, ids=[k.name for k in BACKWARD_KINDS])
def test_backward_tile_matches_its_torch_kernel(setup, kind):
    assert _check_one(setup, kind, forward=False) > 0


@pytest.mark.parametrize("kind", [TaskKind.UNPERMUTE, TaskKind.GRAD_UNPERMUTE, TaskKind.ROUTER_GRAD],
                         ids=lambda k: k.name)
def test_slot_sums_over_more_slots_than_one_unrolled_step(kind):
    """Six slots: a full step of the SUM's unrolled loop and a part of one."""
    s = Setup(torch.float32, top_k=6)
    assert s.w.spec.top_k > int(device_module(True).SLOTS_IN_FLIGHT)
    assert _check_one(s, kind, forward=kind is TaskKind.UNPERMUTE) > 0


def test_every_task_kind_has_a_device_operation():
    # per-rank dispatch has no device operations: the backend refuses it (spec.require_per_expert)
    assert set(DESCRIBE) == set(TaskKind) - PER_RANK_KINDS


def test_device_columns_and_op_codes_match_the_packing():
    d = device_module(True)
    cols = {"C_OP": "op", "C_VARIANT": "variant", "C_M": "m", "C_N": "n", "C_K": "k", "C_A": "a_buf",
            "C_B": "b_buf", "C_C": "c_buf", "C_I": "i_buf", "C_W": "w_buf", "C_S": "s_buf", "C_KK": "kk"}
    assert {c: int(getattr(d, c)) for c in cols} == {c: COL[n] for c, n in cols.items()}
    assert int(d.NCOL) == len(COL)
    assert {op.name: int(getattr(d, f"OP_{op.name}")) for op in Op} == {op.name: int(op) for op in Op}
