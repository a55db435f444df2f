"""The fused backward at W = 1: the expert GEMMs of the backward as one persistent kernel
(docs/fused.md, "Backward").

It replaces the unfused sequence of backend "triton"'s one-process backward between the route
grad and the combine: the shared expert's ``dgrad_swiglu``, ``dgrad_pair`` and three ``wgrad``
launches, then the routed experts' ``dgrad_swiglu``, ``dgrad_pair`` and three ``wgrad``. The
route grad (dz = w * dy by row, d topk_weights = <dy, z>) runs before it and the k-order combine
of d_x after it, as the unfused kernels (their bits: the router-weight gradient is a reduction
whose order follows the route-grad kernel's layout).

Programs take tasks by atomic ticket from one list in topological order (``tasks``):

  1. the shared expert (if any), over the T local tokens as one "expert": per group of row
     blocks its SwiGLU-backward tiles (d_s_g, d_s_u = SwiGLU backward of dy W_s_down) and, LAG
     groups later, its gate+up dgrad tiles (shared d_x); then its weight-gradient tiles;
  2. the routed experts: per group of row blocks the SwiGLU-backward tiles (d_g, d_u) and, LAG
     groups later, the gate+up dgrad tiles (d_x rows); then the weight-gradient tiles, expert by
     expert (d_W_gate, d_W_up, d_W_down; one program per output tile over all of the expert's
     rows in order).

Counters (``sync.backward_flag_layout``): a SwiGLU-backward tile counts into its row block's
``dgu_done`` and its expert's ``expert_done`` (the shared part: ``sdgu_done`` and
``shared_done``); a gate+up dgrad tile waits for its block's count, a d_W_gate / d_W_up tile for
its expert's (every SwiGLU-backward tile of every row block of the expert). d_W_down reads dz
and h, both there before the launch: it waits for nothing. Every wait has the watchdog of
``sync.wait_count``.

The tiles are the unfused kernels' device functions with their tile shapes and warps: the
gate+up dgrad tile is ``gemm.grouped_mm_tile``, a weight-gradient tile ``gemm.wgrad_tile``, a
SwiGLU-backward tile ``gemm.mm_acc`` followed by ``grouped_mm_tile``'s elementwise epilogue in
column pieces (:func:`swiglu_epilogue`). So every output has the unfused bits for every tunable
(the group size, the lag, the epilogue pieces, the grid). Under the interpreter one program
takes the whole list in order (every wait finds its counter complete).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ...ep.workspace import Workspace
from ...errors import Stage
from ...types import SharedActivations, stacked_gate_up
from .. import comm
from ..gemm import gate_up_2d, grouped_mm_tile, mm_acc, weight_2d, wgrad_tile
from ..runtime import descriptor, empty
from ..schedule import RowSchedule
from ..tiles import cast, swiglu_backward
from .plan import BACKWARD_STAGES, FUSED_WARPS, BackwardPlan, plan_backward
from .sync import (
    acquire_for_tma,
    backward_flag_layout,
    backward_flag_pointers,
    publish_writes,
    signal,
    wait_count,
)
from .tasks import backward_counts, grouped_task, take_task, wgrad_task

__all__ = [
    "FusedGrads",
    "SharedBackwardInputs",
    "fused_backward",
    "fused_backward_kernel",
    "BACKWARD_STAGE_CODES",
]

# The stall-record codes of the backward's waits (``megamoe.errors.Stage``).
BACKWARD_STAGE_CODES = {
    name: int(Stage[name])
    for name in ("DGU_READY", "EXPERT_DGU_READY", "SHARED_DGU_READY", "SHARED_ALL_DGU_READY")
}
_STAGE_DGU = tl.constexpr(int(Stage.DGU_READY))
_STAGE_EXPERT = tl.constexpr(int(Stage.EXPERT_DGU_READY))
_STAGE_SHARED_DGU = tl.constexpr(int(Stage.SHARED_DGU_READY))
_STAGE_SHARED_ALL = tl.constexpr(int(Stage.SHARED_ALL_DGU_READY))


# --------------------------------------------------------------------------------------------
# Tasks


@triton.jit
def call_site(SITE: tl.constexpr, GPU: tl.constexpr):
    """A no-op that differs per call site of a tile (an asm comment naming ``SITE``), placed
    after each tile. Two tiles that differ only in their descriptors end in identical blocks,
    which MLIR's canonicalizer merges into one; Triton's shared-memory allocator then finds both
    tiles' pipeline buffers live across the other's branch and places them side by side (295 KB
    instead of 144 KB at dsv3: more than an SM has). No-op under the interpreter."""
    if GPU:
        tl.inline_asm_elementwise(
            "// fused backward: " + SITE + "\n\tmov.u32 $0, 0;",
            "=r,r",
            [tl.full([1], 0, tl.int32)],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


# dgrad descriptors (11): (a, w_down, g, u, dg, du, dg_a, w_gate, du_a, w_up, dx): ``a`` is dz
#   (routed) or dy (shared) as the SwiGLU-backward tile's A, w_down's K-major view, the saved g
#   and u, the d_g and d_u it stores; d_g and d_u as the gate+up dgrad tile's A operands, the
#   gate and up weights' views and the d_x rows it stores.
# wgrad descriptors (8): (dg, du, x, a, h, d_gate, d_up, d_down): d_W_gate = dg^T x,
#   d_W_up = du^T x, d_W_down = a^T h (a: dz or dy), outputs [E, M, N].
# shape: (H, I, w_down rows, gate/up rows): I is the part's intermediate size, the last two
#   space the experts of the weights' 2-D views (``gemm.weight_2d``).


@triton.jit
def _halves(x, BM: tl.constexpr, BN: tl.constexpr):
    """The column halves [BM, BN / 2] of a [BM, BN] tile (registers only)."""
    return tl.split(tl.permute(tl.reshape(x, [BM, 2, BN // 2]), [0, 2, 1]))


@triton.jit
def _swiglu_piece(dh, g_desc, u_desc, dg_desc, du_desc, row, col, UPCAST: tl.constexpr):
    """``gemm.grouped_mm_tile``'s SwiGLU-backward epilogue on one column piece of the tile."""
    g = g_desc.load([row, col]).to(tl.float32)
    u = u_desc.load([row, col]).to(tl.float32)
    dg, du = swiglu_backward(dh, g, u)
    dg_desc.store([row, col], cast(dg, dg_desc.dtype, UPCAST))
    du_desc.store([row, col], cast(du, du_desc.dtype, UPCAST))


