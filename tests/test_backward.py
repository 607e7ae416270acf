"""Backward lowering and the exact backward executor against autograd through
``refs.dense_moe``; graph checks; order invariance."""

import dataclasses

import numpy as np
import pytest
import torch

from hpmoe import refs
from hpmoe.exec.arena import ArenaPool
from hpmoe.exec.exact import execute_forward
from hpmoe.exec.exact_backward import Gradients, execute_backward, moe_forward_backward
from hpmoe.exec.kernel_by_kernel import kbk_backward, kbk_forward
from hpmoe.ir.analysis import GraphError
from hpmoe.ir.graph import IS_PUT, TaskKind
from hpmoe.ir.semantics import check_trace
from hpmoe.ir.verify import verify_graph
from hpmoe.regions.backward import BackwardEvent, lower_backward
from hpmoe.regions.backward_kernels import BACKWARD, SavedActivations, rider, row_width
from hpmoe.regions.base import Kept
from hpmoe.routing import Routing, RoutingKind, synthetic_routing
from hpmoe.schedule import QUEUE_POLICIES, schedule, verify_schedule
from hpmoe.sim.presets import hardware_preset
from hpmoe.sim.simulate import simulate
from hpmoe.spec import Activation, GateKind, GluForm, MoESpec, ParallelSpec, preset
from hpmoe.weights import ExpertWeights

from .helpers import GPT_OSS_FORM, TINY_TILES, tiny_plan

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
NO_SHARED = MoESpec(hidden=24, ffn=12, experts=8, top_k=3, gate=GateKind.SOFTMAX, dtype=torch.float32)
GRAD_FIELDS = [f.name for f in dataclasses.fields(Gradients)]


def _spec(shared: bool, dtype: torch.dtype) -> MoESpec:
    return (preset("tiny") if shared else NO_SHARED).with_dtype(dtype)


def _inputs(spec, ep, tokens, kind, seed=0):
    w = ExpertWeights.random(spec, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(ep * tokens, spec.hidden, generator=g).to(spec.dtype)
    dy = torch.randn(ep * tokens, spec.hidden, generator=g).to(spec.dtype)
    return x, w, synthetic_routing(kind, spec, ParallelSpec(ep, tokens), seed), dy


def _autograd(x, w, routing, dy) -> Gradients:
    """Gradients of refs.dense_moe by autograd."""
    x = x.clone().requires_grad_()
    rw = routing.weights.clone().requires_grad_()
    names = ["w13", "w2"] + (["shared_w13", "shared_w2"] if w.has_shared else []) + (
        ["b13", "b2"] if w.biases else [])
    leaves = {n: getattr(w, n).clone().requires_grad_() for n in names}
    refs.dense_moe(x, dataclasses.replace(w, **leaves), Routing(routing.ids, rw)).backward(dy)

    def grad(name: str) -> torch.Tensor | None:
        return leaves[name].grad if name in leaves else None

    return Gradients(dx=x.grad, dweights=rw.grad, dw13=grad("w13"), dw2=grad("w2"),
                     dshared_w13=grad("shared_w13"), dshared_w2=grad("shared_w2"), db13=grad("b13"),
                     db2=grad("b2"))


def _assert_grads_equal(a: Gradients, b: Gradients, msg: object = "") -> None:
    for name in GRAD_FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None and y is None) or torch.equal(x, y), f"{name} differs {msg}"


# ---------------------------------------------------------------------------- graph


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("recompute", list(Kept), ids=[k.value for k in Kept])
@pytest.mark.parametrize("ep", [1, 2, 4])
@pytest.mark.parametrize("kind", list(RoutingKind))
def test_graphs_verify_and_thresholds_equal_signal_counts(kind, ep, recompute, shared):
    if kind is RoutingKind.EMPTY_RANK and ep == 1:
        pytest.skip("one rank cannot be left empty")
    g = lower_backward(tiny_plan(kind, ep=ep, tokens=7, moe=_spec(shared, torch.float32)), TINY_TILES,
                       recompute=recompute)
    verify_graph(g)
    counts = np.bincount(g.signals_global(), minlength=g.num_events)
    assert counts.tolist() == g.threshold.tolist()
    kinds = set(np.unique(g.kind).tolist())
    assert (TaskKind.SWIGLU_RECOMPUTE in kinds) == (recompute.activation and shared)  # the shared one only
    assert (TaskKind.SHARED_WGRAD_UP in kinds) == shared
    assert kinds <= set(BACKWARD.kernels) | set(BACKWARD.puts)


