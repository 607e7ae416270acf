"""The per-shape persistent program on a CUDA device (``pytest -m gpu``; skipped without
one): one program, built once, its forward and backward launched without a host sync for
20 routings of a shape (the ids on the device), each bitwise equal to the per-routing
kernels; repeats of one routing give the same bits (a difference would be a race)."""

import dataclasses

import pytest
import torch

pytest.importorskip("triton")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

from hpmoe.gpu.backend import TritonOptions, triton_backward, triton_forward  # noqa: E402
from hpmoe.gpu.slots import PlanCache  # noqa: E402
from hpmoe.schedule import QUEUE_POLICIES  # noqa: E402
from hpmoe.weights import ExpertWeights  # noqa: E402

from .helpers import GPU_SPEC as SPEC  # noqa: E402
from .helpers import GPU_TILES as TILES  # noqa: E402
from .helpers import GPU_TOKENS as TOKENS  # noqa: E402
from .helpers import GRAD_NAMES as GRADS  # noqa: E402
from .helpers import weights_on  # noqa: E402
from .slot_routings import twenty_routings  # noqa: E402

FULL = [[64] * 4 + [0] * 12, [0] * 12 + [64] * 4]  # every token on the same four experts
SKEWED = [[16] * 16, [64, 64, 32, 32, 16, 16, 8, 8, 4, 4, 2, 2, 1, 1, 1, 1], [33] * 7 + [25] + [0] * 8]


def _on(dev: torch.device, w: ExpertWeights, x: torch.Tensor, routings: list) -> tuple:
    rs = [dataclasses.replace(r, ids=r.ids.to(dev), weights=r.weights.to(dev)) for r in routings]
    return weights_on(w, dev), x.to(dev), rs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("policy", QUEUE_POLICIES, ids=lambda p: p.name)
def test_one_program_launched_without_a_sync_serves_twenty_routings(dtype, policy):
    spec = SPEC.with_dtype(dtype)
    g = torch.Generator().manual_seed(1)
    x, dy = (torch.randn(TOKENS, spec.hidden, generator=g).to(dtype).cuda() for _ in range(2))
    w, x, routings = _on(torch.device("cuda"), ExpertWeights.random(spec, 0), x,
                         twenty_routings(spec, TOKENS, FULL, SKEWED))
    cache, options = PlanCache(), TritonOptions(policy=policy)
    for i, r in enumerate(routings):
        program = cache.program(x, w, r, TILES, options)
        launched = program.launch(x, w, r)
        back = program.launch_backward(launched, dy, w, r)
        torch.cuda.synchronize()
        assert int(launched.errors[:, 0].sum()) == 0 and int(back.errors[:, 0].sum()) == 0, i
        fwd = triton_forward(x, w, r, 1, TILES, options)
        want = triton_backward(fwd, dy).grads
        assert torch.equal(launched.out, fwd.out), i
        for name in GRADS:
            assert torch.equal(getattr(back.grads, name), getattr(want, name)), (i, name)
        checked = program.forward(x, w, r)
        assert torch.equal(checked.out, fwd.out), i
        assert torch.equal(program.backward(checked, dy, w, r).grads.dx, want.dx), i
    assert cache.builds == 1


def test_twenty_launches_of_one_routing_give_the_same_bits():
    x = torch.randn(TOKENS, SPEC.hidden, generator=torch.Generator().manual_seed(2))
    w, x, routings = _on(torch.device("cuda"), ExpertWeights.random(SPEC, 1), x,
                         twenty_routings(SPEC, TOKENS, FULL, SKEWED))
    program = PlanCache().program(x, w, routings[5], TILES, TritonOptions())
    first = program.launch(x, w, routings[5]).out
    for _ in range(20):
        again = program.launch(x, w, routings[5])
        torch.cuda.synchronize()
        assert torch.equal(again.out, first) and int(again.errors[:, 0].sum()) == 0


