"""The registry of transformers MoE block families hpmoe replaces (one module each).

``family_of(block)`` finds a block's ``Family`` by its class (no transformers import);
``read_block(block, family)`` checks that the block's maths is what the region computes
and returns its ``BlockLayout``, or raises ``ValueError`` naming the family and the
missing feature.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass

from torch import nn

from ...spec import Activation, MoESpec
from .base import ExpertsLayout, ExpertTensors, Family, ScoreSide, activation_of, expert_tensors, glu_form

FAMILIES: tuple[Family, ...] = tuple(
    importlib.import_module(f"{__name__}.{m.name}").FAMILY
    for m in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name) if m.name != "base"
)
"""Every module of this package but ``base`` declares one ``FAMILY``, by module name."""


def family_of(module: nn.Module) -> Family | None:
    """The family whose block class ``module`` is an instance of, else None."""
    for cls in type(module).__mro__:
        for fam in FAMILIES:
            if cls.__module__ == fam.module and cls.__name__ == fam.block:
                return fam
    return None


@dataclass(frozen=True)
class BlockLayout:
    """How hpmoe runs one block: ``spec`` (dtype that of the experts' weights; routing
    fields unused: the block's router routes); ``fused_shared``: the shared MLP's attribute
    when it runs inside the region (``spec.shared_experts`` > 0), else None."""

    spec: MoESpec
    fused_shared: str | None


def read_block(block: nn.Module, family: Family, virtual_ep: int = 1) -> BlockLayout:
    """Check ``block`` (its experts split evenly over ``virtual_ep`` ranks) and read its
    layout; ``ValueError`` names what does not fit."""
    if family.refused:
        raise ValueError(f"{family.name} ({family.block}) is not supported: {family.refused}")
    t = _check_experts(block, family)
    e, f2, h = t.w13.shape
    if e % virtual_ep:
        raise ValueError(f"{family.name}: virtual_ep={virtual_ep} does not divide the block's {e} experts")
    act = Activation.SILU if family.glu and t.act is None else activation_of(t.act)  # g * sigmoid(alpha g)
    top_k = top_k_of(block, family)
    shared = getattr(block, family.shared, None) if family.shared else None
    fused = family.shared if _fusable(shared, family, act, f2 // 2) else None
    width = shared.gate_proj.out_features if fused else 0
    spec = MoESpec(
        hidden=h,
        ffn=f2 // 2,
        experts=e,
        top_k=1 if family.score_side is ScoreSide.INPUT else top_k,  # one region call per slot
        shared_experts=width // (f2 // 2),
        activation=act,
        dtype=t.w13.dtype,
        glu=glu_form(getattr(block, "experts", None), family),
        expert_bias=t.b13 is not None,
    )
    return BlockLayout(spec=spec, fused_shared=fused)


def top_k_of(block: nn.Module, family: Family) -> int:
    """Experts per token: the router's ``top_k``, else the block's."""
    router = getattr(block, family.router, None)
    top_k = getattr(router, "top_k", getattr(block, "top_k", None))
    if not isinstance(top_k, int):
        raise ValueError(f"{family.name}: block.{family.router} has no int top_k, got {top_k!r}")
    return top_k


def computing_experts(block: nn.Module, family: Family) -> int | None:
    """The number of experts that compute when the family also routes to zero-computation
    (identity) experts, else None."""
    if family.identity_experts is None:
        return None
    experts = block.experts
    rows = experts.gate_up_proj.shape[0]
    if hasattr(experts, family.identity_experts):  # rows for every id, the identity ones' unused
        return rows - (getattr(experts, family.identity_experts) or 0)
    return rows  # the block counts the identity experts, the experts hold the computing ones


def _check_experts(block: nn.Module, family: Family) -> ExpertTensors:
    try:
        t = expert_tensors(block, family.layout, computing_experts(block, family))
    except AttributeError as err:
        raise ValueError(f"{family.name}: the block has no expert weights of layout "
                         f"{family.layout.value}: {err}") from None
    except ValueError as err:
        raise ValueError(f"{family.name}: {err}") from None
    e, f2, h = t.w13.shape
    if tuple(t.w2.shape) != (e, h, f2 // 2) or f2 % 2:
        raise ValueError(f"{family.name}: the down projection is {tuple(t.w2.shape)}, "
                         f"expected {(e, h, f2 // 2)}")
    transposed = getattr(getattr(block, "experts", None), "is_transposed", None)
    if transposed is not None and transposed is not (family.layout is ExpertsLayout.TRANSPOSED):
        raise ValueError(f"{family.name}: experts.is_transposed={transposed} does not match the "
                         f"{family.layout.value} layout")
    return t


def _fusable(shared: nn.Module | None, family: Family, act: Activation, ffn: int) -> bool:
    """A shared MLP runs inside the region when it is ungated, bias-free, of the experts'
    activation and a multiple of their width, and the experts compute the plain gate (a
    family with its own ``glu`` clamps its shared MLP too: DeepSeek-V4, GLM-5-Next);
    otherwise it runs beside the region."""
    if shared is None or family.shared_gate is not None or family.score_side is ScoreSide.INPUT:
        return False
    if family.glu is not None:
        return False
    parts = [getattr(shared, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if not all(isinstance(p, nn.Linear) and p.bias is None for p in parts):
        return False
    try:
        same = activation_of(getattr(shared, "act_fn", None) or shared.activation_fn) is act
    except (ValueError, AttributeError):
        return False
    return same and parts[0].out_features % ffn == 0 and parts[0].out_features == parts[1].out_features
