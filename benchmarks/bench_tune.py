"""AUTO's tuned default path against the exhaustive sweep of its own search space, kernel
by kernel and the serialized baseline: one `hpmoe bench --sweep` per row, with no cpu
profile on disk and an empty tuning cache (each row tunes from nothing).

    .venv/bin/python benchmarks/bench_tune.py [--iters 30] [--warmup 3] [--paired 100]
        [--only ROW ...] [--order balanced|blocks] [--out results.jsonl]

Rows: presets tiny and small x transports shm and dist x 256, 1024 and 4096 tokens per
rank, and small with 1024 tokens over shaped links of 1gbit and 500mbit (root).  Prints
a markdown table; per row, by median and by fastest iteration (in brackets):
default / sweep best (1.00: as fast as the best; the acceptance asks >= 0.95), default
over kernel by kernel, default over the serialized baseline, and the tuning's cost;
then how many rows hold 5% by each measure.
``--paired N`` (0: none) then runs the default and the sweep's fastest candidate N calls
each, alternating call by call: the paired ratio, which the host's drift over the
sweep's minutes does not bias.
``--order blocks`` times each candidate in blocks of 10 back-to-back calls (as training
runs its one path) instead of one call of each per iteration (``hpmoe bench --order``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from hpmoe.machine import record

ROWS = {f"{p}-{t}-{n}": ["--preset", p, "--transport", t, "--tokens", str(n)]
        for p in ("tiny", "small") for t in ("shm", "dist") for n in (256, 1024, 4096)}
ROWS |= {f"small-link-{rate}-1024": ["--preset", "small", "--tokens", "1024", "--link", rate]
         for rate in ("1gbit", "500mbit")}


def bench(argv: list[str], iters: int, warmup: int, order: str, paired: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="hpmoe-bench-tune-") as tmp:
        env = {**os.environ, "HPMOE_PROFILE": str(Path(tmp) / "no-profile.json"),
               "HPMOE_TUNE_CACHE": str(Path(tmp) / "tune.json")}
        cmd = [sys.executable, "-m", "hpmoe", "bench", "--ep", "2", "--dtype", "fp32", "--sweep", "--json",
               "--iters", str(iters), "--warmup", str(warmup), "--order", order, "--paired", str(paired),
               *argv]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def row(name: str, d: dict) -> dict:
    """The figures of one row: ratios by median and by fastest iteration."""
    best = d["sweep"][d["sweep_best"]]
    fastest = min(s["min_ms"] for s in d["sweep"].values())
    return {"row": name, "winner": d["tune_winner"], "default_ms": d["taskflow_ms"],
            "default_min_ms": d["taskflow_min_ms"], "sweep_best": d["sweep_best"],
            "sweep_best_ms": best["ms"],
            "sweep_fastest_ms": fastest,
            "vs_best": d["default_over_sweep_best"], "vs_best_fastest": d["default_over_sweep_best_fastest"],
            "choice_vs_best": d.get("chosen_over_sweep_best"),
            "choice_vs_best_fastest": d.get("chosen_over_sweep_best_fastest"),
            "paired_with": d.get("paired_candidate"), "paired": d.get("default_over_paired"),
            "paired_fastest": d.get("default_over_paired_fastest"),
            "vs_kbk": d["kernel_by_kernel_ms"] / d["taskflow_ms"],
            "vs_kbk_fastest": d["kernel_by_kernel_min_ms"] / d["taskflow_min_ms"],
            "vs_serial": d["speedup"], "vs_serial_fastest": d["serial_min_ms"] / d["taskflow_min_ms"],
            "tune_steps": d["tune_steps"], "tune_seconds": d["tune_seconds"],
            "max_steps": d["tune_max_steps"],
            "steal": d.get("host_steal_fraction")}


def table(rows: list[dict]) -> str:
    out = ["| row | tuned winner | default / sweep best | its choice in the sweep / best "
           "| default / sweep's fastest, paired | over kernel by kernel | over serialized "
           "| tuning steps (s) |",
           "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        choice = ("-" if r["choice_vs_best"] is None
                  else f"{r['choice_vs_best']:.2f} ({r['choice_vs_best_fastest']:.2f})")
        paired = "-" if r["paired"] is None else f"{r['paired']:.2f} ({r['paired_fastest']:.2f})"
        if r["paired_with"] == r["winner"]:
            paired += " same path"
        out.append(f"| {r['row']} | {r['winner']} | {r['vs_best']:.2f} ({r['vs_best_fastest']:.2f}) "
                   f"| {choice} | {paired} | {r['vs_kbk']:.2f}x ({r['vs_kbk_fastest']:.2f}x) "
                   f"| {r['vs_serial']:.2f}x ({r['vs_serial_fastest']:.2f}x) "
                   f"| {r['tune_steps']} ({r['tune_seconds']:.1f}) |")
    return "\n".join(out)


def tally(rows: list[dict]) -> str:
    """How many rows hold the acceptance's 5% (fastest calls, then medians), by each
    measure; a paired row that compares the default's path with itself is a measure of
    the host's noise, not of the tuning."""
    def count(fast: str, median: str, among: list[dict]) -> str:
        ok = [sum(r[k] is not None and r[k] >= 0.95 for r in among) for k in (fast, median)]
        return f"{ok[0]} / {ok[1]} of {len(among)}"
    paired = [r for r in rows if r["paired"] is not None]
    other = [r for r in paired if r["paired_with"] != r["winner"]]
    return "\n".join([
        f"within 5% of the sweep's best (fastest / median): {count('vs_best_fastest', 'vs_best', rows)}",
        f"its choice in the sweep: {count('choice_vs_best_fastest', 'choice_vs_best', rows)}",
        f"paired: {count('paired_fastest', 'paired', paired)}; "
        f"where the sweep's fastest is another path: {count('paired_fastest', 'paired', other)}",
        f"at least 0.95x of kernel by kernel: {count('vs_kbk_fastest', 'vs_kbk', rows)}"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--paired", type=int, default=100,
                   help="calls each of the paired comparison (0: none)")
    p.add_argument("--only", nargs="*", choices=sorted(ROWS), default=None)
    p.add_argument("--order", choices=("balanced", "blocks"), default="balanced")
    p.add_argument("--out", default=None, help="append each row's JSON (figures and the bench's report)")
    args = p.parse_args()
    record()
    rows = []
    for name in args.only or ROWS:
        report = bench(ROWS[name], args.iters, args.warmup, args.order, args.paired)
        rows.append(row(name, report))
        print(json.dumps(rows[-1]), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps({"figures": rows[-1], "report": report}) + "\n")
    print(table(rows))
    print(tally(rows))


if __name__ == "__main__":
    main()
