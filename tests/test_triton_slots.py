"""The persistent kernel from one plan made per shape (``gpu.slots``), in the Triton
interpreter: one program, built once, serves 20 routings of a shape with the bits of the
per-routing kernel (``backend.triton_forward``) each time, its work buffers poisoned with
NaN between calls; what a call writes into the device's task table is what ``describe``
gives for the routing's resolved graph."""

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

import hpmoe.gpu.slots as gpu_slots  # noqa: E402
from hpmoe.exec.exact import resolved_graph  # noqa: E402
from hpmoe.gpu.backend import TritonOptions, triton_backward, triton_forward  # noqa: E402
from hpmoe.gpu.buffers import Elem  # noqa: E402
from hpmoe.gpu.ops import COL, describe  # noqa: E402
from hpmoe.gpu.slots import PlanCache, SlotColumns, slot_forward  # noqa: E402
from hpmoe.refs import dense_moe  # noqa: E402
from hpmoe.regions.slot_backward import plan_slot_backward  # noqa: E402
from hpmoe.regions.slot_routing import resolve_slots  # noqa: E402
from hpmoe.runtime.forensics import RegionError  # noqa: E402
from hpmoe.schedule import SchedulePolicy  # noqa: E402
from hpmoe.spec import GateKind, MoESpec, TileSpec  # noqa: E402
from hpmoe.weights import ExpertWeights  # noqa: E402

from .slot_routings import twenty_routings  # noqa: E402

SPEC = MoESpec(hidden=32, ffn=16, experts=4, top_k=2, shared_experts=1, gate=GateKind.SOFTMAX,
               dtype=torch.float32)
TILES = TileSpec(rows=8, gemm_rows=8, gemm_cols=16)
TOKENS = 16
FULL = [[9, 9, 9, 5], [1, 9, 9, 13]]
SKEWED = [[16, 16, 0, 0], [16, 8, 8, 0], [16, 1, 1, 14]]


@pytest.fixture(scope="module")
def case():
    w = ExpertWeights.random(SPEC, 0)
    x = torch.randn(TOKENS, SPEC.hidden, generator=torch.Generator().manual_seed(1))
    return x, w, twenty_routings(SPEC, TOKENS, FULL, SKEWED)


def test_one_program_built_once_serves_twenty_routings_bitwise(case, monkeypatch):
    x, w, routings = case
    lowered = []
    real = gpu_slots.plan_slots
    monkeypatch.setattr(gpu_slots, "plan_slots", lambda shape: lowered.append(shape) or real(shape))
    cache = PlanCache()
    options = TritonOptions(policy=SchedulePolicy.CRITICAL_PATH)
    programs = set()
    for i, r in enumerate(routings):
        program = cache.program(x, w, r, TILES, options)
        programs.add(id(program))
        if i:  # a call reads nothing a previous call left behind
            program.arena.flat[Elem.DATA].fill_(float("nan"))
        run = slot_forward(x, w, r, cache, TILES, options)
        want = triton_forward(x, w, r, 1, TILES, options)
        assert torch.equal(run.out, want.out), i
        torch.testing.assert_close(run.out, dense_moe(x, w, r), atol=1e-5, rtol=1e-5)
        assert run.info.launches > 1  # rounds: waits did block
    assert cache.builds == 1 and len(lowered) == 1 and len(programs) == 1


def test_another_shape_or_policy_is_another_program(case):
    x, w, routings = case
    cache = PlanCache()
    cache.program(x, w, routings[0], TILES, TritonOptions())
    cache.program(x, w, routings[1], TILES, TritonOptions())
    assert cache.builds == 1
    cache.program(x[:8], w, routings[0].__class__(routings[0].ids[:8], routings[0].weights[:8]), TILES,
                  TritonOptions())
    cache.program(x, w, routings[0], TILES, TritonOptions(policy=SchedulePolicy.SERIAL))
    assert cache.builds == 3


def test_the_cache_keeps_the_most_recently_used_programs_only(case):
    x, w, routings = case
    cache = PlanCache(kept=2)
    made = {}
    for n in (16, 8, 16, 12, 8):  # 12 drops 8 (16 was used since); 8 is built again
        r = routings[0].__class__(routings[0].ids[:n], routings[0].weights[:n])
        made.setdefault(n, []).append(cache.program(x[:n], w, r, TILES, TritonOptions()))
    assert cache.builds == 4 and made[16][0] is made[16][1] and made[8][0] is not made[8][1]
    assert len(cache._programs) == 2
    with pytest.raises(ValueError, match="kept=0"):
        PlanCache(kept=0)


