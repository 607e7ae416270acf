"""Hardware models: validation, cost formulas, link table, profiles and calibration.

No test asserts on wall time: calibration runs on a clock the test drives, and each figure
is checked against the work of its benchmark over the injected time.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time

import numpy as np
import pytest
import torch

import hpmoe.sim.calibrate
from hpmoe.cli import calibrate as calibrate_cli
from hpmoe.cli.overrides import with_overrides
from hpmoe.sim.calibrate import calibrate
from hpmoe.sim.hardware import GemmShape, HardwareModel, LinkDirection, LinkEntry
from hpmoe.sim.presets import hardware_preset
from hpmoe.sim.profile import PROFILE_ENV, load_profile, save_profile

DIRECTIONS = (LinkDirection.DISPATCH, LinkDirection.COMBINE)


@pytest.fixture
def a3() -> HardwareModel:
    return hardware_preset("ascend-a3")


@pytest.mark.parametrize("field, bad", [
    ("name", ""), ("matrix_workers", 0), ("vector_workers", -1), ("matrix_workers", 2.0),
    ("matrix_flops_bf16", 0.0), ("matrix_flops_fp32", float("nan")), ("matrix_block", 0),
    ("vector_flops", -1.0), ("mem_bw", float("inf")), ("link_latency", -1e-6),
    ("task_overhead", True), ("link", ()),
])
def test_validation_names_field_and_value(a3: HardwareModel, field: str, bad: object) -> None:
    with pytest.raises(ValueError, match=field) as err:
        dataclasses.replace(a3, **{field: bad})
    assert repr(bad) in str(err.value) or field == "link"


@pytest.mark.parametrize("field, bad", [("ep", 0), ("dispatch", 0.0), ("combine", -5.0)])
def test_link_entry_validation(field: str, bad: object) -> None:
    kwargs = {"ep": 8, "dispatch": 1e9, "combine": 1e9, field: bad}
    with pytest.raises(ValueError, match=f"LinkEntry.{field}"):
        LinkEntry(**kwargs)


def test_link_eps_must_increase(a3: HardwareModel) -> None:
    with pytest.raises(ValueError, match="link EP sizes"):
        dataclasses.replace(a3, link=tuple(reversed(a3.link)))


@pytest.mark.parametrize("name", ["ascend-a3", "h100"])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_put_time_uses_measured_entry_exactly(name: str, direction: LinkDirection) -> None:
    hw = hardware_preset(name)
    nbytes = np.array([0.0, 128 * 7168 * 2, 1e9])
    for entry in hw.link:
        expected = hw.link_latency + nbytes / entry.bandwidth(direction)
        np.testing.assert_array_equal(hw.put_time(nbytes, entry.ep, direction), expected)


def test_link_bandwidth_interpolates_in_log2_ep_and_clamps(a3: HardwareModel) -> None:
    hw = dataclasses.replace(a3, link=(LinkEntry(4, 100.0, 10.0), LinkEntry(16, 200.0, 30.0)))
    assert hw.link_bandwidth(8, LinkDirection.DISPATCH) == 150.0  # log2 midpoint of 4 and 16
    assert hw.link_bandwidth(8, LinkDirection.COMBINE) == 20.0
    assert a3.link_bandwidth(2, LinkDirection.DISPATCH) == 146e9  # below EP8: the EP8 entry
    assert a3.link_bandwidth(1024, LinkDirection.COMBINE) == 81e9  # above EP128: the EP128 entry


def test_link_bandwidth_rejects_bad_arguments(a3: HardwareModel) -> None:
    with pytest.raises(ValueError, match="ep"):
        a3.link_bandwidth(0, LinkDirection.DISPATCH)
    with pytest.raises(TypeError, match="LinkDirection"):
        a3.link_bandwidth(8, "dispatch")  # type: ignore[arg-type]


def test_matrix_time_pads_to_the_cube_block(a3: HardwareModel) -> None:
    a3 = dataclasses.replace(a3, matrix_efficiency=1.0, matrix_full_edge=1)  # padding alone
    block = 2 * 16**3 / a3.matrix_flops_bf16
    assert a3.matrix_time(1, 1, 1, torch.bfloat16) == block
    assert a3.matrix_time(16, 16, 16, torch.bfloat16) == block
    assert a3.matrix_time(17, 16, 16, torch.bfloat16) == 2 * block
    assert a3.matrix_time(0, 512, 7168, torch.bfloat16) == 0.0


def test_matrix_time_vectorised_and_per_dtype(a3: HardwareModel) -> None:
    a3 = dataclasses.replace(a3, matrix_efficiency=1.0, matrix_full_edge=1)
    m = np.array([128, 64, 0])
    t = a3.matrix_time(m, 512, 7168, torch.float32)
    assert t.shape == (3,)
    np.testing.assert_array_equal(t, 2.0 * m * 512 * 7168 / a3.matrix_flops_fp32)
    with pytest.raises(TypeError, match="float16"):
        a3.matrix_time(1, 1, 1, torch.float16)
    with pytest.raises(ValueError, match="m must be"):
        a3.matrix_time(-1, 1, 1, torch.bfloat16)


def test_vector_and_memory_time(a3: HardwareModel) -> None:
    np.testing.assert_array_equal(a3.vector_time([0, 100], 5.0), [0.0, 500.0 / a3.vector_flops])
    assert a3.memory_time(1.6e12) == 1.0
    np.testing.assert_array_equal(a3.memory_time(1.6e12, np.array([1, 24])), [1.0, 24.0])
    with pytest.raises(ValueError, match="sharers"):
        a3.memory_time(1.0, 0)


def test_preset_figures_follow_their_sources() -> None:
    a3, h100 = hardware_preset("ascend-a3"), hardware_preset("h100")
    assert a3.matrix_flops_bf16 == pytest.approx(15.16e12, rel=1e-3)
    assert (a3.matrix_workers, a3.vector_workers, a3.matrix_block) == (24, 24, 16)
    assert [(e.ep, e.dispatch / 1e9, e.combine / 1e9) for e in a3.link] == [
        (8, 146, 125), (16, 107, 103), (32, 102, 95), (64, 81, 91), (128, 57, 81)]
    assert h100.matrix_workers + h100.vector_workers == 132
    assert h100.matrix_flops_bf16 * 132 == pytest.approx(989e12)


def test_unknown_preset() -> None:
    with pytest.raises(ValueError, match="tpu"):
        hardware_preset("tpu")


@pytest.mark.parametrize("name", ["ascend-a3", "h100"])
def test_profile_json_round_trip(tmp_path, name: str) -> None:
    hw = hardware_preset(name)
    path = save_profile(hw, tmp_path / "sub" / "hw.json")
    assert load_profile(path) == hw


def test_cpu_preset_without_profile_names_the_env_var(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(PROFILE_ENV, str(tmp_path / "missing.json"))
    with pytest.raises(FileNotFoundError, match=PROFILE_ENV) as err:
        hardware_preset("cpu")
    assert "hpmoe calibrate" in str(err.value)


def test_cpu_preset_loads_the_env_profile(tmp_path, monkeypatch) -> None:
    hw = dataclasses.replace(hardware_preset("h100"), name="cpu")
    monkeypatch.setenv(PROFILE_ENV, str(save_profile(hw, tmp_path / "cpu.json")))
    assert hardware_preset("cpu") == hw


def test_calibrate_quick_turns_each_timing_into_its_figure(tmp_path, monkeypatch) -> None:
    """The quick calibration's benchmarks run, on a clock that moves 1 ms between two
    readings: every timed batch takes 1 ms, so each figure is its benchmark's work over
    1 ms shared by the batch's calls, counted here from the documented shapes."""
    cal, dt = hpmoe.sim.calibrate, 1e-3
    clock = [0.0]

    def perf_counter() -> float:
        clock[0] += dt
        return clock[0]
    monkeypatch.setattr(cal, "time", argparse.Namespace(perf_counter=perf_counter, strftime=time.strftime))
    hw = calibrate(threads=1, quick=True, matrix_workers=1, vector_workers=1)
    plan = cal._QUICK
    call = dt / plan.tiny_calls  # a 1 x 1 GEMM kernel's call and a one-element op alike

    def rate(m: int, k: int) -> float:  # an m x 512 x k tile, batched as _gemm_bench batches it
        flops = 2.0 * m * cal.GEMM_N * k
        t = dt / max(1, min(64, int(2e-3 * 1e11 / flops)))
        return flops / max(t - call, 0.5 * t)
    rates = [rate(m, k) for m in plan.gemm_rows for k in plan.gemm_ks]
    assert hw.matrix_flops_bf16 == hw.matrix_flops_fp32 == pytest.approx(max(rates), rel=1e-9)
    assert [g.bf16 for g in hw.gemm_shapes] == pytest.approx([r / max(rates) for r in rates], rel=1e-9)
    assert hw.mem_bw == pytest.approx(2 * plan.copy_bytes / dt, rel=1e-9)  # read + written
    assert hw.vector_flops == pytest.approx(5.0 * cal.SWIGLU_TILE[0] * cal.SWIGLU_TILE[1] / dt, rel=1e-9)
    assert hw.task_overhead == pytest.approx(call, rel=1e-9)
    assert hw.link_latency == pytest.approx(0.0, abs=1e-15)  # the 64-byte put costs what the op does
    bandwidth = (plan.put_bytes - cal.SMALL_PUT) / (dt - call)
    assert [e.bandwidth(d) for e in hw.link for d in DIRECTIONS] == pytest.approx([bandwidth] * 2, rel=1e-9)
    tokens, k, h = cal.UNPERMUTE_TILE  # 10 calls a batch; (k + 2) rows of h bf16 a token counted
    moved = (dt / 10 - call) * 2 * plan.copy_bytes / dt
    assert hw.unpermute_traffic == pytest.approx(moved / ((k + 2) * tokens * h * 2), rel=1e-9)
    assert (hw.name, hw.matrix_workers, hw.vector_workers) == ("cpu", 1, 1)
    assert load_profile(save_profile(hw, tmp_path / "cpu.json")) == hw


