"""AUTO by measuring: the tuner against hand-fed times, the cache, and on two ranks the
agreement on one winner, the cache's reuse and the bits each candidate claims."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from hpmoe.ir.schedule import SchedulePolicy, WorkerCounts
from hpmoe.machine import machine
from hpmoe.nn.layer import MoE
from hpmoe.placement import Placement
from hpmoe.schedule.auto import Path
from hpmoe.schedule.tune import (
    KERNEL_BY_KERNEL_KNOBS,
    Budget,
    Knobs,
    Space,
    TuneKey,
    TuneResult,
    Tuning,
    bucket,
)
from hpmoe.schedule.tune_cache import CACHE_ENV, TuneCache
from hpmoe.schedule.tuner import Tuner
from hpmoe.spec import DispatchMode, TileSpec, preset
from hpmoe.testing import spawn_gloo
from hpmoe.weights import ExpertWeights

SPACE = Space()


def _feed(tuning: Tuning, seconds: dict[Knobs, float], limit: int = 100) -> list[Knobs]:
    """Run ``tuning`` to its result on fixed per-candidate times; the candidates it ran."""
    ran = []
    while tuning.result is None and len(ran) < limit:
        k = tuning.next()
        ran.append(k)
        tuning.observe(k, seconds[k])
    return ran


def _times(default: float = 1.0, **by_name: float) -> dict[Knobs, float]:
    return {k: by_name.get(k.name, default) for k in SPACE.every()}


def test_the_space_holds_the_kernel_by_kernel_path_and_every_taskflow_combination():
    every = SPACE.every()
    assert every[0] == KERNEL_BY_KERNEL_KNOBS and len(every) == 1 + 2 * 2 * 2 * 2 == len(set(every))
    order = SPACE.order()
    assert order[:2] == [SPACE.default(), KERNEL_BY_KERNEL_KNOBS] and len(order) == 6
    assert all(k in every for k in order)
    for k in every:
        assert Knobs.from_json(json.loads(json.dumps(k.to_json()))) == k


def test_a_user_tiling_is_not_tuned():
    mine = TileSpec(rows=16, gemm_rows=16, gemm_cols=8)
    space = Space.around(mine, TileSpec(), nodes=1)
    assert {k.tiles for k in space.every() if k.path is Path.TASKFLOW} == {mine}
    assert {k.tiles.dispatch for k in Space.around(TileSpec(), TileSpec(), nodes=2).every()
            if k.tiles} == {DispatchMode.PER_EXPERT}


def test_knobs_are_checked():
    with pytest.raises(ValueError, match="concrete SchedulePolicy"):
        Knobs(Path.TASKFLOW, SchedulePolicy.AUTO, WorkerCounts(1, 1), TileSpec())
    with pytest.raises(ValueError, match="takes no taskflow knobs"):
        Knobs(Path.KERNEL_BY_KERNEL, SchedulePolicy.SERIAL)
    with pytest.raises(ValueError, match="warmup >= 0"):
        Budget(trials=0)


def test_the_fastest_wins_warm_up_calls_are_not_scored_and_the_budget_holds():
    fast = SPACE.knobs(SchedulePolicy.HYPERPARALLEL, WorkerCounts(1, 2), 128, DispatchMode.PER_EXPERT)
    times = _times(1.0, **{fast.name: 0.5, KERNEL_BY_KERNEL_KNOBS.name: 0.8})
    tuning, seen, ran = Tuning(SPACE), set(), []
    while tuning.result is None:
        k = tuning.next()
        ran.append(k)
        tuning.observe(k, times[k] if k in seen else 50.0)  # a first call is slow: not scored
        seen.add(k)
    r = tuning.result
    assert r.winner == fast and r.winner_s == 0.5 and r.runner_up == KERNEL_BY_KERNEL_KNOBS
    assert r.kernel_by_kernel_s == 0.8 and r.gain_over_runner_up == pytest.approx(1.6)
    assert r.steps == len(ran) <= Budget().max_steps
    assert tuning.next() == fast  # settled: the winner from now on


def test_a_candidate_slower_than_twice_the_best_is_dropped_after_two_scored_calls():
    slow = SPACE.knobs(SchedulePolicy.CRITICAL_PATH, WorkerCounts(1, 1), 128, DispatchMode.PER_EXPERT)
    ran = _feed(Tuning(SPACE, Budget(final=0)), _times(1.0, **{slow.name: 2.5}))
    assert ran.count(slow) == 3  # one warm-up, two scored calls, dropped
    assert ran.count(SPACE.default()) == Budget().warmup + Budget().trials


def test_one_spiked_call_does_not_drop_the_fastest_candidate():
    """Kernel by kernel is the fastest (0.4), but its first scored call hits a slow spell
    of the host (10x): its next call brings its score back, and it wins."""
    times = _times(1.0, **{KERNEL_BY_KERNEL_KNOBS.name: 0.4})
    tuning, calls = Tuning(SPACE, Budget(final=0)), 0
    while tuning.result is None:
        k = tuning.next()
        calls += k == KERNEL_BY_KERNEL_KNOBS
        tuning.observe(k, 4.0 if k == KERNEL_BY_KERNEL_KNOBS and calls == 1 + Budget().warmup else times[k])
    assert tuning.result.winner == KERNEL_BY_KERNEL_KNOBS and tuning.result.winner_s == 0.4


def test_single_changes_that_win_are_combined():
    d = SPACE.default()
    rows = SPACE.knobs(d.policy, d.workers, 256, d.tiles.dispatch)
    rank = SPACE.knobs(d.policy, d.workers, 128, DispatchMode.PER_RANK)
    both = SPACE.knobs(d.policy, d.workers, 256, DispatchMode.PER_RANK)
    tuning = Tuning(SPACE)
    ran = _feed(tuning, _times(1.0, **{rows.name: 0.9, rank.name: 0.8, both.name: 0.6}))
    assert both in ran and tuning.result.winner == both


def test_the_descent_finds_changes_that_win_only_together():
    """256-row tiles lose alone and win with per-rank dispatch: the second pass, from the
    per-rank leader, measures the pair; the descent stops once the leader's neighbours
    are all measured, within the candidate budget."""
    d = SPACE.default()
    rows = SPACE.knobs(d.policy, d.workers, 256, d.tiles.dispatch)
    rank = SPACE.knobs(d.policy, d.workers, 128, DispatchMode.PER_RANK)
    both = SPACE.knobs(d.policy, d.workers, 256, DispatchMode.PER_RANK)
    tuning = Tuning(SPACE, Budget(final=0))
    ran = _feed(tuning, _times(1.0, **{rows.name: 1.1, rank.name: 0.8, both.name: 0.6}))
    assert tuning.result.winner == both
    tried = list(dict.fromkeys(ran))
    assert set(SPACE.neighbours(both)) <= set(tried) and len(tried) <= Budget().candidates
    assert set(SPACE.neighbours(rank)) == {both, d, *(SPACE.knobs(p, w, 128, DispatchMode.PER_RANK)
                                               for p, w in ((SchedulePolicy.CRITICAL_PATH, d.workers),
                                                            (d.policy, WorkerCounts(1, 2))))}


def test_a_leading_default_ends_the_search_after_one_pass():
    ran = _feed(Tuning(SPACE, Budget(final=0)), _times(1.0, **{SPACE.default().name: 0.5}))
    assert list(dict.fromkeys(ran)) == SPACE.order()


def test_a_model_choice_is_measured_first_and_times_told_alike_give_one_result():
    first = SPACE.knobs(SchedulePolicy.CRITICAL_PATH, WorkerCounts(1, 1), 256, DispatchMode.PER_RANK)
    a, b = Tuning(SPACE, first=first), Tuning(SPACE, first=first)
    times = _times(1.0, **{first.name: 0.7})
    assert _feed(a, times) == _feed(b, times)
    assert a.next() == first and a.result == b.result and a.digest() == b.digest()
    assert a.digest() != Tuning(SPACE).digest()


def test_token_counts_share_a_key_per_power_of_two():
    assert [bucket(n) for n in (0, 1, 2, 3, 5, 1024, 1025)] == [0, 1, 2, 4, 8, 1024, 2048]


# ---------------------------------------------------------------------------- cache


def _key(**changes) -> TuneKey:
    base = TuneKey.of("cpu A | AVX2 | 2 cores", preset("tiny"), 2, 1, "shm", 300, True)
    return TuneKey(**(vars(base) | changes))


RESULT = TuneResult(KERNEL_BY_KERNEL_KNOBS, 0.01, SPACE.default(), 0.02, 0.01, 12, 0.3)
VERSIONS = {"hpmoe": "1", "torch": "2.13.0", "triton": None}


def test_the_cache_returns_its_entry_and_ignores_stale_ones_with_a_note(tmp_path):
    cache = TuneCache(tmp_path / "tune.json")
    assert cache.lookup(_key(), VERSIONS).result is None
    cache.store(_key(), VERSIONS, RESULT)
    hit = cache.lookup(_key(), VERSIONS)
    assert hit.result.winner == RESULT.winner and hit.result.source == "cache" and hit.note is None
    stale = cache.lookup(_key(), VERSIONS | {"torch": "2.14.0"})
    assert stale.result is None and "torch 2.13.0" in stale.note and "torch 2.14.0" in stale.note
    other = cache.lookup(_key(machine="cpu B | AVX512 | 8 cores"), VERSIONS)
    assert other.result is None and "another machine (cpu A" in other.note
    assert cache.lookup(_key(tokens=1024), VERSIONS) == type(hit)(None, None)  # another shape: no note
    cache.store(_key(), VERSIONS, RESULT)  # replaces, does not add
    assert len(cache.entries()) == 1


def test_a_placement_is_part_of_the_key_and_entries_saved_before_it_read_as_none(tmp_path):
    assert _key(placement=5) != _key() and _key().placement == 0
    assert TuneKey.of("m", preset("tiny"), 2, 1, "shm", 300, True, 5) == _key(machine="m", placement=5)
    path = tmp_path / "tune.json"
    TuneCache(path).store(_key(), VERSIONS, RESULT)
    doc = json.loads(path.read_text())
    del doc["entries"][0]["key"]["placement"]  # an entry saved before the key had one
    path.write_text(json.dumps(doc))
    assert TuneCache(path).lookup(_key(), VERSIONS).result.winner == RESULT.winner
    assert TuneCache(path).lookup(_key(placement=5), VERSIONS).result is None


def test_a_damaged_cache_file_is_named(tmp_path):
    path = tmp_path / "tune.json"
    path.write_text('{"format": 1, "entries": [{"key": {}}]}')
    with pytest.raises(ValueError, match=CACHE_ENV):
        TuneCache(path).lookup(_key(), VERSIONS)


# ---------------------------------------------------------------------------- ranks

TOKENS = 300  # per rank: more than one tile of 128 and of 256 rows


def _layer_steps(rank, world, steps, skew):
    """``steps`` forward/backward steps of an AUTO layer; with ``skew`` each rank's clock
    disagrees: rank 0 reports every taskflow call a second slower, rank 1 every
    kernel-by-kernel call (alone, each would pick the other's loser)."""
    if skew:
        report = Tuner.report

        def skewed(self):
            trial = self._open
            if trial is not None and (trial.knobs.path is Path.KERNEL_BY_KERNEL) == (rank == 1):
                trial.seconds += 1.0
            return report(self)

        Tuner.report = skewed
    spec = preset("tiny")
    layer = MoE(spec, ExpertWeights.random(spec, 1), ep_group=dist.group.WORLD)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(TOKENS, spec.hidden, generator=g, requires_grad=True)
    outs = []
    for _ in range(steps):
        layer.zero_grad()
        x.grad = None
        out = layer(x)
        out.backward(torch.ones_like(out))
        outs.append((out.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}))
    result = layer.tuned(TOKENS, backward=True)
    history = {k.name: v for t in layer._door.auto.tuner._keys.values() for k, v in t._seen.items()}
    layer.close()
    return result, history, outs


