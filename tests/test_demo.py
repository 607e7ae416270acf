"""``hpmoe demo``: its measured rows run as ``hpmoe bench`` runs (the same launcher), the
linked rows only where namespaces can be built (else one line), one table at the end,
and nothing left behind: no namespaces, shared segments or processes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from hpmoe.cli import demo, main
from hpmoe.cli.bench import BenchFailed, measure
from hpmoe.cli.demo_table import Kind, Row, render
from hpmoe.launch import launcher
from hpmoe.launch.netns import link_unavailable, list_namespaces
from hpmoe.runtime.transport.segment import PREFIX, SHM_DIR, pid_alive

needs_namespaces = pytest.mark.skipif(link_unavailable() is not None,
                                      reason="the linked rows need root, ip and tc")


def _table(out: str) -> list[str]:
    """The summary table's rows."""
    body = out.split("\n== summary", 1)[1].split("reproduce (rows: command):")[0]
    return [line for line in body.splitlines() if re.match(r"^ ?\d+  ", line)]


def _row(table: list[str], pattern: str) -> str:
    """The one row that ``pattern`` finds."""
    found = [line for line in table if re.search(pattern, line)]
    assert len(found) == 1, (pattern, table)
    return found[0]


def _leaked_segments(before: set[str]) -> list[str]:
    """hpmoe's shared segments made since ``before`` whose creating process is dead."""
    pid = re.compile(rf"^{PREFIX}[^-]+-p(\d+)-")
    return [p.name for p in SHM_DIR.glob(f"{PREFIX}*")
            if p.name not in before and (m := pid.match(p.name)) and not pid_alive(int(m.group(1)))]


def _marked(marker: str) -> list[int]:
    """Live processes whose environment holds ``marker``."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker.encode() in (proc / "environ").read_bytes():
                pids.append(int(proc.name))
        except OSError:  # exited meanwhile, or not ours to read
            continue
    return pids


@needs_namespaces
def test_the_quick_demo_measures_the_linked_and_skewed_rows_and_leaves_nothing_behind(tmp_path):
    before = {p.name for p in SHM_DIR.glob(f"{PREFIX}*")}
    marker = f"HPMOE_DEMO_TEST={uuid.uuid4().hex}"
    env = {**os.environ, marker.split("=")[0]: marker.split("=")[1]}
    proc = subprocess.Popen([sys.executable, "-m", "hpmoe", "demo", "--quick", "--out", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    table = _table(out)
    for pattern in (r"1gbit link\s+taskflow", r"1gbit link\s+kernel by kernel", r"shared memory\s+taskflow",
                    r"zipf routing\s+2 replicas"):
        assert _row(table, pattern).endswith("measured"), pattern
    assert _row(table, "Ascend A3 model").endswith("simulated")
    assert [n for n in list_namespaces() if n.startswith(f"hpm-p{proc.pid}-")] == []
    assert launcher.left_by(proc.pid) == []
    assert _leaked_segments(before) == []
    assert _marked(marker) == [], "a process of the demo outlived it"


def test_without_root_the_demo_skips_the_linked_rows_in_one_line_and_exits_0(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(demo, "link_unavailable", lambda: "not root")

    def no_namespaces(*args: object, **kwargs: object) -> None:
        raise AssertionError("the demo built namespaces though it was told it cannot")

    monkeypatch.setattr(launcher, "create_topology", no_namespaces)
    assert main(["demo", "--quick", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    sections = out.split("\n== summary")[0]
    skipped = [line for line in sections.splitlines() if "1gbit" in line and "skipped" in line.lower()]
    assert len(skipped) == 1 and skipped[0].startswith("skipped: the 1gbit-link rows"), skipped
    assert "root" in skipped[0] and "--link 1gbit" in skipped[0]
    table = _table(out)
    assert _row(table, "1gbit link").endswith("skipped: not root; needs root, ip, tc")
    assert _row(table, r"shared memory\s+taskflow").endswith("measured")
    assert _row(table, r"zipf routing\s+2 replicas").endswith("measured")
    assert (tmp_path / "gantt_a3.png").is_file()


def test_a_row_is_timed_exactly_when_measured_or_simulated():
    with pytest.raises(ValueError, match="Row 'c': a skipped row has both times"):
        Row("c", "-", "-", Kind.SKIPPED, "cmd", 1.0, 2.0)
    with pytest.raises(ValueError, match="a measured row has both times"):
        Row("c", "h", "a", Kind.MEASURED, "cmd", 1.0)
    with pytest.raises(TypeError, match="Row.kind must be a Kind, got 'measured'"):
        Row("c", "h", "a", "measured", "cmd", 1.0, 2.0)
    assert Row("c", "h", "a", Kind.SIMULATED, "cmd", 2.0, 3.0).speedup == 1.5


def test_the_table_names_each_command_once_with_its_rows():
    rows = [Row("shm", "taskflow", "serial", Kind.MEASURED, "bench A", 100.0, 150.0, fastest=1.4),
            Row("shm", "kernel by kernel", "serial", Kind.MEASURED, "bench A", 120.0, 150.0),
            Row("gpu", "-", "-", Kind.SKIPPED, "bench_gpu", why="no CUDA device")]
    text = render(rows).splitlines()
    assert "1.50x" in text[1] and "(1.40x)" in text[1] and text[1].endswith("measured")
    assert text[3].endswith("skipped: no CUDA device")
    assert text[-2:] == ["  1, 2: bench A", "  3: bench_gpu"]


def test_a_bad_link_rate_is_named_before_anything_runs(capsys, tmp_path):
    assert main(["demo", "--quick", "--link", "fast", "--out", str(tmp_path / "never")]) == 2
    assert capsys.readouterr().err.startswith("hpmoe demo: error: --link='fast' must look like 2gbit")
    assert not (tmp_path / "never").exists()


def test_a_failed_rank_ends_its_row_with_the_diagnosis_and_the_demo_exits_1(monkeypatch, tmp_path, capsys):
    argv = ["--preset", "tiny", "--tokens", "32", "--warmup", "1", "--iters", "1",
            "--schedule", "hyperparallel", "--fault", "kill:1", "--deadline", "5"]
    diagnosis = r"exit codes \{0: 1, 1: -9\}: hpmoe runtime: rank 0 stopped .*rank 1"
    with pytest.raises(BenchFailed, match=diagnosis):
        measure(argv, timeout_s=120)

    def failing(argv: list[str], timeout_s: float) -> dict:
        raise BenchFailed("hpmoe bench: ranks failed: rank 1 exited")

    monkeypatch.setattr(demo, "measure", failing)
    monkeypatch.setattr(demo, "link_unavailable", lambda: "not root")
    monkeypatch.setattr(demo, "gpu", lambda scale: [])
    assert main(["demo", "--quick", "--out", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "failed: hpmoe bench: ranks failed: rank 1 exited" in out
    assert _row(_table(out), r"zipf routing").endswith("failed: ranks failed: the diagnosis is above")
