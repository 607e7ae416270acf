"""Activation memory an MoE call keeps for its backward: what one forward with grad
enabled hands autograd to save (counted with ``torch.autograd.graph.saved_tensors_hooks``),
then the backward, for each variant of one layer on the same tokens and weights.

    .venv/bin/python benchmarks/bench_memory.py [--shapes deepseek-v3,qwen3-30b-a3b,mixtral-8x7b,small]
        [--tokens 64] [--dtype fp32,bf16] [--scaling-shape small] [--weight-budget-mib 1536]
        [--skip-transformers] [--skip-persistent] [--skip-runtime] [--json]

Variants (N tokens, balanced routing made outside the layer for hpmoe and the peer):
  hpmoe-default     ``hpmoe.MoE(spec, weights).region(x, ids, topk_weights)``: one process,
                    the path its AUTO picks (``path`` column)
  hpmoe-nothing,    the same with ``recompute="nothing"`` (keeps the gathered rows too) and
  hpmoe-gemm        ``recompute="gemm"`` (keeps the input alone, recomputes the first GEMM)
  hpmoe-exact-vep2  ``hpmoe.MoE(spec, weights, virtual_ep=2, schedule=None)``: the taskflow of
                    2 virtual ranks in task-id order, one process
  hpmoe-runtime-rR  rank R of 2 gloo ranks, ``ep_group=Session``, ``SchedulePolicy.HYPERPARALLEL``
                    pinned, N tokens on each rank (per-rank bytes)
  hpmoe-rt-gemm-rR  the same with ``recompute="gemm"`` (the received rows travel again beside
                    their dy rows instead of being kept)
  hpmoe-triton      ``backend="triton"``: the persistent kernel (the Triton interpreter on a CPU,
                    which only small shapes at few tokens finish in reasonable time)
  grouped_mm        ``torch._grouped_mm`` + autograd (``hpmoe.bench.torch_peers.grouped_forward``)
  hf-grouped_mm,    transformers' MoE block of the family (its router included, the hook around
  hf-eager          the block call), ``experts_implementation`` grouped_mm / eager

What is counted: every tensor handed to the pack hook during the forward that is still
held when the forward returns (a node the graph drops, as a router's, frees its own), its
parameters excluded (their storage is the model's), plus the tensors a Python autograd node
holds as attributes instead (hpmoe's node keeps the routing ids; the Triton path keeps its
arena), found by walking the output's graph.
  saved   the headline: bytes of distinct storages (``untyped_storage().nbytes()``, each
          storage once by ``data_ptr()``): what stays allocated until the backward, since a
          small view keeps its whole buffer alive.
  views   the saved tensors' own ``numel * element_size``, each save counted: below ``saved``
          where views of big buffers are kept, above it where one tensor is saved twice.
  w-copy  the part of ``saved`` equal to a weight in another storage (a copy made per call,
          e.g. the shared experts' gate and up fused; no token term).
  act     ``saved`` less the weight copies: the part that grows with tokens (``act B/tok``).
  minimal N*H (layer input) + N*k*(8 + 4) (int64 ids, fp32 weights) + N*(k*2F + 2Fs) (the
          routed and the shared experts' pre-activation) bytes in the compute dtype;
          ``/minimal`` and ``/grouped`` (over the grouped_mm peer's ``saved``) divide ``saved``,
          ``act/min`` and ``act/grp`` divide ``act``.
Bytes grow linearly with N (weight copies aside): ``--scaling-shape`` reruns one shape at 2N.
On CUDA ``peak`` is ``max_memory_allocated`` minus what was allocated before, over the forward
and backward of a second call (the first allocates a layer's persistent scratch); on a CPU
there is none.  DeepSeek-V3, Qwen3 and Mixtral keep fewer experts (``experts`` column): the
count halved until the weights fit ``--weight-budget-mib`` (never below top-k).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib
import importlib.util
import json
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from hpmoe.bench.torch_peers import Peer, device_inputs, grouped_forward, grouped_mm_unavailable
from hpmoe.ir.schedule import SchedulePolicy
from hpmoe.machine import default_cpu_dtype, record
from hpmoe.nn.layer import MoE
from hpmoe.routing import Routing
from hpmoe.spec import MoESpec, Recompute, preset
from hpmoe.testing import spawn_gloo
from hpmoe.weights import ExpertWeights

SHAPES = ("deepseek-v3", "qwen3-30b-a3b", "mixtral-8x7b", "small")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TRITON_MAX_MACS = 2**20  # routed rows x H x 3F: the interpreter takes ~8 min on 12 Mi (small, 8 tokens)
HF_FAMILIES = {"deepseek-v3": "deepseek_v3", "small": "deepseek_v3", "tiny": "deepseek_v3",
               "qwen3-30b-a3b": "qwen3_moe", "mixtral-8x7b": "mixtral"}
HF_IMPLS = ("grouped_mm", "eager")
SKIP_ATTRS = frozenset({"path", "session", "pool", "trial", "clock"})  # a layer's, not a call's

# ---------------------------------------------------------------------------- shapes


def weight_bytes(spec: MoESpec) -> int:
    """Bytes of the routed and shared experts' weights in spec.dtype."""
    return 3 * spec.hidden * (spec.experts * spec.ffn + spec.shared_ffn) * spec.dtype.itemsize


