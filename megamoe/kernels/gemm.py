"""Grouped GEMMs over the padded expert-contiguous row layout (persistent, TMA, bf16 -> fp32).

Three kernels, each a persistent grid of one program per SM walking its tiles:
  * ``gate_up``: g = A Wg^T and u = A Wu^T from one pass over A, epilogue h = silu(g) * u;
    writes g, u (for the backward) and h.
  * ``grouped_mm``: C = A W_e per row block, with W stored either way round; optionally a second
    (A2, W2) pair summed into the same accumulator (dgrad of gate and up), or a SwiGLU-backward
    epilogue that turns d_h into (d_g, d_u) (dgrad of down).
  * ``wgrad``: d_W_e = A_e^T B_e, one program per output tile looping over all rows of expert e
    in order (no split-K, no atomics): bitwise reproducible.

Row blocks map to experts through ``RowSchedule.block_expert``; the number of used blocks is read
on the device, so the grid never depends on the routing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .runtime import cdiv, check_out, descriptor, empty, interpreting, launch, launch_grid
from .schedule import RowSchedule
from .tiles import (
    cast,
    load_weight_tile,
    mma,
    next_tile_rows,
    program_steps,
    store_gate_up,
    store_mm,
    tile_of,
    tile_steps,
)

__all__ = [
    "GemmTiles",
    "gate_up_tile",
    "mm_acc",
    "grouped_mm_tile",
    "wgrad_tile",
    "gate_up",
    "grouped_mm",
    "dgrad_swiglu",
    "dgrad_pair",
    "wgrad",
    "tiles_for",
    "wgrad_kind",
    "row_tile",
    "CARRY_ACTIVE",
    "CARRY_IN",
    "CARRY_OUT",
    "CARRY_SLOT",
]


@dataclass(frozen=True)
class GemmTiles:
    """Tile shape, pipelining and grid of one kernel. None of them changes a result bit: each
    output element is summed by one program in K order whatever the tile (tests check it)."""

    bn: int
    bk: int
    stages: int
    warps: int
    # Tile height. Row-block kernels: 0 = one tile per row block (``block_rows``), or a divisor
    # of it (each block split into block_rows // bm tiles of one expert). The weight gradient:
    # the tile's extent along the weight's first dimension (fp8's warp-specialized one: 128,
    # 192 with three consumers, or 0: ``fp8_ws.wgrad_tiles`` picks).
    bm: int = 0
    flatten: bool = False  # fuse the persistent tile loop with the K loop (software pipelining)
    programs_per_sm: int = 1  # persistent programs per SM (2: small tiles hide each other)
    # fp8 GEMMs (``fp8_gemm``): the tile's rows as this many sub-tiles of bm // split_m rows
    # sharing each B tile in one warpgroup, each promoted before the next one's MMA (1 or 2)
    split_m: int = 1
    # fp8 split tiles: each sub-tile's product made to depend on the other's promoted result
    # for real (``fp8_gemm.opaque_zero``'s STRICT: one more instruction an element), where
    # ptxas would otherwise overlap the two products and spill
    strict_order: bool = False
    # fp8's GEMMs on Hopper (gate/up, the one- and two-pair grouped mm, the SwiGLU backward,
    # the weight gradient): the warp-specialized Gluon kernel (``fp8_ws``: 128 x ``bn`` tiles,
    # ``bn`` 128 or 256, gate/up's 64 or 128 of each weight; one producer warp and two consumer
    # warpgroups, ``stages`` ring slots; the weight gradient's ``bm`` 192: three consumers,
    # ``bn`` 128) in place of the Triton one; the same bits. Elsewhere
    # (the interpreter, other GPUs, fp32 outputs) the Triton kernel runs
    # ``fp8_gemm.triton_tiles`` of these tiles.
    warp_specialized: bool = False
    # the warp-specialized row-block kernels (``fp8_ws``): the row tiles walked together, the
    # row the fast index within a group, so that the CTAs running at once share a few
    # columns' weight tiles in L2 (1: the column the fast index; 0: ``fp8_ws.walk_group``
    # picks 8 or 1 by the expert's rows and the grid)
    group_m: int = 1


def row_tile(t: GemmTiles, block_rows: int) -> tuple[int, int]:
    """(tile height, tiles per row block) of a row-block kernel with tiles ``t``."""
    bm = t.bm or block_rows
    if block_rows % bm:
        raise ValueError(
            f"tile height bm = {bm} must divide block_rows = {block_rows} (a tile holds rows "
            "of one expert)"
        )
    return bm, block_rows // bm


# Hopper choices (H200), from interleaved A/B runs at the dsv3 shapes on 2026-11-30 (run-to-run
# spread is about 5%): 128-row blocks, 64-deep K steps, stages within 227 KB. Flattening the
# persistent loop into the K loop cost ~20% on gate/up, so it is off.
GPU_TILES: dict[str, GemmTiles] = {
    "gate_up": GemmTiles(bn=128, bk=64, stages=4, warps=8),  # two B tiles per stage
    "mm": GemmTiles(bn=256, bk=64, stages=3, warps=8),
    "swiglu_bwd": GemmTiles(bn=256, bk=64, stages=3, warps=8),
    "wgrad": GemmTiles(bm=128, bn=256, bk=64, stages=3, warps=8),
    # Experts of few rows (a K of 80-128): a tile is two K steps and a store, so two programs
    # per SM of 4 warps each, one loading while the other stores (1.07-1.17x "wgrad" at 80-128
    # balanced rows per expert, 0.99-1.06x at 160-256, slower above: tile sweep of the model
    # table at 4096 and 16384 tokens, 2026-12-02).
    "wgrad_few_rows": GemmTiles(bm=128, bn=128, bk=64, stages=2, warps=4, programs_per_sm=2),
}
# Small tiles keep interpreter runs (CPU tests) fast.
INTERPRETER_TILES: dict[str, GemmTiles] = {
    name: GemmTiles(bn=32, bk=32, stages=1, warps=4, bm=32 if name.startswith("wgrad") else 0)
    for name in GPU_TILES
}
# Bits of a macrobatched weight-gradient tile's carry word (``wgrad_tile``'s ``CARRY``): the
# launch sums some of the expert's rows (else the tile does nothing), its accumulator starts
# from the fp32 carry (else from +0), it goes back to the carry (else into the gradient), and
# the carry slot it goes to: 1 with ``CARRY_SLOT`` (an odd window), else 0; it starts from the
# other slot (the one the last window left it in).
CARRY_ACTIVE = tl.constexpr(1)
CARRY_IN = tl.constexpr(2)
CARRY_OUT = tl.constexpr(4)
CARRY_SLOT = tl.constexpr(8)
# Balanced rows per expert (``RowSchedule.balanced_rows``) at or below which the weight
# gradients take the "wgrad_few_rows" tiles.
FEW_ROWS_PER_EXPERT = 128


def tiles_for(kind: str) -> GemmTiles:
    return (INTERPRETER_TILES if interpreting() else GPU_TILES)[kind]


def wgrad_kind(sched: RowSchedule) -> str:
    """The tile entry of a weight gradient over ``sched``'s rows, chosen by host-side sizes
    only (the same choice on every rank and every run; the bits do not depend on it)."""
    return "wgrad_few_rows" if sched.balanced_rows <= FEW_ROWS_PER_EXPERT else "wgrad"


@triton.jit
def gate_up_tile(
    a_desc,
    bg_desc,
    bu_desc,
    g_desc,
    u_desc,
    h_desc,
    expert,
    row,
    col,
    w_rows,
    K,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One [BM, BN] tile of g = A Wg^T, u = A Wu^T and h = silu(g) * u at (row, col); the
    experts of both weights' 2-D views are ``w_rows`` rows apart (``tiles.load_weight_tile``).

    Shared by the unfused kernel and the fused forward, so both give the same bits.
    """
    acc_g = tl.zeros([BM, BN], dtype=tl.float32)
    acc_u = tl.zeros([BM, BN], dtype=tl.float32)
    for ki in range(tl.cdiv(K, BK)):
        k = ki * BK
        a = a_desc.load([row, k])
        acc_g = mma(
            acc_g, a, load_weight_tile(bg_desc, expert, k, col, w_rows, BK, BN, False), UPCAST
        )
        acc_u = mma(
            acc_u, a, load_weight_tile(bu_desc, expert, k, col, w_rows, BK, BN, False), UPCAST
        )
    store_gate_up(g_desc, u_desc, h_desc, row, col, acc_g, acc_u, UPCAST)


