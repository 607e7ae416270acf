"""``hpmoe bench`` end to end: spawning its own ranks, under torchrun, and with
ranks in shaped network namespaces; the JSON report, the measured and predicted
traces, and nothing left behind (segments, namespaces)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hpmoe.cli.bench import summary
from hpmoe.launch.netns import list_namespaces
from hpmoe.machine import default_cpu_dtype, machine
from hpmoe.runtime.transport.segment import SHM_DIR
from hpmoe.sim.profile import save_profile

from .handmade import UNIT_HW

TINY = ["--preset", "tiny", "--tokens", "24", "--tile-rows", "8", "--gemm-rows", "8", "--gemm-cols", "16",
        "--iters", "2", "--warmup", "1", "--json", "--deadline", "30"]
FIELDS = ("serial_ms", "serial_same_transport_ms", "taskflow_ms", "speedup", "max_abs_diff")


def _bench(argv: list[str], tmp_path: Path, timeout: float = 120.0) -> dict:
    env = {**os.environ, "HPMOE_PROFILE": str(save_profile(dataclasses.replace(UNIT_HW, name="cpu"),
                                                           tmp_path / "cpu.json"))}
    before = sorted(p.name for p in SHM_DIR.glob("hpmoe-*"))
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in SHM_DIR.glob("hpmoe-*")) == before
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(isinstance(report[f], float | int) for f in FIELDS), report
    assert report["bitwise_equal_serial_schedule"] is True
    assert report["max_abs_diff"] < 1e-4  # fp32 tiny layer: refs differ only by GEMM tiling
    return report


def test_bench_spawns_its_ranks_and_writes_both_traces(tmp_path: Path) -> None:
    out = tmp_path / "traces"
    argv = [sys.executable, "-m", "hpmoe", "bench", "--ep", "2", *TINY, "--predict", "--trace", str(out),
            "--schedule", "critical-path"]
    report = _bench(argv, tmp_path)
    assert report["schedule"] == "critical-path" and report["candidate"] is not None
    assert "auto_chosen" not in report  # a given schedule is measured as asked, no AUTO decision
    assert report["predicted_taskflow_ms"] > 0 and "prediction_error_taskflow" in report
    assert report["cpu_share_during"] > 0 and report["predicted_taskflow_pre_ms"] > 0
    assert "put_cpu_us" not in report
    assert report["replayed_taskflow_on_measured_kernels_ms"] > 0  # --predict records the kernels' CPU
    assert 0.0 <= report["host_steal_fraction"] <= 1.0
    for name in ("trace.json", "predicted-trace.json"):
        events = json.loads((out / name).read_text())["traceEvents"]
        assert any(e.get("ph") == "X" for e in events)
    assert report["trace"] == str(out / "trace.json")
    assert _undocumented(report) == []
    text = summary(report)
    dtype, why = default_cpu_dtype()  # --dtype auto: what this CPU computes natively
    name = {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
    assert text.startswith(f"hpmoe bench: tiny, 24 tokens/rank, EP 2, {name}, balanced routing, transport")
    assert report["dtype"] == name and report["dtype_auto"] == why and f"dtype auto: {why}" in text
    assert report["machine"] == machine().to_json() and f"machine: {machine().line()}" in text
    assert f"speedup {report['speedup']:.2f}x" in text and str(out / "gantt.png") in text
    assert len(text.splitlines()) <= 12


def _undocumented(report: dict) -> list[str]:
    """Keys of ``report`` that docs/bench-json.md does not describe."""
    text = (Path(__file__).parents[1] / "docs" / "bench-json.md").read_text()
    variants = ("serial_same_transport", "runtime_taskflow", "kernel_by_kernel", "taskflow",
                "serial")  # longest prefix first
    missing = []
    for key in report:
        generic = next((f"NAME_{key[len(v) + 1:]}" for v in variants if key.startswith(f"{v}_")), key)
        if f"`{key}`" not in text and f"`{generic}`" not in text:
            missing.append(key)
    return missing


def test_bench_runs_under_torchrun(tmp_path: Path) -> None:
    torchrun = Path(sys.executable).with_name("torchrun")
    argv = [str(torchrun), "--nproc-per-node", "2", "-m", "hpmoe", "bench", *TINY, "--transport", "dist"]
    report = _bench(argv, tmp_path)
    assert report["ep"] == 2 and report["transport"] == "dist"
    assert report["schedule"] in ("critical-path", "hyperparallel")  # auto: the best forecast taskflow
    forecasts = {f"forecast_{n}_ms" for n in ("taskflow:critical-path", "taskflow:hyperparallel",
                                               "kernel-by-kernel", "baseline")}
    assert forecasts <= set(report) and report["auto_chosen"] in {f[9:-3] for f in forecasts}
    ratio = report["serial_ms"] / report["kernel_by_kernel_ms"]  # both rounded to the µs
    assert report["kernel_by_kernel_speedup"] == pytest.approx(ratio, rel=1e-2, abs=2e-3)
    assert report["warmup_kernel-by-kernel_ms"] > 0
    assert report["put_cpu_us"] > 0  # TCP puts burn the host's CPU; shared-memory ones report none


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("tc") is None, reason="needs root and tc")
def test_bench_with_shaped_links_removes_its_namespaces(tmp_path: Path) -> None:
    before = list_namespaces()
    argv = [sys.executable, "-m", "hpmoe", "bench", "--ep", "2", *TINY, "--link", "1gbit"]
    report = _bench(argv, tmp_path)
    assert report["transport"] == "dist" and report["link"] == "1gbit"
    assert report["link_measured_gbytes_per_s"] > 0  # measured and reported; the shaping itself: test_netns
    assert set(list_namespaces()) <= set(before)  # none of ours is left (others' jobs may end meanwhile)


def test_ranks_keep_freed_memory_unless_the_caller_says_otherwise(monkeypatch) -> None:
    from hpmoe.launch.launcher import ALLOCATOR_ENV, LaunchSpec, launch

    for name in ALLOCATOR_ENV:
        monkeypatch.delenv(name, raising=False)
    show = "import os; print(os.environ['MALLOC_TRIM_THRESHOLD_'], os.environ['MALLOC_MMAP_THRESHOLD_'])"
    argv = (sys.executable, "-c", show)
    default = launch(LaunchSpec(argv=argv, world=2, capture=True, timeout_s=60.0))
    want = [ALLOCATOR_ENV["MALLOC_TRIM_THRESHOLD_"], ALLOCATOR_ENV["MALLOC_MMAP_THRESHOLD_"]]
    assert default.ok and [r.stdout.split() for r in default.ranks] == [want, want]
    mine = launch(LaunchSpec(argv=argv, world=1, capture=True, timeout_s=60.0,
                             env={"MALLOC_TRIM_THRESHOLD_": "131072", "MALLOC_MMAP_THRESHOLD_": "131072"}))
    assert mine.ok and mine.ranks[0].stdout.split() == ["131072", "131072"]