def bench_spec(name: str, dtype: torch.dtype, budget_bytes: int) -> MoESpec:
    """``preset(name)`` in ``dtype`` with its experts halved until the weights fit
    ``budget_bytes`` (never below top-k; group limits dropped once cut)."""
    spec = preset(name, dtype)
    e = spec.experts
    while e // 2 >= spec.top_k and weight_bytes(dataclasses.replace(spec, experts=e)) > budget_bytes:
        e //= 2
    if e == spec.experts:
        return spec
    return dataclasses.replace(spec, experts=e, groups=1, top_groups=1)


def minimal_bytes(spec: MoESpec, tokens: int) -> int:
    """Layer input N*H + routing N*k*(8-byte id + 4-byte weight) + pre-activation of the
    routed experts N*k*2F and of the shared experts N*2Fs, the activations in spec.dtype."""
    n, k, b = tokens, spec.top_k, spec.dtype.itemsize
    return n * spec.hidden * b + n * k * (8 + 4) + n * (k * spec.ffn + spec.shared_ffn) * 2 * b


def all_kept_bytes(spec: MoESpec, tokens: int) -> int:
    """Gathered input k*H + pre-activation k*2F + activation k*F + expert outputs k*H a token."""
    return tokens * spec.top_k * (2 * spec.hidden + 3 * spec.ffn) * spec.dtype.itemsize


def weight_refs(w: ExpertWeights) -> list[torch.Tensor]:
    """The weights a saved tensor may be a copy of: the experts', the router's, the shared
    experts' (fused and each half)."""
    fs = w.spec.shared_ffn
    shared = [w.shared_w13, w.shared_w13[:fs], w.shared_w13[fs:], w.shared_w2] if fs else []
    return [w.w13, w.w2, w.router, *shared]


# ---------------------------------------------------------------------------- counting


@dataclass(frozen=True)
class SavedTensor:
    """One distinct storage kept for the backward: ``shape``/``dtype``/``nbytes`` of the
    largest tensor saved on it, its storage's bytes, and ``kind``: ``input`` (the layer
    input's storage), ``weight copy`` or ``activation``; ``held`` when an autograd node
    keeps it as an attribute rather than through the hooks."""

    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    storage_nbytes: int
    kind: str
    held: bool = False

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class SavedBytes:
    """What one call keeps (see the module doc): ``saved`` (distinct storages), ``views``
    (each saved tensor's own bytes), ``weight_copies`` and ``held`` (kept outside the
    hooks), parts of ``saved``; ``saves``: pack-hook calls, parameters included, of which
    ``dropped`` were freed with their node before the forward returned (not counted);
    ``tensors``: the storages, largest first."""

    saved: int
    views: int
    weight_copies: int
    held: int
    saves: int
    dropped: int
    tensors: tuple[SavedTensor, ...]


class _Packed:
    """What the pack hook hands autograd: the saved tensor in a box whose life is the
    node's (a node the graph drops frees it before the forward returns)."""

    __slots__ = ("t", "__weakref__")

    def __init__(self, t: torch.Tensor):
        self.t = t


