"""Memory and links in the replay: L2 in schedule order, shared HBM, per-stream puts, link
tiers, and the lower bounds' memory term, each against a hand-built case with a known answer."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from hpmoe.cli import main
from hpmoe.ir.graph import TaskKind
from hpmoe.schedule import WorkerCounts
from hpmoe.sim.bounds import bounds
from hpmoe.sim.cost import task_costs
from hpmoe.sim.memory import LruCache, memory_traffic
from hpmoe.sim.presets import hardware_preset
from hpmoe.sim.simulate import simulate

from .handmade import UNIT_HW, US, Task, build, by_hand, put, vec

# a GEMM_UP tile 1 x 1000 x 500 (bf16): weight tile 1 MB, input row 1 KB, output 2 KB
TILE_FLOPS, WEIGHT, ROW, OUT = 2.0 * 1 * 1000 * 500, 1000 * 500 * 2, 500 * 2, 1000 * 2
MEM_HW = dataclasses.replace(UNIT_HW, matrix_flops_bf16=1e18, mem_bw=1e9)  # GEMMs all memory


def tile(expert: int, **kw) -> Task:
    return Task(TaskKind.GEMM_UP, flops=TILE_FLOPS, **kw)


def gemm_graph(experts: list[int]):
    """One matrix worker running GEMM tiles of the given experts in order (col1 = 1000)."""
    g = build(1, [tile(e) for e in experts], {})
    return dataclasses.replace(g, expert=np.array(experts, np.int32), col1=np.full(len(experts), 1000),
                               row0=np.arange(len(experts)), row1=np.arange(len(experts)) + 1)


def test_traffic_splits_a_gemm_tile_into_weight_rows_and_output():
    t = memory_traffic(gemm_graph([0, 1, 0]))
    assert list(t.fixed) == [OUT] * 3
    assert sorted(t.size) == [ROW] * 3 + [WEIGHT] * 2  # 3 row blocks, 2 weight tiles
    assert t.operand[0, 0] == t.operand[2, 0] != t.operand[1, 0]  # expert 0's tile is shared


@pytest.mark.parametrize(("l2_tiles", "weight_misses"), [(1, 4), (3, 2)])
def test_l2_in_schedule_order(l2_tiles: int, weight_misses: int):
    """Experts 0, 1, 0, 1: an L2 of one tile misses every time, one of three tiles only the
    first touch of each."""
    g = gemm_graph([0, 1, 0, 1])
    hw = dataclasses.replace(MEM_HW, l2_mb=l2_tiles * (WEIGHT + ROW) / 2**20)
    r = simulate(by_hand(g, [0, 0, 0, 0]), hw)
    hbm = weight_misses * WEIGHT + 4 * (ROW + OUT)
    assert r.memory.hbm_bytes[0] == pytest.approx(hbm)
    assert r.makespan == pytest.approx(hbm / 1e9)
    assert r.memory.l2_hit_rate[0] == pytest.approx((4 - weight_misses) * WEIGHT / (4 * (WEIGHT + ROW)))


def test_lru_evicts_the_least_recent_and_skips_what_cannot_fit():
    c = LruCache(10.0)
    assert [c.access(k, s) for k, s in ((1, 4), (2, 4), (1, 4), (3, 4), (2, 4), (1, 4), (9, 11))] == \
        [4, 4, 0, 4, 4, 4, 11]


def test_two_tasks_share_hbm_and_end_by_their_bytes_over_bandwidth():
    g = build(1, [vec(0, bytes=1000.0), vec(0, bytes=3000.0)], {})
    r = simulate(by_hand(g, [0, 1]), MEM_HW)
    # both at 0.5 GB/s until the first's 1000 B are served (2 µs), then the second alone
    assert list(np.round(r.timeline.end / US, 6)) == [2, 4]
    assert r.memory.busy[0] == pytest.approx(4 * US)


def test_compute_floor_and_memory_overlap():
    hw = dataclasses.replace(MEM_HW, vector_flops=1e9)
    g = build(1, [vec(5, bytes=1000.0)], {})  # 5 µs of flops, 1 µs of memory
    assert simulate(by_hand(g, [0]), hw).makespan == pytest.approx(5 * US)


def test_memory_bound_holds_where_the_old_bound_is_beaten():
    """Eight tiles of one expert on eight matrix workers, no L2: compute is free, so the old
    bounds (no memory term) say ~0; the replay takes the compulsory bytes over the bandwidth."""
    g = gemm_graph([0, 1, 2, 3, 4, 5, 6, 7])
    hw = dataclasses.replace(MEM_HW, matrix_workers=8)
    s = by_hand(g, list(range(8)), workers=WorkerCounts(matrix=8, vector=2))
    r = simulate(s, hw)
    need = 8 * (WEIGHT + ROW + OUT)
    assert r.makespan == pytest.approx(need / 1e9)
    assert r.bounds.memory == pytest.approx(need / 1e9) == pytest.approx(r.bounds.lower_bound)
    old = bounds(g, task_costs(g, hw), s.workers)  # no memory system: the former bounds
    assert old.lower_bound < 0.01 * r.makespan


def test_single_put_stream_is_capped_at_its_rate_and_streams_add_up():
    hw = dataclasses.replace(UNIT_HW, stream_bw=0.25e9)  # a 1 GB/s port serves 4 streams
    one = simulate(by_hand(build(2, [put(0, 1, 2)], {}), [0]), hw)
    assert one.timeline.link_end[0] - one.timeline.link_start[0] == pytest.approx(8 * US)
    g = build(5, [put(0, p, 2) for p in (1, 2, 3, 4)], {})
    four = simulate(by_hand(g, [0, 1, 0, 1], workers=WorkerCounts(matrix=1, vector=2)), hw)
    # two workers: two streams at a time, each at 0.25 GB/s
    assert list(np.round(four.timeline.link_end / US, 6)) == [8, 8, 17, 17]
    assert four.bounds.link == pytest.approx(8 * US + 1 * US)  # 4 x 8 µs over 4 lanes + latency


def test_puts_between_nodes_use_the_inter_node_tier():
    hw = dataclasses.replace(UNIT_HW, inter_link_bw=0.1e9, inter_latency=5e-6)
    g = build(4, [put(0, 1, 2), put(0, 2, 2)], {})
    g = dataclasses.replace(g, nodes=2)
    r = simulate(by_hand(g, [0, 1]), hw)
    # within the node: 2 µs + 1 µs; across: 2000 B at 0.1 GB/s = 20 µs + 5 µs, on its own port
    assert list(np.round(r.timeline.link_start / US, 6)) == [0, 0]
    assert list(np.round(r.timeline.end / US, 6)) == [3, 25]
    with pytest.raises(ValueError, match="inter_link_bw"):
        simulate(by_hand(g, [0, 1]), UNIT_HW)


@pytest.mark.parametrize("direction", [[], ["--backward"]])
def test_cli_without_l2_pays_every_gemm_byte(capsys, direction: list[str]):
    args = ["simulate", "--preset", "small", "--ep", "2", "--tokens", "256", "--schedule", "serial",
            "--routing", "grouped", "--json", *direction]
    assert main([*args, "--set", "l2_mb=0", "--set", "hbm_gbs=100"]) == 0
    cold = json.loads(capsys.readouterr().out)
    assert main(args) == 0
    warm = json.loads(capsys.readouterr().out)
    assert cold["l2_hit_rate"] == 0.0 < warm["l2_hit_rate"]
    assert cold["hbm_bytes"] > warm["hbm_bytes"]
    assert cold["makespan_us"] >= cold["hbm_bytes"] / 100e9 * 1e6 * (1 - 1e-5)  # µs rounded to 3 places
    assert cold["bounds"]["memory_us"] == pytest.approx(cold["hbm_bytes"] / 100e9 * 1e6, rel=1e-5)
    for out in (cold, warm):
        assert out["makespan_us"] >= out["bounds"]["max_us"] * (1 - 1e-9)
        assert out["bounds"]["memory_us"] > 0
    assert main([*args, "--set", "l2=1"]) == 2
    assert "valid fields" in capsys.readouterr().err


def test_presets_carry_a_cache_and_sub_peak_gemms():
    for name in ("ascend-a3", "h100"):
        hw = hardware_preset(name)
        assert hw.l2_mb > 0 and 0 < hw.matrix_efficiency < 1 and hw.stream_bw > 0


def test_reuse_aware_order_keeps_weights_hot():
    """An L2 of two experts' weights: the expert-by-expert list schedule misses less than the
    arrival-order ones; an L2 that holds everything misses each operand exactly once."""
    from hpmoe.regions.forward import lower_forward
    from hpmoe.routing import RoutingKind, plan_routing, synthetic_routing
    from hpmoe.schedule import critical_path as cp
    from hpmoe.spec import ParallelSpec, TileSpec, preset

    moe, par = preset("small"), ParallelSpec(ep=2, tokens_per_rank=512)
    g = lower_forward(plan_routing(synthetic_routing(RoutingKind.GROUPED, moe, par).ids, moe, par),
                      TileSpec(128, 128, 128))
    expert_mb = 3 * moe.hidden * moe.ffn * 2 / 2**20
    compulsory = np.bincount(memory_traffic(g).key_rank, weights=memory_traffic(g).size, minlength=2)
    for l2_mb in (2 * expert_mb, 100.0):
        hw = dataclasses.replace(hardware_preset("ascend-a3"), l2_mb=l2_mb, matrix_workers=4,
                                 vector_workers=4)
        costs, workers = task_costs(g, hw), hw.workers
        miss = {o: simulate(cp.list_schedule(g, costs, workers, o), hw).memory.l2_miss_bytes.sum()
                for o in cp.PutOrder}
        if l2_mb == 100.0:
            assert all(m == pytest.approx(compulsory.sum()) for m in miss.values())
        else:
            assert miss[cp.PutOrder.EXPERT] < 0.8 * min(miss[cp.PutOrder.STAGES], miss[cp.PutOrder.PRIORITY])


def test_published_measurements_within_twenty_percent():
    from hpmoe.sim.validate import checks

    rows = checks()
    assert len([c for c in rows if not c.circular]) >= 8
    for c in rows:
        assert abs(c.error) <= 0.2, (c.name, c.predicted, c.measured)


def test_parallel_spec_nodes_split_the_ranks():
    from hpmoe.spec import ParallelSpec

    assert ParallelSpec(ep=16, tokens_per_rank=8, nodes=2).ranks_per_node == 8
    with pytest.raises(ValueError, match="nodes=3 does not divide ep=8"):
        ParallelSpec(ep=8, tokens_per_rank=8, nodes=3)


def backward_graph(kinds: list[TaskKind], rows: list[tuple[int, int]], cols: list[tuple[int, int]],
                   depth: int):
    """One matrix worker running backward GEMM tiles of expert 0 (rows x cols, depth ``depth``)."""
    g = build(1, [Task(k, flops=2.0 * (r1 - r0) * (c1 - c0) * depth)
                  for k, (r0, r1), (c0, c1) in zip(kinds, rows, cols, strict=True)], {})
    return dataclasses.replace(g, row0=np.array([r for r, _ in rows]), row1=np.array([r for _, r in rows]),
                               col0=np.array([c for c, _ in cols]), col1=np.array([c for _, c in cols]))


@pytest.mark.parametrize(("l2_weights", "weight_misses"), [(0.5, 2), (1.5, 1)])
def test_dgrad_tiles_reuse_their_weight_tile_through_the_l2(l2_weights: float, weight_misses: int):
    """Two DGRAD_DOWN tiles of one expert over two row blocks and the same columns: an L2
    smaller than the weight tile misses it twice, one that holds it misses it once."""
    m, n, k = 4, 1000, 500  # weight tile n x k = 1 MB, a row block m x k = 4 KB, output m x n
    g = backward_graph([TaskKind.DGRAD_DOWN] * 2, [(0, m), (m, 2 * m)], [(0, n)] * 2, k)
    weight, block, out = n * k * 2, m * k * 2, m * n * 2
    hw = dataclasses.replace(MEM_HW, l2_mb=l2_weights * weight / 2**20)
    r = simulate(by_hand(g, [0, 0]), hw)
    hbm = weight_misses * weight + 2 * (block + out)
    assert r.memory.hbm_bytes[0] == pytest.approx(hbm)
    assert r.makespan == pytest.approx(hbm / 1e9)
    assert r.memory.l2_hit_rate[0] == pytest.approx((2 - weight_misses) * weight / (2 * (weight + block)))


def test_wgrad_column_tiles_reuse_the_activation_rows():
    """Two WGRAD_DOWN column tiles of one expert's 64 rows: the activation rows (64 x k) are
    read once when the L2 holds them, the gradient slices (64 x n) each once, and each
    writes its n x k weight-gradient tile; an L2 of one byte misses every operand."""
    m, n, k = 64, 300, 400
    g = backward_graph([TaskKind.WGRAD_DOWN] * 2, [(0, m)] * 2, [(0, n), (n, 2 * n)], k)
    act, grad, out = m * k * 2, m * n * 2, n * k * 2
    warm = simulate(by_hand(g, [0, 0]), dataclasses.replace(MEM_HW, l2_mb=1.0))
    cold = simulate(by_hand(g, [0, 0]), dataclasses.replace(MEM_HW, l2_mb=1 / 2**20))
    assert warm.memory.hbm_bytes[0] == pytest.approx(act + 2 * (grad + out))
    assert cold.memory.hbm_bytes[0] == pytest.approx(2 * (act + grad + out))
    assert cold.memory.l2_hit_rate[0] == 0.0
    assert warm.bounds.memory == pytest.approx(warm.memory.hbm_bytes[0] / 1e9)


def test_backward_region_gemms_go_through_the_l2():
    """The backward lowering's GEMM tiles are cached operands; with no L2 the replay moves
    every operand each time, which is more than the lowering's per-reuse-group bytes."""
    from hpmoe.regions.backward import lower_backward
    from hpmoe.routing import RoutingKind, plan_routing, synthetic_routing
    from hpmoe.schedule import SchedulePolicy, schedule
    from hpmoe.sim.memory import CACHED_KINDS
    from hpmoe.spec import ParallelSpec, TileSpec, preset

    moe, par = preset("small"), ParallelSpec(ep=2, tokens_per_rank=256)
    g = lower_backward(plan_routing(synthetic_routing(RoutingKind.GROUPED, moe, par).ids, moe, par),
                       TileSpec(128, 128, 128))
    t = memory_traffic(g)
    gemms = np.isin(g.kind, CACHED_KINDS)
    assert (t.operand[gemms] >= 0).all() and (t.operand[~gemms] < 0).all()
    assert set(g.kind[gemms]) >= {TaskKind.DGRAD_UP, TaskKind.WGRAD_DOWN, TaskKind.SHARED_WGRAD_UP}
    hw = hardware_preset("ascend-a3")
    s = schedule(g, SchedulePolicy.SERIAL, hw)
    cold = simulate(s, dataclasses.replace(hw, l2_mb=0.0))
    warm = simulate(s, hw)
    assert cold.memory.hbm_bytes.sum() == pytest.approx(t.uncached(g.ep, g.rank).sum())
    assert cold.memory.hbm_bytes.sum() > g.bytes[gemms].sum() + t.fixed[~gemms].sum()
    assert warm.memory.l2_hit_rate.min() > 0.0
