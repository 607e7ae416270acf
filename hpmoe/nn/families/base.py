"""What hpmoe needs to know about one transformers MoE block family.

Every supported block (transformers 5.x) is ``router`` -> ``experts`` (+ shared experts).
Most routers return ``(router_logits, top_k_weights [N, k], top_k_index [N, k])``; a family
whose router returns something else names a ``topk`` function that turns it into
``(weights, ids)``.  The expert weights are stored in one of the ``ExpertsLayout`` forms;
``expert_tensors`` reads any of them as the region's ``w13`` [E, 2F, H] (gate rows first)
and ``w2`` [E, H, F], connected to autograd.  hpmoe calls the block's own router module
exactly as the block does (so output-capturing hooks, ``output_router_logits`` and the
auxiliary loss see the same logits) and replaces only what follows: the experts, and a
plain shared MLP inside the region.  A ``Family`` names the attributes; ``refused`` says why
a family whose maths the region does not compute is refused.
"""

from __future__ import annotations

import enum
import importlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ...spec import PLAIN_GLU, Activation, GluForm


class ExpertsLayout(enum.Enum):
    """Where a block keeps its expert weights, and in which order."""

    FUSED = "fused"  # experts.gate_up_proj [E, 2F, H] (gate rows first), experts.down_proj [E, H, F]
    TRANSPOSED = "transposed"  # experts.gate_up_proj [E, H, 2F], experts.down_proj [E, F, H] (Llama 4)
    FLAT = "flat"  # experts.mlp.w1 (gate), v1 (up), w2 (down), each [E * F, H] (DBRX)
    PARALLEL = "parallel"  # input_linear.weight [E, 2F, H], output_linear.weight [E, H, F] (JetMoE)


class ScoreSide(enum.Enum):
    """Where a token's routing score multiplies: the expert's output (most families) or
    its input (Llama 4: ``experts(x * score)``)."""

    OUTPUT = "output"
    INPUT = "input"


TopK = Callable[[nn.Module, Any], tuple[torch.Tensor, torch.Tensor]]
"""(layer, router output) -> (weights [N, k], ids [N, k]) for a router whose output is not
``(logits, weights, ids)``; ``layer`` holds the block's submodules and ``block_attrs``."""

Route = Callable[..., Any]
"""(layer, x [N, H], hidden_states, *args, **kwargs) -> router output: the router called as
the block calls it, where that is not ``router(x, *router_args)`` (a router reading the
hidden states as the block received them, ``hidden_states``, or the block's other forward
arguments, ``args`` / ``kwargs``); ``layer`` holds the block's submodules and ``block_attrs``."""

Post = Callable[[nn.Module, torch.Tensor, torch.Tensor, Any], torch.Tensor]
"""(layer, x [N, H], out [N, H], router output) -> the block's output: what the block does
after its routed experts, shared expert and output bias (a norm of the sum, a shared MLP
weighted by the router)."""