def test_a_program_a_graph_captured_outlives_its_place_in_the_cache(case, monkeypatch):
    """A capture's replays read the program's buffers and the address table it used:
    dropped for newer shapes, or built again after a late wait, it stays referenced."""
    x, w, routings = case
    cache = PlanCache(kept=1)
    program = cache.program(x, w, routings[0], TILES, TritonOptions())
    program.prepare(x, w, routings[0])
    monkeypatch.setattr(gpu_slots, "capturing", lambda device: True)
    table, _ = program.addresses()
    monkeypatch.undo()
    assert program.captured and cache.program(x, w, routings[0], TILES, TritonOptions()) is program
    r = routings[0].__class__(routings[0].ids[:8], routings[0].weights[:8])
    cache.program(x[:8], w, r, TILES, TritonOptions())  # drops the captured one
    assert cache._captured == [program] and program._captured[0][1] is table
    program.prepare(x.clone(), w, routings[1])
    assert program.addresses()[0] is not table and program._captured[0][1] is table
    program.program.launch_state[1][0, 0] = 1  # a replay's late wait: check() still finds it
    with pytest.raises(RegionError, match="passed the deadline"):
        cache.report()


def test_a_call_writes_the_operands_of_its_resolved_graph(case):
    x, w, routings = case
    cache = PlanCache()
    for r in (routings[15], routings[10], routings[0]):
        program = cache.program(x, w, r, TILES, TritonOptions())
        _, slots = program.prepare(x, w, r)
        got = program.program.arrays["tasks"].numpy()
        assert torch.equal(slots.pos, resolve_slots(r.ids, program.key.shape).pos)
        want = describe(resolved_graph(program.plan, slots), program.arena.space)
        assert np.array_equal(got, want)
        st = program.plan.slot_tasks
        assert got[st.task, COL["m"]].sum() > 0 and (got[st.task, COL["m"]] <= st.cap).all()


def test_the_task_tables_entries_in_one_launch_are_the_torch_integers(case):
    """``SlotColumns.apply`` as a GPU runs it (one launch, here in the interpreter)
    against its torch version, forward and backward (whose weight gradients are expert
    tasks), over the twenty routings."""
    x, w, routings = case
    program = PlanCache().program(x, w, routings[0], TILES, TritonOptions())
    shape, space = program.key.shape, program.arena.space
    backward = plan_slot_backward(shape)
    assert backward.expert_tasks.task.size and not program.plan.expert_tasks.task.size
    for plan in (program.plan, backward):
        columns = SlotColumns.of(plan, space, x.device)
        table = torch.from_numpy(describe(plan.graph, space)).to(program.program.arrays["tasks"].dtype)
        changed = 0
        for r in routings:
            slots = resolve_slots(r.ids, shape)
            want, got = table.clone(), table.clone()
            columns.apply(want, slots)
            columns.apply(got, slots, interpret=True)
            assert torch.equal(got, want)
            changed += not torch.equal(want, table)
        assert changed >= 15  # the table at capacity is not what most routings write


def test_a_step_before_its_launch_reads_nothing_of_the_device(case):
    """Resolving the routing, writing the task table and the row indices, binding and
    the addresses: no op or Tensor method whose result the host must wait for.  A
    strided x (the program's own caller, not the layer's door) launches as its rows."""
    from .test_host_reads import no_host_reads

    x, w, routings = case
    program = PlanCache().program(x, w, routings[0], TILES, TritonOptions())
    for r in routings[5:8] + routings[15:17]:
        with no_host_reads():
            out, _ = program.prepare(x, w, r)
            program.addresses()
        assert out.shape == x.shape
    launched = program.launch(x, w, routings[3])  # in the interpreter: rounds, no check
    assert torch.equal(launched.out, triton_forward(x, w, routings[3], 1, TILES).out)
    assert program.last is launched and not launched.errors.any()
    strided = x.t().contiguous().t()  # the same values laid out column by column
    assert torch.equal(program.launch(strided, w, routings[3]).out, launched.out)


