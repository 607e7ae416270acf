"""The whole forward and backward taskflows as one persistent kernel, in the Triton
interpreter's rounds mode, against the exact executors (``moe_forward`` and the exact
backward, themselves checked against the dense reference and autograd)."""

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from hpmoe.engine import moe_forward  # noqa: E402
from hpmoe.exec.exact_backward import moe_forward_backward  # noqa: E402
from hpmoe.gpu.backend import TritonOptions, triton_backward, triton_forward  # noqa: E402
from hpmoe.gpu.buffers import buffer_space  # noqa: E402
from hpmoe.gpu.pack import pack  # noqa: E402
from hpmoe.gpu.runner import DeviceProgram  # noqa: E402
from hpmoe.ir.analysis import GraphError  # noqa: E402
from hpmoe.routing import RoutingKind, synthetic_routing  # noqa: E402
from hpmoe.runtime.forensics import WorkerStatus  # noqa: E402
from hpmoe.schedule import QUEUE_POLICIES, SchedulePolicy, WorkerCounts, schedule_from_assignment  # noqa: E402
from hpmoe.sim.trace import chrome_trace  # noqa: E402
from hpmoe.spec import ParallelSpec, TileSpec, preset  # noqa: E402
from hpmoe.weights import ExpertWeights  # noqa: E402

TILES = TileSpec(rows=4, gemm_rows=8, gemm_cols=16)
TOKENS = 8
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
GRADS = ("dx", "dweights", "dw13", "dw2", "dshared_w13", "dshared_w2")


