"""The fused backward: the expert GEMMs of the backward as one persistent kernel, at W > 1 with
its dy pull and d_x push inside (docs/fused.md, "Backward").

At W = 1 (:func:`fused_backward`) it replaces the unfused sequence of backend "triton"'s
one-process backward between the route grad and the combine: the shared expert's
``dgrad_swiglu``, ``dgrad_pair`` and three ``wgrad`` launches, then the routed experts'. The
route grad (dz = w * dy by row, d topk_weights = <dy, z>) runs before it and the k-order combine
of d_x after it, as the unfused kernels (their bits: the router-weight gradient is a reduction
whose order follows the route-grad kernel's layout).

At W > 1 (:func:`fused_backward_ep`, ``C.EXCHANGE``) it also replaces the dy pull, the dz half
of the route grad and the d_x push: programs ``[0, NUM_COMM)`` pull every minibatch's dy rows
from the source ranks (``roles.pull_dy_role``, counting into ``ready[m]``), then push each row
block's d_x rows into the source ranks' ``dx_slots`` once its ``dx_done`` counts every gate+up
dgrad tile (``roles.push_blocks``), then take what is left of the list. A comm kernel beside it
(as the forward's) cannot fit: a backward program takes about 251 of 255 registers per thread
at 8 warps, the whole register file of an SM. Each routed row block gets a route-grad task
(:func:`route_grad_task`, the first of its group's tasks: dz = w * dy of its rows) that its
SwiGLU-backward tiles wait for. d topk_weights stays with the route-grad kernel, after this one,
on the pulled rows (a reduction at 4 warps: here it would reduce in another order).

Programs take tasks by atomic ticket from one list in topological order (``tasks``):

  1. the shared expert (if any), over the T local tokens as one "expert": per group of row
     blocks its SwiGLU-backward tiles (d_s_g, d_s_u = SwiGLU backward of dy W_s_down) and, LAG
     groups later, its gate+up dgrad tiles (shared d_x); then its weight-gradient tiles;
  2. the routed experts: per group of row blocks the SwiGLU-backward tiles (d_g, d_u) and, LAG
     groups later, the gate+up dgrad tiles (d_x rows); then the weight-gradient tiles, expert by
     expert (d_W_gate, d_W_up, d_W_down; one program per output tile over the expert's rows
     in order up to its last real row rounded up to the K step, ``gemm.expert_row_range``).

Counters (``sync.backward_flag_layout``): a SwiGLU-backward tile counts into its row block's
``dgu_done`` and its expert's ``expert_done`` (the shared part: ``sdgu_done`` and
``shared_done``); a gate+up dgrad tile waits for its block's count, a d_W_gate / d_W_up tile for
its expert's (every SwiGLU-backward tile of every row block of the expert, the rows a
weight-gradient tile leaves out included). d_W_down reads dz
and h: at W = 1 both there before the launch (it waits for nothing), at W > 1 it waits for its
expert's count too (dz is computed here). At W > 1 also ``ready`` (pulls; the route-grad task
waits), ``dz_done`` (route-grad task; the SwiGLU-backward tiles wait) and ``dx_done`` (gate+up
dgrad tiles; the push waits). Every wait has the watchdog of ``sync.wait_count``.

After a bounded ring the backward runs one launch per macrobatch at every W (``macrobatch=``,
:class:`Macrobatch`): ``sched`` is a row window of the layout (``schedule.row_window``), the
routed rows are the window's, and each routed weight-gradient tile sums the window's rows of its
expert on from an fp32 carry and leaves it there for the next window (``C.CARRY``; the carry
words of :func:`carry_words` say per expert which windows take part, start from +0 and store
the gradient, and per window which of the two carry slots it reads and writes: only an expert
straddling a window boundary carries, at most one per boundary). Windows on K-step boundaries
make the tile's ``mma`` sequence one launch's: the same bits.

The tiles are the unfused kernels' device functions with their tile shapes and warps: the
gate+up dgrad tile is ``gemm.grouped_mm_tile``, a weight-gradient tile ``gemm.wgrad_tile``, a
SwiGLU-backward tile ``gemm.mm_acc`` followed by ``grouped_mm_tile``'s elementwise epilogue in
column pieces (:func:`swiglu_epilogue`). So every output has the unfused bits for every tunable
(the group size, the lag, the epilogue pieces, the grid, the comm programs). Under the
interpreter one program takes the whole list in order (every wait finds its counter complete);
at W > 1 it first pulls for every comm role and pushes for every comm role at the end.
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
from ..gemm import (
    CARRY_ACTIVE,
    CARRY_IN,
    CARRY_OUT,
    CARRY_SLOT,
    expert_row_range,
    gate_up_2d,
    grouped_mm_tile,
    mm_acc,
    weight_2d,
    wgrad_tile,
)
from ..runtime import check_out, descriptor, empty, launch
from ..schedule import RowSchedule
from ..tiles import cast, load_rows, store_rows, swiglu_backward
from .plan import BACKWARD_STAGES, FUSED_WARPS, BackwardPlan, plan_backward
from .roles import pull_dy_role, push_blocks
from .sync import (
    acquire_for_tma,
    backward_flag_layout,
    backward_flag_pointers,
    exchange_flag_pointers,
    publish_writes,
    signal,
    wait_count,
)
from .tasks import backward_counts, grouped_task, take_task, wgrad_part_length, wgrad_task

__all__ = [
    "FusedGrads",
    "SharedBackwardInputs",
    "fused_backward",
    "fused_backward_ep",
    "fused_backward_kernel",
    "BACKWARD_STAGE_CODES",
    "Macrobatch",
    "MacrobatchOutputs",
    "macrobatch_outputs",
    "carry_words",
]

# The stall-record codes of the backward's waits (``megamoe.errors.Stage``).
BACKWARD_STAGE_CODES = {
    name: int(Stage[name])
    for name in (
        "DGU_READY",
        "EXPERT_DGU_READY",
        "SHARED_DGU_READY",
        "SHARED_ALL_DGU_READY",
        "DY_READY",
        "DZ_READY",
        "DX_READY",
    )
}
_STAGE_DY = tl.constexpr(int(Stage.DY_READY))
_STAGE_DZ = tl.constexpr(int(Stage.DZ_READY))
_STAGE_DX = tl.constexpr(int(Stage.DX_READY))
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
def route_grad_task(b, ex, H, watch, C: tl.constexpr):
    """The route-grad task of routed row block b (W > 1): wait until its minibatch's dy rows are
    pulled (``ready``), store dz = w * dy for its rows (fp32 product rounded to dz's dtype, zeros
    on padding rows: the route-grad kernel's ``rows._route_grad_kernel`` arithmetic through the
    same ``tiles.load_rows`` / ``store_rows``; elementwise, so its bits for any tile), count into
    ``dz_done[b]``. The router-weight gradient <dy, z> is a reduction whose order follows that
    kernel's layout: it runs there, after this kernel. False if the wait gave up."""
    dy_rows_ptr, dz_ptr, row_src_ptr, weights_ptr, ready_ptr, dz_done_ptr = (
        ex[0],
        ex[1],
        ex[2],
        ex[3],
        ex[4],
        ex[5],
    )
    mb = (b * C.BM) // C.MB
    alive = wait_count(ready_ptr + mb, C.NUM_COMM, _STAGE_DY, mb, watch)
    if alive:
        for r0 in range(0, C.BM, C.RG_ROWS):
            rows = b * C.BM + r0 + tl.arange(0, C.RG_ROWS)
            slot = tl.load(row_src_ptr + rows)
            real = slot >= 0
            w = tl.load(weights_ptr + slot, mask=real, other=0.0)
            for c0 in range(0, H, C.RG_COLS):
                cols = c0 + tl.arange(0, C.RG_COLS)
                col_mask = cols < H
                dy = load_rows(dy_rows_ptr, rows, cols, H, real, col_mask)
                store_rows(dz_ptr, rows, cols, H, w[:, None] * dy, rows >= 0, col_mask, C.UPCAST)
        signal(dz_done_ptr + b)
    return alive


