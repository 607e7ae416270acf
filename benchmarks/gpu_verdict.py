"""The GPU issues' acceptance figures read off a ``bench_gpu.py`` JSON: each goal with
its measured ratio and HIT, MISS or "not measured" (no row, or a row with an error).

A speedup is the comparison row's milliseconds over hpmoe's: the fastest torch variant
(``torch-eager``, ``torch-grouped-mm`` and their ``+cudagraph`` replays, as the issues
count it), or transformers' ``grouped_mm`` block (``hf-grouped-mm``).  A GEMM phase's
rate is its TFLOP/s over ``torch._grouped_mm``'s on the same phase
(``phase/gemm_up`` against ``grouped-mm/gemm_up``; runs without ``--peers-only``).
Host syncs are each row's ``host_syncs`` (None: not counted).  It reads JSON only: run it
anywhere on the files a GPU run wrote.

    .venv/bin/python benchmarks/gpu_verdict.py benchmarks/results/<run>/bench-lent.json
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

TORCH = ("torch-eager", "torch-eager+cudagraph", "torch-grouped-mm", "torch-grouped-mm+cudagraph")
HF = ("hf-grouped-mm",)
SHAPES = ("deepseek-v3-fit", "qwen3-30b-a3b", "mixtral-8x7b", "small")


@dataclass(frozen=True)
class Goal:
    """``variant`` at least ``floor`` times faster than the fastest of ``against`` (or,
    for a GEMM phase, ``floor`` of its rate) on ``shape`` and ``region``."""

    issue: int
    variant: str
    against: tuple[str, ...]
    shape: str
    region: str
    floor: float


def _speedups(issue: int, variant: str, against: tuple[str, ...], floors: dict[tuple[str, str], float],
              everywhere: float | None = None) -> list[Goal]:
    """Goals per (shape, region): ``floors``, and ``everywhere`` where none is higher."""
    out = []
    for shape in SHAPES:
        for region in ("fwd", "fwd+bwd"):
            floor = max(floors.get((shape, region), 0.0), everywhere or 0.0)
            if floor:
                out.append(Goal(issue, variant, against, shape, region, floor))
    return out


_DEFAULT = {("deepseek-v3-fit", "fwd+bwd"): 1.4, ("qwen3-30b-a3b", "fwd+bwd"): 1.4,
            ("mixtral-8x7b", "fwd+bwd"): 1.1, ("small", "fwd+bwd"): 1.0,
            ("deepseek-v3-fit", "fwd"): 1.2, ("qwen3-30b-a3b", "fwd"): 1.2}
GOALS = (_speedups(44, "hpmoe-default", TORCH, _DEFAULT, everywhere=0.95)
         + _speedups(44, "hpmoe-default", HF, _DEFAULT, everywhere=0.95)
         + _speedups(48, "hpmoe-persistent", TORCH, {("qwen3-30b-a3b", "fwd+bwd"): 1.3,
                                                     ("small", "fwd+bwd"): 1.3,
                                                     ("deepseek-v3-fit", "fwd+bwd"): 1.0})
         + [Goal(48, f"phase/{g}", (f"grouped-mm/{g}",), s, "fwd", 0.85)
            for s in SHAPES for g in ("gemm_up", "gemm_down")])
SYNC_FREE = ("hpmoe-default", "hpmoe-persistent")  # no host sync in a call (#44, #48)


@dataclass(frozen=True)
class Verdict:
    """A goal on one routing: the ratio measured (None: not measured), with what it
    compared."""

    goal: Goal
    routing: str
    ratio: float | None
    detail: str

    @property
    def hit(self) -> bool | None:
        return None if self.ratio is None else self.ratio >= self.goal.floor

    def line(self) -> str:
        g = self.goal
        mark = {True: "HIT", False: "MISS", None: "not measured"}[self.hit]
        got = "-" if self.ratio is None else f"{self.ratio:.2f}x"
        against = "torch" if g.against == TORCH else g.against[0]
        return (f"#{g.issue} {g.shape:<16} {self.routing:<8} {g.region:<7} {g.variant:<16} vs {against:<20} "
                f"{got:>6} (goal >= {g.floor:.2f}x)  {mark:<12} {self.detail}")


def _ok(row: dict | None) -> bool:
    return row is not None and not row.get("error") and math.isfinite(row.get("ms", math.nan))


def verdicts(rows: list[dict]) -> list[Verdict]:
    """Every goal on every routing ``rows`` hold (rows without one: ``"-"``)."""
    index = {(r["shape"], r.get("routing", "-"), r["region"], r["variant"]): r for r in rows}
    out = []
    for routing in sorted({r.get("routing", "-") for r in rows}):
        for g in GOALS:
            mine = index.get((g.shape, routing, g.region, g.variant))
            peers = [r for v in g.against if _ok(r := index.get((g.shape, routing, g.region, v)))]
            if not _ok(mine) or not peers:
                why = (mine or {}).get("error", "")[:60] or "no row" if not _ok(mine) else \
                    f"no row of {' / '.join(g.against)}"
                out.append(Verdict(g, routing, None, why))
                continue
            if g.variant.startswith("phase/"):
                peer = peers[0]
                out.append(Verdict(g, routing, mine["tflops"] / peer["tflops"],
                                   f"{mine['tflops']:.0f} against {peer['tflops']:.0f} TFLOP/s"))
                continue
            best = min(peers, key=lambda r: r["ms"])
            out.append(Verdict(g, routing, best["ms"] / mine["ms"],
                               f"{mine['ms']:.3f} ms against {best['variant']} {best['ms']:.3f} ms"))
    return out


def sync_lines(rows: list[dict]) -> list[str]:
    """Per sync-free variant: the rows that counted a host sync, or that none did."""
    out = []
    for variant in SYNC_FREE:
        counted = [r for r in rows if r["variant"] == variant and r.get("host_syncs") is not None]
        synced = [f"{r['shape']} {r.get('routing', '-')} {r['region']}: {r['host_syncs']}"
                  for r in counted if r["host_syncs"]]
        if not counted:
            out.append(f"{variant}: host syncs not counted in this file")
        else:
            verdict = "MISS: " + "; ".join(synced) if synced else f"HIT: none in {len(counted)} rows"
            out.append(f"{variant}: host syncs per call {verdict}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", type=Path, help="a bench_gpu.py JSON")
    a = p.parse_args(argv)
    data = json.loads(a.json.read_text())
    meta = data.get("meta", {})
    print(f"{a.json.name}: {meta.get('device', '?')}, torch {meta.get('torch', '?')}, "
          f"{meta.get('tokens', '?')} tokens{' (DRY RUN: not GPU figures)' if meta.get('dry_run') else ''}")
    found = verdicts(data["rows"])
    for v in found:
        print(v.line())
    for line in sync_lines(data["rows"]):
        print(line)
    hits = [v.hit for v in found if v.hit is not None]
    print(f"{sum(hits)} of {len(hits)} measured goals met; {len(found) - len(hits)} not measured")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
