"""The "torch-a2a" baseline: the MoE layer as a PyTorch user builds it today, for benchmarks.

Per rank: sort the (token, k) rows by global expert, exchange per-(rank, expert) counts with an
``all_to_all_single`` and read them on the host (``.tolist()``: the host sync the fused kernel
avoids), send the rows with a second ``all_to_all_single``, group the received rows by local
expert (stable argsort), run gate/up/down with ``torch._grouped_mm`` in bf16 and SwiGLU, put the
rows back in arrival order with ``index_copy``, send them home, and combine as an fp32 weighted
sum over k plus the optional shared expert. Autograd differentiates everything, including the
router weights; the all-to-all is the reference layer's differentiable row exchange.

``torch._grouped_mm`` also runs (and differentiates) on the CPU in torch >= 2.11, so the same code
is the CPU baseline; a per-expert loop is kept only as a fallback for builds without it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..config import MoEConfig
from ..reference import all_to_all_rows
from ..types import ExpertWeights
from ..validation import group_size_rank

__all__ = ["torch_a2a_moe", "grouped_linear"]


def _has_grouped_mm() -> bool:
    return hasattr(torch, "_grouped_mm")


def grouped_linear(rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``rows[offs[e-1]:offs[e]] @ weight[e].T`` for every expert e, rows grouped by expert.

    rows [N, in], weight [E, out, in] (nn.Linear layout), offsets int32 [E] (cumulative row ends).
    """
    if _has_grouped_mm():
        return torch._grouped_mm(rows, weight.transpose(-2, -1), offs=offsets)
    # Fallback for torch builds without _grouped_mm: one matmul per expert.
    out, start = [], 0
    for e, end in enumerate(offsets.tolist()):
        out.append(rows[start:end] @ weight[e].T)
        start = end
    return torch.cat(out) if out else rows.new_empty((0, weight.shape[1]))


def _swiglu_experts(
    rows: torch.Tensor, counts: torch.Tensor, weights: ExpertWeights
) -> torch.Tensor:
    """Apply local expert e to its ``counts[e]`` consecutive rows (rows grouped by expert)."""
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    gate = grouped_linear(rows, weights.w_gate, offsets)
    up = grouped_linear(rows, weights.w_up, offsets)
    return grouped_linear(F.silu(gate) * up, weights.w_down, offsets)


def _shared_expert(x: torch.Tensor, weights: ExpertWeights) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, weights.s_gate)) * F.linear(x, weights.s_up), weights.s_down)


def _expert_rows(
    x_sorted: torch.Tensor,
    send_counts: torch.Tensor,
    weights: ExpertWeights,
    e_local: int,
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """Send rows (sorted by global expert) to their owners, run the experts, return the results.

    ``send_counts`` [W * E_local] counts this rank's rows per global expert.
    """
    world, _ = group_size_rank(group)
    if world == 1:
        return _swiglu_experts(x_sorted, send_counts, weights)

    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)  # [src rank, local expert]
    # The host sync a PyTorch user pays for the split sizes.
    in_splits = send_counts.view(world, e_local).sum(1).tolist()
    recv_matrix = recv_counts.view(world, e_local)
    out_splits = recv_matrix.sum(1).tolist()

    recv = all_to_all_rows(x_sorted, out_splits, in_splits, group)
    # Arrival order is (source rank, local expert); the GEMMs want rows grouped by local expert.
    local_expert = torch.arange(e_local, device=recv.device).repeat(world)
    row_expert = torch.repeat_interleave(
        local_expert, recv_matrix.reshape(-1), output_size=sum(out_splits)
    )
    perm = torch.argsort(row_expert, stable=True)
    out_grouped = _swiglu_experts(recv[perm], recv_matrix.sum(0), weights)
    out_arrival = torch.zeros_like(out_grouped).index_copy(0, perm, out_grouped)
    return all_to_all_rows(out_arrival, in_splits, out_splits, group)


def torch_a2a_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: ExpertWeights,
    config: MoEConfig,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """y[T, H] (x.dtype) = shared(x) + sum_k topk_weights[:, k] * expert_{topk_ids[:, k]}(x).

    Same contract as :func:`megamoe.reference.moe_reference`; ``weights`` holds this rank's
    ``E / W`` experts. Inputs are assumed valid (this is a benchmark baseline, not the API).
    """
    world, _ = group_size_rank(group)
    e_local = config.local_experts(world)
    num_tokens, top_k = topk_ids.shape

    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)  # (token, k) rows sorted by global expert
    send_counts = torch.bincount(flat_ids, minlength=config.num_experts)
    x_sorted = x[order // top_k]

    out_sorted = _expert_rows(x_sorted, send_counts, weights, e_local, group)
    out = torch.zeros_like(out_sorted).index_copy(0, order, out_sorted)  # back to (token, k) order

    routed = (out.view(num_tokens, top_k, -1).float() * topk_weights.unsqueeze(-1).float()).sum(1)
    if weights.s_gate is not None:
        routed = routed + _shared_expert(x, weights).float()
    return routed.to(x.dtype)
