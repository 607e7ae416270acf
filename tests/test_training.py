"""Training with hpmoe blocks: DDP and FSDP2 on 2 gloo ranks (with and without an EP
group, uneven token counts, one rank at 0 tokens; each case pinned to a path that it
asserts ran) give the single-process full-batch gradients; non-reentrant checkpointing
frees the region's activations."""

import dataclasses
import gc
import sys
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hpmoe.engine import ExactPath, KernelByKernelPath, RuntimePath
from hpmoe.nn.conformance import CHECK_TILES
from hpmoe.nn.families import FAMILIES
from hpmoe.nn.replace import replace_moe_blocks
from hpmoe.schedule import SchedulePolicy
from hpmoe.schedule.auto import Path as Run
from hpmoe.testing import spawn_gloo

from .helpers import ran

pytest.importorskip("transformers")
DEEPSEEK_V3 = next(f for f in FAMILIES if f.name == "deepseek_v3")
H = 32


def _net() -> nn.Sequential:
    """Linear -> DeepSeek-V3 MoE block (sigmoid router, groups, a shared expert), seeded."""
    torch.manual_seed(0)
    block = DEEPSEEK_V3.block_class()(DEEPSEEK_V3.tiny_config())
    net = nn.Sequential(nn.Linear(H, H), block)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        block.gate.e_score_correction_bias.copy_(torch.randn(8, generator=g) * 0.1)
    return net


