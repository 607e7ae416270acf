"""``select``: the one place that chooses a region call's path (``engine.paths``) — what
``RegionOptions`` fixes, or AUTO's choice.  AUTO with an ep_group and no explicit
hardware model measures (``schedule.tune``, every rank in step through the call's
agreement); otherwise it forecasts on a model (``hardware``, else the saved cpu
profile; in one process with neither, the kernel-by-kernel path).  ``Auto`` is a
caller's memory of it: the layer keeps one, one-process callers share the process's."""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from ..deprecation import deprecated
from ..exec.arena import ArenaPool
from ..exec.backend import Backend
from ..exec.exact import DEFAULT_TILES
from ..exec.phases import TORCH, Phases
from ..ir.schedule import SchedulePolicy
from ..schedule.auto import PROCESS_DECISIONS, AutoDecision, DecisionCache, Path, RoutingShape, saved_profile
from ..schedule.tune import DeviceSpace, Knobs, Space, TuneKey, TuneResult
from ..schedule.tuner import OneProcess, Trial, Tuner
from ..sim.hardware import HardwareModel
from ..sim.presets import cpu_nominal
from ..spec import MoESpec, TileSpec
from .options import RegionOptions
from .paths import ExactPath, KernelByKernelPath, RegionPath, RuntimePath, TritonPath

if TYPE_CHECKING:
    from ..runtime import Session

_UNREAD = object()  # the saved profile before it is read


@dataclass
class Auto:
    """AUTO's memory for one caller: decisions forecast on a model, the tuner's
    measurements, and the saved cpu profile (read once)."""

    decisions: DecisionCache = field(default_factory=DecisionCache)
    tuner: Tuner = field(default_factory=Tuner)
    _profile: Any = _UNREAD
    _knobs: dict = field(default_factory=dict)  # (options, knobs) -> the options that run them

    def profile(self) -> HardwareModel | None:
        """The saved cpu profile (None when there is none)."""
        if self._profile is _UNREAD:
            self._profile = saved_profile()
        return self._profile

    def knob_options(self, o: RegionOptions, knobs: Knobs) -> RegionOptions:
        """``knob_options`` at the saved profile's rates (else nominal ones), made once
        per (options, knobs): a settled layer's call only looks it up."""
        made = self._knobs.get((o, knobs))
        if made is None:
            made = self._knobs[o, knobs] = knob_options(o, knobs, self.profile() or cpu_nominal())
        return made


PROCESS_AUTO = Auto(PROCESS_DECISIONS)  # callers that keep none: moe_forward, the compile path


def select(o: RegionOptions, spec: MoESpec, tokens: int, auto: Auto, session: Session | None = None,
           pool: ArenaPool | None = None, device: torch.device | None = None,
           received: torch.Tensor | None = None) -> tuple[RegionPath, Trial | None]:
    """The path of a call of ``tokens`` tokens (per rank with an ep_group, after padding;
    the whole batch in one process) computing ``spec`` (its dtype: the compute dtype) on
    ``device`` (default: the CPU), and the tuning trial it is (None: not tuning).
    ``received``: the rows each rank sends this one's experts, carried by the call's
    agreement (kernel by kernel then exchanges no counts).  Collective over ``session``'s
    group."""
    if o.backend is Backend.AUTO:
        auto.tuner.observe_own()
        key = device_key(o, spec, tokens, torch.is_grad_enabled(), auto, device)
        trial = auto.tuner.start(key, DeviceSpace(), OneProcess())
        if trial.knobs.path is Path.PERSISTENT:
            return TritonPath(o.virtual_ep, o.tiles, trial.knobs.policy, None, o.recompute, pool), trial
        return KernelByKernelPath(None, o.tiles, pool, o.recompute, phases=phases_for(device)), trial
    chosen, trial = _choose(o, spec, tokens, auto, session)
    if chosen.backend is Backend.KERNEL_BY_KERNEL:
        return KernelByKernelPath(session, o.tiles, pool, o.recompute, received, phases_for(device)), trial
    if o.distributed:
        return RuntimePath(session, chosen.tiles, runtime_policy(chosen), chosen.rank_hardware, chosen.nodes,
                           chosen.recompute), trial
    if o.backend is Backend.TRITON:
        return TritonPath(o.virtual_ep, o.tiles, runtime_policy(o), o.hardware, o.recompute, pool), trial
    return ExactPath(o.virtual_ep, chosen.tiles, chosen.schedule, chosen.nodes, chosen.recompute), trial


def runtime_policy(o: RegionOptions) -> SchedulePolicy:
    """The queue order a fixed taskflow runs (the runtime's, the persistent kernel's):
    ``o.schedule`` where it names one, else (AUTO, None, a seed) HYPERPARALLEL."""
    fixed = isinstance(o.schedule, SchedulePolicy) and o.schedule is not SchedulePolicy.AUTO
    return o.schedule if fixed else SchedulePolicy.HYPERPARALLEL


def _deprecated_policy(o: RegionOptions) -> SchedulePolicy:
    deprecated("RegionOptions.policy", "use hpmoe.engine.selection.runtime_policy(options)")
    return runtime_policy(o)


RegionOptions.policy = property(_deprecated_policy)  # the former property, for one release


def compiled(o: RegionOptions) -> bool:
    """Whether a call runs the region's custom op (``engine.compiled``): one process,
    the exact backend, while ``torch.compile`` traces."""
    return torch.compiler.is_compiling() and not o.distributed and o.backend is Backend.EXACT


