"""The persistent kernel from a plan made once per shape, serving every routing.

``PlanCache.program(key, ...)`` builds a ``SlotProgram`` the first time its ``PlanKey``
(the ``SlotShape``: tokens, MoE shape and dtype, tiles, EP; the triton options: policy,
workers, kernel config; the device; where the experts' rows are stored) is seen, and
returns the same program after: the per-shape graph (``regions.slots``), its schedule,
the packed arrays on the device and the arena are made once.  A call
(``SlotProgram.forward``) then does, all on the device, with no host read of the ids
and no Python planning:

  1. ``resolve_slots``: counts, each slot's expert and live rows, the permutation;
  2. ``SlotColumns.apply``: the routing's operand entries written into the device's task
     table, each slot task's M (its live rows) and each expert GEMM's weight row;
  3. the row indices (token of each slot row, slot row of each (token, j)) into the arena;
  4. bind the caller's tensors, upload their addresses and launch the kernel (on a GPU
     one launch, no host sync: ``SlotProgram.launch``; ``forward`` also checks the run,
     and is what the interpreter runs, in rounds).

Which columns a routing changes is derived from ``ops.describe`` itself (the one place
that says what a task reads), not restated here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from .backend import TritonOptions, bind_experts, region_schedule
from .buffers import Arena, slot_buffer_space
from .core import (
    ExpertWeights,
    Routing,
    SlotPlan,
    SlotRouting,
    SlotShape,
    TileSpec,
    check_input,
    live_rows,
    plan_slots,
    resolve_slots,
)
from .ops import COL, NCOL, aligned_addresses, describe
from .pack import pack
from .runner import DeviceProgram, RunInfo


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
    """The operand entries of the device's task table a routing writes, as device
    tensors.  m_at [m]: flat index of each slot task's M; slot, offset, cap [m]: its
    slot, first row in it and rows at most (``SlotTasks``); b_at [g]: flat index of each
    expert GEMM's weight row, b_slot [g] its slot, and that row is
    ``b_base + read[expert] * b_stride`` ([g] each; read [E]: ``BufferSpace.read``)."""

    m_at: torch.Tensor
    slot: torch.Tensor
    offset: torch.Tensor
    cap: torch.Tensor
    b_at: torch.Tensor
    b_slot: torch.Tensor
    b_base: torch.Tensor
    b_stride: torch.Tensor
    read: torch.Tensor

    @staticmethod
    def of(plan: SlotPlan, read: np.ndarray, weight_rows: tuple[np.ndarray, np.ndarray],
           device: torch.device) -> SlotColumns:
        st = plan.slot_tasks
        gemm = st.task[st.expert_gemm]
        base, stride = weight_rows

        def dev(a: np.ndarray) -> torch.Tensor:
            return torch.as_tensor(np.asarray(a, np.int64), device=device)

        return SlotColumns(m_at=dev(st.task * NCOL + COL["m"]), slot=dev(st.slot), offset=dev(st.offset),
                           cap=dev(st.cap), b_at=dev(gemm * NCOL + COL["b_row"]),
                           b_slot=dev(st.slot[st.expert_gemm]),
                           b_base=dev(base), b_stride=dev(stride), read=dev(read))

    def apply(self, tasks: torch.Tensor, slots: SlotRouting) -> None:
        """Write ``slots``' live rows and weight rows into ``tasks`` [n, NCOL] int32."""
        flat = tasks.view(-1)
        flat.index_put_((self.m_at,), live_rows(slots.slot_rows, self.slot, self.offset, self.cap).int())
        expert = slots.slot_expert[self.b_slot]
        flat.index_put_((self.b_at,), (self.b_base + self.read[expert] * self.b_stride).int())