@triton.jit
def _swiglu_tile(b, j, expert, descs, shape, counters, PART: tl.constexpr, C: tl.constexpr):
    """SwiGLU-backward tile (b, j): d_h = a W_down, then d_g, d_u; counts into the block's and
    the expert's counters."""
    H, wd_rows = shape[0], shape[2]
    dgu_done_ptr, all_done_ptr = counters
    row = b * C.BM
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


@triton.jit
def dgrad_task(
    t,
    blocks,
    block_expert_ptr,
    descs,
    shape,
    counters,
    ex,
    watch,
    LAG: tl.constexpr,
    ROUTED: tl.constexpr,
    EX: tl.constexpr,
    C: tl.constexpr,
):
    """Task t of a dgrad part of ``blocks`` row blocks (``tasks.grouped_task``): a
    SwiGLU-backward tile (stores d_g, d_u; counts into its block's and its expert's counters)
    or a gate+up dgrad tile (waits for its block's SwiGLU-backward tiles; stores d_x). The
    routed part reads each block's expert from ``block_expert_ptr``, the shared part is one
    expert. ``counters``: (per-block pointer, per-expert pointer or the shared word).

    ``EX`` (the routed part at W > 1; ``ex``: (dy rows, dz, row_src, slot weights, ready,
    dz_done, dx_done) pointers): column 0 of a block's first kind is its route-grad task
    (:func:`route_grad_task`), its SwiGLU-backward tiles wait for it (``dz_done``), and its
    gate+up dgrad tiles count into ``dx_done`` for the comm programs' push. False if a wait
    gave up."""
    PART: tl.constexpr = "routed" if ROUTED else "shared"
    H, I, wd_rows, wgu_rows = shape
    dgu_done_ptr, all_done_ptr = counters
    n_swiglu = tl.cdiv(I, C.BN_SWIGLU)
    n_first = n_swiglu
    if EX:
        n_first = n_swiglu + 1
    is_swiglu, b, j, real = grouped_task(t, blocks, n_first, tl.cdiv(H, C.BN_DGRAD), LAG, C.G)
    expert = 0
    if ROUTED:
        expert = tl.load(block_expert_ptr + b, mask=real, other=0)
    row = b * C.BM
    alive = True
    if not real:
        pass
    elif is_swiglu:
        if EX:
            if j == 0:
                alive = route_grad_task(b, ex, H, watch, C)
            else:
                alive = wait_count(ex[5] + b, 1, _STAGE_DZ, b, watch)
                if alive:
                    acquire_for_tma(C.GPU)
                    _swiglu_tile(b, j - 1, expert, descs, shape, counters, PART, C)
        else:
            _swiglu_tile(b, j, expert, descs, shape, counters, PART, C)
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
            if EX:  # the d_x tile is stored and visible: the comm programs may push the block
                publish_writes(C.GPU)
                signal(ex[6] + b)
    return alive


