"""The expert compute of the Triton backends: the same kernel calls at every world size.

This is the root of "W > 1 has the bits of W = 1": each expert gets the same rows in the same
order from the schedule, and these functions run the same GEMMs on them whether the rows were
gathered locally or pulled from peers. The shared expert runs over the local tokens as one
"expert" of a token-order layout. ``programs`` (the grid) never changes the bits.
"""

from __future__ import annotations

import torch

from ..config import MoEConfig
from ..kernels import gemm
from ..kernels.runtime import empty
from ..kernels.schedule import RowSchedule, uniform_schedule
from ..types import ExpertWeights, RoutedActivations, SharedActivations, stacked_gate_up
from .state import TritonContext

__all__ = [
    "routed_forward",
    "shared_forward",
    "routed_dgrad",
    "routed_wgrad",
    "shared_dgrad",
    "shared_wgrad",
    "SharedDgrad",
]

# (shared d_x, d_g, d_u, the token layout they used)
SharedDgrad = tuple[torch.Tensor, torch.Tensor, torch.Tensor, RowSchedule]


def routed_forward(
    xs: torch.Tensor, weights: ExpertWeights, sched: RowSchedule
) -> RoutedActivations:
    """gate/up + SwiGLU and down of the routed rows ``xs``."""
    g, u, h = gemm.gate_up(xs, weights.w_gate, weights.w_up, sched)
    return RoutedActivations(xs, g, u, h, gemm.grouped_mm(h, weights.w_down, sched))


def shared_forward(
    x: torch.Tensor, weights: ExpertWeights, config: MoEConfig, programs: int | None = None
) -> tuple[SharedActivations | None, torch.Tensor | None]:
    """(activations, output) of the shared expert on the local tokens; (None, None) without one."""
    if not weights.has_shared:
        return None, None
    one = uniform_schedule(x.shape[0], config.block_rows, x.device)
    sg, su, sh = gemm.gate_up(x, weights.s_gate[None], weights.s_up[None], one, programs)
    return SharedActivations(sg, su, sh), gemm.grouped_mm(sh, weights.s_down[None], one, programs)


def routed_dgrad(dz: torch.Tensor, ctx: TritonContext) -> tuple[torch.Tensor, ...]:
    """(d_x rows, d_g, d_u) of the routed rows."""
    sched, w, routed = ctx.schedule.routed, ctx.weights, ctx.routed
    dg, du = gemm.dgrad_swiglu(dz, w.w_down, routed.g, routed.u, sched)
    return gemm.dgrad_pair(dg, w.w_gate, du, w.w_up, sched), dg, du


def routed_wgrad(
    dz: torch.Tensor, dg: torch.Tensor, du: torch.Tensor, ctx: TritonContext
) -> tuple[torch.Tensor, ...]:
    """(d_w_gate, d_w_up, d_w_down) of the routed experts. For a stacked gate/up weight the
    first two are the halves of one stacked gradient, written in place (no concatenation)."""
    sched, routed, w = ctx.schedule.routed, ctx.routed, ctx.weights
    stacked = stacked_gate_up(w.w_gate, w.w_up)
    if stacked is None:
        d_gate, d_up = gemm.wgrad(dg, routed.xs, sched), gemm.wgrad(du, routed.xs, sched)
    else:
        d_stacked = empty(stacked.shape, dg.dtype, dg.device)
        i = w.w_gate.shape[1]
        d_gate = gemm.wgrad(dg, routed.xs, sched, out=d_stacked[:, :i])
        d_up = gemm.wgrad(du, routed.xs, sched, out=d_stacked[:, i:])
    return d_gate, d_up, gemm.wgrad(dz, routed.h, sched)


def shared_dgrad(
    dy: torch.Tensor, ctx: TritonContext, programs: int | None = None
) -> SharedDgrad | None:
    """The shared expert's d_x, d_g and d_u over the local tokens; None without one."""
    if ctx.shared is None:
        return None
    w, shared = ctx.weights, ctx.shared
    one = uniform_schedule(ctx.x.shape[0], ctx.schedule.config.block_rows, ctx.x.device)
    dsg, dsu = gemm.dgrad_swiglu(dy, w.s_down[None], shared.g, shared.u, one, programs)
    return gemm.dgrad_pair(dsg, w.s_gate[None], dsu, w.s_up[None], one, programs), dsg, dsu, one


def shared_wgrad(
    dy: torch.Tensor, dgrad: SharedDgrad | None, ctx: TritonContext, programs: int | None = None
) -> tuple[torch.Tensor | None, ...]:
    """(d_s_gate, d_s_up, d_s_down) from :func:`shared_dgrad`'s output (three None without a
    shared expert)."""
    if dgrad is None:
        return None, None, None
    _, dsg, dsu, one = dgrad
    pairs = ((dsg, ctx.x), (dsu, ctx.x), (dy, ctx.shared.h))
    return tuple(gemm.wgrad(a, b, one, programs)[0] for a, b in pairs)
