"""``offload=True``: the activations a call keeps wait for its backward in host memory.

On the CPU the option moves nothing and says so.  The moving itself is device-generic
(``engine.offload``: on a device without streams its copies are synchronous), so it is
run here with ``offload.pays`` made to answer yes: the gradients keep their bits on every
path and recompute mode, the kept activations leave autograd's saved tensors, a later
layer's backward starts bringing back the earlier one's, and under activation
checkpointing it leaves the tensors to the checkpoint.  On a CUDA device (``-m gpu``) the
device memory a call holds between its forward and backward drops by the pre-activation's
bytes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from hpmoe.engine import offload
from hpmoe.nn.layer import MoE
from hpmoe.schedule.auto import Path
from hpmoe.spec import DispatchMode, Recompute, preset
from hpmoe.weights import ExpertWeights

from .helpers import TINY_TILES, pin, ran

SPEC = preset("tiny")  # with a shared expert: routed and shared pre-activations
PINS = {"kernel-by-kernel": pin(Path.KERNEL_BY_KERNEL, 1), "taskflow": pin(Path.TASKFLOW, 2),
        "taskflow-dedup": pin(Path.TASKFLOW, 2,
                              dataclasses.replace(TINY_TILES, dispatch=DispatchMode.PER_RANK))}


def _data(tokens: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, SPEC.hidden, generator=g), torch.randn(tokens, SPEC.hidden, generator=g)


def _region_saved(out: torch.Tensor) -> list[int]:
    """The bytes of each tensor the region's autograd node keeps (found from ``out``)."""
    todo, seen = [out.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "RegionFunctionBackward":
            return [t.numel() * t.element_size() for t in node.saved_tensors if t is not None]
        todo += [f for f, _ in node.next_functions]
    raise AssertionError("no region node behind the output")


def _step(layer: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor, saved: list | None = None):
    """(out, dx, {name: grad}) of one step; ``saved``: gets the bytes of each tensor the
    region's node keeps."""
    x = x.clone().requires_grad_()
    layer.zero_grad()
    out = layer(x)
    if saved is not None:
        saved += _region_saved(out)
    out.backward(dy)
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}


def _equal(a, b) -> None:
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert a[2].keys() == b[2].keys() and all(torch.equal(a[2][n], b[2][n]) for n in a[2])


@pytest.fixture
def moved(monkeypatch):
    """Offloading made to move on the CPU (synchronous copies), every copy counted."""
    monkeypatch.setattr(offload, "pays", lambda device: True)
    sent, fetched = [], []
    send, fetch = offload.Offloaded.send, offload.Offloaded.fetch

    def counted_send(t, stream):
        sent.append(t.numel() * t.element_size())
        return send(t, stream)

    def counted_fetch(self):
        if self.back is None:  # a return started
            fetched.append(self)
        return fetch(self)

    monkeypatch.setattr(offload.Offloaded, "send", staticmethod(counted_send))
    monkeypatch.setattr(offload.Offloaded, "fetch", counted_fetch)
    return sent, fetched


def test_on_the_cpu_offload_moves_nothing_and_says_so():
    w = ExpertWeights.random(SPEC, 1)
    x, dy = _data()
    plain, kept = [], []
    want = _step(MoE(SPEC, w), x, dy, plain)
    with pytest.warns(UserWarning, match="offload=True moves nothing on a cpu device"):
        got = _step(MoE(SPEC, w, offload=True), x, dy, kept)
    _equal(got, want)
    assert kept == plain


@pytest.mark.parametrize("recompute", list(Recompute), ids=[r.value for r in Recompute])
@pytest.mark.parametrize("where", list(PINS))
def test_offloaded_activations_leave_the_saved_tensors_and_keep_the_bits(moved, where, recompute):
    sent, _ = moved
    w, pinned = ExpertWeights.random(SPEC, 2), PINS[where]
    x, dy = _data()
    plain, kept = [], []
    want = _step(MoE(SPEC, w, recompute=recompute, **pinned.options), x, dy, plain)
    assert not sent
    layer = MoE(SPEC, w, recompute=recompute, offload=True, **pinned.options)
    got = _step(layer, x, dy, kept)
    ran(layer, pinned.kind, **pinned.fields)
    _equal(got, want)
    assert sum(kept) + sum(sent) == sum(plain)  # what left the saved tensors went to the host
    # what each keeps: kernel by kernel the routed and shared pre-activations (with the
    # gathered rows under "nothing"; nothing but the input under "gemm"); a taskflow per
    # virtual rank the two pre-activations (with the received rows and the shared
    # activation under "nothing")
    if where == "kernel-by-kernel":
        assert len(sent) == {Recompute.NOTHING: 3, Recompute.PERMUTATION: 2, Recompute.GEMM: 0}[recompute]
    else:
        assert len(sent) == pinned.fields["ep"] * (4 if recompute is Recompute.NOTHING else 2)


