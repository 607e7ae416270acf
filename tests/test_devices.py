"""Every tensor the package makes is made on a named device: a ``torch`` factory call
(``empty``, ``zeros``, ``arange``, ``rand``, ...) without ``device=`` would put it on the
CPU while the layer's inputs and weights are on a GPU.  Every module is walked: the
CPU-side ones (the runtime's transports, calibration, benchmarks) say ``device="cpu"``,
so that a helper they share with the layer's path (``refs``, the region kernels) cannot
hide a CPU allocation, as ``refs.inverse_permutation`` once did on a GPU."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from hpmoe.exec.arena import Arena, ArenaPool

PACKAGE = Path(__file__).resolve().parent.parent / "hpmoe"
MODULES = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py"))
FACTORIES = {"empty", "zeros", "ones", "full", "arange", "tensor", "rand", "randn", "randint", "randperm",
             "linspace", "eye", "as_tensor"}


def factories_without_device(source: str) -> list[str]:
    """``torch.NAME(...)`` calls in ``source`` with a factory NAME and no ``device=``, and
    factories taken as values (``(torch.zeros if z else torch.empty)(...)``), which the
    walk cannot follow."""
    tree = ast.parse(source)
    called = {id(n.func): n for n in ast.walk(tree) if isinstance(n, ast.Call)}
    out = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr in FACTORIES
                and isinstance(node.value, ast.Name) and node.value.id == "torch"):
            continue
        call = called.get(id(node))
        if call is None:
            out.append(f"line {node.lineno}: torch.{node.attr} as a value")
        elif not any(k.arg == "device" for k in call.keywords):
            out.append(f"line {node.lineno}: torch.{node.attr}")
    return sorted(out, key=lambda line: int(line.split()[1].rstrip(":")))


def test_the_walk_finds_a_factory_without_a_device() -> None:
    src = ("import torch\na = torch.zeros(3)\nb = torch.empty(2, device=x.device)\nc = torch.zeros_like(a)\n"
           "d = (torch.zeros if a else torch.empty)(3, device=x.device)\n")
    assert factories_without_device(src) == ["line 2: torch.zeros", "line 5: torch.zeros as a value",
                                             "line 5: torch.empty as a value"]


@pytest.mark.parametrize("module", MODULES)
def test_every_module_names_the_device_of_every_tensor_it_makes(module: str) -> None:
    assert factories_without_device((PACKAGE / module).read_text()) == []


def test_arenas_are_kept_per_device() -> None:
    pool = ArenaPool()
    cpu = pool.acquire("cpu")
    assert cpu.take("x", (2, 3), torch.float32).device == torch.device("cpu")
    pool.release(cpu)
    meta = pool.acquire("meta")  # another device: a new arena, the idle cpu one stays
    assert meta is not cpu and meta.take("x", (2, 3), torch.float32).device == torch.device("meta")
    assert pool.acquire("cpu") is cpu and isinstance(meta, Arena)
