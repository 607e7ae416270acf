"""AUTO by measuring: the ways to run a distributed region (a typed search space), and
the tuner that runs them on real calls, keeps the slowest rank's time of each and
commits every rank to the fastest.

Knobs (``Knobs``): the path (the taskflow on the runtime, or kernel by kernel), and for
the taskflow its scheduling policy, worker threads per rank and tiles (token rows per
tile and per GEMM tile, dispatch per expert or per rank).  Which knobs change rounding:
the path and the dispatch mode (``Knobs.rounding``: candidates with the same value
compute the same bits; tests/test_tune.py checks it).  The tiles' rows do not: every
task computes whole rows, and a row's result does not depend on which rows share its
tile.  The bf16 partial sums are not a knob: they trade accuracy, not time alone.

The tuner (``Tuning``, one per ``TuneKey``) is a pure function of the times it is told:
every rank feeds it the same slowest-rank times (the layer's call agreement carries
them; the bench all-gathers them), so every rank runs the same candidate at the same
call and commits the same winner whatever its own clock said.  Order: ``Space.order``
(the model's choice where there is one, the default, kernel by kernel, the default with
one knob changed), then, pass by pass, the leading taskflow with one more knob changed
(a descent: it finds changes that win only together).  Each candidate gets
``Budget.warmup`` calls not scored, then ``Budget.trials`` scored ones (its score: the
fastest), in rounds over the candidates, each round in another order (a slow spell of
the host, or the call before — a neighbour moves a call's time by ~20% either way on
the development machine — favours or burdens none); a candidate whose score after two
scored calls is over ``Budget.slow_factor`` times the best score so far is dropped (one
call cannot drop it: a host spike once dropped the fastest path).  A leading kernel by
kernel wins outright: a taskflow replaces the floor only when both its fastest call and
paired calls say it is faster (when the two disagree the choice is a near tie, and on a
2-core host a race of four pairs once chose a taskflow 5% slower).  A leading
taskflow races a challenger within ``Budget.close`` of it — kernel by kernel, else the
runner-up — for at least ``Budget.final`` more scored calls each, alternating, until
each has run ``Budget.race_seconds`` in the race (at most ``Budget.final_max`` calls
each: short calls race longer, so a near tie is decided by more pairs), and the race
decides by its adjacent pairs (the median of one's time over the other's, each pair's
calls back to back), not by each one's fastest call.  Every call is a real step whose
output is used.
"""

from __future__ import annotations

import itertools
import math
import statistics
import zlib
from dataclasses import dataclass, field, replace

from ..ir.schedule import SchedulePolicy, WorkerCounts
from ..spec import DispatchMode, MoESpec, TileSpec
from .auto import Candidate, Path