def test_ranks_commit_to_one_winner_even_when_their_clocks_disagree():
    results = spawn_gloo(_layer_steps, 2, Budget().max_steps + 2, True, timeout=300)
    (r0, h0, _), (r1, h1, _) = results
    assert r0 is not None and r0 == r1 and h0 == h1  # the same history: every rank's max
    assert r0.winner_s > 1.0  # the slowest rank's clock: every candidate carries a skewed second


def test_a_stale_entry_is_ignored_and_a_second_process_reuses_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "tune.json"))
    key = Tuner().key(preset("tiny"), 2, 1, "shm", TOKENS, True)
    TuneCache().store(key, machine().versions() | {"torch": "0.0"}, RESULT)  # measured with another torch
    first, _, _ = spawn_gloo(_layer_steps, 2, Budget().max_steps + 2, False, timeout=300)[0]
    assert first is not None and first.source == "measured"
    entry = [e for e in TuneCache().entries() if e.versions == machine().versions()]
    assert len(entry) == 1 and entry[0].key == key and len(TuneCache().entries()) == 2
    again, history, _ = spawn_gloo(_layer_steps, 2, 2, False, timeout=300)[0]
    assert again.source == "cache" and again.winner == first.winner and history == {}


PLACEMENTS = (Placement((0, 3, 4, 5, 7, 0, 1, 2, 6, 7), 8, 2),  # experts 0 and 7 on both ranks
              Placement((0, 1, 2, 3, 7, 4, 5, 6, 0, 7), 8, 2))


