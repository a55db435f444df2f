"""The steps of the Triton backends, written once for every world size.

The expert-parallel protocol is a set of generators that yield where every rank must pass a
device barrier (docs/design.md, "Expert parallelism"): :func:`run_steps` launches the barrier
at each yield on GPUs, and the CPU tests drive W emulated ranks in lockstep through the same
generators. With one process the same functions run without a workspace.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Generator
from typing import TypeVar

import torch
import torch.distributed as dist

from ..config import MoEConfig
from ..ep import checks
from ..ep.workspace import (
    Workspace,
    get_workspace,
    local_workspace,
    packed_x_buffer,
    publish,
    publish_packed,
)
from ..kernels import comm, fp8, gemm, rows
from ..kernels.checks import check_ids, limit_capacity
from ..kernels.schedule import RowSchedule, build_row_schedule
from ..types import ExpertWeights, MoEGrads, RoutedActivations, SharedActivations
from . import experts, fp8_weights
from .requirements import KERNEL_DTYPE, check_supported
from .state import EmptyContext, EpRouting, TritonContext, TritonSchedule, workspace_of
from .streams import BesideCopies

__all__ = [
    "Steps",
    "EP_CHANNEL",
    "build_schedule",
    "prepare",
    "schedule_steps",
    "forward_steps",
    "backward_steps",
    "replay_steps",
    "replay_window",
    "nan_if",
    "routed_unfused",
    "experts_unfused",
    "run_steps",
    "drain",
    "single_rank",
    "backward",
    "check",
    "ExpertsOutput",
]

_T = TypeVar("_T")
# A step of the EP protocol: yields where every rank must pass a device barrier, returns a value.
Steps = Generator[None, None, _T]
# Barrier channel of the layer's protocol (every barrier of a step, in program order).
EP_CHANNEL = 0

# (routed activations or None when not kept, shared activations or None, shared output or
# None), with z pushed into the source ranks' combine slots.
ExpertsOutput = tuple[RoutedActivations | None, SharedActivations | None, torch.Tensor | None]
# (workspace, schedule, local weights, local tokens, the step's fp8 weights or None) ->
# ExpertsOutput: the part of the forward between its two barriers
ExpertsForward = Callable[
    [Workspace, TritonSchedule, ExpertWeights, torch.Tensor, "fp8_weights.StepWeights | None"],
    ExpertsOutput,
]


# --------------------------------------------------------------------------------------------
# Drivers


def barrier_point(ws: Workspace) -> Steps[None]:
    """Every rank passes a device barrier here; afterwards no peer still reads our routing."""
    yield
    checks.records(ws).routing_in_use = False


def run_steps(steps: Steps[_T], ws: Workspace) -> _T:
    """Run a protocol on a GPU: a device barrier at every yield."""
    try:
        while True:
            next(steps)
            comm.barrier(ws, EP_CHANNEL)
    except StopIteration as done:
        return done.value


def drain(steps: Steps[_T]) -> _T:
    """Run steps that never yield (one process has no barrier)."""
    try:
        next(steps)
    except StopIteration as done:
        return done.value
    raise RuntimeError("a one-process step must not pass a barrier")


# --------------------------------------------------------------------------------------------
# Schedule


def schedule_steps(
    topk_ids: torch.Tensor, config: MoEConfig, ws: Workspace
) -> Steps[TritonSchedule]:
    """Publish ids, exchange, lay out the rows of this rank's experts and check every rank's
    ids and loads (no host sync)."""
    rec = checks.records(ws)
    if rec.routing_in_use:  # two schedules in a row: peers may still read the last ids
        yield from barrier_point(ws)
    publish(ws, topk_ids=topk_ids.detach())
    yield from barrier_point(ws)
    all_ids, _ = comm.gather_routing(ws)
    rec.routing_in_use = True
    e_local = config.local_experts(ws.world_size)
    full = build_row_schedule(
        all_ids, e_local, config.block_rows, ws.rank * e_local, world_size=ws.world_size
    )
    invalid = check_ids(all_ids, config.num_experts, ws.num_tokens, full, rec.ids)
    capacity = config.capacity_rows(ws.num_tokens, ws.world_size)
    routed = limit_capacity(full, all_ids, capacity, ws.rank, ws.world_size, rec.capacity, invalid)
    return TritonSchedule(routed, config, invalid, EpRouting(ws, all_ids, capacity))


def build_schedule(
    topk_ids: torch.Tensor, config: MoEConfig, group: dist.ProcessGroup | None
) -> TritonSchedule | None:
    """Device-side row layout of this step's routing, its ids checked on the device (no host
    sync); None for a step of no tokens.

    This is also the step's check point for errors of earlier steps (see
    :func:`megamoe.ep.checks.lagged_check` and ``MEGAMOE_EP_CHECK``). With W > 1 the first call
    for a shape creates the symmetric workspace (a collective: every rank must call it).
    """
    t, k = topk_ids.shape
    if t == 0:
        return None
    if group is None or dist.get_world_size(group) == 1:
        rec = checks.device_records(topk_ids.device)
        checks.lagged_check(rec)
        routed = build_row_schedule(topk_ids, config.num_experts, config.block_rows)
        invalid = check_ids(topk_ids, config.num_experts, t, routed, rec.ids)
        return TritonSchedule(routed, config, invalid)
    ws = get_workspace(group, t, config.hidden_size, k, KERNEL_DTYPE, topk_ids.device)
    checks.lagged_check(ws)
    return run_steps(schedule_steps(topk_ids, config, ws), ws)


def single_rank(schedule: TritonSchedule, topk_ids: torch.Tensor) -> TritonSchedule:
    """A one-process schedule with a one-rank workspace attached (the same row layout), so the
    expert-parallel kernels and protocol run unchanged at W = 1."""
    t, k = topk_ids.shape
    cfg = schedule.config
    ws = local_workspace(t, cfg.hidden_size, k, KERNEL_DTYPE, topk_ids.device)
    return dataclasses.replace(schedule, ep=EpRouting(ws, topk_ids, capacity=t * k))


def empty_forward(
    x: torch.Tensor, topk_weights: torch.Tensor, weights: ExpertWeights
) -> tuple[torch.Tensor, EmptyContext]:
    """A step of no tokens (on every rank: the counts must agree)."""
    return x.new_empty(x.shape), EmptyContext(x, topk_weights, weights)


def check(target: TritonSchedule | TritonContext | Workspace) -> None:
    """Raise what the device recorded on this schedule's workspace (``megamoe.ep.checks.check``);
    with one process there is no workspace and nothing to check."""
    ws = workspace_of(target)
    if ws is not None:
        checks.check(ws)


def prepare(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: ExpertWeights,
    config: MoEConfig,
    group: dist.ProcessGroup | None,
    schedule: TritonSchedule | None,
) -> tuple[torch.Tensor, torch.Tensor, ExpertWeights, TritonSchedule]:
    """A forward's inputs as the kernels take them: supported, contiguous, with a schedule (built
    here when None) whose token count is x's. The routed weights go as they are: the launchers
    read views in place (``gemm.weight_2d``). (Not for a step of no tokens: empty_forward.)"""
    check_supported(x, config)
    if schedule is None:
        schedule = build_schedule(topk_ids, config, group)
    if weights.has_shared:
        s_gate, s_up, s_down = (w.contiguous() for w in weights[3:])
        weights = weights._replace(s_gate=s_gate, s_up=s_up, s_down=s_down)
    if schedule.ep is not None and x.shape[0] != schedule.ep.workspace.num_tokens:
        raise ValueError(
            f"x has {x.shape[0]} tokens, the schedule was built for "
            f"{schedule.ep.workspace.num_tokens}"
        )
    return x.contiguous(), topk_weights.contiguous(), weights, schedule


# --------------------------------------------------------------------------------------------
# Forward


def _fp8(config: MoEConfig) -> bool:
    """Whether the layer runs DeepSeek-V3's fp8 recipe (docs/fp8.md)."""
    return config.precision == "fp8"


