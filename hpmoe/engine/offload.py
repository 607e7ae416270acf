"""Offloading a call's saved activations to host memory (``RegionOptions.offload``),
as Pangu Ultra MoE swaps activations to fit.

``send`` takes the tensors a path's state hands to autograd and moves the ones at the
places the state names (the routed and shared experts' pre-activation and, where
kept, the experts' received rows and the shared activation) to host memory:
on CUDA into pinned memory on a side stream, started once the current stream has
written them, their device memory given back to the caching allocator once the copy is
done (``record_stream``).  ``receive``, at the start of a call's backward, brings them
back and starts bringing back the call before it (in forward order, the backward that
comes next), so that return overlaps with this backward's kernels; the current stream
waits for its own tensors only.

On a CPU saved tensors are in host memory already: ``send`` moves nothing and warns
once that the option does nothing there (``pays``).  Under saved-tensor hooks
(activation checkpointing, which keeps nothing, or ``save_on_cpu``) it leaves the
tensors to them, and while a CUDA graph is captured it sends nothing (a replay runs on
static buffers).  Where a path keeps its activations in an arena of its own (the
persistent kernel) or keeps nothing but the input (kernel by kernel's ``recompute="gemm"``),
nothing is sent either."""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..machine import capturing

_DEPTH = 64  # calls whose offloaded tensors are remembered for the prefetch (in forward order)


def pays(device: torch.device) -> bool:
    """Whether offloading frees memory on ``device``: a CUDA device's (a CPU's saved
    tensors are in host memory already)."""
    return device.type == "cuda"


@dataclass
class Offloaded:
    """One tensor sent to host memory: ``host`` (pinned on CUDA), the device it came from,
    the side stream that copies it both ways (None on a device without streams, where
    the copies are done when they return), and once ``fetch`` started its return, the
    device copy and the event it is ready at."""

    host: torch.Tensor | None
    device: torch.device
    stream: torch.cuda.Stream | None
    back: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None

    @staticmethod
    def send(t: torch.Tensor, stream: torch.cuda.Stream | None) -> Offloaded:
        """Start the copy of ``t`` to host memory."""
        if stream is None:
            return Offloaded(t.to("cpu", copy=True), t.device, None)
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
        stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(stream):
            host.copy_(t, non_blocking=True)
        t.record_stream(stream)  # its memory is not handed out again before the copy ends
        return Offloaded(host, t.device, stream)

    def fetch(self) -> None:
        """Start bringing the tensor back (once): after everything the current stream
        was given so far, since the device copy's memory may have been freed by it."""
        if self.back is not None or self.host is None:  # started, or back already
            return
        if self.stream is None:
            self.back = self.host.to(self.device, copy=True)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self.back = self.host.to(self.device, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record(self.stream)

    def get(self) -> torch.Tensor:
        """The tensor on its device, the current stream ordered after its return; its
        host memory is let go (a call's backward runs once)."""
        self.fetch()
        if self.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(self.ready)
            self.back.record_stream(torch.cuda.current_stream(self.device))
        back, self.back, self.host = self.back, None, None
        return back


@dataclass
class Parcel:
    """The tensors one call sent, by their place among its state's tensors."""

    items: dict[int, Offloaded] = field(default_factory=dict)

    def fetch(self) -> None:
        for item in self.items.values():
            item.fetch()


class _Sent:
    """Per device, the side stream and the parcels of recent calls in forward order
    (weakly: a call whose graph was dropped leaves nothing behind)."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.parcels: list[weakref.ref[Parcel]] = []

    def push(self, parcel: Parcel) -> None:
        self.parcels = [r for r in self.parcels[-_DEPTH + 1:] if r() is not None] + [weakref.ref(parcel)]

    def take(self, parcel: Parcel) -> Parcel | None:
        """Forget ``parcel``; the live one sent just before it (None: none is remembered)."""
        live = [p for p in (r() for r in self.parcels) if p is not None]
        place = next((i for i, p in enumerate(live) if p is parcel), None)
        self.parcels = [weakref.ref(p) for p in live if p is not parcel]
        return live[place - 1] if place else None


_SENT: dict[torch.device, _Sent] = {}


def _sent(device: torch.device) -> _Sent:
    if device not in _SENT:
        _SENT[device] = _Sent(device)
    return _SENT[device]


def hooked() -> bool:
    """Whether saved-tensor hooks are active (non-reentrant activation checkpointing,
    ``save_on_cpu``, a user's): they decide where saved tensors go, and under
    checkpointing none is kept at all."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is not None and top(False) is not None


def send(tensors: list[torch.Tensor | None], places: Sequence[int]) -> Parcel | None:
    """Move ``tensors[i]`` for each of ``places`` to host memory, setting it to None in
    ``tensors``; the parcel ``receive`` takes back (None: nothing was moved: no tensor
    there, saved-tensor hooks active, or a device where it does not pay, which is warned
    about once)."""
    kept = [i for i in places if tensors[i] is not None and tensors[i].numel()]
    if not kept or hooked():
        return None
    device = tensors[kept[0]].device
    if capturing(device):
        return None  # a captured step replays on static buffers: nothing to send per call
    if not pays(device):
        warnings.warn(f"offload=True moves nothing on a {device.type} device: its saved tensors are in host "
                      "memory already", stacklevel=3)
        return None
    sent = _sent(device)
    parcel = Parcel({i: Offloaded.send(tensors[i], sent.stream) for i in kept})
    for i in kept:
        tensors[i] = None
    sent.push(parcel)
    return parcel


def receive(tensors: list[torch.Tensor | None], parcel: Parcel | None) -> None:
    """Put ``parcel``'s tensors back into ``tensors``, and start bringing back the
    parcel sent before it (the next backward's)."""
    if parcel is None:
        return
    item = next(iter(parcel.items.values()))
    parcel.fetch()
    earlier = _sent(item.device).take(parcel)
    if earlier is not None:
        earlier.fetch()
    for i, it in parcel.items.items():
        tensors[i] = it.get()
