"""hpmoe.MoE: the autograd layer against autograd through the gate and refs.dense_moe,
single process (virtual EP) and on gloo ranks of an EP group.  Every test that names a
path, an EP degree or tiles pins the path and asserts (``helpers.ran``) that it ran."""

import copy
import dataclasses
import io
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist

from hpmoe import refs
from hpmoe.engine import ExactPath, KernelByKernelPath, RegionState, RuntimePath
from hpmoe.machine import machine
from hpmoe.nn.layer import MoE
from hpmoe.routing import Routing, route
from hpmoe.runtime import RuntimeConfig, TransportKind
from hpmoe.schedule import SchedulePolicy
from hpmoe.schedule.auto import KERNEL_BY_KERNEL, Path, Reason
from hpmoe.schedule.tune import KERNEL_BY_KERNEL_KNOBS, Budget, TuneResult
from hpmoe.schedule.tune_cache import CACHE_ENV, TuneCache
from hpmoe.schedule.tuner import Tuner
from hpmoe.sim.presets import cpu_nominal, hardware_preset
from hpmoe.spec import Activation, DispatchMode, GateKind, MoESpec, Recompute, as_recompute, preset
from hpmoe.testing import spawn_gloo
from hpmoe.weights import ExpertWeights

from .helpers import GPT_OSS_FORM, TINY_TILES, pin, ran

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float16: dict(atol=2e-3, rtol=2e-3)}
SOFTMAX = MoESpec(hidden=24, ffn=12, experts=8, top_k=3, gate=GateKind.SOFTMAX, dtype=torch.float32)
NAMES = ["experts.gate_up_proj", "experts.down_proj", "gate.weight", "shared_experts.gate_proj.weight",
         "shared_experts.up_proj.weight", "shared_experts.down_proj.weight"]


def _data(spec, tokens, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, tokens // 2, spec.hidden, generator=g).to(spec.dtype)
    return x, torch.randn(x.shape, generator=g).to(spec.dtype)


def _run(layer, x, dy):
    """(out, x.grad, {name: grad}) of one forward/backward of ``layer``."""
    x = x.clone().requires_grad_()
    out = layer(x)
    out.backward(dy)
    return out.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}


def _reference(layer, x, dy):
    """The same, by autograd through the gate and refs.dense_moe on ``layer``'s parameters."""
    x = x.clone().requires_grad_()
    flat = x.reshape(-1, layer.spec.hidden)
    w = layer.expert_weights()
    out = refs.dense_moe(flat, w, route(flat, w)).view(x.shape)
    out.backward(dy)
    return out.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}


def _tol(dtype, ref):
    """TOL, its absolute part scaled to ``ref``'s largest magnitude in a 16-bit dtype: two
    computations that round at other places (kernel by kernel scales by the routing
    weight after the GEMM, autograd before) differ by a few ulps of the largest terms of
    a sum, whatever the element's own size."""
    tol = TOL[dtype]
    if dtype == torch.float32:
        return tol
    return {**tol, "atol": tol["atol"] * max(1.0, float(ref.float().abs().max()))}


def _assert_close_runs(a, b, dtype):
    torch.testing.assert_close(a[0], b[0], **_tol(dtype, b[0]))
    torch.testing.assert_close(a[1], b[1], **_tol(dtype, b[1]))
    assert a[2].keys() == b[2].keys()
    for name in a[2]:
        torch.testing.assert_close(a[2][name], b[2][name], **_tol(dtype, b[2][name]),
                                   msg=lambda m, n=name: f"{n}: {m}")


# the taskflow of 1, 2 and 4 virtual ranks and kernel by kernel (which has no virtual ranks)
PATH_EPS = [(Path.TASKFLOW, 1), (Path.TASKFLOW, 2), (Path.TASKFLOW, 4), (Path.KERNEL_BY_KERNEL, 1)]
PATH_EP_IDS = [f"{p.value}-ep{ep}" for p, ep in PATH_EPS]
ONE_PROCESS = [Path.TASKFLOW, Path.KERNEL_BY_KERNEL]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path,ep", PATH_EPS, ids=PATH_EP_IDS)
@pytest.mark.parametrize("spec", [preset("tiny"), SOFTMAX], ids=["sigmoid-shared", "softmax"])
def test_gradients_match_autograd_through_gate_and_dense_reference(spec, path, ep, dtype):
    spec, pinned = spec.with_dtype(dtype), pin(path, ep)
    layer = MoE(spec, ExpertWeights.random(spec, 1), **pinned.options)
    x, dy = _data(spec, 16)
    got = _run(layer, x, dy)
    ran(layer, pinned.kind, tokens=16, **pinned.fields)
    layer.zero_grad()
    _assert_close_runs(got, _reference(layer, x, dy), dtype)
    assert sorted(got[2]) == sorted(NAMES if spec.shared_experts else NAMES[:3])
    assert all(g.abs().sum() > 0 for g in got[2].values())


@pytest.mark.parametrize("spec", [preset("tiny"), SOFTMAX], ids=["sigmoid-shared", "softmax"])
def test_the_persistent_kernel_matches_autograd(spec):
    """``backend="triton"`` in the Triton interpreter on 2 virtual ranks: 16 tokens, every
    expert's block partial (fp32 only: the interpreter takes seconds a call)."""
    pytest.importorskip("triton")
    pinned = pin(Path.PERSISTENT, 2)
    layer = MoE(spec, ExpertWeights.random(spec, 1), **pinned.options)
    x, dy = _data(spec, 16)
    got = _run(layer, x, dy)
    ran(layer, pinned.kind, tokens=16, **pinned.fields)
    layer.zero_grad()
    _assert_close_runs(got, _reference(layer, x, dy), torch.float32)
    assert all(g.abs().sum() > 0 for g in got[2].values())


