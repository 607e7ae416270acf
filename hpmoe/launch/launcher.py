"""Start the ranks of one job on this host and make sure none outlives it.

``launch`` runs the same command in ``world`` processes with the environment
torchrun would give them (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ...) plus
``HPMOE_JOB``, optionally each in its own network namespace (``--link``).
Without ``--link`` the launcher itself hosts the job's key-value store (as torchrun
does), so the store outlives any rank and a stopped rank can still be named by
its peers.  Failure propagates: once a rank exits with an error, the others get
``grace_s`` to report their own diagnosis, then are terminated, then killed.
Children die with the launcher (PR_SET_PDEATHSIG).  Afterwards the launcher
unlinks every shared segment of the job, deletes the namespaces and its temporary
directory, whatever happened: SIGTERM, SIGINT and SIGHUP run the same cleanup and
then raise ``Interrupted``.  At start it sweeps what dead launchers and ranks left
(segments, ``hpmoe-launch-p<pid>-*`` directories, ``hpm-p<pid>-*`` namespaces).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from ..runtime.session import JOB_ENV
from ..runtime.transport.segment import new_token, pid_alive, sweep, sweep_stale
from ..testing import free_port
from .netns import (
    IFNAME,
    LinkSpec,
    Topology,
    create_topology,
    delete_topology,
    list_namespaces,
    sweep_stale_namespaces,
)

_PR_SET_PDEATHSIG = 1
_LINK_PORT = 29500
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
TMP_PREFIX = "hpmoe-launch-p"
_TMP = re.compile(r"^hpmoe-launch-p(\d+)-")


class Interrupted(BaseException):
    """The launcher got ``signum``; its ranks were stopped and everything removed."""

    def __init__(self, signum: int):
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


@dataclass(frozen=True)
class LaunchSpec:
    """argv: the command of every rank.  world: number of ranks.  link: shape the
    ranks' network (each in its own namespace).  timeout_s: wall-time limit of the
    job.  grace_s: how long the other ranks get after the first failure.  env:
    extra environment.  capture: collect each rank's stdout/stderr (else inherit)."""

    argv: tuple[str, ...]
    world: int
    link: LinkSpec | None = None
    timeout_s: float = 600.0
    grace_s: float = 10.0
    env: Mapping[str, str] = field(default_factory=dict)
    capture: bool = False

    def __post_init__(self) -> None:
        if not self.argv:
            raise ValueError("LaunchSpec.argv must not be empty")
        if not isinstance(self.world, int) or self.world <= 0:
            raise ValueError(f"LaunchSpec.world must be a positive int, got {self.world!r}")
        for name in ("timeout_s", "grace_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"LaunchSpec.{name} must be > 0, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class RankExit:
    """How one rank ended: exit code (negative: killed by that signal), output
    (when captured), and whether the launcher had to stop it."""

    rank: int
    pid: int
    returncode: int
    stopped: bool
    stdout: str = ""
    stderr: str = ""


@dataclass(frozen=True)
class LaunchResult:
    """job: the job token.  swept: shared segments still present after the ranks
    exited (the launcher removed them; empty when ranks cleaned up themselves).
    stale: what the sweep at start removed (left by dead launchers and ranks)."""

    job: str
    ranks: tuple[RankExit, ...]
    elapsed_s: float
    swept: tuple[str, ...]
    stale: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return all(r.returncode == 0 for r in self.ranks)

    @property
    def returncode(self) -> int:
        """0, or the first failing rank's code (1 if it was killed by a signal)."""
        bad = [r.returncode for r in self.ranks if r.returncode]
        return 0 if not bad else (bad[0] if bad[0] > 0 else 1)


def launch(spec: LaunchSpec) -> LaunchResult:
    """Run the job described by ``spec`` to completion (see module doc)."""
    stale = sweep_stale_all()
    job, topo, procs, store = new_token(), None, [], None
    start = time.monotonic()
    with _Signals() as signals, tempfile.TemporaryDirectory(prefix=f"{TMP_PREFIX}{os.getpid()}-") as tmp:
        try:
            if spec.link is not None:
                topo = create_topology(spec.world, spec.link, job)
                master = (Topology.address(0), _LINK_PORT)
            else:
                master, store = _host_store(spec)
            procs = [_start(spec, r, job, master, topo, tmp, store is not None) for r in range(spec.world)]
            stopped = _supervise(procs, spec, start)
        finally:
            signals.disarm()  # a signal from here on waits until the cleanup is done
            _stop(procs)
            swept = tuple(sweep(job))
            if topo is not None:
                delete_topology(topo)
            del store
        exits = tuple(_exit(r, p, r in stopped, tmp, spec.capture) for r, p in enumerate(procs))
    return LaunchResult(job=job, ranks=exits, elapsed_s=time.monotonic() - start, swept=swept, stale=stale)


class _Signals:
    """While armed (main thread only), SIGTERM/SIGINT/SIGHUP raise ``Interrupted``;
    once disarmed they are remembered and raised when the block exits."""

    def __init__(self) -> None:
        self._old: dict[int, object] = {}
        self._armed, self._got = True, 0

    def __enter__(self) -> _Signals:
        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, self._handle) for s in SIGNALS}
        return self

    def _handle(self, signum: int, frame: object) -> None:
        if self._got:
            return
        self._got = signum
        if self._armed:
            raise Interrupted(signum)

    def disarm(self) -> None:
        self._armed = False

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._old.items():
            signal.signal(s, handler)
        if self._got and exc[0] is None:
            raise Interrupted(self._got)


