"""Backend "fused": the forward's shared expert, pull, routed expert GEMMs and push run as ONE
persistent kernel.

Everything else is backend "triton"'s code, imported, not copied: the schedule, the barriers, the
k-order combine of the own slots, the error checks and the whole backward. The forward protocol
is backend "triton"'s ``forward_steps`` (publish x -> barrier -> experts -> barrier -> k-order
combine of the own slots + shared output) with the fused kernel as its experts step. The kernel
gives the same bits as the unfused launches (same tile functions, tiles and row layout), so
``backend="fused"`` outputs equal ``backend="triton"`` bit for bit and train with its backward.

Ring (``config.ring_rows``; None, the default: every row): when it holds every row of the
schedule (``ring_rows >= schedule.routed.rows``) the forward saves the routed activations as
backend "triton" does. When
it is smaller, the routed rows only ever live in the ring (memory bounded by ``ring_rows`` in the
forward and between forward and backward); the context drops them (``xs = g = u = h = z =
None``) and :func:`backward` first replays the routed forward with the unfused kernels (publish
x -> barrier -> pull -> gate/up -> down; the same bits) and then runs backend "triton"'s
backward. The shared expert's activations are always saved (T rows).

With one GPU there is no symmetric workspace; the forward uses a private one-rank workspace
(plain device memory, cached per shape) so that W = 1 runs the very same kernel and protocol,
"pulling" from its own ``x_buffer`` and "pushing" into its own combine slots.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.distributed as dist

from ..config import MoEConfig
from ..types import ExpertWeights, MoEGrads
from . import triton as unfused
from .triton import (EpRouting, Steps, TritonContext, TritonSchedule, build_schedule, check,
                     is_available, supports)

__all__ = ["is_available", "supports", "build_schedule", "forward", "backward", "check", "forward_steps",
           "replay_steps", "resolved_tunables", "MAX_WORLD_SIZE"]

# Any expert-parallel world size, like backend "triton".
MAX_WORLD_SIZE = None

# One-rank workspaces of W = 1 runs, per (device, T, H, K, dtype).
_LOCAL: dict[tuple, object] = {}


def uses_comm_kernel(config: MoEConfig, world_size: int) -> bool:
    """``config.comm_kernel``, None resolved: on when the ring holds every row (the comm kernel
    needs that; a bounded ring keeps the one-kernel forward), at any world size: at W = 1 its
    local copies beside the MMAs also beat copy programs of the one kernel (BENCHMARKS.md)."""
    if config.comm_kernel is not None:
        return config.comm_kernel
    return config.ring_rows is None


def resolved_tunables(config: MoEConfig, device: torch.device,
                      world_size: int) -> dict[str, int | None]:
    """The tunables as the kernel uses them on ``device`` at ``world_size``: the comm kernel on
    or off, and the derived comm programs (the comm kernel's, or the one kernel's) for None.
    (``down_lag`` None stays None: it also depends on the ring and the schedule's rows.)"""
    from ..kernels.fused_forward import comm_kernel_programs, comm_programs_for
    from ..kernels.runtime import persistent_programs
    split = uses_comm_kernel(config, world_size)
    num_comm = config.comm_programs
    if num_comm is None:
        num_comm = (comm_kernel_programs(device) if split else
                    comm_programs_for(persistent_programs(device), config.intermediate_size,
                                      world_size))
    return {"comm_programs": num_comm, "comm_kernel": split}


def _experts(ws, schedule: TritonSchedule, weights: ExpertWeights, x: torch.Tensor,
             trace: torch.Tensor | None = None) -> unfused.ExpertsOutput:
    """Backend "triton"'s experts step (``triton.experts_unfused``) as one fused launch."""
    from ..kernels.fused_forward import fused_forward
    config = schedule.config
    shared = ((x, weights.s_gate, weights.s_up, weights.s_down) if weights.has_shared else None)
    tunables = resolved_tunables(config, ws.device, ws.world_size)
    out = fused_forward(ws, schedule.routed, weights.w_gate, weights.w_up, weights.w_down,
                        num_comm=tunables["comm_programs"], minibatch_rows=config.minibatch_rows,
                        ring_rows=config.ring_rows, shared=shared, down_lag=config.down_lag,
                        trace=trace, comm_kernel=tunables["comm_kernel"])
    routed = (out.xs, out.g, out.u, out.h, out.z) if out.full else (None,) * 5
    return routed, out.shared, out.shared_out


def forward_steps(x: torch.Tensor, topk_weights: torch.Tensor, weights: ExpertWeights,
                  schedule: TritonSchedule, trace: torch.Tensor | None = None
                  ) -> Steps[tuple[torch.Tensor, TritonContext]]:
    """Backend "triton"'s forward protocol with the fused kernel between the two barriers
    (``trace``: see ``fused_forward``)."""
    return unfused.forward_steps(x, topk_weights, weights, schedule,
                                 functools.partial(_experts, trace=trace))


def replay_steps(ctx: TritonContext) -> Steps[TritonContext]:
    """The context with the routed activations the ring dropped recomputed (bitwise the
    forward's: the unfused pull / gather and GEMMs, which the fused kernel reproduces)."""
    from ..kernels import comm, rows
    from ..workspace import publish
    schedule = ctx.schedule
    sched = schedule.routed
    if schedule.ep is None:  # W = 1: the tokens are here
        xs = rows.gather(ctx.x, sched)
    else:
        ws = schedule.ep.workspace
        publish(ws, x=ctx.x.detach())  # the x_buffer may hold a later forward's tokens
        yield from unfused._barrier_point(ws)
        xs = comm.dispatch_pull(ws, sched, "x", programs=schedule.config.copy_programs)
    g, u, h, z = unfused._experts_forward(xs, ctx.weights, sched)
    return dataclasses.replace(ctx, xs=xs, g=g, u=u, h=h, z=z)


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
            schedule: TritonSchedule | None, *, trace: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, TritonContext]:
    """y [T, H] bf16 and backend "triton"'s context (routed activations None when the ring
    dropped them; :func:`backward` replays them). ``trace``: a profile of the kernel
    (``fused_forward``, ``megamoe.fused_trace``)."""
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
    y, ctx = unfused._run(forward_steps(x, topk_weights, weights, run, trace), ws)
    unfused._eager_check(ws)
    if schedule.ep is None:  # the backward runs the W = 1 path: router weights in token order
        ctx = dataclasses.replace(ctx, schedule=schedule, slot_weights=topk_weights.view(-1))
    return y, ctx


def backward(ctx: TritonContext, grad_y: torch.Tensor) -> MoEGrads:
    """Backend "triton"'s backward, after replaying the routed forward if the ring dropped it."""
    if ctx.xs is None:
        ep = ctx.schedule.ep
        if ep is None:
            ctx = _drain(replay_steps(ctx))
        else:
            ctx = unfused._run(replay_steps(ctx), ep.workspace)
    return unfused.backward(ctx, grad_y)


def _drain(steps: Steps[TritonContext]) -> TritonContext:
    """Run steps that never yield (W = 1 has no barrier)."""
    try:
        next(steps)
    except StopIteration as done:
        return done.value
    raise RuntimeError("a W = 1 replay must not pass a barrier")
