"""The MoE region as torch runs it without hpmoe, on one device: the peers that
``hpmoe.MoE``'s default path is timed against (``hpmoe demo``'s GPU row,
``benchmarks/bench_gpu.py``), and the comparison itself.

  eager_forward    kernel by kernel: gather, one F.linear / SwiGLU / F.linear per expert,
                   unsort, fixed-order top-k sum
  grouped_forward  permute, ``torch._grouped_mm`` up, SwiGLU, ``torch._grouped_mm`` down,
                   unpermute

Each takes the layer's tensors as leaves (x [T, H], w13 [E, 2F, H], w2 [E, H, F], the shared
expert's or None, top-k weights [T, k]) and a ``Peer`` (the routing's static sort, made
once so that no call syncs with the host); backward is autograd's.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .. import refs
from ..nn.layer import MoE
from ..routing import Routing, RoutingKind, synthetic_routing
from ..spec import MoESpec, ParallelSpec
from ..weights import ExpertWeights


@dataclasses.dataclass
class Peer:
    """Static routing state of the torch variants (computed once, so no host sync
    happens inside a timed or captured call)."""

    order: torch.Tensor
    inverse: torch.Tensor
    counts: list[int]
    offs: torch.Tensor

    @staticmethod
    def of(routing: Routing, spec: MoESpec) -> Peer:
        flat = routing.ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=spec.experts)
        return Peer(order=order, inverse=refs.inverse_permutation(order), counts=counts.tolist(),
                    offs=torch.cumsum(counts, 0).to(torch.int32))


def eager_forward(x, w13, w2, sw13, sw2, tw, peer: Peer, spec: MoESpec) -> torch.Tensor:
    """Kernel by kernel: gather, one F.linear / SwiGLU / F.linear per expert, unsort, sum."""
    k = spec.top_k
    rows = x[peer.order // k]
    chunks = enumerate(rows.split(peer.counts))
    outs = [refs.expert_ffn(chunk, w13[e], w2[e]) for e, chunk in chunks if len(chunk)]
    o = torch.cat(outs).index_select(0, peer.inverse).view(x.shape[0], k, spec.hidden)
    shared = refs.expert_ffn(x, sw13, sw2) if sw13 is not None else None
    return refs.topk_sum(o, tw, shared, spec.dtype)


def grouped_forward(x, w13, w2, sw13, sw2, tw, peer: Peer, spec: MoESpec) -> torch.Tensor:
    """Permute, torch._grouped_mm up, SwiGLU, torch._grouped_mm down, unpermute."""
    k, f = spec.top_k, spec.ffn
    rows = x[peer.order // k]
    h = torch._grouped_mm(rows, w13.transpose(1, 2), offs=peer.offs)
    a = F.silu(h[:, :f]) * h[:, f:]
    y = torch._grouped_mm(a, w2.transpose(1, 2), offs=peer.offs)
    o = y.index_select(0, peer.inverse).view(x.shape[0], k, spec.hidden)
    shared = refs.expert_ffn(x, sw13, sw2) if sw13 is not None else None
    return refs.topk_sum(o, tw, shared, spec.dtype)


def torch_step(forward, x, w: ExpertWeights, routing: Routing, dy, peer: Peer, backward: bool):
    """A callable running ``forward`` (and autograd's backward) on leaves made once."""
    leaves = [t.detach().requires_grad_(backward) if t is not None else None
              for t in (x, w.w13, w.w2, w.shared_w13, w.shared_w2, routing.weights)]
    grads = [t for t in leaves if t is not None]

    def step() -> object:
        out = forward(*leaves, peer, w.spec)
        if backward:
            return torch.autograd.grad(out, grads, dy)
        return out
    return step


def layer_step(layer: MoE, x, routing: Routing, dy, backward: bool):
    """A callable running ``layer.region`` (and autograd's backward to x, the top-k
    weights and the layer's expert weights) on leaves made once."""
    xl, wl = (t.detach().requires_grad_(backward) for t in (x, routing.weights))
    params = [p for p in layer.parameters() if p.requires_grad]

    def step() -> object:
        out = layer.region(xl, routing.ids, wl)
        if backward:
            return torch.autograd.grad(out, [xl, wl, *params], dy, allow_unused=True)
        return out
    return step


def grouped_mm_unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why ``torch._grouped_mm`` does not run on ``device`` in ``dtype`` (this torch or
    this GPU lacks it), or None when a small call runs."""
    try:
        a = torch.ones(32, 16, device=device, dtype=dtype)
        torch._grouped_mm(a, torch.ones(2, 16, 16, device=device, dtype=dtype),
                          offs=torch.tensor([16, 32], device=device, dtype=torch.int32))
    except (RuntimeError, NotImplementedError, AttributeError) as err:
        return f"torch._grouped_mm does not run here: {type(err).__name__}: {str(err).splitlines()[0][:100]}"
    return None


def fit_experts(spec: MoESpec, device: torch.device) -> MoESpec:
    """The largest power-of-two expert count (>= groups) whose weights, their gradients and
    the baselines' gradient copies take at most half the device memory."""
    total = torch.cuda.get_device_properties(device).total_memory
    per_expert = 3 * spec.hidden * spec.ffn * spec.dtype.itemsize * 4
    e = spec.experts
    while e > spec.groups and e * per_expert > total // 2:
        e //= 2
    return dataclasses.replace(spec, experts=e)


# ---------------------------------------------------------------------------- the comparison


@dataclasses.dataclass(frozen=True)
class PeerTimes:
    """Training steps (forward + backward) of one layer on one device, medians of
    alternating calls: ``default_ms`` of ``hpmoe.MoE``'s region (its default path,
    autograd), ``grouped_ms`` of ``grouped_forward`` + autograd; ``max_abs_diff``: the
    largest |difference| of their forward outputs."""

    default_ms: float
    grouped_ms: float
    max_abs_diff: float

    @property
    def speedup(self) -> float:
        return self.grouped_ms / self.default_ms


def device_inputs(spec: MoESpec, tokens: int, device: torch.device,
                  seed: int = 0) -> tuple[torch.Tensor, ExpertWeights, Routing, torch.Tensor]:
    """(x [tokens, H], weights, balanced routing, dy [tokens, H]) on ``device``, drawn
    there (a large layer's weights are not made on the host first)."""
    g = torch.Generator(device=device).manual_seed(seed)

    def draw(*shape: int, fan_in: int, dtype: torch.dtype = spec.dtype) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=device) / fan_in**0.5).to(dtype)

    fs = spec.shared_ffn
    router = draw(spec.experts, spec.hidden, fan_in=spec.hidden, dtype=torch.float32)
    w = ExpertWeights(spec=spec, router=router, router_bias=torch.zeros(spec.experts, device=device),
                      w13=draw(spec.experts, 2 * spec.ffn, spec.hidden, fan_in=spec.hidden),
                      w2=draw(spec.experts, spec.hidden, spec.ffn, fan_in=spec.ffn),
                      shared_w13=draw(2 * fs, spec.hidden, fan_in=spec.hidden) if fs else None,
                      shared_w2=draw(spec.hidden, fs, fan_in=fs) if fs else None)
    r = synthetic_routing(RoutingKind.BALANCED, spec, ParallelSpec(1, tokens), seed)
    routing = Routing(ids=r.ids.to(device), weights=r.weights.to(device))
    x, dy = (draw(tokens, spec.hidden, fan_in=1) for _ in range(2))
    return x, w, routing, dy


