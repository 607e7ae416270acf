"""Regions of the MoE-FFN: each lowers a routing plan to tile tasks and owns the
kernels, put specs and buffers that execute them (see ``base.Region``)."""

from __future__ import annotations

from .base import Kept, PutSpec, Region, RegionKind


def region(kind: RegionKind) -> Region:
    """The ``Region`` of ``kind``."""
    from .backward_kernels import BACKWARDS
    from .dedup_backward_kernels import BACKWARD_DEDUPS
    from .dedup_kernels import FORWARD_DEDUP
    from .kernels import FORWARD

    if not isinstance(kind, RegionKind):
        raise TypeError(f"kind must be a RegionKind, got {kind!r}")
    every = (FORWARD, FORWARD_DEDUP, *BACKWARDS.values(), *BACKWARD_DEDUPS.values())
    return {r.kind: r for r in every}[kind]


__all__ = ["Kept", "PutSpec", "Region", "RegionKind", "region"]
