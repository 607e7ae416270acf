"""The persistent kernel from plans made once per shape, serving every routing.

``PlanCache.program(key, ...)`` builds a ``SlotProgram`` the first time its ``PlanKey``
(the ``SlotShape``: tokens, MoE shape and dtype, tiles, EP; the triton options: policy,
workers, kernel config; the device; where the experts' rows are stored) is seen, and
returns the same program after: the per-shape forward graph (``regions.slots``), its
schedule, the packed arrays on the device and the arena are made once, and the
backward's (``regions.slot_backward``) on the first backward call, over the same arena.
A call (``SlotProgram.forward``, ``SlotProgram.backward``) then does, all on the device,
with no host read of the ids and no Python planning:

  1. ``phases.resolve_slots``: counts, each slot's expert and live rows, the permutation
     (on a GPU three launches, where torch's version takes 33 operations);
  2. ``SlotColumns.apply``: the routing's operand entries written into the device's task
     table (a slot task's rows and expert weight row, a weight gradient's first row and
     depth);
  3. the row indices (token of each slot row, slot row of each (token, j)) and, for the
     backward, each slot row's routing weight into the arena;
  4. bind the caller's tensors, upload their addresses and launch the kernel (on a GPU
     one launch, no host sync: ``SlotProgram.launch``, ``launch_backward``; ``forward``
     and ``backward`` also check the run, and are what the interpreter runs, in rounds).

Which columns a routing changes is derived from ``ops.describe`` itself (the one place
that says what a task reads), not restated here.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np
import torch

from .backend import TritonOptions, bind_experts, region_schedule
from .buffers import Arena, BufferSpace, slot_buffer_space
from .core import (
    ExpertWeights,
    Gradients,
    MoESpec,
    Routing,
    Schedule,
    SlotGradients,
    SlotPlan,
    SlotRouting,
    SlotShape,
    TileSpec,
    capturing,
    check_input,
    deprecated,
    live_rows,
    plan_slot_backward,
    plan_slots,
)
from .ops import NCOL, aligned_addresses, describe
from .pack import pack
from .phases import SLOT_ENTRIES, integers_launch, resolve_slots
from .runner import DeviceProgram, RunInfo, device_module


@dataclass(frozen=True)
class PlanKey:
    """Everything a per-shape program depends on; equal keys share one program.
    slot_rows, stored: the experts' rows in the stored weight tensors
    (``ExpertWeights.slot_rows``; None, 0: each expert its own)."""

    shape: SlotShape
    options: TritonOptions
    device: torch.device
    slot_rows: tuple[int, ...] | None = None
    stored: int = 0

    @staticmethod
    def of(x: torch.Tensor, weights: ExpertWeights, tiles: TileSpec, options: TritonOptions) -> PlanKey:
        """The key of a call on ``x`` [T, H] with ``weights`` under ``tiles`` and ``options``."""
        shape = SlotShape(moe=weights.spec, tokens=x.shape[0], tiles=tiles)
        return PlanKey(shape=shape, options=options, device=x.device, slot_rows=weights.slot_rows,
                       stored=weights.w13.shape[0])


@dataclass(frozen=True)
class SlotColumns:
    """The operand entries of the device's task table a routing writes, as device tensors.

    Every resolved task (a slot task or an expert task, ``SlotPlan``) has, this call, a
    first row, a number of rows and an expert; each operand entry that depends on them
    is ``base + per_row0 * row0 + per_rows * rows + per_read * read[expert]`` (read off
    ``ops.describe``: ``affine_columns``).  at [z]: flat index of each such entry in the
    task table; task [z]: its position among the resolved tasks; base, per_row0,
    per_rows, per_read [z].  Slot tasks (the first ``len(slot)``): slot, offset, cap,
    static row0; expert tasks (the rest): expert.  read [E]: ``BufferSpace.read``."""

    at: torch.Tensor
    task: torch.Tensor
    base: torch.Tensor
    per_row0: torch.Tensor
    per_rows: torch.Tensor
    per_read: torch.Tensor
    slot: torch.Tensor
    offset: torch.Tensor
    cap: torch.Tensor
    slot_row0: torch.Tensor
    expert: torch.Tensor
    read: torch.Tensor
    block: int

    @staticmethod
    def of(plan: SlotPlan, space: BufferSpace, device: torch.device) -> SlotColumns:
        st, et = plan.slot_tasks, plan.expert_tasks
        ids = np.concatenate([st.task, et.task])
        coef = affine_columns(plan, space)
        pos, col = np.nonzero(coef[1:].any(axis=0))

        def dev(a: np.ndarray) -> torch.Tensor:  # contiguous: a launch reads them flat
            return torch.as_tensor(np.ascontiguousarray(a, np.int64), device=device)

        return SlotColumns(at=dev(ids[pos] * NCOL + col), task=dev(pos),
                           **{n: dev(coef[i][pos, col]) for i, n in enumerate(_COEFFICIENTS)},
                           slot=dev(st.slot), offset=dev(st.offset), cap=dev(st.cap),
                           slot_row0=dev(plan.graph.row0[st.task]), expert=dev(et.expert),
                           read=dev(space.read[0]), block=plan.shape.tiles.gemm_rows)

    def apply(self, tasks: torch.Tensor, slots: SlotRouting, interpret: bool = False) -> None:
        """Write this call's entries (``slots``) into ``tasks`` [n, NCOL] int32: on a GPU
        in one launch (``device.slot_columns_kernel``; ``interpret``: in Triton's
        interpreter), elsewhere in torch, the same integers."""
        if integers_launch(tasks) or interpret:
            self._launch(tasks, slots, interpret)
            return
        live = live_rows(slots.slot_rows, self.slot, self.offset, self.cap)
        rows = torch.cat([live, slots.counts[self.expert]])
        row0 = torch.cat([self.slot_row0, slots.first[self.expert] * self.block])
        expert = torch.cat([slots.slot_expert[self.slot], self.expert])
        t = self.task
        value = (self.base + self.per_row0 * row0[t] + self.per_rows * rows[t]
                 + self.per_read * self.read[expert[t]])
        tasks.view(-1).index_put_((self.at,), value.int())

    def _launch(self, tasks: torch.Tensor, slots: SlotRouting, interpret: bool) -> None:
        entries = self.at.numel()
        if not entries:
            return
        expert = self.expert if self.expert.numel() else self.read  # never read: no expert tasks
        device_module(interpret).slot_columns_kernel[(-(-entries // SLOT_ENTRIES),)](
            tasks, self.at, self.task, self.base, self.per_row0, self.per_rows, self.per_read, self.slot,
            self.offset, self.cap, self.slot_row0, expert, self.read, slots.counts, slots.first,
            slots.slot_expert, slots.slot_rows, entries, self.slot.numel(), self.block, B=SLOT_ENTRIES)


_COEFFICIENTS = ("base", "per_row0", "per_rows", "per_read")


def affine_columns(plan: SlotPlan, space: BufferSpace) -> np.ndarray:
    """[4, m, NCOL] int64 (base, per row0, per rows, per read row) of every operand entry
    of the resolved tasks (slot tasks, then expert tasks), read off ``describe`` at
    probe points on a space whose expert e reads row e; checked at one more point
    (``describe`` must be affine in them)."""
    st, et, g = plan.slot_tasks, plan.expert_tasks, plan.graph
    ids = np.concatenate([st.task, et.task])
    experts = max(space.read.shape[1], 2)
    probe = dataclasses.replace(space, read=np.arange(experts, dtype=np.int64)[None])

    def at(row0: int, rows: int, expert: int) -> np.ndarray:
        r0, r1, e = g.row0.copy(), g.row1.copy(), g.expert.copy()
        r0[ids], r1[ids] = row0, row0 + rows
        e[st.task] = expert
        return describe(dataclasses.replace(g, row0=r0, row1=r1, expert=e), probe)[ids]

    origin = at(0, 1, 0)
    per_row0, per_rows, per_read = at(1, 1, 0) - origin, at(0, 2, 0) - origin, at(0, 1, 1) - origin
    base = origin - per_rows
    if not np.array_equal(at(3, 5, 1), base + 3 * per_row0 + 5 * per_rows + per_read):
        raise AssertionError("a resolved task's operand columns are not affine in its rows and expert")
    return np.stack([base, per_row0, per_rows, per_read])


@dataclass(frozen=True)
class SlotRun:
    """One call: out [T, H] spec.dtype, the routing as resolved, the run."""

    out: torch.Tensor
    slots: SlotRouting
    info: RunInfo | None


@dataclass(frozen=True)
class SlotLaunch:
    """One launched step: out [T, H] spec.dtype (written once the launch ends), the
    routing as resolved, and the program's error rows [Q, 4] int32 (read them after
    synchronising: a nonzero first column is a late wait)."""

    out: torch.Tensor
    slots: SlotRouting
    errors: torch.Tensor


class SlotProgram:
    """A per-shape forward region, and its backward, resident on one device (built once,
    by ``PlanCache``)."""

    def __init__(self, key: PlanKey, x: torch.Tensor, weights: ExpertWeights, routing: Routing):
        """Build for ``key``; the first call's tensors are bound while the workers are
        split by measuring on a GPU (``backend.region_schedule``)."""
        self.key = key
        space = slot_buffer_space(key.shape, key.slot_rows, key.stored)
        self.arena = Arena(space, key.shape.moe.dtype, key.device)
        self._resolved(routing)
        self._bind(x, weights, routing)
        self.forward_region = ResidentRegion.build(plan_slots(key.shape), self.arena, key.options)
        self.backward_region: ResidentRegion | None = None
        self.last: SlotRun | SlotLaunch | None = None  # the forward whose activations the arena holds
        self._table: tuple[np.ndarray, torch.Tensor] | None = None  # ``addresses``: host, device
        self._captured: list[tuple[np.ndarray, torch.Tensor]] = []  # tables a CUDA graph reads

    def _programs(self) -> list[DeviceProgram]:
        return [r.program for r in (self.forward_region, self.backward_region) if r is not None]

    @property
    def failed(self) -> bool:
        """Deprecated: always False (``DeviceProgram.failed``)."""
        deprecated("SlotProgram.failed", "every call starts its counters from zero: the next call runs "
                   "after a late wait")
        return False

    @property
    def captured(self) -> bool:
        """Whether a CUDA graph's capture launched it (its replays read its buffers)."""
        return bool(self._captured)

    def report(self) -> None:
        """Wait for the device and raise a late wait of a launch not reported yet."""
        for program in self._programs():
            program.report(wait=True)

    @property
    def plan(self) -> SlotPlan:
        """The forward's per-shape plan."""
        return self.forward_region.plan

    @property
    def program(self) -> DeviceProgram:
        """The forward's device program."""
        return self.forward_region.program

    def _resolved(self, routing: Routing) -> SlotRouting:
        """The call's routing resolved onto the slots, its row indices written into the
        arena on the way."""
        return resolve_slots(routing.ids, self.key.shape, into=(self.arena.rank_view("tok", 0),
                                                                 self.arena.rank_view("pos", 0)))

    def _bind(self, x: torch.Tensor, weights: ExpertWeights, routing: Routing) -> torch.Tensor:
        """Bind this call's tensors (its row indices are in the arena already); returns the
        output tensor bound."""
        a, x = self.arena, x.contiguous()
        out = torch.empty_like(x)  # rows laid out as x's now are: a strided x's would be strided too
        a.bind_all({"x": x, "out": out, "topk": routing.weights.contiguous()})
        if weights.has_shared:
            a.bind_all({"sw13": weights.shared_w13.contiguous(), "sw2": weights.shared_w2.contiguous()})
        bind_experts(a, {"w13": weights.w13.contiguous(), "w2": weights.w2.contiguous()}, weights)
        return out

    def prepare(self, x: torch.Tensor, weights: ExpertWeights,
                routing: Routing) -> tuple[torch.Tensor, SlotRouting]:
        """Everything a call does before the launch (steps 1-3 of the module and the
        binding): (the output tensor, the resolved routing).  The arena's activations
        stop being ``last``'s."""
        self.last = None
        slots = self._resolved(routing)
        self.forward_region.columns.apply(self.program.arrays["tasks"], slots)
        return self._bind(x, weights, routing), slots

    def addresses(self, program: DeviceProgram | None = None) -> tuple[torch.Tensor, bool]:
        """(the bound buffers' addresses [num_buffers] int64 on the device, whether
        ``program``'s aligned variant may run; default the forward's), from host
        addresses alone.  The device's table is uploaded again only when an address
        changed (the caching allocator mostly hands a step's tensors the blocks of the
        step before).  A table a CUDA graph's capture used is kept as long as the
        program: its replays read it."""
        program = self.program if program is None else program
        host = self.arena.host_addresses()
        aligned = program.aligned and aligned_addresses(program.packed.tasks, host)
        if self._table is None or not np.array_equal(host, self._table[0]):
            self._table = host, _uploaded(host, self.key.device)
        if capturing(self.key.device):
            self._captured.append(self._table)
        return self._table[1], aligned

    def launch(self, x: torch.Tensor, weights: ExpertWeights, routing: Routing) -> SlotLaunch:
        """One step: ``prepare``, then the kernel's one launch, with no host read of the
        device and no synchronisation (``DeviceProgram.launch``: an earlier launch's late
        wait raised one launch late; in the interpreter, rounds); the caller checks x and
        routing (``routing.check_input``) where it wants to.  The arena holds its
        activations (``last``) until the next forward."""
        out, slots = self.prepare(x, weights, routing)
        addresses, aligned = self.addresses()
        errors = self.program.launch(addresses, aligned, self.key.options.deadline_s)
        self.last = SlotLaunch(out=out, slots=slots, errors=errors)
        return self.last

    def forward(self, x: torch.Tensor, weights: ExpertWeights, routing: Routing,
                checked: bool = False) -> SlotRun:
        """The forward output of this call, the run checked (on a GPU: synchronised and
        its late waits raised, ``DeviceProgram.run``).  x [T, H] spec.dtype, routing [T, k]
        on the program's device; checked: the caller checked x and routing."""
        if not checked:
            check_input(x, routing, weights.spec)
        out, slots = self.prepare(x, weights, routing)
        info = self.program.run(self.arena.addresses(), deadline_s=self.key.options.deadline_s)
        self.last = SlotRun(out=out, slots=slots, info=info)
        return self.last

    def backward(self, run: SlotRun, dy: torch.Tensor, weights: ExpertWeights,
                 routing: Routing) -> SlotBackwardRun:
        """The backward region after ``run``, this program's last forward call (the arena
        holds its activations), with the same ``weights`` and ``routing``: dy [T, H]
        spec.dtype.  The backward region is built on the first call (once per program);
        every output starts as NaN, so a row no task wrote shows."""
        if dy.shape != run.out.shape or dy.dtype != run.out.dtype or dy.device != run.out.device:
            raise ValueError(f"dy must be {tuple(run.out.shape)} {run.out.dtype} on {run.out.device}, got "
                             f"{tuple(dy.shape)} {dy.dtype} on {dy.device}")
        experts, dx, dweights = self.prepare_backward(dy, weights, routing, run.slots)
        deadline = self.key.options.deadline_s
        info = self.backward_region.program.run(self.arena.addresses(), deadline_s=deadline)
        return SlotBackwardRun(grads=self._gradients(experts, dx, dweights, weights), info=info)

    def launch_backward(self, launched: SlotLaunch, dy: torch.Tensor, weights: ExpertWeights,
                        routing: Routing) -> SlotBackwardLaunch:
        """The backward after ``launched`` (this program's last forward launch) as one
        launch on a GPU without a host read or a synchronisation; the gradients are
        written once the launch ends (the expert rows' replicas folded in by the
        stream's later operations).  Its outputs start uninitialised: ``backward``, whose
        outputs start as NaN, shows that its tasks write every element."""
        experts, dx, dweights = self.prepare_backward(dy, weights, routing, launched.slots, poison=False)
        program = self.backward_region.program
        addresses, aligned = self.addresses(program)
        errors = program.launch(addresses, aligned, self.key.options.deadline_s)
        return SlotBackwardLaunch(grads=self._gradients(experts, dx, dweights, weights), errors=errors)

    def prepare_backward(self, dy: torch.Tensor, weights: ExpertWeights, routing: Routing,
                         slots: SlotRouting, poison: bool = True
                         ) -> tuple[SlotGradients, torch.Tensor, torch.Tensor]:
        """Everything a backward call does before its launch: bind dy, the outputs and the
        expert gradients (``poison``: filled with NaN, else uninitialised), each slot
        row's routing weight into ``roww``, the routing's entries into the backward's task
        table (the region built on the first call).  Returns (the expert gradients, dx,
        dweights)."""
        if weights.spec.expert_bias:
            raise ValueError("a per-shape backward has no expert-bias gradients (MoESpec.expert_bias)")
        bound = self._bind_backward(dy, weights, routing, slots, poison)
        if self.backward_region is None:
            self.backward_region = ResidentRegion.build(plan_slot_backward(self.key.shape), self.arena,
                                                        self.key.options)
        region = self.backward_region
        region.columns.apply(region.program.arrays["tasks"], slots)
        return bound

    def _gradients(self, experts: SlotGradients, dx: torch.Tensor, dweights: torch.Tensor,
                   weights: ExpertWeights) -> Gradients:
        """The call's ``Gradients`` once its backward ran (or is queued to run)."""
        if weights.slot_rows is not None:  # every expert has tasks: only stored rows no slot reads
            experts.zero_idle([True] * weights.spec.experts)
            experts.fold()
        shared = [self.arena.rank_view(n, 0).clone() if weights.has_shared else None
                  for n in ("dsw13", "dsw2")]
        self.arena.unbind(["dy", "dx", "dweights", *experts.full, *(f"{n}x" for n in experts.scratch)])
        return Gradients(dx=dx, dweights=dweights, dw13=experts.full["dw13"], dw2=experts.full["dw2"],
                         dshared_w13=shared[0], dshared_w2=shared[1])

    def _bind_backward(self, dy: torch.Tensor, weights: ExpertWeights, routing: Routing, slots: SlotRouting,
                       poison: bool) -> tuple[SlotGradients, torch.Tensor, torch.Tensor]:
        """Bind dy, the outputs and the expert gradients (``poison``: NaN); each slot
        row's routing weight into ``roww``.  Returns (the expert gradients, dx, dweights)."""
        a, nan = self.arena, float("nan") if poison else None
        dx, dweights = torch.empty_like(dy), torch.empty(dy.shape[0], weights.spec.top_k, device=dy.device)
        if nan is not None:
            dx.fill_(nan)
            dweights.fill_(nan)
        a.bind_all({"dy": dy.contiguous(), "dx": dx, "dweights": dweights})
        roww = a.rank_view("roww", 0).view(-1)
        roww.index_put_((slots.pos.reshape(-1),), routing.weights.reshape(-1).float())
        grads = SlotGradients.of(weights, slice(None), fill=nan)
        bind_experts(a, grads.full, weights)
        if weights.slot_rows is not None:  # later replicas' gradients, folded in afterwards
            for name, t in grads.scratch.items():
                a.bind_shared(f"{name}x", t)
        return grads, dx, dweights