@pytest.mark.parametrize("kind", ["balanced", "zipf", "hot"])
def test_the_slot_resolution_launched_on_the_gpu_gives_the_torch_integers(kind):
    """Qwen3-30B-A3B's 4096 tokens (32,768 ids, 32 blocks, 128 experts) resolved by the
    three launches against the torch sort on the same device, without a host read."""
    from hpmoe.gpu.phases import resolve_slots
    from hpmoe.regions.slot_routing import resolve_slots as torch_resolve_slots
    from hpmoe.regions.slots import SlotShape
    from hpmoe.routing import RoutingKind, synthetic_routing
    from hpmoe.spec import ParallelSpec, TileSpec, preset

    spec = preset("qwen3-30b-a3b", torch.bfloat16)
    shape = SlotShape(spec, 4096, TileSpec(rows=64, gemm_rows=128, gemm_cols=128))
    ids = synthetic_routing(RoutingKind(kind), spec, ParallelSpec(1, 4096), 3).ids.cuda()
    with torch.cuda.device(ids.device):
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = resolve_slots(ids, shape)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    want = torch_resolve_slots(ids, shape)
    for field in ("counts", "first", "slot_expert", "slot_rows", "pos", "row_token"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field


def test_a_triton_layer_steps_on_new_routings_without_a_host_sync():
    """``hpmoe.MoE(backend="triton")`` on its per-shape program: after a first step (the
    program built, the kernels compiled), forward and backward on new routings make no
    synchronising call, give the dense reference's output and gradient, and ``check``
    then finds no late wait."""
    from hpmoe import MoE
    from hpmoe.engine.paths import TritonPath
    from hpmoe.refs import dense_moe

    cuda = torch.device("cuda")
    w = weights_on(ExpertWeights.random(SPEC, 0), cuda)
    layer = MoE(SPEC, w, tiles=TILES, backend="triton")
    g = torch.Generator().manual_seed(3)
    for i, r in enumerate(twenty_routings(SPEC, TOKENS, FULL, SKEWED)[::4]):
        x = torch.randn(TOKENS, SPEC.hidden, generator=g).cuda().requires_grad_()
        ids, tw, dy = r.ids.cuda(), r.weights.cuda(), torch.randn(TOKENS, SPEC.hidden, generator=g).cuda()
        if i:
            torch.cuda.set_sync_debug_mode("error")
        try:
            out = layer.region(x, ids, tw)
            (dx,) = torch.autograd.grad(out, [x], dy)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert isinstance(layer.last_call.path, TritonPath), layer.last_call.path
        xr = x.detach().clone().requires_grad_()
        want = dense_moe(xr, w, dataclasses.replace(r, ids=ids, weights=tw))
        (want_dx,) = torch.autograd.grad(want, [xr], dy)
        torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(dx, want_dx, atol=1e-4, rtol=1e-4)
    layer.check()


def test_a_captured_step_replays_on_new_routings_with_the_eager_bits():
    """Forward and backward launches of one program captured in a CUDA graph over static
    x, ids, routing weights and dy: each replay, after new ids and weights are copied into
    the static ones, gives the per-routing kernels' bits (a launch is call 0 each time; the
    address table the capture used stays with the program)."""
    from hpmoe.routing import Routing

    cuda = torch.device("cuda")
    g = torch.Generator().manual_seed(4)
    x, dy = (torch.randn(TOKENS, SPEC.hidden, generator=g).cuda() for _ in range(2))
    w, x, routings = _on(cuda, ExpertWeights.random(SPEC, 2), x, twenty_routings(SPEC, TOKENS, FULL, SKEWED))
    static = Routing(routings[0].ids.clone(), routings[0].weights.clone())
    program = PlanCache().program(x, w, static, TILES, TritonOptions())
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm: both kernels compiled, the backward region built
        program.launch_backward(program.launch(x, w, static), dy, w, static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launched = program.launch(x, w, static)
        back = program.launch_backward(launched, dy, w, static)
    for i in (3, 9, 12, 16, 2):
        static.ids.copy_(routings[i].ids)
        static.weights.copy_(routings[i].weights)
        graph.replay()
        torch.cuda.synchronize()
        assert int(launched.errors[:, 0].sum()) == 0 and int(back.errors[:, 0].sum()) == 0, i
        fwd = triton_forward(x, w, routings[i], 1, TILES)
        want = triton_backward(fwd, dy).grads
        assert torch.equal(launched.out, fwd.out), i
        for name in GRADS:
            assert torch.equal(getattr(back.grads, name), getattr(want, name)), (i, name)


def test_a_triton_layers_step_captured_in_a_cuda_graph_gives_eagers_results():
    """``torch.cuda.graph`` around forward and backward of ``hpmoe.MoE(backend="triton")``
    (after eager warm-up steps): replays on new x, ids and weights copied into the static
    inputs give the eager layer's output and input gradient."""
    from hpmoe import MoE

    cuda = torch.device("cuda")
    w = weights_on(ExpertWeights.random(SPEC, 0), cuda)
    layer, eager = (MoE(SPEC, w, tiles=TILES, backend="triton") for _ in range(2))
    routings = twenty_routings(SPEC, TOKENS, FULL, SKEWED)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(TOKENS, SPEC.hidden, generator=g).cuda().requires_grad_()
    ids, tw = routings[0].ids.cuda(), routings[0].weights.cuda()
    dy = torch.randn(TOKENS, SPEC.hidden, generator=g).cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            torch.autograd.grad(layer.region(x, ids, tw), [x], dy)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer.region(x, ids, tw)
        (dx,) = torch.autograd.grad(out, [x], dy)
    for i in (4, 9, 12, 16):
        with torch.no_grad():
            x.copy_(torch.randn(TOKENS, SPEC.hidden, generator=g))
            ids.copy_(routings[i].ids)
            tw.copy_(routings[i].weights)
        graph.replay()
        xe = x.detach().clone().requires_grad_()
        want = eager.region(xe, ids.clone(), tw.clone())
        (want_dx,) = torch.autograd.grad(want, [xe], dy)
        torch.cuda.synchronize()
        assert torch.equal(out, want), i
        assert torch.equal(dx, want_dx), i
    layer.check()
