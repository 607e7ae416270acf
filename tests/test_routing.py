"""routing.py against transformers' routers, a brute-force plan, and its own promises."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hpmoe.nn.hf import randomize_moe_, spec_from_hf, tiny_deepseek_v3_config, tiny_qwen3_moe_config
from hpmoe.routing import (
    Routing,
    RoutingKind,
    bare,
    check_input,
    check_routing,
    expert_counts,
    plan_routing,
    ranks_per_token,
    route,
    synthetic_routing,
)
from hpmoe.spec import GateKind, MoESpec, ParallelSpec, preset
from hpmoe.weights import ExpertWeights

# ---------------------------------------------------------------------------- gates vs transformers


def _by_id(ids: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort each token's choices by expert id, so sets compare with torch.equal."""
    idx = ids.argsort(dim=1)
    return ids.gather(1, idx), w.gather(1, idx)


def _ours(spec: MoESpec, router: torch.nn.Module) -> ExpertWeights:
    bias = getattr(router, "e_score_correction_bias", torch.zeros(spec.experts))
    return dataclasses.replace(ExpertWeights.random(spec), router=router.weight.detach().clone(),
                               router_bias=bias.detach().float().clone())


def _deepseek_router(norm: bool) -> tuple[MoESpec, torch.nn.Module]:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = tiny_deepseek_v3_config(n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                                     topk_group=2, norm_topk_prob=norm)
    return spec_from_hf(config, torch.float32), randomize_moe_(DeepseekV3TopkRouter(config), seed=3)


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sigmoid_gate_matches_deepseek_v3_router(norm: bool, dtype: torch.dtype) -> None:
    spec, router = _deepseek_router(norm)
    weights = _ours(spec.with_dtype(dtype), router)
    x = torch.randn(64, spec.hidden, generator=torch.Generator().manual_seed(0)).to(dtype)
    _, hf_w, hf_ids = router(x)
    ours = route(x, weights)
    ids, w = _by_id(ours.ids, ours.weights)
    ref_ids, ref_w = _by_id(hf_ids, hf_w)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w)


def test_deepseek_comparison_exercises_bias_and_groups() -> None:
    """Guard the test above: bias and group limits change some choices on these inputs."""
    spec, router = _deepseek_router(True)
    weights = _ours(spec, router)
    x = torch.randn(64, spec.hidden, generator=torch.Generator().manual_seed(0))
    ids = route(x, weights).ids.sort(dim=1).values
    no_bias = dataclasses.replace(weights, router_bias=torch.zeros(spec.experts))
    one_group = dataclasses.replace(weights, spec=dataclasses.replace(spec, groups=1, top_groups=1))
    assert not torch.equal(ids, route(x, no_bias).ids.sort(dim=1).values)
    assert not torch.equal(ids, route(x, one_group).ids.sort(dim=1).values)


@pytest.mark.parametrize("norm", [True, False])
def test_softmax_gate_matches_qwen3_moe_router(norm: bool) -> None:
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    config = tiny_qwen3_moe_config(num_experts=16, num_experts_per_tok=4, norm_topk_prob=norm)
    spec = spec_from_hf(config, torch.float32)
    router = randomize_moe_(Qwen3MoeTopKRouter(config), seed=4)
    x = torch.randn(64, spec.hidden, generator=torch.Generator().manual_seed(1))
    _, hf_w, hf_ids = router(x)
    ours = route(x, _ours(spec, router))
    ids, w = _by_id(ours.ids, ours.weights)
    ref_ids, ref_w = _by_id(hf_ids, hf_w)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w)


# ---------------------------------------------------------------------------- plan vs brute force


