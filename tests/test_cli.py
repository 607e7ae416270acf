"""First contact with the command line: help with defaults for every flag, a version,
and every input error as one line naming the flag and value (nothing is launched)."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from hpmoe.cli import build_parser, main, version
from hpmoe.cli.bench import bench_config
from hpmoe.exec.backend import Backend
from hpmoe.routing import RoutingKind, synthetic_routing
from hpmoe.spec import DispatchMode, ParallelSpec, preset


def _subparsers() -> dict:
    return next(a for a in build_parser()._actions if a.dest == "command").choices


def test_every_flag_has_help_and_help_shows_defaults(capsys: pytest.CaptureFixture) -> None:
    for name, sub in _subparsers().items():
        for action in sub._actions:
            assert action.help, f"hpmoe {name} {action.option_strings} has no help"
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = capsys.readouterr().out
    assert "(default: small)" in out and "(default: 60.0)" in out and "stall" in out


def test_version(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.strip() == f"hpmoe {version()}"


@pytest.mark.parametrize(("argv", "message"), [
    (["bench", "--link", "0gbit"], "hpmoe bench: error: --link='0gbit' must be at least 8kbit"),
    (["bench", "--link", "fast"], "hpmoe bench: error: --link='fast' must look like 2gbit"),
    (["bench", "--fault", "explode:0"], "hpmoe bench: error: --fault='explode:0' must be KIND:RANK[:AFTER] "
                                        "with KIND one of kill, silent, unreachable, stall"),
    (["bench", "--workers", "2"], "hpmoe bench: error: --workers='2' must be MATRIX,VECTOR"),
    (["bench", "--backend", "kernel_by_kernel", "--schedule", "hyperparallel"],
     "hpmoe bench: error: --backend kernel_by_kernel runs no schedule: --schedule=hyperparallel must be "
     "left at auto"),
    (["bench", "--preset", "tiny", "--tokens", "0"],  # before any rank starts: said once
     "hpmoe bench: error: ParallelSpec.tokens_per_rank must be a positive int, got 0"),
])
def test_bad_flags_end_in_one_line_naming_flag_and_value(argv: list[str], message: str,
                                                           capsys: pytest.CaptureFixture) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith(message), err


def test_the_bench_runs_the_tiles_and_path_its_flags_name() -> None:
    args = build_parser().parse_args(["bench", "--dispatch", "per-rank", "--tile-rows", "256",
                                      "--backend", "kernel_by_kernel"])
    config = bench_config(args)
    assert config.tiles.dispatch is DispatchMode.PER_RANK and config.tiles.rows == 256
    assert config.backend is Backend.KERNEL_BY_KERNEL and not config.tunes
    assert bench_config(build_parser().parse_args(["bench"])).tunes


def test_a_missing_plotting_extra_is_named_before_any_work(monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture, tmp_path) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "matplotlib" else real(n, *a))
    assert main(["trace", "--preset", "tiny", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("hpmoe trace: error: hpmoe trace (gantt.png) needs matplotlib, which is not installed: "
                   "pip install 'hpmoe[plot]' (or make demo / make test, which install it)")
    assert list(tmp_path.iterdir()) == []


def test_info_counts_bytes_and_flops_in_integers(capsys: pytest.CaptureFixture) -> None:
    """The tiny layer, EP 2, 64 tokens a rank, balanced routing, fp32: the counts are
    integers, and the link bytes and flops are what the routing and the shapes give,
    counted here by hand."""
    assert main(["info", "--preset", "tiny", "--ep", "2", "--tokens", "64", "--dtype", "fp32", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    for key in ("link_bytes_per_rank_max", "link_bytes_per_rank_mean", "memory_bytes", "flops"):
        assert isinstance(doc[key], int), (key, doc[key])
    spec, par = preset("tiny"), ParallelSpec(ep=2, tokens_per_rank=64)
    ids = synthetic_routing(RoutingKind.BALANCED, spec, par, seed=0).ids
    home, owner = torch.arange(128)[:, None].expand_as(ids) // 64, ids // par.local_experts(spec)
    away = home != owner  # a row dispatched to another rank, and its result combined back
    link = [int((away & (home == r)).sum() + (away & (owner == r)).sum()) * spec.hidden * 4 for r in range(2)]
    assert (doc["link_bytes_per_rank_max"], doc["link_bytes_per_rank_mean"]) == (max(link), sum(link) // 2)
    h, f, fs, tokens = spec.hidden, spec.ffn, spec.shared_ffn, 128
    gemm = ids.numel() * (2 * h * 2 * f + 2 * f * h) + tokens * (2 * h * 2 * fs + 2 * fs * h)
    swiglu = 5 * (ids.numel() * f + tokens * fs)  # 5 flops an element
    weighted_sum = 2 * tokens * (spec.top_k + spec.shared_experts) * h  # 2 flops a term: top-k rows, shared
    assert doc["flops"] == gemm + swiglu + weighted_sum
