"""A layer's region weights built once and reused by its calls without gradients while
none of the parameters they read changes: an inference call's largest host cost after
its kernels is building them (the expert tensors' views, the shared experts' fused
gate/up, the checks of ``ExpertWeights``), and they change only when a parameter does.

A parameter changes by being replaced (``setattr``, FSDP's direct registration: its
identity), by a new storage (``.data =``, ``.to()``: its address) or in place (an
optimizer step, ``load_state_dict``: its version counter); a module is replaced or a
parameter added through ``setattr``, which torch's global registration hooks report.
Calls with gradients build afresh (their tensors belong to that call's graph), and so
does a traced call (``torch.compile`` reads the parameters itself)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)

from ..weights import ExpertWeights

_registrations = [0]  # modules and parameters registered anywhere since the watch began
_watching: list[object] = []


def _registered(*_: object) -> None:
    _registrations[0] += 1


def _watch() -> None:
    """Count registrations from the first cached call on (hooks torch calls on each)."""
    if not _watching:
        _watching.append(register_module_module_registration_hook(_registered))
        _watching.append(register_module_parameter_registration_hook(_registered))


class WeightsCache:
    """One layer's region weights of its last call without gradients, and what they were
    built from: its parameters (found where they are registered), their addresses and
    versions."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        """Forget the weights (their tensors are no longer kept alive)."""
        self._seen = -1
        self._owners: tuple[tuple[nn.Module, str], ...] = ()
        self._params: tuple[torch.Tensor | None, ...] = ()
        self._stamp: tuple[tuple[int, int], ...] = ()
        self._weights: ExpertWeights | None = None

    def get(self, module: nn.Module, build: Callable[[], ExpertWeights]) -> ExpertWeights:
        """``build()``; in a call without gradients (not traced) its result detached,
        built again only when one of ``module``'s parameters has changed since."""
        if torch.is_grad_enabled() or torch.compiler.is_compiling():
            return build()
        _watch()
        if self._seen != _registrations[0]:
            self.clear()
            self._seen = _registrations[0]
            self._owners = tuple((m, n) for m in module.modules() for n in m._parameters)
        params = tuple(m._parameters.get(n) for m, n in self._owners)
        stamp = tuple((p._version, p.data_ptr()) for p in params if p is not None)
        if (self._weights is None or stamp != self._stamp
                or any(a is not b for a, b in zip(params, self._params, strict=True))):
            self._weights, self._params, self._stamp = build().detached(), params, stamp
        return self._weights
