"""The demo's closing table: one row per comparison, each measured in the run, simulated,
skipped (with why) or failed, and the command that reproduces it."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Kind(enum.Enum):
    MEASURED = "measured"  # timed in this run, on this machine
    SIMULATED = "simulated"  # replayed on a hardware model
    SKIPPED = "skipped"  # this machine cannot run it (``Row.why``)
    FAILED = "failed"  # it ran and failed (``Row.why``: the diagnosis)


@dataclass(frozen=True)
class Row:
    """hpmoe's figure (``hpmoe_ms``, a median where measured) against ``against``'s
    (``against_ms``) in one ``case``; times are None unless ``kind`` is MEASURED or
    SIMULATED.  ``fastest``: a measured row's ratio of the fastest iterations (against /
    hpmoe), which a busy host's slow spells bias less than the medians."""

    case: str
    hpmoe: str
    against: str
    kind: Kind
    command: str
    hpmoe_ms: float | None = None
    against_ms: float | None = None
    fastest: float | None = None
    why: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.kind, Kind):
            raise TypeError(f"Row.kind must be a Kind, got {self.kind!r}")
        timed = self.kind in (Kind.MEASURED, Kind.SIMULATED)
        if timed != (self.hpmoe_ms is not None and self.against_ms is not None):
            raise ValueError(f"Row {self.case!r}: a {self.kind.value} row has both times and only such a row "
                             f"(hpmoe_ms={self.hpmoe_ms!r}, against_ms={self.against_ms!r})")

    @property
    def speedup(self) -> float | None:
        """``against_ms / hpmoe_ms`` (above 1: hpmoe is faster)."""
        return None if self.hpmoe_ms is None else self.against_ms / self.hpmoe_ms


_HEAD = (f"{'#':>2}  {'case':<36} {'hpmoe runs':<36} {'ms':>8}   {'against':<32} {'ms':>8}  "
         f"{'speedup (fastest)':>17}  kind")


def render(rows: list[Row]) -> str:
    """The table, then each distinct command with the rows it reproduces."""
    lines = [_HEAD]
    for i, r in enumerate(rows, 1):
        lines.append(f"{i:>2}  {r.case:<36} {r.hpmoe:<36} " + _figures(r))
    lines.append("reproduce (rows: command):")
    commands: dict[str, list[int]] = {}
    for i, r in enumerate(rows, 1):
        commands.setdefault(r.command, []).append(i)
    lines += [f"  {', '.join(map(str, nums))}: {command}" for command, nums in commands.items()]
    return "\n".join(lines)


def _figures(r: Row) -> str:
    if r.speedup is None:
        return f"{'-':>8}   {r.against:<32} {'-':>8}  {'-':>17}  {r.kind.value}: {r.why}"
    fastest = f"({r.fastest:.2f}x)" if r.fastest is not None else ""
    return (f"{_ms(r.hpmoe_ms)}   {r.against:<32} {_ms(r.against_ms)}  {r.speedup:6.2f}x {fastest:>10}  "
            f"{r.kind.value}")


def _ms(ms: float) -> str:
    return f"{ms:8.1f}" if ms >= 10 else f"{ms:8.3f}"