def test_every_launch_and_every_checked_run_starts_the_counters_from_zero(case):
    """A launch and a checked run each zero the counters (with the cursors) first: after
    either they hold one call's signals, and every launch passes the kernel the same
    arguments but the address table, as a CUDA graph's replays pass them."""
    x, w, routings = case
    program = PlanCache().program(x, w, routings[0], TILES, TritonOptions())
    device = program.program
    p = device.packed
    step = np.bincount(p.sig_event, minlength=p.num_events)
    launches = []  # (the address table, the kernel's arguments) of each call
    real = device._kernel_args
    device._kernel_args = lambda table, *a: launches.append((table, real(table, *a))) or launches[-1][1]
    for i in (11, 2):  # one hot expert, zipf
        launched = program.launch(x, w, routings[i])
        assert np.array_equal(device.counters.numpy()[:p.num_events], step)
        assert torch.equal(program.forward(x, w, routings[i]).out, launched.out)  # a checked run
        assert np.array_equal(device.counters.numpy()[:p.num_events], step)
    assert torch.equal(launched.out, triton_forward(x, w, routings[2], 1, TILES).out)
    (table, first), (_, second) = launches[0], launches[2]  # the two launches' (each before a run's)
    # all but the address table, the same tensor while no address changes (tested below)
    assert all(a is b or (not isinstance(a, torch.Tensor) and a == b)
               for a, b in zip(first, second, strict=True) if a is not table)


def test_the_address_table_is_uploaded_again_only_when_an_address_changed(case):
    x, w, routings = case
    program = PlanCache().program(x, w, routings[0], TILES, TritonOptions())
    out, _ = program.prepare(x, w, routings[1])
    first, _ = program.addresses()
    assert program.addresses()[0] is first
    assert np.array_equal(first.numpy(), program.arena.host_addresses())
    program.prepare(x.clone(), w, routings[2])  # x and out elsewhere (``out`` is still held)
    again, _ = program.addresses()
    assert again is not first and np.array_equal(again.numpy(), program.arena.host_addresses())
    assert not np.array_equal(again.numpy(), first.numpy()) and out.data_ptr() not in again.tolist()


def test_a_late_wait_of_a_launch_is_raised_by_the_next_one_which_then_runs_as_any_call(case):
    """A late wait (the device's deadline; written here into the error rows as the
    kernel writes them) is raised one launch late, once, naming the waiting task; the
    same program serves the next call, which starts from zero as every call does."""
    x, w, routings = case
    cache = PlanCache()
    program = cache.program(x, w, routings[0], TILES, TritonOptions())
    program.launch(x, w, routings[0])
    device = program.program
    p = device.packed
    task = int(p.queue_task[np.flatnonzero(p.wait_event[p.queue_task] >= 0)[0]])
    device.launch_state[1][0] = torch.tensor([1, task, 0, 0], dtype=torch.int32)
    device._seen.copy_(device.launch_state[1])  # the copy a GPU's launch makes to host memory
    late = r"1 wait\(s\) passed the deadline.*seen after its launch returned"
    with pytest.raises(RegionError, match=late) as e:
        program.launch(x, w, routings[1])
    waits = [wr for wr in e.value.report.workers if wr.task]
    assert [wr.threshold for wr in waits] == [int(device.packed.wait_threshold[task])]  # of the late call
    assert not device.launch_state[1].any()
    device.launch_state[1][0] = torch.tensor([1, task, 0, 0], dtype=torch.int32)
    device._seen.copy_(device.launch_state[1])
    with pytest.raises(RegionError, match=late):  # a checked run raises it first too
        program.forward(x, w, routings[1])
    assert cache.program(x, w, routings[1], TILES, TritonOptions()) is program and cache.builds == 1
    for retired in (program, device):  # no program fails for good now (one release of warnings)
        with pytest.warns(DeprecationWarning, match=r"\.failed is deprecated"):
            assert retired.failed is False
    launched = program.launch(x, w, routings[1])
    assert torch.equal(launched.out, triton_forward(x, w, routings[1], 1, TILES).out)
    device.launch_state[1][2, 0] = 1  # not yet seen in host memory: check() waits and reads
    with pytest.raises(RegionError, match="passed the deadline"):
        cache.report()
    cache.report()  # reported once


def test_a_launch_under_a_capture_copies_nothing_to_host_memory(case, monkeypatch):
    """A capture records no copy to pinned memory: a late wait that a replay writes stays
    in the device's error rows, where ``report(wait=True)`` (``check``) reads it."""
    import hpmoe.gpu.runner as runner

    x, w, routings = case
    program = PlanCache().program(x, w, routings[0], TILES, TritonOptions())
    device = program.program
    monkeypatch.setattr(runner, "capturing", lambda d: True)
    monkeypatch.setattr(gpu_slots, "capturing", lambda d: True)
    program.launch(x, w, routings[2])
    device.launch_state[1][1] = torch.tensor([1, 0, 0, 0], dtype=torch.int32)  # as a replay's late wait
    program.launch(x, w, routings[3])  # its copy would carry the row to host memory
    assert not device._seen.any()
    with pytest.raises(RegionError, match="passed the deadline"):
        device.report(wait=True)