def test_a_layer_backward_starts_bringing_back_the_layer_before(moved):
    _, fetched = moved
    w = ExpertWeights.random(SPEC, 3)
    first, second = MoE(SPEC, w, offload=True), MoE(SPEC, w, offload=True)
    model = torch.nn.Sequential(first, second)
    order = []
    for name, layer in (("first", first), ("second", second)):
        layer.register_full_backward_pre_hook(lambda m, g, name=name: order.append((name, len(fetched))))
    x, dy = _data()
    want = _step(torch.nn.Sequential(MoE(SPEC, w), MoE(SPEC, w)), x, dy)
    got = _step(model, x, dy)
    _equal(got, want)
    # the second layer's backward started bringing back its own two and the first's two
    # before the first's backward began; the first's found its copies started
    assert order == [("second", 0), ("first", 4)]
    assert len(fetched) == 4


def test_under_activation_checkpointing_offload_leaves_the_tensors_to_it(moved):
    """Non-reentrant checkpointing keeps nothing from the forward: nothing is sent."""
    sent, _ = moved
    w = ExpertWeights.random(SPEC, 4)
    x, dy = _data()
    want = _step(MoE(SPEC, w), x, dy)
    layer = MoE(SPEC, w, offload=True)
    xg = x.clone().requires_grad_()
    out = checkpoint(layer, xg, use_reentrant=False)
    out.backward(dy)
    _equal((out.detach(), xg.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}), want)
    assert not sent


def _ep_rank(rank: int, world: int, path: str) -> dict:
    """One training step of an EP-group layer on this rank's tokens, with and without
    offload (its move forced on the CPU): the two steps' results and what was sent."""
    import torch.distributed as dist

    offload.pays = lambda device: True  # this child's module, as the fixture patches the parent's
    sent = []
    send = offload.Offloaded.send
    offload.Offloaded.send = staticmethod(lambda t, stream: sent.append(tuple(t.shape)) or send(t, stream))
    w = ExpertWeights.random(SPEC, 6)
    x, dy = (t.reshape(world, -1, SPEC.hidden)[rank] for t in _data(16, seed=6))
    steps = []
    for on in (False, True):
        options = dict(backend="kernel_by_kernel") if path == "kernel-by-kernel" else dict(schedule=None)
        layer = MoE(SPEC, w, ep_group=dist.group.WORLD, tiles=TINY_TILES, offload=on, **options)
        steps.append(_step(layer, x, dy))
        layer.close()
    return {"plain": steps[0], "offloaded": steps[1], "sent": sent}


@pytest.mark.parametrize("path", ["kernel-by-kernel", "runtime"])
def test_on_an_ep_group_the_received_rows_are_offloaded_too(path):
    """An EP group keeps its received rows under the default: offload sends them beside
    the pre-activations, and every bit of the step stays."""
    from hpmoe.testing import spawn_gloo

    for r in spawn_gloo(_ep_rank, 2, path, timeout=120):
        _equal(r["offloaded"], r["plain"])
        # the received rows and their pre-activation (as many rows), the shared
        # pre-activation (a row per token of this rank)
        rows = [shape[0] for shape in r["sent"]]
        assert len(rows) == 3 and 8 in rows, r["sent"]
        rows.remove(8)
        assert rows[0] == rows[1] > 0, r["sent"]


def test_offload_is_a_bool():
    with pytest.raises(TypeError, match="offload must be a bool, got 'yes'"):
        MoE(SPEC, offload="yes")
    assert "offload=True" in repr(MoE(SPEC, offload=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_forward_holds_less_device_memory_and_the_bits_stay():
    cuda = torch.device("cuda")
    spec = preset("small", torch.bfloat16)
    w = ExpertWeights.random(spec, 5)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2048, spec.hidden, generator=g).to(spec.dtype).to(cuda)
    dy = torch.randn(2048, spec.hidden, generator=g).to(spec.dtype).to(cuda)
    runs = {}
    for on in (False, True):
        layer = MoE(spec, w, offload=on).to(cuda)
        _step(layer, x, dy)  # warm: choose the path, fill the caches
        torch.cuda.synchronize()
        layer.zero_grad()
        before = torch.cuda.memory_allocated()
        xg = x.clone().requires_grad_()
        out = layer(xg)
        torch.cuda.synchronize()
        torch.empty(1, device=cuda)  # an allocation settles frees that waited on the side stream's copies
        held = torch.cuda.memory_allocated() - before
        out.backward(dy)
        runs[on] = (held, out.detach(), xg.grad, {n: p.grad.clone() for n, p in layer.named_parameters()})
    pre = 2048 * spec.top_k * 2 * spec.ffn * 2  # the routed pre-activation, bf16
    assert runs[False][0] - runs[True][0] >= pre
    assert torch.equal(runs[False][1], runs[True][1]) and torch.equal(runs[False][2], runs[True][2])