def _placed_paths(rank, world, path):
    """The path of an AUTO layer's first training call under each of ``PLACEMENTS``
    (ten slots each), its tuning cache at ``path``, and what ``tuned`` says after it."""
    os.environ[CACHE_ENV] = path
    spec = preset("tiny")
    layer = MoE(spec, ExpertWeights.random(spec, 1), ep_group=dist.group.WORLD)
    x = torch.randn(TOKENS, spec.hidden, generator=torch.Generator().manual_seed(rank))
    paths = []
    for placement in PLACEMENTS:
        layer.placement = placement
        layer(x.clone().requires_grad_()).sum().backward()
        paths += [type(layer._door.last.path).__name__, layer.tuned(TOKENS, backward=True).winner.path.name]
    layer.close()
    return paths


def test_a_rebalanced_layer_is_tuned_under_its_own_placement(tmp_path):
    """The tuning key carries the placement the call agreed on: the cache names kernel by
    kernel for one placement of ten slots and the taskflow for another, and the layer
    runs each under its own (a key without the placement would give both one choice)."""
    path = str(tmp_path / "tune.json")
    slots = dataclasses.replace(preset("tiny"), experts=10, groups=1, top_groups=1)
    taskflow = next(k for k in SPACE.every() if k.path is Path.TASKFLOW)
    for placement, winner in zip(PLACEMENTS, (KERNEL_BY_KERNEL_KNOBS, taskflow), strict=True):
        key = Tuner().key(slots, 2, 1, "shm", TOKENS, True, placement.digest())
        TuneCache(path).store(key, machine().versions(), TuneResult(winner, 1.0, None, None, None, 0, 0.0))
    for paths in spawn_gloo(_placed_paths, 2, path, timeout=120):
        assert paths == ["KernelByKernelPath", "KERNEL_BY_KERNEL", "RuntimePath", "TASKFLOW"]


