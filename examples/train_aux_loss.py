"""Train a tiny Qwen3-MoE model with the load-balancing auxiliary loss on, twice — as-is
and with its MoE blocks replaced by hpmoe (2 virtual EP ranks) — and compare the loss and
aux-loss curves step by step.

    python examples/train_aux_loss.py --steps 50

The aux loss is computed by transformers from the router logits its output-capturing
hooks record; hpmoe calls the block's router module, so the hooks see the same logits.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
from torch import nn

from hpmoe.nn.conformance import tiny_model
from hpmoe.nn.families import FAMILIES
from hpmoe.nn.replace import replace_moe_blocks
from hpmoe.spec import TileSpec

QWEN3 = next(f for f in FAMILIES if f.name == "qwen3_moe")


@dataclass(frozen=True)
class Curves:
    """(loss, aux loss) per step of the original and of the hpmoe model."""

    original: list[tuple[float, float]]
    hpmoe: list[tuple[float, float]]

    def max_diff(self) -> float:
        pairs = zip(self.original, self.hpmoe, strict=True)
        return max(abs(a - b) for w, h in pairs for a, b in zip(w, h, strict=True))


def train(model: nn.Module, steps: int) -> list[tuple[float, float]]:
    """AdamW (lr 1e-2) cycling over 4 fixed random batches [4, 12] of token ids."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = torch.randint(0, 64, (4, 4, 12), generator=torch.Generator().manual_seed(7))
    curve = []
    for step in range(steps):
        ids = batches[step % 4]
        opt.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids, output_router_logits=True)
        out.loss.backward()
        opt.step()
        curve.append((float(out.loss.detach()), float(out.aux_loss.detach())))
    return curve


def compare(steps: int, aux_coef: float = 0.1) -> Curves:
    """Both curves from the same initial weights (seed 0), 2 layers, fp32."""
    original = tiny_model(QWEN3, router_aux_loss_coef=aux_coef)
    model = tiny_model(QWEN3, router_aux_loss_coef=aux_coef)
    replace_moe_blocks(model, virtual_ep=2, tiles=TileSpec(rows=16, gemm_rows=16, gemm_cols=16))
    return Curves(train(original, steps), train(model, steps))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    curves = compare(parser.parse_args().steps)
    for i, (w, h) in enumerate(zip(curves.original, curves.hpmoe, strict=True)):
        print(f"step {i:3d}  loss {w[0]:.6f} / {h[0]:.6f}  aux {w[1]:.6f} / {h[1]:.6f}")
    print(f"max |difference| over loss and aux loss: {curves.max_diff():.2e}")