def test_calibration_rounds_see_a_slow_spell_on_every_figure_alike(monkeypatch) -> None:
    """Six benchmarks of 1, 2 or 3 ms a call, in batches of 5, 2 or 1 calls (each batch plus
    its untimed call: 6 ms), on a clock only they advance; every call 3x slower in a spell
    over the middle 30% of the calibration.  Timed one after another, the spell would
    cover most rounds of two benchmarks; timed in rounds it covers at most 5 of the 11
    rounds of each, so every median is exact."""
    calibrate_module = hpmoe.sim.calibrate
    clock, spell = [0.0], [math.inf, math.inf]

    def bench(seconds: float, inner: int) -> calibrate_module._Bench:
        def call() -> None:
            clock[0] += seconds * (3.0 if spell[0] <= clock[0] < spell[1] else 1.0)
        return calibrate_module._Bench(call, inner)

    monkeypatch.setattr(calibrate_module, "time", argparse.Namespace(perf_counter=lambda: clock[0]))
    seconds = [1e-3, 2e-3, 3e-3] * 2
    benches = [bench(t, inner) for t, inner in zip(seconds, [5, 2, 1] * 2, strict=True)]
    calibrate_module._round_medians(benches, repeats=11)
    spell[:] = [0.35 * clock[0], 0.65 * clock[0]]
    clock[0] = 0.0
    assert calibrate_module._round_medians(benches, repeats=11) == pytest.approx(seconds)