class SavedCounter:
    """Pack hooks that box every saved tensor and keep only a weak reference to the box;
    ``count`` reads the boxes still alive when the forward has returned.  ``params``'
    storages are skipped, ``x``'s is marked ``input``.  It holds no tensor: a node that
    outlives the call keeps its pack hook, so the counter, alive."""

    def __init__(self, params: Iterable[torch.Tensor], x: torch.Tensor):
        self.skip = {p.untyped_storage().data_ptr() for p in params}
        self.x_ptr = x.untyped_storage().data_ptr()
        self.weights: list[torch.Tensor] = []
        self.packs: list[weakref.ref[_Packed]] = []

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, _unpack)

    def pack(self, t: torch.Tensor) -> _Packed:
        box = _Packed(t)
        self.packs.append(weakref.ref(box))
        return box

    def count(self, out: torch.Tensor, weights: list[torch.Tensor]) -> SavedBytes:
        """What ``out``'s graph keeps: the saved tensors still boxed (parameters skipped),
        then the tensors its Python nodes hold as attributes (not ``out`` itself); a
        tensor equal to one of ``weights`` (same shape and values, another storage) is a
        ``weight copy``."""
        self.weights = weights
        try:
            return self._count(out)
        finally:
            self.weights = []

    def _count(self, out: torch.Tensor) -> SavedBytes:
        kept = [box.t for ref in self.packs if (box := ref()) is not None]
        storages: dict[int, SavedTensor] = {}
        views = sum(self._note(storages, t, held=False) for t in kept)
        self.skip.add(out.untyped_storage().data_ptr())
        views += sum(self._note(storages, t, held=True) for t in held_tensors(out)
                     if t.untyped_storage().data_ptr() not in storages)
        ts = sorted(storages.values(), key=lambda v: -v.storage_nbytes)
        return SavedBytes(saved=sum(v.storage_nbytes for v in ts), views=views,
                          weight_copies=sum(v.storage_nbytes for v in ts if v.kind == "weight copy"),
                          held=sum(v.storage_nbytes for v in ts if v.held), saves=len(self.packs),
                          dropped=len(self.packs) - len(kept), tensors=tuple(ts))

    def _note(self, storages: dict[int, SavedTensor], t: torch.Tensor, held: bool) -> int:
        """Note ``t``'s storage (by its largest tensor); ``t``'s own bytes (0 if skipped)."""
        ptr, nbytes = t.untyped_storage().data_ptr(), t.numel() * t.element_size()
        if ptr in self.skip:
            return 0
        old = storages.get(ptr)
        if old is None or old.nbytes < nbytes:
            storages[ptr] = SavedTensor(tuple(t.shape), str(t.dtype).removeprefix("torch."), nbytes,
                                        t.untyped_storage().nbytes(), self._kind(t, ptr), held)
        return nbytes

    def _kind(self, t: torch.Tensor, ptr: int) -> str:
        if ptr == self.x_ptr:
            return "input"
        same = (w for w in self.weights if w.shape == t.shape and w.dtype == t.dtype)
        return "weight copy" if any(torch.equal(w, t) for w in same) else "activation"


def _unpack(box: _Packed) -> torch.Tensor:
    return box.t


def held_tensors(out: torch.Tensor) -> Iterator[torch.Tensor]:
    """Tensors reachable from the attributes of the Python (custom Function) nodes of
    ``out``'s autograd graph, a layer's own objects (its path, session, pools) skipped."""
    seen: set[int] = set()
    stack = [out.grad_fn] if out.grad_fn is not None else []
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        yield from _tensors_in(getattr(node, "__dict__", {}), 6, seen)
        stack.extend(n for n, _ in node.next_functions if n is not None)


def _tensors_in(obj: object, depth: int, seen: set[int]) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
        return
    if depth == 0 or id(obj) in seen or isinstance(obj, (str, bytes, int, float, type)):
        return
    seen.add(id(obj))
    if isinstance(obj, dict):
        items = [v for k, v in obj.items() if k not in SKIP_ATTRS]
    elif isinstance(obj, (list, tuple)):
        items = list(obj)
    elif type(obj).__module__.startswith("hpmoe") and hasattr(obj, "__dict__"):
        items = [v for k, v in vars(obj).items() if k not in SKIP_ATTRS]
    else:
        return
    for v in items:
        yield from _tensors_in(v, depth - 1, seen)


# ---------------------------------------------------------------------------- one call


