"""What the cores of one host share, measured outside any region:

- ``puts``: the ``dist`` transport's host CPU per put (``bench.forecast.measure_put_cpu``,
  two gloo ranks, one vector tile of the ``small`` layer per put) with 0, 1, 2 and 4 of the
  share probe's GEMM tiles between consecutive puts; 0 is a burst, whose threads' wake-ups
  are shared between puts.
- ``copy``: bytes/s (read + write) of a 256 MiB ``Tensor.copy_`` in one process alone and in
  two processes at once: the host's memory bandwidth as its cores share it.

    .venv/bin/python benchmarks/host_sharing.py puts
    .venv/bin/python benchmarks/host_sharing.py copy
"""

from __future__ import annotations

import argparse
import multiprocessing as mp

import torch

from hpmoe.bench.forecast import ShareProbe, measure_put_cpu
from hpmoe.bench.overhead import per_call
from hpmoe.machine import record
from hpmoe.schedule.auto import saved_profile
from hpmoe.sim.hardware import HardwareModel
from hpmoe.testing import spawn_gloo

PUT_BYTES = 128 * 512 * 2  # a vector tile of the small layer: 128 rows of H 512, bf16
TILES = (0, 1, 2, 4)


def _put_cpu(rank: int, world: int, profile: dict) -> list[float]:
    tile = ShareProbe(HardwareModel.from_dict(profile), torch.bfloat16).tile
    return [measure_put_cpu(None, PUT_BYTES, lambda k=k: [tile() for _ in range(k)]) for k in TILES]


def puts() -> None:
    profile = saved_profile()
    if profile is None:
        raise SystemExit("no cpu profile: run `hpmoe calibrate` first")
    per_put = spawn_gloo(_put_cpu, 2, profile.to_dict(), timeout=600)[0]
    for k, s in zip(TILES, per_put, strict=True):
        print(f"{k} GEMM tiles between puts: {s * 1e6:.0f} us of host CPU per put")


def _copy_rate(out: mp.Queue, nbytes: int, seconds: float) -> None:
    torch.set_num_threads(1)
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    out.put(2 * nbytes / per_call(lambda: dst.copy_(src), seconds)[0])


def copy_rates(processes: int, nbytes: int = 256 << 20, seconds: float = 1.5) -> list[float]:
    """Bytes/s of each of ``processes`` processes copying at once."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_copy_rate, args=(out, nbytes, seconds)) for _ in range(processes)]
    for p in procs:
        p.start()
    rates = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join()
    return rates


def copy() -> None:
    alone = copy_rates(1)[0]
    both = copy_rates(2)
    print(f"alone {alone / 1e9:.1f} GB/s; two at once " + ", ".join(f"{r / 1e9:.1f}" for r in both)
          + f" GB/s ({min(both) / alone:.2f}-{max(both) / alone:.2f}x)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["puts", "copy"])
    what = p.parse_args().what
    record()
    {"puts": puts, "copy": copy}[what]()


if __name__ == "__main__":
    main()