def test_travelling_input_rows_double_the_backward_dispatch_in_the_cost_columns():
    """The modelled bytes of GRAD_PERMUTE and GRAD_DISPATCH where the input rows travel
    beside their dy rows: twice the rows' elements moved and on the link; every other
    task and the graph's structure unchanged."""
    plan = tiny_plan(RoutingKind.ZIPF, ep=2, tokens=8)
    kept, again = (lower_backward(plan, TINY_TILES, recompute=k) for k in (Kept.ROWS, Kept.INPUT))
    h, esize = plan.moe.hidden, plan.moe.dtype.itemsize
    moved = np.isin(kept.kind, [TaskKind.GRAD_PERMUTE, TaskKind.GRAD_DISPATCH])
    rows = (kept.row1 - kept.row0)[moved]
    assert np.array_equal(kept.kind, again.kind) and np.array_equal(kept.wait, again.wait)
    np.testing.assert_array_equal(again.link_bytes[moved], 2 * kept.link_bytes[moved])
    permute = kept.kind[moved] == TaskKind.GRAD_PERMUTE
    np.testing.assert_array_equal(again.bytes[moved][permute], (2 * rows * 2 * h * esize + 4 * rows)[permute])
    np.testing.assert_array_equal(again.bytes[moved][~permute], 2 * rows[~permute] * 2 * h * esize)
    assert kept.link_bytes[moved].sum() > 0
    np.testing.assert_array_equal(again.bytes[~moved], kept.bytes[~moved])


def _producers(g, task):
    """Tasks signalling the event ``task`` waits on."""
    signaller = g.signaller()
    return signaller[g.signals_global() == g.wait_global()[task]]


def _written_rows(g, p):
    """(rank, row0, row1) a producer writes: the peer's rows for a put."""
    if IS_PUT[g.kind[p]]:
        return g.peer[p], g.dst_row0[p], g.dst_row0[p] + g.row1[p] - g.row0[p]
    return g.rank[p], g.row0[p], g.row1[p]


@pytest.mark.parametrize("recompute", list(Kept), ids=[k.value for k in Kept])
def test_expert_tasks_wait_on_exactly_the_tiles_producing_their_rows(recompute):
    g = lower_backward(tiny_plan(RoutingKind.ZIPF, ep=4, tokens=9), TINY_TILES, recompute=recompute)
    per_col_tiles = {TaskKind.DGRAD_DOWN: 1, TaskKind.WGRAD_DOWN: 1,
                     TaskKind.SWIGLU_BWD: 2, TaskKind.DGRAD_UP: 1, TaskKind.GRAD_COMBINE: 4,
                     TaskKind.WGRAD_UP: 1}  # producers per row: F = 2, H = 4 column tiles
    for task in np.flatnonzero(np.isin(g.kind, list(per_col_tiles))):
        prods = _producers(g, task)
        covered = np.zeros(int(g.row1[task] - g.row0[task]), np.int64)
        for p in prods:
            rank, r0, r1 = _written_rows(g, p)
            assert rank == g.rank[task] and r0 < g.row1[task] and r1 > g.row0[task], g.task(int(p))
            lo, hi = max(r0, g.row0[task]), min(r1, g.row1[task])
            covered[lo - g.row0[task]:hi - g.row0[task]] += 1
        wanted = per_col_tiles[TaskKind(int(g.kind[task]))]
        assert covered.tolist() == [wanted] * len(covered), g.task(int(task))