def _pinned_steps(rank, world, knobs_docs, folder):
    """One step of an AUTO layer per knobs, its cache naming them the winner."""
    spec, out = preset("tiny"), []
    key = Tuner().key(spec, world, 1, "shm", TOKENS, True)
    for i, doc in enumerate(knobs_docs):
        os.environ[CACHE_ENV] = os.path.join(folder, f"tune-{i}.json")
        if rank == 0:
            pinned = TuneResult(Knobs.from_json(doc), 1.0, None, None, None, 0, 0.0)
            TuneCache().store(key, machine().versions(), pinned)
        dist.barrier()
        out.append(_layer_steps(rank, world, 1, False)[2][0])
    return out


def test_candidates_that_claim_the_same_rounding_compute_the_same_bits(tmp_path):
    every = SPACE.every()
    runs = spawn_gloo(_pinned_steps, 2, [k.to_json() for k in every], str(tmp_path), timeout=300)
    by_rounding: dict[tuple, list] = {}
    for i, knobs in enumerate(every):
        by_rounding.setdefault(knobs.rounding, []).append((knobs.name, [runs[r][i] for r in (0, 1)]))
    assert len(by_rounding) == 3  # kernel by kernel; taskflow per expert; taskflow per rank
    for group in by_rounding.values():
        (name0, ref), rest = group[0], group[1:]
        for name, got in rest:
            for rank in (0, 1):
                assert torch.equal(got[rank][0], ref[rank][0]), (name, name0, "out")
                assert torch.equal(got[rank][1], ref[rank][1]), (name, name0, "dx")
                for p, grad in ref[rank][2].items():
                    assert torch.equal(got[rank][2][p], grad), (name, name0, p)


