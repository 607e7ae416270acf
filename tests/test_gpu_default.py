"""The default path on a CUDA device (``pytest -m gpu``; skipped without one): its
one-launch phases against torch's, a training step without a host sync, the whole step
captured in a CUDA graph and replayed on new inputs and routings, recycled memory
poisoned with NaN, the deferred input check, and an NCCL group of one rank."""

import multiprocessing
import os
import tempfile

import pytest
import torch

pytest.importorskip("triton")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

from hpmoe import MoE  # noqa: E402
from hpmoe.exec.arena import Arena  # noqa: E402
from hpmoe.exec.phases import TORCH  # noqa: E402
from hpmoe.gpu.phases import TRITON  # noqa: E402
from hpmoe.refs import dense_moe  # noqa: E402
from hpmoe.routing import Routing, RoutingKind, synthetic_routing  # noqa: E402
from hpmoe.spec import Activation, GluForm, MoESpec, ParallelSpec  # noqa: E402
from hpmoe.weights import ExpertWeights  # noqa: E402

CUDA = torch.device("cuda")
SPEC = MoESpec(hidden=256, ffn=128, experts=16, top_k=4, shared_experts=1, dtype=torch.bfloat16)
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def _weights(spec: MoESpec = SPEC) -> ExpertWeights:
    w = ExpertWeights.random(spec, 0)
    return ExpertWeights(spec, *(t.to(CUDA) if isinstance(t, torch.Tensor) else t
                                 for t in (w.router, w.router_bias, w.w13, w.w2, w.shared_w13, w.shared_w2)))


def _step_inputs(seed: int, tokens: int = 96, kind: RoutingKind = RoutingKind.ZIPF):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, SPEC.hidden, generator=g).to(SPEC.dtype)
    r = synthetic_routing(kind, SPEC, ParallelSpec(1, tokens), seed)
    return x.to(CUDA), r.ids.to(CUDA), r.weights.to(CUDA)


def _poison_free_memory() -> None:
    """Fill memory the caching allocator will hand out again with NaN."""
    torch.empty(1 << 26, dtype=torch.float32, device=CUDA).fill_(float("nan"))
    torch.cuda.synchronize()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_one_launch_phases_against_torchs_on_the_device(dtype):
    g = torch.Generator(device=CUDA).manual_seed(0)
    t, k, h, f = 77, 6, 384, 200
    x = torch.randn(t, h, generator=g, device=CUDA).to(dtype)
    order = torch.randperm(t * k, generator=g, device=CUDA)
    rows = {p: p.permute(x, order, k, torch.empty(t * k, h, dtype=dtype, device=CUDA))
            for p in (TORCH, TRITON)}
    assert torch.equal(rows[TRITON], rows[TORCH])
    hh = (torch.randn(t * k, 2 * f, generator=g, device=CUDA) * 3).to(dtype)
    da = torch.randn(t * k, f, generator=g, device=CUDA).to(dtype)
    out = {p: torch.empty(t * k, f, dtype=dtype, device=CUDA) for p in (TORCH, TRITON)}
    dh = {p: torch.empty(t * k, 2 * f, dtype=dtype, device=CUDA) for p in (TORCH, TRITON)}
    for p in (TORCH, TRITON):
        p.glu(hh, out[p], Activation.SILU, GluForm())
        p.glu_backward(hh, da, dh[p], Activation.SILU, None, GluForm())
    torch.testing.assert_close(out[TRITON], out[TORCH], **TOL[dtype])
    torch.testing.assert_close(dh[TRITON], dh[TORCH], **TOL[dtype])
    wr = torch.rand(t * k, generator=g, device=CUDA)
    router = {}
    for p in (TORCH, TRITON):
        dh_, aw = (torch.empty(t * k, n, dtype=dtype, device=CUDA) for n in (2 * f, f))
        router[p] = (dh_, aw, p.glu_router_backward(hh, da, wr, dh_, aw, Activation.SILU, GluForm()))
    for a, b in zip(router[TRITON], router[TORCH], strict=True):
        torch.testing.assert_close(a, b, **TOL[dtype])
    pos, w = order.view(t, k), torch.rand(t, k, generator=g, device=CUDA)
    sums = {p: p.weighted_sum(rows[p], pos, w, None, Arena(CUDA)) for p in (TORCH, TRITON)}
    torch.testing.assert_close(sums[TRITON], sums[TORCH], **TOL[dtype])


