"""Muse Spark text blocks: sigmoid router with score-correction bias; the experts run in a
projected space (``pre_expert_proj`` and a norm before, ``post_expert_proj`` after) and each
expert's output is RMS-normalised before its routing weight; refused."""

from .base import Family

FAMILY = Family(
    name="muse_spark",
    module="transformers.models.muse_spark.modeling_muse_spark",
    block="MuseSparkMoE",
    config="MuseSparkTextConfig",
    model="MuseSparkTextModel",
    tiny=dict(num_local_experts=8, num_experts_per_tok=2, moe_hidden_size=32, mlp_layer_types=["sparse"] * 2),
    refused="a per-expert RMSNorm on each expert's output (post_expert_norm, before the routing weight) "
            "and projections into and out of the experts' space around them",
)
