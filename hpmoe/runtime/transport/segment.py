"""POSIX shared-memory segments private to one job.

Names are ``hpmoe-<job>-p<pid>-<token>`` under ``/dev/shm``: ``job`` is the job's
random token, ``pid`` the creating process, ``token`` 64 fresh random bits per
segment, so no name can be predicted ahead of its creation; a name that exists
anyway is retried with a new token.  Files are created with ``O_EXCL`` and mode
0600, and their memory is reserved with ``posix_fallocate`` (a full /dev/shm is an
error naming the size needed and the space free, never a SIGBUS later).  A segment
is unlinked as soon as every local rank has mapped it, so a crash afterwards leaks
nothing; for the short window before, its creator unlinks it on exit (and on
SIGTERM/SIGINT), the launcher sweeps ``hpmoe-<job>-*`` after its ranks are gone,
and ``sweep_stale`` removes segments whose creator is dead.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import re
import secrets
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

SHM_DIR = Path("/dev/shm")
PREFIX = "hpmoe-"
_TOKEN = re.compile(r"^[0-9a-f]{8,64}$")


def new_token(nbytes: int = 8) -> str:
    """A random hex token (``2 * nbytes`` characters)."""
    return secrets.token_hex(nbytes)


def check_token(name: str, token: str) -> str:
    """``token`` if it is 8-64 lowercase hex digits, else ValueError naming ``name``."""
    if not isinstance(token, str) or not _TOKEN.match(token):
        raise ValueError(f"{name}={token!r} must be 8-64 lowercase hex digits")
    return token


_OWNED = re.compile(r"^hpmoe-[0-9a-f]{8,64}-p(\d+)-[0-9a-f]{16}$")
TRIES = 8  # names tried before giving up (a collision of 64 random bits means a squatter)


class SegmentError(RuntimeError):
    """A segment could not be created: /dev/shm is full (``code`` ENOSPC), or every
    name tried was taken (EEXIST)."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


def segment_name(job: str, pid: int, token: str) -> str:
    return f"{PREFIX}{job}-p{pid}-{token}"


def size_text(n: int) -> str:
    """``n`` bytes for humans: KiB below 16 MiB (one decimal), else MiB."""
    return f"{n / 2**10:.1f} KiB" if n < 16 * 2**20 else f"{n / 2**20:.1f} MiB"


def shm_free() -> int:
    """Bytes free in /dev/shm."""
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def create_fresh(job: str, size: int, token: Callable[[], str] = new_token) -> tuple[Segment, str]:
    """A new segment of ``job`` owned by this process, under a fresh random name
    (``token`` draws the random part; a name that exists is retried); returns the
    segment and its token."""
    taken = []
    for _ in range(TRIES):
        t = token()
        try:
            return create_segment(segment_name(job, os.getpid(), t), size), t
        except FileExistsError:
            taken.append(t)
    raise SegmentError(errno.EEXIST, f"{TRIES} shared segment names were taken ({', '.join(taken)}): "
                       "someone creates hpmoe names in /dev/shm")


@dataclass
class Segment:
    """A mapped segment: ``map`` is a shared, writable mmap of ``size`` bytes."""

    name: str
    size: int
    map: mmap.mmap

    def close(self) -> None:
        """Unmap, unless tensors still view the memory (then the GC unmaps later)."""
        with contextlib.suppress(BufferError):
            self.map.close()


def create_segment(name: str, size: int) -> Segment:
    """Create a new zero-filled segment with its memory reserved (FileExistsError if
    the name exists; ``SegmentError`` naming the sizes when /dev/shm is full)."""
    if size <= 0:
        raise ValueError(f"segment size={size} must be positive")
    fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.posix_fallocate(fd, 0, size)
        return Segment(name=name, size=size, map=mmap.mmap(fd, size))
    except OSError as err:
        unlink_segment(name)
        if err.errno == errno.ENOSPC:
            raise SegmentError(errno.ENOSPC, f"{SHM_DIR} is full: a shared segment needs {size_text(size)}, "
                               f"{size_text(shm_free())} free") from None
        raise
    finally:
        os.close(fd)


def open_segment(name: str, size: int) -> Segment:
    """Map an existing segment of at least ``size`` bytes, owned by us with mode 0600."""
    fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) != 0o600:
            raise PermissionError(f"shared segment {name} has uid {st.st_uid} mode "
                                  f"{stat.S_IMODE(st.st_mode):o}, expected ours with 600")
        if st.st_size < size:
            raise ValueError(f"shared segment {name} holds {st.st_size} bytes, expected {size}")
        return Segment(name=name, size=size, map=mmap.mmap(fd, size))
    finally:
        os.close(fd)


def unlink_segment(name: str) -> bool:
    """Remove ``name`` from /dev/shm; False if it was already gone."""
    try:
        os.unlink(SHM_DIR / name)
        return True
    except FileNotFoundError:
        return False


def job_segments(job: str) -> list[str]:
    """Names in /dev/shm that belong to ``job``."""
    check_token("job", job)
    return sorted(p.name for p in SHM_DIR.glob(f"{PREFIX}{job}-*"))


def sweep(job: str) -> list[str]:
    """Unlink every segment of ``job``; returns the names that were still there."""
    return [name for name in job_segments(job) if unlink_segment(name)]


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (in this pid namespace)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> list[str]:
    """Unlink our segments whose creating process is dead; returns their names."""
    gone = []
    for p in SHM_DIR.glob(f"{PREFIX}*"):
        m = _OWNED.match(p.name)
        with contextlib.suppress(FileNotFoundError):
            if m and p.stat().st_uid == os.getuid() and not pid_alive(int(m.group(1))):
                gone += [p.name] if unlink_segment(p.name) else []
    return sorted(gone)