def _hpmoe(*argv: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "hpmoe", *argv], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    return proc


def test_hpmoe_tune_saves_a_choice_that_bench_reuses_without_tuning(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "tune.json"))
    layer = ["--ep", "2", "--preset", "tiny", "--tokens", "64", "--dtype", "fp32", "--deadline", "30",
             "--json"]
    tuned = json.loads(_hpmoe("tune", *layer, "--forward-only").stdout.splitlines()[-1])["tuned"][0]
    assert tuned["source"] == "measured" and 0 < tuned["steps"] <= Budget().max_steps
    report = json.loads(_hpmoe("bench", *layer, "--iters", "2", "--warmup", "1").stdout.splitlines()[-1])
    assert report["tune_source"] == "cache" and report["tune_steps"] == 0
    assert report["tune_winner"] == Knobs.from_json(tuned["winner"]).name
    shown = _hpmoe("tune", "--show").stdout
    assert "1 entries" in shown and f"| {report['tune_winner']} |" in shown and "| yes |" in shown


def test_bench_tunes_its_default_path_through_the_layer_and_saves_the_choice(tmp_path, monkeypatch):
    """The bench's default path is a user's layer: its first calls tune, the layer's tuner
    saves the winner, and a second bench reads it and tunes nothing."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "tune.json"))
    args = ["bench", "--ep", "2", "--preset", "tiny", "--tokens", "64", "--dtype", "fp32", "--deadline", "30",
            "--json", "--iters", "2", "--warmup", "1"]
    first = json.loads(_hpmoe(*args).stdout.splitlines()[-1])
    assert first["tune_source"] == "measured" and 0 < first["tune_steps"] <= Budget().max_steps
    second = json.loads(_hpmoe(*args).stdout.splitlines()[-1])
    assert second["tune_source"] == "cache" and second["tune_steps"] == 0
    assert second["tune_winner"] == first["tune_winner"]


def test_bench_pairs_the_default_with_the_sweeps_fastest_candidate(tmp_path, monkeypatch):
    """``--paired N``: the candidate of the sweep's fastest iteration, then N calls each of
    it and the default alternating; its ratios are its own samples'. Without ``--sweep``
    the option is refused by name."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "tune.json"))
    args = ["bench", "--ep", "2", "--preset", "tiny", "--tokens", "64", "--dtype", "fp32", "--deadline", "30",
            "--json", "--iters", "2", "--warmup", "1", "--paired", "3"]
    r = json.loads(_hpmoe(*args, "--sweep").stdout.splitlines()[-1])
    assert r["paired_candidate"] == min(r["sweep"], key=lambda n: r["sweep"][n]["min_ms"])
    assert r["default_over_paired_fastest"] == pytest.approx(
        r["paired_candidate_min_ms"] / r["paired_default_min_ms"], rel=2e-3)
    refused = subprocess.run([sys.executable, "-m", "hpmoe", *args], capture_output=True, text=True,
                             timeout=60)
    assert refused.returncode != 0 and "BenchConfig.paired=3" in refused.stderr


