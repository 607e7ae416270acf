"""Switch Transformers: top-1 router with per-sequence expert capacity (tokens past it
dropped) and input jitter; experts are a ModuleDict of non-gated ``wo(act(wi(x)))`` MLPs;
refused."""

from .base import Family

FAMILY = Family(
    name="switch_transformers",
    module="transformers.models.switch_transformers.modeling_switch_transformers",
    block="SwitchTransformersSparseMLP",
    config="SwitchTransformersConfig",
    model="SwitchTransformersModel",
    tiny=dict(d_model=32, d_ff=16, d_kv=16, num_heads=2, num_layers=2, num_decoder_layers=2,
              num_sparse_encoder_layers=1, num_sparse_decoder_layers=1, num_experts=8, expert_capacity=8,
              decoder_start_token_id=0),
    router="router",
    refused="non-gated experts (a ModuleDict of wi/wo MLPs) behind a top-1 router with per-sequence "
            "expert capacity (overflowing tokens dropped)",
)
