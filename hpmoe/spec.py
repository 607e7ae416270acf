"""Frozen configuration of an MoE layer, its expert-parallel layout and its tiling.

Every other stage reads these three dataclasses; they validate themselves in
``__post_init__`` so that bad configuration fails at construction, naming the
field and the value.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

import torch

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class Activation(enum.Enum):
    """The gate activation of every expert (routed and shared): ``act(gate) * up``."""

    SILU = "silu"  # SwiGLU (DeepSeek, Qwen, Mixtral, ...)
    GELU = "gelu"  # exact (erf) GELU: GeGLU
    GELU_TANH = "gelu_tanh"  # tanh-approximated GELU
    RELU = "relu"


class GateKind(enum.Enum):
    """How router logits become top-k expert ids and weights."""

    SIGMOID = "sigmoid"  # DeepSeek-V3: sigmoid scores, bias-corrected, group-limited
    SOFTMAX = "softmax"  # Mixtral / Qwen3 / DeepSeek-V2: softmax scores, optional groups


@dataclass(frozen=True)
class GluForm:
    """How a routed expert's gated activation reads its [m, 2F] pre-activations h:
    ``a = act(gate) * (up + up_shift)``.

    interleaved: gate and up columns alternate (gate ``h[:, 0::2]``, up ``h[:, 1::2]``, as
      GPT-OSS stores them) instead of gate columns first.
    alpha: ``act(g) = g * sigmoid(alpha * g)`` (``Activation.SILU`` only; 1 is SiLU).
    limit: gate clamped to ``<= limit`` and up to ``[-limit, limit]`` first; None: no clamp.
    up_shift: added to the (clamped) up value (GPT-OSS: ``(up + 1) * glu``).
    The default is the plain ``act(gate) * up`` of every other family.
    """

    interleaved: bool = False
    alpha: float = 1.0
    limit: float | None = None
    up_shift: float = 0.0

    def __post_init__(self) -> None:
        if not self.alpha > 0:
            raise ValueError(f"GluForm.alpha must be > 0, got {self.alpha}")
        if self.limit is not None and not self.limit > 0:
            raise ValueError(f"GluForm.limit must be > 0 or None, got {self.limit}")

    @property
    def plain(self) -> bool:
        """Gate columns first, no clamp, SiLU's slope, no shift."""
        return self == PLAIN_GLU

    @property
    def flops(self) -> float:
        """Vector FLOPs per output element (the plain SwiGLU: 5)."""
        return 5.0 + (2.0 if self.alpha != 1.0 else 0.0) + (3.0 if self.limit is not None else 0.0) + (
            1.0 if self.up_shift else 0.0)


PLAIN_GLU = GluForm()  # act(gate) * up, gate columns first


