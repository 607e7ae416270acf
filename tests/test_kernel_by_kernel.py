"""The kernel-by-kernel path against refs.py and autograd, in one process and on ranks."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from hpmoe.engine import KernelByKernelPath, RegionCall, RegionFunction, run
from hpmoe.exec.arena import Arena, ArenaPool
from hpmoe.exec.kernel_by_kernel import (
    ExpertGrads,
    Experts,
    GemmPath,
    Groups,
    Permutation,
    experts_backward,
    experts_forward,
    gemm_path,
    kbk_backward,
    kbk_forward,
    segments,
)
from hpmoe.exec.phases import slot_sum, weighted_sum, weighted_sum_backward
from hpmoe.refs import dense_moe, serialized_ep_forward
from hpmoe.routing import Routing, RoutingKind, synthetic_routing
from hpmoe.spec import Activation, ParallelSpec, Recompute, preset
from hpmoe.testing import spawn_gloo
from hpmoe.weights import ExpertWeights

from .helpers import GPT_OSS_FORM

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=5e-2, rtol=2e-2)}


def _inputs(dtype: torch.dtype, kind: RoutingKind, tokens: int, ep: int = 1, name: str = "tiny"):
    spec = preset(name, dtype)
    routing = synthetic_routing(kind, spec, ParallelSpec(ep, tokens), seed=3)
    n = ep * tokens
    # rows reveal their token: row t is (t + 1) / n plus a little noise
    noise = torch.randn(n, spec.hidden, generator=torch.Generator().manual_seed(5))
    x = ((torch.arange(n)[:, None] + 1.0) / n + 0.1 * noise).to(dtype)
    return x, routing, ExpertWeights.random(spec, seed=4)


def _autograd_grads(x, routing, weights, dy):
    leaves = [x.clone().requires_grad_(), routing.weights.clone().requires_grad_(),
              *(t.clone().requires_grad_() for t in (weights.w13, weights.w2, weights.shared_w13,
                                                      weights.shared_w2))]
    w = ExpertWeights(weights.spec, weights.router, weights.router_bias, *leaves[2:])
    out = dense_moe(leaves[0], w, Routing(routing.ids, leaves[1]))
    return torch.autograd.grad(out, leaves, dy)


def _assert_grads(names, mine, ref, x, routing, weights, dy) -> None:
    """Gradients against autograd through the dense reference (``ref``): fp32 within
    TOL; bf16, where kernel by kernel and autograd round at other places, within twice
    autograd's own bf16 error of the fp32 gradient (and an ulp of the largest)."""
    if x.dtype == torch.float32:
        for name, a, b in zip(names, mine, ref, strict=True):
            torch.testing.assert_close(a, b, **TOL[torch.float32], msg=name)
        return
    names32 = ("w13", "w2", "shared_w13", "shared_w2")
    wide = dataclasses.replace(weights, spec=weights.spec.with_dtype(torch.float32),
                               **{n: getattr(weights, n).float() for n in names32})
    truth = _autograd_grads(x.float(), routing, wide, dy.float())
    for name, a, b, t in zip(names, mine, ref, truth, strict=True):
        err, theirs = (float((v.float() - t).abs().max()) for v in (a, b))
        assert err <= 2 * theirs + 2**-8 * float(t.abs().max()), f"{name}: {err} against autograd's {theirs}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_biases_and_the_clamped_glu_match_autograd(dtype: torch.dtype) -> None:
    spec = GPT_OSS_FORM.with_dtype(dtype)
    w = ExpertWeights.random(spec, seed=4)
    routing = synthetic_routing(RoutingKind.ZIPF, spec, ParallelSpec(1, 24), seed=3)
    x = torch.randn(24, spec.hidden, generator=torch.Generator().manual_seed(5)).to(dtype)
    out, state = kbk_forward(x, routing, w, save=True)
    torch.testing.assert_close(out, dense_moe(x, w, routing), **TOL[dtype])
    dy = torch.randn_like(out)
    g = kbk_backward(state, dy)
    names = ("w13", "w2", "b13", "b2")
    leaves = [x.clone().requires_grad_(), routing.weights.clone().requires_grad_(),
              *(getattr(w, n).clone().requires_grad_() for n in names)]
    ref = dense_moe(leaves[0], dataclasses.replace(w, **dict(zip(names, leaves[2:], strict=True))),
                    Routing(routing.ids, leaves[1]))
    want = torch.autograd.grad(ref, leaves, dy)
    for name, a, b in zip(("dx", "dweights", "dw13", "dw2", "db13", "db2"),
                          (g.dx, g.dweights, g.dw13, g.dw2, g.db13, g.db2), want, strict=True):
        torch.testing.assert_close(a, b, **TOL[dtype], msg=name)