def _batch(tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(tokens)
    return torch.randn(tokens, H, generator=g), torch.randn(tokens, H, generator=g)


def _grads(net: nn.Module, x: torch.Tensor, target: torch.Tensor, scale: float) -> dict[str, torch.Tensor]:
    out = net(x.unsqueeze(0)).squeeze(0)
    ((out - target).square().sum() * scale).backward()
    full = {}
    for name, p in net.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        full[name.removeprefix("module.")] = g.detach().float().clone()
    return full


def _pinned(path: Run, ep: bool) -> tuple[dict, type, dict]:
    """replace_moe_blocks' options that pin ``path`` (the taskflow: in one process the
    exact executors, on the EP group the runtime under HYPERPARALLEL), the path class a
    call then runs and its fields."""
    group = dict(ep_group=dist.group.WORLD) if ep else {}
    if path is Run.KERNEL_BY_KERNEL:
        return dict(backend="kernel_by_kernel", **group), KernelByKernelPath, {}
    if ep:
        hyper = SchedulePolicy.HYPERPARALLEL
        return dict(schedule=hyper, **group), RuntimePath, dict(policy=hyper, tiles=CHECK_TILES)
    return dict(schedule=None), ExactPath, dict(ep=1, tiles=CHECK_TILES)


def _rank(rank, world, counts, wrap, ep, bf16, path, hpmoe=True):
    net = _net()
    options, kind, fields = _pinned(path, ep)
    if hpmoe:
        replace_moe_blocks(net, tiles=CHECK_TILES, **options)
    if wrap == "ddp":
        net = nn.parallel.DistributedDataParallel(net)
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
        mesh = dist.device_mesh.init_device_mesh("cpu", (world,))
        for module in (net[1], net):
            fully_shard(module, mesh=mesh, **({"mp_policy": mp} if mp else {}))
    x, target = _batch(sum(counts))
    mine = slice(sum(counts[:rank]), sum(counts[:rank + 1]))
    grads = _grads(net, x[mine], target[mine], world / sum(counts))  # DDP/FSDP average over ranks
    dist.barrier()
    if hpmoe:
        ran(net, kind, **fields)
    if bf16 and hpmoe:  # the reference: transformers' own block under the same mixed precision
        return grads, _rank(rank, world, counts, wrap, ep, bf16, path, hpmoe=False)
    return grads


TASKFLOW, KBK = Run.TASKFLOW, Run.KERNEL_BY_KERNEL  # with an EP group, the taskflow is the runtime's
CASES = {"ddp-3-4-taskflow": ("ddp", (3, 4), False, False, TASKFLOW),
         "ddp-ep-0-5-runtime": ("ddp", (0, 5), True, False, TASKFLOW),
         "fsdp2-0-5-kernel-by-kernel": ("fsdp", (0, 5), False, False, KBK),
         "fsdp2-ep-3-4-kernel-by-kernel": ("fsdp", (3, 4), True, False, KBK),
         "fsdp2-ep-bf16-mixed-5-2-runtime": ("fsdp", (5, 2), True, True, TASKFLOW)}


def _all_cases(rank, world):
    """Every case on the same two ranks (one process start for all of them)."""
    return {name: _rank(rank, world, counts, wrap, ep, bf16, path)
            for name, (wrap, counts, ep, bf16, path) in CASES.items()}


@pytest.fixture(scope="module")
def wrapped_runs():
    runs = spawn_gloo(_all_cases, 2, timeout=300)
    return {name: [runs[r][name] for r in (0, 1)] for name in CASES}


@pytest.mark.parametrize("case", list(CASES))
def test_data_parallel_wrappers_give_the_full_batch_gradients(case, wrapped_runs):
    wrap, counts, ep, bf16, _ = CASES[case]
    got = wrapped_runs[case]
    x, target = _batch(sum(counts))
    want = _grads(_net(), x, target, 1 / sum(counts))
    if bf16:  # bf16 rounding differs elementwise (fp32 vs bf16 combine): compare norms
        got, want = [g for g, _ in got], got[0][1]
        for name, g in want.items():
            assert all(float((r[name] - g).norm() / g.norm()) < 1e-2 for r in got), name
        return
    tol = dict(atol=1e-5, rtol=1e-5)
    for rank in (0, 1):
        assert got[rank].keys() == want.keys()
        for name, g in want.items():
            torch.testing.assert_close(got[rank][name], g, **tol,
                                       msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}")


def _spy_taskflow(monkeypatch, packed: list) -> tuple:
    from hpmoe.engine import RegionState
    from hpmoe.regions.backward_kernels import SavedActivations

    names = [f.name for f in dataclasses.fields(SavedActivations) if f.name != "x"]
    pack = RegionState.pack

    def spy(state):
        packed.extend(weakref.ref(getattr(s, f)) for s in state.saved for f in names
                      if getattr(s, f) is not None)
        return pack(state)

    monkeypatch.setattr(RegionState, "pack", spy)
    # h of every routed row and the shared h (no expert output; the gated activations
    # recomputed and the rows gathered again: the default Recompute.PERMUTATION)
    return dict(schedule=None), ExactPath, lambda rows, tokens: rows * 2 * 16 + tokens * 2 * 16


def _spy_kernel_by_kernel(monkeypatch, packed: list) -> tuple:
    from hpmoe.exec.kernel_by_kernel import KernelByKernelState

    pack = KernelByKernelState.pack
    activations = [n for n in KernelByKernelState.TENSORS if n not in ("x", "topk_weights")]

    def spy(state):
        packed.extend(weakref.ref(getattr(state, n)) for n in activations if getattr(state, n) is not None)
        return pack(state)

    monkeypatch.setattr(KernelByKernelState, "pack", spy)
    # the routed rows' pre-activation and the shared one: the rows are gathered again from
    # x, the gated activations recomputed, the expert outputs never needed
    return dict(backend="kernel_by_kernel"), KernelByKernelPath, lambda rows, tokens: (rows + tokens) * 2 * 16


@pytest.mark.parametrize("spy", [_spy_taskflow, _spy_kernel_by_kernel])
def test_non_reentrant_checkpointing_frees_the_region_activations(monkeypatch, spy):
    from torch.utils.checkpoint import checkpoint

    packed = []  # weak references to every saved activation but the input x
    options, kind, elements = spy(monkeypatch, packed)
    net = _net()
    replace_moe_blocks(net, tiles=CHECK_TILES, **options)
    x = torch.randn(1, 64, H, requires_grad=True)
    alive = {}
    for mode in ("plain", "checkpoint"):
        packed.clear()
        out = net(x) if mode == "plain" else checkpoint(net, x, use_reentrant=False)
        gc.collect()
        alive[mode] = sum(t().nbytes for t in packed if t() is not None)
        out.sum().backward()
        ran(net, kind, tokens=64)
    assert alive["plain"] == 4 * elements(64 * net[1].spec.top_k, 64)  # every routed row once
    assert alive["checkpoint"] == 0


def test_training_steps_with_the_aux_loss_follow_the_original_model():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import train_aux_loss

    curves = train_aux_loss.compare(steps=3)
    assert curves.max_diff() < 1e-5  # 50 steps: see docs/training.md
    assert curves.original[-1][0] < curves.original[0][0]
