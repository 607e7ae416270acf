"""A rank's runtime session: the transport and the executor of one EP group."""

from __future__ import annotations

import hashlib
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import torch
import torch.distributed as dist

from .executor import Executor, ExecutorConfig
from .transport.base import Transport, TransportKind
from .transport.dist import DistTransport
from .transport.local import LocalTransport
from .transport.segment import check_token
from .transport.shm import ShmTransport

JOB_ENV = "HPMOE_JOB"  # set by the launcher: prefix of every shared segment of the job


@dataclass(frozen=True)
class RuntimeConfig:
    """transport: SHM (one host) or DIST (any hosts).  deadline_s: longest wait of any
    task on its event
    (and longest stretch without progress).  poll_s: abort-check interval.
    threads: torch intra-op threads per worker."""

    transport: TransportKind = TransportKind.SHM
    deadline_s: float = 60.0
    poll_s: float = 0.05
    threads: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.transport, TransportKind):
            raise TypeError(f"RuntimeConfig.transport must be a TransportKind, got {self.transport!r}")
        self.executor_config()  # validates deadline_s, poll_s, threads

    def executor_config(self) -> ExecutorConfig:
        return ExecutorConfig(self.deadline_s, self.poll_s, self.threads)


class Session:
    """This rank's end of the runtime for ``group`` (None: the default group).

    Collective at construction (every rank of the group must create one)."""

    def __init__(self, config: RuntimeConfig | None = None, group: dist.ProcessGroup | None = None):
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("Session needs an initialized torch.distributed process group")
        self.config = config or RuntimeConfig()
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.session = _agree_token(group)
        env_job = os.environ.get(JOB_ENV)
        self.job = check_token(JOB_ENV, env_job) if env_job else self.session
        self.executor = Executor(self.config.executor_config())
        self.transport: Transport = self._make_transport()

    def _make_transport(self) -> Transport:
        if self.config.transport is TransportKind.LOCAL:
            if self.world != 1:
                raise ValueError(f"transport=local needs a group of one rank, got {self.world}")
            return LocalTransport()
        if self.config.transport is TransportKind.DIST:
            return DistTransport(self.rank, self.world, self.group, self.config.deadline_s)
        hosts = _all_gather_int(_host_id(), self.group)
        if len(set(hosts)) != 1:
            raise ValueError(f"transport=shm needs every rank on one host, got {len(set(hosts))} "
                             "hosts; use transport=dist")
        pids = _all_gather_int(os.getpid(), self.group)
        return ShmTransport(self.rank, self.world, self.job, self.session, pids,
                            barrier=lambda: dist.barrier(group=self.group))

    def close(self) -> None:
        """Stop the workers and release every segment (idempotent, local)."""
        self.executor.close()
        self.transport.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def _agree_token(group: dist.ProcessGroup | None) -> str:
    """Random 8-byte hex token drawn by group rank 0, known to every rank."""
    t = torch.frombuffer(bytearray(os.urandom(8)), dtype=torch.uint8).clone()
    dist.broadcast(t, group=group, group_src=0)
    return bytes(t.tolist()).hex()


def _all_gather_int(value: int, group: dist.ProcessGroup | None) -> list[int]:
    mine = torch.tensor([value], dtype=torch.int64)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mine, group=group)
    return [int(p) for p in parts]


def _host_id() -> int:
    """63-bit id of this host (hostname + boot id)."""
    boot = Path("/proc/sys/kernel/random/boot_id")
    text = socket.gethostname() + (boot.read_text() if boot.exists() else "")
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1
