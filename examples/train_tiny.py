"""Train a tiny random-initialised transformers DeepSeek-V3 model on synthetic data twice —
as-is, and with every MoE block replaced by an hpmoe layer — and compare the loss curves.

    torchrun --nproc-per-node 2 examples/train_tiny.py     # hpmoe at EP 2, one rank per process
    python examples/train_tiny.py --virtual-ep 2           # one process, 2 virtual EP ranks

Under torchrun every rank trains the hpmoe model on its share of each batch (expert
parallel for the MoE blocks, data parallel for the rest: gradients are all-reduced and
averaged); rank 0 then trains the unchanged model on the whole batches.  Both start from
the same initial weights (same seed).  Prints both curves step by step and saves a PNG.
No downloads: the model is built from a small config.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from hpmoe.nn.hf import tiny_deepseek_v3_config
from hpmoe.nn.replace import replace_moe_blocks
from hpmoe.spec import TileSpec

TILES = TileSpec(rows=32, gemm_rows=32, gemm_cols=32)


@dataclass(frozen=True)
class TrainConfig:
    """steps of Adam (lr) on batches [batch, seq] of token ids from a fixed random
    Markov chain over the vocabulary; ``layers`` decoder layers, all MoE."""

    steps: int = 300
    batch: int = 8
    seq: int = 16
    layers: int = 2
    lr: float = 3e-3
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "batch", "seq", "layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"TrainConfig.{name} must be a positive int, got {value!r}")
        if not 2 <= self.seq <= 64:
            raise ValueError(f"TrainConfig.seq must be in [2, 64] (max_position_embeddings), got {self.seq}")


@dataclass(frozen=True)
class Curves:
    """Loss per step of the unchanged model and of the hpmoe model (same steps)."""

    original: list[float]
    hpmoe: list[float]

    def max_abs_diff(self) -> float:
        return max(abs(a - b) for a, b in zip(self.original, self.hpmoe, strict=True))


def make_model(cfg: TrainConfig) -> torch.nn.Module:
    """A fp32 DeepseekV3ForCausalLM with ``cfg.layers`` MoE layers, initialised from ``cfg.seed``."""
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(cfg.seed)
    config = tiny_deepseek_v3_config(num_hidden_layers=cfg.layers)
    return DeepseekV3ForCausalLM(config).float()


def synthetic_batches(cfg: TrainConfig, vocab: int = 64) -> torch.Tensor:
    """[steps, batch, seq] int64 token ids: each sequence walks a fixed random Markov
    chain in which every token has 3 likely successors (a learnable pattern)."""
    g = torch.Generator().manual_seed(cfg.seed + 1)
    succ = torch.randint(0, vocab, (vocab, 3), generator=g)
    n = cfg.steps * cfg.batch
    tokens = torch.empty(n, cfg.seq, dtype=torch.int64)
    tokens[:, 0] = torch.randint(0, vocab, (n,), generator=g)
    for t in range(1, cfg.seq):
        pick = torch.randint(0, 3, (n,), generator=g)
        tokens[:, t] = succ[tokens[:, t - 1], pick]
    return tokens.view(cfg.steps, cfg.batch, cfg.seq)


def train(model: torch.nn.Module, batches: torch.Tensor, cfg: TrainConfig,
          group: dist.ProcessGroup | None = None, label: str | None = None) -> list[float]:
    """Adam over ``batches`` [steps, b, seq]; with ``group``, gradients and the logged loss
    are averaged over its ranks (each holds an equal share of every batch).  With
    ``label``, shows progress on stderr every few seconds."""
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    losses: list[float] = []
    start = shown = time.monotonic()
    for step, ids in enumerate(batches, 1):
        if label is not None and (time.monotonic() - shown > 5.0 or step == len(batches)):
            shown = time.monotonic()
            last = f", loss {losses[-1]:.4f}" if losses else ""
            print(f"{label}: step {step}/{len(batches)}{last} ({shown - start:.0f} s)", file=sys.stderr,
                  flush=True)
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if group is not None:
            _average_gradients(model, group)
            loss = _average(loss.detach(), group)
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _average(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    t = t.clone()
    dist.all_reduce(t, group=group)
    return t / dist.get_world_size(group)


def _average_gradients(model: torch.nn.Module, group: dist.ProcessGroup) -> None:
    """Mean over ranks of every gradient (expert gradients are zero off their owner)."""
    for p in model.parameters():
        if p.grad is not None:
            p.grad.copy_(_average(p.grad, group))


def run_original(cfg: TrainConfig) -> list[float]:
    return train(make_model(cfg), synthetic_batches(cfg), cfg, label="original model")


def run_virtual(cfg: TrainConfig, virtual_ep: int) -> list[float]:
    """The hpmoe model in one process with ``virtual_ep`` virtual EP ranks."""
    model = make_model(cfg)
    replace_moe_blocks(model, virtual_ep=virtual_ep, tiles=TILES)
    return train(model, synthetic_batches(cfg), cfg, label=f"hpmoe model ({virtual_ep} virtual ranks)")


def run_rank(rank: int, world: int, cfg: TrainConfig) -> list[float]:
    """The hpmoe model on this rank of the default process group (EP = world size), on
    the multi-rank runtime (shared-memory transport, one matrix and one vector worker)."""
    if cfg.batch % world:
        raise ValueError(f"TrainConfig.batch={cfg.batch} must be divisible by the world size {world}")
    model = make_model(cfg)
    replaced = replace_moe_blocks(model, ep_group=dist.group.WORLD, tiles=TILES)
    share = synthetic_batches(cfg).chunk(world, dim=1)[rank]
    label = "hpmoe model (rank 0)" if rank == 0 else None
    losses = train(model, share, cfg, group=dist.group.WORLD, label=label)
    replaced.close()  # the runtime session's worker threads and shared memory
    del model, replaced
    gc.collect()  # free every object that holds the process group before the caller destroys it
    return losses


def report(curves: Curves, title: str, png: Path) -> None:
    """Print both curves step by step and save them as a PNG."""
    print(f"{'step':>5} {'original':>12} {'hpmoe':>12} {'|diff|':>10}")
    for i, (a, b) in enumerate(zip(curves.original, curves.hpmoe, strict=True)):
        print(f"{i:5d} {a:12.6f} {b:12.6f} {abs(a - b):10.2e}")
    print(f"max |diff| over {len(curves.original)} steps: {curves.max_abs_diff():.3e}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(curves.original, label="transformers DeepSeek-V3 (original)", lw=2.5, alpha=0.6)
    ax.plot(curves.hpmoe, label="hpmoe MoE blocks", lw=1.0, ls="--")
    ax.set(xlabel="step", ylabel="cross-entropy loss", title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"saved {png}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=TrainConfig.steps)
    parser.add_argument("--layers", type=int, default=TrainConfig.layers)
    parser.add_argument("--virtual-ep", type=int, default=2, help="virtual EP ranks (single process)")
    parser.add_argument("--png", type=Path, default=Path("train_tiny.png"))
    args = parser.parse_args()
    cfg = TrainConfig(steps=args.steps, layers=args.layers)
    torch.set_num_threads(1)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        hp = run_rank(rank, world, cfg)
        if rank == 0:
            title = f"tiny DeepSeek-V3, hpmoe at EP {world} (torchrun)"
            report(Curves(run_original(cfg), hp), title, args.png)
        dist.barrier()
        dist.destroy_process_group()
    else:
        curves = Curves(run_original(cfg), run_virtual(cfg, args.virtual_ep))
        report(curves, f"tiny DeepSeek-V3, hpmoe at {args.virtual_ep} virtual EP ranks", args.png)


if __name__ == "__main__":
    main()