def _uploaded(host: np.ndarray, device: torch.device) -> torch.Tensor:
    """``host`` (int64, never written again) on ``device`` without waiting: on a GPU from
    pinned memory (a copy from pageable memory would synchronise the stream), except
    under a graph's capture, which records a copy from ``host`` itself (kept by the
    caller for the replays) and no pinned allocation."""
    staged = torch.from_numpy(host)
    if device.type != "cuda":
        return staged
    return (staged if capturing(device) else staged.pin_memory()).to(device, non_blocking=True)


@dataclass(frozen=True)
class SlotBackwardRun:
    """One backward call: the gradients (``Gradients``: dx [T, H], dweights [T, k]
    float32, expert and shared weights' gradients; every expert's, zero where it got no
    rows) and the run."""

    grads: Gradients
    info: RunInfo


@dataclass(frozen=True)
class SlotBackwardLaunch:
    """One launched backward: the gradients (written once the launch ends) and the
    backward program's error rows [Q, 4] int32 (read after synchronising)."""

    grads: Gradients
    errors: torch.Tensor


@dataclass(frozen=True)
class ResidentRegion:
    """A per-shape region on the device: its plan, the entries a routing writes, its
    schedule and device program."""

    plan: SlotPlan
    columns: SlotColumns
    schedule: Schedule
    program: DeviceProgram

    @staticmethod
    def build(plan: SlotPlan, arena: Arena, options: TritonOptions) -> ResidentRegion:
        """Schedule and pack ``plan`` over ``arena``'s buffers (the call's bound: on a GPU
        the workers are split by running it, ``backend.region_schedule``)."""
        tasks = describe(plan.graph, arena.space)
        sched = region_schedule(plan.graph, tasks, options, arena)
        program = DeviceProgram(pack(sched, arena.space, tasks), arena.device, arena.dtype, options.config)
        columns = SlotColumns.of(plan, arena.space, arena.device)
        return ResidentRegion(plan=plan, columns=columns, schedule=sched, program=program)