def _brute_plan(ids: torch.Tensor, ep: int, local: int) -> dict[str, torch.Tensor]:
    """The plan built one row at a time with python lists."""
    n, k = ids.shape
    tpr = n // ep
    order, pos, send = [], [[[0] * k for _ in range(tpr)] for _ in range(ep)], []
    counts = [[[0] * local for _ in range(ep)] for _ in range(ep)]
    for s in range(ep):
        rows = sorted((int(ids[s * tpr + t, j]), t * k + j) for t in range(tpr) for j in range(k))
        order.append([flat for _, flat in rows])
        for p, (expert, flat) in enumerate(rows):
            pos[s][flat // k][flat % k] = p
            counts[s][expert // local][expert % local] += 1
        send.append(_prefix([counts[s][d][e] for d in range(ep) for e in range(local)]))
    recv = [_prefix([counts[s][d][e] for e in range(local) for s in range(ep)]) for d in range(ep)]
    return {"order": torch.tensor(order), "pos": torch.tensor(pos), "counts": torch.tensor(counts),
            "send_offsets": torch.tensor(send), "recv_offsets": torch.tensor(recv)}


def _prefix(values: list[int]) -> list[int]:
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return out


@settings(max_examples=30, deadline=None)
@given(ep=st.sampled_from([1, 2, 4]), local=st.integers(1, 3), tpr=st.integers(1, 5),
       k=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_plan_matches_brute_force(ep: int, local: int, tpr: int, k: int, seed: int) -> None:
    experts = ep * local
    k = min(k, experts)
    moe = MoESpec(hidden=8, ffn=4, experts=experts, top_k=k, dtype=torch.float32)
    ids = torch.randint(0, experts, (ep * tpr, k), generator=torch.Generator().manual_seed(seed))
    plan = plan_routing(ids, moe, ParallelSpec(ep=ep, tokens_per_rank=tpr))
    for name, expected in _brute_plan(ids, ep, local).items():
        assert torch.equal(getattr(plan, name), expected), name
    # the invariants the brute force encodes, stated directly
    flat = ids.view(ep, tpr * k)
    assert int(plan.counts.sum()) == ep * tpr * k
    sorted_ids = flat.gather(1, plan.order)
    assert bool((sorted_ids[:, 1:] >= sorted_ids[:, :-1]).all())
    assert torch.equal(plan.order.gather(1, plan.pos.view(ep, -1)), torch.arange(tpr * k).expand(ep, -1))
    for d in range(ep):
        assert plan.recv_rows(d) == int(plan.counts[:, d].sum())
        assert torch.equal(plan.expert_rows(d), plan.counts[:, d].sum(0))


# ---------------------------------------------------------------------------- synthetic routings

PAR = ParallelSpec(ep=2, tokens_per_rank=16)


@pytest.mark.parametrize("kind", list(RoutingKind))
def test_synthetic_routing_is_valid(kind: RoutingKind) -> None:
    moe = preset("tiny")
    r = synthetic_routing(kind, moe, PAR, seed=5)
    check_routing(r, moe, PAR.ep * PAR.tokens_per_rank)
    assert all(len(set(row.tolist())) == moe.top_k for row in r.ids), "repeated expert in a token"
    assert bool((r.weights > 0).all())
    torch.testing.assert_close(r.weights.sum(1), torch.full((r.tokens,), moe.routed_scaling))
    again = synthetic_routing(kind, moe, PAR, seed=5)
    assert torch.equal(r.ids, again.ids) and torch.equal(r.weights, again.weights)


def _counts(kind: RoutingKind, moe: MoESpec | None = None) -> torch.Tensor:
    moe = moe or preset("tiny")
    return torch.bincount(synthetic_routing(kind, moe, PAR, seed=6).ids.flatten(), minlength=moe.experts)


def test_balanced_counts_are_equal() -> None:
    counts = _counts(RoutingKind.BALANCED)
    assert torch.equal(counts, torch.full_like(counts, 32 * 2 // 8))


def test_hot_expert_gets_every_token() -> None:
    r = synthetic_routing(RoutingKind.HOT, preset("tiny"), PAR, seed=7)
    assert bool((r.ids == 0).any(dim=1).all())


def test_empty_experts_get_no_rows() -> None:
    counts = _counts(RoutingKind.EMPTY_EXPERTS)
    assert int(counts[1::2].sum()) == 0 and bool((counts[0::2] > 0).all())


def test_last_rank_receives_nothing() -> None:
    moe = preset("tiny")
    r = synthetic_routing(RoutingKind.EMPTY_RANK, moe, PAR, seed=8)
    plan = plan_routing(r.ids, moe, PAR)
    assert plan.recv_rows(PAR.ep - 1) == 0 and plan.recv_rows(0) == r.ids.numel()


def test_zipf_is_skewed() -> None:
    moe = MoESpec(hidden=8, ffn=4, experts=16, top_k=2, dtype=torch.float32)
    counts = _counts(RoutingKind.ZIPF, moe)
    assert int(counts.max()) > 2 * int(counts.float().mean())


# ---------------------------------------------------------------------------- bad input


def _tiny_weights() -> ExpertWeights:
    return ExpertWeights.random(preset("tiny"))


def test_route_rejects_wrong_shape() -> None:
    with pytest.raises(ValueError, match=r"x has shape \(4, 31\)"):
        route(torch.randn(4, 31), _tiny_weights())


def test_route_rejects_wrong_dtype() -> None:
    with pytest.raises(TypeError, match="x has dtype torch.bfloat16"):
        route(torch.randn(4, 32, dtype=torch.bfloat16), _tiny_weights())


def test_route_rejects_nan() -> None:
    x = torch.randn(4, 32)
    x[2, 5] = float("nan")
    with pytest.raises(ValueError, match="x has NaN at row 2"):
        route(x, _tiny_weights())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_one_pass_value_check_is_isfinite_all(dtype: torch.dtype) -> None:
    """``check_input``'s min/max check against its definition: every position of NaN,
    +inf and -inf in x and in the weights, extreme finite values and the empty batch."""
    spec = dataclasses.replace(preset("tiny"), hidden=5, dtype=dtype)
    x = torch.randn(6, 5).to(dtype)
    ok = Routing(torch.zeros(6, spec.top_k, dtype=torch.int64), torch.ones(6, spec.top_k))
    check_input(x, ok, spec)
    check_input(x[:0], Routing(ok.ids[:0], ok.weights[:0]), spec)
    big = torch.full((3, 5), torch.finfo(dtype).max, dtype=dtype)
    big[1, 1] = torch.finfo(dtype).min
    check_input(big, Routing(ok.ids[:3], ok.weights[:3]), spec)
    for value in (float("nan"), float("inf"), -float("inf")):
        kind = "NaN" if value != value else "inf"
        for pos in [(0, 0), (3, 2), (5, 1)]:
            y = x.clone()
            y[pos] = value
            with pytest.raises(ValueError, match=f"x has {kind} at row {pos[0]}"):
                check_input(y, ok, spec)
            w = ok.weights.clone()
            w[pos[0], pos[1] % spec.top_k] = value
            with pytest.raises(ValueError, match="routing.weights contains NaN or inf"):
                check_input(x, Routing(ok.ids, w), spec)


def test_expert_counts_is_bincount() -> None:
    ids = torch.tensor([[0, 3], [3, 3], [5, 0]])
    assert expert_counts(ids, 7).tolist() == torch.bincount(ids.reshape(-1), minlength=7).tolist()
    assert expert_counts(ids[:0], 7).tolist() == [0] * 7


@pytest.mark.parametrize("bad", [-1, 8])
def test_check_routing_rejects_expert_out_of_range(bad: int) -> None:
    ids = torch.tensor([[0, 1], [2, bad]])
    with pytest.raises(ValueError, match=f"routing.ids contains expert id {bad}"):
        check_routing(Routing(ids, torch.ones(2, 2)), preset("tiny"), 2)


def test_check_routing_rejects_wrong_dtypes_and_shapes() -> None:
    moe = preset("tiny")
    with pytest.raises(TypeError, match="routing.ids"):
        check_routing(Routing(torch.zeros(2, 2, dtype=torch.int32), torch.ones(2, 2)), moe, 2)
    with pytest.raises(ValueError, match="routing.weights has shape"):
        check_routing(Routing(torch.zeros(2, 2, dtype=torch.int64), torch.ones(2, 3)), moe, 2)
    with pytest.raises(ValueError, match="routing.ids has shape"):
        check_routing(Routing(torch.zeros(3, 2, dtype=torch.int64), torch.ones(3, 2)), moe, 2)


def test_ep_must_divide_experts() -> None:
    moe, par = preset("tiny"), ParallelSpec(ep=3, tokens_per_rank=2)
    with pytest.raises(ValueError, match="ParallelSpec.ep=3"):
        plan_routing(torch.zeros(6, 2, dtype=torch.int64), moe, par)
    with pytest.raises(ValueError, match="ParallelSpec.ep=3"):
        synthetic_routing(RoutingKind.EMPTY_RANK, moe, par)


def test_top_k_above_experts_is_rejected() -> None:
    with pytest.raises(ValueError, match="MoESpec.top_k=9"):
        MoESpec(hidden=8, ffn=4, experts=8, top_k=9)
    with pytest.raises(ValueError, match="top_k=5"):
        synthetic_routing(RoutingKind.EMPTY_EXPERTS, MoESpec(hidden=8, ffn=4, experts=8, top_k=5), PAR)


# ---------------------------------------------------------------------------- grouped synthetic

def test_grouped_routing_keeps_each_token_in_its_top_groups():
    """8 experts in 4 groups of 2, top-2 groups, top-4: a token takes both experts of each of
    its two groups; with one group per rank (EP 4) it reaches exactly 2 ranks."""
    moe = MoESpec(hidden=8, ffn=4, experts=8, top_k=4, groups=4, top_groups=2, gate=GateKind.SIGMOID)
    par = ParallelSpec(ep=4, tokens_per_rank=64)
    ids = synthetic_routing(RoutingKind.GROUPED, moe, par, seed=3).ids
    groups = (ids // 2).sort(dim=1).values
    assert torch.equal(groups[:, 0::2], groups[:, 1::2]) and bool((groups[:, 0] != groups[:, 2]).all())
    assert ranks_per_token(ids, moe, par) == 2.0
    assert len(ids.unique(dim=1)[0]) == 4  # distinct experts per token


def test_ranks_per_token_counts_distinct_owners():
    moe = MoESpec(hidden=8, ffn=4, experts=8, top_k=2)
    par = ParallelSpec(ep=4, tokens_per_rank=1)
    ids = torch.tensor([[0, 1], [0, 2], [7, 6], [3, 4]])  # owners (0,0) (0,1) (3,3) (1,2)
    assert ranks_per_token(ids, moe, par) == 1.5


def test_grouped_routing_matches_deepseek_v3_spread():
    """DeepSeek-V3's 8 groups / top-4 over random scores: ~3.95 ranks per token at EP 8."""
    moe = preset("deepseek-v3")
    par = ParallelSpec(ep=8, tokens_per_rank=256)
    assert ranks_per_token(synthetic_routing(RoutingKind.GROUPED, moe, par).ids, moe, par) == \
        pytest.approx(3.95, abs=0.05)


def test_bare_detaches_only_what_records_history():
    plain = torch.ones(3)
    assert bare(plain) is plain  # no detach dispatched where there is nothing to detach
    leaf = torch.ones(3, requires_grad=True)
    out = bare(leaf * 2)
    assert not out.requires_grad and out.grad_fn is None
    assert torch.equal(out, torch.full((3,), 2.0))