def test_each_weight_gradient_tile_is_one_task_over_all_the_experts_rows():
    plan = tiny_plan(RoutingKind.HOT, ep=2, tokens=11)
    g = lower_backward(plan, TINY_TILES)
    for kind, width in [(TaskKind.WGRAD_DOWN, plan.moe.hidden), (TaskKind.WGRAD_UP, 2 * plan.moe.ffn)]:
        for r in range(plan.par.ep):
            for e in range(plan.local_experts):
                t = np.flatnonzero((g.kind == kind) & (g.rank == r) & (g.expert == e))
                rows = int(plan.expert_rows(r)[e])
                assert len(t) == (0 if rows == 0 else -(-width // TINY_TILES.gemm_cols))
                assert (g.row1[t] - g.row0[t] == rows).all()
                edges = sorted(g.col0[t].tolist() + g.col1[t].tolist())
                assert edges == ([] if rows == 0 else [0] + sorted(2 * list(range(8, width, 8))) + [width])


def test_lowering_some_ranks_gives_the_same_tasks_and_events():
    plan = tiny_plan(RoutingKind.ZIPF, ep=4, tokens=6)
    full = lower_backward(plan, TINY_TILES, recompute=True)
    part = lower_backward(plan, TINY_TILES, ranks=(1, 2), recompute=True)
    mine = np.isin(full.rank, [1, 2])
    for col in ["kind", "rank", "peer", "expert", "row0", "row1", "col0", "col1", "wait", "flops"]:
        assert np.array_equal(getattr(part, col), getattr(full, col)[mine]), col
    for r in (1, 2):
        want = full.threshold[full.event_ptr[r]:full.event_ptr[r + 1]]
        assert part.threshold[part.event_ptr[r]:part.event_ptr[r + 1]].tolist() == want.tolist()


def test_events_have_readable_names():
    g = lower_backward(tiny_plan(RoutingKind.BALANCED, ep=2, tokens=8), TINY_TILES)
    ev = g.events
    dx2 = int(ev.base(1, BackwardEvent.DX)) + 2
    assert g.event_name(1, dx2) == f"event r1:{dx2} (DX 2)"
    assert g.event_name(0, 0) == "event r0:0 (GROWS 0)"
    assert g.event_name(0, ev.count(0)).endswith("(schedule barrier)")


def test_bad_lowering_arguments_are_refused():
    plan = tiny_plan(ep=2)
    with pytest.raises(ValueError, match="ranks=.*outside"):
        lower_backward(plan, TINY_TILES, ranks=(2,))
    with pytest.raises(TypeError, match="recompute"):
        lower_backward(plan, TINY_TILES, recompute=1)


@pytest.mark.parametrize("policy", QUEUE_POLICIES)
def test_every_scheduler_and_the_simulator_accept_the_backward_graph(policy):
    """Each scheduler's schedule of the backward graph, replayed by the simulator, keeps
    the reference rule (no task before its event), and the exact executor run in the
    simulated start order gives autograd's gradients, the same bits as in task-id order."""
    x, w, r, dy = _inputs(_spec(True, torch.float32), 2, 8, RoutingKind.ZIPF)
    g = lower_backward(tiny_plan(RoutingKind.ZIPF, ep=2, tokens=8), TINY_TILES, recompute=True)
    hw = hardware_preset("ascend-a3")
    s = schedule(g, policy, hw)
    verify_schedule(s)
    t = simulate(s, hw).timeline
    check_trace(g, t.start, t.end)
    order = np.lexsort((np.arange(g.num_tasks), t.end, t.start))
    step = moe_forward_backward(x, w, r, dy, 2, TINY_TILES, recompute=True, backward_order=order).backward
    assert all(np.array_equal(getattr(step.graph, c), getattr(g, c)) for c in ("kind", "wait", "row0"))
    in_id_order = moe_forward_backward(x, w, r, dy, 2, TINY_TILES, recompute=True).backward
    _assert_grads_equal(step.grads, in_id_order.grads)
    want = _autograd(x, w, r, dy)
    for name in GRAD_FIELDS:
        if getattr(want, name) is not None:
            torch.testing.assert_close(getattr(step.grads, name), getattr(want, name), **TOL[torch.float32])


# ---------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ep", [1, 2, 4])
@pytest.mark.parametrize("kind", list(RoutingKind))
def test_gradients_match_autograd_through_the_dense_reference(dtype, ep, kind):
    if kind is RoutingKind.EMPTY_RANK and ep == 1:
        pytest.skip("one rank cannot be left empty")
    for shared in (True, False):
        x, w, r, dy = _inputs(_spec(shared, dtype), ep, 5, kind, seed=ep)
        got = moe_forward_backward(x, w, r, dy, ep, TINY_TILES).backward.grads
        want = _reference(x, w, r, dy)
        for name in GRAD_FIELDS:
            a, b = getattr(got, name), getattr(want, name)
            assert (a is None) == (b is None) == (name.startswith("dshared") and not shared or
                                                  name.startswith("db")), name
            if a is not None:
                torch.testing.assert_close(a, b, **TOL[dtype], msg=lambda m, n=name: f"{n}: {m}")


def _reference(x: torch.Tensor, w: ExpertWeights, r: Routing, dy: torch.Tensor) -> Gradients:
    """What a taskflow's gradients must be: autograd through ``refs.dense_moe`` in fp32;
    in bf16 kernel by kernel's (itself checked against autograd), whose rounding the
    taskflows share (da = w * (dy @ W2), dW2 from w * act(h)), so that the two paths agree
    closer than either agrees with autograd."""
    if w.spec.dtype == torch.float32:
        return _autograd(x, w, r, dy)
    pool = ArenaPool()
    _, state = kbk_forward(x, r, w, None, pool, save=True)
    return kbk_backward(state, dy, pool)


FORMS = {"gpt-oss": GPT_OSS_FORM,
         "clamped-gelu": dataclasses.replace(GPT_OSS_FORM, activation=Activation.GELU,
                                             glu=GluForm(limit=0.5))}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ep", [1, 2, 4])
@pytest.mark.parametrize("recompute", list(Kept), ids=[k.value for k in Kept])
@pytest.mark.parametrize("form", list(FORMS))
def test_expert_biases_and_the_clamped_interleaved_glu_match_autograd(form, dtype, ep, recompute):
    """GPT-OSS's expert form (and a clamped GeGLU): every gradient (the biases' included)
    against autograd through refs.dense_moe; the clamp is crossed, so a kernel ignoring it
    would fail."""
    spec = FORMS[form].with_dtype(dtype)
    x, w, r, dy = _inputs(spec, ep, 5, RoutingKind.ZIPF, seed=ep)
    step = moe_forward_backward(x, w, r, dy, ep, TINY_TILES, recompute=recompute)
    torch.testing.assert_close(step.out, refs.dense_moe(x, w, r), **TOL[dtype])
    got, want = step.backward.grads, _reference(x, w, r, dy)
    for name in GRAD_FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None) == name.startswith("dshared"), name
        if a is not None:
            torch.testing.assert_close(a, b, **TOL[dtype], msg=lambda m, n=name: f"{n}: {m}")
    h = torch.cat([b.saved.h for b in step.backward.buffers])
    gate, up = (h[:, 0::2], h[:, 1::2]) if spec.glu.interleaved else h.chunk(2, dim=1)
    assert bool((gate > 0.5).any() and (up.abs() > 0.5).any())  # the clamp was crossed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recompute", [Kept.ROWS, Kept.INPUT], ids=["rows", "input"])
def test_recompute_gives_the_same_bits(dtype, recompute):
    """The shared activation recomputed, and the input rows travelling again beside their
    dy rows instead of kept: every gradient keeps its bits."""
    x, w, r, dy = _inputs(_spec(True, dtype), 2, 7, RoutingKind.ZIPF, seed=3)
    plain = moe_forward_backward(x, w, r, dy, 2, TINY_TILES).backward.grads
    again = moe_forward_backward(x, w, r, dy, 2, TINY_TILES, recompute=recompute).backward.grads
    _assert_grads_equal(plain, again)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bitwise_identical_across_random_valid_orders_and_runs(dtype):
    x, w, r, dy = _inputs(_spec(True, dtype), 4, 6, RoutingKind.ZIPF, seed=5)
    base = moe_forward_backward(x, w, r, dy, 4, TINY_TILES, recompute=True).backward.grads
    _assert_grads_equal(moe_forward_backward(x, w, r, dy, 4, TINY_TILES, recompute=True).backward.grads,
                        base, "across runs")
    for seed in range(12):  # odd seeds: the input rows travel again beside their dy rows
        got = moe_forward_backward(x, w, r, dy, 4, TINY_TILES, recompute=(Kept.ROWS, Kept.INPUT)[seed % 2],
                                   forward_order=seed, backward_order=100 + seed).backward.grads
        _assert_grads_equal(got, base, f"order seed {seed}")


def test_an_invalid_order_is_refused():
    x, w, r, dy = _inputs(_spec(True, torch.float32), 2, 4, RoutingKind.BALANCED)
    res = moe_forward_backward(x, w, r, dy, 2, TINY_TILES)
    backwards = np.arange(res.backward.graph.num_tasks)[::-1].copy()
    with pytest.raises(GraphError, match="before its event"):
        moe_forward_backward(x, w, r, dy, 2, TINY_TILES, backward_order=backwards)


def test_saved_activations_shrink_with_recompute():
    x, w, r, _ = _inputs(_spec(True, torch.float32), 2, 8, RoutingKind.BALANCED)
    buf = execute_forward(x, w, r, 2, TINY_TILES).buffers[0]
    spec = w.spec
    kept = SavedActivations.from_forward(buf, recompute=False).nbytes()
    lean = SavedActivations.from_forward(buf, recompute=True).nbytes()
    assert kept - lean == 8 * spec.shared_ffn * 4  # the shared activation; the routed one is never kept
    # no expert output and no routed activation: the received rows and the pre-activations
    assert lean == (buf.recv.numel() + buf.h.numel() + buf.sh.numel()) * 4
    # rows that travel again: the pre-activations alone (and the layer input, the caller's)
    assert SavedActivations.from_forward(buf, Kept.INPUT).nbytes() == (buf.h.numel() + buf.sh.numel()) * 4


def test_bad_backward_inputs_are_refused():
    x, w, r, dy = _inputs(_spec(True, torch.float32), 2, 4, RoutingKind.BALANCED)
    fwd = execute_forward(x, w, r, 2, TINY_TILES)
    plan = fwd.plan
    saved = [SavedActivations.from_forward(b, False) for b in fwd.buffers]
    with pytest.raises(ValueError, match="dy has shape"):
        execute_backward(saved, plan, dy[:-1], w, r, TINY_TILES)
    with pytest.raises(TypeError, match="dy has dtype"):
        execute_backward(saved, plan, dy.double(), w, r, TINY_TILES)
    with pytest.raises(ValueError, match="saved has 1 ranks"):
        execute_backward(saved[:1], plan, dy, w, r, TINY_TILES)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [32, 33])
def test_the_value_riding_after_a_row_leaves_the_row_alone(dtype, hidden):
    """A travelling row's float32 rides after its H elements, aligned even for an odd H in
    a 2-byte dtype, and holds a float32 exactly (a routing weight, a router gradient)."""
    rows = torch.zeros(3, row_width(hidden), dtype=dtype)
    rows[:, :hidden] = 1.0
    value = torch.tensor([0.1234567, -3.5e-7, 12345.678], dtype=torch.float32)
    rider(rows).copy_(value)
    assert torch.equal(rider(rows), value)
    assert bool((rows[:, :hidden] == 1.0).all())


def test_the_former_bias_gradient_shapes_still_answers_with_a_deprecation_warning():
    from hpmoe.regions.backward_kernels import bias_gradient_shapes, gradient_shapes

    plan = tiny_plan(RoutingKind.ZIPF, ep=2, tokens=8, moe=FORMS["gpt-oss"])
    with pytest.warns(DeprecationWarning, match="bias_gradient_shapes is deprecated"):
        old = bias_gradient_shapes(plan)
    new = gradient_shapes(plan.moe, plan.local_experts, 8, 0)
    assert set(old) == {"db13", "db2"} and old == {n: new[n] for n in old}
