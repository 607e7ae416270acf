"""Put visibility on the shared-memory transport: a reader that wakes on a put's
signal must see all of the put's data.  Two ranks put generation after generation
into each other (64 B to 8 MiB, the large ones past memcpy's non-temporal-store
threshold) and check every element as soon as the signal arrives; a deliberately
broken put (signal first, data after) shows that the check catches early reads."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from hpmoe.exec.program import PeerView
from hpmoe.runtime.transport.heap import HeapNeed
from hpmoe.runtime.transport.segment import SHM_DIR, new_token
from hpmoe.runtime.transport.shm import ShmTransport
from hpmoe.testing import spawn_gloo

DATA, ACK = 0, 1  # events: a put landed here; the peer has checked our last put


def _wait(transport: ShmTransport, event: int, target: int, deadline_s: float = 30.0) -> None:
    c, base = transport.counters, int(transport.base[event])
    limit = time.monotonic() + deadline_s
    while c.progress(event, base) < target:
        if time.monotonic() > limit:
            raise TimeoutError(f"event {event} stuck at {c.progress(event, base)} of {target}")
        c.sleep(event, c.value(event), 0.05)


def _put(transport: ShmTransport, peer: int, src: torch.Tensor, broken: bool) -> None:
    if not broken:
        transport.put(peer, PeerView("data", 0, src.shape[0]), src, (DATA,), 0)
        return
    transport.signal(peer, DATA)  # the bug under test: signal before the data
    transport.view(peer, "data").copy_(src)


def _ping_pong(transport: ShmTransport, rank: int, n: int, generations: int, broken: bool) -> int:
    """Puts of generations 1..G — both ways, or (broken puts) rank 0 to an idle rank 1
    that checks at once; returns the torn or early reads seen.  The last element is
    checked first: it is written last."""
    need = HeapNeed(events=2, fields=(("data", (n,), torch.int32),))
    mine = transport.map_region([need, need])["data"]
    peer, bad = 1 - rank, 0
    writes, reads = rank == 0 or not broken, rank == 1 or not broken
    src = torch.empty(n, dtype=torch.int32)
    for gen in range(1, generations + 1):
        if writes:
            _wait(transport, ACK, gen - 1)  # the peer has read our previous put
            src.fill_(gen)
            _put(transport, peer, src, broken)
        if reads:
            _wait(transport, DATA, gen)
            bad += int(int(mine[-1]) != gen or not bool((mine == gen).all()))
            transport.signal(peer, ACK)
    if writes:
        _wait(transport, ACK, generations)
    return bad


def _all_gather(row: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(row) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, row)
    return torch.stack(parts)


def _rank(rank: int, world: int, cases: list[tuple[int, int, bool]]) -> list[int]:
    box = [new_token()]  # the job token, agreed through the group
    dist.broadcast_object_list(box, src=0)
    pids = [0] * world
    dist.all_gather_object(pids, os.getpid())
    transport = ShmTransport(rank, world, box[0], pids, _all_gather)
    try:
        out = []
        for n, generations, broken in cases:
            transport.begin()  # snapshot, then the collective: as a region does
            dist.barrier()
            out.append(_ping_pong(transport, rank, n, generations, broken))
        return out
    finally:
        transport.close()


def test_data_is_visible_before_the_signal_and_the_check_would_see_otherwise() -> None:
    before = sorted(p.name for p in SHM_DIR.glob("hpmoe-*"))
    cases = [(16, 3000, False), (16384, 600, False), (2 << 20, 30, False), (2 << 20, 20, True)]
    results = spawn_gloo(_rank, 2, cases, timeout=120)
    for rank in range(2):
        assert results[rank][:3] == [0, 0, 0], f"rank {rank} read a put before its data landed"
    assert results[0][3] + results[1][3] > 0, "signal-before-data went unnoticed"
    assert sorted(p.name for p in SHM_DIR.glob("hpmoe-*")) == before