def test_kernel_gemm_shares_weights_of_its_own_depth_and_dtype_only() -> None:
    gen = torch.Generator().manual_seed(0)
    weights = torch.zeros(3, 512, 64, dtype=torch.bfloat16)
    tile = hpmoe.sim.calibrate.KernelGemm(4, 64, torch.bfloat16, 1 << 16, gen, weights)
    assert tile.w is weights and tile.experts == 3
    for k, dtype in ((128, torch.bfloat16), (64, torch.float32)):
        with pytest.raises(ValueError, match=r"weights has shape \(3, 512, 64\)"):
            hpmoe.sim.calibrate.KernelGemm(4, k, dtype, 1 << 16, gen, weights)


def test_model_from_turns_measurements_into_overhead_and_unpermute_traffic() -> None:
    """The unpermute took 100 µs past the 10 µs GEMM call on 128 tokens x 10 rows x 256 x 2 B =
    655,360 counted bytes; at 6.5536 GB/s that is 655,360 B moved: a factor 1; 200 µs: 2."""
    from hpmoe.sim.calibrate import CpuMeasurements, model_from

    m = CpuMeasurements(threads=1, quick=True, gemm_ks=(512,), gemm_bf16=(1e11,), gemm_fp32=(5e10,),
                        copy_bw=6.5536e9, swiglu_flops=1e9, tiny_op=1e-6, put_small=3e-6, put_bw=1e9,
                        unpermute=110e-6, kernel_call=10e-6)
    hw = model_from(m)
    assert hw.task_overhead == pytest.approx(10e-6) and hw.link_latency == pytest.approx(2e-6)
    assert hw.unpermute_traffic == pytest.approx(1.0)
    assert model_from(dataclasses.replace(m, unpermute=210e-6)).unpermute_traffic == pytest.approx(2.0)