def _check_positive(owner: str, **fields: int) -> None:
    for name, value in fields.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{owner}.{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class MoESpec:
    """Shapes and gate of one MoE-FFN layer.

    hidden: model width H.  ffn: one routed expert's intermediate width F.
    experts: number of routed experts E.  top_k: experts per token.
    shared_experts: number of shared experts, fused into one FFN of width
    ``shared_experts * ffn`` (DeepSeek convention); 0 for none.
    groups / top_groups: group-limited routing (1 / 1 disables it).
    routed_scaling: factor applied to the top-k weights.
    norm_topk: renormalise the top-k weights to sum to one.
    dtype: dtype of activations and expert weights (fp32, bf16 or fp16; every sum in fp32).
    activation: the experts' gate activation.
    glu: how the routed experts' gated activation reads its input (``GluForm``).
    expert_bias: the routed experts' projections carry biases (``ExpertWeights.b13`` [E, 2F]
      added to the up projection, ``b2`` [E, H] to the down projection; GPT-OSS).
    """

    hidden: int
    ffn: int
    experts: int
    top_k: int
    shared_experts: int = 0
    gate: GateKind = GateKind.SOFTMAX
    groups: int = 1
    top_groups: int = 1
    routed_scaling: float = 1.0
    norm_topk: bool = True
    dtype: torch.dtype = torch.bfloat16
    activation: Activation = Activation.SILU
    glu: GluForm = PLAIN_GLU
    expert_bias: bool = False

    def __post_init__(self) -> None:
        _check_positive("MoESpec", hidden=self.hidden, ffn=self.ffn, experts=self.experts,
                        top_k=self.top_k, groups=self.groups, top_groups=self.top_groups)
        if self.top_k > self.experts:
            raise ValueError(f"MoESpec.top_k={self.top_k} exceeds MoESpec.experts={self.experts}")
        if self.shared_experts < 0:
            raise ValueError(f"MoESpec.shared_experts must be >= 0, got {self.shared_experts}")
        if not isinstance(self.gate, GateKind):
            raise TypeError(f"MoESpec.gate must be a GateKind, got {self.gate!r}")
        if self.experts % self.groups:
            raise ValueError(f"MoESpec.groups={self.groups} does not divide experts={self.experts}")
        if self.top_groups > self.groups:
            raise ValueError(f"MoESpec.top_groups={self.top_groups} exceeds groups={self.groups}")
        if self.top_k > self.top_groups * (self.experts // self.groups):
            raise ValueError(f"MoESpec.top_k={self.top_k} exceeds the experts in "
                             f"top_groups={self.top_groups} groups")
        if self.gate is GateKind.SIGMOID and self.groups > 1 and self.experts // self.groups < 2:
            raise ValueError(f"MoESpec.groups={self.groups}: sigmoid group scores need >= 2 "
                             "experts per group")
        if self.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"MoESpec.dtype must be one of {SUPPORTED_DTYPES}, got {self.dtype}")
        if not isinstance(self.activation, Activation):
            raise TypeError(f"MoESpec.activation must be an Activation, got {self.activation!r}")
        if not isinstance(self.glu, GluForm):
            raise TypeError(f"MoESpec.glu must be a GluForm, got {self.glu!r}")
        if self.glu.alpha != 1.0 and self.activation is not Activation.SILU:
            raise ValueError(f"MoESpec.glu.alpha={self.glu.alpha} needs Activation.SILU, "
                             f"got {self.activation}")
        if not self.routed_scaling > 0:
            raise ValueError(f"MoESpec.routed_scaling must be > 0, got {self.routed_scaling}")

    @property
    def shared_ffn(self) -> int:
        """Width of the fused shared-expert FFN (0 when there is none)."""
        return self.shared_experts * self.ffn

    def with_dtype(self, dtype: torch.dtype) -> MoESpec:
        return replace(self, dtype=dtype)


@dataclass(frozen=True)
class ParallelSpec:
    """Expert-parallel layout: ``ep`` ranks, each holding ``experts / ep`` experts
    and ``tokens_per_rank`` tokens of the batch, spread over ``nodes`` nodes of
    ``ranks_per_node`` consecutive ranks (two link tiers: within and between nodes)."""

    ep: int
    tokens_per_rank: int
    nodes: int = 1

    def __post_init__(self) -> None:
        _check_positive("ParallelSpec", ep=self.ep, tokens_per_rank=self.tokens_per_rank,
                        nodes=self.nodes)
        if self.ep % self.nodes:
            raise ValueError(f"ParallelSpec.nodes={self.nodes} does not divide ep={self.ep}")

    @property
    def ranks_per_node(self) -> int:
        return self.ep // self.nodes

    def local_experts(self, moe: MoESpec) -> int:
        """Experts per rank; raises when ``ep`` does not divide the expert count."""
        if moe.experts % self.ep:
            raise ValueError(f"ParallelSpec.ep={self.ep} does not divide MoESpec.experts={moe.experts}")
        return moe.experts // self.ep


class DispatchMode(enum.Enum):
    """What one dispatch row is.

    PER_EXPERT: one row per (token, expert): a token with k experts travels k times.
    PER_RANK: one row per (token, destination rank holding any of its experts); the
      receiver copies it to its local experts and sums their weighted outputs into one
      partial row per (token, rank), which is what the combine sends back.
    PER_NODE: PER_RANK within a node; between nodes (``ParallelSpec.nodes``) a token
      travels once per (token, destination node) to a relay rank there, which forwards
      it to the node's destination ranks and sums their partials before one row goes
      back.  With one node it is PER_RANK.
    """

    PER_EXPERT = "per-expert"
    PER_RANK = "per-rank"
    PER_NODE = "per-node"


@dataclass(frozen=True)
class TileSpec:
    """Tile sizes of the task graph.

    rows: token rows per vector tile (permute, puts, SwiGLU, unpermute).
    gemm_rows: token rows per GEMM tile; 0 means one GEMM row tile per expert
      (the paper's expert-granular pipeline).
    gemm_cols: output columns per GEMM tile.
    gemm_splits: when > 0, split every GEMM's output width into this many column
      tiles instead (the paper: one tile per matrix core), overriding gemm_cols.
    dispatch: what a dispatch row is (``DispatchMode``).
    partial_dtype: wire dtype of the per-rank (and per-node) partial sums under
      ``PER_RANK`` and ``PER_NODE`` (fp32: exact; bf16: half the combine bytes).
    """

    rows: int = 128
    gemm_rows: int = 128
    gemm_cols: int = 512
    gemm_splits: int = 0
    dispatch: DispatchMode = DispatchMode.PER_EXPERT
    partial_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        _check_positive("TileSpec", rows=self.rows, gemm_cols=self.gemm_cols)
        for name in ("gemm_rows", "gemm_splits"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"TileSpec.{name} must be an int >= 0, got {value!r}")
        if not isinstance(self.dispatch, DispatchMode):
            raise TypeError(f"TileSpec.dispatch must be a DispatchMode, got {self.dispatch!r}")
        if self.partial_dtype not in (torch.float32, torch.bfloat16):
            raise TypeError(f"TileSpec.partial_dtype must be torch.float32 or torch.bfloat16, "
                            f"got {self.partial_dtype}")

    def column_tile(self, width: int) -> int:
        """Columns per GEMM tile of a GEMM whose output is ``width`` wide."""
        return -(-width // self.gemm_splits) if self.gemm_splits else self.gemm_cols


class Recompute(enum.Enum):
    """What a region's backward recomputes instead of keeping it from the forward (the
    gated activation, at least, wherever the path recomputes anything):

    NOTHING      keeps the experts' gathered input rows and their pre-activation (a
                 taskflow also keeps the shared experts' gated activation);
    PERMUTATION  keeps the layer input and the pre-activation, and gathers the rows
                 again: in one process (kernel by kernel, the taskflow of virtual ranks:
                 each row travels again beside its dy row); on an EP group the received
                 rows are kept (the doubled backward dispatch would cross the link), and
                 by the persistent kernel; a taskflow recomputes the shared experts'
                 gated activation;
    GEMM         keeps the layer input alone, gathers the rows again (on an EP group:
                 dispatches them again beside their gradients) and recomputes the first
                 GEMM (kernel by kernel; a taskflow keeps the pre-activation, its rows
                 travelling again on an EP group too: ``engine.paths.taskflow_kept``).
    """

    NOTHING = "nothing"
    PERMUTATION = "permutation"
    GEMM = "gemm"

    @property
    def activation(self) -> bool:
        """Whether the shared experts' gated activation is recomputed (a taskflow's
        recompute regions; the routed experts' always is)."""
        return self is not Recompute.NOTHING


def as_recompute(value: Recompute | bool | str) -> Recompute:
    """``value`` as a ``Recompute``: True (recompute the gated activation, as before) is
    PERMUTATION, False NOTHING; ValueError naming it when it is none."""
    if isinstance(value, Recompute):
        return value
    if isinstance(value, bool):
        return Recompute.PERMUTATION if value else Recompute.NOTHING
    try:
        return Recompute(value)
    except ValueError:
        names = [r.value for r in Recompute]
        raise ValueError(f"recompute={value!r} is not one of {names} or a bool") from None


def require_per_expert(tiles: TileSpec, what: str) -> None:
    """ValueError unless ``tiles`` dispatch one row per (token, expert), the only mode ``what`` runs."""
    if tiles.dispatch is not DispatchMode.PER_EXPERT:
        raise ValueError(f"TileSpec.dispatch={tiles.dispatch.value!r}: {what} runs "
                         f"DispatchMode.PER_EXPERT only")


_GPT_OSS_GLU = GluForm(interleaved=True, alpha=1.702, limit=7.0, up_shift=1.0)
_DEEPSEEK_V3 = MoESpec(hidden=7168, ffn=2048, experts=256, top_k=8, shared_experts=1,
                       gate=GateKind.SIGMOID, groups=8, top_groups=4, routed_scaling=2.5,
                       norm_topk=True)
PRESETS: dict[str, MoESpec] = {
    "deepseek-v3": _DEEPSEEK_V3,
    "deepseek-v2": MoESpec(hidden=5120, ffn=1536, experts=160, top_k=6, shared_experts=2,
                           gate=GateKind.SOFTMAX, groups=8, top_groups=3, routed_scaling=16.0,
                           norm_topk=False),
    "deepseek-v2-lite": MoESpec(hidden=2048, ffn=1408, experts=64, top_k=6, shared_experts=2,
                                gate=GateKind.SOFTMAX, norm_topk=False),
    "qwen3-30b-a3b": MoESpec(hidden=2048, ffn=768, experts=128, top_k=8, gate=GateKind.SOFTMAX,
                             norm_topk=True),
    "mixtral-8x7b": MoESpec(hidden=4096, ffn=14336, experts=8, top_k=2, gate=GateKind.SOFTMAX,
                            norm_topk=True),
    # GPT-OSS: biased experts, interleaved gate/up, clamped SwiGLU (alpha 1.702, limit 7), up + 1;
    # softmax over the top-k logits is softmax renormalised over the top k
    "gpt-oss-120b": MoESpec(hidden=2880, ffn=2880, experts=128, top_k=4, gate=GateKind.SOFTMAX,
                            norm_topk=True, expert_bias=True, glu=_GPT_OSS_GLU),
    "gpt-oss-20b": MoESpec(hidden=2880, ffn=2880, experts=32, top_k=4, gate=GateKind.SOFTMAX,
                           norm_topk=True, expert_bias=True, glu=_GPT_OSS_GLU),
    # A DeepSeek-V3-shaped layer small enough for the CPU demo.
    "small": MoESpec(hidden=512, ffn=256, experts=16, top_k=4, shared_experts=1,
                     gate=GateKind.SIGMOID, groups=4, top_groups=2, routed_scaling=2.5),
    "tiny": MoESpec(hidden=32, ffn=16, experts=8, top_k=2, shared_experts=1, gate=GateKind.SIGMOID,
                    groups=4, top_groups=2, routed_scaling=2.5, dtype=torch.float32),
}


def preset(name: str, dtype: torch.dtype | None = None) -> MoESpec:
    """The named MoE shape (``deepseek-v3``, ``qwen3-30b-a3b``, ``tiny`` ...)."""
    if name not in PRESETS:
        raise ValueError(f"preset={name!r} is not one of {sorted(PRESETS)}")
    spec = PRESETS[name]
    return spec if dtype is None else spec.with_dtype(dtype)