@dataclass(frozen=True)
class Call:
    """One variant's call: ``forward()`` -> output (its backward seeded with ``dy``),
    ``params`` (not counted), ``x`` (the input leaf), ``path``: what ran (after the call)."""

    forward: Callable[[], torch.Tensor]
    params: list[torch.Tensor]
    x: torch.Tensor
    path: Callable[[], str] = lambda: "-"


def measure(call: Call, dy: torch.Tensor, weights: list[torch.Tensor]) -> tuple[SavedBytes, int | None]:
    """(what the forward saves, the CUDA peak over forward + backward or None)."""
    cuda = call.x.device.type == "cuda"
    if cuda:  # a first call allocates the layer's persistent scratch
        _step(call, dy, None)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if cuda else 0
    got = _step(call, dy, SavedCounter(call.params, call.x), weights)
    assert got is not None
    if not cuda:
        return got, None
    torch.cuda.synchronize()
    return got, torch.cuda.max_memory_allocated() - before


def _step(call: Call, dy: torch.Tensor, counter: SavedCounter | None,
          weights: list[torch.Tensor] | None = None) -> SavedBytes | None:
    """Forward (under ``counter``'s hooks, counted once it returns), backward."""
    if counter is None:
        out, got = call.forward(), None
    else:
        with counter.hooks():
            out = call.forward()
        got = counter.count(out, weights or [])
    out.backward(dy.view_as(out))
    for t in (call.x, *call.params):
        t.grad = None
    return got


# ---------------------------------------------------------------------------- variants


def leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_()


def hpmoe_call(layer: MoE, x: torch.Tensor, routing: Routing) -> Call:
    xl, tw = leaf(x), leaf(routing.weights)
    return Call(lambda: layer.region(xl, routing.ids, tw), list(layer.parameters()), xl,
                lambda: path_name(layer))


def path_name(layer: MoE) -> str:
    """The path the layer's last call ran, with its schedule policy where it has one."""
    path = layer.last_call.path if layer.last_call is not None else None
    policy = getattr(path, "policy", None)
    return type(path).__name__ + (f"({policy.value})" if isinstance(policy, SchedulePolicy) else "")


def grouped_call(w: ExpertWeights, x: torch.Tensor, routing: Routing) -> Call:
    peer = Peer.of(routing, w.spec)
    xl, tw = leaf(x), leaf(routing.weights)
    ws = [leaf(t) if t is not None else None for t in (w.w13, w.w2, w.shared_w13, w.shared_w2)]
    return Call(lambda: grouped_forward(xl, *ws, tw, peer, w.spec), [t for t in ws if t is not None], xl,
                lambda: "torch._grouped_mm")


def hf_overrides(family: str, spec: MoESpec) -> dict:
    """The config fields that make the family's block the shape of ``spec``, 1 layer."""
    h, f, e, k = spec.hidden, spec.ffn, spec.experts, spec.top_k
    if family == "deepseek_v3":
        return dict(hidden_size=h, moe_intermediate_size=f, n_routed_experts=e, num_experts_per_tok=k,
                    n_shared_experts=spec.shared_experts, n_group=spec.groups, topk_group=spec.top_groups,
                    routed_scaling_factor=spec.routed_scaling, norm_topk_prob=spec.norm_topk,
                    num_hidden_layers=1)
    if family == "qwen3_moe":
        return dict(hidden_size=h, moe_intermediate_size=f, num_experts=e, num_experts_per_tok=k,
                    norm_topk_prob=spec.norm_topk, num_hidden_layers=1)
    return dict(hidden_size=h, intermediate_size=f, num_local_experts=e, num_experts_per_tok=k,
                num_hidden_layers=1)


def hf_block(name: str, spec: MoESpec, w: ExpertWeights,
             device: torch.device) -> tuple[torch.nn.Module, object]:
    """transformers' MoE block of the family of preset ``name`` shaped as ``spec``, built
    without touching the host's memory twice (meta, then empty on ``device``), holding
    ``w``'s values; with its config (``_experts_implementation`` is set on it)."""
    family = importlib.import_module(f"hpmoe.nn.families.{HF_FAMILIES[name]}").FAMILY
    config = family.tiny_config(**hf_overrides(family.name, spec))
    with torch.device("meta"):
        block = family.block_class()(config).to(spec.dtype)
    block = block.to_empty(device=device)
    fill_block_(block, w)
    return block, config