def _packed_width(config: MoEConfig) -> int | None:
    """int16 words of the packed fp8 rows the dispatch moves; None in bf16 (bf16 rows)."""
    return fp8.packed_width(config.hidden_size) if _fp8(config) else None


def publish_tokens(ws: Workspace, x: torch.Tensor, config: MoEConfig) -> None:
    """Publish the tokens for the dispatch pull: x, or in fp8 its packed 1x128 quantization
    (quantized here, on the source rank, once)."""
    if _packed_width(config) is None:
        publish(ws, x=x.detach())
    else:
        publish_packed(ws, x.detach())


def published_tokens(ws: Workspace, x: torch.Tensor, config: MoEConfig) -> torch.Tensor:
    """What the experts read of the local tokens (:func:`experts.input_rows`) once they are
    published: x, or in fp8 the packed rows in our x_buffer (no second quantization)."""
    width = _packed_width(config)
    return x if width is None else packed_x_buffer(ws, width)


def routed_rows(schedule: TritonSchedule, tokens: torch.Tensor) -> torch.Tensor:
    """The routed input rows in the schedule's layout: gathered from the local ``tokens``
    (:func:`experts.input_rows`) with one process, or else pulled from every rank's published
    ``x_buffer`` (after the barrier that follows the publish); in fp8 packed fp8 rows either
    way."""
    if schedule.ep is None:
        return rows.gather(tokens, schedule.routed)
    return comm.dispatch_pull(
        schedule.ep.workspace,
        schedule.routed,
        "x",
        programs=schedule.config.copy_programs,
        packed_width=_packed_width(schedule.config),
    )


