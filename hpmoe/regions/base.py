"""What a region is: everything an executor needs to run one direction of the MoE-FFN.

A ``Region`` owns, in one place, its lowering (tiles, events and thresholds), its
kernel per non-put ``TaskKind``, its put specs (the only definition of a put: which
buffer field a put reads on the sender and which symmetric field it writes on the
peer), its buffer type and the shapes of its symmetric fields.  The exact executor,
the multi-rank runtime and the GPU backend all read the same ``Region``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..ir.graph import IS_PUT, TaskGraph, TaskKind, Tile
from ..ir.verify import debug_enabled, verify_graph
from ..routing import RoutingPlan
from ..spec import TileSpec

Kernel = Callable[[Tile, Any, Any, Any], None]
ShapeMap = dict[str, tuple[tuple[int, ...], torch.dtype]]


class RegionKind(enum.Enum):
    """The regions of the MoE-FFN."""

    FORWARD = "forward"
    FORWARD_DEDUP = "forward-dedup"  # one dispatch row per (token, rank), partials combined
    BACKWARD = "backward"  # reads the saved SwiGLU activations
    BACKWARD_RECOMPUTE = "backward-recompute"  # recomputes them from the saved pre-activations
    BACKWARD_DEDUP = "backward-dedup"  # gradient of FORWARD_DEDUP: dy once per (token, rank)
    BACKWARD_DEDUP_RECOMPUTE = "backward-dedup-recompute"
    BACKWARD_REGATHER = "backward-regather"  # the experts' input rows travel again beside dy's
    BACKWARD_DEDUP_REGATHER = "backward-dedup-regather"


class Kept(enum.Enum):
    """What a taskflow's backward finds kept from its forward (the layer input and the
    routed and shared pre-activations always are):

    ALL    the experts' received input rows and the shared experts' gated activation;
    ROWS   the received rows; the shared activation is recomputed from its pre-activation;
    INPUT  neither: the shared activation is recomputed and each expert input row
           travels again, beside its dy row in the backward's dispatch (gathered from
           the kept layer input).
    """

    ALL = "all"
    ROWS = "rows"
    INPUT = "input"

    @property
    def activation(self) -> bool:
        """Whether the shared experts' gated activation is recomputed."""
        return self is not Kept.ALL

    @property
    def travels(self) -> bool:
        """Whether the experts' input rows travel again with their gradients."""
        return self is Kept.INPUT


def as_kept(value: Kept | bool) -> Kept:
    """``value`` as ``Kept``; a bool, the former flag "recompute the activation": True
    is ROWS, False ALL."""
    if isinstance(value, Kept):
        return value
    if isinstance(value, bool):
        return Kept.ROWS if value else Kept.ALL
    raise TypeError(f"recompute must be a Kept or a bool, got {value!r}")


@dataclass(frozen=True)
class PutSpec:
    """A put copies rows ``[row0, row1)`` of the sender's field ``src`` into rows
    ``[dst_row0, dst_row0 + row1 - row0)`` of the peer's symmetric field ``dst``."""

    src: str
    dst: str

    def copy(self, tile: Tile, me: object, peer: object) -> None:
        """The put's data movement between two ranks' buffers in one address space."""
        rows = tile.row1 - tile.row0
        getattr(peer, self.dst)[tile.dst_row0:tile.dst_row0 + rows].copy_(
            getattr(me, self.src)[tile.row0:tile.row1])


@dataclass(frozen=True)
class Region:
    """One direction of the MoE-FFN as executors see it.

    kind: which region (None: a hand-built region, e.g. of no-op tasks for measuring
      the executor itself).
    lower(plan, tiles, ranks): the TaskGraph of ``ranks`` (None: every rank).
    kernels: {TaskKind: fn(tile, me_buffers, peer_buffers, ctx)} for non-put kinds.
    puts: {TaskKind: PutSpec} for the put kinds.
    buffers: the buffer type; its ``SYMMETRIC`` class attribute names the fields peers
      put into.  symmetric_shapes(plan, tiles, rank): {field: (shape, dtype)} of those fields.
    """

    kind: RegionKind | None
    lower: Callable[[RoutingPlan, TileSpec, tuple[int, ...] | None], TaskGraph]
    kernels: Mapping[TaskKind, Kernel]
    puts: Mapping[TaskKind, PutSpec]
    buffers: type
    symmetric_shapes: Callable[[RoutingPlan, TileSpec, int], ShapeMap]

    def __post_init__(self) -> None:
        for kind, spec in self.puts.items():
            if not IS_PUT[kind]:
                raise ValueError(f"Region.puts has {TaskKind(kind).name}, which is not a put kind")
            if spec.dst not in self.symmetric:
                raise ValueError(f"Region.puts[{TaskKind(kind).name}].dst={spec.dst!r} is not one "
                                 f"of the symmetric fields {self.symmetric}")
        overlap = set(self.kernels) & set(self.puts)
        if overlap:
            raise ValueError(f"Region.kernels also lists put kinds {sorted(overlap)}")

    def graph(self, plan: RoutingPlan, tiles: TileSpec, debug: bool | None = None) -> TaskGraph:
        """Every rank's tasks for ``plan``: the one way a region is compiled (the exact
        executor, the runtime, the simulator, AUTO's forecast and the GPU packer start
        here); ``debug`` (default: ``HPMOE_DEBUG=1``) verifies the graph's thresholds."""
        graph = self.lower(plan, tiles, None)
        if debug_enabled() if debug is None else debug:
            verify_graph(graph)
        return graph

    @property
    def name(self) -> str:
        return self.kind.value if self.kind is not None else "hand-built"

    @property
    def symmetric(self) -> tuple[str, ...]:
        fields = getattr(self.buffers, "SYMMETRIC", ())
        if not fields or not all(isinstance(f, str) for f in fields):
            raise TypeError(f"{self.buffers.__name__} declares no symmetric fields (SYMMETRIC={fields!r})")
        return tuple(fields)