def fill_block_(block: torch.nn.Module, w: ExpertWeights) -> None:
    """Copy ``w`` into ``block``'s parameters by name (others N(0, 1/fan_in)); zero buffers."""
    fs = w.spec.shared_ffn
    by_name = {"experts.gate_up_proj": w.w13, "experts.down_proj": w.w2, "gate.weight": w.router}
    if fs:
        by_name |= {"shared_experts.gate_proj.weight": w.shared_w13[:fs],
                    "shared_experts.up_proj.weight": w.shared_w13[fs:],
                    "shared_experts.down_proj.weight": w.shared_w2}
    g = torch.Generator(device=w.w13.device).manual_seed(1)
    with torch.no_grad():
        for name, p in block.named_parameters():
            src = by_name.get(name)
            if src is not None and src.shape == p.shape:
                p.copy_(src)
            else:
                p.copy_(torch.randn(p.shape, generator=g, device=p.device) / p.shape[-1] ** 0.5)
        for b in block.buffers():
            b.zero_()


def hf_call(block: torch.nn.Module, x: torch.Tensor) -> Call:
    xl = leaf(x.view(1, *x.shape))

    def forward() -> torch.Tensor:
        out = block(xl)
        return out[0] if isinstance(out, tuple) else out
    return Call(forward, list(block.parameters()), xl, lambda: type(block).__name__)


# ---------------------------------------------------------------------------- rows


def row(name: str, spec: MoESpec, tokens: int, variant: str, path: str, got: SavedBytes | None,
        peak: int | None, skipped: str | None = None) -> dict:
    """One JSON row (``saved`` etc. None when ``skipped``)."""
    r = {"shape": name, "experts": spec.experts, "tokens": tokens, "dtype": _dtype(spec.dtype),
         "variant": variant, "path": path, "minimal_bytes": minimal_bytes(spec, tokens),
         "all_kept_bytes": all_kept_bytes(spec, tokens), "cuda_peak_bytes": peak}
    if got is None:
        return r | {"skipped": skipped}
    return r | {"saved_bytes": got.saved, "view_bytes": got.views, "weight_copy_bytes": got.weight_copies,
                "held_bytes": got.held, "saves": got.saves, "dropped_saves": got.dropped,
                "x_minimal": round(got.saved / r["minimal_bytes"], 3),
                "x_minimal_activations": round((got.saved - got.weight_copies) / r["minimal_bytes"], 3),
                "top": [t.to_json() for t in got.tensors[:12]]}


def _dtype(d: torch.dtype) -> str:
    return {v: k for k, v in DTYPES.items()}.get(d, str(d))


def with_peer_ratio(rows: list[dict]) -> list[dict]:
    """Each row with ``x_grouped_mm``: its bytes over the grouped_mm peer's of its case, and
    ``x_grouped_mm_activations``: the same without weight copies."""
    peer = {(r["shape"], r["tokens"], r["dtype"]): r for r in rows
            if r["variant"] == "grouped_mm" and "saved_bytes" in r}
    for r in rows:
        ref = peer.get((r["shape"], r["tokens"], r["dtype"]))
        both = ref is not None and "saved_bytes" in r
        r["x_grouped_mm"] = round(r["saved_bytes"] / ref["saved_bytes"], 3) if both else None
        r["x_grouped_mm_activations"] = round(_acts(r) / _acts(ref), 3) if both else None
    return rows


def _acts(r: dict) -> int:
    """A row's saved bytes less its weight copies: the part that grows with tokens."""
    return r["saved_bytes"] - r["weight_copy_bytes"]


# ---------------------------------------------------------------------------- one shape


@dataclass(frozen=True)
class Options:
    tokens: int
    budget_bytes: int
    device: torch.device
    transformers: bool = True
    persistent: bool = True
    runtime: bool = True


Inputs = Callable[[], tuple[torch.Tensor, ExpertWeights, Routing, torch.Tensor]]