@dataclass(frozen=True)
class Knobs:
    """One way to run the region: ``path`` and, for the taskflow only, its policy,
    worker threads per rank and tiles."""

    path: Path
    policy: SchedulePolicy | None = None
    workers: WorkerCounts | None = None
    tiles: TileSpec | None = None

    def __post_init__(self) -> None:
        if self.path not in (Path.TASKFLOW, Path.KERNEL_BY_KERNEL, Path.PERSISTENT):
            raise ValueError(f"Knobs.path must be taskflow, kernel-by-kernel or persistent, "
                             f"got {self.path!r}")
        flow = (self.policy, self.workers, self.tiles)
        concrete = isinstance(self.policy, SchedulePolicy) and self.policy is not SchedulePolicy.AUTO
        if self.path is Path.PERSISTENT:
            if not concrete or flow[1:] != (None, None):
                raise ValueError(f"Knobs {flow!r}: the persistent kernel takes a concrete SchedulePolicy "
                                 "only")
        elif self.path is Path.TASKFLOW:
            typed = isinstance(self.workers, WorkerCounts) and isinstance(self.tiles, TileSpec)
            if not concrete or not typed:
                raise ValueError(f"Knobs {flow!r}: a taskflow needs a concrete SchedulePolicy, "
                                 "WorkerCounts and a TileSpec")
        elif flow != (None, None, None):
            raise ValueError(f"Knobs {flow!r}: the kernel-by-kernel path takes no taskflow knobs")

    @property
    def name(self) -> str:
        if self.path is Path.KERNEL_BY_KERNEL:
            return self.path.value
        if self.path is Path.PERSISTENT:
            return f"{self.path.value}:{self.policy.value}"
        t = self.tiles
        return (f"taskflow:{self.policy.value} workers {self.workers.matrix},{self.workers.vector} "
                f"rows {t.rows}/{t.gemm_rows} {t.dispatch.value}")

    @property
    def rounding(self) -> tuple:
        """Candidates with equal ``rounding`` compute bitwise-equal results."""
        if self.path is not Path.TASKFLOW:  # persistent: one task per tile under every policy
            return (self.path,)
        return (self.path, self.tiles.dispatch, self.tiles.partial_dtype)

    def to_json(self) -> dict:
        if self.path is Path.KERNEL_BY_KERNEL:
            return {"path": self.path.value}
        if self.path is Path.PERSISTENT:
            return {"path": self.path.value, "policy": self.policy.value}
        t = self.tiles
        return {"path": self.path.value, "policy": self.policy.value,
                "workers": [self.workers.matrix, self.workers.vector],
                "tiles": {"rows": t.rows, "gemm_rows": t.gemm_rows, "gemm_cols": t.gemm_cols,
                          "gemm_splits": t.gemm_splits, "dispatch": t.dispatch.value}}

    @staticmethod
    def from_json(doc: dict) -> Knobs:
        path = Path(doc["path"])
        if path is Path.KERNEL_BY_KERNEL:
            return KERNEL_BY_KERNEL_KNOBS
        if path is Path.PERSISTENT:
            return Knobs(path, SchedulePolicy(doc["policy"]))
        t = doc["tiles"]
        tiles = TileSpec(rows=t["rows"], gemm_rows=t["gemm_rows"], gemm_cols=t["gemm_cols"],
                         gemm_splits=t["gemm_splits"], dispatch=DispatchMode(t["dispatch"]))
        return Knobs(path, SchedulePolicy(doc["policy"]), WorkerCounts(*doc["workers"]), tiles)


KERNEL_BY_KERNEL_KNOBS = Knobs(Path.KERNEL_BY_KERNEL)


@dataclass(frozen=True)
class Space:
    """The taskflow's knob values (the first of each: the default) around ``tiles``; the
    kernel-by-kernel path is always in the space.  ``rows`` sets a tile's token rows and
    a GEMM tile's rows together; ``fixed_tiles`` keeps ``tiles`` as given (a user's
    explicit tiling is not tuned)."""

    tiles: TileSpec = TileSpec()
    policies: tuple[SchedulePolicy, ...] = (SchedulePolicy.HYPERPARALLEL, SchedulePolicy.CRITICAL_PATH)
    workers: tuple[WorkerCounts, ...] = (WorkerCounts(1, 1), WorkerCounts(1, 2))
    rows: tuple[int, ...] = (128, 256)
    dispatch: tuple[DispatchMode, ...] = (DispatchMode.PER_EXPERT, DispatchMode.PER_RANK)
    fixed_tiles: bool = False

    def __post_init__(self) -> None:
        for name in ("policies", "workers", "rows", "dispatch"):
            if not getattr(self, name):
                raise ValueError(f"Space.{name} must hold at least one value")
        if SchedulePolicy.AUTO in self.policies:
            raise ValueError("Space.policies must be concrete policies, not AUTO")

    @staticmethod
    def around(tiles: TileSpec, default_tiles: TileSpec, nodes: int) -> Space:
        """The space of a layer whose options hold ``tiles``: tiles are tuned only when the
        user left them at ``default_tiles``, and the dispatch only on one node."""
        if tiles != default_tiles or nodes > 1:
            return Space(tiles=tiles, rows=(tiles.rows,), dispatch=(tiles.dispatch,), fixed_tiles=True)
        return Space(tiles=tiles)

    def _tiles(self, rows: int, dispatch: DispatchMode) -> TileSpec:
        if self.fixed_tiles:
            return self.tiles
        return replace(self.tiles, rows=rows, gemm_rows=rows, dispatch=dispatch)

    def knobs(self, policy: SchedulePolicy, workers: WorkerCounts, rows: int,
              dispatch: DispatchMode) -> Knobs:
        return Knobs(Path.TASKFLOW, policy, workers, self._tiles(rows, dispatch))

    def default(self) -> Knobs:
        return self.knobs(self.policies[0], self.workers[0], self.rows[0], self.dispatch[0])

    def of(self, chosen: Candidate) -> Knobs:
        """A model's choice (``schedule.auto``) as knobs: the default taskflow under its
        policy, or the kernel-by-kernel path."""
        if chosen.path is not Path.TASKFLOW:
            return KERNEL_BY_KERNEL_KNOBS
        return replace(self.default(), policy=chosen.policy)

    def every(self) -> list[Knobs]:
        """Every candidate (the exhaustive sweep), the kernel-by-kernel path first."""
        grid = itertools.product(self.policies, self.workers, self.rows, self.dispatch)
        return [KERNEL_BY_KERNEL_KNOBS, *dict.fromkeys(self.knobs(*values) for values in grid)]

    def order(self, first: Knobs | None = None) -> list[Knobs]:
        """What the tuner measures, in order: ``first`` (the model's choice) if given, the
        default taskflow, the kernel-by-kernel path, then the default with one knob changed."""
        d = self.default()
        singles = [self.knobs(p, d.workers, d.tiles.rows, d.tiles.dispatch) for p in self.policies[1:]]
        singles += [self.knobs(d.policy, w, d.tiles.rows, d.tiles.dispatch) for w in self.workers[1:]]
        singles += [self.knobs(d.policy, d.workers, r, d.tiles.dispatch) for r in self.rows[1:]]
        singles += [self.knobs(d.policy, d.workers, d.tiles.rows, m) for m in self.dispatch[1:]]
        head = [first] if first is not None else []
        return list(dict.fromkeys([*head, d, KERNEL_BY_KERNEL_KNOBS, *singles]))

    def neighbours(self, k: Knobs) -> list[Knobs]:
        """The taskflows ``k`` becomes with one knob changed to another value of the
        space (none for another path)."""
        if k.path is not Path.TASKFLOW:
            return []
        here = _parts(k)
        values = {"policy": self.policies, "workers": self.workers, "rows": self.rows,
                  "dispatch": self.dispatch}
        return [self.knobs(**(here | {name: v}))
                for name, vs in values.items() for v in vs if v != here[name]]