def default_against_grouped(spec: MoESpec, tokens: int, device: torch.device, reps: int,
                            warmup: int) -> PeerTimes:
    """``hpmoe.MoE(spec)``'s training step against ``grouped_forward`` + autograd on the
    same inputs (``device_inputs``), ``warmup`` then ``reps`` calls of each, alternating."""
    x, w, routing, dy = device_inputs(spec, tokens, device)
    layer = MoE(spec, w)
    peer = Peer.of(routing, spec)
    steps = {"default": layer_step(layer, x, routing, dy, backward=True),
             "grouped": torch_step(grouped_forward, x, w, routing, dy, peer, backward=True)}
    with torch.no_grad():
        mine = layer.region(x, routing.ids, routing.weights)
        theirs = grouped_forward(x, w.w13, w.w2, w.shared_w13, w.shared_w2, routing.weights, peer, spec)
    ms = alternating_ms(steps, reps, warmup, device)
    return PeerTimes(default_ms=ms["default"], grouped_ms=ms["grouped"],
                     max_abs_diff=(mine.float() - theirs.float()).abs().max().item())


def alternating_ms(calls: dict[str, Callable[[], object]], reps: int, warmup: int,
                   device: torch.device) -> dict[str, float]:
    """Median milliseconds of each of ``calls``, called in turn (every call after every
    other one alike), ``warmup`` rounds untimed; CUDA events on a GPU, the host's clock
    elsewhere."""
    if reps < 1 or warmup < 0:
        raise ValueError(f"reps={reps!r} must be >= 1 and warmup={warmup!r} >= 0")
    names = list(calls)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(warmup + reps):
        turn = i % len(names)
        for name in names[turn:] + names[:turn]:
            ms = _call_ms(calls[name], device)
            if i >= warmup:
                times[name].append(ms)
    return {name: statistics.median(t) for name, t in times.items()}


