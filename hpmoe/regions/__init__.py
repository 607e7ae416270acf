"""Regions of the MoE-FFN: each lowers a routing plan to tile tasks and owns the
kernels, put specs and buffers that execute them (see ``base.Region``)."""

from __future__ import annotations

from .base import PutSpec, Region, RegionKind


def region(kind: RegionKind) -> Region:
    """The ``Region`` of ``kind``."""
    from .backward_kernels import BACKWARD, BACKWARD_RECOMPUTE
    from .dedup_backward_kernels import BACKWARD_DEDUP, BACKWARD_DEDUP_RECOMPUTE
    from .dedup_kernels import FORWARD_DEDUP
    from .kernels import FORWARD

    if not isinstance(kind, RegionKind):
        raise TypeError(f"kind must be a RegionKind, got {kind!r}")
    return {RegionKind.FORWARD: FORWARD, RegionKind.FORWARD_DEDUP: FORWARD_DEDUP,
            RegionKind.BACKWARD: BACKWARD,
            RegionKind.BACKWARD_RECOMPUTE: BACKWARD_RECOMPUTE, RegionKind.BACKWARD_DEDUP: BACKWARD_DEDUP,
            RegionKind.BACKWARD_DEDUP_RECOMPUTE: BACKWARD_DEDUP_RECOMPUTE}[kind]


__all__ = ["PutSpec", "Region", "RegionKind", "region"]
