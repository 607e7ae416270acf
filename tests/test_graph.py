import numpy as np
import pytest

from hpmoe.ir.analysis import GraphError, completion_levels
from hpmoe.ir.graph import UNIT_OF_KIND, TaskKind, Unit
from hpmoe.ir.verify import random_order, verify_graph
from hpmoe.regions.forward import lower_forward
from hpmoe.routing import RoutingKind

from .helpers import TINY_TILES, chain_graph, tiny_plan


def test_units_follow_kinds():
    assert UNIT_OF_KIND[TaskKind.GEMM_UP] == Unit.MATRIX
    assert UNIT_OF_KIND[TaskKind.WGRAD_UP] == Unit.MATRIX
    assert UNIT_OF_KIND[TaskKind.DISPATCH] == Unit.VECTOR
    assert UNIT_OF_KIND[TaskKind.SWIGLU_BWD] == Unit.VECTOR


def test_levels_of_a_chain_with_fan_in():
    # 0 and 1 both signal event 0 (threshold 2); 2 waits on it and signals 1; 3 waits on 1
    g = chain_graph([-1, -1, 0, 1], [[0], [0], [1], []], [2, 1])
    levels = completion_levels(g.wait_global(), g.threshold, g.sig_ptr, g.signals_global())
    assert levels.tolist() == [0, 0, 1, 2]
    verify_graph(g)


def test_verify_names_the_tasks_of_a_cycle():
    # 1 waits on event 0 signalled by 2, which waits on event 1 signalled by 1
    g = chain_graph([-1, 0, 1], [[], [1], [0]], [1, 1])
    with pytest.raises(GraphError, match="cycle") as err:
        verify_graph(g)
    assert "task 1" in str(err.value) and "task 2" in str(err.value)


def test_verify_names_an_unreachable_threshold():
    g = chain_graph([-1, 0], [[0], []], [2])
    with pytest.raises(GraphError, match=r"unreachable threshold.*r0:0 \(threshold 2\) can only reach 1"
                       r".*task 1"):
        verify_graph(g)


@pytest.mark.parametrize("kind", list(RoutingKind))
@pytest.mark.parametrize("ep", [1, 2, 4])
def test_lowered_graphs_verify_and_thresholds_equal_signal_counts(kind, ep):
    if kind is RoutingKind.EMPTY_RANK and ep == 1:
        pytest.skip("one rank cannot be left empty")
    g = lower_forward(tiny_plan(kind, ep=ep, tokens=7), TINY_TILES)
    verify_graph(g)
    counts = np.bincount(g.signals_global(), minlength=g.num_events)
    assert counts.tolist() == g.threshold.tolist()


def test_random_orders_are_valid_permutations():
    g = lower_forward(tiny_plan(), TINY_TILES)
    a, b = random_order(g, 1), random_order(g, 2)
    assert sorted(a.tolist()) == list(range(g.num_tasks))
    assert a.tolist() != b.tolist()
    position = np.empty(g.num_tasks, np.int64)
    position[a] = np.arange(g.num_tasks)
    waited = g.wait_global()
    producer_pos = np.full(g.num_events, -1)
    np.maximum.at(producer_pos, g.signals_global(), position[g.signaller()])
    has = waited >= 0
    assert (producer_pos[waited[has]] < position[has]).all()


def test_a_graph_without_events_verifies():
    g = chain_graph([-1, -1], [[], []], [])
    verify_graph(g)
    assert sorted(random_order(g, 0).tolist()) == [0, 1]


def test_an_extended_event_enum_keeps_its_bases_values_and_pickles():
    import pickle

    from hpmoe.regions.dedup import DedupEvent
    from hpmoe.regions.dedup_backward import DedupBackwardEvent
    from hpmoe.regions.forward import ForwardEvent

    for e in ForwardEvent:
        assert DedupEvent[e.name] == e.value
    assert len(ForwardEvent) == DedupEvent.LANDED
    assert DedupBackwardEvent.PERM is DedupBackwardEvent.GPERM  # an alias names the same category
    for member in (DedupEvent.HDONE, DedupBackwardEvent.GLANDED):
        assert pickle.loads(pickle.dumps(member)) is member


def test_the_former_exec_program_lower_answers_with_a_deprecation_warning():
    from hpmoe.exec.program import lower
    from hpmoe.regions.kernels import FORWARD

    plan = tiny_plan(RoutingKind.ZIPF, 2)
    with pytest.warns(DeprecationWarning, match="Region.graph"):
        old = lower(plan, FORWARD, TINY_TILES)
    new = FORWARD.graph(plan, TINY_TILES, debug=True)
    assert np.array_equal(old.kind, new.kind) and np.array_equal(old.threshold, new.threshold)