def weight_rows(plan: SlotPlan, space: object) -> tuple[np.ndarray, np.ndarray]:
    """(base, stride) [g] of each expert GEMM of ``plan``: its weight row is
    ``base + read[expert] * stride``.  Read off ``describe`` on a probe space whose
    experts 0 and 1 read rows 0 and 1; ``describe`` must change nothing else with the
    expert (checked)."""
    st, g = plan.slot_tasks, plan.graph
    probe = dataclasses.replace(space, read=np.array([[0, 1]], np.int64))
    rows = []
    for e in (0, 1):
        expert = g.expert.copy()
        expert[st.task] = e
        rows.append(describe(dataclasses.replace(g, expert=expert), probe)[st.task])
    changed = np.flatnonzero((rows[0] != rows[1]).any(axis=0))
    if not set(changed.tolist()) <= {COL["b_row"]}:
        raise AssertionError(f"a slot task's operand columns {changed.tolist()} depend on its expert")
    b = COL["b_row"]
    return rows[0][st.expert_gemm, b], (rows[1] - rows[0])[st.expert_gemm, b]


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
    """A per-shape forward region resident on one device (built once, by ``PlanCache``)."""

    def __init__(self, key: PlanKey, x: torch.Tensor, weights: ExpertWeights, routing: Routing):
        """Build for ``key``; the first call's tensors are bound while the workers are
        split by measuring on a GPU (``backend.region_schedule``)."""
        self.key = key
        self.plan = plan_slots(key.shape)
        space = slot_buffer_space(key.shape, key.slot_rows, key.stored)
        self.arena = Arena(space, key.shape.moe.dtype, key.device)
        for name in ("tok", "pos"):  # valid rows until the first call resolves them
            self.arena.rank_view(name, 0).zero_()
        tasks = describe(self.plan.graph, space)
        self.columns = SlotColumns.of(self.plan, space.read[0], weight_rows(self.plan, space), key.device)
        self._bind(x, weights, routing, resolve_slots(routing.ids, key.shape))
        self.schedule = region_schedule(self.plan.graph, tasks, key.options, self.arena)
        self.program = DeviceProgram(pack(self.schedule, space, tasks), key.device, key.shape.moe.dtype,
                                     key.options.config)

    def _bind(self, x: torch.Tensor, weights: ExpertWeights, routing: Routing,
              slots: SlotRouting) -> torch.Tensor:
        """Bind this call's tensors and row indices; returns the output tensor bound."""
        a = self.arena
        a.rank_view("tok", 0).copy_(slots.row_token.view(-1, 1))
        a.rank_view("pos", 0).copy_(slots.pos)
        out = torch.empty_like(x)
        a.bind_all({"x": x.contiguous(), "out": out, "topk": routing.weights.contiguous()})
        if weights.has_shared:
            a.bind_all({"sw13": weights.shared_w13.contiguous(), "sw2": weights.shared_w2.contiguous()})
        bind_experts(a, {"w13": weights.w13.contiguous(), "w2": weights.w2.contiguous()}, weights)
        return out

    def prepare(self, x: torch.Tensor, weights: ExpertWeights,
                routing: Routing) -> tuple[torch.Tensor, SlotRouting]:
        """Everything a call does before the launch (steps 1-3 of the module and the
        binding): (the output tensor, the resolved routing)."""
        slots = resolve_slots(routing.ids, self.key.shape)
        self.columns.apply(self.program.arrays["tasks"], slots)
        return self._bind(x, weights, routing, slots), slots

    def addresses(self) -> tuple[torch.Tensor, bool]:
        """(the bound buffers' addresses [num_buffers] int64 on the device, whether the
        aligned kernel variant may run), from host addresses alone: on a GPU copied
        from pinned memory without waiting (a copy from pageable memory would
        synchronise the stream)."""
        host = self.arena.host_addresses()
        aligned = self.program.aligned and aligned_addresses(self.program.packed.tasks, host)
        staged = torch.from_numpy(host)
        if self.key.device.type != "cuda":
            return staged, aligned
        return staged.pin_memory().to(self.key.device, non_blocking=True), aligned

    def launch(self, x: torch.Tensor, weights: ExpertWeights, routing: Routing) -> SlotLaunch:
        """One step on a GPU: ``prepare``, then the kernel's one launch, with no host
        read of the device and no synchronisation (``DeviceProgram.launch``); the
        caller checks x and routing (``routing.check_input``) where it wants to."""
        out, slots = self.prepare(x, weights, routing)
        addresses, aligned = self.addresses()
        errors = self.program.launch(addresses, aligned, self.key.options.deadline_s)
        return SlotLaunch(out=out, slots=slots, errors=errors)

    def forward(self, x: torch.Tensor, weights: ExpertWeights, routing: Routing,
                checked: bool = False) -> SlotRun:
        """The forward output of this call, the run checked (on a GPU: synchronised and
        its late waits raised, ``DeviceProgram.run``).  x [T, H] spec.dtype, routing [T, k]
        on the program's device; checked: the caller checked x and routing."""
        if not checked:
            check_input(x, routing, weights.spec)
        out, slots = self.prepare(x, weights, routing)
        info = self.program.run(self.arena.addresses(), deadline_s=self.key.options.deadline_s)
        return SlotRun(out=out, slots=slots, info=info)


class PlanCache:
    """Per-shape programs by ``PlanKey``, each built once.  builds: programs built."""

    def __init__(self) -> None:
        self._programs: dict[PlanKey, SlotProgram] = {}
        self.builds = 0

    def program(self, x: torch.Tensor, weights: ExpertWeights, routing: Routing, tiles: TileSpec,
                options: TritonOptions) -> SlotProgram:
        """The program of this call's key, built on the first call with it."""
        key = PlanKey.of(x, weights, tiles, options)
        found = self._programs.get(key)
        if found is None:
            found = self._programs[key] = SlotProgram(key, x, weights, routing)
            self.builds += 1
        return found


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
