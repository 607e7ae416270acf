"""The GPU issues' acceptance read off a bench JSON (``benchmarks/gpu_verdict.py``):
against the H200 run the issues quote, and on made rows whose verdicts are known."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_verdict  # noqa: E402

H200 = ROOT / "benchmarks" / "results" / "h200-2026-11-27b" / "after-bench_gpu.json"


def _found(rows: list[dict]) -> dict[tuple, gpu_verdict.Verdict]:
    return {(v.goal.issue, v.goal.variant, v.goal.against[0], v.goal.shape, v.goal.region): v
            for v in gpu_verdict.verdicts(rows)}


def test_the_h200_run_gives_the_default_paths_ratios_the_issue_quotes():
    """#44's table: forward 0.89, 0.50, 0.85, 0.26x and forward + backward 1.06, 0.92,
    1.00, 0.44x over the fastest torch variant (DeepSeek-V3, Qwen3, Mixtral, small)."""
    found = _found(json.loads(H200.read_text())["rows"])
    quoted = {"deepseek-v3-fit": (0.89, 1.06), "qwen3-30b-a3b": (0.50, 0.92), "mixtral-8x7b": (0.85, 1.00),
              "small": (0.26, 0.44)}
    for shape, (fwd, both) in quoted.items():
        for region, want in (("fwd", fwd), ("fwd+bwd", both)):
            v = found[(44, "hpmoe-default", "torch-eager", shape, region)]
            assert round(v.ratio, 2) == want and v.hit is False, (shape, region, v.line())
    assert found[(48, "hpmoe-persistent", "torch-eager", "small", "fwd+bwd")].ratio is None  # no such row


def _row(shape: str, region: str, variant: str, ms: float, **extra) -> dict:
    return {"shape": shape, "routing": "zipf", "region": region, "variant": variant, "ms": ms, "error": "",
            **extra}


def test_a_goal_is_met_missed_or_not_measured_as_its_rows_say():
    rows = [_row("small", "fwd+bwd", "hpmoe-persistent", 1.0), _row("small", "fwd+bwd", "torch-eager", 3.0),
            _row("small", "fwd+bwd", "torch-grouped-mm+cudagraph", 1.2),  # the fastest torch variant
            _row("qwen3-30b-a3b", "fwd+bwd", "hpmoe-persistent", 5.0), _row("qwen3-30b-a3b", "fwd+bwd",
                                                                              "torch-grouped-mm", 6.0),
            _row("deepseek-v3-fit", "fwd+bwd", "hpmoe-persistent", float("nan"), error="OutOfMemoryError"),
            _row("deepseek-v3-fit", "fwd+bwd", "torch-grouped-mm", 20.0),
            _row("small", "fwd", "phase/gemm_up", 1.0, tflops=430.0),
            _row("small", "fwd", "grouped-mm/gemm_up", 1.0, tflops=500.0)]
    found = _found(rows)
    small = found[(48, "hpmoe-persistent", "torch-eager", "small", "fwd+bwd")]
    assert small.ratio == pytest.approx(1.2) and small.hit is False  # 1.2x against a 1.3x goal
    assert "torch-grouped-mm+cudagraph 1.200 ms" in small.line()
    qwen = found[(48, "hpmoe-persistent", "torch-eager", "qwen3-30b-a3b", "fwd+bwd")]
    assert qwen.ratio == pytest.approx(1.2) and qwen.hit is False
    deepseek = found[(48, "hpmoe-persistent", "torch-eager", "deepseek-v3-fit", "fwd+bwd")]
    assert deepseek.ratio is None and "OutOfMemoryError" in deepseek.line()
    gemm = found[(48, "phase/gemm_up", "grouped-mm/gemm_up", "small", "fwd")]
    assert gemm.ratio == pytest.approx(0.86) and gemm.hit is True
    rows[0]["ms"] = 0.9  # 1.33x now
    assert _found(rows)[(48, "hpmoe-persistent", "torch-eager", "small", "fwd+bwd")].hit is True


def test_host_syncs_are_a_hit_only_where_every_counted_row_has_none():
    rows = [_row("small", "fwd", "hpmoe-default", 1.0, host_syncs=0),
            _row("small", "fwd+bwd", "hpmoe-default", 2.0, host_syncs=0)]
    assert gpu_verdict.sync_lines(rows)[0] == "hpmoe-default: host syncs per call HIT: none in 2 rows"
    assert "not counted" in gpu_verdict.sync_lines(rows)[1]  # no persistent row
    rows[1]["host_syncs"] = 2
    assert gpu_verdict.sync_lines(rows)[0].endswith("MISS: small zipf fwd+bwd: 2")


def test_the_command_names_a_dry_run_and_counts_what_it_measured(tmp_path, capsys):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"meta": {"device": "cpu", "dry_run": True, "tokens": 64},
                                "rows": [_row("small", "fwd+bwd", "hpmoe-default", 2.0, host_syncs=None),
                                         _row("small", "fwd+bwd", "torch-grouped-mm", 2.0)]}))
    assert gpu_verdict.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "DRY RUN: not GPU figures" in out and "1 of 1 measured goals met;" in out
    assert "hpmoe-default: host syncs not counted in this file" in out
