"""The benchmarks' variant order: every variant right after every other one equally often."""

from collections import Counter

import pytest

from hpmoe.bench.order import IterationOrder, balanced_orders, iteration_order, run_groups


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


@pytest.mark.parametrize("iters,block", [(30, 10), (25, 10), (7, 1), (3, 10)])
def test_blocks_run_each_variant_back_to_back_and_iters_times(iters, block):
    names = ["a", "b", "c"]
    groups = run_groups(names, iters, IterationOrder.BLOCKS, block)
    flat = [n for g in groups for n in g]
    assert all(flat.count(n) == iters for n in names)
    for r, group in enumerate(groups):  # each round: the rows' order, each variant's calls together
        runs = [group[i] for i in range(len(group)) if i == 0 or group[i] != group[i - 1]]
        assert runs == iteration_order(names, r)
    balanced = run_groups(names, 4, IterationOrder.BALANCED, block)
    assert balanced == [iteration_order(names, i) for i in range(4)]


def test_a_block_below_one_is_refused():
    with pytest.raises(ValueError, match="block must be >= 1"):
        run_groups(["a"], 3, IterationOrder.BLOCKS, 0)