def test_groups_give_the_per_expert_segments_and_grouped_offsets() -> None:
    counts = [3, 0, 0, 5, 1]
    groups = Groups(torch.tensor(counts))
    assert groups.segments == segments(counts) == [(0, 0, 3), (3, 3, 8), (4, 8, 9)]
    assert groups.offsets().tolist() == [3, 3, 3, 8, 9] and groups.offsets().dtype == torch.int32
    assert Groups.one(7).segments == [(0, 0, 7)]


def test_expert_gemms_give_grouped_mm_bits() -> None:
    a, w13, w2 = (torch.randn(shape).bfloat16() for shape in ((11, 16), (3, 48, 16), (3, 16, 24)))
    counts = [4, 0, 7]
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    ex = Experts(w13, w2, (0, 1, 2), Activation.SILU)
    h, act, y = experts_forward(a, Groups(torch.tensor(counts)), ex, Arena("cpu"), "")
    assert torch.equal(h, F.grouped_mm(a, w13.transpose(1, 2), offs=offs))
    assert torch.equal(y, F.grouped_mm(act, w2.transpose(1, 2), offs=offs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", [RoutingKind.ZIPF, RoutingKind.EMPTY_EXPERTS])
def test_one_process_matches_the_reference_and_autograd(dtype: torch.dtype, kind: RoutingKind) -> None:
    x, routing, w = _inputs(dtype, kind, tokens=24)
    pool = ArenaPool()
    out, state = kbk_forward(x, routing, w, pool=pool, save=True)
    assert torch.equal(out, dense_moe(x, w, routing))  # same GEMM shapes, same combine order
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(8)).to(dtype)
    g = kbk_backward(state, dy)
    ref = _autograd_grads(x, routing, w, dy)
    mine = (g.dx, g.dweights, g.dw13, g.dw2, g.dshared_w13, g.dshared_w2)
    names = ("dx", "dweights", "dw13", "dw2", "dshared_w13", "dshared_w2")
    _assert_grads(names, mine, ref, x, routing, w, dy)
    if kind is RoutingKind.EMPTY_EXPERTS:  # odd experts get no rows: exact zero gradients
        assert not g.dw13[1::2].any() and not g.dw2[1::2].any()
    assert len(pool) == 1  # forward and backward returned their arena


def test_scratch_is_reused_across_steps_and_saved_tensors_are_not_scratch() -> None:
    x, routing, w = _inputs(torch.float32, RoutingKind.ZIPF, tokens=16)
    pool = ArenaPool()
    first, held = kbk_forward(x, routing, w, pool=pool, save=True)
    assert len(pool) == 1  # scratch is back in the pool while the activations are held
    scratch = {b.untyped_storage().data_ptr() for b in pool.acquire("cpu").buffers()}
    pool.release(pool.acquire("cpu"))
    saved = [t for t in held.pack()[0][:len(held.TENSORS) - 2] if t is not None]
    assert not scratch & {t.untyped_storage().data_ptr() for t in saved}
    dy = torch.ones_like(first)
    alone = kbk_backward(kbk_forward(x, routing, w, save=True)[1], dy)
    kbk_forward(x * 2, routing, w, pool=pool, save=True)  # a second step while the first is held
    g = kbk_backward(held, dy, pool)
    assert torch.equal(g.dx, alone.dx) and torch.equal(g.dw13, alone.dw13) and len(pool) == 1


@pytest.mark.parametrize("activation", list(Activation))
def test_every_activation_and_recompute_match_autograd(activation: Activation) -> None:
    x, routing, w = _inputs(torch.float32, RoutingKind.ZIPF, tokens=16)
    w = ExpertWeights.random(dataclasses.replace(w.spec, activation=activation), seed=4)
    out = kbk_forward(x, routing, w)[0]
    # not bitwise: torch's vectorised and scalar erf/tanh differ in the last bit, and which
    # elements take which depends on the tensor's extent
    torch.testing.assert_close(out, dense_moe(x, w, routing), **TOL[torch.float32])
    dy = torch.randn_like(out)
    ref = _autograd_grads(x, routing, w, dy)
    for recompute in Recompute:
        _, state = kbk_forward(x, routing, w, save=True, recompute=recompute)
        g = kbk_backward(state, dy)
        mine = (g.dx, g.dweights, g.dw13, g.dw2, g.dshared_w13, g.dshared_w2)
        for name, a, b in zip(("dx", "dweights", "dw13", "dw2", "dsw13", "dsw2"), mine, ref, strict=True):
            torch.testing.assert_close(a, b, **TOL[torch.float32], msg=f"{recompute.value}: {name}")


def test_each_recompute_keeps_its_tensors_and_nothing_else() -> None:
    """The gathered rows only under NOTHING, the pre-activations (routed and shared) but
    under GEMM, the layer input but under NOTHING without a shared expert; never a gated
    activation or an expert output."""
    x, routing, w = _inputs(torch.float32, RoutingKind.ZIPF, tokens=16)
    rows, h = x.shape[0] * w.spec.top_k, (x.shape[0] * w.spec.top_k, 2 * w.spec.ffn)
    for recompute in Recompute:
        kept = kbk_forward(x, routing, w, save=True, recompute=recompute)[1]
        assert (kept.rows is not None) == (recompute is Recompute.NOTHING)
        assert kept.rows is None or kept.rows.shape == (rows, w.spec.hidden)
        assert (kept.h is None) == (kept.sh is None) == (recompute is Recompute.GEMM)
        assert kept.h is None or kept.h.shape == h
        assert kept.x is x  # the shared expert reads it
        assert set(kept.TENSORS) == {"rows", "h", "sh", "x", "topk_weights"}
    no_shared = ExpertWeights.random(dataclasses.replace(w.spec, shared_experts=0), seed=1)
    assert kbk_forward(x, routing, no_shared, save=True, recompute=Recompute.NOTHING)[1].x is None


def test_the_autograd_node_saves_through_save_for_backward() -> None:
    x, routing, w = _inputs(torch.float32, RoutingKind.ZIPF, tokens=16)
    leaves = [t.clone().requires_grad_() for t in (x, routing.weights, w.w13, w.w2, w.shared_w13,
                                                   w.shared_w2)]
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or len(packed) - 1,
                                                  lambda i: packed[i]):
        out = run(KernelByKernelPath(), leaves[0], Routing(routing.ids, leaves[1]),
                  ExpertWeights.routed(w.spec, *leaves[2:]))
    assert any(t.shape == (16 * w.spec.top_k, w.spec.hidden) for t in packed)  # the activations
    out.backward(torch.ones_like(out))
    want = _autograd_grads(x, routing, w, torch.ones_like(out))
    for name, a, b in zip(("dx", "dweights", "dw13"), leaves, want, strict=False):
        torch.testing.assert_close(a.grad, b, **TOL[torch.float32], msg=name)


