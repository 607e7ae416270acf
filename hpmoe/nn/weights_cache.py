"""A layer's region weights kept between its calls without gradients while none of the
parameters they read is replaced: an inference call's largest host cost after its
kernels is building them (the expert tensors' views, the checks of ``ExpertWeights``).

Only views are kept: they read the parameters' storage, so an update in place (an
optimizer step, ``load_state_dict``) reaches them.  The shared experts' fused gate/up, a
copy, is fused again each call from the kept views of its parts (keeping it would hold a
copy of those weights between calls); weights holding any other copy (a layout the
region reads only through one) are built each call.  A parameter is replaced by
``setattr`` into one of the layer's modules (torch's global registration hooks report
it, and a module replaced so), by FSDP's direct registration (its identity) or with a
new storage (``.data =``, ``.to()``: its address and shape).  Calls with gradients build
afresh (their tensors belong to that call's graph), and so does a traced call
(``torch.compile`` reads the parameters itself)."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)

from ..weights import ExpertWeights

_registrations = [0]  # modules and parameters registered into a watched module since the watch began
_watched: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # every module of a kept layer's tree
_hooks: list[object] = []


def _registered(module: nn.Module, *_: object) -> None:
    if module in _watched:  # not, e.g., the ModuleList a slice of a model's layers makes each forward
        _registrations[0] += 1


def _watch(modules: Iterable[nn.Module]) -> None:
    """Count the registrations into ``modules`` from now on (hooks torch calls on each)."""
    if not _hooks:
        _hooks.append(register_module_module_registration_hook(_registered))
        _hooks.append(register_module_parameter_registration_hook(_registered))
    _watched.update(modules)


class WeightsCache:
    """One layer's region weights of a call without gradients (views of its parameters,
    detached), and what they were built from: its parameters (found where they are
    registered), their identities, addresses and shapes."""

    def __init__(self, keeps: bool = True) -> None:
        self.keeps = keeps  # False: every call builds (weights that follow more than the parameters)
        self.clear()

    def clear(self) -> None:
        """Forget the weights."""
        self._seen = -1
        self._owners: tuple[tuple[nn.Module, str], ...] = ()
        self._params: tuple[torch.Tensor | None, ...] = ()
        self._stamp: tuple[tuple[int, int, torch.Size], ...] = ()
        self._weights: ExpertWeights | None = None  # None: not built, or holding a copy
        self._parts: tuple[torch.Tensor, torch.Tensor] | None = None  # the fused shared gate/up's

    def get(self, module: nn.Module, build: Callable[[], ExpertWeights]) -> ExpertWeights:
        """``build()``; in a call without gradients (not traced) the kept views while none of
        ``module``'s parameters was replaced, the shared gate/up fused again."""
        if not self.keeps or torch.is_grad_enabled() or torch.compiler.is_compiling():
            return build()
        if self._seen != _registrations[0]:
            self.clear()
            tree = list(module.modules())
            _watch(tree)
            self._seen = _registrations[0]
            self._owners = tuple((m, n) for m in tree for n in m._parameters)
        params = tuple(m._parameters.get(n) for m, n in self._owners)  # held: their ids stay theirs
        stamp = tuple((id(p), p.data_ptr(), p.shape) for p in params if p is not None)
        if stamp != self._stamp:
            self._params, self._stamp = params, stamp
            built = build()
            self._weights, self._parts = _views(built, params)
            return built.detached()
        if self._weights is None:  # it holds a copy: built each call
            return build().detached()
        if self._parts is None:
            return self._weights
        return self._weights.with_shared_w13(torch.cat(self._parts))


def _views(w: ExpertWeights, params: tuple[torch.Tensor | None, ...]
           ) -> tuple[ExpertWeights | None, tuple[torch.Tensor, torch.Tensor] | None]:
    """(``w`` detached, the fused shared gate/up's parts detached) when every expert tensor
    reads a parameter's storage in place but the fused gate/up (fused from such parts);
    (None, None) where another is a copy."""
    stored = {p.untyped_storage().data_ptr() for p in params if p is not None}
    parts = w.shared_parts
    read = [w.w13, w.w2, w.shared_w2, *w.biases, *(parts or (w.shared_w13,))]
    if any(t is not None and t.untyped_storage().data_ptr() not in stored for t in read):
        return None, None
    kept = w.detached()
    return kept, None if parts is None else (parts[0].detach(), parts[1].detach())