def one_process_rows(name: str, spec: MoESpec, o: Options, tokens: int) -> list[dict]:
    """Every one-process variant of one shape, one after the other; each draws the same
    inputs anew (seed 0) and frees them before the next, so that at most two copies of the
    weights (the variant's and their gradients) are alive at a time."""
    def make() -> tuple[torch.Tensor, ExpertWeights, Routing, torch.Tensor]:
        gc.collect()  # the last variant's layer, before the next one's weights
        return device_inputs(spec, tokens, o.device)

    case = (name, spec, tokens)
    rows = [_layer_row(case, "hpmoe-default", {}, make),
            _layer_row(case, "hpmoe-nothing", dict(recompute=Recompute.NOTHING), make),
            _layer_row(case, "hpmoe-gemm", dict(recompute=Recompute.GEMM), make),
            _layer_row(case, "hpmoe-exact-vep2", dict(virtual_ep=2, schedule=None), make)]
    why = triton_skip(spec, tokens, o)
    skipped = row(*case, "hpmoe-triton", "-", None, None, why)
    rows.append(skipped if why is not None else
                _guarded(lambda: _layer_row(case, "hpmoe-triton", dict(backend="triton"), make), skipped))
    rows.append(_grouped_row(case, make))
    return rows + _hf_rows(case, o, make)


def _guarded(make_row: Callable[[], dict], skipped: dict) -> dict:
    """``make_row()``, or ``skipped`` naming the error where a kernel this device lacks raises."""
    try:
        return make_row()
    except (RuntimeError, NotImplementedError) as err:
        return skipped | {"skipped": f"failed: {type(err).__name__}: {str(err).splitlines()[0][:120]}"}


def _layer_row(case: tuple[str, MoESpec, int], variant: str, options: dict, make: Inputs) -> dict:
    x, w, routing, dy = make()
    layer = MoE(case[1], w, **options)
    del w
    call = hpmoe_call(layer, x, routing)
    got, peak = measure(call, dy, weight_refs(layer.expert_weights()))
    r = row(*case, variant, call.path(), got, peak)
    layer.close()
    return r


def triton_skip(spec: MoESpec, tokens: int, o: Options) -> str | None:
    """Why the persistent path is not measured here, or None."""
    if not o.persistent:
        return "--skip-persistent"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    macs = tokens * spec.top_k * spec.hidden * 3 * spec.ffn
    if o.device.type != "cuda" and macs > TRITON_MAX_MACS:
        return (f"the Triton interpreter on a CPU: {macs / 2**20:.0f} Mi multiply-adds a forward "
                f"(> {TRITON_MAX_MACS / 2**20:.0f} Mi) would take too long")
    return None


def _grouped_row(case: tuple[str, MoESpec, int], make: Inputs) -> dict:
    x, w, routing, dy = make()
    why = grouped_mm_unavailable(x.device, case[1].dtype)
    if why is not None:
        return row(*case, "grouped_mm", "-", None, None, why)
    call = grouped_call(w, x, routing)
    got, peak = measure(call, dy, weight_refs(w))
    return row(*case, "grouped_mm", call.path(), got, peak)


def _hf_rows(case: tuple[str, MoESpec, int], o: Options, make: Inputs) -> list[dict]:
    """transformers' block under each experts implementation (one block, the weights drawn
    for it freed once copied in)."""
    variants = [f"hf-{impl}" for impl in HF_IMPLS]
    why = None if o.transformers else "--skip-transformers"
    if why is None and (importlib.util.find_spec("transformers") is None or case[0] not in HF_FAMILIES):
        why = "no transformers block for this shape"
    if why is not None:
        return [row(*case, v, "-", None, None, why) for v in variants]
    x, w, _, dy = make()
    block, config = hf_block(case[0], case[1], w, o.device)
    del w
    return [_guarded(lambda impl=impl: _hf_row(case, block, config, impl, x, dy),
                     row(*case, f"hf-{impl}", "-", None, None)) for impl in HF_IMPLS]


def _hf_row(case: tuple[str, MoESpec, int], block: torch.nn.Module, config: object, impl: str,
            x: torch.Tensor, dy: torch.Tensor) -> dict:
    config._experts_implementation = impl
    call = hf_call(block, x)
    got, peak = measure(call, dy, list(block.parameters()))
    return row(*case, f"hf-{impl}", call.path(), got, peak)


# ---------------------------------------------------------------------------- the runtime


