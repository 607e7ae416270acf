"""``benchmarks/bench_memory.py``: the saved-tensor counter against byte counts worked out
by hand, and the minimal set against the issue's per-token figures."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from hpmoe.spec import preset

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
try:
    import bench_memory as bm
finally:
    sys.path.remove(str(ROOT / "benchmarks"))

N = 8  # tokens: N*k = 16 rows


def _count(call: bm.Call, dy: torch.Tensor, weights: list[torch.Tensor]) -> bm.SavedBytes:
    got, peak = bm.measure(call, dy, weights)
    assert peak is None  # no CUDA here
    return got


def test_a_view_counts_its_whole_storage_once_and_its_own_bytes_per_save() -> None:
    x = torch.ones(4, 8, requires_grad=True)
    z = x * 2.0  # [4, 8] fp32: 128 bytes; mul by a number saves no tensor
    call = bm.Call(lambda: z[:1].sin() + z[:1].cos(), [], x)  # each saves z[:1]: 32 bytes
    got = _count(call, torch.ones(1, 8), [])
    assert (got.saved, got.views, got.saves) == (128, 64, 2)
    assert [(t.shape, t.storage_nbytes, t.kind) for t in got.tensors] == [((1, 8), 128, "activation")]


class _KeepsOnCtx(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: torch.Tensor) -> torch.Tensor:
        ctx.kept = [t * 3.0]  # an attribute, never through save_for_backward
        return t * 3.0

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        return g * 3.0


def test_tensors_a_node_holds_as_attributes_are_counted_as_held_and_parameters_are_not() -> None:
    x = torch.ones(5, 3, requires_grad=True)
    w = torch.ones(3, 3, requires_grad=True)
    call = bm.Call(lambda: _KeepsOnCtx.apply(x @ w), [w], x)  # mm saves x (input) and w (parameter)
    got = _count(call, torch.ones(5, 3), [])
    assert got.saves == 2
    assert (got.saved, got.held) == (60 + 60, 60)
    kinds = sorted((t.kind, t.held) for t in got.tensors)
    assert kinds == [("activation", True), ("input", False)]


def test_the_grouped_mm_peer_keeps_what_its_ops_save() -> None:
    """preset tiny (H 32, F 16, k 2, one shared expert of width 16, fp32), N tokens.
    Storages, in bytes per token: gather index N*k int64 (16), gathered rows N*k*H (256),
    pre-activation h N*k*2F (256: SiLU saves its gate half, the product its up half),
    SiLU output N*k*F (128), activation N*k*F (128), unpermute index N*k int64 (16),
    expert outputs N*k*H (256: the top-k sum saves a slot view of them per slot), the input
    N*H (128), the shared expert's pre-activation N*2Fs (128), SiLU output and activation
    N*Fs (64 + 64), the top-k weights N*k fp32 (8): 1448 a token, plus the group offsets
    E int32 (32 bytes), saved by both GEMMs: counted once in ``saved``, twice in ``views``."""
    spec = preset("tiny")
    x, w, routing, dy = bm.device_inputs(spec, N, torch.device("cpu"))
    got = _count(bm.grouped_call(w, x, routing), dy, bm.weight_refs(w))
    assert got.saved == 1448 * N + 32
    assert got.views == 1448 * N + 64
    assert got.weight_copies == got.held == 0
    shapes = {(t.shape, t.storage_nbytes, t.kind) for t in got.tensors}
    rows, h = N * spec.top_k, 2 * spec.ffn
    assert ((rows, spec.hidden), rows * spec.hidden * 4, "activation") in shapes  # gathered input
    assert ((rows, spec.ffn), rows * h * 4, "activation") in shapes  # a half of the pre-activation
    assert ((N, spec.hidden), N * spec.hidden * 4, "input") in shapes


def test_hpmoe_default_path_is_counted_and_names_its_path() -> None:
    spec = preset("tiny")
    r = bm._layer_row(("tiny", spec, N), "hpmoe-default", {},
                      lambda: bm.device_inputs(spec, N, torch.device("cpu")))
    assert r["path"].endswith("Path")
    assert r["saved_bytes"] > N * spec.hidden * 4
    assert r["x_minimal"] == pytest.approx(r["saved_bytes"] / (536 * N), abs=1e-3)


def test_the_minimal_set_is_the_issues_40k_elements_a_deepseek_v3_token() -> None:
    spec = preset("deepseek-v3")  # bf16, H 7168, F 2048, k 8, one shared expert of 2048
    assert bm.minimal_bytes(spec, 256) == 256 * (7168 * 2 + 8 * (8 + 4) + (8 * 4096 + 4096) * 2)
    # layer input + routed pre-activation, ~40k elements, and the shared expert's 4096
    assert bm.minimal_bytes(spec, 1) == 2 * (39936 + 4096) + 96
    assert bm.all_kept_bytes(spec, 1) == 2 * 163840  # everything: ~164k elements
    # fp32: 408 a token and the shared expert's pre-activation, 2 * 16 * 4
    assert bm.minimal_bytes(preset("tiny"), 3) == 3 * (32 * 4 + 2 * 12 + 2 * 32 * 4 + 2 * 16 * 4)


def test_large_presets_keep_fewer_experts_to_fit_the_budget() -> None:
    ds = bm.bench_spec("deepseek-v3", torch.float32, 1536 * 2**20)  # 168 MiB an expert, shared too
    assert (ds.experts, ds.groups, ds.top_groups, ds.top_k) == (8, 1, 1, 8)
    assert bm.bench_spec("small", torch.float32, 1536 * 2**20) == preset("small", torch.float32)
    assert bm.bench_spec("mixtral-8x7b", torch.float32, 1536 * 2**20).experts == 2  # 672 MiB an expert