def _ranks(rank: int, world: int, kind: RoutingKind) -> dict:
    from hpmoe.runtime import Session

    with Session() as session:
        return {(dtype, recompute): _rank(rank, world, dtype, kind, session.collectives, recompute)
                for dtype in (torch.float32, torch.bfloat16) for recompute in Recompute}


def _rank(rank: int, world: int, dtype: torch.dtype, kind: RoutingKind, coll, recompute: Recompute) -> dict:
    tokens = 12
    x, routing, w = _inputs(dtype, kind, tokens, ep=world)
    mine = slice(rank * tokens, (rank + 1) * tokens)
    local = Routing(routing.ids[mine].contiguous(), routing.weights[mine].contiguous())
    out, state = kbk_forward(x[mine].contiguous(), local, w, coll=coll, pool=ArenaPool(), save=True,
                             recompute=recompute)
    kept_rows = state.rows is not None
    base = serialized_ep_forward(x[mine].contiguous(), w, local)
    dy = ((torch.arange(world * tokens)[:, None] % 5 + 1.0) / 5 * torch.ones(1, w.spec.hidden)).to(dtype)
    g = kbk_backward(state, dy[mine].contiguous())
    grads = torch.cat([t.float().reshape(-1) for t in (g.dw13, g.dw2)])
    dist.all_reduce(grads)  # expert gradients are complete on their owner, zero elsewhere
    shared = torch.cat([g.dshared_w13.float().reshape(-1), g.dshared_w2.float().reshape(-1)])
    dist.all_reduce(shared)
    return {"equal_baseline": torch.equal(out, base.out), "out": out, "dx": g.dx, "dweights": g.dweights,
            "experts": grads, "shared": shared, "x": x, "routing": routing, "w": w, "dy": dy,
            "kept_rows": kept_rows}


