"""Every family of hpmoe.nn.families against transformers: logits, aux loss and every
gradient of a tiny model with its MoE blocks replaced, on kernel by kernel and on the
taskflow (2 virtual ranks, small tiles), three families on the persistent kernel (the
Triton interpreter); each check asserts the path its blocks ran.  Refusals name the
family."""

import copy
import pickle

import pytest
import torch

from hpmoe.nn.conformance import CHECK_TILES, PERSISTENT_TILES, check_family, run_model, tiny_model
from hpmoe.nn.families import FAMILIES, family_of
from hpmoe.nn.layer import MoE
from hpmoe.nn.replace import InitThroughBlocks, replace_moe_blocks
from hpmoe.schedule.auto import Path

from .helpers import Pin, pin, ran

pytest.importorskip("transformers")
FAMILY = {f.name: f for f in FAMILIES}
ATOL = 2e-5  # fp32; measured <= 3.3e-6 (Qwen3-Next), <= 2e-7 elsewhere, on either path
PATHS = [Path.KERNEL_BY_KERNEL, Path.TASKFLOW]


def _pinned(path: Path) -> Pin:
    """What ``check_family(path=path)`` pins: 2 virtual ranks, CHECK_TILES (the
    interpreter: PERSISTENT_TILES)."""
    return pin(path, 2, PERSISTENT_TILES if path is Path.PERSISTENT else CHECK_TILES)


TASKFLOW = _pinned(Path.TASKFLOW)


def _within_atol(row) -> None:
    """Both blocks replaced, logits and every gradient within ATOL of transformers'."""
    assert row.blocks == 2 and row.logits_err < ATOL and row.grad_err < ATOL


@pytest.mark.parametrize("path", PATHS, ids=[p.value for p in PATHS])
@pytest.mark.parametrize("family", FAMILIES, ids=[f.name for f in FAMILIES])
def test_family_equals_transformers_or_is_refused_by_name(family, path):
    row = check_family(family, path=path)
    if family.refused:
        assert row.refused.startswith(f"{family.name} ({family.block}) is not supported: ")
        return
    assert not row.refused
    _within_atol(row)
    assert row.aux_err is None or row.aux_err < 1e-6
    ran(row.calls, _pinned(path).kind, **_pinned(path).fields)


SUPPORTED = [f for f in FAMILIES if not f.refused]


@pytest.mark.parametrize("path", PATHS, ids=[p.value for p in PATHS])
@pytest.mark.parametrize("family", SUPPORTED, ids=[f.name for f in SUPPORTED])
def test_family_in_bf16_is_as_close_to_fp32_as_transformers_in_bf16(family, path):
    """Both models in bf16 against transformers' fp32 run: hpmoe's errors (logits, aux loss,
    every gradient) within twice transformers' own bf16 errors plus 1e-3 (measured: at most
    1.5x on logits and gradients)."""
    row = check_family(family, dtype=torch.bfloat16, path=path)
    ref = row.reference
    assert row.logits_err <= 2 * ref.logits_err + 1e-3
    assert row.grad_err <= 2 * ref.grad_err + 1e-3
    assert row.aux_err is None or row.aux_err <= 2 * ref.aux_err + 1e-3
    ran(row.calls, _pinned(path).kind, **_pinned(path).fields)


# a top-2 softmax block without shared experts, one with a shared expert fused into the
# region, a top-1 block; each check takes about 5-20 s in the interpreter
PERSISTENT = ["qwen3_moe", "deepseek_v3", "zaya"]


@pytest.mark.parametrize("name", PERSISTENT)
def test_family_on_the_persistent_kernel_equals_transformers(name):
    """The persistent kernel in the Triton interpreter (2 virtual ranks, tiles that leave
    every block partial), forward and backward, against transformers."""
    pytest.importorskip("triton")
    row = check_family(FAMILY[name], path=Path.PERSISTENT)
    _within_atol(row)
    assert row.aux_err is None or row.aux_err < 1e-6
    ran(row.calls, _pinned(Path.PERSISTENT).kind, **_pinned(Path.PERSISTENT).fields)


def test_llama4_scores_on_the_expert_input_with_two_experts_per_token():
    """Llama 4's released models route to one expert; the region runs once per slot, so
    top-2 is exact as well."""
    row = check_family(FAMILY["llama4"], num_experts_per_tok=2)
    _within_atol(row)
    ran(row.calls, TASKFLOW.kind, **TASKFLOW.fields)


