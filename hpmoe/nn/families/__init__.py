"""The registry of transformers MoE block families hpmoe replaces (one module each).

``family_of(block)`` finds a block's ``Family`` by its class (no transformers import);
``read_block(block, family)`` checks that the block's maths is what the region computes
and returns its ``BlockLayout``, or raises ``ValueError`` naming the family and the
missing feature.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ...spec import Activation, MoESpec
from . import (
    afmoe,
    aria,
    axk1,
    axk2,
    bailing_hybrid,
    beam,
    cohere2_moe,
    dbrx,
    deepseek_ocr2,
    deepseek_v2,
    deepseek_v3,
    deepseek_v4,
    deepseek_v32,
    doge,
    dots1,
    dots3_note,
    ernie4_5_moe,
    ernie4_5_vl_moe,
    exaone_moe,
    flex_olmo,
    flint,
    glm4_moe,
    glm4_moe_lite,
    glm4v_moe,
    glm5_next,
    glm_moe_dsa,
    gpt_oss,
    granitemoe,
    granitemoe_swa,
    granitemoehybrid,
    granitemoeshared,
    hunyuan_v1_moe,
    hy_v3,
    hy_v4,
    hy_v4_vl,
    inkling,
    inkling2,
    inkling2_loop,
    jamba,
    jetmoe,
    kimi_linear,
    kolibri1,
    laguna,
    lara_mini,
    lfm2_moe,
    llama4,
    longcat_flash,
    mellum,
    mimo_v2_flash,
    minimax,
    minimax_m2,
    minimax_m3_vl,
    mistral4,
    mistral_large4,
    mixtral,
    muse_spark,
    nemotron_h,
    nllb_moe,
    olmoe,
    openai_privacy_filter,
    phimoe,
    qwen2_moe,
    qwen3_5_moe,
    qwen3_moe,
    qwen3_next,
    qwen3_omni_moe,
    qwen3_vl_moe,
    qwen4_exp,
    solar_open,
    step3p7,
    switch_transformers,
    unlimited_ocr,
    zaya,
)
from .base import ExpertsLayout, ExpertTensors, Family, ScoreSide, activation_of, expert_tensors, glu_form

FAMILIES: tuple[Family, ...] = tuple(
    m.FAMILY
    for m in (
        mixtral,
        qwen2_moe,
        qwen3_moe,
        deepseek_v2,
        deepseek_v3,
        olmoe,
        granitemoe,
        granitemoeshared,
        phimoe,
        glm4_moe,
        ernie4_5_moe,
        hunyuan_v1_moe,
        dots1,
        qwen3_next,
        qwen3_vl_moe,
        gpt_oss,
        llama4,
        deepseek_v32,
        minimax,
        minimax_m2,
        kimi_linear,
        jamba,
        flex_olmo,
        longcat_flash,
        jetmoe,
        dbrx,
        mistral4,
        mistral_large4,
        glm4_moe_lite,
        glm_moe_dsa,
        glm4v_moe,
        axk2,
        bailing_hybrid,
        exaone_moe,
        mimo_v2_flash,
        solar_open,
        dots3_note,
        deepseek_ocr2,
        unlimited_ocr,
        qwen3_5_moe,
        qwen4_exp,
        qwen3_omni_moe,
        mellum,
        lara_mini,
        flint,
        kolibri1,
        granitemoe_swa,
        granitemoehybrid,
        aria,
        hy_v3,
        hy_v4,
        hy_v4_vl,
        glm5_next,
        minimax_m3_vl,
        openai_privacy_filter,
        laguna,
        beam,
        step3p7,
        deepseek_v4,
        afmoe,
        zaya,
        axk1,
        inkling,
        lfm2_moe,
        cohere2_moe,
        ernie4_5_vl_moe,
        doge,
        nemotron_h,
        muse_spark,
        inkling2,
        inkling2_loop,
        nllb_moe,
        switch_transformers,
    )
)


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
    return experts.gate_up_proj.shape[0] - (getattr(experts, family.identity_experts) or 0)


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