def test_two_ranks_match_the_serialized_baseline_and_autograd() -> None:
    """Every ``Recompute`` on 2 ranks against autograd; the received rows are kept but
    under GEMM (which dispatches them again beside their gradients), with the bits of
    the rows kept."""
    both = spawn_gloo(_ranks, 2, RoutingKind.EMPTY_RANK, timeout=120)
    for dtype in (torch.float32, torch.bfloat16):
        kept = [r[dtype, Recompute.NOTHING] for r in both]
        for recompute in Recompute:
            res = [r[dtype, recompute] for r in both]
            _check_ranks(res, dtype)
            assert all(r["kept_rows"] == (recompute is not Recompute.GEMM) for r in res), recompute
            for a, b in zip(res, kept, strict=True):
                for name in ("dx", "dweights", "experts"):
                    assert torch.equal(a[name], b[name]), (recompute, name)


def _check_ranks(res: list[dict], dtype: torch.dtype) -> None:
    assert all(r["equal_baseline"] for r in res)
    r0 = res[0]
    ref = _autograd_grads(r0["x"], r0["routing"], r0["w"], r0["dy"])
    torch.testing.assert_close(torch.cat([r["dx"] for r in res]), ref[0], **TOL[dtype])
    torch.testing.assert_close(torch.cat([r["dweights"] for r in res]), ref[1], **TOL[dtype])
    experts = torch.cat([t.float().reshape(-1) for t in ref[2:4]])
    torch.testing.assert_close(r0["experts"], experts, **TOL[dtype])
    shared = torch.cat([t.float().reshape(-1) for t in ref[4:6]])
    torch.testing.assert_close(r0["shared"], shared, **TOL[dtype])


