"""The GPU scripts on a machine without CUDA: each says so and exits 2 before any work,
so a first contact that lands on the wrong machine costs seconds, not a lease."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


def test_the_first_contact_script_exits_2_before_it_runs_anything(tmp_path):
    """Without a device it stops at its first check: it starts no Python (``PYTHON``
    names a stand-in that leaves a mark) and makes no output folder."""
    mark, python = tmp_path / "python-ran", tmp_path / "python"
    python.write_text(f"#!/bin/sh\ntouch {mark}\n")
    python.chmod(0o755)
    out = tmp_path / "out"
    for mode in ("check", "bench-small", "bench-ds", "profile-ds", "lent"):
        env = {"PATH": "/usr/bin:/bin", "OUT": str(out), "PYTHON": str(python)}
        done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_first_contact.sh"), mode], env=env,
                              capture_output=True, text=True)
        assert done.returncode == 2 and "no CUDA device" in done.stderr, done
    assert not mark.exists() and not out.exists()


def test_the_first_contact_script_refuses_an_unknown_mode():
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_first_contact.sh"), "bench-all"],
                          capture_output=True, text=True)
    assert done.returncode == 64 and "usage" in done.stderr


@pytest.mark.parametrize("script", ["gpu_smoke.py", "bench_gpu.py", "gpu_sweep.py", "gpu_profile.py"])
def test_the_python_gpu_scripts_exit_2_without_cuda(script, tmp_path):
    where = "--json" if script == "gpu_smoke.py" else "--out"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), where, str(tmp_path / "x")],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 2 and "needs a CUDA device" in done.stderr, done.stderr[-2000:]


# ||a - b|| / ||b|| a step may reach: fp32 as the suite's assert_close; bf16 keeps 8 bits,
# one rounding is up to 2^-9 (2e-3) relative, and a step rounds a few times in a row
STEP_REL = {"float32": 1e-5, "bfloat16": 1e-2}


def test_the_smokes_layer_step_runs_on_the_cpu():
    """The smoke's layer step, which only a GPU runs, with the CPU as its device: the code
    keeps pace with the package's API (a GPU run once found it broken), and its output and
    gradients are the dense reference's by autograd.  (Its device-against-CPU figures
    compare a CPU run with itself here, so they are not checked.)"""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_smoke
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    got = gpu_smoke.layer(device="cpu")
    assert got["float32_gemm_path"] == got["bfloat16_gemm_path"] == "per-expert"
    for dtype, bound in STEP_REL.items():
        for what in ("y", "dx", "dw13"):
            assert got[f"{dtype}_{what}_ref_rel"] < bound, (dtype, what, got[f"{dtype}_{what}_ref_rel"])


def test_the_model_check_refits_a_saved_run_and_predicts_it(capsys):
    """``gpu_model_check.py`` on a committed H200 run: the graph rebuilt on the CPU matches
    the stamped timeline task for task, and the model refitted to its stamps replays the
    measured forward within 5% (0.987 now; 2.04 with the fit and model before this
    check existed, 1.09 with GEMM tiles charged their bytes again): a change to the fit or
    the simulator that breaks the model against real measurements fails here."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_model_check
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    run = ROOT / "benchmarks" / "results" / "h200-2026-11-27" / "bench-deepseek-v3-fit-3.json"
    assert gpu_model_check.main([str(run)]) == 0
    rows = [r for r in capsys.readouterr().out.splitlines() if "| hyperparallel |" in r]
    assert len(rows) == 1
    predicted, measured = (float(c) for c in rows[0].split("|")[4:6])
    assert measured == pytest.approx(9.174, abs=1e-3) and 0.95 <= predicted / measured <= 1.05


def test_the_plan_cost_on_a_gpu_exits_2_without_cuda(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "slot_plan_cost.py"), "--device", "cuda",
                           "--json", str(tmp_path / "x.json")], capture_output=True, text=True)
    assert done.returncode == 2 and "no CUDA device" in done.stderr and not (tmp_path / "x.json").exists()


def test_the_gpu_bench_dry_run_reaches_every_peer_row_on_the_cpu(tmp_path):
    """``bench_gpu.py --dry-run`` runs each row's code on a cut shape before a GPU's time is
    spent on it: every row the default modes record is there, timed, or failed only for
    what needs CUDA; one failing row does not end the shape's others."""
    args = ["--dry-run", "--peers-only", "--shapes", "small", "--routing", "balanced", "zipf",
            "--out", str(tmp_path)]
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_gpu.py"), *args],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "bench_gpu.json").read_text())
    assert report["meta"]["dry_run"] and report["meta"]["tokens"] == 64
    rows = report["rows"]
    for routing in ("balanced", "zipf"):
        seen = {(r["region"], r["variant"]) for r in rows if r["routing"] == routing}
        for region in ("fwd", "fwd+bwd"):
            for variant in ("hpmoe-kernel-by-kernel", "hpmoe-default", "torch-eager", "torch-grouped-mm",
                            "hf-grouped-mm", "hf-eager", "hpmoe-from-hf"):
                assert (region, variant) in seen, (routing, region, variant)
        assert ("fwd+bwd", "hpmoe-default+offload") in seen
    for r in rows:
        assert r["ms"] == r["ms"] or "CUDA" in r["error"], r  # timed, or refused for want of CUDA
        assert r["ms"] != r["ms"] or not r["error"], r
