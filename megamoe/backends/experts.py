"""The expert compute of the Triton backends: the same kernel calls at every world size.

This is the root of "W > 1 has the bits of W = 1": each expert gets the same rows in the same
order from the schedule, and these functions run the same GEMMs on them whether the rows were
gathered locally or pulled from peers. The shared expert runs over the local tokens as one
"expert" of a token-order layout. ``programs`` (the grid) never changes the bits.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Union

import torch

from ..config import MoEConfig
from ..kernels import fp8, fp8_gemm, gemm
from ..kernels.fused.forward import Pulls
from ..kernels.rows import QuantizedRows
from ..kernels.runtime import empty
from ..kernels.schedule import RowSchedule, uniform_schedule
from ..types import ExpertWeights, RoutedActivations, SharedActivations, stacked_gate_up
from . import fp8_weights
from .requirements import KERNEL_DTYPE
from .state import TritonContext

__all__ = [
    "input_rows",
    "routed_forward",
    "shared_forward",
    "routed_dgrad",
    "routed_wgrad",
    "shared_dgrad",
    "shared_wgrad",
    "Dgrad",
    "SharedDgrad",
]

# A weight gradient's operand: bf16 rows, or in fp8 their 128x1 quantization (fp8.quantize_cols'
# (q_t, scale), quantized once for every weight gradient that reads it).
Operand = Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]


class Dgrad(NamedTuple):
    """An expert group's data gradient ``dx`` (its rows) and what its weight gradients read of
    d_g, d_u and d_z (:data:`Operand`: in fp8 quantized by the data gradient's passes)."""

    dx: torch.Tensor
    dg: Operand
    du: Operand
    dz: Operand


# (the shared expert's Dgrad, the token layout it used)
SharedDgrad = tuple[Dgrad, RowSchedule]


def _is_fp8(config: MoEConfig) -> bool:
    return config.precision == "fp8"


def _pad16(x: torch.Tensor) -> torch.Tensor:
    """``x`` with zero rows up to a multiple of 16 rows (16-byte rows of the transposed weight
    gradient operand for TMA; only the shared expert's token count needs it): zero rows leave
    every scale and sum unchanged (packed zero rows are zero values with scale 0)."""
    pad = -x.shape[0] % 16
    return torch.cat([x, x.new_zeros(pad, x.shape[1])]) if pad else x


def _cols(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_cols`` of the rows ``x [rows, N]``: ``x^T`` 128x1-quantized, for a weight
    gradient."""
    return fp8.quantize_cols(_pad16(x))


def _rows_cols(x: torch.Tensor, sched: RowSchedule) -> tuple[tuple[torch.Tensor, ...], ...]:
    """(``quantize_rows(x)``, :func:`_cols` of ``x``) from one pass over the used rows of ``x``
    (in ``sched``'s layout): a data gradient's A operand that a weight gradient reads too."""
    return fp8.quantize_rows_cols(x, pad_to=16, used=fp8_gemm.used_rows(sched, x.shape[0]))


def _h_cols(packed: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight gradient of down's h operand (h^T 128x1-quantized: :func:`_cols` of h) from
    the packed rows the fp8 forward saved of h (``fp8_gemm.gate_up_quantized``'s: half of h's
    bytes) of ``rows`` rows."""
    return fp8.unpack_rows(packed, rows + -rows % 16)


def _x_cols(
    packed: torch.Tensor, hidden: int, sched: RowSchedule
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate/up weight gradients' x operand: x^T 128x1-quantized, re-blocked from the
    packed 1x128 rows the forward read (``fp8.requantize_cols``; once for gate and up), of
    the used rows of ``sched``'s layout."""
    rows = _pad16(packed)
    used = fp8_gemm.used_rows(sched, rows.shape[0])
    return fp8.requantize_cols(*fp8.unpack_rows(rows, hidden), used=used)


def _fp8_wgrad(
    a: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    b: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    sched: RowSchedule,
    programs: int | None = None,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``gemm.wgrad(a, b, ...)`` in fp8: d_W[e] = a_e^T b_e; ``a``, ``b`` the bf16 rows or their
    :func:`_cols` (to quantize a shared operand once)."""
    a_t, a_s = _cols(a) if isinstance(a, torch.Tensor) else a
    b_t, b_s = _cols(b) if isinstance(b, torch.Tensor) else b
    return fp8_gemm.wgrad(a_t, a_s, b_t, b_s, sched, programs, out=out, out_dtype=out_dtype)


def routed_forward(
    xs: torch.Tensor,
    weights: ExpertWeights,
    sched: RowSchedule,
    precision: str = "bf16",
    fp8w: fp8_weights.StepWeights | None = None,
    pulls: Pulls | None = None,
) -> RoutedActivations:
    """gate/up + SwiGLU and down of the routed rows ``xs`` (``precision``: the config's). In
    fp8 ``xs`` holds the rows' packed 1x128 quantization (``fp8.quantize_packed`` on the source
    rank, then gathered or pulled), which the gate/up GEMM reads in place, and the GEMMs read
    the step's fp8 weights ``fp8w`` (default: :func:`fp8_weights.step_weights`). With ``pulls``
    (fp8; ``xs`` its rows) the rows arrive while the gate/up GEMM runs on ``pulls.programs``
    SMs, waiting for each row block's arrival, and down runs on ``pulls.down_programs`` SMs
    counting its stored tiles into ``pulls.stored`` (backend "fused"'s pipelined forward, whose
    comm programs push z meanwhile: ``Pulls.push``)."""
    if precision == "fp8":
        xq, xq_s = fp8.unpack_rows(xs, weights.w_gate.shape[-1])
        fp8w = fp8w if fp8w is not None else fp8_weights.step_weights(weights)
        programs, arrivals, down_programs, stored = (None,) * 4
        if pulls is not None:
            programs, arrivals = pulls.programs, pulls.arrivals
            down_programs, stored = pulls.down_programs, pulls.stored
        g, u, (hq, hq_s), h_cols = fp8_gemm.gate_up_quantized(
            xq, xq_s, fp8w.gate, fp8w.up, sched, programs, arrivals
        )
        z = fp8_gemm.grouped_mm(
            hq, hq_s, fp8w.down, sched, down_programs, out_dtype=KERNEL_DTYPE, stored=stored
        )
        return RoutedActivations(xs, g, u, h_cols, z)
    g, u, h = gemm.gate_up(xs, weights.w_gate, weights.w_up, sched)
    return RoutedActivations(xs, g, u, h, gemm.grouped_mm(h, weights.w_down, sched))


def input_rows(x: torch.Tensor, precision: str) -> torch.Tensor:
    """What the expert GEMMs read of the local tokens ``x``: x itself in bf16; in fp8 its
    packed 1x128 quantization (``fp8.quantize_packed``), made once for the routed rows (before
    the gather) and the shared expert. (At W > 1 ``workspace.publish_packed`` makes it.)"""
    return fp8.quantize_packed(x) if precision == "fp8" else x


def shared_forward(
    x: torch.Tensor,
    weights: ExpertWeights,
    config: MoEConfig,
    programs: int | None = None,
    fp8w: fp8_weights.StepWeights | None = None,
) -> tuple[SharedActivations | None, torch.Tensor | None]:
    """(activations, output) of the shared expert on the local tokens ``x`` (in fp8 their
    packed rows, :func:`input_rows`, and the GEMMs read ``fp8w``'s shared weights, default
    :func:`fp8_weights.step_weights`); (None, None) without one."""
    if not weights.has_shared:
        return None, None
    one = uniform_schedule(x.shape[0], config.block_rows, x.device)
    if _is_fp8(config):
        xq, xq_s = fp8.unpack_rows(x, weights.s_gate.shape[-1])
        w = fp8w if fp8w is not None else fp8_weights.step_weights(weights, config.fp8_weight_cache)
        sg, su, (hq, hq_s), sh_cols = fp8_gemm.gate_up_quantized(
            xq, xq_s, w.s_gate, w.s_up, one, programs
        )
        out = fp8_gemm.grouped_mm(hq, hq_s, w.s_down, one, programs, out_dtype=KERNEL_DTYPE)
        return SharedActivations(sg, su, sh_cols), out
    sg, su, sh = gemm.gate_up(x, weights.s_gate[None], weights.s_up[None], one, programs)
    return SharedActivations(sg, su, sh), gemm.grouped_mm(sh, weights.s_down[None], one, programs)


def _fp8_of(ctx: TritonContext) -> fp8_weights.StepWeights:
    """The step's fp8 weights the forward saved in ``ctx``; for a context made without them
    (``MoEConfig.fp8_weight_cache`` False) the transposed copies quantized now, once a backward
    (:func:`fp8_weights.step_weights`)."""
    if ctx.fp8 is None:
        cache = ctx.schedule.config.fp8_weight_cache
        ctx.fp8 = fp8_weights.step_weights(ctx.weights, cache, backward=True)
    return ctx.fp8


def routed_dgrad(dz: torch.Tensor | QuantizedRows, ctx: TritonContext) -> Dgrad:
    """The routed rows' d_x and the weight gradients' operands (:class:`Dgrad`); in fp8 ``dz``
    may come quantized (``rows.route_grad(..., quantize=True)``)."""
    sched, w, routed = ctx.schedule.routed, ctx.weights, ctx.routed
    if _is_fp8(ctx.schedule.config):
        w8 = _fp8_of(ctx)
        return _fp8_dgrad(dz, w8.down, w8.gate, w8.up, routed.g, routed.u, sched)
    dg, du = gemm.dgrad_swiglu(dz, w.w_down, routed.g, routed.u, sched)
    return Dgrad(gemm.dgrad_pair(dg, w.w_gate, du, w.w_up, sched), dg, du, dz)


def _fp8_dgrad(
    dz: torch.Tensor | QuantizedRows,
    w_down: fp8.Fp8Weight,
    w_gate: fp8.Fp8Weight,
    w_up: fp8.Fp8Weight,
    g: torch.Tensor,
    u: torch.Tensor,
    sched: RowSchedule,
    programs: int | None = None,
) -> Dgrad:
    """:class:`Dgrad` in fp8: d_z, d_g and d_u quantized 1x128 for the data gradients on the
    weights' transposed copies, and 128x1 for the weight gradients: d_z's by one pass
    (:func:`_rows_cols`), or by the route grad (``dz`` then its :class:`QuantizedRows`), d_g's
    and d_u's by the SwiGLU backward (``fp8_gemm.dgrad_swiglu_quantized``)."""
    quantized = isinstance(dz, QuantizedRows)
    (dzq, dzq_s), dz_cols = dz if quantized else _rows_cols(dz, sched)
    dtype = g.dtype if quantized else dz.dtype  # the data gradients' (d_z's: the route grad's)
    ((gq, gs), dg_cols), ((uq, us), du_cols) = fp8_gemm.dgrad_swiglu_quantized(
        dzq, dzq_s, w_down, g, u, sched, programs, dtype
    )
    dx = fp8_gemm.dgrad_pair(gq, gs, w_gate, uq, us, w_up, sched, programs, dtype)
    return Dgrad(dx, dg_cols, du_cols, dz_cols)


def routed_wgrad(dgrad: Dgrad, ctx: TritonContext) -> tuple[torch.Tensor, ...]:
    """(d_w_gate, d_w_up, d_w_down) of the routed experts from :func:`routed_dgrad`'s
    operands. For a stacked gate/up weight the first two are the halves of one stacked
    gradient, written in place (no concatenation)."""
    sched, routed, w = ctx.schedule.routed, ctx.routed, ctx.weights
    dtype = dgrad.dx.dtype
    if _is_fp8(ctx.schedule.config):
        xs = _x_cols(routed.xs, w.w_gate.shape[-1], sched)
        h = _h_cols(routed.h, routed.xs.shape[0])
        wgrad = functools.partial(_fp8_wgrad, out_dtype=dtype)
    else:
        xs, h, wgrad = routed.xs, routed.h, gemm.wgrad
    stacked = stacked_gate_up(w.w_gate, w.w_up)
    if stacked is None:
        d_gate, d_up = wgrad(dgrad.dg, xs, sched), wgrad(dgrad.du, xs, sched)
    else:
        d_stacked = empty(stacked.shape, dtype, dgrad.dx.device)
        i = w.w_gate.shape[1]
        d_gate = wgrad(dgrad.dg, xs, sched, out=d_stacked[:, :i])
        d_up = wgrad(dgrad.du, xs, sched, out=d_stacked[:, i:])
    return d_gate, d_up, wgrad(dgrad.dz, h, sched)


def shared_dgrad(
    dy: torch.Tensor, ctx: TritonContext, programs: int | None = None
) -> SharedDgrad | None:
    """The shared expert's :class:`Dgrad` over the local tokens (d_z is d_y) and its token
    layout; None without one."""
    if ctx.shared is None:
        return None
    w, shared = ctx.weights, ctx.shared
    one = uniform_schedule(ctx.x.shape[0], ctx.schedule.config.block_rows, ctx.x.device)
    if _is_fp8(ctx.schedule.config):
        w8 = _fp8_of(ctx)
        return _fp8_dgrad(dy, w8.s_down, w8.s_gate, w8.s_up, shared.g, shared.u, one, programs), one
    dsg, dsu = gemm.dgrad_swiglu(dy, w.s_down[None], shared.g, shared.u, one, programs)
    dx = gemm.dgrad_pair(dsg, w.s_gate[None], dsu, w.s_up[None], one, programs)
    return Dgrad(dx, dsg, dsu, dy), one


def shared_wgrad(
    dgrad: SharedDgrad | None, ctx: TritonContext, programs: int | None = None
) -> tuple[torch.Tensor | None, ...]:
    """(d_s_gate, d_s_up, d_s_down) from :func:`shared_dgrad`'s operands (three None without a
    shared expert)."""
    if dgrad is None:
        return None, None, None
    (dx, dsg, dsu, dy), one = dgrad
    if _is_fp8(ctx.schedule.config):
        # x's 1x128 quantization as the forward read it (a function of x: computed again),
        # re-blocked as the routed experts' is
        x = _x_cols(fp8.quantize_packed(ctx.x), ctx.x.shape[1], one)
        pairs = ((dsg, x), (dsu, x), (dy, _h_cols(ctx.shared.h, ctx.x.shape[0])))
        return tuple(_fp8_wgrad(a, b, one, programs, out_dtype=dx.dtype)[0] for a, b in pairs)
    pairs = ((dsg, ctx.x), (dsu, ctx.x), (dy, ctx.shared.h))
    return tuple(gemm.wgrad(a, b, one, programs)[0] for a, b in pairs)
