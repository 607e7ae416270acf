"""``RegionOptions``: how a region call runs — one process or an EP group, the schedule
(AUTO, a policy, a task order), tiles, recompute, backend, AUTO's cost model — checked
once, naming the field and its value.  ``engine.select`` reads it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch.distributed as dist

from ..exec.backend import Backend, as_backend
from ..exec.exact import DEFAULT_TILES
from ..ir.schedule import SchedulePolicy
from ..regions.family import RegionFamily, region_family
from ..sim.hardware import HardwareModel
from ..sim.presets import cpu_nominal
from ..spec import Recompute, TileSpec, as_recompute, require_per_expert
from .check import CheckMode, as_check_mode

if TYPE_CHECKING:  # the runtime is imported on first distributed use, never by ``import hpmoe``
    from ..runtime import RuntimeConfig, Session


@dataclass(frozen=True)
class RegionOptions:
    """How the region runs.

    ep_group: None (one process); a torch.distributed process group of the EP ranks
      (the layer opens a runtime ``Session`` on it at its first forward, configured by
      ``runtime``); or a runtime ``Session`` shared between layers.
    virtual_ep: EP ranks simulated in one process (must be 1 with an ep_group).
    schedule: ``SchedulePolicy.AUTO`` (default).  With an ep_group and no ``hardware``,
      AUTO measures (``schedule.tune``): per key (machine, layer, EP group and network,
      dtype, tokens per rank to a power of two, with or without backward) the first calls
      try the candidates — the kernel-by-kernel path (``exec.kernel_by_kernel``: grouped
      GEMMs per phase, all-to-all over the ep_group) and the taskflow under each schedule
      policy, worker split, tile rows and dispatch mode (tiles only when left at their
      default) — every call a real step; the slowest rank's times decide, every rank runs
      the same winner from then on, and the choice is saved in the tuning cache
      (``hpmoe tune --show``) for later processes; see ``MoE.tuned``.  Candidates differ
      in rounding only by path and dispatch mode, so bits can differ between runs until
      the choice is cached: pin ``schedule`` for bitwise-reproducible runs.  With
      ``hardware`` (or in one process), whichever of the taskflow and the kernel-by-kernel
      path is forecast faster on ``hardware`` (else the calibrated profile of
      ``hpmoe calibrate``; in one process with neither, the kernel-by-kernel path); see
      ``MoE.decision``.  Otherwise the taskflow: with an ep_group, the runtime's
      ``SchedulePolicy`` (None: HYPERPARALLEL); in one process, the exact executors' task
      order: None (task-id order), an int seeding a random valid order, or the task ids
      in order (``moe_forward``'s ``order``) — every order
      gives the same bits.  Under ``torch.compile`` (one process) AUTO decides on the saved
      profile alone (``engine.compiled``).
    recompute: what a call's backward computes again instead of keeping it from the forward
      (``spec.Recompute``): ``"permutation"`` (default) keeps the layer input, the routing
      and the experts' pre-activation, the least that cannot be recomputed cheaply;
      ``"nothing"`` also keeps the gathered rows (a taskflow: the gated activation too);
      ``"gemm"`` keeps the input alone and recomputes the first GEMM.  True and False, its
      former values, mean "permutation" and "nothing".
    tiles: the tiling of the taskflow, its ``dispatch`` included: ``DispatchMode.PER_RANK``
      and ``PER_NODE`` run the deduplicated forward and backward regions (exact executors
      in one process, the runtime with an ep_group; gradients equal the per-expert ones but
      for dx, summed per rank first as ``refs.rank_partials_sum`` does).  The tiles describe
      the taskflow only: AUTO still picks the path (forecasting the deduplicated taskflow,
      on one node) and the kernel-by-kernel path ignores them.
    nodes: nodes the EP ranks span (``virtual_ep`` or the ep_group's size a multiple of
      it); only ``DispatchMode.PER_NODE`` relays between them.
    runtime: ``RuntimeConfig`` of the session the layer opens.
    hardware: the cost model of AUTO and of the CRITICAL_PATH scheduler.
    rebalance_every: every that many training calls (grad mode on), ``MoE.rebalance``
      with ``redundant`` extra replicas (0: never; a collective over the ep_group).
    shard_experts: with an ep_group, each rank stores only its own slots' expert rows
      (``MoE(spec)`` layers): 1/EP of the expert memory, and a new placement moves rows
      between ranks with their optimizer state (``MoE.move_to``, ``hpmoe.migration``).
      It stores ``redundant`` extra slots from the start (spares: second copies of an
      expert on its own rank, until ``rebalance`` spreads as many as pay as replicas), so
      its parameters never change shape.
      Default False: every rank keeps full-size tensors (state dicts as transformers').
    backend: in one process, ``"exact"`` (torch kernels) or ``"triton"`` (each region one
      persistent Triton kernel on the input's device; ``schedule`` is then a
      ``SchedulePolicy``, AUTO and None meaning HYPERPARALLEL), or ``"auto"``: the first
      calls of each shape time the kernel-by-kernel path and the persistent kernel under
      each policy (``schedule.tune.DeviceSpace``; on CUDA each call waited for), every
      call a real step, and the fastest runs from then on (``MoE.tuned``; saved in the
      tuning cache).  Per-expert tiles, a plain gated activation, no expert biases.
      ``"kernel_by_kernel"``, in one process or with an ep_group: the region without
      tiles (``exec.kernel_by_kernel``), pinned — what AUTO may choose, chosen by the
      user; ``schedule`` and ``tiles`` are then not read (but fingerprinted).
    check: when a call's input verdict (NaN/inf rows of x, expert ids out of range,
      non-finite routing weights; scanned on the input's device once a call) is read:
      ``"deferred"`` (default) at the next call or ``layer.check()``, raising the same
      named error one call late without a host sync in the call; ``"sync"`` in the call
      itself (``engine.check.CheckMode``).  On an EP group every call reads it at once
      for the agreement.
    offload: the activations a call keeps for its backward (the experts' pre-activation
      and, where kept, the rows an EP group received) wait for it in host memory (pinned,
      copied on a side stream; each backward brings back the one before it while it
      runs, ``engine.offload``).  On a CPU it moves nothing and warns so; the
      persistent kernel keeps its activations in its arena, and kernel by kernel's
      ``recompute="gemm"`` keeps nothing but the input, so neither sends anything.
      Default False.
    """

    ep_group: Any = None
    virtual_ep: int = 1
    schedule: SchedulePolicy | int | np.ndarray | None = SchedulePolicy.AUTO
    recompute: Recompute | bool | str = Recompute.PERMUTATION
    tiles: TileSpec = DEFAULT_TILES
    runtime: RuntimeConfig | None = None
    hardware: HardwareModel | None = None
    backend: Backend | str = Backend.EXACT
    nodes: int = 1
    rebalance_every: int = 0
    redundant: int = 0
    shard_experts: bool = False
    check: CheckMode | str = CheckMode.DEFERRED
    offload: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "backend", as_backend(self.backend))
        object.__setattr__(self, "check", as_check_mode(self.check))
        for name in ("rebalance_every", "redundant"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if not isinstance(self.virtual_ep, int) or isinstance(self.virtual_ep, bool) or self.virtual_ep <= 0:
            raise ValueError(f"virtual_ep must be a positive int, got {self.virtual_ep!r}")
        object.__setattr__(self, "recompute", as_recompute(self.recompute))
        if not isinstance(self.tiles, TileSpec):
            raise TypeError(f"tiles must be a TileSpec, got {type(self.tiles).__name__}")
        if not isinstance(self.nodes, int) or isinstance(self.nodes, bool) or self.nodes <= 0:
            raise ValueError(f"nodes must be a positive int, got {self.nodes!r}")
        for name in ("shard_experts", "offload"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.runtime is not None:
            from ..runtime import RuntimeConfig

            if not isinstance(self.runtime, RuntimeConfig):
                raise TypeError(f"runtime must be a RuntimeConfig, got {type(self.runtime).__name__}")
        if self.hardware is not None and not isinstance(self.hardware, HardwareModel):
            raise TypeError(f"hardware must be a HardwareModel, got {type(self.hardware).__name__}")
        if self.distributed:
            self._check_distributed()
        else:
            self._check_single_process()

    def _check_distributed(self) -> None:
        if self.backend not in (Backend.EXACT, Backend.KERNEL_BY_KERNEL):
            raise ValueError(f"backend={self.backend.value!r} runs in one process, without an ep_group")
        if self.virtual_ep != 1:
            raise ValueError(f"virtual_ep={self.virtual_ep} cannot be combined with an ep_group")
        if self.schedule is not None and not isinstance(self.schedule, SchedulePolicy):
            raise ValueError(f"schedule={self.schedule!r}: with an ep_group, schedule is a SchedulePolicy")
        if self.session is not None and self.runtime is not None:
            raise ValueError("runtime configures a session the layer opens; ep_group is already a Session")
        if self.shard_experts and self.rebalance_every:
            raise ValueError(f"rebalance_every={self.rebalance_every} with shard_experts: a move carries the "
                             "optimizer state, so call layer.rebalance(optimizer=...) between steps")
        config = self.session.config if self.session is not None else self.runtime
        if self.shard_experts and config is not None and config.check_weights:
            raise ValueError("shard_experts with RuntimeConfig.check_weights: the ranks store different "
                             "experts, so their weights cannot be checksummed alike")

    def _check_single_process(self) -> None:
        if self.shard_experts:
            raise ValueError("shard_experts=True needs an ep_group (one process stores every expert)")
        if self.backend is Backend.KERNEL_BY_KERNEL:
            if self.runtime is not None:
                raise ValueError("runtime configures the multi-rank runtime: it needs an ep_group")
            return
        if self.backend is Backend.AUTO:
            require_per_expert(self.tiles, "backend='auto' (the persistent kernel is a candidate)")
            fixed = self.hardware is not None or self.runtime is not None
            if self.schedule is not SchedulePolicy.AUTO or fixed:
                raise ValueError(f"backend='auto' measures its own choice: schedule must be AUTO "
                                 f"(got {self.schedule!r}), without hardware or runtime")
            return
        if self.backend is Backend.TRITON:
            require_per_expert(self.tiles, "the triton backend")
            if self.schedule is not None and not isinstance(self.schedule, SchedulePolicy):
                raise ValueError(f"schedule={self.schedule!r}: the triton backend takes a SchedulePolicy")
            if self.runtime is not None:
                raise ValueError("runtime configures the multi-rank runtime, not the triton backend")
            return
        seed = (isinstance(self.schedule, int | np.ndarray | list | tuple)
                and not isinstance(self.schedule, bool))
        auto = self.schedule is SchedulePolicy.AUTO
        if self.schedule is not None and not seed and not auto:
            raise ValueError(f"schedule={self.schedule!r}: in one process, schedule is AUTO, None or an "
                             "int seed (other scheduling policies need an ep_group)")
        if self.runtime is not None:
            raise ValueError("runtime configures the multi-rank runtime: it needs an ep_group")
        if self.hardware is not None and not auto:
            raise ValueError(f"hardware is AUTO's cost model in one process: schedule={self.schedule!r} "
                             "runs the taskflow without one")

    def __deepcopy__(self, memo: dict) -> RegionOptions:
        """Itself: options are frozen, and a copied layer runs on the same EP group (a
        communication handle, not state; a process group cannot be copied)."""
        return self

    @property
    def distributed(self) -> bool:
        return self.ep_group is not None

    @property
    def regions(self) -> RegionFamily:
        """The region family the taskflow runs (per expert, or deduplicated)."""
        return region_family(self.tiles)

    @property
    def session(self) -> Session | None:
        """``ep_group`` when it is a runtime ``Session`` shared between layers."""
        if not self.distributed:
            return None
        from ..runtime import Session

        return self.ep_group if isinstance(self.ep_group, Session) else None

    @property
    def rank_hardware(self) -> HardwareModel:
        """The rank's hardware model on the runtime (default ``cpu_nominal()``)."""
        return self.hardware if self.hardware is not None else cpu_nominal()

    @property
    def ranks(self) -> int:
        """EP ranks: the ep_group's size, else ``virtual_ep``."""
        return dist.get_world_size(self.group) if self.distributed else self.virtual_ep

    @property
    def group(self) -> Any:
        """The torch.distributed group of the EP ranks (None in one process)."""
        session = self.session
        return session.group if session is not None else self.ep_group