PROGRAMS_KEPT = 4  # a layer's per-shape programs at most (each holds an arena sized for its shape)


class PlanCache:
    """Per-shape programs by ``PlanKey``, each built once while it is among the ``kept``
    most recently used (a layer called with ever new token counts would otherwise keep an
    arena for each).  A program a CUDA graph's capture launched is kept as long as the
    cache once dropped, since the graph's replays read its buffers.  builds: programs
    built."""

    def __init__(self, kept: int = PROGRAMS_KEPT) -> None:
        if kept < 1:
            raise ValueError(f"PlanCache: kept={kept}, expected at least 1")
        self.kept = kept
        self._programs: dict[PlanKey, SlotProgram] = {}  # least recently used first
        self._captured: list[SlotProgram] = []  # dropped programs that a graph reads
        self.builds = 0

    def program(self, x: torch.Tensor, weights: ExpertWeights, routing: Routing, tiles: TileSpec,
                options: TritonOptions) -> SlotProgram:
        """The program of this call's key, built on the first call with it (and again
        once it was dropped for newer ones)."""
        key = PlanKey.of(x, weights, tiles, options)
        found = self._programs.pop(key, None)
        if found is None:
            found = SlotProgram(key, x, weights, routing)
            self.builds += 1
        self._programs[key] = found
        while len(self._programs) > self.kept:  # a call still holding a dropped one keeps it alive
            dropped = self._programs.pop(next(iter(self._programs)))
            if dropped.captured:
                self._captured.append(dropped)
        return found

    def report(self) -> None:
        """Wait for the device and raise a late wait of any program's launch not reported
        yet (``SlotProgram.report``), a dropped one's that a graph still replays too."""
        for program in (*self._programs.values(), *self._captured):
            program.report()