def runtime_rows(name: str, spec: MoESpec, o: Options, tokens: int) -> list[dict]:
    """hpmoe on 2 gloo ranks (HYPERPARALLEL pinned), ``tokens`` on each: one row per rank."""
    if not o.runtime or o.device.type == "cuda":
        why = "--skip-runtime" if not o.runtime else "the runtime runs on the host (gloo, shared memory)"
        return [row(name, spec, tokens, "hpmoe-runtime", "-", None, None, why)]
    rows = []
    for label, recompute in (("hpmoe-runtime", Recompute.PERMUTATION), ("hpmoe-rt-gemm", Recompute.GEMM)):
        ranks = spawn_gloo(_runtime_rank, 2, spec, tokens, recompute, timeout=1800)
        rows += [row(name, spec, tokens, f"{label}-r{rank}", path, got, None)
                 for rank, (got, path) in enumerate(ranks)]
    return rows


def _runtime_rank(rank: int, world: int, spec: MoESpec, tokens: int, recompute: Recompute
                  ) -> tuple[SavedBytes, str]:
    from hpmoe.runtime import RuntimeConfig, Session

    x, w, routing, dy = device_inputs(spec, world * tokens, torch.device("cpu"))
    mine = slice(rank * tokens, (rank + 1) * tokens)
    routing = Routing(routing.ids[mine].contiguous(), routing.weights[mine].contiguous())
    with Session(RuntimeConfig(deadline_s=600.0)) as session:
        layer = MoE(spec, w, ep_group=session, schedule=SchedulePolicy.HYPERPARALLEL, recompute=recompute)
        del w
        call = hpmoe_call(layer, x[mine].clone(), routing)  # its own storage, as a rank's input has
        got, _ = measure(call, dy[mine].clone(), weight_refs(layer.expert_weights()))
        layer.close()
    return got, call.path()


# ---------------------------------------------------------------------------- output


def table(rows: list[dict]) -> str:
    """The rows, one a line; the CUDA peak column only where a row has one."""
    cuda = any(r["cuda_peak_bytes"] is not None for r in rows)
    head = (f"{'shape':13} {'E':>3} {'N':>4} {'dtype':5} {'variant':17} {'path':26} {'saved MiB':>9} "
            f"{'views MiB':>9} {'w-copy':>7} {'act B/tok':>9} {'/minimal':>8} {'act/min':>7} "
            f"{'/grouped':>8} {'act/grp':>7}")
    return "\n".join([head + (f" {'peak MiB':>8}" if cuda else ""), *(_line(r, cuda) for r in rows)])


def _line(r: dict, cuda: bool) -> str:
    lead = (f"{r['shape']:13} {r['experts']:3} {r['tokens']:4} {r['dtype']:5} {r['variant']:17} "
            f"{r['path'][:26]:26}")
    if "saved_bytes" not in r:
        return f"{lead} skipped: {r['skipped']}"
    mib = 2**20
    peak = f" {r['cuda_peak_bytes'] / mib:8.1f}" if r["cuda_peak_bytes"] is not None else f" {'-':>8}"
    grouped = (f"{r['x_grouped_mm']:8.2f} {r['x_grouped_mm_activations']:7.2f}"
               if r["x_grouped_mm"] is not None else f"{'-':>8} {'-':>7}")
    return (f"{lead} {r['saved_bytes'] / mib:9.3f} {r['view_bytes'] / mib:9.3f} "
            f"{r['weight_copy_bytes'] / mib:7.3f} {_acts(r) // r['tokens']:9d} "
            f"{r['x_minimal']:8.2f} {r['x_minimal_activations']:7.2f} {grouped}{peak if cuda else ''}")


def minimal_lines(specs: dict[str, MoESpec], tokens: int) -> str:
    out = ["minimal set (N*H + N*k*12 + N*(k*2F + 2Fs)) and all kept (N*k*(2H + 3F)), bytes per token:"]
    for name, s in specs.items():
        out.append(f"  {name:14} H {s.hidden} F {s.ffn} k {s.top_k}: "
                   f"minimal {minimal_bytes(s, tokens) // tokens} "
                   f"all kept {all_kept_bytes(s, tokens) // tokens}")
    return "\n".join(out)


