"""hpmoe as one of transformers' experts implementations (``config._experts_implementation``).

transformers (5.x) picks an experts module's forward by its config's
``_experts_implementation`` (``"eager"``, ``"batched_mm"``, ``"grouped_mm"``, ...) through
the ``ALL_EXPERTS_FUNCTIONS`` registry, and ``model.set_experts_implementation(name)``
switches it.  ``register()`` adds ``"hpmoe"`` to that registry and ``MoE.from_hf`` sets it
on the block's experts config (``select``).  A replaced block runs the region while its
experts' config says ``"hpmoe"`` and its experts module (transformers' dispatch) otherwise,
so ``set_experts_implementation("eager")`` gives transformers' own experts back and
``set_experts_implementation("hpmoe")`` the region again.  An experts module outside an
hpmoe layer whose config says ``"hpmoe"`` runs ``experts_forward``: the region in one
process (virtual EP 1, default tiles, the path AUTO decides) through the ``hpmoe::region``
custom op.
"""

from __future__ import annotations

import torch
from torch import nn

from ..engine.compiled import run_region
from ..exec.exact import DEFAULT_TILES
from ..spec import MoESpec
from ..weights import ExpertWeights
from .families.base import activation_of, check_flags

HPMOE = "hpmoe"


def register() -> None:
    """Add ``"hpmoe"`` to transformers' experts registry (again after a test restored it)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if HPMOE not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(HPMOE, experts_forward)


def select(experts: nn.Module) -> None:
    """Set ``"hpmoe"`` as the experts implementation of ``experts.config`` (shared by the
    model's other blocks of that config, as transformers' own switch is)."""
    config = getattr(experts, "config", None)
    if config is not None and hasattr(config, "_experts_implementation_internal"):
        config._experts_implementation_internal = HPMOE


def runs_region(experts: nn.Module) -> bool:
    """Whether a replaced block runs the region (its experts' config says ``"hpmoe"``, or the
    experts module follows no config)."""
    config = getattr(experts, "config", None)
    return getattr(config, "_experts_implementation", HPMOE) in (HPMOE, None)


def experts_forward(experts: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts call: hidden_states [N, H], top_k_index [N, k] (any int dtype),
    top_k_weights [N, k] -> [N, H] in hidden_states' dtype, computed in the experts' dtype
    with fp32 combine; autograd through the custom op's registered backward."""
    w13, w2 = experts.gate_up_proj, experts.down_proj
    check_flags(experts, f"experts_implementation='hpmoe' ({type(experts).__name__})")
    e, f2, h = w13.shape
    spec = MoESpec(hidden=h, ffn=f2 // 2, experts=e, top_k=top_k_index.shape[1],
                   activation=activation_of(experts.act_fn), dtype=w13.dtype)
    w = ExpertWeights.routed(spec, w13, w2)
    x, ids = hidden_states.to(w13.dtype), top_k_index.to(torch.int64)
    return run_region(x, ids, top_k_weights.float(), w, 1, DEFAULT_TILES, auto=True).to(hidden_states.dtype)
