"""Backend "triton": the expert compute as separate Triton kernels (schedule, row copies, grouped
GEMMs, combine), on one GPU or expert-parallel over NVLink (any world size).

One GPU (W = 1):
  Forward:  schedule -> gather rows -> gate/up GEMM + SwiGLU -> down GEMM -> combine (+ shared).
  Backward: route grad (d_z rows, d_w) -> down dgrad + SwiGLU backward -> gate/up dgrad (one
  accumulator) -> combine d_x; weight gradients per expert in fixed row order.

Expert parallel (W > 1), through the symmetric workspace (docs/comm.md):
  Schedule: publish ids -> barrier -> gather every rank's ids -> row schedule of the local
            experts (global slot order) -> capacity check on the device (on overflow: empty
            schedule, and the step's combines write NaN instead of reading stale slots).
  Forward:  publish x, weights -> barrier -> pull x rows from the peers -> the same expert
            GEMMs -> push z rows into the source ranks' combine slots -> barrier -> combine the
            own slots in k order (+ shared).
  Backward: publish dy -> barrier -> pull dy rows (unscaled) -> route grad by row -> the same
            dgrad/wgrad GEMMs -> push d_x rows and d_w values to the source ranks -> barrier ->
            sum the own d_x slots in k order (+ shared d_x).

Each expert sees its rows in the same order and tiles at every world size and the combines run
the same kernels, so routed outputs and gradients at W > 1 have the bits of W = 1 on the same
global batch. Nothing reads the device from the host (a whole step can be captured in a CUDA
graph); device error records reach Python as ``megamoe.ep.checks`` describes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..config import MoEConfig
from ..ep import checks
from ..types import ExpertWeights
from . import state, steps
from .requirements import is_available, supports
from .state import TritonContext, TritonSchedule, save
from .steps import backward, build_schedule, check

__all__ = [
    "saved_layout",
    "save",
    "restore",
    "is_available",
    "supports",
    "build_schedule",
    "forward",
    "backward",
    "check",
    "MAX_WORLD_SIZE",
]

# Any expert-parallel world size (the comm layer is written for W ranks).
MAX_WORLD_SIZE = None


def forward(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: ExpertWeights,
    config: MoEConfig,
    group: dist.ProcessGroup | None,
    schedule: TritonSchedule | None,
) -> tuple[torch.Tensor, TritonContext]:
    """y [T, H] bf16 and the context for :func:`backward`."""
    if x.shape[0] == 0:
        return steps.empty_forward(x, topk_weights, weights)
    x, topk_weights, weights, schedule = steps.prepare(
        x, topk_ids, topk_weights, weights, config, group, schedule
    )
    if schedule.ep is None:
        y, ctx = steps.local_forward(x, topk_weights, weights, schedule)
        checks.eager_check(checks.device_records(x.device))
        return y, ctx
    ws = schedule.ep.workspace
    y, ctx = steps.run_steps(steps.forward_steps(x, topk_weights, weights, schedule), ws)
    checks.eager_check(ws)
    return y, ctx


def saved_layout(
    config: MoEConfig, tokens: int, world_size: int, dtype: torch.dtype
) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """What :func:`save` returns for such a step (``megamoe.ops``' fake forward)."""
    return state.saved_layout(config, tokens, world_size, dtype, keeps_routed=True)


def restore(
    saved: list[torch.Tensor],
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: ExpertWeights,
    config: MoEConfig,
    group: dist.ProcessGroup | None,
) -> TritonContext:
    return state.restore(saved, x, topk_weights, weights, config, group, keeps_routed=True)