def test_a_lowering_refuses_a_task_that_signals_another_rank_without_being_a_put():
    import enum

    import torch

    from hpmoe.ir.events import EventLayout
    from hpmoe.regions.tiles import lower_graph, task_block

    class Ev(enum.IntEnum):
        A = 0

    events = EventLayout.from_columns(Ev, 2, [1])
    one = np.array([0])

    def phase(_):
        return task_block(TaskKind.SWIGLU, one, one, one + 1, sig_rank=np.array([1]), sig_event=one)

    with pytest.raises(AssertionError, match="SWIGLU tasks signal another rank"):
        lower_graph([phase], None, None, np.array([True, False]), events, torch.float32)
    graph = lower_graph([phase], None, None, np.array([True, True]), events, torch.float32)
    assert graph.threshold.tolist() == [0, 1]  # every rank lowered: rank 1's event counts the signal


def test_the_debug_switch_answers_at_its_former_place_with_a_deprecation_warning():
    import hpmoe.exec.program as program
    from hpmoe.ir.verify import DEBUG_ENV

    with pytest.warns(DeprecationWarning, match="ir.verify.DEBUG_ENV"):
        assert program.DEBUG_ENV == DEBUG_ENV == "HPMOE_DEBUG"
    assert program.debug_enabled is not None  # imported there: it still answers


def test_the_former_threshold_functions_answer_with_a_deprecation_warning():
    """The per-region formulas gave way to the lowering's count: each former name warns
    and answers that count, rank by rank."""
    import dataclasses

    from hpmoe.regions.backward import backward_thresholds, lower_backward
    from hpmoe.regions.dedup import DedupLowering, dedup_events, dedup_thresholds, lower_dedup
    from hpmoe.regions.dedup_layout import make_dedup_layout
    from hpmoe.regions.forward import forward_events, forward_thresholds, lower_forward
    from hpmoe.regions.layout import make_layout
    from hpmoe.regions.slot_backward import plan_slot_backward, slot_backward_thresholds
    from hpmoe.regions.slots import SlotShape, plan_slots, slot_thresholds
    from hpmoe.regions.tiles import Lowering, shared_down, signals_per_token_tile
    from hpmoe.spec import DispatchMode, TileSpec, preset

    plan = tiny_plan(RoutingKind.ZIPF, 2)
    layout = make_layout(plan, TINY_TILES)
    dedup_tiles = dataclasses.replace(TINY_TILES, dispatch=DispatchMode.PER_RANK)
    d = make_dedup_layout(plan, dedup_tiles)
    full = {"forward": lower_forward(plan, TINY_TILES), "backward": lower_backward(plan, TINY_TILES),
            "dedup": lower_dedup(plan, dedup_tiles)}
    low = Lowering(d.base, dedup_events(d), np.ones(2, bool))
    for rank in range(2):
        with pytest.warns(DeprecationWarning, match="forward_thresholds is deprecated"):
            got = forward_thresholds(layout, rank, None)
        assert np.array_equal(got, full["forward"].threshold[full["forward"].event_ptr[rank]:
                                                             full["forward"].event_ptr[rank + 1]])
        with pytest.warns(DeprecationWarning, match="backward_thresholds"):
            got = backward_thresholds(layout, rank, None)
        assert np.array_equal(got, full["backward"].threshold[full["backward"].event_ptr[rank]:
                                                              full["backward"].event_ptr[rank + 1]])
        with pytest.warns(DeprecationWarning, match="dedup_thresholds"):
            got = dedup_thresholds(DedupLowering(low, d, 4), rank)
        assert np.array_equal(got, full["dedup"].threshold[full["dedup"].event_ptr[rank]:
                                                           full["dedup"].event_ptr[rank + 1]])
    shape = SlotShape(preset("tiny"), 8, TileSpec(rows=4, gemm_rows=8))
    with pytest.warns(DeprecationWarning, match="slot_thresholds"):
        assert np.array_equal(slot_thresholds(shape), plan_slots(shape).graph.threshold)
    with pytest.warns(DeprecationWarning, match="slot_backward_thresholds"):
        assert np.array_equal(slot_backward_thresholds(shape), plan_slot_backward(shape).graph.threshold)
    fwd = Lowering(layout, forward_events(layout), np.ones(2, bool))
    with pytest.warns(DeprecationWarning, match="Lowering.only"):
        rank0 = fwd.only(0)
    assert rank0.sel.tolist() == [True, False]
    with pytest.warns(DeprecationWarning, match="signals_per_token_tile"):
        counts = signals_per_token_tile(shared_down(rank0), rank0, fwd.events.categories.OUT)
    assert counts.sum() == len(shared_down(rank0).sig_event)
