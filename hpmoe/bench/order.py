"""The order in which a benchmark runs its variants, iteration after iteration.

A variant measured right after another can run at a fraction of its own speed (a
runtime region's worker threads and caches linger: the serialized baseline measured
right after one ran at 0.60-0.80x of itself after another baseline call).  Rotating a
fixed order does not help: every variant still follows the same neighbour.  A Williams
design does: over its rows, every variant immediately follows every other one equally
often (once for an even count, twice for an odd one, over twice as many rows).

``IterationOrder.BALANCED`` runs one call of every variant per iteration in those rows;
``BLOCKS`` runs each variant's calls ``block`` at a time, back to back (as a training
loop runs its one path), the blocks of a round in the same rows, so that slow drift of
the host spreads over every variant alike.
"""

from __future__ import annotations

import enum


class IterationOrder(enum.Enum):
    BALANCED = "balanced"  # one call of each variant per iteration, Williams rows
    BLOCKS = "blocks"  # ``block`` back-to-back calls of each variant per round, Williams rows


def balanced_orders(n: int) -> list[list[int]]:
    """Rows of a Williams design over ``n`` variants: each row a permutation of
    ``range(n)``, and over all rows each variant directly follows each other one equally
    often.  ``n`` rows for even ``n``, ``2n`` (the rows and their mirrors) for odd."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n!r}")
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    rows = [[(v + i) % n for v in first] for i in range(n)]
    return rows + [row[::-1] for row in rows] if n % 2 else rows


def run_groups(names: list[str], iters: int, order: IterationOrder, block: int) -> list[list[str]]:
    """The calls to run, in groups (an iteration, or a round of blocks), so that each of
    ``names`` runs ``iters`` times."""
    if order is IterationOrder.BALANCED:
        return [iteration_order(names, i) for i in range(iters)]
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block!r}")
    groups, done = [], 0
    for r in range(-(-iters // block)):
        n = min(block, iters - done)
        groups.append([name for name in iteration_order(names, r) for _ in range(n)])
        done += n
    return groups


def iteration_order(names: list[str], iteration: int) -> list[str]:
    """The variants of iteration ``iteration``: row ``iteration`` (cyclically) of
    ``balanced_orders``.  Run a multiple of ``len(balanced_orders(len(names)))``
    iterations for an exact balance."""
    rows = balanced_orders(len(names))
    return [names[i] for i in rows[iteration % len(rows)]]
