"""Which executor runs a region."""

from __future__ import annotations

import enum


class Backend(enum.Enum):
    EXACT = "exact"  # torch kernels, task by task, every virtual rank in this process
    TRITON = "triton"  # one persistent Triton kernel on the input's device (hpmoe.gpu)
    AUTO = "auto"  # measured on real calls: kernel by kernel or the persistent kernel
    KERNEL_BY_KERNEL = "kernel_by_kernel"  # no tiles: grouped GEMMs per phase, all-to-all over an ep_group


def as_backend(value: Backend | str) -> Backend:
    """``value`` as a ``Backend``; ValueError naming it when it is none."""
    if isinstance(value, Backend):
        return value
    try:
        return Backend(value)
    except ValueError:
        raise ValueError(f"backend={value!r} is not one of {[b.value for b in Backend]}") from None