def routed_unfused(
    ws: Workspace,
    schedule: TritonSchedule,
    x: torch.Tensor,
    weights: ExpertWeights,
    fp8w: fp8_weights.StepWeights | None = None,
) -> RoutedActivations:
    """Pull x rows, expert GEMMs, push z rows into the sources' combine slots."""
    routed = experts.routed_forward(
        routed_rows(schedule, x), weights, schedule.routed, schedule.config.precision, fp8w
    )
    comm.combine_push(
        ws, routed.z, schedule.routed, "combine", programs=schedule.config.copy_programs
    )
    return routed


def experts_unfused(
    ws: Workspace,
    schedule: TritonSchedule,
    weights: ExpertWeights,
    x: torch.Tensor,
    fp8w: fp8_weights.StepWeights | None = None,
) -> ExpertsOutput:
    """The part between the forward's barriers: the shared expert on the local tokens beside
    the dispatch pull (``config.overlap_shared``), and the routed experts
    (:func:`routed_unfused`); in fp8 on the step's fp8 weights ``fp8w``."""
    beside = BesideCopies(ws.device, schedule.config)
    try:
        tokens = published_tokens(ws, x, schedule.config)
        shared, shared_out = beside.run(
            experts.shared_forward, tokens, weights, schedule.config, fp8w=fp8w
        )
        routed = routed_unfused(ws, schedule, x, weights, fp8w)
    finally:
        beside.join()
    return routed, shared, shared_out


def forward_steps(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: ExpertWeights,
    schedule: TritonSchedule,
    experts_step: ExpertsForward | None = None,
) -> Steps[tuple[torch.Tensor, TritonContext]]:
    """Publish, pull dispatch, expert GEMMs, push combine, local k-order combine (+ shared).

    ``experts_step`` does the part between the two barriers (default :func:`experts_unfused`;
    backend "fused" passes its kernel).
    """
    ws = schedule.ep.workspace
    fp8w = _step_weights(weights, schedule.config)
    publish_tokens(ws, x, schedule.config)
    publish(ws, topk_weights=topk_weights.detach())
    yield from barrier_point(ws)
    _, slot_weights = comm.gather_routing(ws)
    experts_step = experts_unfused if experts_step is None else experts_step
    routed, shared, shared_out = experts_step(ws, schedule, weights, x, fp8w)
    yield from barrier_point(ws)
    # After an overflow nobody pushed into the slots: the combine writes NaN, not stale rows.
    y = rows.combine_slots(
        ws.combine_buffer, ws.top_k, topk_weights, shared_out, x.dtype, invalid=schedule.invalid
    )
    kept = _kept_for_backward(fp8w, schedule.config)
    return y, TritonContext(schedule, x, slot_weights.view(-1), weights, routed, shared, kept)


def local_forward(
    x: torch.Tensor, topk_weights: torch.Tensor, weights: ExpertWeights, schedule: TritonSchedule
) -> tuple[torch.Tensor, TritonContext]:
    """One process: gather rows, expert GEMMs, combine in k order (+ shared)."""
    sched, precision = schedule.routed, schedule.config.precision
    fp8w = _step_weights(weights, schedule.config)
    tokens = experts.input_rows(x, precision)
    routed = experts.routed_forward(routed_rows(schedule, tokens), weights, sched, precision, fp8w)
    shared, shared_out = experts.shared_forward(tokens, weights, schedule.config, fp8w=fp8w)
    y = rows.combine(routed.z, sched, topk_weights, shared_out, x.dtype, schedule.invalid)
    kept = _kept_for_backward(fp8w, schedule.config)
    return y, TritonContext(schedule, x, topk_weights.view(-1), weights, routed, shared, kept)