@triton.jit
def mm_acc(
    acc,
    a_desc,
    b_desc,
    expert,
    row,
    col,
    w_rows,
    K,
    BK: tl.constexpr,
    BN: tl.constexpr,
    B_KN: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """``acc += A[row:row+BM] @ W_expert`` over all of K, in K order (one output tile); the
    experts of W's 2-D view are ``w_rows`` rows apart."""
    for ki in range(tl.cdiv(K, BK)):
        k = ki * BK
        acc = mma(
            acc,
            a_desc.load([row, k]),
            load_weight_tile(b_desc, expert, k, col, w_rows, BK, BN, B_KN),
            UPCAST,
        )
    return acc


@triton.jit
def _gate_up_kernel(
    a_desc,
    bg_desc,
    bu_desc,
    g_desc,
    u_desc,
    h_desc,
    block_expert_ptr,
    num_blocks_ptr,
    N,
    K,
    w_rows,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    BLOCK_TILES: tl.constexpr,
    NUM_PROGS: tl.constexpr,
    FLATTEN: tl.constexpr,
    UPCAST: tl.constexpr,
):
    tiles_n = tl.cdiv(N, BN)
    num_tiles = tl.load(num_blocks_ptr) * BLOCK_TILES * tiles_n
    for tile in tl.range(tl.program_id(0), num_tiles, NUM_PROGS, flatten=FLATTEN):
        mb, nb = tile_of(tile, tiles_n)
        gate_up_tile(
            a_desc,
            bg_desc,
            bu_desc,
            g_desc,
            u_desc,
            h_desc,
            tl.load(block_expert_ptr + mb // BLOCK_TILES),
            mb * BM,
            nb * BN,
            w_rows,
            K,
            BM,
            BN,
            BK,
            UPCAST,
        )


@triton.jit
def grouped_mm_tile(
    a_desc,
    b_desc,
    a2_desc,
    b2_desc,
    c_desc,
    c2_desc,
    g_desc,
    u_desc,
    expert,
    row,
    col,
    w_rows,
    w2_rows,
    K,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    B_KN: tl.constexpr,
    TWO_PAIRS: tl.constexpr,
    SWIGLU_BWD: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One [BM, BN] output tile at (row, col) of ``grouped_mm``'s three forms: C = A W_e;
    with ``TWO_PAIRS`` C = A W_e + A2 W2_e in one accumulator (dgrad of gate and up); with
    ``SWIGLU_BWD`` the accumulator is d_h and the tile stores (d_g, d_u) into (c, c2) from the
    saved (g, u).

    Shared by the unfused kernel and the fused backward, so both give the same bits.
    """
    acc = mm_acc(
        tl.zeros([BM, BN], dtype=tl.float32),
        a_desc,
        b_desc,
        expert,
        row,
        col,
        w_rows,
        K,
        BK,
        BN,
        B_KN,
        UPCAST,
    )
    if TWO_PAIRS:
        acc = mm_acc(acc, a2_desc, b2_desc, expert, row, col, w2_rows, K, BK, BN, B_KN, UPCAST)
    store_mm(c_desc, c2_desc, g_desc, u_desc, row, col, acc, SWIGLU_BWD, UPCAST)


@triton.jit
def _grouped_mm_kernel(
    a_desc,
    b_desc,
    a2_desc,
    b2_desc,
    c_desc,
    c2_desc,
    g_desc,
    u_desc,
    block_expert_ptr,
    num_blocks_ptr,
    N,
    K,
    w_rows,
    w2_rows,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    B_KN: tl.constexpr,
    TWO_PAIRS: tl.constexpr,
    SWIGLU_BWD: tl.constexpr,
    BLOCK_TILES: tl.constexpr,
    NUM_PROGS: tl.constexpr,
    FLATTEN: tl.constexpr,
    UPCAST: tl.constexpr,
):
    tiles_n = tl.cdiv(N, BN)
    num_tiles = tl.load(num_blocks_ptr) * BLOCK_TILES * tiles_n
    for tile in tl.range(tl.program_id(0), num_tiles, NUM_PROGS, flatten=FLATTEN):
        mb, nb = tile_of(tile, tiles_n)
        grouped_mm_tile(
            a_desc,
            b_desc,
            a2_desc,
            b2_desc,
            c_desc,
            c2_desc,
            g_desc,
            u_desc,
            tl.load(block_expert_ptr + mb // BLOCK_TILES),
            mb * BM,
            nb * BN,
            w_rows,
            w2_rows,
            K,
            BM,
            BN,
            BK,
            B_KN,
            TWO_PAIRS,
            SWIGLU_BWD,
            UPCAST,
        )


@triton.jit
def wgrad_tile(
    a_desc,
    b_desc,
    c_desc,
    expert,
    m0,
    n0,
    row_begin,
    row_end,
    carry_desc,
    carry,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    CARRY: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """The [BM, BN] tile at (m0, n0) of d_W[expert] = A^T B over the rows [row_begin, row_end)
    in order, BK rows a step (no split-K): one program per output tile.

    ``CARRY`` (a macrobatched backward, which sums an expert's rows over several launches): the
    fp32 accumulator starts from the tile of slot ``1 - s`` of ``carry_desc`` (an fp32 [2, M, N]
    buffer: two slots, whatever the expert) when ``carry & CARRY_IN`` (else from +0, as without
    ``CARRY``) and goes to slot ``s`` when ``carry & CARRY_OUT`` (else it is cast into
    ``c_desc``), ``s`` = 1 when ``carry & CARRY_SLOT`` else 0. With every launch's rows on
    K-step multiples the tile takes the same ``mma`` steps from the same +0 as one launch over
    all the rows, and an fp32 value goes through memory unchanged: the same bits. Without
    ``CARRY`` ``carry_desc`` and ``carry`` are never read.

    Shared by the unfused kernel and the fused backward, so both give the same bits.
    """
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    out_at = -1
    if CARRY:
        if (carry & CARRY_IN) != 0:
            slot_in = 1 - (carry & CARRY_SLOT) // CARRY_SLOT
            acc = carry_desc.load([slot_in, m0, n0]).reshape([BM, BN])
        # the slot it goes to (-1: into c_desc), worked out here: only it stays live across the
        # loop, not the word (a temporary after the loop spilled 4 B in the fused kernel at W = 2)
        out_at = tl.where((carry & CARRY_OUT) != 0, (carry & CARRY_SLOT) // CARRY_SLOT, -1)
    # All rows of this expert, in order: padding rows hold zeros in A and B.
    for r in range(row_begin, row_end, BK):
        acc = mma(acc, a_desc.load([r, m0]).T, b_desc.load([r, n0]), UPCAST)
    if CARRY:
        if out_at >= 0:
            carry_desc.store([out_at, m0, n0], acc.reshape([1, BM, BN]))
        else:
            c_desc.store([expert, m0, n0], cast(acc, c_desc.dtype, UPCAST).reshape([1, BM, BN]))
    else:
        c_desc.store([expert, m0, n0], cast(acc, c_desc.dtype, UPCAST).reshape([1, BM, BN]))


@triton.jit
def expert_row_range(row_start_ptr, counts_ptr, expert, BK: tl.constexpr):
    """The rows of ``expert`` a weight-gradient tile sums: from its first row to its last real
    row rounded up to the K step, within its padded rows. The padding rows past it hold zeros
    in both operands and the sum starts at +0, so leaving them out changes no bit; an expert of
    160 rows in 128-row blocks takes 3 K steps of 64 instead of 4. ``expert`` may be a vector
    (``E_POW2`` lanes, masked from ``E`` on). (The flattened loop reads the same rows with
    ``tiles.expert_rows``.)"""
    row_begin = tl.load(row_start_ptr + expert)
    padded_end = tl.load(row_start_ptr + expert + 1)
    real_end = row_begin + tl.cdiv(tl.load(counts_ptr + expert), BK) * BK
    return row_begin, tl.minimum(real_end, padded_end)


@triton.jit
def _wgrad_kernel(
    a_desc,
    b_desc,
    c_desc,
    row_start_ptr,
    counts_ptr,
    E,
    M,
    N,
    zero_row,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    FLATTEN: tl.constexpr,
    E_POW2: tl.constexpr,
    NUM_PROGS: tl.constexpr,
    UPCAST: tl.constexpr,
):
    tiles_n = tl.cdiv(N, BN)
    tiles_per_expert = tl.cdiv(M, BM) * tiles_n
    if FLATTEN:
        # One loop over the K steps of all the program's tiles (as fp8_gemm's weight gradient:
        # a walk over the tiles for the loads, one for the stores; an expert without rows takes
        # one step of zeros at ``zero_row``, past every row).
        pid = tl.program_id(0)
        e = tl.arange(0, E_POW2)
        begin_e, end_e = expert_row_range(row_start_ptr, counts_ptr, tl.minimum(e, E - 1), BK)
        steps = tl.maximum(tl.cdiv(end_e - begin_e, BK), 1)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        walk = (pid - NUM_PROGS, 0, 0, 0, 0, False)  # the loads' (tiles.next_tile_rows)
        out_tile = pid  # the stores'
        first = tl.minimum(pid // tiles_per_expert, E - 1)
        left = tile_steps(row_start_ptr, counts_ptr, first, BK, UPCAST, True)
        for _ in range(program_steps(steps, E, tiles_per_expert, pid, NUM_PROGS, E_POW2)):
            walk = next_tile_rows(walk, row_start_ptr, counts_ptr, tiles_per_expert, tiles_n,
                                  zero_row, BM, BN, BK, NUM_PROGS, UPCAST, True)  # fmt: skip
            tile, r, r_end, m0, n0, live = walk
            acc = mma(acc, a_desc.load([r, m0]).T, b_desc.load([r, n0]), UPCAST)
            walk = (tile, r + BK, r_end, m0, n0, live)
            left -= 1
            if left == 0:
                out_expert = out_tile // tiles_per_expert
                out_mb, out_nb = tile_of(out_tile % tiles_per_expert, tiles_n)
                out = cast(acc, c_desc.dtype, UPCAST).reshape([1, BM, BN])
                c_desc.store([out_expert, out_mb * BM, out_nb * BN], out)
                acc = tl.zeros([BM, BN], dtype=tl.float32)
                out_tile += NUM_PROGS
                next_expert = tl.minimum(out_tile // tiles_per_expert, E - 1)
                left = tile_steps(row_start_ptr, counts_ptr, next_expert, BK, UPCAST, True)
    else:
        for tile in tl.range(tl.program_id(0), E * tiles_per_expert, NUM_PROGS):
            expert = tile // tiles_per_expert
            mb, nb = tile_of(tile % tiles_per_expert, tiles_n)
            row_begin, row_end = expert_row_range(row_start_ptr, counts_ptr, expert, BK)
            wgrad_tile(
                a_desc,
                b_desc,
                c_desc,
                expert,
                mb * BM,
                nb * BN,
                row_begin,
                row_end,
                c_desc,
                0,
                BM,
                BN,
                BK,
                False,
                UPCAST,
            )


def weight_2d(w: torch.Tensor) -> tuple[torch.Tensor, int]:
    """An [E, R, C] weight as the kernels index it: a [rows, C] view with the experts stacked
    along the rows, and the rows from one expert to the next.

    Read in place whenever its rows are contiguous and its experts a whole number of rows apart:
    a weight of its own (R rows apart) or either half of a stacked gate/up weight ``[E, 2I, H]``
    (2I rows apart; the view of the gate half runs into the up rows, which only feed output
    columns past I that the stores clip). Any other layout is copied once here."""
    e, r, c = w.shape
    row, step = w.stride(1), w.stride(0)
    if w.stride(2) != 1 or (r > 1 and row < c) or (e > 1 and (step % row or step < r * row)):
        w = w.contiguous()
        row, step = c, r * c
    rows_apart = step // row if e > 1 else r
    return w.as_strided(((e - 1) * rows_apart + r, c), (row, 1)), rows_apart


def gate_up_2d(
    w_gate: torch.Tensor, w_up: torch.Tensor
) -> tuple[tuple[torch.Tensor, int], tuple[torch.Tensor, int]]:
    """:func:`weight_2d` of both gate/up weights, whose experts one kernel argument spaces: the
    halves of one stacked weight, or two weights of their own (copied when they are neither)."""
    views = weight_2d(w_gate), weight_2d(w_up)
    if views[0][1] != views[1][1]:
        views = weight_2d(w_gate.contiguous()), weight_2d(w_up.contiguous())
    return views


def gate_up(
    a: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    sched: RowSchedule,
    programs: int | None = None,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(g, u, h), each [rows of a, I]: both projections and SwiGLU of every used row block.
    ``programs`` (every GEMM here): the SMs to fill, default all (the grid is the tiles'
    ``programs_per_sm`` on each); the bits never depend on it. ``out``: where to write
    (g, u, h) (default: new tensors), each a contiguous [rows of a, I] tensor of a's dtype."""
    t = tiles_for("gate_up")
    bm, block_tiles = row_tile(t, sched.block_rows)
    rows, k = a.shape
    n = w_gate.shape[1]
    if out is None:
        g, u, h = (empty((rows, n), a.dtype, a.device) for _ in range(3))
    else:
        g, u, h = (check_out(name, o, (rows, n), a.dtype) for name, o in zip("guh", out))
    out_descs = [descriptor(o, [bm, t.bn]) for o in (g, u, h)]
    (wg, w_rows), (wu, _) = gate_up_2d(w_gate, w_up)
    work = sched.max_blocks * block_tiles * cdiv(n, t.bn)
    grid = launch_grid(work, a.device, programs, t.programs_per_sm)
    launch(
        _gate_up_kernel,
        grid,
        descriptor(a, [bm, t.bk]),
        descriptor(wg, [t.bn, t.bk]),
        descriptor(wu, [t.bn, t.bk]),
        *out_descs,
        sched.block_expert,
        sched.num_blocks,
        n,
        k,
        w_rows,
        BM=bm,
        BN=t.bn,
        BK=t.bk,
        BLOCK_TILES=block_tiles,
        NUM_PROGS=grid[0],
        FLATTEN=t.flatten and not interpreting(),
        UPCAST=interpreting(),
        num_warps=t.warps,
        num_stages=t.stages,
    )
    return g, u, h


def _mm_launch(
    kind: str,
    a: torch.Tensor,
    w: torch.Tensor,
    sched: RowSchedule,
    *,
    b_kn: bool,
    a2: torch.Tensor | None = None,
    w2: torch.Tensor | None = None,
    gu: tuple[torch.Tensor, torch.Tensor] | None = None,
    programs: int | None = None,
    out: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    t = tiles_for(kind)
    bm, block_tiles = row_tile(t, sched.block_rows)
    rows, k = a.shape
    n = w.shape[2] if b_kn else w.shape[1]
    if out is not None:
        outs = [check_out("out", out, (rows, n), a.dtype)]
    else:
        outs = [empty((rows, n), a.dtype, a.device) for _ in range(2 if gu is not None else 1)]
    b_block = [t.bk, t.bn] if b_kn else [t.bn, t.bk]
    a_desc = descriptor(a, [bm, t.bk])
    (wb, w_rows), (wb2, w2_rows) = weight_2d(w), weight_2d(w if w2 is None else w2)
    b_desc = descriptor(wb, b_block)
    c_descs = [descriptor(o, [bm, t.bn]) for o in outs]
    gu_descs = [descriptor(x, [bm, t.bn]) for x in gu] if gu is not None else c_descs * 2
    work = sched.max_blocks * block_tiles * cdiv(n, t.bn)
    grid = launch_grid(work, a.device, programs, t.programs_per_sm)
    launch(
        _grouped_mm_kernel,
        grid,
        a_desc,
        b_desc,
        descriptor(a2, [bm, t.bk]) if a2 is not None else a_desc,
        descriptor(wb2, b_block) if w2 is not None else b_desc,
        c_descs[0],
        c_descs[-1],
        gu_descs[0],
        gu_descs[1],
        sched.block_expert,
        sched.num_blocks,
        n,
        k,
        w_rows,
        w2_rows,
        BM=bm,
        BN=t.bn,
        BK=t.bk,
        B_KN=b_kn,
        TWO_PAIRS=a2 is not None,
        SWIGLU_BWD=gu is not None,
        BLOCK_TILES=block_tiles,
        NUM_PROGS=grid[0],
        FLATTEN=t.flatten and not interpreting(),
        UPCAST=interpreting(),
        num_warps=t.warps,
        num_stages=t.stages,
    )
    return outs


def grouped_mm(
    a: torch.Tensor,
    w: torch.Tensor,
    sched: RowSchedule,
    programs: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """C[r] = a[r] @ w[e(r)]^T for weights in ``nn.Linear`` layout [E, N, K] (forward down).
    ``out``: where to write C (default: a new tensor), a contiguous [rows of a, N] tensor."""
    return _mm_launch("mm", a, w, sched, b_kn=False, programs=programs, out=out)[0]


def dgrad_swiglu(
    dz: torch.Tensor,
    w_down: torch.Tensor,
    g: torch.Tensor,
    u: torch.Tensor,
    sched: RowSchedule,
    programs: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d_g, d_u) = SwiGLU backward of d_h = dz @ w_down[e] (w_down [E, H, I])."""
    dg, du = _mm_launch("swiglu_bwd", dz, w_down, sched, b_kn=True, gu=(g, u), programs=programs)
    return dg, du


def dgrad_pair(
    dg: torch.Tensor,
    w_gate: torch.Tensor,
    du: torch.Tensor,
    w_up: torch.Tensor,
    sched: RowSchedule,
    programs: int | None = None,
) -> torch.Tensor:
    """d_x rows = dg @ w_gate[e] + du @ w_up[e] in one fp32 accumulator (weights [E, I, H])."""
    return _mm_launch("mm", dg, w_gate, sched, b_kn=True, a2=du, w2=w_up, programs=programs)[0]


def wgrad(
    a: torch.Tensor,
    b: torch.Tensor,
    sched: RowSchedule,
    programs: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """d_W [E, M, N], d_W[e] = a_e^T @ b_e over the rows of expert e (a [rows, M], b [rows, N]).

    ``out``: where to write it (default: a new tensor), e.g. one half of a stacked gate/up
    gradient; any [E, M, N] view with contiguous rows."""
    t = tiles_for(wgrad_kind(sched))
    bk = min(t.bk, sched.block_rows)
    m, n = a.shape[1], b.shape[1]
    e = sched.num_experts
    if out is None:
        out = empty((e, m, n), a.dtype, a.device)
    elif tuple(out.shape) != (e, m, n) or out.dtype != a.dtype or out.stride(2) != 1:
        raise ValueError(
            f"out must be a {a.dtype} [{e}, {m}, {n}] tensor with contiguous rows, got "
            f"{out.dtype} {list(out.shape)} strides {out.stride()}"
        )
    work = e * cdiv(m, t.bm) * cdiv(n, t.bn)
    if not work:
        return out
    grid = launch_grid(work, a.device, programs, t.programs_per_sm)
    launch(
        _wgrad_kernel,
        grid,
        descriptor(a, [bk, t.bm]),
        descriptor(b, [bk, t.bn]),
        descriptor(out, [1, t.bm, t.bn]),
        sched.row_start,
        sched.counts,
        e,
        m,
        n,
        cdiv(a.shape[0], bk) * bk,  # a K step past the rows: TMA reads zeros there
        BM=t.bm,
        BN=t.bn,
        BK=bk,
        FLATTEN=t.flatten,
        E_POW2=triton.next_power_of_2(e),
        NUM_PROGS=grid[0],
        UPCAST=interpreting(),
        num_warps=t.warps,
        num_stages=t.stages,
    )
    return out
