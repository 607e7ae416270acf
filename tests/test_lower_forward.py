"""The forward graph moves every row exactly once and depends on exactly the
tiles that produce each task's rows."""

import dataclasses

import numpy as np
import pytest

from hpmoe.ir.graph import TaskGraph, TaskKind
from hpmoe.regions.forward import lower_forward
from hpmoe.routing import RoutingKind
from hpmoe.spec import TileSpec

from .helpers import TINY_TILES, tiny_plan


def _tasks(g: TaskGraph, kind: TaskKind) -> np.ndarray:
    return np.flatnonzero(g.kind == kind)


def _coverage(g: TaskGraph, ids: np.ndarray, rank: np.ndarray, start: np.ndarray, sizes: list[int]) -> list:
    """How many tasks cover each row of each rank's buffer."""
    cover = [np.zeros(n, np.int64) for n in sizes]
    for i, r, s in zip(ids, rank, start, strict=True):
        cover[r][s:s + g.row1[i] - g.row0[i]] += 1
    return cover


@pytest.mark.parametrize("kind", list(RoutingKind))
def test_puts_cover_every_row_exactly_once(kind):
    plan = tiny_plan(kind, ep=4, tokens=9)
    g = lower_forward(plan, TINY_TILES)
    d = _tasks(g, TaskKind.DISPATCH)
    recv = [plan.recv_rows(r) for r in range(4)]
    sent = [9 * plan.moe.top_k] * 4
    assert all((c == 1).all() for c in _coverage(g, d, g.rank[d], g.row0[d], sent))
    assert all((c == 1).all() for c in _coverage(g, d, g.peer[d], g.dst_row0[d], recv))
    c = _tasks(g, TaskKind.COMBINE)
    assert all((x == 1).all() for x in _coverage(g, c, g.peer[c], g.dst_row0[c], sent))
    assert (g.row1 > g.row0).all(), "no empty tiles"
    assert (g.row1[d] - g.row0[d]).max() <= TINY_TILES.rows


def test_gemm_waits_exactly_for_the_pieces_that_write_its_rows():
    plan = tiny_plan(RoutingKind.ZIPF, ep=2, tokens=11, seed=3)
    g = lower_forward(plan, TINY_TILES)
    sig, who = g.signals_global(), g.signaller()
    for i in _tasks(g, TaskKind.GEMM_UP):
        producers = set(who[sig == g.wait_global()[i]].tolist())
        d = _tasks(g, TaskKind.DISPATCH)
        lo, hi = g.dst_row0[d], g.dst_row0[d] + g.row1[d] - g.row0[d]
        overlap = d[(g.peer[d] == g.rank[i]) & (lo < g.row1[i]) & (hi > g.row0[i])]
        assert producers == set(overlap.tolist())


def test_unpermute_waits_exactly_for_pieces_and_shared_tiles_of_its_tokens():
    plan = tiny_plan(RoutingKind.BALANCED, ep=2, tokens=10, seed=1)
    g = lower_forward(plan, TINY_TILES)
    sig, who = g.signals_global(), g.signaller()
    k = plan.moe.top_k
    for i in _tasks(g, TaskKind.UNPERMUTE):
        r = g.rank[i]
        rows = plan.pos[r, g.row0[i]:g.row1[i]].reshape(-1).numpy()
        c = _tasks(g, TaskKind.COMBINE)
        carries = [j for j in c if g.peer[j] == r and
                   np.intersect1d(rows, np.arange(g.dst_row0[j], g.dst_row0[j] + g.row1[j] - g.row0[j])).size]
        s = _tasks(g, TaskKind.SHARED_DOWN)
        shared = [j for j in s if g.rank[j] == r and g.row0[j] < g.row1[i] and g.row1[j] > g.row0[i]]
        assert set(who[sig == g.wait_global()[i]].tolist()) == set(carries) | set(shared)
        assert len(rows) == (g.row1[i] - g.row0[i]) * k


def test_empty_experts_and_ranks_produce_no_tasks():
    plan = tiny_plan(RoutingKind.EMPTY_RANK, ep=4, tokens=6)
    g = lower_forward(plan, TINY_TILES)
    on_last = g.rank == 3
    assert not np.isin(g.kind[on_last], [TaskKind.GEMM_UP, TaskKind.SWIGLU, TaskKind.GEMM_DOWN,
                                         TaskKind.COMBINE]).any()
    plan = tiny_plan(RoutingKind.EMPTY_EXPERTS, ep=2, tokens=6)
    g = lower_forward(plan, TINY_TILES)
    gemm = np.isin(g.kind, [TaskKind.GEMM_UP, TaskKind.GEMM_DOWN])
    global_expert = g.rank[gemm] * plan.local_experts + g.expert[gemm]
    assert (global_expert % 2 == 0).all()


@pytest.mark.parametrize("tiles", [TINY_TILES, TileSpec(rows=2, gemm_rows=0, gemm_cols=5)])
def test_one_rank_lowering_is_the_full_graph_restricted_to_that_rank(tiles):
    plan = tiny_plan(RoutingKind.ZIPF, ep=4, tokens=7, seed=2)
    full = lower_forward(plan, tiles)
    for r in range(4):
        part = lower_forward(plan, tiles, ranks=(r,))
        mine = np.flatnonzero(full.rank == r)
        for col in ("kind", "peer", "expert", "row0", "row1", "col0", "col1", "dst_row0", "wait"):
            assert getattr(part, col).tolist() == getattr(full, col)[mine].tolist(), col
        lo, hi = full.event_ptr[r], full.event_ptr[r + 1]
        assert part.threshold.tolist() == full.threshold[lo:hi].tolist()
        full_sigs = [full.sig_event[full.sig_ptr[i]:full.sig_ptr[i + 1]].tolist() for i in mine]
        part_sigs = [part.sig_event[part.sig_ptr[i]:part.sig_ptr[i + 1]].tolist() for i in range(len(mine))]
        assert full_sigs == part_sigs


def test_whole_expert_gemm_blocks_wait_for_the_whole_expert():
    plan = tiny_plan(RoutingKind.BALANCED, ep=2, tokens=8)
    g = lower_forward(plan, TileSpec(rows=2, gemm_rows=0, gemm_cols=8))
    up = _tasks(g, TaskKind.GEMM_UP)
    expert_rows = plan.counts.sum(dim=0).numpy()
    assert sorted((g.row1[up] - g.row0[up]).tolist()) == sorted(
        np.repeat(expert_rows.ravel(), 4).tolist())  # 2F=32 / 8 = 4 column tiles


def test_the_gated_activation_is_charged_its_form_s_flops():
    """GPT-OSS's clamped, shifted SwiGLU costs the simulator GluForm.flops per element, not
    the plain SwiGLU's 5; the same rows, the same tasks, forward and backward."""
    from hpmoe.regions.backward import lower_backward
    from hpmoe.spec import PLAIN_GLU

    from .helpers import GPT_OSS_FORM

    plain = dataclasses.replace(GPT_OSS_FORM, glu=PLAIN_GLU)
    ratio = GPT_OSS_FORM.glu.flops / PLAIN_GLU.flops
    assert ratio > 1
    for lower, kind in ((lower_forward, TaskKind.SWIGLU), (lower_backward, TaskKind.SWIGLU_BWD)):
        got, want = (lower(tiny_plan(moe=m), TINY_TILES) for m in (GPT_OSS_FORM, plain))
        np.testing.assert_allclose(got.flops[got.kind == kind], ratio * want.flops[want.kind == kind])
        assert got.flops[got.kind == kind].sum() > 0