@triton.jit
def swiglu_epilogue(dh, g_desc, u_desc, dg_desc, du_desc, row, col, C: tl.constexpr):
    """(d_g, d_u) of the [BM, BN_SWIGLU] d_h tile at (row, col) from the saved (g, u), in
    ``C.SWIGLU_SPLIT`` column pieces (1, 2 or 4; the descriptors' boxes are that wide).

    Elementwise, so the pieces give the bits of ``gemm.grouped_mm_tile``'s whole-tile epilogue
    (the same ``tiles.swiglu_backward`` and ``tiles.cast`` per element); with fewer values live
    at once the kernel needs no spills (at dsv3 one piece spilled ~160 B, two ~36 B, four
    none)."""
    BN: tl.constexpr = C.BN_SWIGLU
    if C.SWIGLU_SPLIT == 1:
        _swiglu_piece(dh, g_desc, u_desc, dg_desc, du_desc, row, col, C.UPCAST)
    elif C.SWIGLU_SPLIT == 2:
        left, right = _halves(dh, C.BM, BN)
        _swiglu_piece(left, g_desc, u_desc, dg_desc, du_desc, row, col, C.UPCAST)
        _swiglu_piece(right, g_desc, u_desc, dg_desc, du_desc, row, col + BN // 2, C.UPCAST)
    else:
        tl.static_assert(C.SWIGLU_SPLIT == 4, "SWIGLU_SPLIT must be 1, 2 or 4")
        QN: tl.constexpr = BN // 4
        left, right = _halves(dh, C.BM, BN)
        q0, q1 = _halves(left, C.BM, BN // 2)
        _swiglu_piece(q0, g_desc, u_desc, dg_desc, du_desc, row, col, C.UPCAST)
        _swiglu_piece(q1, g_desc, u_desc, dg_desc, du_desc, row, col + QN, C.UPCAST)
        q2, q3 = _halves(right, C.BM, BN // 2)
        _swiglu_piece(q2, g_desc, u_desc, dg_desc, du_desc, row, col + 2 * QN, C.UPCAST)
        _swiglu_piece(q3, g_desc, u_desc, dg_desc, du_desc, row, col + 3 * QN, C.UPCAST)


@triton.jit
def dgrad_task(
    t,
    blocks,
    block_expert_ptr,
    descs,
    shape,
    counters,
    watch,
    LAG: tl.constexpr,
    ROUTED: tl.constexpr,
    C: tl.constexpr,
):
    """Task t of a dgrad part of ``blocks`` row blocks (``tasks.grouped_task``): a
    SwiGLU-backward tile (stores d_g, d_u; counts into its block's and its expert's counters)
    or a gate+up dgrad tile (waits for its block's SwiGLU-backward tiles; stores d_x). The
    routed part reads each block's expert from ``block_expert_ptr``, the shared part is one
    expert. ``counters``: (per-block pointer, per-expert pointer or the shared word). False if
    the wait gave up."""
    PART: tl.constexpr = "routed" if ROUTED else "shared"
    H, I, wd_rows, wgu_rows = shape
    dgu_done_ptr, all_done_ptr = counters
    n_swiglu = tl.cdiv(I, C.BN_SWIGLU)
    is_swiglu, b, j, real = grouped_task(t, blocks, n_swiglu, tl.cdiv(H, C.BN_DGRAD), LAG, C.G)
    expert = 0
    if ROUTED:
        expert = tl.load(block_expert_ptr + b, mask=real, other=0)
    row = b * C.BM
    alive = True
    if not real:
        pass
    elif is_swiglu:
        col = j * C.BN_SWIGLU
        acc = mm_acc(
            tl.zeros([C.BM, C.BN_SWIGLU], dtype=tl.float32),
            descs[0],
            descs[1],
            expert,
            row,
            col,
            wd_rows,
            H,
            C.BK_SWIGLU,
            C.BN_SWIGLU,
            True,
            C.UPCAST,
        )
        swiglu_epilogue(acc, descs[2], descs[3], descs[4], descs[5], row, col, C)
        call_site(PART + " SwiGLU backward", C.GPU)
        publish_writes(C.GPU)
        signal(dgu_done_ptr + b)
        signal(all_done_ptr + expert)
    else:
        if ROUTED:
            alive = wait_count(dgu_done_ptr + b, n_swiglu, _STAGE_DGU, b, watch)
        else:
            alive = wait_count(dgu_done_ptr + b, n_swiglu, _STAGE_SHARED_DGU, b, watch)
        if alive:
            acquire_for_tma(C.GPU)
            dx = descs[10]
            grouped_mm_tile(
                descs[6],
                descs[7],
                descs[8],
                descs[9],
                dx,
                dx,
                dx,
                dx,
                expert,
                row,
                j * C.BN_DGRAD,
                wgu_rows,
                wgu_rows,
                I,
                C.BM,
                C.BN_DGRAD,
                C.BK_DGRAD,
                True,
                True,
                False,
                C.UPCAST,
            )
            call_site(PART + " gate+up dgrad", C.GPU)
    return alive


@triton.jit
def wgrad_part_task(
    t,
    blocks,
    row_start_ptr,
    T,
    descs,
    shape,
    all_done_ptr,
    watch,
    ROUTED: tl.constexpr,
    C: tl.constexpr,
):
    """Task t of a weight-gradient part (``tasks.wgrad_task``): one output tile of d_W_gate,
    d_W_up or d_W_down of one expert over all of its rows in order (the routed experts' from
    ``row_start_ptr``; the shared expert's: the T tokens), as the unfused kernel computes it.
    d_W_gate / d_W_up tiles first wait for the expert's SwiGLU-backward tiles (the shared part:
    every one of its ``blocks`` row blocks). False if the wait gave up."""
    PART: tl.constexpr = "routed" if ROUTED else "shared"
    H, I = shape[0], shape[1]
    n_swiglu = tl.cdiv(I, C.BN_SWIGLU)
    expert, kind, mt, nt = wgrad_task(
        t,
        tl.cdiv(I, C.BM_WGRAD),
        tl.cdiv(H, C.BN_WGRAD),
        tl.cdiv(H, C.BM_WGRAD),
        tl.cdiv(I, C.BN_WGRAD),
    )
    if ROUTED:
        row_begin = tl.load(row_start_ptr + expert)
        row_end = tl.load(row_start_ptr + expert + 1)
    else:
        row_begin = 0
        row_end = T
    m0 = mt * C.BM_WGRAD
    n0 = nt * C.BN_WGRAD
    alive = True
    if kind == 2:  # d_W_down = a^T h: both there before the launch
        wgrad_tile(
            descs[3],
            descs[4],
            descs[7],
            expert,
            m0,
            n0,
            row_begin,
            row_end,
            C.BM_WGRAD,
            C.BN_WGRAD,
            C.BK_WGRAD,
            C.UPCAST,
        )
        call_site(PART + " d_W_down", C.GPU)
    else:
        if ROUTED:  # the expert's row blocks (padded to whole blocks) times their tiles
            wanted = (row_end - row_begin) // C.BM * n_swiglu
            alive = wait_count(all_done_ptr + expert, wanted, _STAGE_EXPERT, expert, watch)
        else:
            alive = wait_count(all_done_ptr, blocks * n_swiglu, _STAGE_SHARED_ALL, 0, watch)
        if alive:
            acquire_for_tma(C.GPU)
            if kind == 0:
                wgrad_tile(
                    descs[0],
                    descs[2],
                    descs[5],
                    expert,
                    m0,
                    n0,
                    row_begin,
                    row_end,
                    C.BM_WGRAD,
                    C.BN_WGRAD,
                    C.BK_WGRAD,
                    C.UPCAST,
                )
                call_site(PART + " d_W_gate", C.GPU)
            else:
                wgrad_tile(
                    descs[1],
                    descs[2],
                    descs[6],
                    expert,
                    m0,
                    n0,
                    row_begin,
                    row_end,
                    C.BM_WGRAD,
                    C.BN_WGRAD,
                    C.BK_WGRAD,
                    C.UPCAST,
                )
                call_site(PART + " d_W_up", C.GPU)
    return alive


# --------------------------------------------------------------------------------------------
# Kernel


@triton.jit
def fused_backward_kernel(
    # routed dgrad: dz, w_down, g, u, dg, du, dg_a, w_gate, du_a, w_up, dxs
    dz_desc,
    wd_desc,
    g_desc,
    u_desc,
    dg_desc,
    du_desc,
    dg_a_desc,
    wg_desc,
    du_a_desc,
    wu_desc,
    dxs_desc,
    # routed wgrad: dg, du, xs, dz, h, d_w_gate, d_w_up, d_w_down
    dg_w_desc,
    du_w_desc,
    xs_w_desc,
    dz_w_desc,
    h_w_desc,
    dwg_desc,
    dwu_desc,
    dwd_desc,
    # shared dgrad: dy, s_down, sg, su, dsg, dsu, dsg_a, s_gate, dsu_a, s_up, shared d_x
    dy_desc,
    sdw_desc,
    sg_desc,
    su_desc,
    dsg_desc,
    dsu_desc,
    dsg_a_desc,
    sgw_desc,
    dsu_a_desc,
    suw_desc,
    sdx_desc,
    # shared wgrad: dsg, dsu, x, dy, sh, d_s_gate, d_s_up, d_s_down
    dsg_w_desc,
    dsu_w_desc,
    x_w_desc,
    dy_w_desc,
    sh_w_desc,
    dsgw_desc,
    dsuw_desc,
    dsdw_desc,
    tables,  # (row_start_ptr, block_expert_ptr, num_blocks_ptr)
    dims,  # (T, H, I, IS, E, max_blocks, w_down rows, gate/up rows)
    sync,  # (flags_ptr, err_ptr, rank, budget)
    C: tl.constexpr,
):
    # (descriptors as separate arguments: Triton 3.6's launcher passes none inside a tuple)
    routed = (
        dz_desc,
        wd_desc,
        g_desc,
        u_desc,
        dg_desc,
        du_desc,
        dg_a_desc,
        wg_desc,
        du_a_desc,
        wu_desc,
        dxs_desc,
    )
    routed_w = (dg_w_desc, du_w_desc, xs_w_desc, dz_w_desc, h_w_desc, dwg_desc, dwu_desc, dwd_desc)
    shared = (
        dy_desc,
        sdw_desc,
        sg_desc,
        su_desc,
        dsg_desc,
        dsu_desc,
        dsg_a_desc,
        sgw_desc,
        dsu_a_desc,
        suw_desc,
        sdx_desc,
    )
    shared_w = (
        dsg_w_desc,
        dsu_w_desc,
        x_w_desc,
        dy_w_desc,
        sh_w_desc,
        dsgw_desc,
        dsuw_desc,
        dsdw_desc,
    )
    row_start_ptr, block_expert_ptr, num_blocks_ptr = tables
    T, H, I, IS, E, max_blocks, wd_rows, wgu_rows = dims
    flags_ptr, err_ptr, rank, budget = sync
    watch = (err_ptr, rank, budget)
    num_blocks, shared_blocks, shared_dgrad, shared_end, routed_dgrad, total = backward_counts(
        num_blocks_ptr,
        T,
        H,
        I,
        IS,
        E,
        C.BM,
        C.BN_SWIGLU,
        C.BN_DGRAD,
        C.BM_WGRAD,
        C.BN_WGRAD,
        C.G,
        C.SHARED,
    )
    ticket_ptr, dgu_done_ptr, expert_done_ptr, sdgu_done_ptr, shared_done_ptr = (
        backward_flag_pointers(flags_ptr, max_blocks, E, shared_blocks)
    )
    # One loop per part of the list (tickets only grow, so a program goes through them in
    # order): each loop keeps only its own part's values live (one loop over all four parts
    # needed every register and spilled).
    task = take_task(ticket_ptr, total, C.INTERPRET)
    alive = True
    if C.SHARED:
        while (task < shared_dgrad) & alive:
            alive = dgrad_task(
                task,
                shared_blocks,
                block_expert_ptr,
                shared,
                (H, IS, H, IS),
                (sdgu_done_ptr, shared_done_ptr),
                watch,
                C.SHARED_LAG,
                False,
                C,
            )
            if alive:
                task = take_task(ticket_ptr, total, C.INTERPRET)
        while (task < shared_end) & alive:
            alive = wgrad_part_task(
                task - shared_dgrad,
                shared_blocks,
                row_start_ptr,
                T,
                shared_w,
                (H, IS),
                shared_done_ptr,
                watch,
                False,
                C,
            )
            if alive:
                task = take_task(ticket_ptr, total, C.INTERPRET)
    while (task < routed_dgrad) & alive:
        alive = dgrad_task(
            task - shared_end,
            num_blocks,
            block_expert_ptr,
            routed,
            (H, I, wd_rows, wgu_rows),
            (dgu_done_ptr, expert_done_ptr),
            watch,
            C.LAG,
            True,
            C,
        )
        if alive:
            task = take_task(ticket_ptr, total, C.INTERPRET)
    while (task < total) & alive:
        alive = wgrad_part_task(
            task - routed_dgrad,
            num_blocks,
            row_start_ptr,
            T,
            routed_w,
            (H, I),
            expert_done_ptr,
            watch,
            True,
            C,
        )
        if alive:
            task = take_task(ticket_ptr, total, C.INTERPRET)


# --------------------------------------------------------------------------------------------
# Launcher


class SharedBackwardInputs(NamedTuple):
    """What the shared expert's backward reads."""

    dy: torch.Tensor  # [T, H]
    x: torch.Tensor  # [T, H]
    acts: SharedActivations  # the forward's (g, u, h) [T, Is]
    s_gate: torch.Tensor  # [Is, H]
    s_up: torch.Tensor  # [Is, H]
    s_down: torch.Tensor  # [H, Is]


@dataclass(frozen=True)
class FusedGrads:
    """What one fused backward launch leaves behind.

    ``dxs``: the routed rows' d_x [rows, H] in the schedule's layout (the combine sums them in
    k order); ``d_w_gate``, ``d_w_up`` [E, I, H] (the halves of one stacked gradient when the
    weights are stacked), ``d_w_down`` [E, H, I]; the shared expert's d_x [T, H] and weight
    gradients (None without one)."""

    dxs: torch.Tensor
    d_w_gate: torch.Tensor
    d_w_up: torch.Tensor
    d_w_down: torch.Tensor
    dx_shared: torch.Tensor | None = None
    d_s_gate: torch.Tensor | None = None
    d_s_up: torch.Tensor | None = None
    d_s_down: torch.Tensor | None = None


def _flags(plan: BackwardPlan, device: torch.device, flags: torch.Tensor | None) -> torch.Tensor:
    layout = backward_flag_layout(plan.max_blocks, plan.experts, plan.shared_blocks)
    if flags is None:
        return torch.zeros(layout.words, dtype=torch.int32, device=device)
    if flags.numel() < layout.words or flags.dtype != torch.int32:
        raise ValueError(
            f"flags must be int32 with >= {layout.words} words, got {flags.dtype} "
            f"with {flags.numel()}"
        )
    return flags


def _gate_up_grads(
    w_gate: torch.Tensor, w_up: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs for d_W_gate and d_W_up: the halves of one stacked gradient when the weights are
    the halves of one stacked tensor (written in place, as ``experts.routed_wgrad``)."""
    stacked = stacked_gate_up(w_gate, w_up)
    if stacked is None:
        return tuple(empty(w.shape, dtype, w.device) for w in (w_gate, w_up))
    d_stacked = empty(stacked.shape, dtype, w_gate.device)
    i = w_gate.shape[1]
    return d_stacked[:, :i], d_stacked[:, i:]


def _part_descriptors(
    plan: BackwardPlan,
    a: torch.Tensor,
    x: torch.Tensor,
    g: torch.Tensor,
    u: torch.Tensor,
    h: torch.Tensor,
    weights: tuple,
    outs: tuple,
) -> tuple:
    """The 19 descriptors of one part (routed or shared), in the kernel's argument order:
    ``a`` (dz or dy), ``x`` (xs or x), the saved g, u, h; ``weights``: the 2-D views
    (w_down, w_gate, w_up); ``outs``: (dg, du, dx, d_gate, d_up, d_down)."""
    m = plan.meta
    bm = m.BM
    w_down, w_gate, w_up = weights
    dg, du, dx, d_gate, d_up, d_down = outs
    dgrad = (
        descriptor(a, [bm, m.BK_SWIGLU]),
        descriptor(w_down, [m.BK_SWIGLU, m.BN_SWIGLU]),
        *(descriptor(t, [bm, m.BN_SWIGLU // m.SWIGLU_SPLIT]) for t in (g, u, dg, du)),
        descriptor(dg, [bm, m.BK_DGRAD]),
        descriptor(w_gate, [m.BK_DGRAD, m.BN_DGRAD]),
        descriptor(du, [bm, m.BK_DGRAD]),
        descriptor(w_up, [m.BK_DGRAD, m.BN_DGRAD]),
        descriptor(dx, [bm, m.BN_DGRAD]),
    )
    bk, mw, nw = m.BK_WGRAD, m.BM_WGRAD, m.BN_WGRAD
    wgrad = (
        descriptor(dg, [bk, mw]),
        descriptor(du, [bk, mw]),
        descriptor(x, [bk, nw]),
        descriptor(a, [bk, mw]),
        descriptor(h, [bk, nw]),
        *(descriptor(o, [1, mw, nw]) for o in (d_gate, d_up, d_down)),
    )
    return (*dgrad, *wgrad)


def fused_backward(
    ws: Workspace,
    sched: RowSchedule,
    dz: torch.Tensor,
    xs: torch.Tensor,
    g: torch.Tensor,
    u: torch.Tensor,
    h: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    group_rows: int,
    shared: SharedBackwardInputs | None = None,
    lag: int | None = None,
    programs: int | None = None,
    swiglu_split: int = 4,
    budget: int | None = None,
    flags: torch.Tensor | None = None,
) -> FusedGrads:
    """The expert GEMMs of a one-process backward in one launch (no host sync): the shared
    expert's and the routed experts' dgrad and weight gradients.

    Arguments:
        ws: the one-rank workspace whose stall record the waits write (``local_workspace``).
        sched: the row schedule of the forward.
        dz ``[rows, H]``: the route grad's w * dy rows (``rows.route_grad``); xs, g, u, h: the
            forward's routed rows (``RoutedActivations``).
        w_gate, w_up ``[E, I, H]``, w_down ``[E, H, I]``: bf16 expert weights (gate and up may
            be the halves of one stacked weight: the gradients are then too).
        group_rows: rows per task-list group (a multiple of the block rows).
        shared: the shared expert's inputs (:class:`SharedBackwardInputs`).
        lag: task-list groups between a group's SwiGLU-backward and gate+up dgrad tiles (None:
            ``plan.backward_lag_for``).
        programs: the grid (None: one program per SM); the bits never depend on it.
        swiglu_split: column pieces of the SwiGLU-backward epilogue (1, 2 or 4; elementwise,
            so the same bits; 4 keeps the kernel free of spills).
        budget: polls of every wait (None: ``comm.spin_budget()``).
        flags: a zeroed int32 flag buffer (``sync.backward_flag_layout``); a test hook: a
            pre-set counter reproduces a missing signal.

    Returns:
        :class:`FusedGrads`.
    """
    dev, dtype = dz.device, dz.dtype
    e, i, hidden = w_gate.shape
    rows = sched.rows
    routed = (("dz", dz, hidden), ("xs", xs, hidden), ("g", g, i), ("u", u, i), ("h", h, i))
    for name, t, width in routed:
        if t.shape[0] < rows or t.shape[1] != width or t.dtype != dtype:
            raise ValueError(
                f"{name} must be {dtype} [>= {rows}, {width}], got {t.dtype} {list(t.shape)}"
            )
    tokens = 0 if shared is None else shared.dy.shape[0]
    shared_intermediate = 0 if shared is None else shared.s_gate.shape[0]
    plan = plan_backward(
        dev,
        rows=rows,
        block_rows=sched.block_rows,
        tokens=tokens,
        hidden=hidden,
        intermediate=i,
        shared_intermediate=shared_intermediate,
        experts=e,
        group_rows=group_rows,
        lag=lag,
        programs=programs,
        swiglu_split=swiglu_split,
    )
    dg, du = empty((rows, i), dtype, dev), empty((rows, i), dtype, dev)
    dxs = empty((rows, hidden), dtype, dev)
    # (the gradients in the activations' dtype, as gemm.wgrad)
    d_gate, d_up = _gate_up_grads(w_gate, w_up, dtype)
    d_down = empty(w_down.shape, dtype, dev)
    (wg, wgu_rows), (wu, _) = gate_up_2d(w_gate, w_up)
    wd, wd_rows = weight_2d(w_down)
    routed_descs = _part_descriptors(
        plan, dz, xs, g, u, h, (wd, wg, wu), (dg, du, dxs, d_gate, d_up, d_down)
    )
    out = dict(dxs=dxs, d_w_gate=d_gate, d_w_up=d_up, d_w_down=d_down)
    if shared is None:  # never read (C.SHARED False removes the shared branch)
        shared_descs = routed_descs
    else:
        dy, x, acts, s_gate, s_up, s_down = shared
        t, i_s = tokens, shared_intermediate
        dsg, dsu = empty((t, i_s), dtype, dev), empty((t, i_s), dtype, dev)
        sdx = empty((t, hidden), dtype, dev)
        d_s = [empty((1, *w.shape), dtype, dev) for w in (s_gate, s_up, s_down)]
        views = (weight_2d(s_down[None])[0], weight_2d(s_gate[None])[0], weight_2d(s_up[None])[0])
        shared_descs = _part_descriptors(
            plan, dy, x, acts.g, acts.u, acts.h, views, (dsg, dsu, sdx, *d_s)
        )
        out.update(dx_shared=sdx, d_s_gate=d_s[0][0], d_s_up=d_s[1][0], d_s_down=d_s[2][0])
    flags = _flags(plan, dev, flags)
    budget = comm.spin_budget(budget)
    fused_backward_kernel[(plan.grid,)](
        *routed_descs,
        *shared_descs,
        (sched.row_start, sched.block_expert, sched.num_blocks),
        (tokens, hidden, i, shared_intermediate, e, plan.max_blocks, wd_rows, wgu_rows),
        (flags, ws.errors, ws.rank, budget),
        C=plan.meta.as_constexprs(),
        num_warps=FUSED_WARPS,
        num_stages=BACKWARD_STAGES,
        # every program resident: a task waits only on tasks that running programs hold
        launch_cooperative_grid=plan.meta.GPU,
    )
    return FusedGrads(**out)
