"""A rank's runtime session: the transport and the executor of one EP group."""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import TracebackType

import numpy as np
import torch
import torch.distributed as dist

from ..spec import TileSpec
from ..weights import ExpertWeights
from .agree import Fingerprint, RegionKind, agree
from .board import BEAT_S, Board
from .collective import CollectiveError, Collectives, StallReport
from .executor import Executor, ExecutorConfig
from .transport.base import Transport, TransportKind
from .transport.dist import DistTransport
from .transport.local import LocalTransport
from .transport.segment import check_token, new_token, sweep_stale
from .transport.shm import ShmTransport

JOB_ENV = "HPMOE_JOB"  # set by the launcher: prefix of every shared segment of the job
AGREED_COUNTS = 256  # rows per expert a call's agreement carries: a fixed length (rows of unequal
# length would end the all-gather before the ranks' expert counts could be compared); a
# layer with more experts runs kernel by kernel's own count exchange
_OPENS_A_CALL = (RegionKind.FORWARD, RegionKind.FORWARD_DEDUP)  # a backward's agreement follows one


@dataclass(frozen=True)
class Opened:
    """What a call's agreement returned: every rank's token count, the ``figures`` each
    rank sent ([world, m] int64), and the rows [ep, E / ep] int64 each rank routes to
    this rank's experts (None where no rank sent its counts, or the layer has more than
    ``AGREED_COUNTS`` experts)."""

    tokens: list[int]
    figures: np.ndarray
    received: torch.Tensor | None


@dataclass(frozen=True)
class RuntimeConfig:
    """transport: SHM (one host) or DIST (any hosts).  deadline_s: longest wait of any
    task on its event
    (and longest stretch without progress).  poll_s: abort-check interval.
    threads: torch intra-op threads per worker.  check_weights: every region's
    agreement includes a checksum of the weights (a debug switch: it reads every
    weight byte per region).  thread_cpu: record each task's worker-thread CPU time
    (``ExecutorConfig.thread_cpu``).  network: a label for the network between the ranks
    (e.g. ``1gbit``), part of the key of AUTO's tuned choices (``hpmoe bench --link`` sets
    it): the same layer on another network is tuned anew."""

    transport: TransportKind = TransportKind.SHM
    deadline_s: float = 60.0
    poll_s: float = 0.05
    threads: int = 1
    check_weights: bool = False
    thread_cpu: bool = False
    network: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.network, str):
            raise TypeError(f"RuntimeConfig.network must be a str, got {self.network!r}")
        if not isinstance(self.transport, TransportKind):
            raise TypeError(f"RuntimeConfig.transport must be a TransportKind, got {self.transport!r}")
        self.executor_config()  # validates deadline_s, poll_s, threads

    @property
    def tuning_network(self) -> str:
        """The transport and network of a tuning key: ``shm``, ``dist``, ``dist 1gbit``."""
        return f"{self.transport.value} {self.network}".strip()

    def executor_config(self) -> ExecutorConfig:
        return ExecutorConfig(self.deadline_s, self.poll_s, self.threads, thread_cpu=self.thread_cpu)


class Session:
    """This rank's end of the runtime for ``group`` (None: the default group).

    Collective at construction (every rank of the group must create one, within
    ``deadline_s`` of each other).  Until ``close``, SIGTERM and SIGINT first unlink
    the shared segments this rank still holds, then act as before.  ``placement``: the
    expert placement's digest the last layer call agreed on as it opened (0: none; a
    backward's agreement carries none and keeps it): part of AUTO's tuning key
    (``engine.selection.tune_key``)."""

    def __init__(self, config: RuntimeConfig | None = None, group: dist.ProcessGroup | None = None):
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("Session needs an initialized torch.distributed process group")
        self.config = config or RuntimeConfig()
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        store = dist.distributed_c10d._get_default_store()
        hello = _hello(store, group, self.rank, self.world, self.config.deadline_s)
        self.session, self.regions, self.calls, self.placement = hello.token, 0, 0, 0
        beat = min(BEAT_S, self.config.deadline_s / 4)  # a stopped peer looks silent before any deadline
        self.board = Board(store, hello.prefix, self.rank, self.world, beat)
        self.collectives = Collectives(group, self.board, self.config.deadline_s)
        env_job = os.environ.get(JOB_ENV)
        self.job = check_token(JOB_ENV, env_job) if env_job else self.session
        self.executor = Executor(self.config.executor_config())
        self.transport: Transport = self._make_transport(hello)
        self._signals = _Unlinking(self.transport)
        # what close() does, also when the session is dropped without it (a layer let go): nothing
        # the threads or the signal handler hold refers back to the session
        self._release = weakref.finalize(self, _release, self.executor, self.transport, self.board,
                                         self._signals)

    def agree(self, kind: RegionKind, weights: ExpertWeights, tokens: int, tiles: TileSpec,
              error: BaseException | None = None) -> int:
        """Open region number ``regions + 1`` of ``kind`` on every rank: agree on its
        fingerprint and on every rank's input (``error``: this rank's objection).
        Raises ``InputRejected``/``MismatchError`` on every rank, ``CollectiveError`` at
        the deadline.  Returns the region's number."""
        self.regions += 1
        mine = Fingerprint.of(kind, weights, tokens, tiles, self.config.check_weights)
        agree(self.collectives, f"{kind.name.lower()} region {self.regions}: agreement", mine, error)
        return self.regions

    def open_call(self, kind: RegionKind, weights: ExpertWeights, tiles: TileSpec, tokens: int,
                  error: BaseException | None = None, figures: Sequence[int] = (), tuning: int = 0,
                  placement: int = 0, sent: torch.Tensor | None = None, backward: bool = False) -> Opened:
        """Open call number ``calls + 1`` of a layer, before any other collective of it:
        snapshot the counters (no peer signals this call's events before every rank has
        passed the agreement), then agree on what it is (ranks may hold different numbers
        of ``tokens``; ``tuning`` and ``placement``: digests of the layer's tuning history
        and expert placement, equal on ranks in step) and on every rank's input
        (``error``: this rank's objection).  ``figures``: numbers ranks may differ on
        (the tuner's); ``sent``: this rank's rows per expert ([E] int64, None on every
        rank or none), carried so that kernel by kernel needs no count exchange of its
        own; ``backward``: the call records a backward (ranks that differ could never run
        it together).  Raises as ``agree`` on every rank."""
        self.calls += 1
        self.transport.begin()
        carried = np.zeros(AGREED_COUNTS, np.int64)  # one row length on every rank, whatever its layer
        fits = sent is not None and sent.numel() <= AGREED_COUNTS  # the same on ranks that agree
        if fits:
            carried[:sent.numel()] = sent.cpu().numpy()
        mine = Fingerprint.of(kind, weights, 0, tiles, self.config.check_weights, tuning, placement, backward)
        what = f"{kind.name.lower()} call {self.calls}: agreement"
        table = agree(self.collectives, what, mine, error, (tokens, *figures, *carried))
        if kind in _OPENS_A_CALL:
            self.placement = placement  # every rank's, the agreement checked
        m = 1 + len(figures)
        received = None
        if fits:
            local = sent.numel() // self.world
            received = torch.from_numpy(table[:, m + self.rank * local:m + (self.rank + 1) * local].copy())
        return Opened(table[:, 0].tolist(), table[:, 1:m], received)

    def _make_transport(self, hello: _Hello) -> Transport:
        if self.config.transport is TransportKind.LOCAL:
            if self.world != 1:
                raise ValueError(f"transport=local needs a group of one rank, got {self.world}")
            return LocalTransport()
        if self.config.transport is TransportKind.DIST:
            return DistTransport(self.rank, self.world, self.group, self.config.deadline_s)
        if len(set(hello.hosts)) != 1:
            raise ValueError(f"transport=shm needs every rank on one host, got {len(set(hello.hosts))} "
                             "hosts; use transport=dist")
        sweep_stale()  # segments of dead processes (a crash while a segment grew)
        collectives = self.collectives
        return ShmTransport(self.rank, self.world, self.job, list(hello.pids),
                            lambda t: collectives.all_gather(t, "shared segment growth"))

    def close(self) -> None:
        """Stop the threads and release every segment (idempotent, local); a session
        dropped without it does so as it is collected."""
        self._release()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


