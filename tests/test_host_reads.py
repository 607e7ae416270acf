"""The default path in one process reads nothing of the device's on the host: no
``.item()``, ``.tolist()``, ``.cpu()``, ``nonzero`` or other op whose
result size or value the host must wait for (on a GPU each is a sync that idles it).

A CPU has no device to wait for, so the test runs what a GPU runs, on the CPU: the
input's verdict kept on the device (``engine.check.held_on_device``) and the experts'
GEMMs grouped (``exec.kernel_by_kernel.gemm_path``), under a dispatch mode that fails
on every such op and Tensor methods that fail when called."""

from contextlib import contextmanager

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hpmoe.engine.check as check_module
import hpmoe.exec.kernel_by_kernel as kbk_module
from hpmoe import MoE
from hpmoe.exec.kernel_by_kernel import GemmPath
from hpmoe.refs import dense_moe
from hpmoe.routing import Routing, route
from hpmoe.spec import preset
from hpmoe.weights import ExpertWeights

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}

SYNCING_OPS = {"aten._local_scalar_dense", "aten.item", "aten.nonzero", "aten.nonzero_static",
               "aten.masked_select", "aten.unique", "aten._unique", "aten._unique2", "aten.unique_dim",
               "aten.unique_consecutive", "aten.bincount", "aten.histc", "aten.equal", "aten.is_nonzero"}
HOST_METHODS = ("item", "tolist", "cpu", "__bool__", "__int__", "__float__", "__index__")  # numpy() of a
# GPU tensor raises: only host memory (the verdict's pinned copy) is read through it


class HostRead(AssertionError):
    """The host read a device value."""


class _NoSyncingOps(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.replace("::", ".")
        kwargs = kwargs or {}
        if name in SYNCING_OPS:
            raise HostRead(f"{func} reads a device value on the host")
        if name == "aten.repeat_interleave" and kwargs.get("output_size") is None:
            raise HostRead(f"{func} without output_size sizes its result from device values")
        if name == "aten.index" and any(t is not None and t.dtype == torch.bool for t in args[1]):
            raise HostRead(f"{func} with a boolean mask sizes its result from device values")
        return func(*args, **kwargs)


@contextmanager
def no_host_reads():
    """Fail on any op or Tensor method that reads a device value on the host."""
    saved = {m: getattr(torch.Tensor, m) for m in HOST_METHODS}

    def refuse(name):
        def method(self, *args, **kwargs):
            raise HostRead(f"Tensor.{name}() reads a device value on the host")
        return method

    try:
        for m in HOST_METHODS:
            setattr(torch.Tensor, m, refuse(m))
        with _NoSyncingOps():
            yield
    finally:
        for m, f in saved.items():
            setattr(torch.Tensor, m, f)


@pytest.fixture
def as_on_a_gpu(monkeypatch):
    monkeypatch.setattr(check_module, "held_on_device", lambda device: True)
    monkeypatch.setattr(kbk_module, "gemm_path", lambda xs, ex: GemmPath.GROUPED)


def test_the_detector_catches_every_kind_of_host_read():
    t = torch.arange(6.0)
    for read in (lambda: t.sum().item(), lambda: t.tolist(), lambda: t.nonzero(), lambda: t[t > 2],
                 lambda: bool(t.any()), lambda: torch.repeat_interleave(t.long()), lambda: t.cpu()):
        with pytest.raises(HostRead), no_host_reads():
            read()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_default_training_step_reads_nothing_of_the_device(as_on_a_gpu, dtype):
    spec = preset("tiny", dtype)
    w = ExpertWeights.random(spec, 0)
    layer = MoE(spec, w)
    for step in range(3):  # new inputs and routings every step; the first call chooses the path
        g = torch.Generator().manual_seed(step)
        x = torch.randn(24, spec.hidden, generator=g).to(dtype).requires_grad_()
        r = route(x.detach(), w)
        with no_host_reads():
            out = layer.region(x, r.ids, r.weights)
            out.float().square().sum().backward()
        want = dense_moe(x.detach(), w, Routing(r.ids, r.weights))
        torch.testing.assert_close(out.detach(), want, **TOL[dtype])
        assert x.grad is not None and layer.experts.gate_up_proj.grad is not None
    assert type(layer.last_call.path).__name__ == "KernelByKernelPath"


def test_a_fault_is_still_reported_one_call_late(as_on_a_gpu):
    spec = preset("tiny")
    layer = MoE(spec, ExpertWeights.random(spec, 0))
    x = torch.randn(8, spec.hidden)
    x[3, 0] = float("nan")
    with no_host_reads():
        layer(x)
    with pytest.raises(ValueError, match="x has NaN at row 3"):
        layer(torch.randn(8, spec.hidden))


@pytest.fixture
def poisoned_scratch(monkeypatch):
    """Every scratch buffer a call takes comes back holding NaN (integers: -1), as
    recycled memory may on a GPU: a call that reads a row it did not write shows it."""
    from hpmoe.exec.arena import Arena

    take = Arena.take

    def poisoned(self, name, shape, dtype):
        t = take(self, name, shape, dtype)
        return t.fill_(float("nan") if dtype.is_floating_point else -1)

    monkeypatch.setattr(Arena, "take", poisoned)


def test_no_step_reads_a_buffer_row_it_did_not_write(as_on_a_gpu, poisoned_scratch):
    """Several training steps on one layer, new routings each (an expert with no rows
    among them), every scratch buffer poisoned: outputs and gradients those of autograd
    through the dense reference."""
    spec = preset("tiny")
    w = ExpertWeights.random(spec, 0)
    layer = MoE(spec, w)
    for step in range(4):
        g = torch.Generator().manual_seed(10 + step)
        x = torch.randn(16, spec.hidden, generator=g)
        ids = torch.randint(0, spec.experts - 1, (16, spec.top_k), generator=g)  # the last expert: no rows
        ids[:, 1] = (ids[:, 0] + 1 + step) % (spec.experts - 1)
        tw = torch.rand(16, spec.top_k, generator=g)
        xl = x.clone().requires_grad_()
        out = layer.region(xl, ids, tw)
        out.square().sum().backward()
        xr = x.clone().requires_grad_()
        want = dense_moe(xr, w, Routing(ids, tw))
        want.square().sum().backward()
        torch.testing.assert_close(out.detach(), want.detach(), **TOL[torch.float32])
        torch.testing.assert_close(xl.grad, xr.grad, **TOL[torch.float32])