def test_the_sweeps_tally_counts_each_measure_and_sets_apart_a_path_paired_with_itself():
    """``bench_tune.py``'s closing counts, on hand-made rows: 0.95 holds and 0.949 does
    not; a paired row whose candidate is the default's own path is left out of the count
    among other paths."""
    benchmarks = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
    sys.path.insert(0, benchmarks)
    try:
        import bench_tune
    finally:
        sys.path.remove(benchmarks)
    base = {"vs_best": 1.0, "vs_best_fastest": 1.0, "choice_vs_best": 1.0, "choice_vs_best_fastest": 1.0,
            "vs_kbk": 1.0, "vs_kbk_fastest": 1.0, "paired": 1.0, "paired_fastest": 1.0}
    rows = [dict(base, winner="kbk", paired_with="kbk", vs_best_fastest=0.949, paired_fastest=0.9),
            dict(base, winner="kbk", paired_with="flow", vs_best=0.95, paired=0.96),
            dict(base, winner="flow", paired_with=None, paired=None, paired_fastest=None)]
    lines = bench_tune.tally(rows).splitlines()
    assert lines[0] == "within 5% of the sweep's best (fastest / median): 2 / 3 of 3"
    assert lines[2] == "paired: 1 / 2 of 2; where the sweep's fastest is another path: 1 / 1 of 1"


def _first_tried(rank, world, profile):
    os.environ["HPMOE_PROFILE"] = profile
    spec = preset("tiny")
    layer = MoE(spec, ExpertWeights.random(spec, 1), ep_group=dist.group.WORLD)
    x = torch.randn(TOKENS, spec.hidden)
    with torch.no_grad():
        for _ in range(2):  # the second call's agreement carries the first's time
            layer(x)
    tuning = next(iter(layer._door.auto.tuner._keys.values()))
    chosen = layer.decision(TOKENS, backward=False).chosen
    layer.close()
    return next(iter(tuning._seen)), chosen


def test_with_a_saved_profile_the_model_choice_is_measured_first(tmp_path):
    from hpmoe.sim.profile import save_profile

    from .handmade import UNIT_HW

    profile = save_profile(dataclasses.replace(UNIT_HW, name="cpu"), tmp_path / "cpu.json")
    for first, chosen in spawn_gloo(_first_tried, 2, str(profile), timeout=120):
        assert first.path is chosen.path and (first.policy is None or first.policy is chosen.policy)


def test_the_race_decides_by_paired_calls_not_by_each_ones_fastest_call():
    """The host slows down while the finalists race: B is 10% faster than A in every
    pair, but A's fastest call came before the slowdown.  Each one's fastest call would
    pick A; the pairs pick B."""
    a, b = SPACE.default(), KERNEL_BY_KERNEL_KNOBS
    tuning = Tuning(SPACE, Budget(final=4))
    spell = 1.0
    while tuning.result is None:
        k = tuning.next()
        raced = bool(tuning._final) and k in (a, b)
        spell = 1.3 if raced else spell  # the race runs in a slow spell
        base = {a: 1.0, b: 1.05}.get(k, 1.5) if not raced else {a: 1.0, b: 0.9}[k]
        tuning.observe(k, base * spell)
    r = tuning.result
    assert r.winner == b and r.runner_up == a
    assert tuning._paired(a, b) == pytest.approx(0.9)


