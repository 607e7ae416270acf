"""``backend='auto'`` in one process: the first calls of a shape time the kernel-by-kernel
path and the persistent kernel (here in Triton's interpreter, on the CPU) on real
training steps, every step's output and gradients those of the exact layer, and the
fastest runs from then on; the choice is the tuner's, saved and reported as on an EP
group."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

pytest.importorskip("triton")

import hpmoe.schedule.tuner as tuner_module  # noqa: E402
from hpmoe.engine import RegionOptions, moe_forward  # noqa: E402
from hpmoe.nn.layer import MoE  # noqa: E402
from hpmoe.routing import route  # noqa: E402
from hpmoe.schedule.auto import Path  # noqa: E402
from hpmoe.schedule.tune import KERNEL_BY_KERNEL_KNOBS, Budget, DeviceSpace, Knobs, Tuning  # noqa: E402
from hpmoe.schedule.tune_cache import CACHE_ENV  # noqa: E402
from hpmoe.schedule.tuner import Tuner, timed  # noqa: E402
from hpmoe.spec import DispatchMode, TileSpec, preset  # noqa: E402
from hpmoe.weights import ExpertWeights  # noqa: E402

TILES = TileSpec(rows=4, gemm_rows=8, gemm_cols=16)


def _step(layer: MoE, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x = x.clone().requires_grad_()
    out = layer(x)
    out.backward(torch.ones_like(out))
    grads = tuple(p.grad.clone() for p in layer.parameters())
    layer.zero_grad()
    return out.detach(), x.grad, *grads


class FedClock:
    """The tuner's clock, fed instead of measured: a block it times (a step's forward, then
    its backward) takes ``seconds[knobs]`` of the trial the tuner started last."""

    def __init__(self, seconds: dict[Knobs, float], monkeypatch: pytest.MonkeyPatch):
        self.seconds, self.now, self.knobs = seconds, 0.0, None
        start = Tuner.start

        def started(tuner: Tuner, *args: object, **kwargs: object) -> object:
            trial = start(tuner, *args, **kwargs)
            self.knobs = trial.knobs
            return trial
        monkeypatch.setattr(Tuner, "start", started)
        monkeypatch.setattr(tuner_module, "time", self)

    def perf_counter(self) -> float:
        self.now += self.seconds.get(self.knobs, 0.0)
        return self.now


def test_auto_times_both_paths_on_real_steps_and_keeps_the_fastest(monkeypatch, tmp_path):
    """Every candidate runs real steps, each the exact layer's; the times the tuner sees
    are fed (kernel by kernel fastest, then the persistent kernel under critical-path,
    then under hyperparallel, its default), so winner and runner-up are the fed times'
    choice, whatever this host's timings."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "tune.json"))
    hyper, critical = (Knobs(Path.PERSISTENT, p) for p in DeviceSpace().policies)
    fed = {KERNEL_BY_KERNEL_KNOBS: 1e-3, hyper: 3e-3, critical: 2e-3}
    FedClock(fed, monkeypatch)
    spec = preset("tiny")
    w = ExpertWeights.random(spec, 3)
    exact = MoE(spec, w, tiles=TILES, schedule=None)
    layer = MoE(spec, w, tiles=TILES, backend="auto")
    layer._door.auto.tuner = Tuner(Budget(warmup=0, trials=1, final=1, final_max=1))
    x = torch.randn(8, spec.hidden, generator=torch.Generator().manual_seed(1))
    want = _step(exact, x)
    ran = []
    for _ in range(Budget(warmup=0, trials=1, final=1, final_max=1).max_steps):
        got = _step(layer, x)
        ran.append(layer._door.auto.tuner._open.knobs)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        if layer.tuned(8) is not None:
            break
    result = layer.tuned(8)
    assert result is not None and result.source == "measured"
    assert set(ran) == set(fed)  # each candidate ran a real step
    assert (result.winner, result.runner_up) == (KERNEL_BY_KERNEL_KNOBS, critical)
    assert result.winner_s == pytest.approx(2 * fed[KERNEL_BY_KERNEL_KNOBS])  # its forward and backward
    _step(layer, x)
    settled = layer._door.auto.tuner._open
    assert settled.knobs == KERNEL_BY_KERNEL_KNOBS and not settled.tuning  # nothing timed or waited for
    with timed(settled, torch.device("cpu")):
        torch.ones(64, 64) @ torch.ones(64, 64)
    assert settled.seconds == 0.0
    saved = json.loads((tmp_path / "tune.json").read_text())
    assert "one process on cpu" in json.dumps(saved)


def test_a_faster_persistent_kernel_wins_on_fed_times():
    times = {KERNEL_BY_KERNEL_KNOBS: 1.0, Knobs(Path.PERSISTENT, DeviceSpace().policies[0]): 0.7,
             Knobs(Path.PERSISTENT, DeviceSpace().policies[1]): 0.8}
    tuning = Tuning(DeviceSpace())
    while tuning.result is None:
        k = tuning.next()
        tuning.observe(k, times[k])
    assert tuning.result.winner.path is Path.PERSISTENT and tuning.result.winner_s == 0.7
    for k in times:
        assert Knobs.from_json(json.loads(json.dumps(k.to_json()))) == k


def test_auto_backend_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="backend='auto' measures its own choice"):
        RegionOptions(backend="auto", schedule=None)
    with pytest.raises(ValueError, match="runs in one process"):
        RegionOptions(backend="auto", ep_group=object())
    with pytest.raises(ValueError, match="PER_EXPERT only"):
        RegionOptions(backend="auto", tiles=dataclasses.replace(TILES, dispatch=DispatchMode.PER_RANK))
    spec = preset("tiny")
    w = ExpertWeights.random(spec, 0)
    x = torch.randn(4, spec.hidden)
    with pytest.raises(ValueError, match="use hpmoe.MoE"):
        moe_forward(x, w, route(x, w), backend="auto")


def test_the_persistent_candidates_claim_equal_bits_and_compute_them():
    """``Knobs.rounding`` says the persistent kernel's policies compute the same bits
    (every tile one task over its whole reduction): forward outputs and gradients equal
    bitwise under each, in the interpreter."""
    from hpmoe.engine import TritonPath
    from hpmoe.routing import Routing

    persistent = [k for k in DeviceSpace().every() if k.path is Path.PERSISTENT]
    assert len({k.rounding for k in persistent}) == 1 and len(persistent) == 2
    spec = preset("tiny")
    w = ExpertWeights.random(spec, 4)
    x = torch.randn(8, spec.hidden, generator=torch.Generator().manual_seed(5))
    r = route(x, w)
    dy = torch.randn(8, spec.hidden, generator=torch.Generator().manual_seed(6))
    runs = []
    for k in persistent:
        path = TritonPath(1, TILES, k.policy)
        out, state = path.forward(x, Routing(r.ids, r.weights), w, True)
        g = path.backward(state, dy)
        runs.append((out, g.dx, g.dweights, g.dw13, g.dw2))
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)
