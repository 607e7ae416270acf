"""A layer's verdicts on its inputs: the scan of a call's x, expert ids and routing
weights (``routing.input_status``) runs on the input's device, and ``CheckMode`` says
when its verdict is read on the host.

``SYNC`` reads it in the call and raises there (one host read: on a GPU the host waits
for the device).  ``DEFERRED`` keeps it on the device: the first fault since the last
report stays in a status tensor updated in place (a CUDA graph's replays update it
too), copied to pinned host memory without waiting; the next call reads that copy
(no sync) and raises the fault one call late, saying so, and ``InputCheck.check``
waits for the device and raises at once.  The faulty call itself runs on clamped
expert ids, so an out-of-range id never indexes outside a buffer.  On an EP group
the call's agreement needs every rank's verdict at once: it reads it in the call
whatever the mode (the agreement waits for the ranks anyway)."""

from __future__ import annotations

import enum

import numpy as np
import torch

from ..routing import InputFault, input_status, status_error

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
    """The verdicts of one layer's calls.  ``scan`` judges a call's input on its
    device; ``settle`` acts on it as the mode says; ``check`` raises a fault still
    unreported."""

    def __init__(self, mode: CheckMode, experts: int):
        self.mode, self.experts = mode, experts
        self._held: torch.Tensor | None = None  # [3] int64 on the device: the first unreported fault
        self._host: torch.Tensor | None = None  # its copy in host memory (pinned on a GPU)
        self._seen: np.ndarray | None = None  # a numpy view of that copy: read without a tensor op

    def scan(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """This call's verdict, int64 [3] on x's device (``routing.input_status``)."""
        return input_status(self.experts, x, ids, weights)

    def error(self, status: torch.Tensor) -> ValueError | None:
        """The fault ``status`` names, read at once (a host read)."""
        return status_error(status.tolist(), self.experts)

    def settle(self, status: torch.Tensor) -> None:
        """One process: ``SYNC`` raises this call's fault now; ``DEFERRED`` raises an
        earlier call's fault whose verdict has reached the host, then holds this one's."""
        if self.mode is CheckMode.SYNC:
            if (err := self.error(status)) is not None:
                raise err
            return
        if not _capturing(status.device):  # a CUDA graph's capture runs no host read
            self._report(wait=False)
        self._hold(status)

    def check(self) -> None:
        """Wait for the device and raise the first fault no call has reported yet."""
        self._report(wait=True)

    def _hold(self, status: torch.Tensor) -> None:
        if self._held is None or self._held.device != status.device:
            self._held = torch.zeros(3, dtype=torch.int64, device=status.device)
            self._host = self._held if status.device.type == "cpu" else torch.zeros(
                3, dtype=torch.int64, device="cpu", pin_memory=True)
            self._seen = self._host.numpy()
        self._held.copy_(torch.where(self._held[0] == InputFault.NONE, status, self._held))
        if self._host is not self._held:
            self._host.copy_(self._held, non_blocking=True)

    def _report(self, wait: bool) -> None:
        """Raise the held fault: read from host memory (a copy may still be on its way:
        only a fault seen there makes this wait for the device and read it whole)."""
        if self._held is None or (not wait and self._seen[0] == InputFault.NONE):
            return
        if self._held.is_cuda:
            torch.cuda.synchronize(self._held.device)
        err = status_error(self._held.tolist(), self.experts)
        if err is not None:
            self._held.zero_()
            if self._host is not self._held:
                self._host.zero_()
            raise ValueError(f"{err} ({LATE})") from err


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()
