"""Ground truth for every backend: the dense single-process MoE layer and the
serialized expert-parallel baseline a user writes today with torch.distributed.

Numerics contract (DESIGN.md, "Numerics"): each token's k expert outputs are summed in
top-k slot order in fp32 by :func:`topk_sum`, then the shared experts are added, then the
sum is cast to ``spec.dtype``.  An expert always sees its rows in global token order, so a
backend that feeds the same rows to GEMMs of the same shapes and calls :func:`topk_sum`
reproduces :func:`dense_moe` bit for bit.  Measured on this CPU: bf16 GEMM rows do not
depend on the row count or thread count; fp32 rows can (e.g. calls of fewer than 4 rows,
or 1 vs 2 threads at H=32), so fp32 comparisons across different GEMM shapes need a
tolerance of a few ulps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .routing import Routing, check_input
from .spec import PLAIN_GLU, Activation, GluForm, MoESpec
from .weights import ExpertWeights

# ---------------------------------------------------------------------------- math


ACTIVATION_FNS = {Activation.SILU: F.silu, Activation.GELU: F.gelu,
                  Activation.GELU_TANH: lambda t: F.gelu(t, approximate="tanh"), Activation.RELU: F.relu}


def gated(h: torch.Tensor, activation: Activation = Activation.SILU,
          glu: GluForm = PLAIN_GLU) -> torch.Tensor:
    """``act(gate) * (up + glu.up_shift)`` of h [..., 2F] as autograd computes it: gate and
    up columns as ``glu`` lays them out, clamped by ``glu.limit``, ``act(g) = g *
    sigmoid(glu.alpha * g)`` when alpha is not 1 (GPT-OSS's clamped SwiGLU)."""
    gate, up = clamped(*glu_halves(h, glu), glu)
    act = gate * torch.sigmoid(gate * glu.alpha) if glu.alpha != 1.0 else ACTIVATION_FNS[activation](gate)
    return act * (up + glu.up_shift) if glu.up_shift else act * up


def glu_halves(h: torch.Tensor, glu: GluForm) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up) views of h [..., 2F] as ``glu`` lays them out."""
    return (h[..., 0::2], h[..., 1::2]) if glu.interleaved else h.chunk(2, dim=-1)


def clamped(gate: torch.Tensor, up: torch.Tensor, glu: GluForm) -> tuple[torch.Tensor, torch.Tensor]:
    """gate clamped to ``<= glu.limit`` and up to ``±glu.limit`` (unchanged without a limit)."""
    if glu.limit is None:
        return gate, up
    return gate.clamp(max=glu.limit), up.clamp(min=-glu.limit, max=glu.limit)


def expert_ffn(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
               activation: Activation = Activation.SILU, glu: GluForm = PLAIN_GLU,
               b13: torch.Tensor | None = None, b2: torch.Tensor | None = None) -> torch.Tensor:
    """One gated expert, exactly as transformers' ``DeepseekV3Experts`` computes it.

    x: [R, H]; w13: [2F, H] (gate rows [0, F), up rows [F, 2F), or alternating under
    ``glu.interleaved``); w2: [H, F]; b13 [2F] / b2 [H] or None; one dtype.
    Returns [R, H] in ``x.dtype``: ``gated(x @ w13.T + b13) @ w2.T + b2``.
    """
    return F.linear(gated(F.linear(x, w13, b13), activation, glu), w2, b2)


def grouped_ffn(rows: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor,
                w2: torch.Tensor, activation: Activation = Activation.SILU, glu: GluForm = PLAIN_GLU,
                b13: torch.Tensor | None = None, b2: torch.Tensor | None = None) -> torch.Tensor:
    """Run expert ``e`` on the ``e``-th segment of ``rows``.

    rows: [R, H] sorted by expert; counts: [E'] int64 rows per expert, summing to R;
    w13: [E', 2F, H]; w2: [E', H, F]; b13 [E', 2F] / b2 [E', H] or None.  Returns [R, H] in
    ``rows.dtype``, same row order.  Differentiable with respect to ``rows`` and every weight.
    """
    chunks = rows.split(counts.tolist())
    outs = [expert_ffn(chunk, w13[e], w2[e], activation, glu, None if b13 is None else b13[e],
                       None if b2 is None else b2[e]) for e, chunk in enumerate(chunks)]
    return torch.cat(outs) if outs else rows.new_empty(0, w2.shape[1])


def routed_ffn(rows: torch.Tensor, counts: torch.Tensor, weights: ExpertWeights,
               experts: slice = slice(None)) -> torch.Tensor:
    """:func:`grouped_ffn` of the routed ``experts`` of ``weights`` (form and biases of its spec)."""
    spec, b = weights.spec, weights.biases
    return grouped_ffn(rows, counts, weights.w13[experts], weights.w2[experts], spec.activation, spec.glu,
                       *(t[experts] for t in b))


def shared_ffn(x: torch.Tensor, weights: ExpertWeights) -> torch.Tensor | None:
    """Shared experts on every token: [N, H] spec.dtype, or None when there are none."""
    if not weights.has_shared:
        return None
    return expert_ffn(x, weights.shared_w13, weights.shared_w2, weights.spec.activation)


def topk_sum(o: torch.Tensor, w: torch.Tensor, shared: torch.Tensor | None,
             dtype: torch.dtype) -> torch.Tensor:
    """The fixed-order combine every backend must reproduce.

    o: [N, k, H] expert outputs in top-k slot order (any float dtype); w: [N, k] float32;
    shared: [N, H] or None.  ``acc`` is fp32, summed slot 0 first, shared last.
    Returns [N, H] in ``dtype``.
    """
    acc = torch.zeros(o.shape[0], o.shape[2], dtype=torch.float32, device=o.device)
    for j in range(o.shape[1]):
        acc = acc + w[:, j:j + 1] * o[:, j].float()
    if shared is not None:
        acc = acc + shared.float()
    return acc.to(dtype)


def add_present(acc: torch.Tensor, term: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
    """acc [N, H] fp32 plus ``term`` [N, H] on the rows where ``present`` [N] bool;
    other rows gain +0.0, which leaves every fp32 value (never -0.0 here) unchanged."""
    return acc + torch.where(present[:, None], term, 0.0)


def rank_partials_sum(o: torch.Tensor, w: torch.Tensor, rank_of_slot: torch.Tensor, ep: int,
                      shared: torch.Tensor | None, dtype: torch.dtype, partial_dtype: torch.dtype,
                      nodes: int = 1) -> torch.Tensor:
    """The combine of rank-deduplicated dispatch (``DispatchMode.PER_RANK``, and
    ``PER_NODE`` over ``nodes`` nodes of consecutive ranks).

    o: [N, k, H] expert outputs in slot order; w: [N, k] float32; rank_of_slot: [N, k]
    int64 rank holding each slot's expert; the N tokens are split evenly over the ``ep``
    ranks.  Each rank's partial is the fp32 sum of its slots' ``w_j * o_j`` in slot
    order, cast to ``partial_dtype`` (the wire dtype).  With ``nodes`` > 1 the partials
    of the ranks of a node other than the token's own are first summed in fp32, rank
    order, and cast to ``partial_dtype`` (what the node's relay sends back).  The
    token's output is the fp32 sum of its partials in rank order (a node's sum at the
    node's last rank), shared expert last, cast to ``dtype``.  Returns [N, H].
    """
    rpn = ep // nodes
    node_of_token = torch.arange(o.shape[0], device=o.device) // max(o.shape[0] // ep, 1) // rpn
    acc = torch.zeros(o.shape[0], o.shape[2], dtype=torch.float32, device=o.device)
    node_acc = torch.zeros_like(acc)
    for r in range(ep):
        mine = rank_of_slot == r
        part = torch.zeros_like(acc)
        for j in range(o.shape[1]):
            part = add_present(part, w[:, j:j + 1] * o[:, j].float(), mine[:, j])
        part = part.to(partial_dtype).float()
        here = mine.any(dim=1)
        home = node_of_token == r // rpn
        acc = add_present(acc, part, here & home)
        node_acc = add_present(node_acc, part, here & ~home)
        if nodes > 1 and r % rpn == rpn - 1:
            reached = (rank_of_slot // rpn == r // rpn).any(dim=1) & ~home
            acc = add_present(acc, node_acc.to(partial_dtype).float(), reached)
            node_acc = torch.zeros_like(acc)
    if shared is not None:
        acc = acc + shared.float()
    return acc.to(dtype)


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """pos with ``pos[order[i]] == i``; order: [M] int64 permutation of range(M)."""
    pos = torch.empty_like(order)
    pos[order] = torch.arange(order.numel(), device=order.device)
    return pos


# ---------------------------------------------------------------------------- dense


def dense_moe(x: torch.Tensor, weights: ExpertWeights, routing: Routing) -> torch.Tensor:
    """Single-process MoE layer: routed experts plus shared experts (arguments in the
    order of ``moe_forward``).

    x: [N, H] spec.dtype; weights: the layer's parameters; routing: ids/weights [N, k].
    Returns [N, H] spec.dtype.  Differentiable by autograd with respect to ``x``,
    ``routing.weights`` and every weight tensor.

    1. sort the N*k (token, slot) rows by expert (stable: token order within an expert);
    2. run each expert once on its segment (:func:`grouped_ffn`);
    3. unsort to [N, k, H] and combine with :func:`topk_sum`.
    """
    o = expert_outputs(x, weights, routing)
    return topk_sum(o, routing.weights, shared_ffn(x, weights), weights.spec.dtype)


def expert_outputs(x: torch.Tensor, weights: ExpertWeights, routing: Routing) -> torch.Tensor:
    """[N, k, H] spec.dtype: each token's expert outputs in top-k slot order (steps 1-3
    of :func:`dense_moe`, before the combine)."""
    _check_order(weights, routing)
    spec = weights.spec
    check_input(x, routing, spec)
    n, k = routing.ids.shape
    flat = routing.ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=spec.experts)
    ys = routed_ffn(x[order // k], counts, weights)
    return ys.index_select(0, inverse_permutation(order)).view(n, k, spec.hidden)


def dense_moe_rank_partials(x: torch.Tensor, weights: ExpertWeights, routing: Routing, ep: int,
                            partial_dtype: torch.dtype = torch.float32, nodes: int = 1) -> torch.Tensor:
    """:func:`dense_moe` with the combine of rank-deduplicated dispatch over ``ep``
    ranks (:func:`rank_partials_sum`): what ``DispatchMode.PER_RANK`` must reproduce,
    and ``PER_NODE`` over ``nodes`` nodes.  With one rank and fp32 partials it equals
    :func:`dense_moe` bit for bit."""
    o = expert_outputs(x, weights, routing)
    local = _local_experts(weights.spec, ep)
    if ep % nodes:
        raise ValueError(f"nodes={nodes} does not divide ep={ep}")
    return rank_partials_sum(o, routing.weights, routing.ids // local, ep, shared_ffn(x, weights),
                             weights.spec.dtype, partial_dtype, nodes)


# ---------------------------------------------------------------------------- serialized EP


@dataclass
class SerialResult:
    """What one rank of :func:`serialized_ep_forward` saw and produced.

    out:           [T, H] spec.dtype — the layer output for this rank's tokens.
    dispatch_recv: [R, H] spec.dtype — rows received in dispatch, in all-to-all order
                   (by source rank, then local expert, token order within).
    combine_recv:  [T*k, H] spec.dtype — expert outputs received back, in this rank's
                   permuted (sorted-by-expert, stable) order.
    recv_counts:   [ep, L] int64 — rows received from each source for each local expert.
    """

    out: torch.Tensor
    dispatch_recv: torch.Tensor
    combine_recv: torch.Tensor
    recv_counts: torch.Tensor


def serialized_ep_forward(x_local: torch.Tensor, weights: ExpertWeights, routing_local: Routing,
                          group: dist.ProcessGroup | None = None) -> SerialResult:
    """The kernel-by-kernel expert-parallel baseline, forward only (call on every rank).

    x_local: [T, H] spec.dtype; weights: the full layer (rank r uses experts
    [r*L, (r+1)*L), L = E/ep); routing_local: ids/weights [T, k] of these tokens (global
    expert ids).
    T may differ between ranks.

    1. permute rows by global expert (stable argsort); 2. all-to-all the per-expert counts;
    3. dispatch rows (uneven all-to-all); 4. run the local experts; 5. send results back;
    6. unpermute and combine with :func:`topk_sum`, shared experts on the local tokens.
    """
    _check_order(weights, routing_local)
    spec = weights.spec
    rank, ep = dist.get_rank(group), dist.get_world_size(group)
    local = _local_experts(spec, ep)
    check_input(x_local, routing_local, spec, "x_local")
    t, k = routing_local.ids.shape
    with torch.no_grad():
        flat = routing_local.ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        send_counts = torch.bincount(flat, minlength=spec.experts).view(ep, local)
        recv_counts = exchange_counts(send_counts, group)
        recv = ep_dispatch(x_local[order // k], send_counts, recv_counts, group)
        mine = slice(rank * local, (rank + 1) * local)
        ys = run_local_experts(recv, recv_counts, weights, mine)
        back = ep_combine(ys, send_counts, recv_counts, group)
        o = back.index_select(0, inverse_permutation(order)).view(t, k, spec.hidden)
        out = topk_sum(o, routing_local.weights, shared_ffn(x_local, weights), spec.dtype)
    return SerialResult(out=out, dispatch_recv=recv, combine_recv=back, recv_counts=recv_counts)


def _check_order(weights: object, routing: object) -> None:
    """TypeError when the two are swapped (the order is x, weights, routing everywhere)."""
    if not isinstance(weights, ExpertWeights) or not isinstance(routing, Routing):
        raise TypeError(f"expected (x, weights: ExpertWeights, routing: Routing), got weights="
                        f"{type(weights).__name__}, routing={type(routing).__name__}")


def _local_experts(spec: MoESpec, ep: int) -> int:
    if spec.experts % ep:
        raise ValueError(f"world size ep={ep} does not divide MoESpec.experts={spec.experts}")
    return spec.experts // ep


def exchange_counts(send_counts: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """send_counts: [ep, L] int64 rows this rank sends to expert e of rank d.
    Returns [ep, L] int64 rows this rank receives from source s for its local expert e."""
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts.contiguous(), group=group)
    return recv_counts


def ep_dispatch(rows: torch.Tensor, send_counts: torch.Tensor, recv_counts: torch.Tensor,
                group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """rows: [T*k, H] sorted by global expert; counts: [ep, L] int64 (as sent / received).
    Returns [R, H] (same dtype): received rows by source rank, then local expert."""
    return _all_to_all(rows, send_counts.sum(1), recv_counts.sum(1), group)


def ep_combine(ys: torch.Tensor, send_counts: torch.Tensor, recv_counts: torch.Tensor,
               group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """ys: [R, H] expert outputs in dispatch-receive order; counts as in :func:`ep_dispatch`.
    Returns [T*k, H]: this rank's rows back, in its sorted-by-expert order."""
    return _all_to_all(ys, recv_counts.sum(1), send_counts.sum(1), group)


def _all_to_all(rows: torch.Tensor, send: torch.Tensor, recv: torch.Tensor,
                group: dist.ProcessGroup | None) -> torch.Tensor:
    """Uneven all-to-all of rows: send[d] rows go to rank d, recv[s] come from rank s."""
    out = rows.new_empty(int(recv.sum()), rows.shape[1])
    dist.all_to_all_single(out, rows.contiguous(), recv.tolist(), send.tolist(), group=group)
    return out


def run_local_experts(recv: torch.Tensor, recv_counts: torch.Tensor, weights: ExpertWeights,
                      experts: slice) -> torch.Tensor:
    """Apply local expert e (of ``weights``' ``experts``) to its rows of every source.

    recv: [R, H] in dispatch order (source s, then local expert e); recv_counts: [ep, L].
    Regroups rows by (e, s) so each expert runs once on its rows in global token order,
    then restores dispatch order.  Returns [R, H].
    """
    ep, local = recv_counts.shape
    dev = recv_counts.device
    # [s, e] -> e*ep + s
    segment_key = torch.arange(local, device=dev) * ep + torch.arange(ep, device=dev)[:, None]
    row_key = torch.repeat_interleave(segment_key.reshape(-1), recv_counts.reshape(-1))
    perm = torch.argsort(row_key, stable=True)
    ys = routed_ffn(recv[perm], recv_counts.sum(0), weights, experts)
    return ys.index_select(0, inverse_permutation(perm))