def test_the_persistent_kernel_at_ep1_runs_one_program_for_every_routing_of_its_shape():
    """At EP 1 the layer's persistent kernel runs the program made once for its shape
    (``gpu.slots``) on each new routing: three batches, one program built; two
    micro-batches' forwards before their backwards (its arena holds the last forward's
    activations: the first's backward runs its forward again) give each batch's own bits,
    and match autograd."""
    pytest.importorskip("triton")
    from hpmoe.gpu.slots import PlanCache

    spec, pinned = preset("tiny"), pin(Path.PERSISTENT, 1)
    layer = MoE(spec, ExpertWeights.random(spec, 1), **pinned.options)
    batches = [_data(spec, 16, seed) for seed in range(3)]
    alone = []
    for x, dy in batches:
        alone.append(_run(layer, x, dy))
        ran(layer, pinned.kind, tokens=16, **pinned.fields)
        layer.zero_grad()
        _assert_close_runs(alone[-1], _reference(layer, x, dy), torch.float32)
        layer.zero_grad()
    assert layer._door.arenas.resident(PlanCache, PlanCache).builds == 1
    xs = [x.clone().requires_grad_() for x, _ in batches[:2]]
    outs = [layer(x) for x in xs]
    for out, (_, dy), x, want in zip(outs, batches, xs, alone, strict=False):
        layer.zero_grad()
        out.backward(dy)
        assert torch.equal(out.detach(), want[0]) and torch.equal(x.grad, want[1])
        for n, p in layer.named_parameters():
            assert torch.equal(p.grad, want[2][n]), n


STEALS = {"persistent-1": (Path.PERSISTENT, 1), "persistent-2": (Path.PERSISTENT, 2),
          "kbk-1": (Path.KERNEL_BY_KERNEL, 1), "taskflow-2": (Path.TASKFLOW, 2)}


@pytest.mark.parametrize("path,ep", STEALS.values(), ids=STEALS)
def test_the_expert_gradients_a_path_returns_become_grad_without_a_copy(path, ep, monkeypatch):
    """Autograd takes a returned gradient as ``.grad`` without a copy only when nothing
    else references it (a persistent kernel's arena kept views of them, and a runtime
    worker its last job: each made autograd copy every expert gradient a step)."""
    from hpmoe.engine.paths import RegionFunction

    returned = []
    backward = RegionFunction.backward

    def kept(ctx, dout):
        grads = backward(ctx, dout)
        returned.append([t.data_ptr() for t in grads[2:4]])  # no reference: it would be one more
        return grads

    monkeypatch.setattr(RegionFunction, "backward", staticmethod(kept))
    spec, pinned = preset("tiny"), pin(path, ep)
    layer = MoE(spec, ExpertWeights.random(spec, 1), **pinned.options)
    x, dy = _data(spec, 16)
    layer(x).backward(dy)
    ran(layer, pinned.kind, tokens=16, **pinned.fields)
    assert returned == [[layer.experts.gate_up_proj.grad.data_ptr(), layer.experts.down_proj.grad.data_ptr()]]


@pytest.mark.parametrize("path", ONE_PROCESS, ids=[p.value for p in ONE_PROCESS])
@pytest.mark.parametrize("activation", list(Activation))
def test_every_activation_matches_autograd_and_differs_from_silu(activation, path):
    spec, pinned = MoESpec(**{**vars(preset("tiny")), "activation": activation}), pin(path, 2)
    layer = MoE(spec, ExpertWeights.random(spec, 1), recompute=True, **pinned.options)
    x, dy = _data(spec, 16)
    got = _run(layer, x, dy)
    ran(layer, pinned.kind, recompute=Recompute.PERMUTATION, **pinned.fields)
    layer.zero_grad()
    _assert_close_runs(got, _reference(layer, x, dy), torch.float32)
    if activation is not Activation.SILU:  # a kernel that ignored the activation would fail here
        silu = MoE(preset("tiny"), ExpertWeights.random(preset("tiny"), 1), **pinned.options)
        assert (silu(x) - got[0]).abs().max() > 1e-3
        ran(silu, pinned.kind, **pinned.fields)


@pytest.mark.parametrize("path", ONE_PROCESS, ids=[p.value for p in ONE_PROCESS])
def test_fp16_accumulates_in_fp32(path):
    spec, pinned = SOFTMAX.with_dtype(torch.float16), pin(path, 2)
    layer = MoE(spec, ExpertWeights.random(spec, 1), **pinned.options)
    x, dy = _data(spec, 16)
    got = _run(layer, x, dy)
    ran(layer, pinned.kind, **pinned.fields)
    layer.zero_grad()
    _assert_close_runs(got, _reference(layer, x, dy), torch.float16)
    assert got[0].dtype == torch.float16


# kernel by kernel runs one rank (only 0 tokens pad, to 1); the persistent kernel at 7
# tokens only (a partial block, a padding token; the interpreter takes seconds a call)
TOKEN_CASES = [(p, ep, t) for p, ep in [(Path.TASKFLOW, 2), (Path.TASKFLOW, 4), (Path.KERNEL_BY_KERNEL, 1)]
               for t in (0, 1, 7)] + [(Path.PERSISTENT, 2, 7)]
TOKEN_IDS = [f"{p.value}-ep{e}-{t}" for p, e, t in TOKEN_CASES]