def _call_ms(call: Callable[[], object], device: torch.device) -> float:
    if device.type != "cuda":
        start = time.perf_counter()
        call()
        return (time.perf_counter() - start) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


# ---------------------------------------------------------------------------- transformers' blocks


def hf_block(family: str, spec: MoESpec, device: torch.device) -> torch.nn.Module:
    """transformers' MoE block of ``family`` (``deepseek_v3``, ``qwen3_moe`` or
    ``mixtral``) in the layer shape ``spec``, built on ``device`` in ``spec.dtype`` with
    every parameter drawn N(0, 1/fan_in) there (a large block is not made on the host
    first; transformers leaves a bare block's expert tensors unfilled)."""
    h, f, e, k = spec.hidden, spec.ffn, spec.experts, spec.top_k
    if family == "deepseek_v3":
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

        from ..nn.hf import tiny_deepseek_v3_config

        cls, config = DeepseekV3MoE, tiny_deepseek_v3_config(
            hidden_size=h, moe_intermediate_size=f, n_routed_experts=e, num_experts_per_tok=k,
            n_shared_experts=spec.shared_experts, n_group=spec.groups, topk_group=spec.top_groups,
            routed_scaling_factor=spec.routed_scaling, norm_topk_prob=spec.norm_topk)
    elif family == "qwen3_moe":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        from ..nn.hf import tiny_qwen3_moe_config

        cls, config = Qwen3MoeSparseMoeBlock, tiny_qwen3_moe_config(
            hidden_size=h, moe_intermediate_size=f, num_experts=e, num_experts_per_tok=k,
            norm_topk_prob=spec.norm_topk)
    elif family == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        cls, config = MixtralSparseMoeBlock, MixtralConfig(
            hidden_size=h, intermediate_size=f, num_local_experts=e, num_experts_per_tok=k,
            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, vocab_size=64)
    else:
        raise ValueError(f"family={family!r} is not one of ['deepseek_v3', 'mixtral', 'qwen3_moe']")
    with torch.device(device):
        block = cls(config)
    g = torch.Generator(device=device).manual_seed(1)
    with torch.no_grad():
        for _, p in sorted(block.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=g, device=device) / p.shape[-1] ** 0.5)
    return block.to(spec.dtype)


def experts_configs(block: torch.nn.Module) -> list:
    """The configs whose ``_experts_implementation`` picks ``block``'s experts' forward."""
    configs = (getattr(m, "config", None) for m in block.modules())
    return [c for c in configs if hasattr(c, "_experts_implementation")]


def block_step(module: torch.nn.Module, block: torch.nn.Module, impl: str, x: torch.Tensor, dy: torch.Tensor,
               backward: bool) -> Callable[[], object]:
    """A step of ``module`` (``block`` itself, or an ``hpmoe.MoE`` over it sharing its
    submodules and config) with the block's experts implementation set to ``impl``
    (``"hpmoe"`` runs the region): forward on x [N, H] as one sequence [1, N, H], and the
    gradients of x and every parameter."""
    xl = x.detach().view(1, *x.shape).requires_grad_(backward)
    params = [p for p in module.parameters() if p.requires_grad]

    def step() -> object:
        for c in experts_configs(block):
            c._experts_implementation = impl
        out = module(xl)
        out = out[0] if isinstance(out, tuple) else out
        if backward:
            return torch.autograd.grad(out, [xl, *params], dy.view_as(out), allow_unused=True)
        return out
    return step
