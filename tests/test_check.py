"""The input scan on the input's device and when its verdict is read: in the call
(``check="sync"``), or one call late without a host read (``"deferred"``, the default)."""

import pytest
import torch

import hpmoe.engine.check as check_module
from hpmoe import MoE
from hpmoe.routing import (
    InputFault,
    cpu_expert_counts,
    expert_counts,
    input_status,
    route,
    status_error,
    value_error,
)
from hpmoe.spec import preset
from hpmoe.weights import ExpertWeights

SPEC = preset("tiny")


@pytest.fixture(params=["host", "device"])
def held(request, monkeypatch):
    """Where a deferred verdict waits for the next call: read at once and kept on the
    host (a CPU), or kept on the device and copied to host memory (a GPU; forced here)."""
    if request.param == "device":
        monkeypatch.setattr(check_module, "held_on_device", lambda device: True)
    return request.param


def _layer(**options) -> MoE:
    return MoE(SPEC, ExpertWeights.random(SPEC, 0), **options)


def _x(rows: int = 12, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, SPEC.hidden, generator=torch.Generator().manual_seed(seed))


def _routing(x: torch.Tensor):
    return route(x, ExpertWeights.random(SPEC, 0))


def _reference_status(x, ids, w, experts):
    """The verdict computed row by row on the host: the first non-finite row of x (NaN
    before inf within it), else an id out of range, else a non-finite weight."""
    for r in range(x.shape[0]):
        row = x[r]
        if torch.isnan(row).any():
            return [InputFault.X_NAN, r, 0]
        if torch.isinf(row).any():
            return [InputFault.X_INF, r, 0]
    bad = [int(i) for i in ids.flatten() if not 0 <= int(i) < experts]
    if bad:
        return [InputFault.EXPERT_ID, None, min(bad) if min(bad) < 0 else max(bad)]
    if not torch.isfinite(w).all():
        return [InputFault.WEIGHTS, None, None]
    return [InputFault.NONE, None, None]


@pytest.mark.parametrize("seed", range(6))
def test_the_device_scan_names_what_a_host_walk_finds(seed):
    g = torch.Generator().manual_seed(seed)
    x, ids = torch.randn(9, 4, generator=g), torch.randint(0, 8, (9, 2), generator=g)
    w = torch.rand(9, 2, generator=g)
    for _ in range(int(torch.randint(0, 3, (1,), generator=g))):  # some NaN and inf cells, anywhere
        r, c = (int(v) for v in torch.randint(0, 9, (2,), generator=g))
        x[r, c % 4] = float("nan") if seed % 2 else float("inf")
    if seed % 3 == 0:
        ids[int(torch.randint(0, 9, (1,), generator=g)), 1] = -3 if seed % 2 else 11
    if seed == 4:
        w[3, 0] = float("inf")
    got = input_status(8, x, ids, w).tolist()
    want = _reference_status(x, ids, w, 8)
    assert got[0] == want[0]
    if want[1] is not None:
        assert got[1] == want[1]
    if want[0] == InputFault.EXPERT_ID:
        assert got[2] == want[2]


def test_nan_before_inf_in_the_first_bad_row_and_empty_inputs_hold_no_fault():
    x = torch.zeros(5, 3)
    x[3, 0], x[1, 2], x[1, 0] = float("nan"), float("inf"), float("nan")
    assert str(status_error(input_status(8, x).tolist(), 8)) == "x has NaN at row 1"
    empty = torch.zeros(0, 3), torch.zeros(0, 2, dtype=torch.int64), torch.zeros(0, 2)
    assert input_status(8, *empty).tolist() == [0, 0, 0]


def test_deferred_reports_a_nan_row_at_the_next_call_and_says_so(held):
    layer = _layer()
    x = _x()
    x[5, 3] = float("nan")
    out = layer(x)  # the call itself returns: its verdict stays on the device
    assert torch.isnan(out[5]).all()
    with pytest.raises(ValueError, match=r"x has NaN at row 5 \(found by the device-side input check of an "
                                         r"earlier call.*one call late"):
        layer(_x(seed=1))
    clean = _x(seed=2)
    torch.testing.assert_close(layer(clean), _layer(check="sync")(clean), rtol=0, atol=0)  # reported once