def test_longcat_routes_to_identity_experts_and_stays_exact():
    """With the score-correction bias at zero the tiny model routes tokens to both the
    computing and the identity experts; logits and every gradient still equal transformers'."""
    model = tiny_model(FAMILY["longcat_flash"])
    for layer in model.model.layers:
        layer.mlp.router.e_score_correction_bias.zero_()
    original = copy.deepcopy(model)
    replace_moe_blocks(model, **TASKFLOW.options)
    chosen = []
    model.model.layers[0].mlp.router.register_forward_hook(lambda m, i, out: chosen.append(out[2]))
    ids = torch.arange(24).view(2, 12) % 61 + 2
    (want, _, want_grads), (got, _, got_grads) = run_model(original, ids), run_model(model, ids)
    assert bool((chosen[0] >= 8).any()) and bool((chosen[0] < 8).any())  # both kinds in the batch
    assert float((got - want).abs().max()) < ATOL
    assert max(float((got_grads[n] - g).abs().max()) for n, g in want_grads.items()) < ATOL
    ran(model, TASKFLOW.kind, **TASKFLOW.fields)


def test_dbrx_divides_by_the_configured_p_norm():
    ffn = dict(FAMILY["dbrx"].tiny["ffn_config"], moe_normalize_expert_weights=2.0)
    row = check_family(FAMILY["dbrx"], ffn_config=ffn)
    _within_atol(row)
    ran(row.calls, TASKFLOW.kind, **TASKFLOW.fields)


@pytest.mark.parametrize("path", PATHS, ids=[p.value for p in PATHS])
@pytest.mark.parametrize("act", ["gelu", "gelu_pytorch_tanh"])
def test_gelu_experts_are_computed_not_replaced_by_silu(act, path):
    row = check_family(FAMILY["qwen3_moe"], hidden_act=act, path=path)
    _within_atol(row)
    ran(row.calls, _pinned(path).kind, **_pinned(path).fields)


def test_an_activation_without_kernel_is_refused_at_replacement():
    model = tiny_model(FAMILY["qwen3_moe"], hidden_act="relu2")
    with pytest.raises(ValueError, match="ReLUSquaredActivation is not supported"):
        replace_moe_blocks(model)


@pytest.mark.parametrize("name", ["qwen2_moe", "deepseek_v3", "granitemoe"])
def test_replacement_keeps_parameter_objects_and_state_dict(name):
    model = tiny_model(FAMILY[name])
    before = {k: (v.data_ptr(), v.clone()) for k, v in model.state_dict().items()}
    params = [id(p) for p in model.parameters()]
    replace_moe_blocks(model)
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(after[k].data_ptr() == ptr and torch.equal(after[k], v) for k, (ptr, v) in before.items())
    assert [id(p) for p in model.parameters()] == params
    assert sum(isinstance(m, MoE) for m in model.modules()) == 2


def test_an_unsupported_variant_is_refused_before_anything_is_replaced():
    model = tiny_model(FAMILY["qwen3_moe"], hidden_act="relu2")  # an activation without a kernel
    with pytest.raises(ValueError, match="ReLUSquaredActivation"):
        replace_moe_blocks(model)
    assert not any(isinstance(m, MoE) for m in model.modules())
    blocks = [m for m in model.modules() if family_of(m) is FAMILY["qwen3_moe"]]
    with pytest.raises(ValueError, match="ReLUSquaredActivation"):
        MoE.from_hf(blocks[0])


def test_experts_with_a_gate_of_their_own_are_refused_by_name(monkeypatch):
    """A family that does not read its experts' own ``_apply_gate`` refuses it instead of
    computing the default gate."""
    model = tiny_model(FAMILY["qwen3_moe"])
    experts = type(model.model.layers[0].mlp.experts)
    monkeypatch.setattr(experts, "_apply_gate", lambda self, gate_up: gate_up, raising=False)
    with pytest.raises(ValueError, match="qwen3_moe: experts._apply_gate .* its own gate"):
        replace_moe_blocks(model)


@pytest.mark.parametrize(("alpha", "limit"), [(1.702, 0.05), (1.0, 0.2)])
def test_gpt_oss_clamps_where_its_limit_bites(alpha, limit):
    """A limit low enough that the tiny model's pre-activations cross it; alpha 1 is SiLU."""
    row = check_family(FAMILY["gpt_oss"], swiglu_alpha=alpha, swiglu_limit=limit)
    _within_atol(row)
    ran(row.calls, TASKFLOW.kind, **TASKFLOW.fields)


def test_a_block_argument_is_refused_where_the_family_routes_without_it():
    layer = MoE.from_hf(tiny_model(FAMILY["qwen3_moe"]).model.layers[0].mlp)
    with pytest.raises(TypeError, match="takes hidden_states only"):
        layer(torch.zeros(3, 32), torch.zeros(3))
    with pytest.raises(TypeError, match=r"model.init_weights\(\)"):  # the block's parameters are the model's
        layer.reset_parameters()


