"""refs.py: the dense reference against brute force and autograd, the serialized EP
baseline on real gloo ranks against the dense reference, and the spawn helper."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from hpmoe.refs import SerialResult, dense_moe, expert_ffn, serialized_ep_forward
from hpmoe.routing import Routing, RoutingKind, route, synthetic_routing
from hpmoe.spec import GateKind, MoESpec, ParallelSpec, preset
from hpmoe.testing import spawn_gloo
from hpmoe.weights import ExpertWeights

DTYPES = [torch.float32, torch.bfloat16]


def _x(n: int, spec: MoESpec, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, spec.hidden, generator=torch.Generator().manual_seed(seed)).to(spec.dtype)


# ---------------------------------------------------------------------------- dense


def test_expert_ffn_is_swiglu() -> None:
    g = torch.Generator().manual_seed(0)
    x, w13, w2 = (torch.randn(*s, generator=g) for s in [(5, 8), (12, 8), (8, 6)])
    gate, up = w13[:6], w13[6:]
    expected = (F.silu(x @ gate.T) * (x @ up.T)) @ w2.T
    torch.testing.assert_close(expert_ffn(x, w13, w2), expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shared", [0, 1])
def test_one_expert_top1_is_the_dense_ffn(dtype: torch.dtype, shared: int) -> None:
    spec = MoESpec(hidden=16, ffn=8, experts=1, top_k=1, shared_experts=shared, dtype=dtype)
    w = ExpertWeights.random(spec, seed=1)
    x = _x(10, spec)
    routing = Routing(torch.zeros(10, 1, dtype=torch.int64), torch.ones(10, 1))
    expected = expert_ffn(x, w.w13[0], w.w2[0]).float()
    if shared:
        expected = expected + expert_ffn(x, w.shared_w13, w.shared_w2).float()
    assert torch.equal(dense_moe(x, w, routing), expected.to(dtype))


def _brute_force(x: torch.Tensor, ids: torch.Tensor, rw: torch.Tensor, w13: torch.Tensor,
                 w2: torch.Tensor, sw13: torch.Tensor | None, sw2: torch.Tensor | None) -> torch.Tensor:
    """One token, one slot at a time; returns fp32 (or fp64 for fp64 inputs)."""
    acc_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1], dtype=acc_dtype)
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            acc = acc + rw[t, j].to(acc_dtype) * expert_ffn(x[t:t + 1], w13[e], w2[e])[0].to(acc_dtype)
        if sw13 is not None:
            acc = acc + expert_ffn(x[t:t + 1], sw13, sw2)[0].to(acc_dtype)
        rows.append(acc)
    return torch.stack(rows)


SPECS = {
    "tiny": preset("tiny"),
    "softmax-noshared": MoESpec(hidden=24, ffn=12, experts=6, top_k=3, gate=GateKind.SOFTMAX,
                                dtype=torch.float32),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", [None, RoutingKind.HOT, RoutingKind.EMPTY_EXPERTS])
@pytest.mark.parametrize("name", sorted(SPECS))
def test_dense_matches_brute_force(name: str, kind: RoutingKind | None, dtype: torch.dtype) -> None:
    spec = SPECS[name].with_dtype(dtype)
    w = ExpertWeights.random(spec, seed=2)
    x = _x(12, spec, seed=3)
    par = ParallelSpec(ep=1, tokens_per_rank=12)
    r = route(x, w) if kind is None else synthetic_routing(kind, spec, par, seed=4)
    expected = _brute_force(x, r.ids, r.weights, w.w13, w.w2, w.shared_w13, w.shared_w2)
    out = dense_moe(x, w, r)
    assert out.dtype == dtype
    # per-row GEMMs (M=1) may round differently from grouped ones (M>1): allclose, not equal
    torch.testing.assert_close(out, expected.to(dtype), **({} if dtype == torch.bfloat16 else
                                                           {"rtol": 1e-5, "atol": 1e-6}))


GRAD_SPEC = MoESpec(hidden=8, ffn=4, experts=4, top_k=2, shared_experts=1, dtype=torch.float32)


def _grad_inputs(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """x, routing weights, w13, w2, shared w13, shared w2 (leaves needing grad) and ids."""
    g = torch.Generator().manual_seed(9)
    w = ExpertWeights.random(GRAD_SPEC, seed=9)
    tensors = [torch.randn(5, 8, generator=g), torch.rand(5, 2, generator=g) + 0.5,
               w.w13, w.w2, w.shared_w13, w.shared_w2]
    ids = torch.tensor([[0, 1], [1, 0], [3, 1], [1, 2], [0, 3]])  # expert 1 used in every slot
    return tuple(t.detach().to(dtype).requires_grad_() for t in tensors) + (ids,)


def test_brute_force_gradients_pass_gradcheck() -> None:
    x, rw, w13, w2, sw13, sw2, ids = _grad_inputs(torch.float64)
    assert torch.autograd.gradcheck(lambda *a: _brute_force(a[0], ids, *a[1:]),
                                    (x, rw, w13, w2, sw13, sw2))


def test_dense_backward_matches_float64_brute_force() -> None:
    x, rw, w13, w2, sw13, sw2, ids = _grad_inputs(torch.float32)
    weights = dataclasses.replace(ExpertWeights.random(GRAD_SPEC), w13=w13, w2=w2,
                                  shared_w13=sw13, shared_w2=sw2)
    out = dense_moe(x, weights, Routing(ids, rw))
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(10))
    grads = torch.autograd.grad((out * probe).sum(), (x, rw, w13, w2, sw13, sw2))
    ref_inputs = _grad_inputs(torch.float64)
    ref = _brute_force(ref_inputs[0], ids, *ref_inputs[1:6])
    ref_grads = torch.autograd.grad((ref * probe.double()).sum(), ref_inputs[:6])
    for name, got, want in zip(["x", "rw", "w13", "w2", "sw13", "sw2"], grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want.float(), rtol=1e-4, atol=1e-5, msg=name)


def test_dense_rejects_bad_input() -> None:
    spec = preset("tiny")
    w = ExpertWeights.random(spec)
    x = _x(4, spec)
    with pytest.raises(TypeError, match="x has dtype"):
        dense_moe(x.bfloat16(), w, route(x, w))
    with pytest.raises(ValueError, match="routing.ids has shape"):
        dense_moe(x[:3], w, route(x, w))
    bad = Routing(torch.full((4, 2), 8), torch.ones(4, 2))
    with pytest.raises(ValueError, match="expert id 8"):
        dense_moe(x, w, bad)


# ---------------------------------------------------------------------------- serialized EP


@dataclasses.dataclass
class Case:
    """A whole batch and how many of its tokens each rank holds."""

    x: torch.Tensor
    routing: Routing
    weights: ExpertWeights
    splits: list[int]

    def local(self, rank: int) -> tuple[torch.Tensor, ExpertWeights, Routing]:
        """(x, weights, routing) of rank ``rank``'s tokens, as ``serialized_ep_forward`` takes them."""
        lo = sum(self.splits[:rank])
        rows = slice(lo, lo + self.splits[rank])
        return self.x[rows], self.weights, Routing(self.routing.ids[rows], self.routing.weights[rows])