@pytest.mark.parametrize("bad", [99, 8, -3])
def test_an_out_of_range_id_runs_clamped_and_is_reported_by_check(held, bad):
    layer = _layer()
    x = _x()
    r = _routing(x)
    ids = r.ids.clone()
    ids[4, 1] = bad
    out = layer.region(x, ids, r.weights)  # no out-of-bounds read
    clamped = _layer(check="sync").region(x, ids.clamp(0, 7), r.weights)
    torch.testing.assert_close(out, clamped, rtol=0, atol=0)
    with pytest.raises(ValueError, match=rf"routing.ids contains expert id {bad}, outside \[0, 8\)"):
        layer.check()
    layer.check()  # nothing left


@pytest.mark.parametrize("bad", [None, 8, 1000, -1])
def test_a_cpu_counts_ids_in_range_and_refuses_any_other(bad):
    ids = torch.randint(0, 8, (12, 2), generator=torch.Generator().manual_seed(0))
    if bad is None:
        assert torch.equal(cpu_expert_counts(ids, 8), expert_counts(ids, 8))
        return
    ids[3, 1] = bad
    assert cpu_expert_counts(ids, 8) is None


def test_the_next_call_raises_before_it_runs_and_holds_nothing_of_its_own(held):
    layer = _layer()
    x, y = _x(), _x(seed=1)
    x[2, 0], y[7, 0] = float("inf"), float("nan")
    layer(x)
    with pytest.raises(ValueError, match="x has inf at row 2"):
        layer(y)  # raised before y was scanned or run
    layer.check()


def test_non_finite_routing_weights_are_reported(held):
    layer = _layer()
    x = _x()
    r = _routing(x)
    w = r.weights.detach().clone()
    w[0, 0] = float("nan")
    layer.region(x, r.ids, w)
    with pytest.raises(ValueError, match="routing.weights contains NaN or inf"):
        layer.region(x, r.ids, r.weights)


def test_sync_raises_in_the_call_itself():
    layer = _layer(check="sync")
    x = _x()
    x[9, 1] = float("-inf")
    with pytest.raises(ValueError, match=r"^x has inf at row 9$"):
        layer(x)
    layer(_x(seed=3))  # the next call is clean


def test_a_check_mode_that_is_none_is_named():
    with pytest.raises(ValueError, match=r"check='later' is not one of \['sync', 'deferred'\]"):
        _layer(check="later")


@pytest.mark.parametrize("seed", range(6))
def test_the_host_read_names_what_a_host_walk_finds(seed):
    g = torch.Generator().manual_seed(seed)
    x, ids = torch.randn(9, 4, generator=g), torch.randint(0, 8, (9, 2), generator=g)
    w = torch.rand(9, 2, generator=g)
    x[seed, seed % 4] = (float("nan"), float("inf"), -float("inf"), 1.0, 2.0, 3.0)[seed]
    if seed >= 3:
        ids[seed, 1] = (-3, 8, 5)[seed - 3]
    if seed == 5:
        w[3, 0] = float("nan")
    want = _reference_status(x, ids, w, 8)
    got = value_error(8, x, ids, w)
    assert str(got) == str(status_error([want[0], want[1] or 0, want[2] or 0], 8))


@pytest.mark.parametrize("dtype,value", [(torch.float32, 3e38), (torch.bfloat16, 3e38), (torch.float16, 6e4)])
def test_finite_values_whose_sum_overflows_hold_no_fault(dtype, value):
    x = torch.full((16, 4), value, dtype=dtype)
    assert value_error(8, x, torch.zeros(16, 2, dtype=torch.int64), torch.ones(16, 2)) is None


def test_a_deferred_check_made_in_inference_mode_keeps_working_outside_it(held):
    """The verdict a first call keeps (on a GPU in a status tensor written in place) is
    made under ``torch.inference_mode()`` by an evaluation and written by training after."""
    layer, x = _layer(), _x()
    r = _routing(x)
    with torch.inference_mode():
        layer.region(x, r.ids, r.weights)
    bad = x.clone()
    bad[4, 1] = float("nan")
    with torch.no_grad():
        layer.region(bad, r.ids, r.weights)
    with pytest.raises(ValueError, match="x has NaN at row 4"):
        layer.check()
    layer.region(x.requires_grad_(), r.ids, r.weights).sum().backward()
