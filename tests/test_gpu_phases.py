"""Kernel by kernel's memory-bound phases and the input scan as one Triton launch each
(``hpmoe.gpu.phases``, what a CUDA call runs), in the Triton interpreter, against the
torch versions (``exec.phases``, ``routing.input_status``): blocks cut by the row and
column counts."""

import pytest
import torch

pytest.importorskip("triton")

from hpmoe.exec.phases import permute  # noqa: E402
from hpmoe.gpu import phases  # noqa: E402
from hpmoe.gpu.phases import (  # noqa: E402
    SLOT_IDS,
    resolve_slots,
    scan,
    triton_glu,
    triton_glu_backward,
    triton_permute,
)
from hpmoe.regions.backward_kernels import glu_backward  # noqa: E402
from hpmoe.regions.kernels import glu  # noqa: E402
from hpmoe.regions.slot_routing import resolve_slots as torch_resolve_slots  # noqa: E402
from hpmoe.regions.slots import SlotShape  # noqa: E402
from hpmoe.routing import expert_counts, input_status, status_error  # noqa: E402
from hpmoe.spec import Activation, GateKind, GluForm, MoESpec, TileSpec  # noqa: E402

from .slot_routings import from_counts, twenty_routings  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]
SHAPES = [(37, 48), (5, 16), (64, 300)]  # (rows, F): a partial row block, one small block, a partial
# column block


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m_f", SHAPES)
def test_the_gated_activation_and_its_gradient_against_torch(dtype, m_f):
    """bf16: the torch bits (every product rounded as torch rounds it); fp32: within
    rounding (the interpreter's exp is numpy's, torch's CPU one SLEEF's)."""
    m, f = m_f
    close = {"rtol": 0, "atol": 0} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
    g = torch.Generator().manual_seed(m)
    h = (torch.randn(m, 2 * f, generator=g) * 3).to(dtype)
    da = torch.randn(m, f, generator=g).to(dtype)
    want, got = torch.empty(m, f, dtype=dtype), torch.full((m, f), float("nan"), dtype=dtype)
    glu(h, want, Activation.SILU)
    triton_glu(h, got, Activation.SILU, GluForm(), interpret=True)
    torch.testing.assert_close(got, want, **close)
    want_dh, got_dh = torch.empty(m, 2 * f, dtype=dtype), torch.full((m, 2 * f), float("nan"), dtype=dtype)
    glu_backward(h, da, want_dh, Activation.SILU)
    triton_glu_backward(h, da, got_dh, Activation.SILU, interpret=True)
    torch.testing.assert_close(got_dh, want_dh, **close)


def test_other_activations_fall_back_to_torch():
    h, out = torch.randn(4, 8), torch.empty(4, 4)
    want = torch.empty(4, 4)
    glu(h, want, Activation.GELU)
    triton_glu(h, out, Activation.GELU, GluForm(), interpret=True)
    assert torch.equal(out, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t_h_k", [(37, 300, 3), (5, 16, 1), (20, 40, 8)])
def test_the_permute_gathers_the_torch_rows(dtype, t_h_k):
    t, h, k = t_h_k
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, h, generator=g).to(dtype)
    order = torch.randperm(t * k, generator=g)
    want = permute(x, order, k, torch.empty(t * k, h, dtype=dtype))
    assert torch.equal(triton_permute(x, order, k, torch.empty(t * k, h, dtype=dtype), interpret=True), want)