def compiled_path(spec: MoESpec, tokens: int, ep: int, tiles: TileSpec, nodes: int, auto: bool,
                  device: torch.device) -> RegionPath:
    """The path of the custom op's call (``engine.compiled``) on ``device``: AUTO's for
    this shape (on the saved profile) with ``auto``, else the taskflow in task-id order."""
    options = RegionOptions(virtual_ep=ep, schedule=SchedulePolicy.AUTO if auto else None, tiles=tiles,
                            nodes=nodes)
    return select(options, spec, tokens, PROCESS_AUTO, device=device)[0]


def phases_for(device: torch.device | None) -> Phases:
    """Kernel by kernel's memory-bound phases on ``device``: one Triton launch each on a
    CUDA device where triton is installed (``gpu.phases.TRITON``, which falls back to
    torch per call where its kernels do not run), else torch's."""
    if device is None or device.type != "cuda" or importlib.util.find_spec("triton") is None:
        return TORCH
    from ..gpu.phases import TRITON

    return TRITON


def _choose(o: RegionOptions, spec: MoESpec, tokens: int, auto: Auto,
            session: Session | None) -> tuple[RegionOptions, Trial | None]:
    """The options that run the call (AUTO's choice made) and the trial."""
    if o.schedule is not SchedulePolicy.AUTO or o.backend is not Backend.EXACT:
        return o, None
    if o.distributed and o.hardware is None:
        space = Space.around(o.tiles, DEFAULT_TILES, o.nodes)
        key = tune_key(o, spec, tokens, torch.is_grad_enabled(), auto, session)
        first = None if auto.tuner.knows(key) else _model_first(o, spec, tokens, auto, session, space)
        trial = auto.tuner.start(key, space, session.collectives, first)
        return auto.knob_options(o, trial.knobs), trial
    chosen = decision(o, spec, tokens, torch.is_grad_enabled(), auto, session).chosen
    if chosen.path is not Path.TASKFLOW:
        return replace(o, backend=Backend.KERNEL_BY_KERNEL), None
    if o.distributed:
        return replace(o, schedule=chosen.policy), None
    return replace(o, schedule=None, hardware=None), None  # task-id order; AUTO's model has served


def decision(o: RegionOptions, spec: MoESpec, tokens: int, backward: bool, auto: Auto,
             session: Session | None = None) -> AutoDecision:
    """AUTO's forecast for ``tokens`` tokens: in one process over ``o.virtual_ep``
    virtual ranks; with an ep_group per rank, group rank 0 forecasting and broadcasting
    (collective).  Made once per shape and kept in ``auto.decisions``."""
    if not o.distributed:  # raises naming ``virtual_ep`` when it divides neither tokens nor experts
        shape = RoutingShape.one_process(spec, o.virtual_ep, tokens, backward)
        return auto.decisions.decide(shape, o.tiles, o.hardware)
    shape = RoutingShape(spec, o.ranks, tokens, backward)
    workers = o.rank_hardware.workers
    return auto.decisions.decide(shape, o.tiles, o.hardware, workers, session.collectives)


def tune_key(o: RegionOptions, spec: MoESpec, tokens: int, backward: bool, auto: Auto,
             session: Session) -> TuneKey:
    """The tuning key of a distributed call (machine, layer, EP group, network, dtype,
    token bucket, direction, and the expert placement its agreement carried:
    ``Session.placement``, so that a rebalanced layer is tuned as it now is)."""
    network = session.config.tuning_network
    return auto.tuner.key(spec, o.ranks, o.nodes, network, tokens, backward, session.placement)


def device_key(o: RegionOptions, spec: MoESpec, tokens: int, backward: bool, auto: Auto,
               device: torch.device | None) -> TuneKey:
    """The tuning key of a one-process call on ``device``: its name stands for the network."""
    device = torch.device("cpu") if device is None else device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return auto.tuner.key(spec, o.virtual_ep, o.nodes, f"one process on {name}", tokens, backward)


def tuned(o: RegionOptions, spec: MoESpec, tokens: int, backward: bool, auto: Auto,
          session: Session | None, device: torch.device | None = None) -> TuneResult | None:
    """What the tuning settled on for this key (None: still tuning, or not tuning)."""
    if o.backend is Backend.AUTO:
        return auto.tuner.result(device_key(o, spec, tokens, backward, auto, device))
    if not o.distributed:
        return None
    return auto.tuner.result(tune_key(o, spec, tokens, backward, auto, session))


def _model_first(o: RegionOptions, spec: MoESpec, tokens: int, auto: Auto, session: Session,
                 space: Space) -> Knobs | None:
    """What the saved profile forecasts fastest (the tuner measures it first); None
    without one."""
    if auto.profile() is None:
        return None
    return space.of(decision(o, spec, tokens, torch.is_grad_enabled(), auto, session).chosen)


def knob_options(o: RegionOptions, knobs: Knobs, rates: HardwareModel) -> RegionOptions:
    """The options that run the tuning candidate ``knobs``: the kernel-by-kernel backend,
    or the taskflow with its policy, tiles and worker threads (the rates of ``rates``:
    the saved profile, else nominal ones)."""
    if knobs.path is not Path.TASKFLOW:
        return replace(o, backend=Backend.KERNEL_BY_KERNEL)
    w = knobs.workers
    hw = dataclasses.replace(rates, matrix_workers=w.matrix, vector_workers=w.vector)
    return replace(o, schedule=knobs.policy, tiles=knobs.tiles, hardware=hw)