@pytest.mark.parametrize("path,ep,tokens", TOKEN_CASES, ids=TOKEN_IDS)
def test_any_token_count_at_any_virtual_ep(path, ep, tokens):
    if path is Path.PERSISTENT:
        pytest.importorskip("triton")
    spec, pinned = preset("tiny"), pin(path, ep)
    layer = MoE(spec, ExpertWeights.random(spec, 1), **pinned.options)
    x, dy = _rows(spec, tokens)
    got = _run(layer, x, dy)
    ran(layer, pinned.kind, tokens=max(-(-tokens // ep), 1) * ep, **pinned.fields)  # padded to ep ranks
    layer.zero_grad()
    out, dx, grads = _reference(layer, x, dy)
    zero = {n: torch.zeros_like(p) for n, p in layer.named_parameters()}  # autograd: None for no rows
    want = (out, dx, {n: zero[n] if g is None else g for n, g in grads.items()})
    _assert_close_runs(got, want, torch.float32)


def _saved_bytes(out: torch.Tensor) -> int:
    node = out.grad_fn
    while not isinstance(getattr(node, "state", None), RegionState):
        node = node.next_functions[0][0]
    return node.state.saved_bytes()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recompute_and_task_order_leave_every_bit_unchanged(dtype):
    spec = preset("tiny", dtype)
    w = ExpertWeights.random(spec, 2)
    x, dy = _data(spec, 24, seed=3)
    base = _run(MoE(spec, w, virtual_ep=2, tiles=TINY_TILES, schedule=None), x, dy)
    for options in [dict(recompute=True, schedule=None), dict(schedule=7), dict(schedule=8, recompute=True)]:
        layer = MoE(spec, w, virtual_ep=2, tiles=TINY_TILES, **options)
        got = _run(layer, x, dy)
        ran(layer, ExactPath, ep=2, tiles=TINY_TILES, order=options["schedule"],
            **{k: as_recompute(options[k]) for k in ("recompute",) if k in options})  # as asked
        assert torch.equal(got[0], base[0]) and torch.equal(got[1], base[1]), options
        assert all(torch.equal(got[2][n], base[2][n]) for n in base[2]), options


def test_a_taskflow_in_one_process_keeps_only_the_pre_activations():
    """Under the default the taskflow recomputes the shared activation and its experts'
    input rows travel again beside their dy rows: it keeps the pre-activations (and the
    layer input, the caller's); with "nothing" the rows and the shared activation too.
    No path keeps an expert output."""
    spec = preset("tiny")
    x, _ = _data(spec, 16)
    layers = [MoE(spec, virtual_ep=2, recompute=r, tiles=TINY_TILES, schedule=None) for r in Recompute]
    kept, lean, gemm = (_saved_bytes(layer(x)) for layer in layers)
    for layer, recompute in zip(layers, Recompute, strict=True):
        ran(layer, ExactPath, ep=2, tiles=TINY_TILES, recompute=recompute)
    rows = 16 * spec.top_k  # every routed row is held by exactly one rank
    pre = rows * 2 * spec.ffn + 16 * 2 * spec.shared_ffn
    assert lean == gemm == pre * 4  # (the layer input is the caller's)
    assert kept == (pre + rows * spec.hidden + 16 * spec.shared_ffn) * 4  # + received rows, shared activation


@pytest.mark.parametrize("path", ONE_PROCESS, ids=[p.value for p in ONE_PROCESS])
def test_a_call_keeps_the_shared_experts_parameters_not_their_fused_copy(path):
    """The shared expert's gate and up are fused for the call; its autograd node keeps the
    parameters themselves (no [2Fs, H] copy among what it saves) and its gradients equal
    a call's that saved the fused copy (through the dense reference)."""
    spec, pinned = preset("tiny"), pin(path, 2)
    layer = MoE(spec, ExpertWeights.random(spec, 1), **pinned.options)
    saved: list[torch.Tensor] = []

    def pack(t):
        saved.append(t)
        return t
    x, dy = _data(spec, 16)
    xg = x.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(xg)
    sh = layer.shared_experts
    fused = torch.cat([sh.gate_proj.weight, sh.up_proj.weight])
    ptrs = {t.untyped_storage().data_ptr() for t in saved}
    assert {p.untyped_storage().data_ptr() for p in (sh.gate_proj.weight, sh.up_proj.weight)} <= ptrs
    assert not [t for t in saved if t.shape == fused.shape and torch.equal(t, fused)]
    out.backward(dy)
    got = (out.detach(), xg.grad, {n: p.grad.clone() for n, p in layer.named_parameters()})
    ran(layer, pinned.kind, tokens=16, **pinned.fields)
    layer.zero_grad()
    _assert_close_runs(got, _reference(layer, x, dy), torch.float32)


def test_the_taskflow_state_keeps_no_tensor_outside_save_for_backward():
    """``RegionState.pack`` hands every tensor the backward reads, the routing's ids and
    top-k weights included, to save_for_backward (so saved-tensor hooks may offload or
    free them), and ``unpack`` puts the same ones back."""
    spec = preset("tiny")
    w = ExpertWeights.random(spec, 0)
    x = _data(spec, 16)[0].reshape(-1, spec.hidden)
    routing = route(x, w)
    _, state = ExactPath(2, TINY_TILES).forward(x, routing, w, True)
    tensors, bare = state.pack()
    assert not [f.name for f in dataclasses.fields(bare) if isinstance(getattr(bare, f.name), torch.Tensor)]
    assert bare.routing is None and bare.weights is None and bare.saved == [None, None]
    back = bare.unpack(tuple(tensors))
    assert back.routing.ids is routing.ids and back.routing.weights is routing.weights
    assert back.weights.w13 is w.w13


@pytest.mark.parametrize("path", ONE_PROCESS, ids=[p.value for p in ONE_PROCESS])
def test_parameters_are_trained_through_an_optimizer(path):
    spec, pinned = preset("tiny"), pin(path, 2)
    layer = MoE(spec, **pinned.options)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    x, target = _data(spec, 16, seed=4)
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = (layer(x) - target).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    ran(layer, pinned.kind, **pinned.fields)
    assert losses[-1] < losses[0]


def test_bad_configuration_and_input_are_refused():
    spec = preset("tiny")
    with pytest.raises(ValueError, match="virtual_ep must be a positive int"):
        MoE(spec, virtual_ep=0)
    with pytest.raises(ValueError, match="cannot be combined with an ep_group"):
        MoE(spec, virtual_ep=2, ep_group=object())
    with pytest.raises(ValueError, match="weights must be ExpertWeights of spec"):
        MoE(spec, ExpertWeights.random(SOFTMAX))
    with pytest.raises(ValueError, match=r"recompute='yes' is not one of \['nothing', 'permutation', 'gemm'"):
        MoE(spec, recompute="yes")
    with pytest.raises(ValueError, match=r"hidden_states must be \[\.\.\., 32\]"):
        MoE(spec)(torch.zeros(3, 31))
    with pytest.raises(ValueError, match="ParallelSpec.ep=3 does not divide MoESpec.experts=8"):
        MoE(spec, virtual_ep=3)  # at construction, not at the first call
    with pytest.raises(ValueError, match="ParallelSpec.nodes=3 does not divide ep=2"):
        MoE(spec, virtual_ep=2, nodes=3)  # even where AUTO would run the kernel-by-kernel path
    with pytest.raises(ValueError, match="scheduling policies need an ep_group"):
        MoE(spec, schedule=SchedulePolicy.SERIAL)
    with pytest.raises(ValueError, match="with an ep_group, schedule is a SchedulePolicy"):
        MoE(spec, ep_group=object(), schedule=3)
    with pytest.raises(ValueError, match="runtime configures the multi-rank runtime"):
        MoE(spec, runtime=RuntimeConfig())


# ---------------------------------------------------------------------------- distributed


def _rank_step(rank, world, groups, tokens, options):
    """One forward/backward of an EP-group layer on this rank's share of the tokens."""
    handles = [dist.new_group(g) for g in groups]
    group = next(g for g in groups if rank in g)
    spec = preset("tiny")
    layer = MoE(spec, ExpertWeights.random(spec, 1), ep_group=handles[groups.index(group)], tiles=TINY_TILES,
                **options)
    x, dy = _data(spec, tokens * len(group))
    me = group.index(rank)
    shares = (t.reshape(len(group), -1, spec.hidden)[me] for t in (x, dy))
    result = _run(layer, *shares)
    ran(layer, RuntimePath, tokens=tokens, policy=options["schedule"], tiles=TINY_TILES,
        **{k: as_recompute(options[k]) for k in ("recompute",) if k in options})  # as asked
    layer.close()
    return result


RUNS = {
    "world-hyperparallel-shm-gemm": ([[0, 1]], dict(schedule=SchedulePolicy.HYPERPARALLEL,
                                                     recompute="gemm")),  # the rows travel again
    "subgroups-serial-dist-recompute": ([[0, 2], [1, 3]], dict(
        schedule=SchedulePolicy.SERIAL, recompute=True,
        runtime=RuntimeConfig(transport=TransportKind.DIST), hardware=cpu_nominal(2, 2))),
}


@pytest.mark.parametrize("run", list(RUNS))
def test_distributed_ranks_on_the_runtime_equal_virtual_ranks(run):
    groups, options = RUNS[run]
    world = sum(len(g) for g in groups)
    results = spawn_gloo(_rank_step, world, groups, 6, options, timeout=120)
    spec = preset("tiny")
    for group in groups:
        virtual = MoE(spec, ExpertWeights.random(spec, 1), virtual_ep=len(group), tiles=TINY_TILES,
                      schedule=None)
        x, dy = _data(spec, 6 * len(group))
        want = _run(virtual, x.reshape(len(group), -1, spec.hidden), dy.reshape(len(group), -1, spec.hidden))
        ran(virtual, ExactPath, ep=len(group), tiles=TINY_TILES)
        assert torch.equal(torch.stack([results[r][0] for r in group]), want[0])
        assert torch.equal(torch.stack([results[r][1] for r in group]), want[1])
        for name, grad in want[2].items():
            total = sum(results[r][2][name] for r in group)  # expert grads: zero off the owner
            if name.startswith("gate"):  # router grads: per-rank GEMMs, summed
                torch.testing.assert_close(total, grad, **TOL[torch.float32])
            else:
                assert torch.equal(total, grad), name


def _rows(spec, tokens):
    g = torch.Generator().manual_seed(tokens)
    return torch.randn(tokens, spec.hidden, generator=g), torch.randn(tokens, spec.hidden, generator=g)


def _share(rank, counts, spec):
    """(x, dy) of rank ``rank`` when the ranks hold ``counts`` of ``_rows``' tokens."""
    return tuple(t[sum(counts[:rank]):sum(counts[:rank + 1])] for t in _rows(spec, sum(counts)))


def _assert_ranks_equal_one_process(got, counts, path):
    """Two ranks' steps (``_run``'s results, in rank order) against one process's step of
    the same layer on every token, pinned to ``path``: outputs and dx joined, parameter
    gradients summed."""
    spec, pinned = preset("tiny"), pin(path)
    layer = MoE(spec, ExpertWeights.random(spec, 1), **pinned.options)
    want = _run(layer, *_rows(spec, sum(counts)))
    ran(layer, pinned.kind, **pinned.fields)
    torch.testing.assert_close(torch.cat([g[0] for g in got]), want[0], **TOL[torch.float32])
    torch.testing.assert_close(torch.cat([g[1] for g in got]), want[1], **TOL[torch.float32])
    for name, grad in want[2].items():
        torch.testing.assert_close(got[0][2][name] + got[1][2][name], grad, **TOL[torch.float32])


def _uneven_step(rank, world, counts):
    spec = preset("tiny")
    layer = MoE(spec, ExpertWeights.random(spec, 1), ep_group=dist.group.WORLD, tiles=TINY_TILES,
                schedule=SchedulePolicy.HYPERPARALLEL)
    result = _run(layer, *_share(rank, counts, spec))
    # every rank padded to the most tokens any holds
    ran(layer, RuntimePath, tokens=max(counts), policy=SchedulePolicy.HYPERPARALLEL, tiles=TINY_TILES)
    layer.close()
    return result


@pytest.mark.parametrize("counts", [(3, 4), (0, 5)])
def test_distributed_ranks_may_hold_any_token_count(counts):
    """The runtime taskflow on 2 ranks holding uneven token counts (one rank none)."""
    results = spawn_gloo(_uneven_step, 2, counts, timeout=120)
    _assert_ranks_equal_one_process(results, counts, Path.TASKFLOW)


def _kbk_step(rank, world, counts, placed):
    """One step of a kernel-by-kernel layer on this rank's share of ``counts`` tokens, and
    the forward's collectives by name; ``placed``: experts 0 and 4 swap ranks."""
    from hpmoe.placement import Placement
    from hpmoe.runtime.collective import Collectives

    spec = preset("tiny")
    layer = MoE(spec, ExpertWeights.random(spec, 1), ep_group=dist.group.WORLD, backend="kernel_by_kernel")
    if placed:
        layer.placement = Placement((4, 1, 2, 3, 0, 5, 6, 7), spec.experts, world)
    x, dy = _share(rank, counts, spec)
    names, wait = [], Collectives._wait
    Collectives._wait = lambda self, work, mine, what: names.append(what) or wait(self, work, mine, what)
    try:
        with torch.no_grad():
            layer(x)
    finally:
        Collectives._wait = wait
    result = _run(layer, x, dy)
    ran(layer, KernelByKernelPath, tokens=max(counts))
    layer.close()
    return result, names


@pytest.mark.parametrize("placed", [False, True])
def test_the_agreement_carries_kernel_by_kernels_counts(placed):
    """A kernel-by-kernel call on an EP group makes the unprotected baseline's three
    collectives: the agreement carries each rank's rows per expert, so no count exchange
    follows (under a placement, whose slots are counted after it, one does); uneven
    token counts (one rank's padding) and both cases equal one process."""
    counts = (5, 2)
    results = spawn_gloo(_kbk_step, 2, counts, placed, timeout=120)
    for _, names in results:
        assert names[0].endswith("agreement") and len(names) == 3 + placed, names
        assert ("kernel by kernel: count exchange" in names) == placed, names
    _assert_ranks_equal_one_process([r for r, _ in results], counts, Path.KERNEL_BY_KERNEL)


def _copied_step(rank, world):
    """A placed kernel-by-kernel layer's step on an EP group, then its deep copy's on the
    same tokens: the copy's placement and outputs (bits), and whether the copy's step
    left the original's session open (the original steps again after it)."""
    from hpmoe.placement import Placement

    spec = preset("tiny")
    layer = MoE(spec, ExpertWeights.random(spec, 1), ep_group=dist.group.WORLD, backend="kernel_by_kernel")
    layer.placement = Placement((4, 1, 2, 3, 0, 5, 6, 7), spec.experts, world)
    x, dy = _share(rank, (5, 2), spec)
    first = _run(layer, x, dy)
    copied = copy.deepcopy(layer)
    got = _run(copied, x, dy)
    ran(copied, KernelByKernelPath)
    same_placement = copied.placement == layer.placement
    copied.close()
    layer.zero_grad()
    again = _run(layer, x, dy)
    layer.close()
    return same_placement, first, got, again


def test_a_copied_layer_on_an_ep_group_opens_its_own_session_and_keeps_the_placement():
    for same_placement, first, got, again in spawn_gloo(_copied_step, 2, timeout=120):
        assert same_placement
        for run in (got, again):
            torch.testing.assert_close(run[0], first[0], atol=0, rtol=0)
            torch.testing.assert_close(run[1], first[1], atol=0, rtol=0)


# ---------------------------------------------------------------------------- AUTO


def test_auto_runs_kernel_by_kernel_without_a_profile_and_caches_per_shape(monkeypatch, tmp_path):
    monkeypatch.setenv("HPMOE_PROFILE", str(tmp_path / "none.json"))
    spec = preset("tiny")
    layer = MoE(spec, ExpertWeights.random(spec, 1), virtual_ep=2)
    x, dy = _data(spec, 16)
    _run(layer, x, dy)
    with torch.no_grad():
        layer(x)
    d = layer.decision(16)
    assert d.reason is Reason.NO_MODEL and d.chosen.path is Path.KERNEL_BY_KERNEL
    ran(layer, KernelByKernelPath, tokens=16)
    assert len(layer._door.auto.decisions) == 2  # forward+backward and forward-only shapes


def test_auto_forecasts_on_a_given_model_and_runs_its_choice():
    spec = preset("tiny")
    layer = MoE(spec, ExpertWeights.random(spec, 1), virtual_ep=2, tiles=TINY_TILES,
                hardware=hardware_preset("h100"))
    x, dy = _data(spec, 16)
    got = _run(layer, x, dy)
    d = layer.decision(16)
    assert {f.candidate.path for f in d.forecasts} == {Path.TASKFLOW, Path.KERNEL_BY_KERNEL}
    assert d.chosen == KERNEL_BY_KERNEL  # one thread: tiles cannot overlap, kernels are fewer
    ran(layer, KernelByKernelPath)
    _assert_close_runs(got, _reference(layer, x, dy), spec.dtype)


def test_auto_decides_in_the_dtype_the_layer_computes_in():
    """A layer moved to bf16 (or computing under autocast) is forecast at bf16 rates, as
    one built in bf16 is, not at the fp32 of its construction."""
    spec, hw = preset("tiny", torch.float32), hardware_preset("h100")
    layer = MoE(spec, ExpertWeights.random(spec, 1), virtual_ep=2, tiles=TINY_TILES, hardware=hw)
    built = MoE(preset("tiny", torch.bfloat16), ExpertWeights.random(preset("tiny", torch.bfloat16), 1),
                virtual_ep=2, tiles=TINY_TILES, hardware=hw)
    def modelled(m, **kw):  # the forecasts' modelled regions (their setup times are measured)
        return [(f.candidate, f.region_s) for f in m.decision(16, backward=False, **kw).forecasts]
    bf16 = modelled(built)
    assert modelled(layer) != bf16
    assert modelled(layer, dtype=torch.bfloat16) == bf16
    assert modelled(layer.to(torch.bfloat16)) == bf16


def _auto_ranks(rank, world, steps):
    spec = preset("tiny")
    layer = MoE(spec, ExpertWeights.random(spec, 1), ep_group=dist.group.WORLD)
    x, dy = _data(spec, 12)
    shares = [t.reshape(world, -1, spec.hidden)[rank] for t in (x, dy)]
    results, kinds = [], set()
    for _ in range(steps):
        layer.zero_grad()
        results.append(_run(layer, *shares))
        kinds.add(type(layer.last_call.path).__name__)
    tuned = layer.tuned(6, backward=True)
    if tuned.winner.path is Path.KERNEL_BY_KERNEL:  # the last step: the winner, no trial
        ran(layer, KernelByKernelPath, trial=False)
    else:
        ran(layer, RuntimePath, trial=False, policy=tuned.winner.policy)
    layer.close()
    return results, tuned, kinds


def test_auto_on_an_ep_group_tunes_and_every_step_matches_one_process():
    """Without a model AUTO measures its candidates on real steps: every step (whichever
    candidate ran it) matches one process, and both ranks settle on the same winner
    within the budget."""
    steps = Budget().max_steps + 2
    results = spawn_gloo(_auto_ranks, 2, steps, timeout=300)
    spec = preset("tiny")
    x, dy = _data(spec, 12)
    want = _run(MoE(spec, ExpertWeights.random(spec, 1)), x, dy)
    for step in range(steps):
        got = [r[0][step] for r in results]
        torch.testing.assert_close(torch.stack([g[0] for g in got]), want[0])
        torch.testing.assert_close(torch.stack([g[1] for g in got]), want[1])
        for name, grad in want[2].items():
            torch.testing.assert_close(sum(g[2][name] for g in got), grad, msg=name)
    tuned = [r[1] for r in results]
    assert tuned[0] is not None and tuned[0] == tuned[1]
    assert results[0][2] == {"KernelByKernelPath", "RuntimePath"}  # both paths were tried
    assert 0 < tuned[0].steps <= Budget().max_steps and tuned[0].source == "measured"


def test_auto_runs_the_taskflow_when_it_is_forecast_to_pay(monkeypatch):
    from hpmoe.schedule import auto

    flow = auto.Candidate(Path.TASKFLOW, SchedulePolicy.SERIAL)
    decision = auto.AutoDecision(flow, KERNEL_BY_KERNEL, (), Reason.FORECAST_GAIN, 2.0)
    monkeypatch.setattr(auto, "layer_decision", lambda *args: decision)
    spec = preset("tiny")
    layer = MoE(spec, ExpertWeights.random(spec, 1), virtual_ep=2, tiles=TINY_TILES)
    x, dy = _data(spec, 16)
    assert _saved_bytes(layer(x)) > 0  # the taskflow's autograd node
    assert layer.decision(16) is decision
    fixed = MoE(spec, ExpertWeights.random(spec, 1), virtual_ep=2, tiles=TINY_TILES, schedule=None)
    got, want = _run(layer, x, dy), _run(fixed, x, dy)
    for m in (layer, fixed):  # AUTO's taskflow runs in task-id order
        ran(m, ExactPath, ep=2, tiles=TINY_TILES, order=None)
    assert torch.equal(got[0], want[0]) and all(torch.equal(got[2][n], want[2][n]) for n in want[2])


# ---------------------------------------------------------------------------- expert forms

PER_RANK = dataclasses.replace(TINY_TILES, dispatch=DispatchMode.PER_RANK)
FORM_RUNS = {  # options, and the path they run (its fields)
    "kernel-by-kernel": (dict(backend="kernel_by_kernel"), KernelByKernelPath, {}),
    "taskflow": (dict(schedule=None), ExactPath, dict(ep=2, tiles=TINY_TILES)),
    "taskflow-per-rank": (dict(schedule=None, tiles=PER_RANK), ExactPath, dict(ep=2, tiles=PER_RANK)),
    "taskflow-recompute": (dict(schedule=None, recompute=True), ExactPath,
                           dict(ep=2, tiles=TINY_TILES, recompute=Recompute.PERMUTATION)),
}


@pytest.mark.parametrize("run", list(FORM_RUNS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_biases_and_the_clamped_glu_match_autograd_on_every_path(run, dtype):
    spec, (options, kind, fields) = GPT_OSS_FORM.with_dtype(dtype), FORM_RUNS[run]
    layer = MoE(spec, ExpertWeights.random(spec, 1), virtual_ep=2, **{"tiles": TINY_TILES, **options})
    x, dy = _data(spec, 16)
    got = _run(layer, x, dy)
    ran(layer, kind, **fields)
    layer.zero_grad()
    _assert_close_runs(got, _reference(layer, x, dy), dtype)
    assert {"experts.gate_up_proj_bias", "experts.down_proj_bias"} <= set(got[2])
    assert all(g.abs().sum() > 0 for g in got[2].values())


def _form_steps(rank, world, runs, cache):
    """One step per run (options, the path class and fields it runs) on the group; the
    last run is AUTO with a tuning cache naming kernel by kernel the winner (so AUTO runs
    it without tuning)."""
    spec, out = GPT_OSS_FORM, []
    os.environ[CACHE_ENV] = cache
    if rank == 0:
        key = Tuner().key(spec, world, 1, "shm", 6, True)
        pinned = TuneResult(KERNEL_BY_KERNEL_KNOBS, 1.0, None, None, None, 0, 0.0)
        TuneCache().store(key, machine().versions(), pinned)
    dist.barrier()
    for options, kind, fields in runs:
        options = {"tiles": TINY_TILES, **options}
        layer = MoE(spec, ExpertWeights.random(spec, 1), ep_group=dist.group.WORLD, **options)
        x, dy = _data(spec, 12)
        mine = slice(rank * 3, (rank + 1) * 3)
        out.append(_run(layer, x[:, mine], dy[:, mine]))
        ran(layer, kind, **fields)
        if "schedule" not in options:
            out[-1] = (*out[-1], layer.tuned(6, backward=True).source)
        layer.close()
    return out


def test_expert_forms_on_two_ranks_equal_one_process(tmp_path):
    """The runtime's per-expert and per-rank taskflows, and kernel by kernel (AUTO)."""
    hyper = SchedulePolicy.HYPERPARALLEL
    runs = [(dict(schedule=hyper), RuntimePath, dict(policy=hyper, tiles=TINY_TILES)),
            (dict(schedule=hyper, tiles=PER_RANK), RuntimePath, dict(policy=hyper, tiles=PER_RANK)),
            (dict(), KernelByKernelPath, {})]
    results = spawn_gloo(_form_steps, 2, runs, str(tmp_path / "tune.json"), timeout=180)
    assert results[0][-1][3] == "cache"  # AUTO ran the pinned kernel by kernel, untuned
    spec = GPT_OSS_FORM
    whole = MoE(spec, ExpertWeights.random(spec, 1), tiles=TINY_TILES, schedule=None)
    x, dy = _data(spec, 12)
    want = _run(whole, x, dy)
    ran(whole, ExactPath, ep=1, tiles=TINY_TILES)
    for i in range(len(runs)):
        got = [results[r][i] for r in (0, 1)]
        torch.testing.assert_close(torch.cat([g[0] for g in got], 1), want[0], **TOL[torch.float32])
        torch.testing.assert_close(torch.cat([g[1] for g in got], 1), want[1], **TOL[torch.float32])
        for name, grad in want[2].items():
            torch.testing.assert_close(got[0][2][name] + got[1][2][name], grad, **TOL[torch.float32])


def test_region_on_a_routing_made_elsewhere_is_the_forward_on_that_routing() -> None:
    """``MoE.region``: the experts on a caller's routing; on the layer's own routing it
    is the layer's forward, and it equals the dense reference on any routing."""
    spec = preset("tiny", torch.float32)
    w = ExpertWeights.random(spec, 5)
    layer = MoE(spec, w, virtual_ep=2, schedule=None)
    x = torch.randn(24, spec.hidden, generator=torch.Generator().manual_seed(5))
    r = route(x, w)
    torch.testing.assert_close(layer.region(x, r.ids, r.weights), layer(x), atol=0, rtol=0)
    ran(layer, ExactPath, ep=2, tokens=24)
    ids = torch.arange(24 * spec.top_k).reshape(24, spec.top_k) % spec.experts  # not the router's
    weights = torch.rand(24, spec.top_k, generator=torch.Generator().manual_seed(6))
    want = refs.dense_moe(x, w, Routing(ids, weights))
    torch.testing.assert_close(layer.region(x, ids, weights), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("path,ep", [(Path.TASKFLOW, 2), (Path.KERNEL_BY_KERNEL, 1), (Path.PERSISTENT, 1)],
                         ids=["taskflow-ep2", "kernel_by_kernel", "persistent-ep1"])
def test_a_strided_input_gives_the_bits_of_its_contiguous_copy(path, ep):
    """x a transposed view (strides (1, N)): the call's output and gradients are those of
    the same values laid out row by row (a path that binds x's storage as rows reads it
    so)."""
    if path is Path.PERSISTENT:
        pytest.importorskip("triton")
    spec, pinned = preset("tiny"), pin(path, ep)
    layer = MoE(spec, ExpertWeights.random(spec, 1), **pinned.options)
    g = torch.Generator().manual_seed(3)
    strided = torch.randn(spec.hidden, 8, generator=g).t()
    r = route(strided.contiguous(), layer.expert_weights())
    dy = torch.randn(8, spec.hidden, generator=g)
    runs = []
    for x in (strided, strided.contiguous()):
        x = x.detach().requires_grad_()
        out = layer.region(x, r.ids, r.weights.detach())
        out.backward(dy)
        runs.append((out.detach(), x.grad))
        ran(layer, pinned.kind, **pinned.fields)
    assert not strided.is_contiguous()
    for got, want in zip(*runs, strict=True):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("path,ep", [(Path.TASKFLOW, 2), (Path.KERNEL_BY_KERNEL, 1), (Path.PERSISTENT, 1)],
                         ids=["taskflow-ep2", "kernel_by_kernel", "persistent-ep1"])
def test_a_copied_layer_trains_alone_on_the_originals_path_and_load(path, ep):
    """``copy.deepcopy`` of a layer that has trained (an EMA or reference model): the
    copy's step gives the original's bits on the original's path, keeps its measured
    load, and owns its parameters; a pickled layer loads and gives the same bits."""
    if path is Path.PERSISTENT:
        pytest.importorskip("triton")
    spec, pinned = preset("tiny"), pin(path, ep)
    layer = MoE(spec, ExpertWeights.random(spec, 1), **pinned.options)
    x, dy = _data(spec, 8)
    _run(layer, x, dy)
    copied = copy.deepcopy(layer)
    np.testing.assert_array_equal(copied.expert_load(), layer.expert_load())
    got = _run(copied, x, dy)
    ran(copied, pinned.kind, **pinned.fields)
    layer.zero_grad()
    want = _run(layer, x, dy)
    for a, b in [(got[0], want[0]), (got[1], want[1]), *((got[2][n], want[2][n]) for n in want[2])]:
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    torch.testing.assert_close(torch.load(buffer, weights_only=False)(x), layer(x), atol=0, rtol=0)
    with torch.no_grad():
        for p in copied.parameters():
            p.mul_(2.0)
    torch.testing.assert_close(layer(x), got[0], atol=0, rtol=0)


@pytest.mark.parametrize("spec", [preset("tiny"), SOFTMAX, dataclasses.replace(SOFTMAX, expert_bias=True)],
                         ids=["sigmoid-shared", "softmax", "expert-bias"])
def test_a_layer_built_on_the_meta_device_draws_its_values_in_reset_parameters(spec):
    """``with torch.device("meta")`` a layer holds shapes only (a layer too large for host
    memory is built so); after ``to_empty`` its ``reset_parameters`` gives the parameters,
    buffers and outputs of ``MoE(spec, seed=...)`` built on the CPU, and it does so again
    after training moved them."""
    with torch.device("meta"):
        layer = MoE(spec, seed=3)
    assert {t.device.type for t in (*layer.parameters(), *layer.buffers())} == {"meta"}
    layer.to_empty(device="cpu")
    layer.reset_parameters()
    want = MoE(spec, seed=3)
    x, dy = _data(spec, 8)
    for _ in range(2):
        got = layer.state_dict()
        assert got.keys() == want.state_dict().keys()
        for name, value in want.state_dict().items():
            torch.testing.assert_close(got[name], value, atol=0, rtol=0, msg=name)
        torch.testing.assert_close(layer(x), want(x), atol=0, rtol=0)
        _run(layer, x, dy)
        torch.optim.SGD(layer.parameters(), lr=1.0).step()
        assert not torch.equal(layer.experts.down_proj, want.experts.down_proj)
        layer.reset_parameters()


@pytest.mark.parametrize("recompute", list(Recompute), ids=[r.value for r in Recompute])
def test_what_a_call_keeps_can_be_offloaded_by_saved_tensor_hooks(recompute):
    """What a call keeps goes through saved-tensor hooks (as ``save_on_cpu`` offloads):
    a hook that packs each tensor as a copy elsewhere and unpacks that copy leaves every
    gradient unchanged, and the backward reads only what the hook gave back."""
    spec, pinned = preset("tiny"), pin(Path.KERNEL_BY_KERNEL, 1)
    layer = MoE(spec, ExpertWeights.random(spec, 2), recompute=recompute, **pinned.options)
    x, dy = _data(spec, 16)
    plain = _run(layer, x, dy)
    plain = (plain[0], plain[1], {n: g.clone() for n, g in plain[2].items()})
    layer.zero_grad()
    copies = {}

    def pack(t):
        copy = t.clone()
        copies[id(copy)] = copy
        return copy

    def unpack(t):
        assert copies.get(id(t)) is t  # the backward reads only what the hook handed back
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        got = _run(layer, x, dy)
    assert copies
    ran(layer, pinned.kind, tokens=16, recompute=recompute, **pinned.fields)
    assert torch.equal(got[0], plain[0]) and torch.equal(got[1], plain[1])
    assert all(torch.equal(got[2][n], plain[2][n]) for n in plain[2])


# ---------------------------------------------------------------------------- the call protocol


def _protocol_counts(layer, x, dy):
    """(input scans, agreements opened) of one forward + backward of ``layer``, counted on
    every thread by the functions' code objects, whoever calls them and by any name."""
    import inspect
    import sys
    import threading

    from hpmoe import routing
    from hpmoe.runtime import Session

    scans = (routing.value_error, routing.input_status, routing._check_values, routing.input_error)
    named = (("scan", scans), ("agree", (Session.open_call,)))
    codes = {inspect.unwrap(f).__code__: name for name, fs in named for f in fs}
    counts = {"scan": 0, "agree": 0}

    def profile(frame, event, arg):
        if event == "call" and frame.f_code in codes:
            counts[codes[frame.f_code]] += 1
    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        _run(layer, x, dy)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return counts


@pytest.mark.parametrize("path", ONE_PROCESS, ids=[p.value for p in ONE_PROCESS])
def test_a_call_scans_its_input_once_in_one_process(path):
    spec, pinned = preset("tiny"), pin(path, 2)
    layer = MoE(spec, ExpertWeights.random(spec, 1), **pinned.options)
    x, dy = _data(spec, 16)
    assert _protocol_counts(layer, x, dy) == {"scan": 1, "agree": 0}
    ran(layer, pinned.kind, **pinned.fields)


def _protocol_step(rank, world, backend):
    spec = preset("tiny")
    pinned = dict(backend="kernel_by_kernel") if backend == "kernel_by_kernel" else dict(
        schedule=SchedulePolicy.HYPERPARALLEL, tiles=TINY_TILES)
    layer = MoE(spec, ExpertWeights.random(spec, 1), ep_group=dist.group.WORLD, **pinned)
    x, dy = _share(rank, (6, 6), spec)
    counts = _protocol_counts(layer, x, dy)
    kind = KernelByKernelPath if backend == "kernel_by_kernel" else RuntimePath
    ran(layer, kind, tokens=6)
    layer.close()
    return counts


@pytest.mark.parametrize("backend", ["kernel_by_kernel", "runtime"])
def test_a_distributed_call_opens_one_agreement_each_way_and_scans_its_input_once(backend):
    """Forward and backward each open one agreement (the forward's carries the input's
    verdict and the counts; no path opens one of its own), and the input is scanned once."""
    for counts in spawn_gloo(_protocol_step, 2, backend, timeout=180):
        assert counts == {"scan": 1, "agree": 2}, counts
