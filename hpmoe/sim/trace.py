"""Export a ``Timeline`` (simulated or measured) as a Chrome/Perfetto trace and a Gantt PNG.

Trace layout (the Trace Event Format's JSON object form): one process (``pid``) per
rank; inside it one track (``tid``) per worker — matrix workers first, then vector
workers — and two link tracks, egress and ingress.  Every task is a complete event
(``"ph": "X"``) on its worker's track; every transfer is one complete event on its
source's egress track and one on its peer's ingress track.  Times are microseconds.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..ir.graph import TaskKind, Unit
from ..ir.schedule import WorkerCounts
from .simulate import Timeline

if TYPE_CHECKING:
    from matplotlib.figure import Figure

_US = 1e6


def track_ids(workers: WorkerCounts) -> tuple[int, int]:
    """(egress tid, ingress tid) of a rank: after the worker tracks."""
    return workers.per_rank, workers.per_rank + 1


def worker_tid(timeline: Timeline) -> np.ndarray:
    """[n] track id of each task's worker within its rank."""
    vector = timeline.unit == Unit.VECTOR
    return np.where(vector, timeline.workers.matrix, 0) + timeline.worker


def _selected(timeline: Timeline, ranks: tuple[int, ...] | None) -> tuple[int, ...]:
    chosen = tuple(range(timeline.ep)) if ranks is None else tuple(sorted(set(ranks)))
    bad = [r for r in chosen if not 0 <= r < timeline.ep]
    if bad:
        raise ValueError(f"ranks={bad} outside the {timeline.ep} ranks of the timeline")
    return chosen


