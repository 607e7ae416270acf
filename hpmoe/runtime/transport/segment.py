"""POSIX shared-memory segments private to one job.

Names are ``hpmoe-<job>-<session>-r<rank>-g<generation>`` under ``/dev/shm``:
``job`` and ``session`` are random hex tokens (unguessable), files are created
with ``O_EXCL`` and mode 0600.  A segment is unlinked as soon as every local rank
has mapped it, so a crash afterwards leaks nothing; for the short window between
creation and that point, every rank unlinks all names of its session on exit and
the launcher sweeps ``hpmoe-<job>-*`` after its ranks are gone.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import secrets
import stat
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


def segment_name(job: str, session: str, rank: int, generation: int) -> str:
    return f"{PREFIX}{job}-{session}-r{rank}-g{generation}"


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
    """Create a new zero-filled segment (fails if the name exists)."""
    if size <= 0:
        raise ValueError(f"segment size={size} must be positive")
    fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, size)
        return Segment(name=name, size=size, map=mmap.mmap(fd, size))
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