def test_an_inference_call_saves_nothing(monkeypatch) -> None:
    import hpmoe.engine.paths as paths

    saves, forward = [], paths.kbk_forward
    monkeypatch.setattr(paths, "kbk_forward", lambda *a, **k: saves.append(a[5]) or forward(*a, **k))
    x, routing, w = _inputs(torch.float32, RoutingKind.ZIPF, tokens=8)
    w13 = w.w13.clone().requires_grad_()  # needs_input_grad is True even under no_grad
    args = (x, routing.weights, w13, w.w2, w.shared_w13, w.shared_w2)
    path = KernelByKernelPath()
    with torch.no_grad():
        RegionFunction.apply(*args, None, None, RegionCall(w.spec, routing.ids, path, grad=False))
    RegionFunction.apply(*args, None, None, RegionCall(w.spec, routing.ids, path))
    assert saves == [False, True]
    # the call protocol: no autograd node at all under no_grad, one that saves with grad
    weights = ExpertWeights.routed(w.spec, w13, w.w2, w.shared_w13, w.shared_w2)
    with torch.no_grad():
        out = paths.run(path, x, routing, weights)
    assert saves[2:] == [False] and out.grad_fn is None
    assert paths.run(path, x, routing, weights).grad_fn is not None and saves[3:] == [True]


def _expert_grads(ex: Experts, segs, xs, g, w, path: GemmPath) -> tuple[torch.Tensor, ...]:
    """(h, a, y, dxs, ds, dw13, dw2) of rows xs whose unweighted output gradient is g and
    routing weights w (None: 1; ds then zeros)."""
    h, a, y = experts_forward(xs, segs, ex, Arena("cpu"), "", path)
    grads = ExpertGrads(*(torch.full(t.shape, float("nan"), dtype=t.dtype) for t in (ex.w13, ex.w2)))
    dxs, ds = experts_backward(g, xs, h, w, segs, ex, grads, Arena("cpu"), "", path)
    ds = torch.zeros(xs.shape[0]) if ds is None else ds
    return h, a, y, dxs.clone(), ds.clone(), grads.dw13, grads.dw2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("rows", [(0, 1, 2, 3), (2, 0, 2, 1)])
def test_grouped_gemms_match_the_per_expert_loop(dtype: torch.dtype, weighted: bool, rows) -> None:
    """GemmPath.GROUPED (a GPU's path, run here on the CPU's grouped GEMM) against the
    per-expert loop: forward, input, routing-weight and weight gradients (rows with
    routing weights, and without: the shared expert's), an expert without rows; experts
    reading rows in place (two replicas of row 2: their gradients summed) against the
    same experts with their rows copied out, gradients summed by autograd's index_add."""
    g = torch.Generator().manual_seed(3)
    m, h_, f, r = 40, 32, 24, max(rows) + 1
    segs = Groups(torch.tensor([12, 0, 20, 8]))
    stored = [torch.randn(*s, generator=g).to(dtype) for s in ((r, 2 * f, h_), (r, h_, f))]
    ex = Experts(*stored, rows, Activation.SILU)
    xs, dy = (torch.randn(m, h_, generator=g).to(dtype) for _ in range(2))
    w = torch.rand(m, generator=g) + 0.1 if weighted else None
    out = {path: _expert_grads(ex, segs, xs, dy, w, path) for path in GemmPath}
    copied = Experts(*(t[list(rows)] for t in stored), tuple(range(len(rows))), Activation.SILU)
    *want, dw13, dw2 = _expert_grads(copied, segs, xs, dy, w, GemmPath.PER_EXPERT)
    index = torch.tensor(rows)
    want += [torch.zeros_like(t).index_add_(0, index, d) for t, d in zip(stored, (dw13, dw2), strict=True)]
    for name, grouped, loop, copy in zip(("h", "a", "y", "dxs", "ds", "dw13", "dw2"), out[GemmPath.GROUPED],
                                         out[GemmPath.PER_EXPERT], want, strict=True):
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
        if dtype == torch.bfloat16 and len(set(rows)) < len(rows):  # a replica pair's sum is rounded
            tol["atol"] = 2**-7 * float(copy.abs().max())  # once (addmm) or twice: an ulp of the largest
        torch.testing.assert_close(grouped, loop, **tol, msg=lambda m, n=name: f"{n}: {m}")
        torch.testing.assert_close(loop, copy, **tol, msg=lambda m, n=name: f"{n} in place: {m}")
    if rows == (0, 1, 2, 3):  # expert 1 has no rows: exact zeros
        assert not out[GemmPath.GROUPED][5][1].any() and not out[GemmPath.GROUPED][6][1].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_shared_expert_is_one_plain_gemm_on_the_grouped_path(dtype: torch.dtype) -> None:
    """One group of every row (``Groups.one``, the shared expert) runs plain GEMMs on the
    grouped path: the per-expert loop's values, forward and both gradients."""
    g = torch.Generator().manual_seed(5)
    ex = Experts(*(torch.randn(*s, generator=g).to(dtype) for s in ((1, 48, 16), (1, 16, 24))), (0,),
                 Activation.SILU)
    xs, dy = (torch.randn(13, 16, generator=g).to(dtype) for _ in range(2))
    grouped, loop = (_expert_grads(ex, Groups.one(13), xs, dy, None, p) for p in GemmPath)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for a, b in zip(grouped, loop, strict=True):
        torch.testing.assert_close(a, b, **tol)


