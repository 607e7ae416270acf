"""Family conformance: every family of ``hpmoe.nn.families`` against transformers itself.

For each family a tiny random causal LM (2 MoE layers, H 32, F 16, 8 experts, top-2, fp32)
is built twice; one copy gets its MoE blocks replaced by hpmoe, pinned to one path
(``PATHS``): the taskflow of ``virtual_ep`` ranks in one process (small tiles so every tile
path runs), kernel by kernel, or the persistent kernel (the Triton interpreter on the CPU).
Both run the same batch with ``labels`` and, where the family has one,
``output_router_logits=True``; the check reports the largest difference of the logits, of
the auxiliary (load-balancing) loss and of every parameter's gradient, and what each
replaced block's last call ran (``CallRecord``: it raises if that is not the path asked for).
Refused families report the reason instead.  In bf16 (``dtype=torch.bfloat16``) both
models run in bf16 and each is compared with the fp32 run of transformers' model: hpmoe's
errors sit beside transformers' own (``reference``), the bf16 parity being that hpmoe is
about as far from fp32 as transformers is.

    python -m hpmoe.nn.conformance        # prints the families table (markdown)
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass, replace

import torch
from torch import nn

from ..engine import ExactPath, KernelByKernelPath, TritonPath
from ..engine.door import CallRecord
from ..schedule.auto import Path
from ..spec import TileSpec
from .families import FAMILIES, Family
from .layer import MoE
from .replace import replace_moe_blocks

CHECK_TILES = TileSpec(rows=3, gemm_rows=4, gemm_cols=8)
# the interpreter runs each task in Python: fewer, larger tiles (every block still partial)
PERSISTENT_TILES = TileSpec(rows=8, gemm_rows=16, gemm_cols=32)
# each path the check can pin: the layer options that pin it, and the path object it runs
PATHS: dict[Path, tuple[dict, type]] = {
    Path.TASKFLOW: ({"schedule": None, "tiles": CHECK_TILES}, ExactPath),  # exact executors, task-id order
    Path.KERNEL_BY_KERNEL: ({"backend": "kernel_by_kernel", "tiles": CHECK_TILES}, KernelByKernelPath),
    # one persistent Triton kernel (on the CPU, the interpreter); plain GLU, no expert biases
    Path.PERSISTENT: ({"backend": "triton", "tiles": PERSISTENT_TILES}, TritonPath),
}


@dataclass(frozen=True)
class FamilyCheck:
    """One row of the families table.  Errors are max |hpmoe - transformers| (fp32; in bf16
    against transformers' fp32 run, with ``reference`` the same errors of transformers' own
    bf16 run); aux_err is None when the family has no auxiliary loss; refused: the reason,
    or ''; calls: the last region call of each replaced block that ran one."""

    family: str
    block: str
    refused: str
    blocks: int = 0
    logits_err: float = 0.0
    aux_err: float | None = None
    grad_err: float = 0.0
    reference: FamilyCheck | None = None
    calls: tuple[CallRecord, ...] = ()


def tiny_model(family: Family, seed: int = 0, **overrides) -> nn.Module:
    """``family.tiny_model`` in fp32 with every parameter drawn N(0, 1/fan_in) from ``seed``
    (transformers leaves fused expert tensors uninitialised)."""
    model = family.tiny_model(seed, **overrides).float()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g, device="cpu") / p.shape[-1] ** 0.5)
        for _, b in _state_buffers(model):  # routers' score-correction biases and the like
            b.copy_(torch.randn(b.shape, generator=g, device="cpu") * 0.1)
    return model


def _state_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The floating-point buffers of ``model`` that its state dict holds (not those a
    module derives, such as rotary frequencies)."""
    state = model.state_dict(keep_vars=True)
    return [(n, b) for n, b in model.named_buffers() if n in state and b.is_floating_point()]


def run_model(model: nn.Module, ids: torch.Tensor, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor | None,
                                                                          dict[str, torch.Tensor | None]]:
    """(logits, aux_loss or None, {name: grad}) of one forward/backward; the loss is the
    LM loss (plus the weighted aux loss) or, for a bare text model, the mean square of the
    last hidden state.  ``torch.manual_seed(seed)`` first, so training-time jitter repeats."""
    model.zero_grad()
    torch.manual_seed(seed)
    kwargs = {"input_ids": ids}
    params = inspect.signature(model.forward).parameters
    if "labels" in params:
        kwargs["labels"] = ids
    if "output_router_logits" in params or "kwargs" in params:
        kwargs["output_router_logits"] = True
    out = model(**kwargs)
    y = out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state
    loss = out.loss if getattr(out, "loss", None) is not None else y.square().mean()
    loss.backward()
    aux = getattr(out, "aux_loss", None)
    return y.detach(), None if aux is None else aux.detach(), {n: p.grad for n, p in model.named_parameters()}


