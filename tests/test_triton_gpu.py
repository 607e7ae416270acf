"""The persistent kernel on a CUDA device (``pytest -m gpu``; skipped without one).

Against the exact executor on the CPU: fp32 and bf16, EP 1-8, every policy, forward
and backward; 20 repeats bitwise equal (a difference would be a race); random start
delays per program; the deadline path; the stamps' timeline."""

import dataclasses

import numpy as np
import pytest
import torch

pytest.importorskip("triton")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

from hpmoe.engine import moe_forward  # noqa: E402
from hpmoe.exec.exact_backward import moe_forward_backward  # noqa: E402
from hpmoe.gpu.backend import TritonOptions, triton_backward, triton_forward  # noqa: E402
from hpmoe.gpu.runner import DeviceProgram  # noqa: E402
from hpmoe.routing import RoutingKind, synthetic_routing  # noqa: E402
from hpmoe.runtime.forensics import RegionError, WorkerStatus  # noqa: E402
from hpmoe.schedule import QUEUE_POLICIES, SchedulePolicy  # noqa: E402
from hpmoe.spec import ParallelSpec  # noqa: E402
from hpmoe.weights import ExpertWeights  # noqa: E402

from .helpers import GPU_SPEC as SPEC  # noqa: E402
from .helpers import GPU_TILES as TILES  # noqa: E402
from .helpers import GPU_TOKENS as TOKENS  # noqa: E402
from .helpers import GRAD_NAMES as GRADS  # noqa: E402
from .helpers import weights_on  # noqa: E402

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def _inputs(dtype, ep, seed):
    spec = SPEC.with_dtype(dtype)
    w = ExpertWeights.random(spec, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(ep * TOKENS, spec.hidden, generator=g).to(dtype)
    dy = torch.randn(ep * TOKENS, spec.hidden, generator=g).to(dtype)
    return x, w, synthetic_routing(RoutingKind.ZIPF, spec, ParallelSpec(ep, TOKENS), seed), dy


def _cuda(w: ExpertWeights, x, routing, dy):
    dev = torch.device("cuda")
    routing = dataclasses.replace(routing, weights=routing.weights.to(dev))
    return weights_on(w, dev), x.to(dev), routing, dy.to(dev)


CASES = [(dtype, ep, policy) for dtype in (torch.float32, torch.bfloat16) for ep in (1, 2, 4, 8)
         for policy in QUEUE_POLICIES]


@pytest.mark.parametrize("dtype,ep,policy", CASES,
                         ids=[f"{str(d)[6:]}-ep{e}-{p.name}" for d, e, p in CASES])
def test_forward_and_backward_match_the_exact_executors(dtype, ep, policy):
    x, w, routing, dy = _inputs(dtype, ep, ep)
    want = moe_forward_backward(x, w, routing, dy, ep, TILES)
    gw, gx, grouting, gdy = _cuda(w, x, routing, dy)
    fwd = triton_forward(gx, gw, grouting, ep, TILES, TritonOptions(policy=policy))
    torch.testing.assert_close(fwd.out.cpu(), want.out, **TOL[dtype])
    grads = triton_backward(fwd, gdy)
    for name in GRADS:
        got, ref = getattr(grads.grads, name).cpu(), getattr(want.backward.grads, name)
        if name.startswith("dshared") and dtype == torch.bfloat16:
            assert_rank_sum_close(got, ref, name)
        else:
            torch.testing.assert_close(got, ref, **TOL[dtype], msg=lambda m, n=name: f"{n}: {m}")
    assert fwd.info.launches == 1 and grads.info.launches == 1


def assert_rank_sum_close(got: torch.Tensor, ref: torch.Tensor, name: str) -> None:
    """A shared-expert gradient is a sum over ranks of bf16 partials: where they cancel, one
    partial rounded the other way (tensor cores and the CPU accumulate in different
    orders) moves an element by an ulp of the partial, not of the sum (seen on an H200:
    0.0625 on an element of 0.56, 1 of 65536).  Held to the norm: ||got - ref|| / ||ref||
    below 1e-2, the bf16 band, and no NaN."""
    assert not got.isnan().any(), f"{name}: NaN (an unwritten tile)"
    rel = float((got.double() - ref.double()).norm() / ref.double().norm())
    assert rel < 1e-2, f"{name}: relative error {rel:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_two_hundred_repeats_and_random_start_delays_give_the_same_bits(dtype):
    x, w, routing, _ = _inputs(dtype, 4, 3)
    gw, gx, grouting, _ = _cuda(w, x, routing, x)
    fwd = triton_forward(gx, gw, grouting, 4, TILES, TritonOptions(policy=SchedulePolicy.CRITICAL_PATH))
    first = fwd.out.clone()
    rng = np.random.default_rng(0)
    region = fwd.region
    for i in range(200):
        region.arena.bind("out", torch.full_like(first, float("nan")))
        delays = rng.integers(0, 200_000, region.program.packed.num_queues) if i % 2 else None
        region.run(delays_ns=delays)
        assert torch.equal(region.arena.gather("out"), first), f"repeat {i}"
    torch.testing.assert_close(first.cpu(), moe_forward(x, w, routing, 4, TILES), **TOL[dtype])


def test_a_threshold_that_is_never_reached_ends_in_the_hang_report():
    x, w, routing, _ = _inputs(torch.float32, 2, 5)
    gw, gx, grouting, _ = _cuda(w, x, routing, x)
    fwd = triton_forward(gx, gw, grouting, 2, TILES)
    packed = fwd.region.program.packed
    task = int(np.flatnonzero(packed.wait_event >= 0)[-1])
    threshold = packed.wait_threshold.copy()
    threshold[task] += 1_000_000
    stuck = DeviceProgram(dataclasses.replace(packed, wait_threshold=threshold), "cuda", torch.float32)
    with pytest.raises(RegionError) as err:
        stuck.run(fwd.region.arena.addresses(), deadline_s=0.2)
    waits = [r for r in err.value.report.workers if r.status is WorkerStatus.WAITS]
    assert [r.task for r in waits] == [packed.graph.task(task)]
    assert waits[0].threshold - waits[0].progress >= 1_000_000


def test_global_timer_stamps_become_a_timeline_that_respects_every_wait():
    x, w, routing, _ = _inputs(torch.bfloat16, 2, 6)
    gw, gx, grouting, _ = _cuda(w, x, routing, x)
    fwd = triton_forward(gx, gw, grouting, 2, TILES, TritonOptions(stamps=True))
    tl = fwd.region.program.timeline(fwd.info.stamps)
    g = fwd.region.schedule.graph
    assert (tl.end >= tl.start).all() and tl.makespan > 0
    waits = g.wait_global()
    for s, ev in zip(g.signaller(), g.signals_global(), strict=True):
        assert (tl.start[waits == ev] >= tl.end[s]).all(), g.task(int(s))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_by_kernels_one_launch_combine_gives_the_cpus_bits(dtype):
    """The GPU's combines (``hpmoe.gpu.phases``, what kernel by kernel runs on CUDA)
    against the torch ones on the CPU: the same fp32 products and sums in the same order
    give the same bits (an FMA would not); the weights' gradient sums in another order."""
    from hpmoe.exec.arena import Arena
    from hpmoe.exec.phases import slot_sum, weighted_sum, weighted_sum_backward
    from hpmoe.gpu.phases import slot_combine, slot_combine_backward

    g = torch.Generator().manual_seed(5)
    t, k, h = 300, 8, 1000
    rows = torch.randn(t * k, h, generator=g).to(dtype)
    pos = torch.randperm(t * k, generator=g).view(t, k)
    w = torch.rand(t, k, generator=g)
    extra = torch.randn(t, h, generator=g).to(dtype)
    dev = [a.cuda() for a in (rows, pos, w, extra)]
    assert torch.equal(slot_combine(*dev).cpu(), weighted_sum(rows, pos, w, extra, Arena("cpu")))
    unweighted = slot_combine(dev[0], dev[1], None, dev[3]).cpu()
    assert torch.equal(unweighted, slot_sum(rows, pos, extra, Arena("cpu")))
    dout = torch.randn(t, h, generator=g)
    dw, drows = slot_combine_backward(dout.cuda(), *dev[:3])
    want_dw, want_drows = weighted_sum_backward(dout, rows, pos, w, Arena("cpu"))
    assert torch.equal(drows.cpu(), want_drows)
    torch.testing.assert_close(dw.cpu(), want_dw, rtol=1e-5, atol=1e-5 * h ** 0.5)
