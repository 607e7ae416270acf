"""DeepSeek-V3.2: DeepSeek-V3's MoE block (sigmoid router with score-correction bias and
group limits, renormalised and scaled, shared experts); its sparse attention is outside
the block."""

from .base import Family
from .deepseek_v3 import FAMILY as V3

FAMILY = Family(
    name="deepseek_v32",
    module="transformers.models.deepseek_v32.modeling_deepseek_v32",
    block="DeepseekV32MoE",
    config="DeepseekV32Config",
    model="DeepseekV32ForCausalLM",
    tiny=dict(V3.tiny, q_lora_rank=8, num_key_value_heads=2, index_n_heads=2, index_head_dim=8, index_topk=8),
    shared="shared_experts",
)