def _inputs(dtype, ep, seed, kind=RoutingKind.ZIPF):
    spec = preset("tiny").with_dtype(dtype)
    w = ExpertWeights.random(spec, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(ep * TOKENS, spec.hidden, generator=g).to(dtype)
    dy = torch.randn(ep * TOKENS, spec.hidden, generator=g).to(dtype)
    return x, w, synthetic_routing(kind, spec, ParallelSpec(ep, TOKENS), seed), dy


CASES = [(ep, policy, 10 * ep + i) for ep in (1, 2, 4) for i, policy in enumerate(QUEUE_POLICIES)]


@pytest.mark.parametrize("ep,policy,seed", CASES, ids=[f"ep{e}-{p.name}-seed{s}" for e, p, s in CASES])
def test_forward_and_backward_match_the_exact_executors(ep, policy, seed):
    x, w, routing, dy = _inputs(torch.float32, ep, seed)
    fwd = triton_forward(x, w, routing, ep, TILES, TritonOptions(policy=policy))
    assert not fwd.out.isnan().any()
    torch.testing.assert_close(fwd.out, moe_forward(x, w, routing, ep, TILES), **TOL[torch.float32])
    grads = triton_backward(fwd, dy, recompute=seed % 2 == 1)
    want = moe_forward_backward(x, w, routing, dy, ep, TILES).backward.grads
    for name in GRADS:
        got = getattr(grads.grads, name)
        assert not got.isnan().any(), name
        torch.testing.assert_close(got, getattr(want, name), **TOL[torch.float32], msg=name)
    assert fwd.info.launches > 1 and grads.info.launches > 1  # rounds: waits did block


def test_bf16_forward_and_backward_match_within_bf16_tolerance():
    x, w, routing, dy = _inputs(torch.bfloat16, 2, 7, RoutingKind.BALANCED)
    fwd = triton_forward(x, w, routing, 2, TILES, TritonOptions(policy=SchedulePolicy.CRITICAL_PATH))
    torch.testing.assert_close(fwd.out, moe_forward(x, w, routing, 2, TILES), **TOL[torch.bfloat16])
    grads = triton_backward(fwd, dy)
    want = moe_forward_backward(x, w, routing, dy, 2, TILES).backward.grads
    for name in GRADS:
        torch.testing.assert_close(getattr(grads.grads, name), getattr(want, name), **TOL[torch.bfloat16],
                                   msg=name)


def test_every_call_starts_the_counters_from_zero_and_gives_the_first_calls_bits():
    x, w, routing, _ = _inputs(torch.float32, 2, 3)
    fwd = triton_forward(x, w, routing, 2, TILES)
    first = fwd.out.clone()
    region = fwd.region
    p = region.program.packed
    step = np.bincount(p.sig_event, minlength=p.num_events)
    for _ in range(2):
        region.arena.rank_view("out", 0).fill_(float("nan"))
        region.run()
        assert torch.equal(region.arena.gather("out"), first)
        assert np.array_equal(region.program.counters.numpy()[:p.num_events], step)
    with pytest.warns(DeprecationWarning, match="RunInfo.epoch"):
        assert region.run().epoch == 0  # the retired call number: every call is call 0 of its counters


def test_a_queue_order_against_the_events_raises_a_cycle_error_naming_the_stuck_tasks():
    x, w, routing, _ = _inputs(torch.float32, 2, 5)
    fwd = triton_forward(x, w, routing, 2, TILES)
    g = fwd.region.schedule.graph
    workers = WorkerCounts(1, 1)
    backwards = schedule_from_assignment(g, SchedulePolicy.SERIAL, workers, np.zeros(g.num_tasks),
                                         -np.arange(g.num_tasks))  # every queue in reverse task order
    program = DeviceProgram(pack(backwards, buffer_space(fwd.plan)), "cpu", torch.float32)
    with pytest.raises(GraphError, match=r"no queue advanced(.|\n)*rank 0 matrix worker 0: task \d+"):
        program.run(fwd.region.arena.addresses())


def test_stamps_become_a_timeline_that_respects_every_wait():
    x, w, routing, _ = _inputs(torch.float32, 2, 9)
    fwd = triton_forward(x, w, routing, 2, TILES, TritonOptions(stamps=True))
    tl = fwd.region.program.timeline(fwd.info.stamps)
    g = fwd.region.schedule.graph
    assert tl.num_tasks == g.num_tasks and (tl.end > tl.start).all()
    assert np.array_equal(tl.worker, fwd.region.schedule.worker)
    waits = g.wait_global()
    signaller = g.signaller()
    for s, ev in zip(signaller, g.signals_global(), strict=True):
        waiting = np.flatnonzero(waits == ev)
        assert (tl.start[waiting] > tl.end[s]).all(), g.task(int(s))
    trace = chrome_trace(tl)
    assert sum(e.get("ph") == "X" for e in trace["traceEvents"]) == g.num_tasks
    assert tl.start.min() == 0
    late = fwd.region.program.timeline(fwd.info.stamps + 1_795_677_183_000_000)  # a GPU's global timer
    assert np.array_equal(late.start, tl.start) and np.array_equal(late.end, tl.end)


def test_a_late_wait_on_the_device_becomes_the_runtimes_hang_report():
    """The host side of the deadline path: the error rows a late wait writes on a GPU."""
    x, w, routing, _ = _inputs(torch.float32, 2, 4)
    fwd = triton_forward(x, w, routing, 2, TILES)
    program, p = fwd.region.program, fwd.region.program.packed
    task = int(np.flatnonzero(p.wait_event >= 0)[0])
    pos = int(np.flatnonzero(p.queue_task == task)[0])
    q = int(np.searchsorted(p.queue_ptr, pos, side="right") - 1)
    errors = np.zeros((p.num_queues, 4), np.int32)
    seen = int(p.wait_threshold[task]) - 1
    errors[q] = (1, task, p.wait_event[task], seen)
    cursor = np.diff(p.queue_ptr).copy()
    cursor[q] = pos - p.queue_ptr[q]
    report = program.hang_report(errors, cursor, 1.5)
    late = report.workers[q]
    assert late.status is WorkerStatus.WAITS and late.task == p.graph.task(task)
    assert late.threshold - late.progress == 1
    assert str(report).count("waits") == 1 and "deadline" in report.cause


def test_bad_options_are_refused():
    with pytest.raises(TypeError, match="policy"):
        TritonOptions(policy="serial")
    with pytest.raises(ValueError, match="deadline_s"):
        TritonOptions(deadline_s=0)
    x, w, routing, _ = _inputs(torch.float32, 2, 1)
    with pytest.raises(ValueError, match="ep=3"):
        triton_forward(x, w, routing, 3, TILES)
    fwd = triton_forward(x, w, routing, 2, TILES)
    with pytest.raises(ValueError, match="dy must be"):
        triton_backward(fwd, torch.zeros(3, 3))
    with pytest.raises(ValueError, match="addresses"):
        fwd.region.program.run(torch.zeros(3, dtype=torch.int64))


def test_moe_forward_and_the_moe_layer_take_backend_triton():
    import hpmoe
    x, w, routing, dy = _inputs(torch.float32, 2, 11)
    got = hpmoe.moe_forward(x, w, routing, 2, TILES, backend="triton")
    torch.testing.assert_close(got, moe_forward(x, w, routing, 2, TILES), **TOL[torch.float32])
    with pytest.raises(ValueError, match="backend='cuda'"):
        hpmoe.moe_forward(x, w, routing, 2, TILES, backend="cuda")
    layers = [hpmoe.MoE(w.spec, w, virtual_ep=2, tiles=TILES, backend=b) for b in ("exact", "triton")]
    grads = []
    for layer in layers:
        xi = x.clone().requires_grad_()
        out = layer(xi)
        out.backward(dy)
        grads.append((out.detach(), xi.grad, layer.experts.gate_up_proj.grad, layer.gate.weight.grad))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, **TOL[torch.float32])
    with pytest.raises(ValueError, match="SchedulePolicy"):
        hpmoe.MoE(w.spec, w, schedule=3, backend="triton")
