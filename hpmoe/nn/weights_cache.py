"""A layer's region weights kept between its calls while none of the parameters they
read is replaced: a call's largest host cost after its kernels and its input check is
building them (the expert tensors' views, the checks of ``ExpertWeights``).

Only views are kept: they read the parameters' storage, so an update in place (an
optimizer step, ``load_state_dict``) reaches them.  The shared experts' fused gate/up, a
copy, is fused again each call from the kept views of its parts (keeping it would hold a
copy of those weights between calls); weights holding any other copy (a layout the
region reads only through one) are built each call.  Calls with gradients reuse them
where every tensor is a parameter itself (hpmoe's own layer, the fused layouts): a view
made in a call with gradients belongs to that call's graph, so those are built each
call.  A parameter is replaced by ``setattr`` into one of the layer's modules (torch's
global registration hooks report it, and a module replaced so), by FSDP's direct
registration (its identity) or with a new storage (``.data =``, ``.to()``: its address
and shape).  A traced call builds afresh (``torch.compile`` reads the parameters
itself)."""

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
    """One layer's region weights between calls: their views of its parameters (detached,
    for calls without gradients) and, where every tensor is a parameter itself, the
    weights as they are (for calls with gradients); what they were built from: its
    parameters (found where they are registered), their identities, addresses and shapes."""

    def __init__(self, keeps: bool = True) -> None:
        self.keeps = keeps  # False: every call builds (weights that follow more than the parameters)
        self.clear()

    def __reduce__(self) -> tuple:
        """A copy (``copy.deepcopy`` of a layer, a pickled one) starts empty: the copy's
        parameters are other tensors in other modules, watched from its first call."""
        return (type(self), (self.keeps,))

    def clear(self) -> None:
        """Forget the weights."""
        self._seen = -1
        self._owners: tuple[tuple[nn.Module, str], ...] = ()
        self._params: tuple[torch.Tensor | None, ...] = ()
        self._stamp: tuple[tuple[int, int, torch.Size], ...] = ()
        self._views: ExpertWeights | None = None  # None: not built, or holding a copy
        self._leaves: ExpertWeights | None = None  # None: not built, or holding a view or a copy
        self._parts: tuple[torch.Tensor, torch.Tensor] | None = None  # the views' fused gate/up parts

    def get(self, module: nn.Module, build: Callable[[], ExpertWeights]) -> ExpertWeights:
        """``build()``, or (not traced) what it built last while none of ``module``'s
        parameters was replaced, the shared gate/up fused again: without gradients the
        views, detached; with gradients the parameters themselves, where they are all it
        holds (a view would belong to an earlier call's graph)."""
        if not self.keeps or torch.compiler.is_compiling():
            return build()
        grad = torch.is_grad_enabled()
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
            self._views, self._leaves, self._parts = _kept(built, params)
            return built if grad else built.detached()
        kept, parts = (self._leaves, self._leaves and self._leaves.shared_parts) if grad else \
            (self._views, self._parts)
        if kept is None:  # it holds a copy (or, with gradients, a view): built each call
            return build() if grad else build().detached()
        return kept if parts is None else kept.with_shared_w13(torch.cat(parts))


def _kept(w: ExpertWeights, params: tuple[torch.Tensor | None, ...]) -> tuple[
        ExpertWeights | None, ExpertWeights | None, tuple[torch.Tensor, torch.Tensor] | None]:
    """What ``w`` leaves to later calls, its fused shared gate/up (a copy) left out: (its
    views, detached; itself where every tensor is a parameter; the views of the fused
    gate/up's parts), each None where ``w`` holds another copy."""
    parts = w.shared_parts
    read = [t for t in (w.w13, w.w2, w.shared_w2, *w.biases, *(parts or (w.shared_w13,))) if t is not None]
    stored = {p.untyped_storage().data_ptr() for p in params if p is not None}
    if any(t.untyped_storage().data_ptr() not in stored for t in read):
        return None, None, None
    bare = w if parts is None else w.with_shared_w13(None)
    leaves = bare if {id(t) for t in read} <= {id(p) for p in params} else None
    return bare.detached(), leaves, None if parts is None else (parts[0].detach(), parts[1].detach())
