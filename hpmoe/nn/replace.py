"""Drop-in: swap transformers MoE blocks of a model for ``hpmoe.MoE`` layers in place.

The new layers adopt the blocks' own ``gate``, ``experts`` and ``shared_experts``
submodules (``MoE.from_hf``), so every parameter stays the same tensor under the same
name: optimizers built before the swap keep updating the right tensors and state dicts
(keys and values) are unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from ..engine import RegionOptions
from .families import FAMILIES, family_of, read_block
from .layer import MoE

if TYPE_CHECKING:  # imported on first distributed use
    from ..runtime import Session


@dataclass
class Replacement:
    """names: qualified names of the replaced modules, in ``named_modules`` order.
    session: the runtime session the layers share (distributed runs), else None;
    ``close()`` it when done training."""

    names: list[str]
    session: Session | None

    def close(self) -> None:
        if self.session is not None:
            self.session.close()


def supported_blocks() -> tuple[str, ...]:
    """Class names of the transformers MoE blocks hpmoe replaces (``hpmoe.nn.families``)."""
    return tuple(f.block for f in FAMILIES if not f.refused)


def replace_moe_blocks(model: nn.Module, **options: Any) -> Replacement:
    """Replace every supported MoE block inside ``model`` by ``MoE.from_hf(block, ...)``.

    ``options``: fields of ``hpmoe.nn.layer.RegionOptions`` (ep_group, virtual_ep, schedule,
    recompute, tiles, runtime, hardware).  With a process group as ``ep_group`` one
    runtime ``Session`` is opened here (collective over the group) and shared by every
    new layer.  Raises ``ValueError`` when ``model`` holds no supported block or is
    itself one (use ``MoE.from_hf``)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    checked = RegionOptions(**options)
    targets = [(name, m) for name, m in model.named_modules() if family_of(m) is not None]
    if not targets:
        names = sorted(supported_blocks())
        raise ValueError(f"model of type {type(model).__name__} holds no block of type {names}")
    for _, block in targets:
        read_block(block, family_of(block), checked.virtual_ep)  # refuse before replacing anything
    if targets[0][0] == "":
        raise ValueError(f"model is itself a {type(model).__name__}; use hpmoe.MoE.from_hf(model)")
    session = None
    if checked.distributed and checked.session is None:
        from ..runtime import Session

        session = Session(options.pop("runtime", None), checked.ep_group)
        options["ep_group"] = session
    for name, block in targets:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, MoE.from_hf(block, **options))
    from transformers import PreTrainedModel

    for m in model.modules():  # every transformers model inside: its own init reaches the blocks
        if isinstance(m, PreTrainedModel) and not isinstance(m._init_weights, InitThroughBlocks):
            m._init_weights = InitThroughBlocks(m._init_weights)
    return Replacement(names=[name for name, _ in targets], session=session)


@dataclass
class InitThroughBlocks:
    """A transformers model's ``_init_weights`` that is handed, for a replaced block, the
    block itself (``MoE.as_block``: the very tensors the layer holds) — its init checks the
    module's class.  Picklable: it holds the model's bound method."""

    init: Callable[[nn.Module], Any]

    def __call__(self, module: nn.Module) -> Any:
        block = module.as_block() if isinstance(module, MoE) else None
        return self.init(module if block is None else block)