def top_lines(r: dict, n: int = 10) -> str:
    out = [f"top saved storages of {r['variant']} ({r['path']}), {r['shape']} {r['dtype']} N={r['tokens']}:"]
    for t in r.get("top", [])[:n]:
        held = ", held outside the hooks" if t["held"] else ""
        out.append(f"  {t['storage_nbytes'] / 2**20:9.3f} MiB  {str(list(t['shape'])):18} {t['dtype']:8} "
                   f"{t['kind']}{held} (view {t['nbytes'] / 2**20:.3f} MiB)")
    return "\n".join(out)


def scaling_lines(small: list[dict], large: list[dict]) -> str:
    out = ["token scaling (saved bytes at 2N over N; the weight copies, which do not scale, taken out):"]
    for a, b in zip(small, large, strict=True):
        if "saved_bytes" in a and "saved_bytes" in b:
            grow = (b["saved_bytes"] - b["weight_copy_bytes"]) / (a["saved_bytes"] - a["weight_copy_bytes"])
            out.append(f"  {a['shape']} {a['variant']:18} N {a['tokens']} -> {b['tokens']}: "
                       f"{b['saved_bytes'] / a['saved_bytes']:.3f}x, activations {grow:.3f}x")
    return "\n".join(out)


# ---------------------------------------------------------------------------- main


def shape_rows(name: str, spec: MoESpec, o: Options, tokens: int) -> list[dict]:
    return with_peer_ratio(one_process_rows(name, spec, o, tokens) + runtime_rows(name, spec, o, tokens))


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    record()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    budget = weight_budget(args.weight_budget_mib, device)
    o = Options(args.tokens, budget, device, not args.skip_transformers, not args.skip_persistent,
                not args.skip_runtime)
    rows: list[dict] = []
    specs: dict[str, MoESpec] = {}
    for dtype in dtypes(args.dtype, device):
        for name in args.shapes.split(","):
            specs[f"{name} {_dtype(dtype)}"] = spec = bench_spec(name, dtype, budget)
            for r in shape_rows(name, spec, o, args.tokens):
                rows.append(r)
                print(json.dumps(r), flush=True)
    if args.json:
        return
    print(minimal_lines(specs, args.tokens))
    print(table(rows))
    for r in rows:
        if r["variant"] == "hpmoe-default" and "top" in r:
            print(top_lines(r))
    scaling(args, o, rows)


def scaling(args: argparse.Namespace, o: Options, rows: list[dict]) -> None:
    """``--scaling-shape`` at twice the tokens (hpmoe's default path and the peer)."""
    name = args.scaling_shape
    first = [r for r in rows if r["shape"] == name and r["variant"] in ("hpmoe-default", "grouped_mm")]
    if not name or not first:
        return
    spec = bench_spec(name, DTYPES[first[0]["dtype"]], o.budget_bytes)
    quick = dataclasses.replace(o, transformers=False, persistent=False, runtime=False)
    twice = [r for r in one_process_rows(name, spec, quick, 2 * args.tokens)
             if r["variant"] in ("hpmoe-default", "grouped_mm")]
    print(scaling_lines(first[:2], twice))


def weight_budget(mib: int | None, device: torch.device) -> int:
    """Bytes the experts' weights may take: ``mib``, else a sixth of the GPU's memory
    (weights, the layer's copy, gradients and a peer's) or 1.5 GiB on a host."""
    if mib is not None:
        return mib * 2**20
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory // 6
    return 1536 * 2**20


def dtypes(arg: str, device: torch.device) -> list[torch.dtype]:
    if arg == "auto":
        return [torch.bfloat16 if device.type == "cuda" else default_cpu_dtype()[0]]
    return [DTYPES[d] for d in arg.split(",")]


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--dtype", default="auto", help="fp32, bf16 or both (comma); auto: bf16 on a GPU or "
                   "a CPU computing it natively, else fp32")
    p.add_argument("--weight-budget-mib", type=int, default=None,
                   help="default: 1536 on a host, a sixth of the GPU's memory on CUDA")
    p.add_argument("--scaling-shape", default="small", help="rerun at 2x tokens ('' for none)")
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--skip-persistent", action="store_true")
    p.add_argument("--skip-runtime", action="store_true")
    p.add_argument("--json", action="store_true", help="JSON lines only (no table)")
    return p.parse_args(argv)


if __name__ == "__main__":
    main()
