"""Backend "fused": the forward's pull, expert GEMMs and push run as ONE persistent kernel.

Everything else is backend "triton"'s code, imported, not copied: the schedule, the protocol
(publish x -> barrier -> [routed part] -> shared expert -> barrier -> k-order combine of the own
slots), the error checks and the whole backward. Only the routed part between the two barriers is
:func:`megamoe.kernels.fused_forward.fused_forward` instead of ``dispatch_pull -> gate_up -> down
-> combine_push``; it gives the same bits (same tile functions, tiles and row layout), so
``backend="fused"`` outputs equal ``backend="triton"`` bit for bit and train with its backward.

With one GPU there is no symmetric workspace; the forward uses a private one-rank workspace
(plain device memory, cached per shape) so that W = 1 runs the very same kernel and protocol,
"pulling" from its own ``x_buffer`` and "pushing" into its own combine slots.

Not yet: the shared expert runs in the unfused launches, the routed rows use the full row buffer
(no ring), pushes start after every pull (docs/fused.md).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from ..config import MoEConfig
from ..types import ExpertWeights, MoEGrads
from . import triton as unfused
from .triton import (EpRouting, TritonContext, TritonSchedule, build_schedule, check,
                     is_available)

__all__ = ["is_available", "build_schedule", "forward", "backward", "check", "routed_fused",
           "MAX_WORLD_SIZE"]

# Any expert-parallel world size, like backend "triton".
MAX_WORLD_SIZE = None

# One-rank workspaces of W = 1 runs, per (device, T, H, K, dtype).
_LOCAL: dict[tuple, object] = {}


def routed_fused(ws, schedule: TritonSchedule, weights: ExpertWeights) -> tuple[torch.Tensor, ...]:
    """(xs, g, u, h, z) with z pushed to the sources' combine slots: the fused kernel."""
    from ..kernels.fused_forward import fused_forward
    config = schedule.config
    out = fused_forward(ws, schedule.routed, weights.w_gate, weights.w_up, weights.w_down,
                        num_comm=config.comm_programs, minibatch_rows=config.minibatch_rows)
    return out.xs, out.g, out.u, out.h, out.z


def local_workspace(num_tokens: int, hidden: int, top_k: int, dtype: torch.dtype,
                    device: torch.device):
    """The cached one-rank workspace of a W = 1 forward (no backward regions: unused)."""
    from ..workspace import emulated_workspaces
    key = (device, num_tokens, hidden, top_k, dtype)
    ws = _LOCAL.get(key)
    if ws is None:
        ws = emulated_workspaces(1, num_tokens, hidden, top_k, dtype, device, backward=False)[0]
        _LOCAL[key] = ws
    return ws


def _single_rank_schedule(schedule: TritonSchedule, topk_ids: torch.Tensor) -> TritonSchedule:
    """The W = 1 schedule with a one-rank workspace attached (same row layout)."""
    t, k = topk_ids.shape
    cfg = schedule.config
    ws = local_workspace(t, cfg.hidden_size, k, unfused.KERNEL_DTYPE, topk_ids.device)
    ep = EpRouting(ws, topk_ids, capacity=t * k)
    return dataclasses.replace(schedule, ep=ep)


def forward(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
            weights: ExpertWeights, config: MoEConfig, group: dist.ProcessGroup | None,
            schedule: TritonSchedule | None) -> tuple[torch.Tensor, TritonContext]:
    """y [T, H] bf16 and backend "triton"'s context (its backward runs unchanged)."""
    unfused._check_supported(x, config)
    if schedule is None:
        schedule = build_schedule(topk_ids, config, group)
    weights = unfused._contiguous(weights)
    x = x.contiguous()
    topk_weights = topk_weights.contiguous()
    run = schedule if schedule.ep is not None else _single_rank_schedule(schedule, topk_ids)
    ws = run.ep.workspace
    if x.shape[0] != ws.num_tokens:
        raise ValueError(f"x has {x.shape[0]} tokens, the schedule was built for {ws.num_tokens}")
    if schedule.ep is None:  # W > 1 checks in build_schedule; the private workspace here
        unfused._lagged_check(ws)
    y, ctx = unfused._run(unfused.forward_steps(x, topk_weights, weights, run, routed_fused), ws)
    unfused._eager_check(ws)
    if schedule.ep is None:  # the backward runs the W = 1 path: router weights in token order
        ctx = dataclasses.replace(ctx, schedule=schedule, slot_weights=topk_weights.view(-1))
    return y, ctx


def backward(ctx: TritonContext, grad_y: torch.Tensor) -> MoEGrads:
    """Backend "triton"'s backward (the fused forward saves the same context)."""
    return unfused.backward(ctx, grad_y)