def _step_weights(weights: ExpertWeights, config: MoEConfig) -> fp8_weights.StepWeights | None:
    """In fp8 the step's fp8 weights (``fp8_weights.step_weights``: from the cache, or under a
    CUDA graph's capture or without ``config.fp8_weight_cache`` quantized for this forward);
    None in bf16."""
    if config.precision != "fp8":
        return None
    return fp8_weights.step_weights(weights, config.fp8_weight_cache)


def _kept_for_backward(
    fp8w: fp8_weights.StepWeights | None, config: MoEConfig
) -> fp8_weights.StepWeights | None:
    """The fp8 weights the context carries to the backward: the forward's, or without
    ``config.fp8_weight_cache`` none (the backward quantizes the weights again, as FSDP gathers
    them again for it, rather than keep every layer's transposed copies until its backward)."""
    return fp8w if config.fp8_weight_cache else None


def replay_steps(ctx: TritonContext) -> Steps[TritonContext]:
    """The context with the routed activations a bounded ring dropped recomputed (bitwise the
    forward's: the unfused pull / gather and GEMMs, which the fused kernel reproduces)."""
    schedule, precision = ctx.schedule, ctx.schedule.config.precision
    if schedule.ep is not None:
        ws = schedule.ep.workspace
        publish_tokens(ws, ctx.x, schedule.config)  # x_buffer may hold a later forward's tokens
        yield from barrier_point(ws)
        tokens = ctx.x
    else:
        tokens = experts.input_rows(ctx.x, precision)
    routed = experts.routed_forward(
        routed_rows(schedule, tokens), ctx.weights, schedule.routed, precision
    )
    return dataclasses.replace(ctx, routed=routed)


def replay_window(
    ctx: TritonContext, window: RowSchedule, into: RoutedActivations
) -> RoutedActivations:
    """:func:`replay_steps` for the rows of one row window of the layout
    (``schedule.row_window``), written into the first ``window.rows`` rows of ``into``'s
    buffers (reused from one window to the next): the gather (W > 1: the pull of the window's
    rows from every rank's published x, after the barrier that follows the publish) and the
    same GEMMs, so the forward's bits row by row. bf16 only (the precision of backend
    "fused")."""
    config = ctx.schedule.config
    if config.precision != "bf16":
        raise ValueError(f"replay_window replays bf16 rows, got precision {config.precision!r}")
    n, w = window.rows, ctx.weights
    xs, g, u, h, z = (t[:n] for t in into)
    if ctx.schedule.ep is None:
        rows.gather(ctx.x, window, out=xs)
    else:
        ws = ctx.schedule.ep.workspace
        comm.dispatch_pull(ws, window, "x", out=xs, programs=config.copy_programs)
    gemm.gate_up(xs, w.w_gate, w.w_up, window, out=(g, u, h))
    gemm.grouped_mm(h, w.w_down, window, out=z)
    return RoutedActivations(xs, g, u, h, z)


# --------------------------------------------------------------------------------------------
# Backward


def publish_grads(ws: Workspace, dy: torch.Tensor, config: MoEConfig) -> None:
    """Publish the output gradient for the dy pull: dy, or in fp8 its packed 1x128 quantization
    (quantized here, on the source rank, once), as :func:`publish_tokens` does for x."""
    if _packed_width(config) is None:
        publish(ws, dy=dy.detach())
    else:
        publish_packed(ws, dy=dy.detach())


def routed_grads(dy: torch.Tensor, config: MoEConfig) -> torch.Tensor:
    """What the one-process route grad reads of the local dy: dy, or in fp8 its packed 1x128
    quantization (:func:`publish_grads`' rows: the route grad then sees the values a pull of
    them gives)."""
    return dy if _packed_width(config) is None else fp8.quantize_packed(dy)