@dataclass(frozen=True)
class DeviceSpace:
    """One process on a device: the kernel-by-kernel path and the persistent kernel under
    each of ``policies`` (the first: the default).  The tuner's interface of ``Space``;
    every candidate is in the first pass (no neighbours)."""

    policies: tuple[SchedulePolicy, ...] = (SchedulePolicy.HYPERPARALLEL, SchedulePolicy.CRITICAL_PATH)

    def default(self) -> Knobs:
        return Knobs(Path.PERSISTENT, self.policies[0])

    def every(self) -> list[Knobs]:
        return [KERNEL_BY_KERNEL_KNOBS, *(Knobs(Path.PERSISTENT, p) for p in self.policies)]

    def order(self, first: Knobs | None = None) -> list[Knobs]:
        every = self.every()
        return list(dict.fromkeys([*([first] if first else []), self.default(), *every]))

    def neighbours(self, k: Knobs) -> list[Knobs]:
        return []


def _parts(k: Knobs) -> dict:
    return {"policy": k.policy, "workers": k.workers, "rows": k.tiles.rows, "dispatch": k.tiles.dispatch}


SLOW_CALLS = 2  # scored calls before a slow score drops a candidate


@dataclass(frozen=True)
class Budget:
    """Calls per candidate: ``warmup`` unscored then ``trials`` scored; a score (the fastest
    scored call) over ``slow_factor`` x the best score so far, after ``SLOW_CALLS`` scored
    calls, drops the candidate; at most ``candidates``
    candidates per key; then, when the runner-up's score is within ``close`` (a fraction)
    of the winner's, at least ``final`` more scored calls of each, more while either has
    run less than ``race_seconds`` in the race, at most ``final_max``.  Worst case per
    key: ``max_steps``."""

    warmup: int = 1
    trials: int = 3
    slow_factor: float = 2.0
    candidates: int = 12
    final: int = 4
    close: float = 0.2
    race_seconds: float = 0.5
    final_max: int = 16

    def __post_init__(self) -> None:
        if (self.warmup < 0 or self.trials < 1 or self.candidates < 1 or not self.slow_factor > 1.0
                or self.final < 0 or not self.close >= 0 or self.final_max < self.final
                or not self.race_seconds >= 0):
            raise ValueError(f"Budget{(self.warmup, self.trials, self.slow_factor, self.candidates)}, "
                             f"final={self.final}, final_max={self.final_max}, close={self.close}, "
                             f"race_seconds={self.race_seconds}: warmup >= 0, trials >= 1, slow_factor > 1, "
                             "candidates >= 1, 0 <= final <= final_max, close >= 0, race_seconds >= 0")

    @property
    def max_steps(self) -> int:
        return self.candidates * (self.warmup + self.trials) + 2 * self.final_max


