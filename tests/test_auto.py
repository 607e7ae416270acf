"""AUTO's decision on hand-made forecasts, its cache and its one-process forecasts."""

from __future__ import annotations

import dataclasses

import pytest

from hpmoe.ir.schedule import SchedulePolicy
from hpmoe.schedule.auto import (
    BASELINE,
    KERNEL_BY_KERNEL,
    Candidate,
    DecisionCache,
    Forecast,
    Path,
    Reason,
    RoutingShape,
    auto_forecasts,
    decide,
)
from hpmoe.sim.presets import hardware_preset
from hpmoe.sim.profile import PROFILE_ENV
from hpmoe.spec import TileSpec, preset

from .helpers import tiny_plan

CP = Candidate(Path.TASKFLOW, SchedulePolicy.CRITICAL_PATH)
HP = Candidate(Path.TASKFLOW, SchedulePolicy.HYPERPARALLEL)


def _forecasts(cp: float, hp: float, kbk: float, base: float) -> list[Forecast]:
    return [Forecast(CP, cp, 0.001), Forecast(HP, hp, 0.001), Forecast(KERNEL_BY_KERNEL, kbk),
            Forecast(BASELINE, base)]


def test_a_taskflow_forecast_well_ahead_of_the_fallback_is_chosen() -> None:
    d = decide(_forecasts(cp=0.049, hp=0.070, kbk=0.080, base=0.090))
    assert (d.chosen, d.fallback, d.reason) == (CP, KERNEL_BY_KERNEL, Reason.FORECAST_GAIN)
    assert d.gain == pytest.approx(0.080 / 0.050)


def test_a_gain_under_five_percent_falls_back() -> None:
    d = decide(_forecasts(cp=0.077, hp=0.1, kbk=0.082, base=0.2))  # 0.082 / (0.077 + 0.001) = 1.051
    assert d.chosen == CP
    d = decide(_forecasts(cp=0.079, hp=0.1, kbk=0.082, base=0.2))  # 0.082 / 0.080 = 1.025
    assert (d.chosen, d.reason) == (KERNEL_BY_KERNEL, Reason.GAIN_BELOW_MIN)
    assert d.gain == pytest.approx(0.082 / 0.080)


def test_the_fallback_is_the_faster_of_kernel_by_kernel_and_baseline() -> None:
    d = decide(_forecasts(cp=0.5, hp=0.6, kbk=0.09, base=0.08))
    assert (d.chosen, d.fallback, d.reason) == (BASELINE, BASELINE, Reason.FALLBACK_FASTEST)
    tie = decide([Forecast(KERNEL_BY_KERNEL, 0.08), Forecast(BASELINE, 0.08)])
    assert tie.chosen == KERNEL_BY_KERNEL  # ties go to the earlier forecast


def test_a_warm_up_measurement_vetoes_the_forecast() -> None:
    f = _forecasts(cp=0.04, hp=0.07, kbk=0.08, base=0.09)
    d = decide(f, {CP.name: 0.081, KERNEL_BY_KERNEL.name: 0.080})
    assert (d.chosen, d.reason) == (KERNEL_BY_KERNEL, Reason.VETOED)
    d = decide(f, {CP.name: 0.079, KERNEL_BY_KERNEL.name: 0.080})
    assert (d.chosen, d.reason) == (CP, Reason.FORECAST_GAIN)
    d = decide(f, {CP.name: 0.5})  # the fallback was not measured: no veto
    assert d.chosen == CP
    assert "critical-path" in d.describe() and d.to_json()["auto_chosen"] == CP.name


def test_setup_time_counts_against_a_taskflow() -> None:
    d = decide([Forecast(CP, 0.05, setup_s=0.04), Forecast(KERNEL_BY_KERNEL, 0.08)])
    assert d.chosen == KERNEL_BY_KERNEL and d.reason is Reason.FALLBACK_FASTEST


def test_bad_forecasts_and_candidates_are_rejected() -> None:
    with pytest.raises(ValueError, match="kernel-by-kernel path or the baseline"):
        decide([Forecast(CP, 0.1)])
    with pytest.raises(ValueError, match="region_s"):
        Forecast(CP, -1.0)
    with pytest.raises(ValueError, match="policy"):
        Candidate(Path.TASKFLOW, SchedulePolicy.AUTO)
    with pytest.raises(ValueError, match="policy"):
        Candidate(Path.KERNEL_BY_KERNEL, SchedulePolicy.SERIAL)
    with pytest.raises(ValueError, match="min_gain"):
        decide(_forecasts(0.1, 0.1, 0.1, 0.1), min_gain=0.9)


def test_the_cache_keeps_one_decision_per_shape_tiles_and_model() -> None:
    cache, moe, hw, tiles = DecisionCache(), preset("tiny"), hardware_preset("h100"), TileSpec()
    a, b = RoutingShape(moe, 2, 8, False), RoutingShape(moe, 2, 8, True)
    first = cache.decide(a, tiles, hw)
    assert first.reason is not Reason.NO_MODEL and first.forecasts
    assert cache.decide(RoutingShape(moe, 2, 8, False), tiles, hw) is first and len(cache) == 1
    assert cache.decide(b, tiles, hw) is not first and len(cache) == 2
    assert cache.decide(a, TileSpec(rows=8, gemm_rows=8, gemm_cols=16), hw) is not first
    assert cache.decide(RoutingShape(moe, 2, 0, False), tiles, hw).reason is Reason.NO_TOKENS


def test_without_a_saved_profile_the_fallback_runs_unforecast(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv(PROFILE_ENV, str(tmp_path / "none.json"))
    d = DecisionCache().decide(RoutingShape(preset("tiny"), 2, 8, False), TileSpec(), None)
    assert d.reason is Reason.NO_MODEL and d.chosen == KERNEL_BY_KERNEL and not d.forecasts
    assert d.describe() == "kernel-by-kernel (no-model: nothing forecast)"
    with pytest.raises(ValueError, match="ep=3"):
        RoutingShape.one_process(preset("tiny"), 3, 16)


def test_one_process_forecasts_favour_kernel_by_kernel_and_grow_with_backward() -> None:
    hw = hardware_preset("h100")
    plan = tiny_plan(ep=2, tokens=64, moe=dataclasses.replace(preset("tiny"), hidden=64, ffn=32))
    fwd = auto_forecasts(plan, TileSpec(rows=8, gemm_rows=8, gemm_cols=16), hw, backward=False)
    both = auto_forecasts(plan, TileSpec(rows=8, gemm_rows=8, gemm_cols=16), hw, backward=True)
    assert [f.candidate.path for f in fwd] == [Path.TASKFLOW, Path.KERNEL_BY_KERNEL]
    assert fwd[1].region_s < fwd[0].region_s  # fewer tasks, same work, one thread
    assert all(b.region_s > f.region_s for f, b in zip(fwd, both, strict=True))
    assert decide(fwd).chosen == KERNEL_BY_KERNEL