def test_bf16_one_program_gives_the_per_routing_kernels_bits(case):
    x, w, routings = case
    spec = SPEC.with_dtype(torch.bfloat16)
    w16 = ExpertWeights.random(spec, 3)
    x16 = x.to(torch.bfloat16)
    cache = PlanCache()
    for r in (routings[2], routings[11], routings[16]):  # zipf, one hot expert, every slot filled
        got = slot_forward(x16, w16, r, cache, TILES).out
        assert torch.equal(got, triton_forward(x16, w16, r, 1, TILES).out)
    assert cache.builds == 1


def test_one_program_runs_forward_and_backward_with_the_per_routing_kernels_bits(case):
    """Zipf, one hot expert, experts with no rows, every slot filled: every gradient
    (experts without rows: zeros, as the per-routing kernel's host zeroes them), the
    backward region built once, the arena poisoned between calls."""
    x, w, routings = case
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(5))
    cache = PlanCache()
    regions = set()
    for i in (2, 9, 12, 16):
        program = cache.program(x, w, routings[i], TILES, TritonOptions())
        program.arena.flat[Elem.DATA].fill_(float("nan"))
        run = program.forward(x, w, routings[i])
        got = program.backward(run, dy, w, routings[i]).grads
        regions.add(id(program.backward_region))
        region = program.backward_region
        assert np.array_equal(region.program.arrays["tasks"].numpy(),
                              describe(resolved_graph(region.plan, run.slots), program.arena.space))
        fwd = triton_forward(x, w, routings[i], 1, TILES)
        want = triton_backward(fwd, dy).grads
        assert torch.equal(run.out, fwd.out), i
        for name in ("dx", "dweights", "dw13", "dw2", "dshared_w13", "dshared_w2"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (i, name)
    assert cache.builds == 1 and len(regions) == 1


def test_a_backward_step_before_its_launch_reads_nothing_of_the_device(case):
    from .test_host_reads import no_host_reads

    x, w, routings = case
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(6))
    program = PlanCache().program(x, w, routings[0], TILES, TritonOptions())
    run = program.forward(x, w, routings[0])
    program.prepare_backward(dy, w, routings[0], run.slots)  # builds the backward region
    for r in routings[5:8] + routings[15:17]:
        with no_host_reads():
            _, slots = program.prepare(x, w, r)
            program.prepare_backward(dy, w, r, slots)
            program.addresses()


@pytest.mark.parametrize("placed", [False, True], ids=["own-rows", "replicas"])
def test_a_launched_backward_with_uninitialised_outputs_gives_the_checked_ones_bits(case, placed):
    """``launch_backward`` leaves its outputs uninitialised (``backward`` fills them with
    NaN and shows every element written): the same bits, with freed host memory full of
    NaN before each launch; with replicated experts the stored rows no slot reads are
    zeroed and the replicas folded in."""
    x, w, routings = case
    if placed:
        w = ExpertWeights.routed(SPEC, w.w13[:3].clone(), w.w2[:3].clone(), w.shared_w13, w.shared_w2,
                                 slot_rows=(0, 1, 0, 2))
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(8))
    program = PlanCache().program(x, w, routings[0], TILES, TritonOptions())
    for i in (16,) if placed else (12,):  # every slot filled; experts without rows (zeros written)
        want = program.backward(program.forward(x, w, routings[i]), dy, w, routings[i]).grads
        launched = program.launch(x, w, routings[i])
        for t in (want.dx, want.dweights, want.dw13, want.dw2):
            torch.full_like(t, float("nan"))  # freed at once: the next allocations may reuse it
        got = program.launch_backward(launched, dy, w, routings[i]).grads
        for name in ("dx", "dweights", "dw13", "dw2", "dshared_w13", "dshared_w2"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (i, name)


def test_replicated_experts_reading_rows_in_place(case):
    x, w, routings = case
    placed = ExpertWeights.routed(SPEC, w.w13[:3].clone(), w.w2[:3].clone(), w.shared_w13, w.shared_w2,
                                  slot_rows=(0, 1, 0, 2))
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(7))
    program = PlanCache().program(x, placed, routings[16], TILES, TritonOptions())
    run = program.forward(x, placed, routings[16])
    got = program.backward(run, dy, placed, routings[16]).grads
    fwd = triton_forward(x, placed, routings[16], 1, TILES)
    want = triton_backward(fwd, dy).grads
    assert torch.equal(run.out, fwd.out)
    for name in ("dx", "dweights", "dw13", "dw2", "dshared_w13", "dshared_w2"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