@dataclass(frozen=True)
class Family:
    """One transformers MoE block family.

    name: the transformers ``model_type``.  module / block: where the block class lives.
    router: attribute of the router module, called as ``router(x [N, H])``.
    shared: attribute of an ungated shared MLP (``gate_proj``/``up_proj``/``down_proj``),
      added to every token; fused into the region when its maths fits, else run beside it.
    shared_gate: attribute of a ``Linear(H, 1)`` whose sigmoid scales ``shared`` per token
      (Qwen2-MoE, Qwen3-Next); such a shared expert runs beside the region.
    jitter: block attribute holding the training-time input jitter amplitude (Mixtral).
    router_args: block attributes passed to the router after ``x`` (MiniMax-M2: the
      block's score-correction bias buffer).
    layout: where the expert weights are (``ExpertsLayout``).
    topk: turns the router's output into (weights, ids); None: it is (logits, weights, ids).
    block_attrs: plain attributes of the block that ``topk`` reads (copied to the layer).
    score_side: where the routing score multiplies (``ScoreSide``).
    output_bias: attribute of a [H] parameter the block adds to every token's output (JetMoE).
    identity_experts: attribute holding the number of zero-computation experts, ids
      ``[E, E + n)`` whose output is the token itself (LongCat): of the experts module, whose
      weights then hold rows for every id; or, where the experts have none (transformers
      >= 5.25), of the block, whose experts hold the computing experts' rows only.
    returns: None when the block returns the hidden states only; else the index of the
      router output it returns beside them (``(hidden, router_output[returns])``).
    glu: the ``GluForm`` of the experts' own ``_apply_gate`` (GPT-OSS), read from the experts
      module (``ValueError`` for a gate the form does not express); None: transformers' default
      gate (``act(gate) * up``).  A family with its own gate runs its shared MLP beside the
      region: the region's shared expert computes the plain gate.
    route: calls the router where the block does not call it as ``router(x, *router_args)``
      (``Route``); the layer then takes the block's other forward arguments.
    post: what the block does to its output last (``Post``).
    refused: None, or the feature of the block that the region does not compute.
    config / model: transformers class names of the family's config and causal LM.
    tiny: overrides that make ``config`` a tiny test model (no download).
    """

    name: str
    module: str
    block: str
    config: str
    model: str
    tiny: dict[str, Any]
    router: str = "gate"
    shared: str | None = None
    shared_gate: str | None = None
    jitter: str | None = None
    router_args: tuple[str, ...] = ()
    layout: ExpertsLayout = ExpertsLayout.FUSED
    topk: TopK | None = None
    block_attrs: tuple[str, ...] = ()
    score_side: ScoreSide = ScoreSide.OUTPUT
    output_bias: str | None = None
    identity_experts: str | None = None
    returns: int | None = None
    glu: Callable[[nn.Module], GluForm] | None = None
    route: Route | None = None
    post: Post | None = None
    refused: str | None = None

    def block_class(self) -> type[nn.Module]:
        return getattr(importlib.import_module(self.module), self.block)

    def tiny_config(self, **overrides: Any) -> Any:
        """A tiny config of this family (H 32, F 16, 8 experts, top-2, 2 layers)."""
        import transformers

        return getattr(transformers, self.config)(**{**TINY, **self.tiny, **overrides})

    def tiny_model(self, seed: int = 0, **overrides: Any) -> nn.Module:
        """A randomly initialised tiny causal LM of this family (``torch.manual_seed(seed)``)."""
        import torch
        import transformers

        torch.manual_seed(seed)
        return getattr(transformers, self.model)(self.tiny_config(**overrides))


TINY: dict[str, Any] = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=16,
    moe_intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    pad_token_id=0,  # special tokens inside the 64-token vocabulary (some defaults are not)
    bos_token_id=None,
    eos_token_id=None,
)


@dataclass(frozen=True)
class ExpertTensors:
    """A block's expert weights as the region reads them, connected to autograd (views of
    the parameters, or a copy where the layout needs one): w13 [E, 2F, H] gate rows first
    (alternating with up rows where the experts say ``is_concatenated=False``), w2
    [E, H, F]; act: the module that computes the gate activation; b13 [E, 2F] / b2 [E, H]:
    the experts' biases where they say ``has_bias``, else None."""

    w13: torch.Tensor
    w2: torch.Tensor
    act: nn.Module
    b13: torch.Tensor | None = None
    b2: torch.Tensor | None = None


def expert_tensors(block: nn.Module, layout: ExpertsLayout, experts: int | None = None) -> ExpertTensors:
    """Read ``block``'s expert weights stored in ``layout``; ``experts``: the number of
    computing experts when the block stores more gate/up rows than it computes (LongCat).
    ``ValueError`` when an attribute is missing or not a tensor of the layout's rank."""
    if layout in (ExpertsLayout.FUSED, ExpertsLayout.TRANSPOSED):
        e = block.experts
        w13, w2 = _tensor(e, "gate_up_proj", 3), _tensor(e, "down_proj", 3)
        if layout is ExpertsLayout.TRANSPOSED:
            w13, w2 = w13.transpose(1, 2), w2.transpose(1, 2)
        biased = _flag(e, "has_bias")
        biases = (_tensor(e, "gate_up_proj_bias", 2), _tensor(e, "down_proj_bias", 2)) if biased else ()
        t = ExpertTensors(w13, w2, getattr(e, "act_fn", None), *biases)
    elif layout is ExpertsLayout.FLAT:
        m = block.experts.mlp
        w1, v1, w2 = (_tensor(m, n, 2) for n in ("w1", "v1", "w2"))
        rows = (m.moe_num_experts, m.ffn_hidden_size, w1.shape[1])
        t = ExpertTensors(torch.cat([w1.view(rows), v1.view(rows)], dim=1), w2.view(rows).transpose(1, 2),
                          m.activation_fn)
    else:
        w13, w2 = _tensor(block.input_linear, "weight", 3), _tensor(block.output_linear, "weight", 3)
        t = ExpertTensors(w13, w2, block.activation)
    if experts is None:
        return t
    return replace(t, w13=t.w13[:experts], b13=None if t.b13 is None else t.b13[:experts])


