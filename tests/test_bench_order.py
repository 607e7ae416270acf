"""The benchmarks' variant order: every variant right after every other one equally often."""

from collections import Counter

import pytest

from hpmoe.bench.order import balanced_orders, iteration_order


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6])
def test_every_variant_follows_every_other_equally_often(n):
    rows = balanced_orders(n)
    assert len(rows) == (2 * n if n % 2 else n)
    assert all(sorted(r) == list(range(n)) for r in rows)
    follows = Counter((a, b) for r in rows for a, b in zip(r, r[1:], strict=False))
    assert set(follows) == {(a, b) for a in range(n) for b in range(n) if a != b}
    assert len(set(follows.values())) <= 1  # one count for every ordered pair


def test_iterations_cycle_through_the_rows_and_name_the_variants():
    names = ["serial", "kbk", "runtime"]
    orders = [iteration_order(names, i) for i in range(7)]
    assert orders[0] == ["serial", "kbk", "runtime"] and orders[6] == orders[0]
    assert len({tuple(o) for o in orders[:6]}) == 6
    with pytest.raises(ValueError, match="n must be >= 1"):
        balanced_orders(0)