@dataclass(frozen=True)
class TuneKey:
    """What a tuned choice depends on: the machine (``Machine.fingerprint``), the layer,
    the EP group (size, nodes, transport), the compute dtype, the tokens per rank rounded
    up to a power of two, whether the backward runs too, and the digest of the expert
    placement the layer runs under (``Placement.digest``; 0: none), so that a rebalance,
    which changes the work each rank does, is tuned anew."""

    machine: str
    moe: str
    ep: int
    nodes: int
    transport: str
    dtype: str
    tokens: int
    backward: bool
    placement: int = 0

    @staticmethod
    def of(machine: str, moe: MoESpec, ep: int, nodes: int, transport: str, tokens: int,
           backward: bool, placement: int = 0) -> TuneKey:
        layer = (f"H{moe.hidden} F{moe.ffn} E{moe.experts} k{moe.top_k} S{moe.shared_ffn} "
                 f"{moe.activation.value} {moe.gate.value}")
        return TuneKey(machine, layer, ep, nodes, transport, str(moe.dtype).removeprefix("torch."),
                       bucket(tokens), backward, placement)

    def to_json(self) -> dict:
        return dict(vars(self))


def bucket(tokens: int) -> int:
    """Tokens per rank rounded up to a power of two (0 stays 0)."""
    return 0 if tokens <= 0 else 1 << (tokens - 1).bit_length()


@dataclass(frozen=True)
class TuneResult:
    """A key's committed choice: the winner and its score (the fastest scored call's
    slowest-rank seconds; after a race the winner is the race's paired verdict, whose
    score may be the higher), the runner-up, the kernel-by-kernel path's score (None when
    not measured), the tuning steps and their seconds, and where it came from."""

    winner: Knobs
    winner_s: float
    runner_up: Knobs | None
    runner_up_s: float | None
    kernel_by_kernel_s: float | None
    steps: int
    seconds: float
    source: str = "measured"  # or "cache"

    @property
    def gain_over_runner_up(self) -> float:
        return self.runner_up_s / self.winner_s if self.runner_up_s and self.winner_s > 0 else 1.0

    def describe(self) -> str:
        parts = [f"{self.winner.name} ({self.source}; {self.winner_s * 1e3:.3f} ms"]
        if self.runner_up is not None:
            parts.append(f"runner-up {self.runner_up.name} {self.runner_up_s * 1e3:.3f} ms, "
                         f"{self.gain_over_runner_up:.2f}x")
        if self.kernel_by_kernel_s is not None:
            parts.append(f"kernel by kernel {self.kernel_by_kernel_s * 1e3:.3f} ms")
        parts.append(f"{self.steps} tuning steps, {self.seconds:.2f} s)")
        return "; ".join(parts)

    def to_json(self) -> dict:
        return {"winner": self.winner.to_json(), "winner_s": self.winner_s,
                "runner_up": self.runner_up.to_json() if self.runner_up else None,
                "runner_up_s": self.runner_up_s, "kernel_by_kernel_s": self.kernel_by_kernel_s,
                "steps": self.steps, "seconds": self.seconds, "source": self.source}

    @staticmethod
    def from_json(doc: dict, source: str = "cache") -> TuneResult:
        up = doc.get("runner_up")
        return TuneResult(Knobs.from_json(doc["winner"]), float(doc["winner_s"]),
                          Knobs.from_json(up) if up else None, doc.get("runner_up_s"),
                          doc.get("kernel_by_kernel_s"), int(doc["steps"]), float(doc["seconds"]), source)