def metadata_events(timeline: Timeline, ranks: tuple[int, ...]) -> list[dict]:
    """Process and thread names, in rank then track order."""
    names = lane_names(timeline.workers)
    events = []
    for r in ranks:
        events.append({"name": "process_name", "ph": "M", "pid": r, "tid": 0,
                       "args": {"name": f"rank {r}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": r, "tid": 0,
                       "args": {"sort_index": r}})
        for tid, name in enumerate(names):
            events.append({"name": "thread_name", "ph": "M", "pid": r, "tid": tid, "args": {"name": name}})
            events.append({"name": "thread_sort_index", "ph": "M", "pid": r, "tid": tid,
                           "args": {"sort_index": tid}})
    return events


def task_events(timeline: Timeline, ranks: tuple[int, ...]) -> list[dict]:
    """One complete event per task of the selected ranks, on its worker's track."""
    keep = np.flatnonzero(np.isin(timeline.rank, ranks))
    tid = worker_tid(timeline)
    names = [k.name.lower() for k in TaskKind]
    return [{"name": names[k], "cat": "matrix" if u == Unit.MATRIX else "vector", "ph": "X",
             "ts": s * _US, "dur": (e - s) * _US, "pid": r, "tid": t, "args": {"task": i, "peer": p}}
            for i, k, u, s, e, r, t, p in zip(keep.tolist(), timeline.kind[keep].tolist(),
                                             timeline.unit[keep].tolist(), timeline.start[keep].tolist(),
                                             timeline.end[keep].tolist(), timeline.rank[keep].tolist(),
                                             tid[keep].tolist(), timeline.peer[keep].tolist(), strict=True)]


def link_events(timeline: Timeline, ranks: tuple[int, ...]) -> list[dict]:
    """Each transfer on its source's egress track and on its peer's ingress track."""
    egress, ingress = track_ids(timeline.workers)
    has = ~np.isnan(timeline.link_start)
    names = [k.name.lower() for k in TaskKind]
    events = []
    for port, tid, other in ((timeline.rank, egress, timeline.peer), (timeline.peer, ingress, timeline.rank)):
        keep = np.flatnonzero(has & np.isin(port, ranks))
        for i, k, s, e, r, o in zip(keep.tolist(), timeline.kind[keep].tolist(),
                                    timeline.link_start[keep].tolist(), timeline.link_end[keep].tolist(),
                                    port[keep].tolist(), other[keep].tolist(), strict=True):
            events.append({"name": names[k], "cat": "link", "ph": "X", "ts": s * _US, "dur": (e - s) * _US,
                           "pid": r, "tid": tid, "args": {"task": i, "peer": o}})
    return events


def chrome_trace(timeline: Timeline, ranks: tuple[int, ...] | None = None) -> dict:
    """The trace of ``ranks`` (default: all) as a JSON-ready dict with ``traceEvents``."""
    chosen = _selected(timeline, ranks)
    events = metadata_events(timeline, chosen) + task_events(timeline, chosen) + link_events(timeline, chosen)
    return {"traceEvents": events, "displayTimeUnit": "ns",
            "otherData": {"ep": timeline.ep, "makespan_us": timeline.makespan * _US}}


def write_trace(timeline: Timeline, path: str | os.PathLike, ranks: tuple[int, ...] | None = None) -> Path:
    """Write ``chrome_trace(timeline, ranks)`` as JSON to ``path``; returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        json.dump(chrome_trace(timeline, ranks), f, separators=(",", ":"))
    return out


def lane_names(workers: WorkerCounts) -> list[str]:
    """Names of a rank's rows in the Gantt chart and tracks in the trace, in order."""
    return ([f"matrix {i}" for i in range(workers.matrix)] + [f"vector {i}" for i in range(workers.vector)]
            + ["link egress", "link ingress"])


def write_gantt(timeline: Timeline, path: str | os.PathLike, ranks: tuple[int, ...] | None = None,
                title: str | None = None) -> Path:
    """``gantt_figure`` saved as a PNG at ``path``; returns the path."""
    import matplotlib.pyplot as plt

    fig = gantt_figure(timeline, ranks, title)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out


def gantt_figure(timeline: Timeline, ranks: tuple[int, ...] | None = None,
                 title: str | None = None) -> Figure:
    """A Gantt chart (matplotlib Figure) of ``ranks`` (default: the first two): one
    labelled row per worker and link port, bars coloured by task kind, the legend
    beside the plot, ``title`` (plus the makespan) on top.  Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chosen = _selected(timeline, tuple(range(min(timeline.ep, 2))) if ranks is None else ranks)
    names = lane_names(timeline.workers)
    rows = len(names)
    height = max(3.0, 0.16 * rows * len(chosen) + 1.2)
    fig, ax = plt.subplots(figsize=(14, height))
    colors = plt.get_cmap("tab20")
    for k in TaskKind:
        bars = _gantt_bars(timeline, chosen, k, rows)
        if bars:
            for y, spans in bars.items():
                ax.broken_barh(spans, (y - 0.4, 0.8), color=colors(int(k) % 20), linewidth=0)
            ax.plot([], [], color=colors(int(k) % 20), linewidth=6, label=k.name.lower())
    labels = [f"rank {r}  {n}" for r in chosen for n in names]
    ax.set_yticks(range(len(labels)), labels, fontsize=max(4.5, min(8.0, 220 / len(labels))))
    for j in range(1, len(chosen)):
        ax.axhline(j * rows - 0.5, color="black", linewidth=0.8)
    ax.set_ylim(len(labels) - 0.5, -0.5)
    ax.set_xlabel("time (µs)")
    head = title or f"ranks {', '.join(map(str, chosen))} of {timeline.ep}"
    ax.set_title(f"{head}\nmakespan {timeline.makespan * _US:,.1f} µs", fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, title="task kind",
              title_fontsize=8, frameon=False)
    return fig


def _gantt_bars(timeline: Timeline, ranks: tuple[int, ...], kind: TaskKind,
                rows: int) -> dict[int, list[tuple[float, float]]]:
    """Row -> [(start µs, width µs)] of ``kind``'s tasks and transfers on ``ranks``."""
    egress, ingress = track_ids(timeline.workers)
    slot = {r: j for j, r in enumerate(ranks)}
    tid = worker_tid(timeline)
    bars: dict[int, list[tuple[float, float]]] = {}
    m = np.flatnonzero((timeline.kind == kind) & np.isin(timeline.rank, ranks))
    for r, t, s, e in zip(timeline.rank[m].tolist(), tid[m].tolist(), timeline.start[m].tolist(),
                          timeline.end[m].tolist(), strict=True):
        bars.setdefault(slot[r] * rows + t, []).append((s * _US, (e - s) * _US))
    link = (timeline.kind == kind) & ~np.isnan(timeline.link_start)
    for port, track in ((timeline.rank, egress), (timeline.peer, ingress)):
        m = np.flatnonzero(link & np.isin(port, ranks))
        for r, s, e in zip(port[m].tolist(), timeline.link_start[m].tolist(), timeline.link_end[m].tolist(),
                           strict=True):
            bars.setdefault(slot[r] * rows + track, []).append((s * _US, (e - s) * _US))
    return bars
