"""Backend "triton": expert compute on one GPU with the Triton kernels of ``megamoe.kernels``.

Forward:  schedule -> gather rows -> gate/up GEMM + SwiGLU -> down GEMM -> combine (+ shared).
Backward: route grad (d_z rows, d_w) -> down dgrad + SwiGLU backward -> gate/up dgrad (one
accumulator) -> combine d_x; weight gradients per expert in fixed row order.

Everything runs on the device without host synchronization (a whole step can be captured in a
CUDA graph) and is bitwise deterministic. Expert parallelism (world size > 1) is issue 6.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..config import MoEConfig
from ..types import ExpertWeights, MoEGrads

if TYPE_CHECKING:
    from ..kernels.schedule import RowSchedule

__all__ = ["is_available", "build_schedule", "forward", "backward", "TritonSchedule",
           "TritonContext"]

# Expert parallelism over NVLink is issue 6; until then this backend runs on one GPU.
MAX_WORLD_SIZE = 1
# Compute capability the kernels are written for (wgmma, TMA).
MIN_CAPABILITY = (9, 0)
KERNEL_DTYPE = torch.bfloat16
# TMA needs 16-byte row strides: sizes must be multiples of this many bf16 elements.
SIZE_MULTIPLE = 8


def _interpreting() -> bool:
    from ..kernels.runtime import interpreting
    return interpreting()


def is_available(device: torch.device | None = None) -> tuple[bool, str]:
    """CUDA with compute capability >= 9.0 and Triton importable.

    On the CPU the answer is no even under ``TRITON_INTERPRET=1``: the interpreter is far too
    slow for real use and must never be what ``backend="auto"`` picks; tests call this module's
    functions directly there.
    """
    try:
        import triton  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the install
        return False, f"triton is not importable: {exc}"
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cpu":
        extra = " (the Triton interpreter runs it for tests only)" if _interpreting() else ""
        return False, "needs a CUDA GPU with compute capability >= 9.0" + extra
    if device.type != "cuda" or not torch.cuda.is_available():
        return False, f"needs a CUDA device, got {device}"
    cap = torch.cuda.get_device_capability(device)
    if cap < MIN_CAPABILITY:
        return False, f"needs compute capability >= 9.0 (Hopper), got {cap[0]}.{cap[1]}"
    return True, f"CUDA compute capability {cap[0]}.{cap[1]}"


@dataclass(frozen=True)
class TritonSchedule:
    """Row layout of the routed experts (device tensors) plus the config it was built for."""

    routed: RowSchedule
    config: MoEConfig


@dataclass
class TritonContext:
    """Activations the backward reads (all in the schedule's row layout unless noted)."""

    schedule: TritonSchedule
    x: torch.Tensor
    topk_weights: torch.Tensor
    weights: ExpertWeights
    xs: torch.Tensor
    g: torch.Tensor
    u: torch.Tensor
    h: torch.Tensor
    z: torch.Tensor
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (g, u, h) in token order


def _world_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def build_schedule(topk_ids: torch.Tensor, config: MoEConfig,
                   group: dist.ProcessGroup | None) -> TritonSchedule:
    """Device-side row layout of this step's routing (no host sync)."""
    if _world_size(group) > 1:
        raise NotImplementedError(
            "backend 'triton' runs on one GPU for now; expert parallelism (world size > 1) is "
            "issue 6 (expert parallelism over NVLink)")
    from ..kernels.schedule import build_row_schedule
    routed = build_row_schedule(topk_ids, config.num_experts, config.block_rows)
    return TritonSchedule(routed, config)


def _check_supported(x: torch.Tensor, config: MoEConfig) -> None:
    if x.dtype != KERNEL_DTYPE:
        raise TypeError(f"x must be bfloat16 for backend 'triton', got {x.dtype}")
    for name in ("hidden_size", "intermediate_size", "shared_intermediate_size"):
        value = getattr(config, name)
        if value % SIZE_MULTIPLE:
            raise ValueError(f"{name} must be a multiple of {SIZE_MULTIPLE} for backend 'triton' "
                             f"(TMA row alignment), got {value}")


def _contiguous(weights: ExpertWeights) -> ExpertWeights:
    return ExpertWeights(*(w.contiguous() if w is not None else None for w in weights))


def forward(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
            weights: ExpertWeights, config: MoEConfig, group: dist.ProcessGroup | None,
            schedule: TritonSchedule | None) -> tuple[torch.Tensor, TritonContext]:
    """y [T, H] bf16 and the context for :func:`backward`."""
    from ..kernels import gemm, rows
    from ..kernels.schedule import uniform_schedule

    _check_supported(x, config)
    if schedule is None:
        schedule = build_schedule(topk_ids, config, group)
    weights = _contiguous(weights)
    x = x.contiguous()
    topk_weights = topk_weights.contiguous()
    sched = schedule.routed
    xs = rows.gather(x, sched)
    g, u, h = gemm.gate_up(xs, weights.w_gate, weights.w_up, sched)
    z = gemm.grouped_mm(h, weights.w_down, sched)
    shared = None
    shared_out = None
    if weights.has_shared:
        one = uniform_schedule(x.shape[0], config.block_rows, x.device)
        sg, su, sh = gemm.gate_up(x, weights.s_gate[None], weights.s_up[None], one)
        shared_out = gemm.grouped_mm(sh, weights.s_down[None], one)
        shared = (sg, su, sh)
    y = rows.combine(z, sched, topk_weights, shared_out, x.dtype)
    ctx = TritonContext(schedule, x, topk_weights, weights, xs, g, u, h, z, shared)
    return y, ctx


def backward(ctx: TritonContext, grad_y: torch.Tensor) -> MoEGrads:
    """Gradients of x (bf16), the router weights (fp32) and every weight (weight dtype)."""
    from ..kernels import gemm, rows
    from ..kernels.schedule import uniform_schedule

    sched = ctx.schedule.routed
    w = ctx.weights
    dy = grad_y.to(ctx.x.dtype).contiguous()
    dz, d_topk = rows.route_grad(dy, ctx.z, ctx.topk_weights, sched)
    dg, du = gemm.dgrad_swiglu(dz, w.w_down, ctx.g, ctx.u, sched)
    dxs = gemm.dgrad_pair(dg, w.w_gate, du, w.w_up, sched)
    d_w_down = gemm.wgrad(dz, ctx.h, sched)
    d_w_gate = gemm.wgrad(dg, ctx.xs, sched)
    d_w_up = gemm.wgrad(du, ctx.xs, sched)
    shared_grads: tuple[torch.Tensor | None, ...] = (None, None, None)
    dx_shared = None
    if ctx.shared is not None:
        sg, su, sh = ctx.shared
        one = uniform_schedule(ctx.x.shape[0], ctx.schedule.config.block_rows, ctx.x.device)
        dsg, dsu = gemm.dgrad_swiglu(dy, w.s_down[None], sg, su, one)
        dx_shared = gemm.dgrad_pair(dsg, w.s_gate[None], dsu, w.s_up[None], one)
        shared_grads = (gemm.wgrad(dsg, ctx.x, one)[0], gemm.wgrad(dsu, ctx.x, one)[0],
                        gemm.wgrad(dy, sh, one)[0])
    dx = rows.combine(dxs, sched, None, dx_shared, ctx.x.dtype)
    return MoEGrads(dx, d_topk, d_w_gate, d_w_up, d_w_down, *shared_grads)