@pytest.mark.parametrize("name", ["step3p7", "bailing_hybrid"])
def test_a_layer_clamped_after_the_activation_is_refused_by_name(name):
    """Step-3.7-Flash (and Ling, since transformers 5.25) clamps ``min(silu(gate), limit)`` on
    some layers; the region clamps the gate before the activation, so such a block is
    refused by name, and the unclamped layer of the same model is not what fails."""
    model = tiny_model(FAMILY[name], swiglu_limits=[0.0, 7.0])
    experts = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    if not hasattr(experts[-1], "limit"):
        pytest.skip(f"this transformers' {name} experts do not clamp")
    clamped = f"{name}: experts clamp after the activation, min\\(silu\\(gate\\), 7.0\\)"
    with pytest.raises(ValueError, match=clamped):
        replace_moe_blocks(model)
    assert not any(isinstance(m, MoE) for m in model.modules())


def _exact(original, model, **inputs) -> None:
    """Logits (or last hidden state) and every gradient of ``model`` equal ``original``'s."""
    def run(m):
        m.zero_grad()
        out = m(**inputs)
        y = out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state
        y.square().mean().backward()
        return y.detach(), {n: p.grad for n, p in m.named_parameters()}

    (want, want_grads), (got, got_grads) = run(original), run(model)
    assert float((got - want).abs().max()) < ATOL
    for name, grad in want_grads.items():
        assert (grad is None) == (got_grads[name] is None), name
        assert grad is None or float((got_grads[name] - grad).abs().max()) < ATOL, name


def test_deepseek_v4_hash_layer_routes_by_token_id():
    """The hash layer's router reads the block's ``input_ids`` argument (``Family.route``):
    a random token-id -> experts table routes tokens to every expert, exactly."""
    model = tiny_model(FAMILY["deepseek_v4"])
    gate = model.model.layers[0].mlp.gate
    assert model.model.layers[0].mlp.is_hash
    gate.tid2eid.copy_(torch.randint(0, 8, gate.tid2eid.shape, generator=torch.Generator().manual_seed(1)))
    original = copy.deepcopy(model)
    replace_moe_blocks(model, **TASKFLOW.options)
    ids = torch.arange(24).view(2, 12) % 61 + 2
    assert len(gate.tid2eid[ids].unique()) == 8
    _exact(original, model, input_ids=ids)
    ran(model, TASKFLOW.kind, **TASKFLOW.fields)


def test_lfm2_moe_without_expert_bias():
    row = check_family(FAMILY["lfm2_moe"], use_expert_bias=False)
    _within_atol(row)
    ran(row.calls, TASKFLOW.kind, **TASKFLOW.fields)


@pytest.mark.parametrize("over", [dict(shared_expert_combination_strategy="sum"), dict(num_shared_experts=0),
                                  dict(expert_selection_fn="sigmoid")])
def test_cohere2_moe_combinations(over):
    """The shared experts summed with the routed ones, absent (the block has no
    ``shared_experts`` then), and the sigmoid selection."""
    row = check_family(FAMILY["cohere2_moe"], **over)
    _within_atol(row)
    ran(row.calls, TASKFLOW.kind, **TASKFLOW.fields)


def test_ernie4_5_vl_sub_blocks_take_flattened_tokens_of_mixed_modalities():
    """With text and vision tokens in one batch the MoE layer hands each sub-block its
    modality's hidden states flattened to one dimension and reads back flat outputs."""
    model = tiny_model(FAMILY["ernie4_5_vl_moe"])
    original = copy.deepcopy(model)
    replace_moe_blocks(model, **TASKFLOW.options)
    ids = torch.arange(24).view(2, 12) % 61 + 2
    types = (torch.arange(24).view(2, 12) % 3 == 0).int()
    _exact(original, model, input_ids=ids, moe_mm_token_type_ids=types)
    records = ran(model, TASKFLOW.kind, **TASKFLOW.fields)
    assert sorted(r.tokens for r in records) == [8, 16]  # the vision and the text sub-block ran


@pytest.mark.parametrize(("name", "tensor"), [("jetmoe", "bias"), ("minimax_m2", "e_score_correction_bias")])
def test_the_models_own_init_reaches_a_replaced_blocks_tensors(name, tensor):
    """transformers' ``_init_weights`` initialises a block's own tensors only when the module
    is the block class: a replaced block is handed to it as the block (the same tensors)."""
    model = tiny_model(FAMILY[name])
    replace_moe_blocks(model)
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    for layer in layers:
        getattr(layer, tensor).data.fill_(float("nan"))
    model.apply(model._init_weights)
    assert all(torch.equal(getattr(m, tensor), torch.zeros_like(getattr(m, tensor))) for m in layers)
    assert isinstance(pickle.loads(pickle.dumps(model._init_weights)), InitThroughBlocks)