def _cases(ep: int) -> list[Case]:
    """Gate-routed fp32 and bf16 batches, and an uneven batch that leaves the last rank idle."""
    cases = []
    for dtype in DTYPES:
        spec = preset("tiny", dtype)
        w = ExpertWeights.random(spec, seed=11)
        x = _x(6 * ep, spec, seed=12)
        cases.append(Case(x, route(x, w), w, [6] * ep))
    spec = preset("tiny")
    splits = [5 + 2 * r for r in range(ep)]
    par = ParallelSpec(ep=ep, tokens_per_rank=sum(splits) // ep + 1)
    r = synthetic_routing(RoutingKind.EMPTY_RANK, spec, par, seed=13)
    n = sum(splits)
    x = _x(n, spec, seed=14)
    cases.append(Case(x, Routing(r.ids[:n], r.weights[:n]), ExpertWeights.random(spec, 15), splits))
    return cases


def _ep_worker(rank: int, world: int, cases: list[Case]) -> dict[str, object]:
    results = {"cases": [serialized_ep_forward(*case.local(rank)) for case in cases]}
    if world == 4:
        results.update(_group_checks(rank, cases[0]))
    return results


def _group_checks(rank: int, case: Case) -> dict[str, object]:
    """Ranks 2 and 3 as their own EP group; a group of 3 that cannot split 8 experts."""
    pair, trio = dist.new_group([2, 3]), dist.new_group([0, 1, 2])
    out: dict[str, object] = {}
    if rank >= 2:
        sub = dataclasses.replace(case, splits=[12, 12])
        out["pair"] = serialized_ep_forward(*sub.local(rank - 2), pair)
    if rank < 3:
        with pytest.raises(ValueError, match="ep=3 does not divide") as err:
            serialized_ep_forward(*case.local(rank), trio)
        out["trio"] = str(err.value)
    return out


def _expected_dispatch(case: Case, ep: int, dst: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows rank ``dst`` receives, built one row at a time, and its [ep, L] counts."""
    local = case.weights.spec.experts // ep
    rows, counts = [], torch.zeros(ep, local, dtype=torch.int64)
    for src in range(ep):
        x, _, r = case.local(src)
        for e in range(local):
            for t in range(x.shape[0]):
                hits = int((r.ids[t] == dst * local + e).sum())
                rows += [x[t]] * hits
                counts[src, e] += hits
    return (torch.stack(rows) if rows else case.x.new_empty(0, case.x.shape[1])), counts


def _check_rank(res: SerialResult, case: Case, ep: int, rank: int, ref: torch.Tensor) -> None:
    rows, counts = _expected_dispatch(case, ep, rank)
    assert torch.equal(res.recv_counts, counts)
    assert torch.equal(res.dispatch_recv, rows), "moved data must arrive bit-identical"
    _assert_close(res.combine_recv, _expected_combine(case, rank))  # M=1 rows: not bitwise
    _assert_same(res.out, ref)


def _expected_combine(case: Case, rank: int) -> torch.Tensor:
    """Expert outputs of this rank's rows, one row at a time, sorted by (expert, token, slot)."""
    x, _, r = case.local(rank)
    w = case.weights
    rows = sorted((int(r.ids[t, j]), t, j) for t in range(x.shape[0]) for j in range(r.ids.shape[1]))
    return torch.cat([expert_ffn(x[t:t + 1], w.w13[e], w.w2[e]) for e, t, _ in rows])


def _assert_same(out: torch.Tensor, ref: torch.Tensor) -> None:
    """bf16 is bitwise equal. fp32 is not always: CPU sgemm picks kernels by row count and
    thread count (measured: M < 4 rows, 1 vs 2 threads differ in the last bits), and the
    shared expert runs on T local rows here but on all N rows in dense_moe."""
    if out.dtype == torch.bfloat16:
        assert torch.equal(out, ref)
    else:
        _assert_close(out, ref)


def _assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    tol = {} if out.dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(out, ref, **tol)


@pytest.mark.parametrize("ep", [2, 4])
def test_serialized_ep_matches_dense(ep: int) -> None:
    cases = _cases(ep)
    results = spawn_gloo(_ep_worker, ep, cases)
    for i, case in enumerate(cases):
        ref = dense_moe(case.x, case.weights, case.routing)
        for rank in range(ep):
            lo = sum(case.splits[:rank])
            _check_rank(results[rank]["cases"][i], case, ep, rank, ref[lo:lo + case.splits[rank]])
    assert results[ep - 1]["cases"][2].dispatch_recv.shape[0] == 0  # EMPTY_RANK reached nobody
    if ep == 4:
        ref = dense_moe(cases[0].x, cases[0].weights, cases[0].routing)
        _assert_close(torch.cat([results[2]["pair"].out, results[3]["pair"].out]), ref)
        assert all("MoESpec.experts=8" in results[r]["trio"] for r in range(3))


# ---------------------------------------------------------------------------- spawn_gloo


def _rank_sum(rank: int, world: int, base: int) -> torch.Tensor:
    t = torch.tensor([base + rank])
    dist.all_reduce(t)
    return t


def _fail_on_rank_1(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank one is broken")
    dist.barrier()  # rank 0 waits for a peer that never comes


def _sleep(rank: int, world: int) -> None:
    time.sleep(60)


def test_spawn_gloo_returns_results_by_rank() -> None:
    assert [int(t) for t in spawn_gloo(_rank_sum, 2, 10)] == [21, 21]


def test_spawn_gloo_raises_child_traceback() -> None:
    with pytest.raises(RuntimeError, match=r"(?s)rank 1 of 2 failed.*ValueError: rank one is broken"):
        spawn_gloo(_fail_on_rank_1, 2, timeout=60)


def test_spawn_gloo_times_out() -> None:
    with pytest.raises(TimeoutError, match=r"ranks \[0\] did not finish within timeout=5"):
        spawn_gloo(_sleep, 1, timeout=5)


def test_reference_arguments_follow_moe_forward_and_a_swap_is_named() -> None:
    spec = preset("tiny")
    w = ExpertWeights.random(spec, 0)
    x = _x(4, spec, seed=1)
    with pytest.raises(TypeError, match="expected \\(x, weights: ExpertWeights, routing: Routing\\)"):
        dense_moe(x, route(x, w), w)