def _scan_case(seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(23, 40, generator=g)
    ids = torch.randint(0, 8, (23, 3), generator=g)
    w = torch.rand(23, 3, generator=g)
    if seed % 4 == 1:
        x[17, 5], x[9, 39], x[9, 2] = float("nan"), float("inf"), float("nan")
    if seed % 4 == 2:
        x[3, 1] = float("-inf")
        ids[20, 2] = 12
    if seed % 4 == 3:
        ids[0, 0], ids[5, 1] = -4, 9
        w[22, 2] = float("nan")
    return x, ids, w


@pytest.mark.parametrize("seed", range(8))
def test_the_scan_finds_what_the_torch_scan_finds_and_counts_the_clamped_ids(seed):
    x, ids, w = _scan_case(seed)
    got = scan(x, ids, w, 8, interpret=True)
    want = input_status(8, x, ids, w).tolist()
    assert got.status.tolist()[0] == want[0]
    assert str(status_error(got.status.tolist(), 8)) == str(status_error(want, 8))
    assert torch.equal(got.ids, ids.clamp(0, 7))
    assert torch.equal(got.counts, expert_counts(ids.clamp(0, 7), 8))


def test_the_scan_keeps_the_first_fault_it_was_handed_and_fills_a_clean_one():
    held = torch.zeros(3, dtype=torch.int64)
    scan(*_scan_case(0), 8, held, interpret=True)
    assert held.tolist() == [0, 0, 0]
    scan(*_scan_case(2), 8, held, interpret=True)  # inf at row 3 (before the id 12)
    first = held.tolist()
    assert str(status_error(first, 8)) == "x has inf at row 3"
    scan(*_scan_case(1), 8, held, interpret=True)
    assert held.tolist() == first


def test_an_empty_call_scans_clean():
    x, ids, w = torch.zeros(0, 4), torch.zeros(0, 2, dtype=torch.int64), torch.zeros(0, 2)
    got = scan(x, ids, w, 8, interpret=True)
    assert got.status.tolist()[0] == 0 and got.counts.tolist() == [0] * 8


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weighted", [True, False])
def test_the_router_gradient_backward_against_torch(dtype, weighted):
    """``glu_router_backward`` in one launch: dh and w * a within an ulp of the torch
    version's (the same roundings, but the interpreter's exp is numpy's and torch's CPU
    one SLEEF's), ds within fp32 rounding (another order of the sum)."""
    from hpmoe.exec.phases import glu_router_backward
    from hpmoe.gpu.phases import triton_glu_router_backward

    m, f = 37, 300
    g = torch.Generator().manual_seed(f)
    h = (torch.randn(m, 2 * f, generator=g) * 3).to(dtype)
    d = torch.randn(m, f, generator=g).to(dtype)
    w = torch.rand(m, generator=g) + 0.1 if weighted else None
    out = {}
    for name, fn in (("torch", glu_router_backward), ("triton", triton_glu_router_backward)):
        dh, aw = (torch.full(shape, float("nan"), dtype=dtype) for shape in ((m, 2 * f), (m, f)))
        extra = {"interpret": True} if name == "triton" else {}
        ds = fn(h, d, w, dh, aw, Activation.SILU, GluForm(), **extra)
        out[name] = (dh, aw, ds)
    close = {"rtol": 2**-7, "atol": 1e-6} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
    for a, b in zip(out["triton"][:2], out["torch"][:2], strict=True):
        torch.testing.assert_close(a, b, **close)
    if weighted:
        torch.testing.assert_close(out["triton"][2], out["torch"][2], rtol=1e-5, atol=1e-4)
    else:
        assert out["triton"][2] is None and out["torch"][2] is None


SLOT_SPEC = MoESpec(hidden=32, ffn=16, experts=6, top_k=2, shared_experts=0, gate=GateKind.SOFTMAX,
                    dtype=torch.float32)  # experts not a power of two: padded lanes


@pytest.mark.parametrize("tokens,gemm_rows,block,every", [(16, 8, 64, 1), (300, 16, 32, 4),
                                                          (600, 16, SLOT_IDS, 10)])
def test_the_slot_resolution_gives_the_torch_integers_for_every_routing(tokens, gemm_rows, block, every,
                                                                        monkeypatch):
    """Three launches against ``regions.slot_routing``'s sort, over the twenty routings'
    kinds (``every``: one in so many, the interpreter's time): one block of ids, more
    blocks than the layout program reads at once (32 ids a block), and two blocks of the
    kernels' own size; 300 and 600 tokens have more slots than it lays out at once."""
    monkeypatch.setattr(phases, "SLOT_IDS", block)
    shape = SlotShape(SLOT_SPEC, tokens, TileSpec(rows=8, gemm_rows=gemm_rows, gemm_cols=16))
    t, per = tokens, tokens * SLOT_SPEC.top_k // SLOT_SPEC.experts
    splits = [[2 * t - 5 * per] + [per] * 5, [t, t] + [0] * 4, [0] * 4 + [t, t], [t] + [0] * 4 + [t],
              [1, 1] + [per] * 3 + [2 * t - 2 - 3 * per]]
    assert -(-2 * t // block) == {16: 1, 300: 19, 600: 2}[t]
    assert shape.slots > phases.SLOT_SLOTS or t == 16
    for r in twenty_routings(SLOT_SPEC, tokens, splits[:1], splits[1:])[::every]:
        tok, pos = (torch.full(size, -7, dtype=torch.int32) for size in ((shape.capacity, 1), r.ids.shape))
        got = resolve_slots(r.ids, shape, interpret=True, into=(tok, pos))
        want = torch_resolve_slots(r.ids, shape)
        for field in ("counts", "first", "slot_expert", "slot_rows", "pos", "row_token"):
            assert torch.equal(getattr(got, field), getattr(want, field)), field
        assert torch.equal(tok.view(-1), want.row_token.int()) and torch.equal(pos, want.pos.int())


def test_the_torch_resolution_writes_a_programs_row_indices_too_and_refuses_other_ones():
    shape = SlotShape(SLOT_SPEC, 16, TileSpec(rows=8, gemm_rows=8, gemm_cols=16))
    r = from_counts([7, 5, 5, 5, 5, 5], 16, 2, 0)
    tok, pos = (torch.full(size, -7, dtype=torch.int32) for size in ((shape.capacity, 1), (16, 2)))
    want = resolve_slots(r.ids, shape, into=(tok, pos))  # no CUDA here: the reference
    assert torch.equal(tok.view(-1), want.row_token.int()) and torch.equal(pos, want.pos.int())
    with pytest.raises(ValueError, match=r"into must be two contiguous int32 tensors \(tok, pos\), got "
                                         r"\[\(torch.int64, 'contiguous'\), \(torch.int32, 'contiguous'\)\]"):
        resolve_slots(r.ids, shape, into=(tok.long(), pos))