def check_family(family: Family, seed: int = 0, virtual_ep: int = 2, dtype: torch.dtype = torch.float32,
                 path: Path = Path.TASKFLOW, **overrides) -> FamilyCheck:
    """Build, replace (pinned to ``path``, see ``PATHS``), run and compare one family (see
    the module docstring); ``overrides``: config fields (e.g. ``hidden_act``)."""
    model = tiny_model(family, seed, **overrides)
    original = copy.deepcopy(model)
    options, ran = PATHS[path]
    try:
        replaced = replace_moe_blocks(model, virtual_ep=virtual_ep, **options)
    except ValueError as err:
        return FamilyCheck(family.name, family.block, refused=str(err))
    ids = torch.arange(24, device="cpu").view(2, 12) % 61 + 2
    want = run_model(original, ids)
    got = run_model(model.to(dtype), ids)
    if list(want[2]) != list(got[2]):
        raise AssertionError(f"{family.name}: parameter names changed")
    calls = _calls(family, model, replaced.names, ran)
    row = replace(_compare(family, len(replaced.names), got, want), calls=calls)
    if dtype == torch.float32:
        return row
    return replace(row, reference=_compare(family, 0, run_model(original.to(dtype), ids), want))


def _calls(family: Family, model: nn.Module, names: list[str], ran: type) -> tuple[CallRecord, ...]:
    """The last call of each replaced block that ran a region call (one at least), each
    checked to have run a ``ran`` path."""
    layers = [m for n in names for m in model.get_submodule(n).modules() if isinstance(m, MoE)]
    calls = tuple(m.last_call for m in layers if m.last_call is not None)
    wrong = [type(c.path).__name__ for c in calls if not isinstance(c.path, ran)]
    if not calls or wrong:
        raise AssertionError(f"{family.name}: the replaced blocks ran {wrong or 'no region call'}, "
                             f"not {ran.__name__}")
    return calls


def _compare(family: Family, blocks: int, got: tuple, want: tuple) -> FamilyCheck:
    aux = None if want[1] is None else _err(got[1], want[1])
    grads = max(_err(got[2][n], g) for n, g in want[2].items())
    return FamilyCheck(family.name, family.block, "", blocks, _err(got[0], want[0]), aux, grads)


def _err(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    if a is None or b is None:
        if a is not b:
            raise AssertionError("a gradient is None on one side only")
        return 0.0
    return float((a.float() - b.float()).abs().max())


def table(rows: list[FamilyCheck], bf16: list[FamilyCheck] | None = None) -> str:
    """The families table in markdown; with ``bf16`` (the same families checked in bf16)
    two more columns: hpmoe's and transformers' own bf16 errors against transformers' fp32
    run, logits and gradients."""
    extra = bool(bf16)
    lines = ["| family | block | status | blocks | logits max err | aux loss err | grad max err |"
             + (" bf16 logits: hpmoe / transformers | bf16 grads: hpmoe / transformers |" if extra else ""),
             "|---|---|---|---|---|---|---|" + ("---|---|" if extra else "")]
    for i, r in enumerate(rows):
        if r.refused:
            lines.append(f"| {r.family} | {r.block} | refused: {r.refused.split(': ', 1)[-1]} | | | | |"
                         + (" | |" if extra else ""))
            continue
        aux = "no aux loss" if r.aux_err is None else f"{r.aux_err:.1e}"
        line = (f"| {r.family} | {r.block} | supported | {r.blocks} | {r.logits_err:.1e} | {aux} | "
                f"{r.grad_err:.1e} |")
        if extra:
            b, ref = bf16[i], bf16[i].reference
            line += f" {b.logits_err:.1e} / {ref.logits_err:.1e} | {b.grad_err:.1e} / {ref.grad_err:.1e} |"
        lines.append(line)
    return "\n".join(lines)


if __name__ == "__main__":
    print(table([check_family(f) for f in FAMILIES],
                [check_family(f, dtype=torch.bfloat16) for f in FAMILIES]))
