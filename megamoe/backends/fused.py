"""Backend "fused": the forward's shared expert, pull, routed expert GEMMs and push run as one
persistent kernel (``megamoe.kernels.fused``); opt-in, the backward's too.

Everything else is the Triton backends' shared code (``steps``): the schedule, the barriers, the
k-order combine of the own slots, the error checks and, by default, the whole backward. The forward
protocol is ``steps.forward_steps`` (publish x -> barrier -> experts -> barrier -> k-order
combine of the own slots + shared output) with the fused kernel as its experts step. The kernel
gives the same bits as the unfused launches (same tile functions, tiles and row layout), so
``backend="fused"`` outputs equal ``backend="triton"`` bit for bit.

Backward (:func:`backward_kind`): backend "triton"'s backward (``steps.backward``), or, with
``MEGAMOE_FUSED_BACKWARD=1``, one fused kernel for the shared and routed experts' dgrad and
weight gradients (``kernels.fused.backward``): with one process between the route grad and the
k-order combine of d_x; at W > 1 (:func:`backward_steps`) with the dy pull, the route grad's dz
and the d_x push inside the kernel, then the route-grad kernel's d topk_weights on the pulled
rows and its push, barrier, combine of the own d_x slots. Bitwise backend "triton"'s backward
at every W. The fused backward is opt-in until it has been measured on a GPU (docs/fused.md; at
W > 1 it has not run on one yet).

Ring (``config.ring_rows``; None, the default: every row): when it holds every row of the
schedule the forward saves the routed activations as backend "triton" does. When it is smaller,
the routed rows only ever live in the ring (memory bounded by ``ring_rows`` in the forward and
between forward and backward); the context drops them (``routed = None``) and the backward
recomputes them with the unfused kernels (the same bits): the fused backward one macrobatch of
ring rows at a time (:func:`_macrobatch_steps`: replay and one fused launch per window of the
layout's rows, the weight gradients carried across windows in fp32), so that its routed memory
is bounded by the ring too; backend "triton"'s backward the whole routed forward first. The
shared expert's activations are always saved (T rows).

With one GPU the forward runs on a private one-rank workspace (``steps.single_rank``), so W = 1
runs the very same kernel and protocol; the fused backward's waits record stalls there too.
In fp8 on Hopper (:func:`forward_kind`) the forward is the pipelined one at W > 1 and backend
"triton"'s with one process, whose rows are local: no pulls to hide.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch
import torch.distributed as dist

from ..config import MoEConfig
from ..ep import checks
from ..ep.workspace import Workspace, local_workspace, publish
from ..kernels import comm, fp8, fp8_gemm, rows
from ..kernels.fused import comm_kernel_programs, comm_programs_for, fused_forward
from ..kernels.fused.backward import (
    Macrobatch,
    SharedBackwardInputs,
    fused_backward,
    fused_backward_ep,
    macrobatch_outputs,
)
from ..kernels.fused.forward import start_pulls
from ..kernels.fused.plan import pull_programs_for, push_programs_for
from ..kernels.runtime import empty, persistent_programs
from ..kernels.schedule import row_window
from ..types import ExpertWeights, MoEGrads, RoutedActivations
from . import experts, fp8_weights, state, steps
from .requirements import KERNEL_DTYPE, is_available, supports
from .state import EmptyContext, TritonContext, TritonSchedule, save
from .steps import build_schedule, check

__all__ = [
    "saved_layout",
    "save",
    "restore",
    "is_available",
    "supports",
    "build_schedule",
    "forward",
    "backward",
    "backward_steps",
    "check",
    "forward_steps",
    "resolved_tunables",
    "forward_kind",
    "pipelined_fp8",
    "uses_comm_kernel",
    "backward_kind",
    "macrobatch_rows",
    "FUSED_BACKWARD_ENV",
    "PIPELINED_FP8_ENV",
    "MAX_WORLD_SIZE",
]

# Any expert-parallel world size, like backend "triton".
MAX_WORLD_SIZE = None
# "1": the fused backward kernel; "0" (the default): backend "triton"'s backward (backward_kind).
FUSED_BACKWARD_ENV = "MEGAMOE_FUSED_BACKWARD"
# "1" (the default): the pipelined fp8 forward on Hopper; "0": the fused kernel (forward_kind).
PIPELINED_FP8_ENV = "MEGAMOE_PIPELINED_FP8"


def pipelined_fp8() -> bool:
    """Whether ``MEGAMOE_PIPELINED_FP8`` (default "1") lets the fp8 forward pipeline its pulls
    (:func:`forward_kind`); "0" runs the fused kernel's fp8 tiles instead."""
    value = os.environ.get(PIPELINED_FP8_ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{PIPELINED_FP8_ENV} must be 0 or 1, got {value!r}")
    return value == "1"


def _pipelines(config: MoEConfig, device: torch.device) -> bool:
    """fp8 with ``comm_kernel`` None and :func:`pipelined_fp8`, on a GPU that runs the
    warp-specialized fp8 GEMMs, with the ring holding every row (the pulled rows are all
    kept; a bounded ring keeps the fused kernel, which bounds them)."""
    return (
        config.precision == "fp8"
        and config.comm_kernel is None
        and config.ring_rows is None
        and pipelined_fp8()
        and fp8_gemm.warp_specialized("gate_up", device, config.block_rows)
    )


def forward_kind(config: MoEConfig, device: torch.device, world_size: int = 1) -> str:
    """Which forward runs: where the fp8 forward pipelines (:func:`_pipelines`), "pipelined"
    at W > 1 (:func:`_pipelined_experts` between the barriers) and "unfused" with one process
    (backend "triton"'s one-process forward: its rows are local, a gather on every SM, so
    there are no pulls to hide and pull programs would only take SMs from the GEMMs); else
    the fused kernel: "comm_kernel" (:func:`uses_comm_kernel`) or "one_kernel"."""
    if _pipelines(config, device):
        return "pipelined" if world_size > 1 else "unfused"
    return "comm_kernel" if uses_comm_kernel(config, world_size) else "one_kernel"


def uses_comm_kernel(config: MoEConfig, world_size: int) -> bool:
    """``config.comm_kernel``, None resolved: on when the ring holds every row (the comm kernel
    needs that; a bounded ring keeps the one-kernel forward), at any world size, in bf16; off
    in fp8, whose compute programs fit beside the comm kernel's only capped at 216 registers,
    and whose two forwards traced alike (docs/fused.md, "fp8")."""
    if config.comm_kernel is not None:
        return config.comm_kernel
    return config.ring_rows is None and config.precision == "bf16"


def resolved_tunables(
    config: MoEConfig, device: torch.device, world_size: int
) -> dict[str, int | str | None]:
    """The tunables as the forward uses them on ``device`` at ``world_size``: which forward
    (:func:`forward_kind`), the comm kernel on or off (the pipelined forward pulls with it),
    the derived comm programs (the comm kernel's, the one kernel's, or the pipelined forward's
    pulls') for None, and the pipelined forward's push programs (None for the others); the
    "unfused" forward has neither. (``down_lag`` None stays None: it also depends on the ring
    and the schedule's rows.)"""
    kind = forward_kind(config, device, world_size)
    if kind == "unfused":
        return {"comm_programs": None, "push_programs": None, "comm_kernel": False, "forward": kind}
    num_comm, pushes = config.comm_programs, None
    programs = persistent_programs(device)
    hidden, inter = config.hidden_size, config.intermediate_size
    if num_comm is None:
        if kind == "pipelined":
            row_bytes = 2 * fp8.packed_width(hidden)
            num_comm = pull_programs_for(programs, hidden, inter, row_bytes, world_size)
        elif kind == "comm_kernel":
            num_comm = comm_kernel_programs(device)
        else:
            num_comm = comm_programs_for(programs, inter, world_size)
    if kind == "pipelined":
        pushes = config.push_programs
        if pushes is None:
            pushes = push_programs_for(programs, inter)
    return {
        "comm_programs": num_comm,
        "push_programs": pushes,
        "comm_kernel": kind != "one_kernel",
        "forward": kind,
    }


def _experts_step(
    ws: Workspace,
    schedule: TritonSchedule,
    weights: ExpertWeights,
    x: torch.Tensor,
    fp8w: fp8_weights.StepWeights | None,
    trace: torch.Tensor | None = None,
) -> steps.ExpertsOutput:
    """``steps.experts_unfused`` as one fused launch (in fp8 on the step's fp8 weights
    ``fp8w`` and this rank's published packed rows), or in fp8 on Hopper the pipelined forward
    (:func:`_pipelined_experts`, also on a one-rank workspace)."""
    config = schedule.config
    if _pipelines(config, ws.device):
        _refuse_trace(trace, "pipelined")
        return _pipelined_experts(ws, schedule, weights, x, fp8w)
    tokens = steps.published_tokens(ws, x, config)
    shared = None
    if weights.has_shared:
        shared = (tokens, weights.s_gate, weights.s_up, weights.s_down)
    tunables = resolved_tunables(config, ws.device, ws.world_size)
    out = fused_forward(
        ws,
        schedule.routed,
        weights.w_gate,
        weights.w_up,
        weights.w_down,
        num_comm=tunables["comm_programs"],
        minibatch_rows=config.minibatch_rows,
        ring_rows=config.ring_rows,
        shared=shared,
        down_lag=config.down_lag,
        trace=trace,
        comm_kernel=tunables["comm_kernel"],
        fp8_weights=fp8w,
    )
    return (out.routed if out.full else None), out.shared, out.shared_out


def _pipelined_experts(
    ws: Workspace,
    schedule: TritonSchedule,
    weights: ExpertWeights,
    x: torch.Tensor,
    fp8w: fp8_weights.StepWeights,
) -> steps.ExpertsOutput:
    """The fp8 forward's experts on the warp-specialized GEMMs: the comm kernel pulls the
    packed rows on SMs of its own (``kernels.fused.start_pulls``) while the shared expert's
    GEMMs and then the routed gate/up and down GEMMs run on the other SMs, the gate/up kernel
    waiting for each row block's pull; then the comm programs push z into the source ranks'
    combine slots, each minibatch once down has stored its tiles (``Pulls.push``). The GEMMs
    are backend "triton"'s: the same bits. (They fill an SM's registers, so the comm programs
    take SMs of their own, not a place beside them as in the bf16 comm-kernel forward.)"""
    config, sched = schedule.config, schedule.routed
    tokens = steps.published_tokens(ws, x, config)
    pulls = start_pulls(
        ws,
        sched,
        weights.w_gate.shape[1],
        config.comm_programs,
        config.minibatch_rows,
        push_programs=config.push_programs,
    )
    try:
        shared, shared_out = experts.shared_forward(
            tokens, weights, config, pulls.programs, fp8w=fp8w
        )
        routed = experts.routed_forward(pulls.rows, weights, sched, "fp8", fp8w, pulls)
        pulls.push(routed.z, fp8_gemm.stored_signals(sched.block_rows, config.hidden_size))
    finally:
        pulls.join()
    return routed, shared, shared_out


def _refuse_trace(trace: torch.Tensor | None, kind: str) -> None:
    if trace is not None:
        raise ValueError(
            f"trace: the {kind} fp8 forward runs no fused kernel to trace; comm_kernel=False "
            "traces the one-kernel fp8 forward"
        )


def forward_steps(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: ExpertWeights,
    schedule: TritonSchedule,
    trace: torch.Tensor | None = None,
) -> steps.Steps[tuple[torch.Tensor, TritonContext]]:
    """``steps.forward_steps`` with the fused kernel between the two barriers (``trace``: see
    ``fused_forward``)."""
    return steps.forward_steps(
        x, topk_weights, weights, schedule, functools.partial(_experts_step, trace=trace)
    )


def forward(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: ExpertWeights,
    config: MoEConfig,
    group: dist.ProcessGroup | None,
    schedule: TritonSchedule | None,
    *,
    trace: torch.Tensor | None = None,
) -> tuple[torch.Tensor, TritonContext]:
    """y [T, H] bf16 and the Triton backends' context (``routed`` None when the ring dropped
    the routed rows: the backward replays them). ``trace``: a profile of the kernel
    (``fused_forward``, ``megamoe.tools.fused_trace``)."""
    from . import check_precision  # (the package imports this module)

    check_precision("fused", config)
    if backward_kind() == "fused":
        _check_fused_backward(config)
    if x.shape[0] == 0:
        return steps.empty_forward(x, topk_weights, weights)
    x, topk_weights, weights, schedule = steps.prepare(
        x, topk_ids, topk_weights, weights, config, group, schedule
    )
    if schedule.ep is None and forward_kind(config, x.device) == "unfused":
        _refuse_trace(trace, "one-process")
        y, ctx = steps.local_forward(x, topk_weights, weights, schedule)
        checks.eager_check(checks.device_records(x.device))
        return y, ctx
    run = schedule if schedule.ep is not None else steps.single_rank(schedule, topk_ids)
    ws = run.ep.workspace
    if schedule.ep is None:  # the private workspace's stall record (the ids: build_schedule)
        checks.lagged_check(ws)
    y, ctx = steps.run_steps(forward_steps(x, topk_weights, weights, run, trace), ws)
    checks.eager_check(ws)
    if schedule.ep is None:  # the backward runs the one-process path: weights in token order
        checks.eager_check(checks.device_records(x.device))
        ctx = dataclasses.replace(ctx, schedule=schedule, slot_weights=topk_weights.view(-1))
    return y, ctx


def keeps_routed(config: MoEConfig, tokens: int, world_size: int) -> bool:
    """Whether the forward saves the routed activations: the ring holds every row."""
    return (
        config.ring_rows is None
        or config.ring_rows >= state.schedule_rows(config, tokens, world_size)[1]
    )


def saved_layout(
    config: MoEConfig, tokens: int, world_size: int, dtype: torch.dtype
) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """What :func:`save` returns for such a step (``megamoe.ops``' fake forward)."""
    return state.saved_layout(
        config, tokens, world_size, dtype, keeps_routed(config, tokens, world_size)
    )


def restore(
    saved: list[torch.Tensor],
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: ExpertWeights,
    config: MoEConfig,
    group: dist.ProcessGroup | None,
) -> TritonContext:
    return state.restore(
        saved,
        x,
        topk_weights,
        weights,
        config,
        group,
        keeps_routed(
            config, topk_weights.shape[0], 1 if group is None else dist.get_world_size(group)
        ),
    )


# --------------------------------------------------------------------------------------------
# Backward


def backward_kind(world_size: int = 1) -> str:
    """Which backward :func:`backward` runs at ``world_size``: "fused" (the fused backward
    kernel, with its dy pull and d_x push inside at W > 1: ``MEGAMOE_FUSED_BACKWARD=1``) or
    "triton" (backend "triton"'s unfused backward: the default)."""
    value = os.environ.get(FUSED_BACKWARD_ENV, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{FUSED_BACKWARD_ENV} must be 0 or 1, got {value!r}")
    return "fused" if value == "1" else "triton"


def _check_fused_backward(config: MoEConfig) -> None:
    """The fused backward runs bf16 only: fp8 runs the fused forward with backend "triton"'s
    backward (an error, not bf16 arithmetic on fp8 activations)."""
    if config.precision != "bf16":
        raise ValueError(
            f"{FUSED_BACKWARD_ENV}=1 selects the fused backward, which runs bf16 only; precision "
            f"{config.precision!r} runs backend 'fused''s forward with backend 'triton''s "
            f"backward: unset {FUSED_BACKWARD_ENV} or set it to 0"
        )


def _shared_inputs(ctx: TritonContext, dy: torch.Tensor) -> SharedBackwardInputs | None:
    w = ctx.weights
    if ctx.shared is None:
        return None
    return SharedBackwardInputs(dy, ctx.x, ctx.shared, w.s_gate, w.s_up, w.s_down)


def _local_backward(ctx: TritonContext, dy: torch.Tensor, ws: Workspace) -> MoEGrads:
    """``steps.local_backward`` with its expert GEMMs (shared and routed dgrad and weight
    gradients) in one fused launch: route grad -> fused kernel -> k-order combine of d_x
    (``ws``: the private one-rank workspace, whose stall record the kernel's waits write)."""
    sched, config = ctx.schedule.routed, ctx.schedule.config
    routed, w, x = ctx.routed, ctx.weights, ctx.x
    dz, d_topk = rows.route_grad(dy, routed.z, ctx.slot_weights, sched)
    out = fused_backward(
        ws,
        sched,
        dz,
        routed.xs,
        routed.g,
        routed.u,
        routed.h,
        w.w_gate,
        w.w_up,
        w.w_down,
        group_rows=config.minibatch_rows,
        shared=_shared_inputs(ctx, dy),
    )
    invalid = ctx.schedule.invalid
    dx = rows.combine(out.dxs, sched, None, out.dx_shared, x.dtype, invalid)
    d_topk = steps.nan_if(invalid, d_topk)  # (else stale values)
    return MoEGrads(
        dx,
        d_topk,
        out.d_w_gate,
        out.d_w_up,
        out.d_w_down,
        out.d_s_gate,
        out.d_s_up,
        out.d_s_down,
    )


def macrobatch_rows(config: MoEConfig, layout_rows: int) -> int:
    """Rows of a macrobatch of the fused backward after a bounded ring: the ring's
    (``config.ring_rows``, a multiple of ``minibatch_rows`` and so of the row block and of the
    weight gradients' K step, which divides the power-of-two block rows), at most the
    layout's ``layout_rows``."""
    ring = config.ring_rows if config.ring_rows is not None else layout_rows
    if ring % config.block_rows:
        raise ValueError(
            f"ring_rows must be a multiple of block_rows ({config.block_rows}), got {ring}"
        )
    return min(ring, layout_rows)


def _macrobatch_steps(ctx: TritonContext, dy: torch.Tensor, ws: Workspace) -> steps.Steps[MoEGrads]:
    """The fused backward after a bounded ring, one macrobatch of rows at a time: the layout's
    rows ``[0, rows)`` (host-known) in windows of :func:`macrobatch_rows`, each replayed
    (``steps.replay_window``: gather or, at W > 1, pull; gate/up + SwiGLU; down) into buffers of
    the ring's rows, then route-graded and differentiated by one fused launch of its dgrad and
    of its rows' share of every routed weight-gradient tile (continued across windows in fp32
    carries, ``kernels.fused.backward.Macrobatch``); the shared expert in the first launch.

    W = 1 (``ws``: the private one-rank workspace): the route grad (dz rows, d topk_weights of
    the window's slots) before each launch, the k-order combine of the layout's d_x rows after
    the last. W > 1 (``ws``: the schedule's): publish x (for the replay's pulls) and dy, one
    barrier; per window the launch pulls dy, computes dz and pushes d_x (``fused_backward_ep``),
    then the route-grad kernel's d topk_weights of its rows and their push; barrier; combine of
    the own d_x slots. The routed activations and their gradients never exist for more than
    the ring's rows; a window past the used rows has no used row block (its launches do
    nothing). Bitwise :func:`_local_backward` / :func:`backward_steps` after a full replay."""
    sched, config = ctx.schedule.routed, ctx.schedule.config
    w, x = ctx.weights, ctx.x
    ep = ctx.schedule.ep is not None
    if ep:
        steps.publish_tokens(ws, x, config)  # x_buffer may hold a later forward's tokens
        publish(ws, dy=dy.detach())
        yield from steps.barrier_point(ws)
    ring = macrobatch_rows(config, sched.rows)
    dev, dtype = x.device, x.dtype
    hidden, inter = x.shape[1], w.w_gate.shape[1]
    buffers = RoutedActivations(
        *(empty((ring, width), dtype, dev) for width in (hidden, inter, inter, inter, hidden))
    )
    dz, dy_rows = empty((ring, hidden), dtype, dev), None
    if ep:
        dy_rows = empty((ring, hidden), dtype, dev)
    else:
        d_topk = empty((sched.num_tokens, sched.top_k), torch.float32, dev)
    outputs = macrobatch_outputs(sched, ring, w.w_gate, w.w_up, w.w_down, dtype, by_window=ep)
    shared = None
    for first in range(0, sched.rows, ring):
        window = row_window(sched, first, min(ring, sched.rows - first))
        n = window.rows
        acts = steps.replay_window(ctx, window, buffers)
        launch = dict(
            group_rows=config.minibatch_rows,
            shared=_shared_inputs(ctx, dy) if first == 0 else None,
            macrobatch=Macrobatch(outputs, sched, first),
        )
        weights = (w.w_gate, w.w_up, w.w_down)
        if ep:
            out = fused_backward_ep(
                ws,
                window,
                ctx.slot_weights,
                *acts[:4],
                *weights,
                dy_rows=dy_rows[:n],
                dz=dz[:n],
                **launch,
            )
            _, dw_rows = rows.route_grad_rows(
                out.dy_rows, acts.z, ctx.slot_weights, window, dz=out.dz
            )
            comm.push_row_values(ws, dw_rows, window, programs=config.copy_programs)
        else:
            dz_w, _ = rows.route_grad(dy, acts.z, ctx.slot_weights, window, dz=dz[:n], dw=d_topk)
            out = fused_backward(ws, window, dz_w, *acts[:4], *weights, **launch)
        if first == 0:
            shared = out
    invalid = ctx.schedule.invalid
    if ep:
        yield from steps.barrier_point(ws)
        dx = rows.combine_slots(
            ws.dx_slots, ws.top_k, None, shared.dx_shared, x.dtype, invalid=invalid
        )
        # (NaN after a capacity overflow or bad ids: nobody pushed, the slots are stale)
        d_topk = ws.dw_slots.view(ws.num_tokens, ws.top_k)
    else:
        dx = rows.combine(outputs.dxs, sched, None, shared.dx_shared, x.dtype, invalid)
    d_topk = steps.nan_if(invalid, d_topk)  # (else stale values)
    return MoEGrads(
        dx,
        d_topk,
        outputs.d_w_gate,
        outputs.d_w_up,
        outputs.d_w_down,
        shared.d_s_gate,
        shared.d_s_up,
        shared.d_s_down,
    )


def backward_steps(ctx: TritonContext, dy: torch.Tensor) -> steps.Steps[MoEGrads]:
    """``steps.backward_steps`` with the fused kernel (W > 1): publish dy -> barrier -> one
    launch (dy pull, route-grad dz, shared and routed dgrad and weight gradients, d_x push;
    ``kernels.fused.backward.fused_backward_ep``) -> the route-grad kernel on the pulled dy rows
    for d topk_weights (its reduction order) and their push -> barrier -> k-order combine of
    the own d_x slots + shared d_x. After a bounded ring: one replay and launch per macrobatch
    (:func:`_macrobatch_steps`). Bitwise ``steps.backward_steps``."""
    _check_fused_backward(ctx.schedule.config)
    if ctx.routed is None:
        return (yield from _macrobatch_steps(ctx, dy, ctx.schedule.ep.workspace))
    schedule = ctx.schedule
    ws, sched, config = schedule.ep.workspace, schedule.routed, schedule.config
    routed, w = ctx.routed, ctx.weights
    publish(ws, dy=dy.detach())
    yield from steps.barrier_point(ws)
    out = fused_backward_ep(
        ws,
        sched,
        ctx.slot_weights,
        routed.xs,
        routed.g,
        routed.u,
        routed.h,
        w.w_gate,
        w.w_up,
        w.w_down,
        group_rows=config.minibatch_rows,
        shared=_shared_inputs(ctx, dy),
    )
    _, dw_rows = rows.route_grad_rows(out.dy_rows, routed.z, ctx.slot_weights, sched)
    comm.push_row_values(ws, dw_rows, sched, programs=config.copy_programs)
    yield from steps.barrier_point(ws)
    invalid = schedule.invalid
    dx = rows.combine_slots(
        ws.dx_slots, ws.top_k, None, out.dx_shared, ctx.x.dtype, invalid=invalid
    )
    # (NaN after a capacity overflow or bad ids: nobody pushed, the slots are stale)
    d_topk = steps.nan_if(invalid, ws.dw_slots.view(ws.num_tokens, ws.top_k))
    return MoEGrads(
        dx,
        d_topk,
        out.d_w_gate,
        out.d_w_up,
        out.d_w_down,
        out.d_s_gate,
        out.d_s_up,
        out.d_s_down,
    )


def backward(ctx: TritonContext | EmptyContext, grad_y: torch.Tensor) -> MoEGrads:
    """Gradients of x (bf16), the router weights (fp32) and every weight (weight dtype): the
    fused backward when :func:`backward_kind` says so (W > 1: :func:`backward_steps`), else
    ``steps.backward``. A bounded ring's dropped routed rows are replayed macrobatch by
    macrobatch (:func:`_macrobatch_steps`; W > 1: in :func:`backward_steps`)."""
    if isinstance(ctx, EmptyContext) or backward_kind() != "fused":
        return steps.backward(ctx, grad_y)
    _check_fused_backward(ctx.schedule.config)
    dy = grad_y.to(ctx.x.dtype).contiguous()
    if ctx.schedule.ep is not None:
        ws = ctx.schedule.ep.workspace
        grads = steps.run_steps(backward_steps(ctx, dy), ws)
        checks.eager_check(ws)
        return grads
    x = ctx.x  # the forward's private workspace (steps.single_rank)
    ws = local_workspace(x.shape[0], x.shape[1], ctx.schedule.routed.top_k, KERNEL_DTYPE, x.device)
    if ctx.routed is None:  # a bounded ring: replayed and differentiated macrobatch by macrobatch
        grads = steps.drain(_macrobatch_steps(ctx, dy, ws))
    else:
        grads = _local_backward(ctx, dy, ws)
    checks.eager_check(ws)
    checks.eager_check(checks.device_records(dy.device))
    return grads
