"""A layer's verdicts on its inputs: the scan of a call's x, expert ids and routing
weights (``routing.input_status``) runs on the input's device, and ``CheckMode`` says
when its verdict is read on the host.

``SYNC`` reads it in the call and raises there (one host read: on a GPU the host waits
for the device).  ``DEFERRED`` raises it at the next call, one call late, saying so; on
a GPU without a host read in the call: the first fault since the last report stays in a
status tensor on the device updated in place (a CUDA graph's replays update it too),
copied to pinned host memory without waiting, and the next call reads that copy; a CPU
reads its verdict in the call (there is no device to wait for) and keeps it until the
next.  ``InputCheck.check`` waits for the device and raises at once.  The faulty call itself runs on clamped
expert ids, so an out-of-range id never indexes outside a buffer.  On an EP group
the call's agreement needs every rank's verdict at once: it reads it in the call
whatever the mode (the agreement waits for the ranks anyway)."""

from __future__ import annotations

import enum

import numpy as np
import torch

from ..machine import capturing
from ..routing import (
    InputFault,
    Scanned,
    cpu_expert_counts,
    expert_counts,
    input_status,
    status_error,
    value_error,
)

LATE = ("found by the device-side input check of an earlier call (check='deferred' reports a fault one "
        "call late; check='sync' raises in the call itself)")


class CheckMode(enum.Enum):
    """When a layer reads the verdict of its input scan: in the call (``SYNC``), or
    at the next call without a host sync (``DEFERRED``, the default)."""

    SYNC = "sync"
    DEFERRED = "deferred"


def as_check_mode(value: CheckMode | str) -> CheckMode:
    """``value`` as a ``CheckMode``; ValueError naming it when it is none."""
    if isinstance(value, CheckMode):
        return value
    try:
        return CheckMode(value)
    except ValueError:
        raise ValueError(f"check={value!r} is not one of {[m.value for m in CheckMode]}") from None


class InputCheck:
    """The verdicts of one layer's calls on their inputs (x [N, H], expert ids [N, k],
    routing weights [N, k]; ``experts``: the ids' range).  ``settle`` acts on a call's
    as the mode says; ``error`` reads one at once; ``check`` raises a fault no call has
    reported yet."""

    def __init__(self, mode: CheckMode, experts: int):
        self.mode, self.experts = mode, experts
        self._late: ValueError | None = None  # a CPU's verdict, read in its call, raised at the next
        self._held: torch.Tensor | None = None  # [3] int64 on a GPU: the first unreported fault
        self._host: torch.Tensor | None = None  # its copy in pinned host memory
        self._seen: np.ndarray | None = None  # a numpy view of that copy: read without a tensor op

    def error(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> ValueError | None:
        """The call's fault, read at once (one host read)."""
        return value_error(self.experts, x, ids, weights)

    def settle(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """One process: ``SYNC`` raises this call's fault now; ``DEFERRED`` raises an
        earlier call's fault whose verdict has reached the host, then keeps this one's:
        on a CPU read at once (no device to wait for), on a GPU on the device.  Returns
        the ids the call runs on (under ``DEFERRED`` clamped into range) and their rows
        per expert ([E] int64), counted in the same scan on a GPU."""
        if self.mode is CheckMode.DEFERRED:
            live = not capturing(x.device)  # a CUDA graph's capture reads nothing from the host, and
            if live:  # copies nothing to it (``check`` reads what its replays found on the device)
                self._report(wait=False)
            if held_on_device(x.device):
                scanned = device_scan(self.experts, x, ids, weights, self._keeper(x.device))
                if live:
                    self._host.copy_(self._held, non_blocking=True)
                return scanned.ids, scanned.counts
        err, counts = self._read(x, ids, weights)
        if err is not None and self.mode is CheckMode.SYNC:
            raise err
        self._late = err  # a CPU's, read in the call: raised at the next
        if counts is None:  # only a faulty call's ids need clamping
            ids = ids.clamp(0, self.experts - 1)
            counts = expert_counts(ids, self.experts)
        return ids, counts

    def _read(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
              ) -> tuple[ValueError | None, torch.Tensor | None]:
        """The call's fault read at once, and the ids' rows per expert where they are all
        in range (None: not counted).  A CPU counts them first, which reads their range
        (``cpu_expert_counts``); then only x and the weights are read."""
        if not ids.is_cpu:
            err = self.error(x, ids, weights)
            return err, expert_counts(ids, self.experts) if err is None else None
        counts = cpu_expert_counts(ids, self.experts)
        return self.error(x, ids if counts is None else None, weights), counts

    def check(self) -> None:
        """Wait for the device and raise the first fault no call has reported yet."""
        self._report(wait=True)

    def _keeper(self, device: torch.device) -> torch.Tensor:
        """The status a GPU keeps its first unreported fault in, and its host copy."""
        if self._held is None or self._held.device != device:
            self._held = torch.zeros(3, dtype=torch.int64, device=device)
            self._host = torch.zeros(3, dtype=torch.int64, device="cpu", pin_memory=device.type == "cuda")
            self._seen = self._host.numpy()
        return self._held

    def _report(self, wait: bool) -> None:
        """Raise the kept fault: a CPU's, or a GPU's read from its copy in host memory
        (a copy may still be on its way: only a fault seen there makes this wait for the
        device and read it whole)."""
        err, self._late = self._late, None
        if err is None and self._held is not None and (wait or self._seen[0] != InputFault.NONE):
            if self._held.is_cuda:
                torch.cuda.synchronize(self._held.device)
            err = status_error(self._held.tolist(), self.experts)
            self._held.zero_()
            self._host.zero_()
        if err is not None:
            raise ValueError(f"{err} ({LATE})") from err


def held_on_device(device: torch.device) -> bool:
    """Whether ``DEFERRED`` keeps a call's verdict on ``device`` (a GPU: reading it would
    wait for the device); a CPU reads it at no cost."""
    return device.type != "cpu"


def device_scan(experts: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                held: torch.Tensor) -> Scanned:
    """The call's scan on its device without a host read: its verdict (kept also in
    ``held`` unless that holds a fault already), the ids clamped into range and their
    rows per expert.  On CUDA with triton one scan launch (``gpu.phases.scan``); else
    in torch (``routing.input_status``), the reference."""
    if x.is_cuda:
        from ..gpu import phases

        if phases.available(x):
            return phases.scan(x, ids, weights, experts, held)
    status = input_status(experts, x, ids, weights)
    held.copy_(torch.where(held[0] == InputFault.NONE, status, held))
    clamped = ids.clamp(0, experts - 1)
    return Scanned(status, clamped, expert_counts(clamped, experts))