@dataclass(frozen=True)
class _Hello:
    """What the ranks of a new session told each other: its token, store prefix,
    and every rank's host id and process id."""

    token: str
    prefix: str
    hosts: tuple[int, ...]
    pids: tuple[int, ...]


def _hello(store: dist.Store, group: dist.ProcessGroup | None, rank: int, world: int,
           deadline_s: float) -> _Hello:
    """Open a session through the store: the n-th session a rank opens on a group
    meets the n-th of every other rank; ranks that do not say hello within
    ``deadline_s`` are named.  The token is group rank 0's random draw."""
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    gkey = hashlib.sha256(",".join(map(str, ranks)).encode()).hexdigest()[:12]
    n = store.add(f"hpmoe/{gkey}/opened/{rank}", 1)
    prefix = f"hpmoe/{gkey}/{n}"
    store.set(f"{prefix}/hello/{rank}", f"{new_token()} {_host_id()} {os.getpid()}")
    keys = [f"{prefix}/hello/{r}" for r in range(world)]
    try:
        store.wait(keys, timedelta(seconds=deadline_s))
    except RuntimeError:
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        raise CollectiveError(StallReport(rank, f"session {n} start", deadline_s,
                                          f"rank(s) {missing} did not arrive within the {deadline_s:g} s "
                                          "deadline", tuple(missing), ())) from None
    parts = [v.decode().split() for v in store.multi_get(keys)]
    return _Hello(token=parts[0][0], prefix=prefix, hosts=tuple(int(p[1]) for p in parts),
                  pids=tuple(int(p[2]) for p in parts))


class _Unlinking:
    """SIGTERM and SIGINT while a session is open (installed from the main thread only):
    unlink the segment names its transport still holds, then do what the previous
    handler did (by default: die of the signal).  It holds the transport weakly."""

    def __init__(self, transport: Transport):
        self._transport = weakref.ref(transport)
        main = threading.current_thread() is threading.main_thread()
        self.previous = {s: signal.signal(s, self) for s in (signal.SIGTERM, signal.SIGINT)} if main else {}

    def __call__(self, signum: int, frame: object) -> None:
        transport = self._transport()
        if isinstance(transport, ShmTransport):
            transport.heap.unlink_created()
        old = self.previous.get(signum, signal.SIG_DFL)
        if callable(old):
            old(signum, frame)
        elif old != signal.SIG_IGN:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def restore(self) -> None:
        """Put the previous handlers back where this one is still installed (main thread
        only; elsewhere it stays, passing signals on)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, old in list(self.previous.items()):
            if signal.getsignal(signum) is self:
                signal.signal(signum, old)
                del self.previous[signum]


def _release(executor: Executor, transport: Transport, board: Board, signals: _Unlinking) -> None:
    """A session's close: its signal handlers, worker threads, segments and board."""
    signals.restore()
    executor.close()
    transport.close()
    board.close()


def _host_id() -> int:
    """63-bit id of this host (hostname + boot id)."""
    boot = Path("/proc/sys/kernel/random/boot_id")
    text = socket.gethostname() + (boot.read_text() if boot.exists() else "")
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1