def test_calibrate_parser() -> None:
    parser = argparse.ArgumentParser(prog="hpmoe")
    calibrate_cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["calibrate", "--out", "p.json", "--quick", "--json"])
    assert (args.out, args.quick, args.json, args.threads) == ("p.json", True, True, 1)
    assert args.run is calibrate_cli.run


def test_run_calibrate_saves_and_prints(tmp_path, monkeypatch, capsys) -> None:
    hw = dataclasses.replace(hardware_preset("h100"), name="cpu")
    monkeypatch.setattr(calibrate_cli, "calibrate", lambda **kwargs: hw)
    parser = argparse.ArgumentParser(prog="hpmoe")
    calibrate_cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["calibrate", "--out", str(tmp_path / "p.json"), "--json"])
    assert args.run(args) == 0
    printed = tmp_path / "printed.json"  # `hpmoe calibrate --json > printed.json` is a profile
    printed.write_text(capsys.readouterr().out)
    assert load_profile(printed) == hw
    assert load_profile(tmp_path / "p.json") == hw


def test_a_garbage_profile_names_its_file(tmp_path) -> None:
    bad = tmp_path / "bad.json"
    for text, why in (("{not json", "is not JSON"), ('{"version": 1}', "version=1, expected a document"),
                      ('{"version": 1, "hardware": {"name": "x"}}', "ValueError")):
        bad.write_text(text)
        with pytest.raises(ValueError, match=f"profile {bad}.*{why}"):
            load_profile(bad)


def test_overrides_set_fields_in_their_units_and_reject_unknown_ones(a3: HardwareModel) -> None:
    hw = with_overrides(a3, ["l2_mb=0", "hbm_gbs=800", "matrix_workers=12", "link_latency_us=5"])
    assert (hw.l2_mb, hw.mem_bw, hw.matrix_workers) == (0.0, 800e9, 12)
    assert hw.link_latency == pytest.approx(5e-6)
    with pytest.raises(ValueError, match="valid fields: .*hbm_gbs.*l2_mb"):
        with_overrides(a3, ["l2=1"])
    with pytest.raises(ValueError, match="matrix_workers must be an integer"):
        with_overrides(a3, ["matrix_workers=1.5"])
    with pytest.raises(ValueError, match="mem_bw"):
        with_overrides(a3, ["hbm_gbs=-1"])


def test_gemm_efficiency_by_tile_shape(a3: HardwareModel) -> None:
    hw = dataclasses.replace(a3, matrix_efficiency=0.5, matrix_full_edge=128, matrix_block=1)
    peak = 2 * 128 * 128 * 64 / a3.matrix_flops_bf16
    assert hw.matrix_time(128, 128, 64, torch.bfloat16) == pytest.approx(peak / 0.5)
    narrow = 2 * 64 * 512 * 64 / a3.matrix_flops_bf16
    assert hw.matrix_time(64, 512, 64, torch.bfloat16) == pytest.approx(narrow / 0.25)
    with pytest.raises(ValueError, match="matrix_efficiency"):
        dataclasses.replace(a3, matrix_efficiency=1.5)