def _host_store(spec: LaunchSpec) -> tuple[tuple[str, int], dist.TCPStore]:
    """The job's store, served by this process on a free local port."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, spec.world, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=spec.timeout_s))
    return ("127.0.0.1", port), store


def sweep_stale_all() -> tuple[str, ...]:
    """Remove what dead launchers and ranks left behind: our shared segments whose
    creator is dead, launch directories and network namespaces of dead launchers."""
    gone = [f"/dev/shm/{n}" for n in sweep_stale()]
    for path in Path(tempfile.gettempdir()).glob(f"{TMP_PREFIX}*"):
        m = _TMP.match(path.name)
        if m and path.stat().st_uid == os.getuid() and not pid_alive(int(m.group(1))):
            shutil.rmtree(path, ignore_errors=True)
            gone.append(str(path))
    return tuple(gone + [f"netns {n}" for n in sweep_stale_namespaces()])


def left_by(pid: int) -> list[str]:
    """Launch directories and network namespaces of launcher ``pid`` that still exist."""
    dirs = [str(p) for p in Path(tempfile.gettempdir()).glob(f"{TMP_PREFIX}{pid}-*")]
    names = list_namespaces() if os.geteuid() == 0 and shutil.which("ip") else []
    return dirs + [n for n in names if n.startswith(f"hpm-p{pid}-")]


def rank_env(rank: int, world: int, job: str, master: tuple[str, int],
             ifname: str | None = None) -> dict[str, str]:
    """The environment torchrun gives a local rank, plus ``HPMOE_JOB``."""
    env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
           "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0", "MASTER_ADDR": master[0],
           "MASTER_PORT": str(master[1]), JOB_ENV: job}
    if ifname is not None:
        env["GLOO_SOCKET_IFNAME"] = ifname
    return env


def _die_with_parent() -> None:
    """In the child before exec: get SIGKILL when the launcher dies."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


# glibc hands freed memory back to the OS (trims the heap, unmaps large blocks), and a
# step's next allocation of the same size then faults in and zeroes every page again (up
# to 4,100 page faults a step per rank on qwen3-30b-a3b, 512 tokens per rank).  Ranks keep
# what they freed (blocks under 32 MiB come from the heap, which is never trimmed), as
# the PyTorch CPU tuning guides get with jemalloc or tcmalloc.  The caller's environment
# and ``LaunchSpec.env`` override these.
ALLOCATOR_ENV = {"MALLOC_TRIM_THRESHOLD_": str(1 << 40), "MALLOC_MMAP_THRESHOLD_": str(32 << 20)}


def _start(spec: LaunchSpec, rank: int, job: str, master: tuple[str, int], topo: Topology | None,
           tmp: str, hosted: bool) -> subprocess.Popen:
    env = {**ALLOCATOR_ENV, **os.environ, **spec.env, **rank_env(rank, spec.world, job, master,
                                                                    IFNAME if topo else None)}
    if hosted:  # connect to the launcher's store instead of serving one on rank 0
        env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    argv = [*(topo.exec_prefix(rank) if topo else []), *spec.argv]
    out = err = None
    if spec.capture:
        out = open(os.path.join(tmp, f"{rank}.out"), "w")  # noqa: SIM115 (closed below)
        err = open(os.path.join(tmp, f"{rank}.err"), "w")  # noqa: SIM115
    try:
        return subprocess.Popen(argv, env=env, stdout=out, stderr=err, start_new_session=True,
                                preexec_fn=_die_with_parent)
    finally:
        for f in (out, err):
            if f is not None:
                f.close()


def _supervise(procs: list[subprocess.Popen], spec: LaunchSpec, start: float) -> set[int]:
    """Wait for every rank; stop the rest ``grace_s`` after the first failure or at
    the timeout.  Returns the ranks the launcher stopped."""
    failed_at = None
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return set()
        now = time.monotonic()
        if failed_at is None and any(c not in (None, 0) for c in codes):
            failed_at = now
        late = failed_at is not None and now - failed_at > spec.grace_s
        if late or now - start > spec.timeout_s:
            live = {r for r, c in enumerate(codes) if c is None}
            _stop(procs)
            return live
        time.sleep(0.05)


def _stop(procs: list[subprocess.Popen], term_s: float = 2.0) -> None:
    """SIGTERM (and SIGCONT) every live rank's process group, then SIGKILL what is
    left; reap all."""
    for sig, wait_s in ((signal.SIGTERM, term_s), (signal.SIGKILL, 5.0)):
        live = [p for p in procs if p.poll() is None]
        for p in live:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, sig)
                os.killpg(p.pid, signal.SIGCONT)  # a stopped rank acts on SIGTERM only once continued
        end = time.monotonic() + wait_s
        while any(p.poll() is None for p in live) and time.monotonic() < end:
            time.sleep(0.02)
    for p in procs:
        p.wait()


def _exit(rank: int, p: subprocess.Popen, stopped: bool, tmp: str, capture: bool) -> RankExit:
    def read(ext: str) -> str:
        if not capture:
            return ""
        with open(os.path.join(tmp, f"{rank}.{ext}"), errors="replace") as f:
            return f.read()

    return RankExit(rank=rank, pid=p.pid, returncode=p.returncode, stopped=stopped,
                    stdout=read("out"), stderr=read("err"))
