"""Tensor storage an hpmoe layer keeps alive after its forward, plain and under
non-reentrant activation checkpointing.

    python benchmarks/checkpoint_memory.py          # preset small, fp32, 1024 tokens, virtual EP 2

Counts the storage of every tensor the garbage collector can find, before and after the
forward (the difference is what autograd keeps for backward, plus the output).
"""

from __future__ import annotations

import gc

import torch
from torch.utils.checkpoint import checkpoint

import hpmoe
from hpmoe.machine import record
from hpmoe.spec import preset


def live_bytes() -> int:
    gc.collect()
    tensors = (t for t in gc.get_objects() if isinstance(t, torch.Tensor))
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def kept_after_forward(layer: torch.nn.Module, x: torch.Tensor, checkpointed: bool) -> int:
    base = live_bytes()
    out = checkpoint(layer, x, use_reentrant=False) if checkpointed else layer(x)
    kept = live_bytes() - base
    out.sum().backward()
    return kept


if __name__ == "__main__":
    record()
    spec = preset("small", torch.float32)
    layer = hpmoe.MoE(spec, virtual_ep=2)
    x = torch.randn(1024, spec.hidden, requires_grad=True)
    for checkpointed in (False, True):
        mib = kept_after_forward(layer, x, checkpointed) / 2**20
        print(f"{'checkpoint(use_reentrant=False)' if checkpointed else 'plain forward':32s} {mib:7.2f} MiB")