def test_a_training_step_makes_no_host_sync():
    layer = MoE(SPEC, _weights())
    for step in range(3):  # the first step chooses the path and allocates
        x, ids, tw = _step_inputs(step)
        xl, wl = x.requires_grad_(), tw.requires_grad_()
        if step:
            torch.cuda.set_sync_debug_mode("error")
        try:
            out = layer.region(xl, ids, wl)
            torch.autograd.grad(out, [xl, wl, *layer.parameters()], torch.ones_like(out), allow_unused=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert type(layer.last_call.path).__name__ == "KernelByKernelPath"


def test_a_graph_captured_step_replays_new_inputs_and_routings_as_eager_runs_them():
    w = _weights()
    layer = MoE(SPEC, w)
    x, ids, tw = _step_inputs(0)
    xs, idss, tws = x.clone().requires_grad_(), ids.clone(), tw.clone().requires_grad_()
    params = list(layer.parameters())

    def step():
        out = layer.region(xs, idss, tws)
        return (out, *torch.autograd.grad(out, [xs, tws, *params], torch.ones_like(out), allow_unused=True))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    _poison_free_memory()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    eager = MoE(SPEC, w)
    for seed in range(1, 5):
        kind = RoutingKind.HOT if seed == 3 else RoutingKind.ZIPF  # one expert takes every token's first slot
        x, ids, tw = _step_inputs(seed, kind=kind)
        with torch.no_grad():
            xs.copy_(x), idss.copy_(ids), tws.copy_(tw)
        _poison_free_memory()
        graph.replay()
        xe, twe = x.clone().requires_grad_(), tw.clone().requires_grad_()
        out = eager.region(xe, ids, twe)
        want = (out, *torch.autograd.grad(out, [xe, twe, *eager.parameters()], torch.ones_like(out),
                                          allow_unused=True))
        for got, ref in zip(static, want, strict=True):
            if ref is not None:
                assert not torch.isnan(got).any()
                torch.testing.assert_close(got, ref, **TOL[SPEC.dtype])
        ref = dense_moe(x, w, Routing(ids, tw))
        torch.testing.assert_close(static[0], ref, **TOL[SPEC.dtype])


def test_a_fault_reaches_the_host_one_call_late_without_a_sync():
    layer = MoE(SPEC, _weights())
    x, ids, tw = _step_inputs(0)
    layer.region(x, ids, tw)
    bad = x.clone()
    bad[41, 7] = float("nan")
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer.region(bad, ids, tw)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match=r"x has NaN at row 41 \(found by the device-side input check"):
        layer.region(x, ids, tw)
    ids2 = ids.clone()
    ids2[5, 2] = 40
    layer.region(x, ids2, tw)  # clamped: no device-side assert
    with pytest.raises(ValueError, match=r"routing.ids contains expert id 40, outside \[0, 16\)"):
        layer.check()


def test_a_fault_in_a_replayed_step_is_raised_by_check():
    """A captured forward copies no verdict to the host (a capture records no host copy):
    a NaN a replay finds stays on the device until ``check`` reads it."""
    layer = MoE(SPEC, _weights())
    x, ids, tw = _step_inputs(0)
    xs = x.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            layer.region(xs, ids, tw)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer.region(xs, ids, tw)
    graph.replay()
    layer.check()  # nothing found
    xs[23, 5] = float("nan")
    graph.replay()
    with pytest.raises(ValueError, match=r"x has NaN at row 23"):
        layer.check()


def test_a_model_compiled_with_reduce_overhead_trains_as_eager_on_new_routings():
    """``torch.compile(mode="reduce-overhead")`` (inductor, CUDA graphs) over a model
    holding the layer: steps on new inputs (so new routings, its own router's) give the
    eager model's output and gradients."""
    import copy

    torch._dynamo.reset()
    w = _weights()
    model = torch.nn.Sequential(torch.nn.Linear(SPEC.hidden, SPEC.hidden, device=CUDA, dtype=SPEC.dtype),
                                MoE(SPEC, w))
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    g = torch.Generator().manual_seed(11)
    for step in range(5):
        x = torch.randn(96, SPEC.hidden, generator=g).to(CUDA, SPEC.dtype)
        torch.compiler.cudagraph_mark_step_begin()
        out = compiled(x)
        out.float().square().mean().backward()
        want = eager(x)
        want.float().square().mean().backward()
        torch.testing.assert_close(out, want, **TOL[SPEC.dtype], msg=f"step {step}")
        for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, **TOL[SPEC.dtype], msg=f"step {step}: {name}")
            p.grad, q.grad = None, None


def _nccl_rank(path: str, results) -> None:
    import torch.distributed as dist

    try:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", init_method=f"file://{path}", rank=0, world_size=1)
        w = _weights()
        x, ids, tw = _step_inputs(7)
        grads = []
        for group in (dist.group.WORLD, None):
            layer = MoE(SPEC, w, ep_group=group)
            xl, wl = x.clone().requires_grad_(), tw.clone().requires_grad_()
            out = layer.region(xl, ids, wl)
            leaves = [xl, wl, layer.experts.gate_up_proj]
            grads.append([t.cpu() for t in (out, *torch.autograd.grad(out, leaves, torch.ones_like(out)))])
            layer.close()
        dist.destroy_process_group()
        results.put(("ok", grads))
    except Exception as err:  # reported in the parent
        results.put(("error", f"{type(err).__name__}: {err}"))


def test_an_nccl_group_of_one_rank_gives_the_layer_without_a_group():
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        proc = ctx.Process(target=_nccl_rank, args=(os.path.join(tmp, "init"), results))
        proc.start()
        status, payload = results.get(timeout=240)
        proc.join(timeout=60)
    assert status == "ok", payload
    grouped, alone = payload
    for a, b in zip(grouped, alone, strict=True):
        torch.testing.assert_close(a, b, **TOL[SPEC.dtype])


def test_a_layer_built_under_a_cuda_default_device_holds_the_cpu_draws_there():
    with torch.device(CUDA):
        layer = MoE(SPEC, seed=3)
    want = MoE(SPEC, seed=3).state_dict()
    got = layer.state_dict()
    assert {t.device.type for t in got.values()} == {"cuda"}
    for name, value in want.items():
        torch.testing.assert_close(got[name].cpu(), value, atol=0, rtol=0, msg=name)
