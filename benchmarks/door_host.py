"""What the front door costs a call in one process (EP 1): ``hpmoe.MoE.region`` against
the path it runs called bare (``exec.kernel_by_kernel.kbk_forward``, and its backward),
on a small layer whose kernels take little time, so that the difference is the door's
host work: the input's form and scan, the load's average, the path's lookup, the
autograd node.  Three cases: an inference call (grad off), a training forward (x needs
a gradient: the autograd node, the saved state) and forward + backward.  Calls
alternate (door, bare, door, ...); medians and fastest calls of
each, and their difference; also the door's own time (each door call less the time it
spent inside the path's forward and backward, which the script times: the door's work
after the path's kernels have run, caches as a real call finds them), the aten ops
each call dispatches (a count that no load on the machine changes) and which the door
adds; on the inference call, the door's input check alone (its form and the scan of
its values), right after a bare call and in a loop.  Last, the layer's weights alone,
with and without gradients: built as a call would build them, and kept between calls
(``nn.weights_cache``), the fastest of 7 rounds of 5,000.

    .venv/bin/python benchmarks/door_host.py [--preset tiny] [--tokens 64] [--calls 2000]

On a GPU (``--device cuda``) each call is issued with the device idle and timed on the
host only (the kernels run after it returns): the host's time to issue a call.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import time
import timeit
from collections.abc import Callable
from unittest import mock

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hpmoe import MoE
from hpmoe.engine.paths import KernelByKernelPath
from hpmoe.exec.arena import ArenaPool
from hpmoe.exec.kernel_by_kernel import kbk_backward, kbk_forward
from hpmoe.machine import record
from hpmoe.routing import Routing, route
from hpmoe.spec import preset
from hpmoe.weights import ExpertWeights


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


def ops(fn: Callable[[], object]) -> collections.Counter:
    with _Ops() as mode:
        fn()
    return mode.counts


def calls(spec_name: str, tokens: int, device: torch.device, grad: bool, backward: bool
          ) -> dict[str, Callable]:
    """The door's call and the bare path's, on the same inputs: ``grad``, x requires a
    gradient (a training forward: the autograd node, the saved state); ``backward``, then
    the backward too."""
    spec = preset(spec_name)
    w = ExpertWeights.random(spec, 0)
    layer = MoE(spec, w).to(device)
    x = torch.randn(tokens, spec.hidden, generator=torch.Generator().manual_seed(1))
    r = route(x, w)
    x, ids, tw = x.to(device), r.ids.to(device), r.weights.detach().to(device)
    wd = ExpertWeights.routed(spec, *(t.detach() if t is not None else None for t in (
        w.w13.to(device), w.w2.to(device), *((w.shared_w13.to(device), w.shared_w2.to(device))
                                             if w.has_shared else (None, None)))))
    pool, dy = ArenaPool(), torch.ones_like(x)
    xl = x.clone().requires_grad_(grad)

    def door() -> object:
        out = layer.region(xl, ids, tw)
        return out.backward(dy) if backward else out

    def bare() -> object:
        out, state = kbk_forward(x, Routing(ids, tw), wd, None, pool, save=grad, checked=True)
        return kbk_backward(state, dy, pool) if backward else out

    def check() -> object:  # the door's input check alone: the form, then the values' scan
        return layer._door._checked(x, Routing(ids, tw), layer._door.logical(x.dtype))

    return {"door": door, "bare": bare, "check": check}


def timed(fns: dict[str, Callable], n: int, device: torch.device) -> dict[str, list[float]]:
    """Seconds of ``n`` calls of each, alternating, with the device idle before each."""
    out: dict[str, list[float]] = {k: [] for k in fns}
    for i in range(n):
        for name in list(fns)[i % 2:] + list(fns)[:i % 2]:
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            fns[name]()
            out[name].append(time.perf_counter() - start)
    return out


def own_us(door: Callable[[], object], n: int) -> np.ndarray:
    """Microseconds of ``n`` door calls each less the time spent inside its path's
    forward and backward (the kernel-by-kernel path's, timed by wrapping them)."""
    inside = [0.0]

    def clocked(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args: object) -> object:
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                inside[0] += time.perf_counter() - start
        return wrapper

    own = []
    path = KernelByKernelPath
    with mock.patch.object(path, "forward", clocked(path.forward)), \
            mock.patch.object(path, "backward", clocked(path.backward)):
        for _ in range(n):
            inside[0] = 0.0
            start = time.perf_counter()
            door()
            own.append((time.perf_counter() - start - inside[0]) * 1e6)
    return np.array(own)


def check_us(bare: Callable[[], object], check: Callable[[], object], n: int) -> dict[str, dict[str, float]]:
    """Microseconds of the door's input check (its form, then the scan of its values,
    which the issue asks for on every call): right after a bare call, as a call finds the
    machine, and right after another check (in a loop, warm)."""
    after: dict[str, list[float]] = {"after_a_bare_call": [], "in_a_loop": []}
    for _ in range(n):
        bare()
        for name in after:
            start = time.perf_counter()
            check()
            after[name].append((time.perf_counter() - start) * 1e6)
    return {k: {"median": round(float(np.median(v)), 1), "fastest": round(float(min(v)), 1)}
            for k, v in after.items()}


def weights_us(spec_name: str, device: torch.device) -> dict[str, dict[str, float]]:
    """Microseconds a call spends on the layer's weights: built, and kept between calls."""
    layer = MoE(preset(spec_name), ExpertWeights.random(preset(spec_name), 0)).to(device)
    out = {}
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            kept = functools.partial(layer._weights_cache.get, layer, layer._region_weights)
            kept()
            out["grad" if grad else "no_grad"] = {
                name: round(min(timeit.repeat(fn, number=5000, repeat=7)) / 5000 * 1e6, 2)
                for name, fn in (("built", layer._region_weights), ("kept", kept))}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    record()
    device = torch.device(args.device)
    torch.set_num_threads(1)
    for grad, backward in ((False, False), (True, False), (True, True)):
        fns = calls(args.preset, args.tokens, device, grad, backward)
        check = fns.pop("check")
        with torch.set_grad_enabled(grad):
            timed(fns, 100, device)  # warm: the path chosen, arenas grown
            us = {k: np.array(v) * 1e6 for k, v in timed(fns, args.calls, device).items()}
            own = own_us(fns["door"], args.calls)
            counted = {k: ops(f) for k, f in fns.items()}
            checked = check_us(fns["bare"], check, args.calls) if not grad else None
        added = counted["door"] - counted["bare"]
        print(json.dumps({
            "args": vars(args), "grad": grad, "backward": backward,
            "median_us": {k: round(float(np.median(v)), 1) for k, v in us.items()},
            "fastest_us": {k: round(float(v.min()), 1) for k, v in us.items()},
            "door_minus_bare_us": {"median": round(float(np.median(us["door"]) - np.median(us["bare"])), 1),
                                   "fastest": round(float(us["door"].min() - us["bare"].min()), 1)},
            "door_own_us": {"median": round(float(np.median(own)), 1), "fastest": round(float(own.min()), 1)},
            "aten_ops": {k: sum(c.values()) for k, c in counted.items()},
            "door_adds": dict(added.most_common()), **({"check_us": checked} if checked else {})}))
    print(json.dumps({"weights_us": weights_us(args.preset, device)}))


if __name__ == "__main__":
    main()