@functools.cache  # asked at every call of the persistent path
def per_shape(spec: MoESpec, ep: int, tiles: TileSpec) -> bool:
    """Whether a per-shape program computes this layer's calls: one rank, per-expert
    dispatch, slots of whole row chunks (``SlotShape``), the plain gate without expert
    biases (what its backward computes)."""
    try:
        SlotShape(spec, 1, tiles, ep)
    except ValueError:
        return False
    return not spec.expert_bias and spec.glu.plain


def slot_forward(x: torch.Tensor, weights: ExpertWeights, routing: Routing, cache: PlanCache,
                 tiles: TileSpec, options: TritonOptions | None = None) -> SlotRun:
    """The forward MoE region (one rank) as one persistent kernel on ``x.device`` from
    ``cache``'s per-shape program: x [T, H] spec.dtype, routing [T, k]; GLU without
    expert biases, as ``backend.triton_forward``."""
    spec = weights.spec
    check_input(x, routing, spec)
    if spec.expert_bias or not spec.glu.plain:
        raise ValueError(f"the persistent kernel computes act(gate) * up without expert biases; got "
                         f"MoESpec.expert_bias={spec.expert_bias}, MoESpec.glu={spec.glu}")
    return cache.program(x, weights, routing, tiles, options or TritonOptions()).forward(x, weights, routing,
                                                                                          checked=True)
