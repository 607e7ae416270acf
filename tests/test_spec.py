import pytest
import torch

from hpmoe.spec import PRESETS, GateKind, MoESpec, ParallelSpec, TileSpec, preset


def test_presets_construct_and_carry_the_published_shapes():
    v3 = preset("deepseek-v3")
    assert (v3.hidden, v3.ffn, v3.experts, v3.top_k, v3.shared_experts) == (7168, 2048, 256, 8, 1)
    assert (v3.groups, v3.top_groups, v3.gate) == (8, 4, GateKind.SIGMOID)
    assert preset("mixtral-8x7b").ffn == 14336
    assert preset("qwen3-30b-a3b").shared_ffn == 0
    assert preset("deepseek-v2-lite").shared_ffn == 2 * 1408
    assert set(PRESETS) >= {"deepseek-v3", "deepseek-v2", "deepseek-v2-lite", "qwen3-30b-a3b",
                            "mixtral-8x7b", "tiny"}
    assert preset("tiny", torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("kwargs, field", [
    (dict(top_k=9), "top_k"),
    (dict(hidden=0), "hidden"),
    (dict(groups=3), "groups"),
    (dict(top_groups=5), "top_groups"),
    (dict(shared_experts=-1), "shared_experts"),
    (dict(routed_scaling=0.0), "routed_scaling"),
])
def test_bad_moe_spec_names_the_field(kwargs, field):
    base = dict(hidden=8, ffn=4, experts=8, top_k=2, groups=4, top_groups=2)
    with pytest.raises(ValueError, match=field):
        MoESpec(**(base | kwargs))


def test_bad_dtype_gate_and_activation_raise_type_error():
    with pytest.raises(TypeError, match="dtype"):
        MoESpec(hidden=8, ffn=4, experts=8, top_k=2, dtype=torch.float64)
    with pytest.raises(TypeError, match="gate"):
        MoESpec(hidden=8, ffn=4, experts=8, top_k=2, gate="sigmoid")
    with pytest.raises(TypeError, match="activation"):
        MoESpec(hidden=8, ffn=4, experts=8, top_k=2, activation="gelu")


def test_ep_must_divide_experts():
    with pytest.raises(ValueError, match="ep=3"):
        ParallelSpec(ep=3, tokens_per_rank=4).local_experts(preset("tiny"))
    assert ParallelSpec(ep=4, tokens_per_rank=4).local_experts(preset("tiny")) == 2


def test_tiles_and_unknown_preset():
    with pytest.raises(ValueError, match="rows"):
        TileSpec(rows=0)
    with pytest.raises(ValueError, match="gemm_rows"):
        TileSpec(gemm_rows=-1)
    with pytest.raises(ValueError, match="nope"):
        preset("nope")
