"""Linux futexes on 32-bit words, through ``ctypes``: the only synchronisation
primitive the runtime's event counters need.

``add`` is an atomic fetch-and-add done by the kernel (``FUTEX_WAKE_OP`` with
``FUTEX_OP_ADD``) that also wakes every thread sleeping on the word, in any process
that maps it (the futexes are shared, not ``FUTEX_PRIVATE``), unless told not to;
``wake`` wakes them alone.  The locked
read-modify-write is a full memory barrier, so every store the caller made before
``add`` (a put's data) is visible to a thread that observes the new value.
``wait`` sleeps while the word still holds an expected value, up to a timeout.
Calls through ``ctypes.CDLL`` release the GIL.  libc is bound on the first call, so
importing this module works on any platform.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import platform

_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}
_FUTEX_WAIT, _FUTEX_WAKE, _FUTEX_WAKE_OP = 0, 1, 5
_FUTEX_OP_ADD = 1
_FUTEX_OP_CMP_LT = 2
_WAKE_ALL = 0x7FFFFFFF
MAX_ADD = 2047  # FUTEX_OP's oparg is a signed 12-bit field


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


@functools.cache
def _libc() -> tuple[ctypes.CDLL, int]:
    """(libc, the futex syscall number), bound once; OSError off Linux x86_64/aarch64."""
    machine = platform.machine()
    if machine not in _SYS_FUTEX or os.uname().sysname != "Linux":
        raise OSError(f"futex counters need Linux on x86_64 or aarch64, got {os.uname().sysname} {machine}")
    lib = ctypes.CDLL(None, use_errno=True)
    lib.syscall.restype = ctypes.c_long
    return lib, _SYS_FUTEX[machine]


_NULL = ctypes.c_void_p(0)
_IDLE = ctypes.c_int32(0)  # a word no thread sleeps on: the wake of a quiet add goes there


def add(addr: int, n: int = 1, wake: bool = True) -> None:
    """Atomically add ``n`` (1..2047) to the int32 at ``addr`` and, with ``wake``,
    wake its waiters."""
    if not 0 < n <= MAX_ADD:
        raise ValueError(f"futex add n={n} outside [1, {MAX_ADD}]")
    libc, sys_futex = _libc()
    word = ctypes.c_void_p(addr)
    op = (_FUTEX_OP_ADD << 28) | (n << 12)
    first = word
    if not wake:
        # FUTEX_WAKE_OP wakes at least one thread of the first word, and one of the
        # added word when the old value compares true: aim the first at an idle word,
        # and compare "old < 0" (a counter past 2**31, whose one spurious wake is harmless)
        first, op = ctypes.byref(_IDLE), op | (_FUTEX_OP_CMP_LT << 24)
    if libc.syscall(sys_futex, first, _FUTEX_WAKE_OP, _WAKE_ALL, _NULL, word, op) < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"futex add at {addr:#x}: {os.strerror(err)}")


def wake(addr: int) -> None:
    """Wake every thread sleeping on the int32 at ``addr``."""
    libc, sys_futex = _libc()
    if libc.syscall(sys_futex, ctypes.c_void_p(addr), _FUTEX_WAKE, _WAKE_ALL, _NULL, _NULL, 0) < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"futex wake at {addr:#x}: {os.strerror(err)}")


def wait(addr: int, expected: int, timeout_s: float) -> None:
    """Sleep while the int32 at ``addr`` equals ``expected`` (signed), at most
    ``timeout_s`` seconds; returns early on a wake, a change or a signal."""
    libc, sys_futex = _libc()
    ts = _Timespec(int(timeout_s), int((timeout_s % 1.0) * 1e9))
    if libc.syscall(sys_futex, ctypes.c_void_p(addr), _FUTEX_WAIT, ctypes.c_int(expected),
                     ctypes.byref(ts), _NULL, 0) < 0:
        err = ctypes.get_errno()
        if err not in (errno.EAGAIN, errno.ETIMEDOUT, errno.EINTR):
            raise OSError(err, f"futex wait at {addr:#x}: {os.strerror(err)}")