def _flag(experts: nn.Module, name: str) -> bool:
    """A flag transformers' ``use_experts_implementation`` sets on an experts module
    (False when the module has none)."""
    return getattr(experts, name, False) is True


def glu_form(experts: nn.Module | None, family: Family) -> GluForm:
    """The gated activation ``experts`` compute: the family's reading of its own
    ``_apply_gate``, else the plain one with gate/up interleaved where the experts say
    ``is_concatenated=False``.  ``ValueError`` for an own ``_apply_gate`` the family does not read."""
    if family.glu is not None:
        return family.glu(experts)
    gate = getattr(type(experts), "_apply_gate", None)
    if gate is not None and gate.__name__ != "_default_apply_gate":
        raise ValueError(f"{family.name}: experts._apply_gate ({type(experts).__name__}) is its own gate, "
                         "which this family does not read")
    interleaved = experts is not None and getattr(experts, "is_concatenated", True) is False
    return GluForm(interleaved=True) if interleaved else PLAIN_GLU


_FIRST = {ExpertsLayout.FUSED: ("experts", "gate_up_proj"),
          ExpertsLayout.TRANSPOSED: ("experts", "gate_up_proj"),
          ExpertsLayout.FLAT: ("experts", "mlp", "w1"),
          ExpertsLayout.PARALLEL: ("input_linear", "weight")}


def experts_dtype(block: nn.Module, layout: ExpertsLayout) -> torch.dtype:
    """The dtype of ``block``'s expert weights (without reading them all, as a FLAT copy would)."""
    owner: Any = block
    for name in _FIRST[layout]:
        owner = getattr(owner, name)
    return owner.dtype


def _tensor(owner: nn.Module, name: str, dims: int) -> torch.Tensor:
    t = getattr(owner, name, None)
    if not isinstance(t, torch.Tensor) or t.dim() != dims:
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else t
        raise ValueError(f"{type(owner).__name__}.{name} must be a {dims}-d tensor, got {shape!r}")
    return t


MLA_TINY: dict[str, Any] = dict(kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4,
                                v_head_dim=8)
"""A tiny multi-head latent attention (the DeepSeek-style families' ``tiny``)."""

GROUPED_TINY: dict[str, Any] = dict(n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                                    mlp_layer_types=["sparse"] * 2, n_group=4, topk_group=2)
"""Eight grouped experts, top-2, one shared expert, two sparse layers (DeepSeek-style ``tiny``)."""


GATED_DELTA_TINY: dict[str, Any] = dict(
    num_experts=8, num_experts_per_tok=2, shared_expert_intermediate_size=24, linear_num_value_heads=2,
    linear_num_key_heads=1, linear_key_head_dim=8, linear_value_head_dim=8,
    layer_types=["linear_attention", "full_attention"])
"""Eight experts, top-2, a gated shared expert, one gated-delta-net and one attention layer
(the Qwen3-Next-style ``tiny``)."""


def activation_of(act: nn.Module) -> Activation:
    """The ``Activation`` a transformers ``ACT2FN`` module (or ``F.silu`` / ``F.gelu`` /
    ``F.relu``) computes; ``ValueError`` naming the class when the region has no kernel for it."""
    functional = {F.silu: Activation.SILU, F.gelu: Activation.GELU, F.relu: Activation.RELU}
    if act in functional:  # the function itself (LFM2-MoE's ``act_fn = F.silu``)
        return functional[act]
    kind = type(act).__name__
    if kind in ("SiLUActivation", "SiLU"):
        return Activation.SILU
    if kind == "GELUActivation":
        return Activation.GELU
    if kind in ("GELUTanh", "NewGELUActivation", "FastGELUActivation", "PytorchGELUTanh"):
        return Activation.GELU_TANH
    if kind == "ReLU":
        return Activation.RELU
    raise ValueError(
        f"expert activation {kind} is not supported; hpmoe computes {sorted(a.value for a in Activation)}"
    )


def check_flags(experts: nn.Module, owner: str) -> None:
    """``ValueError`` (naming ``owner``) for experts with biases, transposed weights or
    interleaved gate/up columns, outside a family (``experts_implementation="hpmoe"`` on a
    bare experts module reads gate_up_proj [E, 2F, H], gate rows first, no biases)."""
    for flag, bad in (("has_bias", True), ("is_transposed", True), ("is_concatenated", False)):
        if getattr(experts, flag, not bad) is bad:
            raise ValueError(f"{owner}: experts.{flag}={bad} is not supported")


Reader = Callable[[nn.Module], Any]