def test_the_grouped_path_is_a_gpus_and_refuses_biases() -> None:
    ex = Experts(torch.zeros(2, 16, 8), torch.zeros(2, 8, 8), (0, 1), Activation.SILU)
    assert gemm_path(torch.zeros(4, 8, dtype=torch.bfloat16), ex) is GemmPath.PER_EXPERT  # the CPU
    biased = dataclasses.replace(ex, b13=torch.zeros(2, 16), b2=torch.zeros(2, 8))
    assert gemm_path(torch.zeros(4, 8, dtype=torch.bfloat16), biased) is GemmPath.PER_EXPERT
    with pytest.raises(ValueError, match="adds no expert biases"):
        experts_forward(torch.zeros(4, 8), segments([4, 0]), biased, Arena("cpu"), "", GemmPath.GROUPED)


def _pinned_layer(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from hpmoe.nn.layer import MoE

    spec = preset("tiny", torch.float32)
    layer = MoE(spec, ExpertWeights.random(spec, 2), ep_group=dist.group.WORLD, backend="kernel_by_kernel")
    x = torch.randn(world * 16, spec.hidden, generator=torch.Generator().manual_seed(4))
    mine = x[rank * 16:(rank + 1) * 16].clone().requires_grad_()
    out = layer(mine)
    out.square().sum().backward()
    grad = layer.experts.gate_up_proj.grad.clone()
    dist.all_reduce(grad)
    layer.close()
    return out.detach(), mine.grad, grad


def test_the_pinned_backend_runs_kernel_by_kernel_in_one_process_and_on_an_ep_group() -> None:
    """``backend="kernel_by_kernel"``: what AUTO may choose, chosen by the user; in one
    process and on 2 gloo ranks the outputs and gradients are the taskflow's."""
    from hpmoe.engine import RegionOptions, select
    from hpmoe.engine.selection import Auto
    from hpmoe.nn.layer import MoE
    from hpmoe.runtime import RuntimeConfig

    spec = preset("tiny", torch.float32)
    path, trial = select(RegionOptions(backend="kernel_by_kernel"), spec, 32, Auto())
    assert isinstance(path, KernelByKernelPath) and trial is None
    with pytest.raises(ValueError, match="runtime configures the multi-rank runtime"):
        RegionOptions(backend="kernel_by_kernel", runtime=RuntimeConfig())
    x = torch.randn(32, spec.hidden, generator=torch.Generator().manual_seed(4))
    def step(layer: MoE) -> list[torch.Tensor]:
        xi = x.clone().requires_grad_()
        out = layer(xi)
        out.square().sum().backward()
        return [out.detach(), xi.grad, layer.experts.gate_up_proj.grad]

    w = ExpertWeights.random(spec, 2)
    want = step(MoE(spec, w, virtual_ep=2, schedule=None))  # the taskflow of 2 virtual ranks
    # kernel by kernel scales d = g W2 by the routing weight, the taskflow g before W2:
    # the same sums associated otherwise, a few fp32 ulps of a sum of cancelling terms apart
    tol = dict(atol=3e-5, rtol=1e-5)
    for a, b in zip(step(MoE(spec, w, backend="kernel_by_kernel")), want, strict=True):
        torch.testing.assert_close(a, b, **tol)
    ranks = spawn_gloo(_pinned_layer, 2, timeout=120)
    for a, b in zip((torch.cat([r[0] for r in ranks]), torch.cat([r[1] for r in ranks]), ranks[0][2]),
                    want, strict=True):
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tk_h", [(37, 3, 300), (5, 1, 16), (64, 8, 512)])
def test_the_gpus_one_launch_combine_gives_the_torch_combines_bits(dtype: torch.dtype, tk_h) -> None:
    """``hpmoe.gpu.phases.slot_combine`` (what ``weighted_sum`` and ``slot_sum`` run on a
    GPU), in the Triton interpreter, against the torch versions: blocks cut by the token
    and hidden sizes, one slot and eight, with and without the shared expert's rows."""
    pytest.importorskip("triton")
    from hpmoe.gpu.phases import slot_combine

    t, k, h = tk_h
    g = torch.Generator().manual_seed(t)
    rows = torch.randn(t * k + 3, h, generator=g).to(dtype)
    pos = torch.randperm(t * k, generator=g).view(t, k)
    w = torch.rand(t, k, generator=g)
    for extra in (None, torch.randn(t, h, generator=g).to(dtype)):
        assert torch.equal(slot_combine(rows, pos, w, extra, interpret=True),
                           weighted_sum(rows, pos, w, extra, Arena("cpu")))
        assert torch.equal(slot_combine(rows, pos, None, extra, interpret=True),
                           slot_sum(rows, pos, extra, Arena("cpu")))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tk_h", [(37, 3, 300), (5, 1, 16), (20, 6, 40), (24, 8, 512)])
def test_the_gpus_one_launch_combine_gradient_against_the_torch_one(dtype: torch.dtype, tk_h) -> None:
    """``slot_combine_backward`` in the interpreter against ``weighted_sum_backward``:
    the rows' gradients bit for bit, the weights' within fp32 rounding (another order of
    the same sum); six slots pad to eight; blocks cut by the token and hidden sizes."""
    pytest.importorskip("triton")
    from hpmoe.gpu.phases import slot_combine_backward

    t, k, h = tk_h
    g = torch.Generator().manual_seed(t)
    rows = torch.randn(t * k, h, generator=g).to(dtype)
    pos = torch.randperm(t * k, generator=g).view(t, k)
    w, dout = torch.rand(t, k, generator=g), torch.randn(t, h, generator=g).to(dtype)  # the output's dtype
    dw, drows = slot_combine_backward(dout, rows, pos, w, interpret=True)
    want_dw, want_drows = weighted_sum_backward(dout, rows, pos, w, Arena("cpu"))
    assert torch.equal(drows, want_drows)
    torch.testing.assert_close(dw, want_dw, rtol=1e-5, atol=1e-5 * h ** 0.5)


@pytest.mark.parametrize("experts", [8, 256, 300, 40000])
def test_the_permutation_sorts_narrow_keys_into_the_int64_order(experts: int) -> None:
    """Permutation.of sorts expert ids as uint8 / int16 / int32 keys: the same stable
    order as sorting the int64 ids (ties kept in token order, ids at the type's edges)."""
    g = torch.Generator().manual_seed(experts)
    ids = torch.randint(0, experts, (97, 4), generator=g)
    ids[0, 0], ids[1, 1] = experts - 1, 0
    perm = Permutation.of(ids, experts, 1)
    assert torch.equal(perm.order, torch.argsort(ids.reshape(-1), stable=True))
    assert perm.send.sum() == ids.numel()