@dataclass
class Tuning:
    """The search for one key.  ``next()`` names the candidate the next call runs;
    ``observe(knobs, seconds)`` records a finished call's slowest-rank seconds (calls
    may finish one behind: a call issued before the previous one's time is known).
    ``result`` is set once every candidate ran (or was dropped) and every time is in."""

    space: Space
    budget: Budget = field(default_factory=Budget)
    first: Knobs | None = None
    result: TuneResult | None = None
    steps: int = 0
    seconds: float = 0.0
    _order: list[Knobs] = field(default_factory=list)
    _issued: dict[Knobs, int] = field(default_factory=dict)
    _seen: dict[Knobs, list[float]] = field(default_factory=dict)
    _dropped: set[Knobs] = field(default_factory=set)
    _descended: bool = False
    _final: dict[Knobs, int] = field(default_factory=dict)  # extra scored calls of the two finalists
    _raced: bool = False
    _trace: list[tuple[Knobs, float]] = field(default_factory=list)  # every observation, in order
    _race_from: int = 0  # where the race's observations begin in ``_trace``

    def __post_init__(self) -> None:
        self._order = self.space.order(self.first)[:self.budget.candidates]

    @staticmethod
    def committed(result: TuneResult) -> Tuning:
        """A tuning that is already done (a cached result)."""
        return Tuning(Space(), result=result)

    def next(self) -> Knobs:
        if self.result is not None:
            return self.result.winner
        open_ = [k for k in self._order if k not in self._dropped and self._issued.get(k, 0) < self._need(k)]
        if open_:
            k = self._in_round(open_)
            self._issued[k] = self._issued.get(k, 0) + 1
            return k
        best = self._best()  # waiting for the last time: run the best so far, scored too
        self._issued[best] = self._issued.get(best, 0) + 1
        return best

    def _in_round(self, open_: list[Knobs]) -> Knobs:
        """The next candidate of the current round (the fewest calls so far): round ``r``
        takes the candidates rotated by ``r``, reversed in odd rounds, so a slow spell of
        the host spreads over them all and none always runs right after the same
        neighbour (the call before moves a call's time)."""
        r = min(self._issued.get(k, 0) for k in open_)
        n = len(self._order)
        turn = [self._order[(i + r) % n] for i in range(n)]
        turn = turn[::-1] if r % 2 else turn
        return next(k for k in turn if k in open_ and self._issued.get(k, 0) == r)

    def observe(self, knobs: Knobs, seconds: float) -> None:
        if self.result is not None or not math.isfinite(seconds) or seconds < 0:
            return
        self.steps += 1
        self.seconds += seconds
        self._trace.append((knobs, seconds))
        seen = self._seen.setdefault(knobs, [])
        seen.append(seconds)
        scored = seen[self.budget.warmup:]
        judged = len(scored) >= min(SLOW_CALLS, self.budget.trials)
        if judged and min(scored) > self.budget.slow_factor * self._best_score():
            self._dropped.add(knobs)
        self._maybe_descend()
        self._maybe_race()
        self._extend_race()
        if self._pending() == 0 and self._all_issued():
            self.result = self._result()

    def _score(self, knobs: Knobs) -> float | None:
        scored = self._seen.get(knobs, [])[self.budget.warmup:]
        return min(scored) if scored else None

    def _best_score(self) -> float | None:
        scores = [s for k in self._order if (s := self._score(k)) is not None]
        return min(scores) if scores else None

    def _best(self) -> Knobs:
        ranked = self._ranked()
        return ranked[0] if ranked else self._order[0]

    def _ranked(self) -> list[Knobs]:
        """Scored candidates, fastest first (ties: the earlier in order)."""
        scored = [k for k in self._order if self._score(k) is not None]
        return sorted(scored, key=lambda k: (self._score(k), self._order.index(k)))

    def _pending(self) -> int:
        return sum(self._issued.values()) - self.steps

    def _need(self, knobs: Knobs) -> int:
        return self.budget.warmup + self.budget.trials + self._final.get(knobs, 0)

    def _all_issued(self) -> bool:
        return all(k in self._dropped or self._issued.get(k, 0) >= self._need(k) for k in self._order)

    def _maybe_race(self) -> None:
        """Once the search is done, the leader races a challenger (``_challenger``):
        ``Budget.final`` more scored calls each to begin with, alternating, extended by
        ``_extend_race`` (under a noisy host three calls cannot tell 10% apart)."""
        if self._raced or not self._descended or not self._all_issued() or self._pending():
            return
        self._raced = True
        ranked = self._ranked()
        challenger = self._challenger(ranked) if ranked else None
        if challenger is not None and self.budget.final > 0:
            self._final = {ranked[0]: self.budget.final, challenger: self.budget.final}
            self._race_from = len(self._trace)

    def _extend_race(self) -> None:
        """Once a race's calls are all in, one more call each while either finalist has run
        less than ``Budget.race_seconds`` in it (up to ``Budget.final_max`` calls each)."""
        if not self._final or self._pending() or not self._all_issued():
            return
        race = self._trace[self._race_from:]
        short = any(sum(t for k, t in race if k == f) < self.budget.race_seconds for f in self._final)
        if short and max(self._final.values()) < self.budget.final_max:
            self._final = {k: n + 1 for k, n in self._final.items()}

    def _challenger(self, ranked: list[Knobs]) -> Knobs | None:
        """Who races a leading taskflow: kernel by kernel when it is within
        ``Budget.close`` (a taskflow is chosen over the floor only when paired calls say
        it is faster too), else the runner-up when within ``Budget.close``; None: no race
        (a leading kernel by kernel among them)."""
        leader, kbk = ranked[0], KERNEL_BY_KERNEL_KNOBS
        if leader == kbk:
            return None

        def close(k: Knobs) -> bool:
            return self._score(k) < (1.0 + self.budget.close) * self._score(leader)
        if kbk in ranked and close(kbk):
            return kbk
        return ranked[1] if len(ranked) > 1 and close(ranked[1]) else None

    def _paired(self, first: Knobs, second: Knobs) -> float | None:
        """The median over the race's adjacent (first, second) call pairs, in either order,
        of second's time over first's; None without a pair.  A pair's two calls ran one
        after the other, so a slow spell of the host or the call before moves both: their
        ratio is what the race decides by, not each one's fastest call."""
        calls = [(k, t) for k, t in self._trace[self._race_from:] if k in (first, second)]
        ratios, i = [], 0
        while i + 1 < len(calls):
            (a, ta), (b, tb) = calls[i], calls[i + 1]
            if a != b and ta > 0 and tb > 0:
                ratios.append(tb / ta if a == first else ta / tb)
                i += 2
            else:
                i += 1
        return statistics.median(ratios) if ratios else None

    def _maybe_descend(self) -> None:
        """Once every candidate so far has its time, queue the leading taskflow's
        neighbours (``Space.neighbours``: one knob changed) not measured yet, while
        ``Budget.candidates`` leaves room: a descent one knob at a time from the default,
        which also finds changes that win only together (tiles of 256 rows may lose
        alone and win with per-rank dispatch).  Done when the leader's neighbours have
        all been measured."""
        if self._descended or not self._all_issued() or self._pending():
            return
        leader = next((k for k in self._ranked() if k.path is not Path.KERNEL_BY_KERNEL), None)
        new = [k for k in self.space.neighbours(leader) if k not in self._order] if leader else []
        room = self.budget.candidates - len(self._order)
        if new and room > 0:
            self._order.extend(new[:room])
        else:
            self._descended = True

    def _result(self) -> TuneResult:
        ranked = self._ranked()
        if not ranked:  # nothing scored (every time non-finite): the default order's head
            return TuneResult(self._order[0], math.nan, None, None, None, self.steps, self.seconds)
        win, up = ranked[0], (ranked[1] if len(ranked) > 1 else None)
        if self._final:  # the race's pairs decide between its leader and its challenger
            leader, challenger = self._final
            faster = (self._paired(leader, challenger) or 1.0) < 1.0
            win, up = (challenger, leader) if faster else (leader, challenger)
        return TuneResult(win, self._score(win), up, self._score(up) if up else None,
                          self._score(KERNEL_BY_KERNEL_KNOBS), self.steps, self.seconds)

    def digest(self) -> int:
        """A 31-bit digest of what this tuning has been told (ranks that were told the
        same times have the same digest): part of every call's agreement."""
        text = repr((sorted((k.name, v) for k, v in self._seen.items()),
                     self.result.winner.name if self.result else None))
        return zlib.crc32(text.encode()) >> 1
