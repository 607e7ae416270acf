"""Trace export: Chrome/Perfetto JSON schema, link tracks, Gantt PNG, ``hpmoe trace``."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hpmoe.cli import main
from hpmoe.schedule import WorkerCounts
from hpmoe.sim.simulate import Timeline, simulate
from hpmoe.sim.trace import chrome_trace, gantt_figure, lane_names, track_ids, write_gantt, write_trace

from .handmade import UNIT_HW, build, by_hand, gemm, put

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def sample_timeline() -> Timeline:
    """Rank 0 puts to rank 1 (2 µs on the link), rank 1 then runs a 3 µs GEMM."""
    g = build(2, [put(0, 1, 2, signals=[(1, 0)]), gemm(3, rank=1, wait=0)], {1: [1]})
    return simulate(by_hand(g, [0, 0]), UNIT_HW).timeline


def check_schema(trace: dict) -> None:
    """The Trace Event Format's JSON object form, as trace viewers read it."""
    assert isinstance(trace, dict) and isinstance(trace["traceEvents"], list)
    for ev in trace["traceEvents"]:
        assert isinstance(ev["name"], str) and ev["ph"] in ("X", "M")
        assert isinstance(ev["pid"], int) and isinstance(ev["tid"], int)
        if ev["ph"] == "X":
            assert isinstance(ev["ts"], float) and isinstance(ev["dur"], float)
            assert ev["ts"] >= 0 and ev["dur"] >= 0 and isinstance(ev.get("cat", ""), str)
        else:
            assert ev["name"] in ("process_name", "thread_name", "process_sort_index", "thread_sort_index")
            assert isinstance(ev["args"], dict)


def test_trace_has_worker_and_link_tracks():
    tl = sample_timeline()
    trace = chrome_trace(tl)
    check_schema(trace)
    json.dumps(trace)  # plain JSON types only
    tasks = [e for e in trace["traceEvents"] if e.get("cat") in ("matrix", "vector")]
    links = [e for e in trace["traceEvents"] if e.get("cat") == "link"]
    egress, ingress = track_ids(WorkerCounts(1, 2))
    assert [(e["name"], e["pid"], e["tid"], e["ts"], e["dur"]) for e in tasks] == [
        ("dispatch", 0, 1, 0.0, pytest.approx(3.0)),
        ("gemm_up", 1, 0, pytest.approx(3.0), pytest.approx(3.0))]
    assert sorted((e["pid"], e["tid"]) for e in links) == [(0, egress), (1, ingress)]
    assert all(e["dur"] == pytest.approx(2.0) for e in links)
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"]
             if e["name"] == "thread_name"}
    assert names[(0, 0)] == "matrix 0" and names[(1, 2)] == "vector 1" and names[(0, egress)] == "link egress"


def test_trace_of_some_ranks_only():
    trace = chrome_trace(sample_timeline(), ranks=(1,))
    assert {e["pid"] for e in trace["traceEvents"]} == {1}
    with pytest.raises(ValueError, match="ranks"):
        chrome_trace(sample_timeline(), ranks=(5,))


def test_write_trace_and_gantt(tmp_path):
    tl = sample_timeline()
    path = write_trace(tl, tmp_path / "t" / "trace.json")
    check_schema(json.loads(path.read_text()))
    png = write_gantt(tl, tmp_path / "gantt.png")
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_the_gantt_chart_is_titled_lane_labelled_and_its_legend_beside_the_bars():
    tl = sample_timeline()
    fig = gantt_figure(tl, title="tiny, EP 2")
    ax = fig.axes[0]
    assert ax.get_title() == f"tiny, EP 2\nmakespan {tl.makespan * 1e6:,.1f} µs"
    labels = [t.get_text() for t in ax.get_yticklabels()]
    lanes = lane_names(tl.workers)
    assert labels == [f"rank {r}  {n}" for r in (0, 1) for n in lanes]
    assert lanes[-2:] == ["link egress", "link ingress"] and lanes[0] == "matrix 0"
    fig.canvas.draw()
    legend = ax.get_legend().get_window_extent()
    assert legend.x0 >= ax.get_window_extent().x1  # beside the plot, never over a bar


def test_a_measured_timeline_exports_too():
    """Any Timeline (e.g. one a runtime measured) exports; no link transfers here."""
    n = 3
    tl = Timeline(ep=1, workers=WorkerCounts(1, 1), kind=np.array([2, 3, 4]), rank=np.zeros(n, int),
                  peer=np.zeros(n, int), unit=np.array([0, 1, 0]), worker=np.zeros(n, int),
                  start=np.array([0.0, 1e-6, 2e-6]), end=np.array([1e-6, 2e-6, 3e-6]),
                  link_start=np.full(n, np.nan), link_end=np.full(n, np.nan))
    trace = chrome_trace(tl)
    check_schema(trace)
    assert [e["name"] for e in trace["traceEvents"] if e["ph"] == "X"] == ["gemm_up", "swiglu", "gemm_down"]


def test_cli_trace_writes_both_files(tmp_path, capsys):
    assert main(["trace", "--preset", "tiny", "--dtype", "fp32", "--ep", "2", "--tokens", "16",
                 "--out", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    check_schema(json.loads((tmp_path / "trace.json").read_text()))
    assert (tmp_path / "gantt.png").read_bytes()[:8] == PNG_MAGIC
    assert out["trace"].endswith("trace.json") and out["makespan_us"] > 0