@triton.jit
def wgrad_part_task(
    t,
    blocks,
    row_start_ptr,
    counts_ptr,
    carry_ptr,
    T,
    descs,
    shape,
    all_done_ptr,
    watch,
    ROUTED: tl.constexpr,
    EX: tl.constexpr,
    C: tl.constexpr,
):
    """Task t of a weight-gradient part (``tasks.wgrad_task``): one output tile of d_W_gate,
    d_W_up or d_W_down of one expert over its rows in order (the routed experts' from
    ``row_start_ptr`` up to the last real row rounded up to the K step,
    ``gemm.expert_row_range`` of ``counts_ptr``; the shared expert's: the T tokens), as the
    unfused kernel computes it.
    d_W_gate / d_W_up tiles first wait for the expert's SwiGLU-backward tiles (the shared part:
    every one of its ``blocks`` row blocks). With ``EX`` (the routed part at W > 1) d_W_down
    waits too: it reads dz, which the kernel computes (the expert's SwiGLU-backward tiles ran
    after their blocks' dz). False if the wait gave up.

    ``C.CARRY`` (the routed part of a macrobatch: the tables are the row window's): the tile
    sums the expert's rows inside the window only, and ``carry_ptr[expert]`` (the carry word,
    ``gemm.CARRY_*``) says whether it has rows to sum here (else it does nothing, waits for
    nothing), whether its accumulator continues the fp32 carry of the last macrobatch, whether
    it goes back to a carry and which slots it reads and writes (``gemm.wgrad_tile``'s
    ``CARRY``)."""
    PART: tl.constexpr = "routed" if ROUTED else "shared"
    CARRY: tl.constexpr = C.CARRY if ROUTED else False
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
        row_begin, row_end = expert_row_range(row_start_ptr, counts_ptr, expert, C.BK_WGRAD)
        # the waits count every row block of the expert (the padded range), as they signal
        wanted = (tl.load(row_start_ptr + expert + 1) - row_begin) // C.BM * n_swiglu
    else:
        row_begin = 0
        row_end = T
        wanted = blocks * n_swiglu
    m0 = mt * C.BM_WGRAD
    n0 = nt * C.BN_WGRAD
    carry = 0
    active = True
    if CARRY:
        carry = tl.load(carry_ptr + expert)
        active = (carry & CARRY_ACTIVE) != 0
    alive = True
    if not active:
        pass  # none of the expert's summed rows lie in this macrobatch
    elif kind == 2:  # d_W_down = a^T h: both there before the launch (W = 1)
        if EX:
            alive = wait_count(all_done_ptr + expert, wanted, _STAGE_EXPERT, expert, watch)
            if alive:
                acquire_for_tma(C.GPU)
        if alive:
            wgrad_tile(
                descs[3],
                descs[4],
                descs[7],
                expert,
                m0,
                n0,
                row_begin,
                row_end,
                descs[10],
                carry,
                C.BM_WGRAD,
                C.BN_WGRAD,
                C.BK_WGRAD,
                CARRY,
                C.UPCAST,
            )
            call_site(PART + " d_W_down", C.GPU)
    else:
        if ROUTED:  # the expert's row blocks times their tiles
            alive = wait_count(all_done_ptr + expert, wanted, _STAGE_EXPERT, expert, watch)
        else:
            alive = wait_count(all_done_ptr, wanted, _STAGE_SHARED_ALL, 0, watch)
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
                    descs[8],
                    carry,
                    C.BM_WGRAD,
                    C.BN_WGRAD,
                    C.BK_WGRAD,
                    CARRY,
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
                    descs[9],
                    carry,
                    C.BM_WGRAD,
                    C.BN_WGRAD,
                    C.BK_WGRAD,
                    CARRY,
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
    # a macrobatch (C.CARRY): the fp32 carries [2, ...] of d_w_gate, d_w_up, d_w_down (else
    # unused)
    cwg_desc,
    cwu_desc,
    cwd_desc,
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
    tables,  # (row_start_ptr, block_expert_ptr, num_blocks_ptr, counts_ptr, carry words [E])
    dims,  # (T, H, I, IS, E, max_blocks, w_down rows, gate/up rows, max minibatches)
    sync,  # (flags_ptr, err_ptr, rank, budget)
    exchange,  # W > 1: (dy table, dx table, dy_rows, dz, dxs, row_src, slot weights)
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
    routed_w = (
        dg_w_desc,
        du_w_desc,
        xs_w_desc,
        dz_w_desc,
        h_w_desc,
        dwg_desc,
        dwu_desc,
        dwd_desc,
        cwg_desc,
        cwu_desc,
        cwd_desc,
    )
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
        dsgw_desc,  # (no carry: never read)
        dsuw_desc,
        dsdw_desc,
    )
    row_start_ptr, block_expert_ptr, num_blocks_ptr, counts_ptr, carry_ptr = tables
    T, H, I, IS, E, max_blocks, wd_rows, wgu_rows, max_mb = dims
    flags_ptr, err_ptr, rank, budget = sync
    watch = (err_ptr, rank, budget)
    RG: tl.constexpr = 1 if C.EXCHANGE else 0  # route-grad tasks per routed row block
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
        RG,
    )
    ticket_ptr, dgu_done_ptr, expert_done_ptr, sdgu_done_ptr, shared_done_ptr = (
        backward_flag_pointers(flags_ptr, max_blocks, E, shared_blocks)
    )
    alive = True
    if C.EXCHANGE:
        # Comm programs [0, NUM_COMM) pull every minibatch's dy rows (never waiting), then push
        # each row block's d_x rows once its gate+up dgrad tiles are stored, then compute what
        # is left of the list. The interpreter's one program pulls for every role first and
        # pushes for every role after its tasks.
        ready_ptr, dz_done_ptr, dx_done_ptr = exchange_flag_pointers(
            flags_ptr, max_blocks, E, shared_blocks, max_mb
        )
        dy_table, dx_table, dy_rows_ptr, dz_ptr, dxs_ptr, row_src_ptr, weights_ptr = exchange
        if C.INTERPRET:
            for role in range(C.NUM_COMM):
                pull_dy_role(
                    role, num_blocks * C.BM, dy_table, dy_rows_ptr, row_src_ptr, ready_ptr, T, H, C
                )
        elif tl.program_id(0) < C.NUM_COMM:
            role = tl.program_id(0)
            pull_dy_role(
                role, num_blocks * C.BM, dy_table, dy_rows_ptr, row_src_ptr, ready_ptr, T, H, C
            )
            alive = push_blocks(
                role,
                num_blocks,
                dxs_ptr,
                dx_table,
                row_src_ptr,
                dx_done_ptr,
                tl.cdiv(H, C.BN_DGRAD),
                T,
                H,
                _STAGE_DX,
                watch,
                C,
            )
        ex = (dy_rows_ptr, dz_ptr, row_src_ptr, weights_ptr, ready_ptr, dz_done_ptr, dx_done_ptr)
    else:
        ex = (flags_ptr,) * 7  # (never read)
    # One loop per part of the list (tickets only grow, so a program goes through them in
    # order): each loop keeps only its own part's values live (one loop over all four parts
    # needed every register and spilled).
    task = take_task(ticket_ptr, total, C.INTERPRET)
    if C.SHARED:
        while (task < shared_dgrad) & alive:
            alive = dgrad_task(
                task,
                shared_blocks,
                block_expert_ptr,
                shared,
                (H, IS, H, IS),
                (sdgu_done_ptr, shared_done_ptr),
                ex,
                watch,
                C.SHARED_LAG,
                False,
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
                counts_ptr,
                carry_ptr,
                T,
                shared_w,
                (H, IS),
                shared_done_ptr,
                watch,
                False,
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
            ex,
            watch,
            C.LAG,
            True,
            C.EXCHANGE,
            C,
        )
        if alive:
            task = take_task(ticket_ptr, total, C.INTERPRET)
    first_task = routed_dgrad
    if C.CARRY:
        # A macrobatch's routed weight-gradient part: only the tiles of the experts the window
        # holds rows of (consecutive: carry words [E, E + 2) name the first and their number).
        # Loaded here, not with the counts: values live across the dgrad loops cost registers.
        per_expert = wgrad_part_length(
            1,
            tl.cdiv(I, C.BM_WGRAD),
            tl.cdiv(H, C.BN_WGRAD),
            tl.cdiv(H, C.BM_WGRAD),
            tl.cdiv(I, C.BN_WGRAD),
        )
        first_task = routed_dgrad - tl.load(carry_ptr + E) * per_expert
        total = routed_dgrad + tl.load(carry_ptr + E + 1) * per_expert
    while (task < total) & alive:
        alive = wgrad_part_task(
            task - first_task,
            num_blocks,
            row_start_ptr,
            counts_ptr,
            carry_ptr,
            T,
            routed_w,
            (H, I),
            expert_done_ptr,
            watch,
            True,
            C.EXCHANGE,
            C,
        )
        if alive:
            task = take_task(ticket_ptr, total, C.INTERPRET)
    if C.EXCHANGE:
        if C.INTERPRET:
            for role in range(C.NUM_COMM):
                push_blocks(
                    role,
                    num_blocks,
                    dxs_ptr,
                    dx_table,
                    row_src_ptr,
                    dx_done_ptr,
                    tl.cdiv(H, C.BN_DGRAD),
                    T,
                    H,
                    _STAGE_DX,
                    watch,
                    C,
                )


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
    gradients (None without one). At W > 1 (:func:`fused_backward_ep`) also the pulled
    ``dy_rows`` [rows, H] (the route-grad kernel's input for d topk_weights) and ``dz``; the
    d_x rows are then already pushed into the source ranks' ``dx_slots``."""

    dxs: torch.Tensor
    d_w_gate: torch.Tensor
    d_w_up: torch.Tensor
    d_w_down: torch.Tensor
    dx_shared: torch.Tensor | None = None
    d_s_gate: torch.Tensor | None = None
    d_s_up: torch.Tensor | None = None
    d_s_down: torch.Tensor | None = None
    dy_rows: torch.Tensor | None = None
    dz: torch.Tensor | None = None


@dataclass(frozen=True)
class MacrobatchOutputs:
    """What the launches of a macrobatched backward (one per row window of the layout,
    :class:`Macrobatch`: window j holds the rows ``[j * ring_rows, (j + 1) * ring_rows)``, the
    last one up to the layout's end) write between them: the d_x rows ``dxs`` (``by_window``
    False, W = 1: the layout's [rows, H], each launch its window's rows, which the combine
    reads after the last; True, W > 1: [ring rows, H] reused by every launch, whose comm
    programs push them), the routed weight gradients (as :class:`FusedGrads`), their fp32
    carries ``carries`` (d_w_gate, d_w_up [2, I, H], d_w_down [2, H, I]: two slots, each
    holding the accumulators of the expert that straddles one window boundary from one
    macrobatch to the next, window j writing slot j % 2 and reading slot (j - 1) % 2; never
    read before written) and the window's d_g, d_u rows [ring rows, I] (reused by every
    launch)."""

    ring_rows: int
    by_window: bool
    dxs: torch.Tensor
    d_w_gate: torch.Tensor
    d_w_up: torch.Tensor
    d_w_down: torch.Tensor
    carries: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    dg: torch.Tensor
    du: torch.Tensor


class Macrobatch(NamedTuple):
    """One launch of a macrobatched backward: the row window ``[first_row, first_row + rows of
    the launch's schedule)`` of ``layout`` (the launch's ``sched`` is
    ``schedule.row_window(layout, first_row, rows)``), writing into ``outputs``."""

    outputs: MacrobatchOutputs
    layout: RowSchedule
    first_row: int


def macrobatch_outputs(
    layout: RowSchedule,
    ring_rows: int,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    dtype: torch.dtype,
    by_window: bool = False,
) -> MacrobatchOutputs:
    """The buffers of a macrobatched backward of ``layout`` in windows of at most
    ``ring_rows`` rows (gradients in ``dtype``, as :func:`fused_backward`); ``by_window``: d_x
    rows of one window (W > 1, :func:`fused_backward_ep` pushes them), else of the layout."""
    dev = w_gate.device
    e, i, hidden = w_gate.shape
    d_gate, d_up = _gate_up_grads(w_gate, w_up, dtype)
    # two slots: at most one expert straddles each window boundary
    carries = tuple(empty((2, *w.shape[1:]), torch.float32, dev) for w in (w_gate, w_up, w_down))
    return MacrobatchOutputs(
        ring_rows=ring_rows,
        by_window=by_window,
        dxs=empty((ring_rows if by_window else layout.rows, hidden), dtype, dev),
        d_w_gate=d_gate,
        d_w_up=d_up,
        d_w_down=empty(w_down.shape, dtype, dev),
        carries=carries,
        dg=empty((ring_rows, i), dtype, dev),
        du=empty((ring_rows, i), dtype, dev),
    )


def carry_words(layout: RowSchedule, window: int, ring: int, bk: int) -> torch.Tensor:
    """int32 [E + 2]: each expert's carry word (``gemm.CARRY_*``) in window ``window`` of
    ``layout`` in windows of ``ring`` rows (its rows ``[window * ring, (window + 1) * ring)``,
    up to the layout's end), then the first active expert and the number of active ones (small
    device ops, no host read). An expert's weight-gradient tiles sum its rows ``[begin, end)``
    (``gemm.expert_row_range``, K step ``bk``); a window that holds some of them is active,
    takes the carry unless it holds ``begin``, and leaves it unless it holds the last one. An
    expert with nothing to sum (no rows) is active once, in the window that holds its
    ``begin`` (the last window when that is the layout's end): its tiles then store +0 as one
    launch would. The experts' ranges follow one another in the layout, so the active ones are
    consecutive (the launch's task list holds only their weight-gradient tiles: a window past
    the used rows has almost none), and at most one expert carries across each boundary: the
    active words of an odd window hold ``CARRY_SLOT`` (the carry out goes to slot
    ``window % 2``, the carry in comes from the other one, which the window before wrote)."""
    begin = layout.row_start[:-1]
    end = torch.minimum(begin + (layout.counts + bk - 1) // bk * bk, layout.row_start[1:])
    first = window * ring
    stop = min(first + ring, layout.rows)
    holds_begin = (begin >= first) & ((begin < stop) | (stop >= layout.rows))
    nonempty = end > begin
    active = torch.where(nonempty, (end > first) & (begin < stop), holds_begin)
    carry_in = active & nonempty & (begin < first)
    carry_out = active & nonempty & (end > stop)
    words = (
        active.to(torch.int32) * CARRY_ACTIVE.value
        + carry_in.to(torch.int32) * CARRY_IN.value
        + carry_out.to(torch.int32) * CARRY_OUT.value
        + active.to(torch.int32) * (window % 2 * CARRY_SLOT.value)
    )
    count = active.to(torch.int32).sum(0, keepdim=True, dtype=torch.int32)
    lo = (active.to(torch.int32).cumsum(0, dtype=torch.int32) == 0).to(torch.int32)
    return torch.cat([words, lo.sum(0, keepdim=True, dtype=torch.int32), count])


def _flags(plan: BackwardPlan, device: torch.device, flags: torch.Tensor | None) -> torch.Tensor:
    layout = backward_flag_layout(
        plan.max_blocks, plan.experts, plan.shared_blocks, plan.max_minibatches
    )
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


def _check_macrobatch(
    mo: MacrobatchOutputs, layout: RowSchedule, first: int, sched: RowSchedule
) -> None:
    """A :class:`Macrobatch` that fits its launch: the window inside the layout, on whole row
    blocks, its rows within the outputs', one of the outputs' windows of their ring rows (a
    ValueError naming what does not)."""
    rows, bm = sched.rows, layout.block_rows
    if sched.block_rows != bm or first % bm or first < 0 or first + rows > layout.rows:
        raise ValueError(
            f"macrobatch first_row {first} with {rows} rows must be whole {bm}-row blocks "
            f"inside the layout's {layout.rows} rows"
        )
    dx_rows = rows if mo.by_window else layout.rows
    if mo.dg.shape[0] < rows or mo.dxs.shape[0] < dx_rows:
        raise ValueError(
            f"macrobatch outputs hold {mo.dg.shape[0]} window rows and {mo.dxs.shape[0]} "
            f"d_x rows, the launch needs >= {rows} and >= {dx_rows}"
        )
    ring = mo.ring_rows
    if first % ring or rows != min(ring, layout.rows - first):
        raise ValueError(
            f"macrobatch first_row {first} with {rows} rows must be a window of the outputs' "
            f"{ring} ring rows (first_row a multiple, rows up to the next or the layout's end)"
        )


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
    macrobatch: Macrobatch | None = None,
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
        macrobatch: one launch of a macrobatched backward (:class:`Macrobatch`): ``sched`` is
            a row window of its layout and the routed rows are the window's; the routed d_x
            rows, d_g and d_u and the weight gradients go into its outputs, each
            weight-gradient tile summing the window's rows of its expert on from the carry.
            After the launches of every window in order the outputs hold one launch's bits.

    Returns:
        :class:`FusedGrads` (with ``macrobatch``: its outputs' d_x rows and weight gradients,
        final after the last window).
    """
    return _launch(
        ws,
        sched,
        (dz, xs, g, u, h),
        (w_gate, w_up, w_down),
        group_rows,
        shared,
        dict(lag=lag, programs=programs, swiglu_split=swiglu_split),
        budget,
        flags,
        macrobatch=macrobatch,
    )


def fused_backward_ep(
    ws: Workspace,
    sched: RowSchedule,
    slot_weights: torch.Tensor,
    xs: torch.Tensor,
    g: torch.Tensor,
    u: torch.Tensor,
    h: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    group_rows: int,
    shared: SharedBackwardInputs | None = None,
    num_comm: int | None = None,
    lag: int | None = None,
    programs: int | None = None,
    swiglu_split: int = 4,
    budget: int | None = None,
    flags: torch.Tensor | None = None,
    macrobatch: Macrobatch | None = None,
    dy_rows: torch.Tensor | None = None,
    dz: torch.Tensor | None = None,
) -> FusedGrads:
    """:func:`fused_backward` at W > 1 with its communication inside the launch (no host sync):
    comm programs pull the dy rows of this rank's experts from the source ranks' ``dy_buffer``
    (minibatches of ``group_rows``), a route-grad task per row block computes its dz = w * dy
    rows, and the comm programs push each row block's d_x rows into the source ranks'
    ``dx_slots`` once its gate+up dgrad tiles are stored.

    Call after the barrier that follows every rank's publish of dy; the source ranks may read
    their ``dx_slots`` after the next barrier. ``sched``: the schedule built from every rank's
    ids; ``slot_weights`` ``[W*T*K]`` fp32: every rank's router weights by global slot
    (``comm.gather_routing``); ``num_comm``: comm programs (None: ``plan.comm_programs_for`` of
    the grid); the other arguments as :func:`fused_backward` (``macrobatch``: with d_x rows
    ``by_window``, each launch pushing its window's). ``dy_rows``, ``dz``: where the pulled dy
    rows and dz go (default: new tensors; contiguous [sched.rows, H]). d topk_weights is not
    computed here: ``rows.route_grad_rows`` on the returned ``dy_rows`` gives it (its reduction
    order).
    """
    comm.check_schedule(ws, sched)
    if not ws.backward:
        raise ValueError("fused_backward_ep needs a workspace built with backward=True")
    tk = ws.world_size * ws.num_tokens * ws.top_k
    if slot_weights.dtype != torch.float32 or slot_weights.numel() != tk:
        raise ValueError(
            f"slot_weights must be float32 with {tk} elements (W*T*K), got "
            f"{slot_weights.dtype} with {slot_weights.numel()}"
        )
    rows, hidden = sched.rows, ws.hidden
    if macrobatch is not None and not macrobatch.outputs.by_window:
        raise ValueError("fused_backward_ep pushes d_x by window: macrobatch outputs by_window")
    bufs = []
    for name, t in (("dy_rows", dy_rows), ("dz", dz)):
        if t is None:
            bufs.append(empty((rows, hidden), ws.dtype, ws.device))
        else:
            bufs.append(check_out(name, t, (rows, hidden), ws.dtype))
    dy_rows, dz = bufs
    exchange = (ws.peers.dy, ws.peers.dx, dy_rows, dz, slot_weights.contiguous())
    return _launch(
        ws,
        sched,
        (dz, xs, g, u, h),
        (w_gate, w_up, w_down),
        group_rows,
        shared,
        dict(lag=lag, programs=programs, swiglu_split=swiglu_split, num_comm=num_comm),
        budget,
        flags,
        exchange,
        macrobatch,
    )


def _launch(
    ws: Workspace,
    sched: RowSchedule,
    routed_rows: tuple,
    weights: tuple,
    group_rows: int,
    shared: SharedBackwardInputs | None,
    tunables: dict,
    budget: int | None,
    flags: torch.Tensor | None,
    exchange: tuple | None = None,
    macrobatch: Macrobatch | None = None,
) -> FusedGrads:
    """Check, plan, allocate and launch (``exchange``: W > 1's (dy table, dx table, dy_rows,
    dz, slot weights), else None; ``macrobatch``: see :func:`fused_backward`)."""
    dz, xs, g, u, h = routed_rows
    w_gate, w_up, w_down = weights
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
    if exchange is not None and shared is not None and tokens != ws.num_tokens:
        raise ValueError(f"shared dy must have the workspace's {ws.num_tokens} rows, got {tokens}")
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
        exchange=exchange is not None,
        world_size=ws.world_size,
        top_k=sched.top_k,
        itemsize=dtype.itemsize,
        carry=macrobatch is not None,
        **tunables,
    )
    if macrobatch is None:
        dg, du = empty((rows, i), dtype, dev), empty((rows, i), dtype, dev)
        dxs = empty((rows, hidden), dtype, dev)
        # (the gradients in the activations' dtype, as gemm.wgrad)
        d_gate, d_up = _gate_up_grads(w_gate, w_up, dtype)
        d_down = empty(w_down.shape, dtype, dev)
        out_dxs = dxs
        carries = (d_gate, d_up, d_down)  # (never read: C.CARRY False)
        words = sched.counts
    else:
        mo, layout, first = macrobatch
        _check_macrobatch(mo, layout, first, sched)
        dg, du = mo.dg[:rows], mo.du[:rows]
        dxs = mo.dxs[:rows] if mo.by_window else mo.dxs[first : first + rows]
        d_gate, d_up, d_down = mo.d_w_gate, mo.d_w_up, mo.d_w_down
        out_dxs = mo.dxs
        carries = mo.carries
        words = carry_words(layout, first // mo.ring_rows, mo.ring_rows, plan.meta.BK_WGRAD)
    (wg, wgu_rows), (wu, _) = gate_up_2d(w_gate, w_up)
    wd, wd_rows = weight_2d(w_down)
    routed_descs = _part_descriptors(
        plan, dz, xs, g, u, h, (wd, wg, wu), (dg, du, dxs, d_gate, d_up, d_down)
    )
    carry_descs = tuple(descriptor(c, [1, plan.meta.BM_WGRAD, plan.meta.BN_WGRAD]) for c in carries)
    out = dict(dxs=out_dxs, d_w_gate=d_gate, d_w_up=d_up, d_w_down=d_down)
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
    if exchange is None:  # never read (C.EXCHANGE False removes the exchange)
        exchange_ptrs = (sched.row_src, sched.row_src, dz, dz, dxs, sched.row_src, dz)
        t_rows = tokens
    else:
        dy_table, dx_table, dy_rows, _, slot_weights = exchange
        exchange_ptrs = (dy_table, dx_table, dy_rows, dz, dxs, sched.row_src, slot_weights)
        out.update(dy_rows=dy_rows, dz=dz)
        t_rows = ws.num_tokens
    flags = _flags(plan, dev, flags)
    budget = comm.spin_budget(budget)
    launch(
        fused_backward_kernel,
        (plan.grid,),
        *routed_descs,
        *carry_descs,
        *shared_descs,
        (sched.row_start, sched.block_expert, sched.num_blocks, sched.counts, words),
        (
            t_rows,
            hidden,
            i,
            shared_intermediate,
            e,
            plan.max_blocks,
            wd_rows,
            wgu_rows,
            plan.max_minibatches,
        ),
        (flags, ws.errors, ws.rank, budget),
        exchange_ptrs,
        C=plan.meta.as_constexprs(),
        num_warps=FUSED_WARPS,
        num_stages=BACKWARD_STAGES,
        # every program resident: a task waits only on tasks (and pulls) that running programs
        # hold
        launch_cooperative_grid=plan.meta.GPU,
    )
    return FusedGrads(**out)
