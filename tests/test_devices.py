"""Every tensor the layer's default path makes is made on a named device: a ``torch``
factory call (``empty``, ``zeros``, ``arange``, ``rand``, ...) without ``device=`` would
put it on the CPU while the layer's inputs and weights are on a GPU.  The modules a
call of ``hpmoe.MoE`` (and ``moe_forward``) runs through on that path are walked; the
CPU-side modules (the runtime's transports, calibration, benchmarks) are not."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from hpmoe.exec.arena import Arena, ArenaPool

PACKAGE = Path(__file__).resolve().parent.parent / "hpmoe"
DEFAULT_PATH = ("nn/layer.py", "exec/kernel_by_kernel.py", "exec/arena.py", "engine.py", "routing.py")
FACTORIES = {"empty", "zeros", "ones", "full", "arange", "tensor", "rand", "randn", "randint", "randperm",
             "linspace", "eye", "as_tensor"}


def factories_without_device(source: str) -> list[str]:
    """``torch.NAME(...)`` calls in ``source`` with a factory NAME and no ``device=``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        func = node.func if isinstance(node, ast.Call) else None
        if (isinstance(func, ast.Attribute) and func.attr in FACTORIES and isinstance(func.value, ast.Name)
                and func.value.id == "torch" and not any(k.arg == "device" for k in node.keywords)):
            out.append(f"line {node.lineno}: torch.{func.attr}")
    return out


def test_the_walk_finds_a_factory_without_a_device() -> None:
    src = "import torch\na = torch.zeros(3)\nb = torch.empty(2, device=x.device)\nc = torch.zeros_like(a)\n"
    assert factories_without_device(src) == ["line 2: torch.zeros"]


@pytest.mark.parametrize("module", DEFAULT_PATH)
def test_the_default_path_names_the_device_of_every_tensor_it_makes(module: str) -> None:
    assert factories_without_device((PACKAGE / module).read_text()) == []


def test_arenas_are_kept_per_device() -> None:
    pool = ArenaPool()
    cpu = pool.acquire("cpu")
    assert cpu.take("x", (2, 3), torch.float32).device == torch.device("cpu")
    pool.release(cpu)
    meta = pool.acquire("meta")  # another device: a new arena, the idle cpu one stays
    assert meta is not cpu and meta.take("x", (2, 3), torch.float32).device == torch.device("meta")
    assert pool.acquire("cpu") is cpu and isinstance(meta, Arena)
