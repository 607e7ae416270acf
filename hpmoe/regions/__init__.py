"""Lowering: routing plans to tile task graphs (forward and backward)."""

from __future__ import annotations

import enum

from ..ir.graph import TaskGraph
from ..routing import RoutingPlan
from ..spec import TileSpec


class Direction(enum.Enum):
    """Which region of the MoE-FFN a graph covers."""

    FORWARD = "forward"
    BACKWARD = "backward"


def lower(plan: RoutingPlan, tiles: TileSpec, direction: Direction = Direction.FORWARD,
          ranks: tuple[int, ...] | None = None, recompute: bool = False) -> TaskGraph:
    """The task graph of ``direction`` for ``ranks`` (default: all); ``recompute``
    (backward only) recomputes the SwiGLU activation instead of reading it."""
    from .backward import lower_backward
    from .forward import lower_forward

    if direction is Direction.BACKWARD:
        return lower_backward(plan, tiles, ranks, recompute=recompute)
    return lower_forward(plan, tiles, ranks)