def backward_steps(ctx: TritonContext, dy: torch.Tensor) -> Steps[MoEGrads]:
    """Pull dy rows, route grad by row, dgrad/wgrad GEMMs, push d_x rows and d_w values back.
    In fp8 the pull moves dy's packed 1x128 rows, which the route grad reads dequantized, and
    the route grad writes d_z quantized for the GEMMs (``rows.route_grad(quantize=True)``)."""
    schedule = ctx.schedule
    ws, sched, programs = schedule.ep.workspace, schedule.routed, schedule.config.copy_programs
    publish_grads(ws, dy, schedule.config)
    # The shared expert needs only the local dy: its d_x runs beside the dy pull, its weight
    # gradients beside the d_x push (config.overlap_shared; each about as long as the copy).
    beside = BesideCopies(ws.device, schedule.config)
    try:
        shared_dgrad = beside.run(experts.shared_dgrad, dy, ctx)
        yield from barrier_point(ws)
        dy_rows = comm.dispatch_pull(
            ws,
            sched,
            "dy",
            programs=programs,
            scale=False,
            packed_width=_packed_width(schedule.config),
        )
        dz, dw_rows = rows.route_grad_rows(
            dy_rows, ctx.routed.z, ctx.slot_weights, sched, quantize=_fp8(schedule.config)
        )
        dgrad = experts.routed_dgrad(dz, ctx)
        shared_grads = beside.run(experts.shared_wgrad, shared_dgrad, ctx)
        comm.combine_push(ws, dgrad.dx, sched, "dx", programs=programs)
        comm.push_row_values(ws, dw_rows, sched, programs=programs)
        d_w_gate, d_w_up, d_w_down = experts.routed_wgrad(dgrad, ctx)
    finally:
        beside.join()
    dx_shared = None if shared_dgrad is None else shared_dgrad[0].dx
    yield from barrier_point(ws)
    invalid = schedule.invalid
    dx = rows.combine_slots(ws.dx_slots, ws.top_k, None, dx_shared, ctx.x.dtype, invalid=invalid)
    d_topk = nan_if(invalid, ws.dw_slots.view(ws.num_tokens, ws.top_k))  # (else stale slots)
    return MoEGrads(dx, d_topk, d_w_gate, d_w_up, d_w_down, *shared_grads)


def nan_if(invalid: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t``, NaN everywhere when the step's ``invalid`` word is set (no host read)."""
    return torch.where(invalid != 0, float("nan"), t)


def local_backward(ctx: TritonContext, dy: torch.Tensor) -> MoEGrads:
    """One process: route grad, dgrad and wgrad GEMMs, combine d_x in k order (+ shared). In
    fp8 the route grad reads dy's packed 1x128 rows by token (the values W > 1 pulls) and writes
    d_z quantized."""
    sched = ctx.schedule.routed
    dy_routed = routed_grads(dy, ctx.schedule.config)
    dz, d_topk = rows.route_grad(
        dy_routed, ctx.routed.z, ctx.slot_weights, sched, quantize=_fp8(ctx.schedule.config)
    )
    dgrad = experts.routed_dgrad(dz, ctx)
    d_w_gate, d_w_up, d_w_down = experts.routed_wgrad(dgrad, ctx)
    shared_dgrad = experts.shared_dgrad(dy, ctx)
    shared_grads = experts.shared_wgrad(shared_dgrad, ctx)
    dx_shared = None if shared_dgrad is None else shared_dgrad[0].dx
    invalid = ctx.schedule.invalid
    dx = rows.combine(dgrad.dx, sched, None, dx_shared, ctx.x.dtype, invalid)
    return MoEGrads(dx, nan_if(invalid, d_topk), d_w_gate, d_w_up, d_w_down, *shared_grads)


def empty_backward(ctx: EmptyContext) -> MoEGrads:
    """The gradients of a step of no tokens: empty for x and the router weights, zeros for
    every weight."""
    w = [None if t is None else torch.zeros_like(t) for t in ctx.weights]
    return MoEGrads(ctx.x.new_empty(ctx.x.shape), torch.zeros_like(ctx.topk_weights), *w)


def backward(ctx: TritonContext | EmptyContext, grad_y: torch.Tensor) -> MoEGrads:
    """Gradients of x (bf16), the router weights (fp32) and every weight (weight dtype), after
    replaying the routed forward if a bounded ring dropped it."""
    if isinstance(ctx, EmptyContext):
        return empty_backward(ctx)
    dy = grad_y.to(ctx.x.dtype).contiguous()
    ws = workspace_of(ctx)
    if ctx.routed is None:
        ctx = drain(replay_steps(ctx)) if ws is None else run_steps(replay_steps(ctx), ws)
    if ws is None:
        grads = local_backward(ctx, dy)
        checks.eager_check(checks.device_records(dy.device))
        return grads
    grads = run_steps(backward_steps(ctx, dy), ws)
    checks.eager_check(ws)
    return grads