def _shapes(bf16: list[list[float]], rows=(32, 128), depths=(512, 2048)) -> tuple[GemmShape, ...]:
    return tuple(GemmShape(rows=r, depth=d, bf16=bf16[i][j], fp32=1.0)
                 for i, r in enumerate(rows) for j, d in enumerate(depths))


def test_gemm_shapes_scale_a_tile_by_its_measured_rate() -> None:
    """A 1 TFLOP/s peak with 32-row tiles at half of it: a 32 x 512 x 512 tile is 16.8 MFLOP
    at 0.5 TFLOP/s = 33.55 µs; 128-row tiles at the peak; in between, linear in log2 rows
    (64 rows: 0.75) and log2 depth (1024 deep: halfway); outside the grid, its edge."""
    hw = dataclasses.replace(hardware_preset("h100"), matrix_flops_bf16=1e12, matrix_efficiency=1.0,
                             matrix_full_edge=1, gemm_shapes=_shapes([[0.5, 0.5], [1.0, 1.0]]))
    assert hw.matrix_time(32, 512, 512, torch.bfloat16) == pytest.approx(2 * 32 * 512 * 512 / 0.5e12)
    assert hw.matrix_time(128, 512, 512, torch.bfloat16) == pytest.approx(2 * 128 * 512 * 512 / 1e12)
    assert hw.shape_efficiency(64, 512, torch.bfloat16) == pytest.approx(0.75)
    assert hw.shape_efficiency(8, 4096, torch.bfloat16) == pytest.approx(0.5)
    assert hw.shape_efficiency(1024, 64, torch.bfloat16) == pytest.approx(1.0)
    deep = dataclasses.replace(hw, gemm_shapes=_shapes([[0.4, 0.8], [0.4, 0.8]]))
    assert deep.shape_efficiency(np.array([64, 64]), np.array([1024, 2048]),
                                 torch.bfloat16) == pytest.approx([0.6, 0.8])
    assert hw.shape_efficiency(64, 512, torch.float32) == pytest.approx(1.0)


def test_gemm_shapes_round_trip_and_refuse_a_partial_grid(tmp_path) -> None:
    hw = dataclasses.replace(hardware_preset("h100"), gemm_shapes=_shapes([[0.5, 0.6], [0.9, 1.0]]))
    assert load_profile(save_profile(hw, tmp_path / "p.json")) == hw
    with pytest.raises(ValueError, match="missing rows=128, depth=2048"):
        dataclasses.replace(hw, gemm_shapes=_shapes([[0.5, 0.6], [0.9, 1.0]])[:3])
    with pytest.raises(ValueError, match="GemmShape.bf16 must be in"):
        GemmShape(rows=32, depth=512, bf16=1.5, fp32=1.0)


def test_model_from_takes_the_best_tile_as_peak_and_the_grid_as_shapes() -> None:
    from hpmoe.sim.calibrate import CpuMeasurements, model_from

    m = CpuMeasurements(threads=1, quick=True, gemm_rows=(32, 128), gemm_ks=(512, 2048),
                        gemm_bf16=(5e10, 6e10, 1e11, 1.2e11), gemm_fp32=(2e10, 3e10, 4e10, 6e10),
                        copy_bw=6.5536e9, swiglu_flops=1e9, tiny_op=1e-6, put_small=3e-6, put_bw=1e9,
                        unpermute=110e-6, kernel_call=10e-6)
    hw = model_from(m)
    assert (hw.matrix_flops_bf16, hw.matrix_flops_fp32) == (1.2e11, 6e10)
    assert hw.matrix_time(32, 512, 2048, torch.bfloat16) == pytest.approx(2 * 32 * 512 * 2048 / 6e10)
    assert hw.matrix_time(128, 512, 512, torch.float32) == pytest.approx(2 * 128 * 512 * 512 / 4e10)
    with pytest.raises(ValueError, match="gemm_bf16 has 3 rates for 2 rows x 2 depths"):
        dataclasses.replace(m, gemm_bf16=(1e11, 1e11, 1e11))
