"""The collectives hpmoe issues outside a region, each under the session's deadline.

Every collective is started asynchronously and waited on for at most ``deadline_s``.
One that misses the deadline, or fails because a peer is gone, ends in a
``CollectiveError`` whose report names the ranks that did not arrive and what each
was doing last (their status words on the ``Board``).  The group is unusable after
that (the collective is still pending): the process should report and exit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .board import Board, Status


@dataclass(frozen=True)
class StallReport:
    """Why rank ``rank`` stopped in ``what``: ``missing`` ranks had not arrived;
    ``peers`` describes every other rank (empty when the store did not answer)."""

    rank: int
    what: str
    elapsed_s: float
    cause: str
    missing: tuple[int, ...]
    peers: tuple[str, ...]

    def __str__(self) -> str:
        head = (f"hpmoe runtime: rank {self.rank} stopped after {self.elapsed_s:.3f} s in "
                f"'{self.what}': {self.cause}")
        return "\n".join([head, *(f"  {p}" for p in self.peers)])


class CollectiveError(RuntimeError):
    """A collective that missed its deadline or failed; ``report`` names who is missing."""

    def __init__(self, report: StallReport):
        super().__init__(str(report))
        self.report = report


def stall_report(board: Board, mine: Status, what: str, elapsed_s: float, err: BaseException | str,
                 deadline_s: float) -> StallReport:
    """The report of rank ``board.rank`` whose collective ``what`` (entered as
    ``mine``) did not complete: peers whose status is older than ``mine`` are missing."""
    statuses, now = board.read(), time.time()
    text = str(err)
    failed = "timed out" not in text.lower() and "timeout" not in text.lower()
    first = text.splitlines()[0][:200] if text else "unknown error"
    why = f"it failed: {first}" if failed else f"not done within the {deadline_s:g} s deadline"
    if statuses is None:
        return StallReport(board.rank, what, elapsed_s,
                           f"{why}; the store does not answer (the process hosting it is stopped or gone)",
                           (), ())
    missing = tuple(r for r, st in statuses.items() if r != board.rank and (st is None or st.seq < mine.seq))
    peers = tuple(f"rank {r}: " + (st.describe(now, board.beat_s) if st else "no status published")
                  for r, st in statuses.items() if r != board.rank)
    names = ", ".join(map(str, missing))
    if missing:
        cause = f"rank{'s' if len(missing) > 1 else ''} {names} did not arrive ({why})"
    else:
        cause = f"every rank arrived, but {why}"
    return StallReport(board.rank, what, elapsed_s, cause, missing, peers)


def wire_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where the group's collectives take their tensors: this process's CUDA device for
    an NCCL group (NCCL moves GPU memory only), else the CPU (gloo, or a group with a
    backend per device, which takes either)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Collectives:
    """This rank's collectives over ``group`` (None: the default group), each bounded
    by ``deadline_s`` and announced on ``board``."""

    def __init__(self, group: dist.ProcessGroup | None, board: Board, deadline_s: float):
        self.group, self.board, self.deadline_s = group, board, deadline_s
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.device = wire_device(group)

    def all_gather(self, tensor: torch.Tensor, what: str, publish: bool = True) -> torch.Tensor:
        """[world, *tensor.shape] on ``tensor``'s device: every rank's ``tensor`` (same
        shape and dtype everywhere), gathered on the group's ``device``; ``publish``: see
        ``Board.enter``."""
        sent = tensor.to(self.device).contiguous()
        parts = [torch.empty_like(sent) for _ in range(self.world)]
        mine = self.board.enter(what, publish)
        self._wait(dist.all_gather(parts, sent, group=self.group, async_op=True), mine, what)
        return torch.stack(parts).to(tensor.device)

    def all_reduce(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        """``tensor`` summed over every rank, in place (the same bits on every rank: each
        element is reduced in one place and the sum sent to the others); returns it."""
        mine = self.board.enter(what, publish=False)
        self._wait(dist.all_reduce(tensor, group=self.group, async_op=True), mine, what)
        return tensor

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int] | None,
                   in_splits: list[int] | None, what: str) -> None:
        """``all_to_all_single`` of ``inp`` into ``out`` (rows per peer: the splits;
        None: equal), announced with the next heartbeat."""
        mine = self.board.enter(what, publish=False)
        work = dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group, async_op=True)
        self._wait(work, mine, what)

    def broadcast_bytes(self, data: bytes | None, what: str) -> bytes:
        """Group rank 0's ``data`` on every rank (the others pass None): its length,
        then its bytes, in two all-gathers."""
        mine = torch.frombuffer(bytearray(data or b"\0"), dtype=torch.uint8)
        sizes = self.all_gather(torch.tensor([mine.numel()], device="cpu"), f"{what}: size", publish=False)
        padded = torch.zeros(int(sizes.max()), dtype=torch.uint8, device="cpu")
        padded[:mine.numel()] = mine
        return bytes(self.all_gather(padded, what, publish=False)[0, :int(sizes[0, 0])].numpy())

    def barrier(self, what: str, publish: bool = True) -> None:
        mine = self.board.enter(what, publish)
        self._wait(dist.barrier(group=self.group, async_op=True), mine, what)

    def _wait(self, work: dist.Work, mine: Status, what: str) -> None:
        start = time.monotonic()
        try:
            work.wait(timeout=timedelta(seconds=self.deadline_s))
        except RuntimeError as err:
            raise CollectiveError(self.diagnose(mine, what, err, time.monotonic() - start)) from None

    def diagnose(self, mine: Status, what: str, err: BaseException | str, elapsed_s: float) -> StallReport:
        return stall_report(self.board, mine, what, elapsed_s, err, self.deadline_s)

    def diagnose_current(self, err: BaseException) -> StallReport:
        """The report of a collective issued outside this class (its group's own
        timeout fired, or a peer vanished) during the board's current status."""
        mine = self.board.status
        return self.diagnose(mine, mine.text, err, time.time() - mine.since)
