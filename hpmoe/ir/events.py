"""Per-rank event layouts: each region names its event categories in an ``IntEnum``
and every rank's local event ids are the categories laid out one after another.

An ``EventLayout`` is a pure function of the routing plan and the tiles, so every
rank computes its peers' event ids without asking them.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class EventLayout:
    """Local event ids of every rank: category ``c`` of rank ``r`` covers
    ``[offset[r, c], offset[r, c + 1])``.  categories: the region's ``IntEnum``
    (values 0, 1, ...).  offset: [ep, len(categories) + 1] int64."""

    categories: type[enum.IntEnum]
    offset: np.ndarray

    @staticmethod
    def from_sizes(categories: type[enum.IntEnum], sizes: np.ndarray) -> EventLayout:
        """sizes: [ep, len(categories)] events of each category on each rank."""
        sizes = np.asarray(sizes, np.int64)
        if sizes.ndim != 2 or sizes.shape[1] != len(categories):
            raise ValueError(f"sizes has shape {sizes.shape}, expected [ep, {len(categories)}]")
        offset = np.zeros((sizes.shape[0], sizes.shape[1] + 1), np.int64)
        np.cumsum(sizes, axis=1, out=offset[:, 1:])
        return EventLayout(categories=categories, offset=offset)

    @staticmethod
    def from_columns(categories: type[enum.IntEnum], ep: int, columns: Sequence[int | np.ndarray]
                     ) -> EventLayout:
        """One column per category, in its order: an int (that many events on every one of
        the ``ep`` ranks) or an [ep] array."""
        return EventLayout.from_sizes(categories, np.stack(
            [np.broadcast_to(np.asarray(c, np.int64), (ep,)) for c in columns], axis=1))

    def base(self, rank: np.ndarray | int, category: enum.IntEnum) -> np.ndarray:
        """First local event id of ``category`` on ``rank``."""
        return self.offset[rank, int(category)]

    def count(self, rank: int) -> int:
        return int(self.offset[rank, -1])

    def name(self, rank: int, event: int) -> str:
        """e.g. ``event r1:7 (OUT 2)``; ids beyond the layout are a scheduler's barriers."""
        if not 0 <= event < self.count(rank):
            return f"event r{rank}:{event} (schedule barrier)"
        k = int(np.searchsorted(self.offset[rank], event, side="right")) - 1
        return f"event r{rank}:{event} ({self.categories(k).name} {event - int(self.offset[rank, k])})"


def extended(name: str, module: str, base: type[enum.IntEnum], extra: Sequence[str],
             aliases: Mapping[str, str] | None = None) -> type[enum.IntEnum]:
    """An event enum ``name`` of ``module`` (where pickle finds it): ``base``'s categories
    with their values (so the builders of ``base``'s region apply), then ``extra``;
    ``aliases``: more names of its categories (alias -> category), under which builders
    written for another enum find them."""
    values = {e.name: e.value for e in base}
    values |= {n: len(values) + i for i, n in enumerate(extra)}
    members = [*values.items(), *((a, values[n]) for a, n in (aliases or {}).items())]
    return enum.IntEnum(name, members, module=module)
