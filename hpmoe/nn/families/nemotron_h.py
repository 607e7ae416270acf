"""Nemotron-H: DeepSeek-V3-style sigmoid router, shared MLP; its routed experts are not gated
(``down_proj(act(up_proj(x)))``, squared ReLU), optionally between latent projections;
refused."""

from .base import Family

FAMILY = Family(
    name="nemotron_h",
    module="transformers.models.nemotron_h.modeling_nemotron_h",
    block="NemotronHMoE",
    config="NemotronHConfig",
    model="NemotronHForCausalLM",
    tiny=dict(n_routed_experts=8, num_experts_per_tok=2, moe_shared_expert_intermediate_size=16,
              layers_block_type=["moe", "full_attention", "moe"], use_mamba_kernels=False),
    refused="non-gated experts (down_proj(act(up_proj(x))), squared ReLU), optionally between latent "
            "projections (moe_latent_size)",
)