def test_a_leading_taskflow_races_when_close_and_a_leading_kernel_by_kernel_never():
    """A taskflow in the lead races kernel by kernel within 20% of it, not one further
    behind; kernel by kernel in the lead wins without a race (a taskflow replaces the
    floor only when its fastest call and the pairs both say it is faster)."""
    kbk, default = KERNEL_BY_KERNEL_KNOBS, SPACE.default()
    need = Budget().warmup + Budget().trials
    tuning = Tuning(SPACE)
    close = _feed(tuning, _times(1.0, **{default.name: 0.95}))
    assert close.count(kbk) == need + Budget().final and close.count(default) == need + Budget().final
    assert tuning.result.winner == default
    far = _feed(Tuning(SPACE), _times(1.0, **{default.name: 0.5}))
    assert far.count(kbk) == need and len(far) <= Budget().max_steps
    tuning = Tuning(SPACE)
    floor = _feed(tuning, _times(1.0, **{kbk.name: 0.95}))
    assert floor.count(kbk) == need and floor.count(default) == need
    assert tuning.result.winner == kbk and tuning.result.runner_up == default


def test_short_calls_race_until_each_finalist_ran_race_seconds_long_calls_only_final():
    """The race's length is time, not a call count: 10 ms calls race on until each
    finalist has 0.05 s in the race (6 calls of 9.5 ms, over ``final`` = 2), 1 ms calls stop at
    ``final_max``, 1 s calls at ``final``."""
    kbk, default = KERNEL_BY_KERNEL_KNOBS, SPACE.default()
    budget = Budget(final=2, final_max=8, race_seconds=0.05)
    need = budget.warmup + budget.trials
    for scale, extra in ((0.01, 6), (0.001, 8), (1.0, 2)):
        times = _times(1.0, **{default.name: 0.95})
        ran = _feed(Tuning(SPACE, budget), {k: t * scale for k, t in times.items()})
        assert ran.count(kbk) == need + extra, scale
        assert len(ran) <= budget.max_steps


def test_a_taskflow_in_the_lead_races_kernel_by_kernel_not_another_taskflow():
    """Two taskflows lead, kernel by kernel 10% behind them: the leader races kernel by
    kernel (the floor), and where the pairs say kernel by kernel is faster it wins."""
    kbk, lead = KERNEL_BY_KERNEL_KNOBS, SPACE.default()
    second = next(k for k in SPACE.order() if k not in (kbk, lead))
    tuning = Tuning(SPACE, Budget(final=4))
    while tuning.result is None:
        k = tuning.next()
        raced = bool(tuning._final)
        times = {lead: 1.0, second: 1.02, kbk: 1.1} if not raced else {lead: 1.0, kbk: 0.95}
        tuning.observe(k, times.get(k, 1.5))
    assert set(tuning._final) == {lead, kbk}
    assert tuning.result.winner == kbk and tuning.result.runner_up == lead


def test_the_sweep_fields_set_the_default_and_its_choice_against_the_best():
    from hpmoe.bench.report import Stats, sweep_fields

    sweep = {"a": Stats(10.0, 9.0, 11.0, 8.0), "b": Stats(12.0, 11.0, 13.0, 7.0)}
    f = sweep_fields(sweep, Stats(11.0, 10.0, 12.0, 9.0), "b")
    assert f["sweep_best"] == "a" and f["sweep_best_ms"] == 10.0
    assert f["default_over_sweep_best"] == round(10 / 11, 3)
    assert f["default_over_sweep_best_fastest"] == round(7 / 9, 3)
    assert f["chosen_over_sweep_best"] == round(10 / 12, 3) and f["chosen_over_sweep_best_fastest"] == 1.0
    assert "chosen_over_sweep_best" not in sweep_fields(sweep, sweep["a"], None)
    assert sweep_fields({}, sweep["a"], "a") == {}


def test_the_paired_fields_set_the_default_against_its_partner():
    from hpmoe.bench.report import Stats, paired_fields

    default, b = Stats(11.0, 10.0, 12.0, 9.0), Stats(10.0, 9.0, 11.0, 8.0)
    f = paired_fields({"taskflow": default, "sweep:b": b})
    assert f["paired_candidate"] == "b" and f["paired_default_min_ms"] == 9.0
    assert f["default_over_paired"] == round(10 / 11, 3)
    assert f["default_over_paired_fastest"] == round(8 / 9, 3)
    assert paired_fields({}) == {}
