"""Warp-specialized block-scaled FP8 grouped GEMMs for Hopper (Gluon): gate/up with its SwiGLU
epilogue (two weights, 64 or 128 columns of each a tile), the forward down (one (A, W) pair),
the dgrad of down with the SwiGLU backward epilogue, the dgrad of gate/up (two pairs into one
accumulator) and the weight gradient (each expert's rows as the K steps; its 128x1 scales on
both operands, the columns' through the ring with the step's tiles).

Why: ``fp8_gemm``'s Triton kernels promote each 128-deep K step's fp32 partial product on the
CUDA cores, and within one warpgroup the tensor cores idle while it waits for its MMAs and
promotes; two programs per SM hide part of that. Here the work of a CTA is split the way
DeepGEMM splits it, so that one warpgroup's promotion overlaps another's MMAs:

  * one producer warp streams each K step's A and B tiles into a ring of ``stages``
    shared-memory slots with TMA ("ready" barriers completed by the copies, "free" barriers
    released by the consumers);
  * two consumer warpgroups each own the 64 x 128 fp32 accumulator of one half of a 128 x 128
    tile (B shared). A consumer issues the step's wgmma (m64n128k32, four along K) into a fresh
    partial accumulator, waits for it, releases the slot and promotes:
    ``acc + d * (a_scale * b_scale)[:, None]``. The consumers run independently, so one
    promotes while the other's MMAs run;
  * the scales of step k + 1 are loaded during step k into two register sets by step parity
    (the K loop is unrolled by two), and their product is taken after the step's wait: no
    instruction before a wgmma issue waits for a global load. (A consumer that multiplied the
    scales as soon as they were loaded, or copied them into a loop-carried register, waited
    for the loads before every wgmma: ptxas puts that multiply or copy there.)
  * wide tiles (256 columns; gate/up: 128 of each weight) stack two 128-row B boxes in a slot,
    a quarter fewer operand bytes a FLOP than 128 x 128 tiles, whose operand traffic holds
    them near 65% of the tensor cores' time (Nsight Compute on an H100: L2 71-74% busy).
    A consumer keeps two 64 x 128 accumulators and runs the slot's two blocks one after the
    other through one partial accumulator (``WIDE_MM``): two of those would not fit its
    registers. The weight gradient's wide tile, which also holds the step's column scales,
    keeps four 64 x 64 accumulators and one 64 x 64 partial one (``WIDE_WGRAD``). The
    weight gradient can also run three consumer warpgroups on 192 x 128 tiles (``consumers``
    3: two 64 x 64 accumulators a consumer, 160 registers each), so that two consumers' MMAs
    are in flight while the third promotes.
  * gate/up's wide tile can quantize h in its epilogue instead of storing it
    (``_store_quantized``, ``fp8_gemm.gate_up_quantized``): a consumer's 64 rows hold whole
    1x128 blocks, and the tile's 128 rows one 128x1 block, whose column maxima the two
    consumers exchange through shared memory. The SwiGLU backward's epilogue quantizes d_g
    and d_u the same way (``fp8_gemm.dgrad_swiglu_quantized``).

Bits: per K step each element's partial product comes from four m64n128k32 wgmma instructions
(gate/up's 64-column tiles and the wide weight gradient: m64n64k32, as gate/up's Triton
tiles; an element's product is the same from either shape, the GPU tests show), in K order,
from a zero accumulator, as in ``fp8_gemm.fp8_mma``'s 64-row tiles, the promotion is the same
expression in the same order, and the SwiGLU epilogues call the Triton kernels' device
functions (``tiles.swiglu``, ``tiles.swiglu_backward``), so the output is bitwise that of
``fp8_gemm``'s kernels (the GPU tests compare them). The persistent grid, one
CTA per SM, walks the tiles of the used row blocks in groups of row tiles (``_tile_origin``,
``walk_group``) or each expert's weight tiles in order; no walk changes a bit.

Gluon kernels do not run in the Triton interpreter: ``fp8_gemm.gate_up``, ``grouped_mm``,
``dgrad_swiglu``, ``dgrad_pair`` and ``wgrad`` take this path on a Hopper GPU only, when their
tiles ask for it (``GemmTiles.warp_specialized``); the CPU tests compile it for sm_90a
(``megamoe.tools.compile_check``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..errors import Stage
from . import comm, fp8, tiles
from .fp8 import BLOCK, FP8
from .runtime import (
    cdiv,
    compiling_for_hopper,
    device_capability,
    interpreting,
    launch,
    launch_grid,
)

__all__ = [
    "TILE_ROWS",
    "TILE_COLS",
    "SMEM_BYTES",
    "smem_bytes",
    "staging_cols",
    "supported",
    "RowArrivals",
    "StoredTiles",
    "stored_signals",
    "launch_gate_up",
    "launch_grouped_mm",
    "launch_wgrad",
]

HALF_ROWS = gl.constexpr(64)  # rows of one consumer's wgmma tile (m64)
# one 128-wide weight-scale block: a consumer's columns, the tile's width
TILE_COLS = gl.constexpr(128)
TILE_ROWS = 2 * HALF_ROWS.value  # (host) the two consumers' halves
BK = gl.constexpr(BLOCK)  # the K step: one scale block, the promotion interval
# Registers per thread (setmaxnreg) of the consumer warpgroups and of the producer warp's
# warpgroup: 2 * 128 * 232 + 128 * 40 = 64512 of the SM's 65536. The launch asks for their
# average over the kernel's 12 warps.
CONSUMER_REGS = gl.constexpr(232)
PRODUCER_REGS = gl.constexpr(40)
KERNEL_MAXNREG = 168
# Three consumer warpgroups (the weight gradient's 192-row tiles): 3 * 128 * 160 + 128 * 32 =
# 65536 (152 a consumer spilled); the launch asks for the 16 warps' average, 128
THREE_CONSUMER_REGS = gl.constexpr(160)
THREE_PRODUCER_REGS = gl.constexpr(32)
THREE_CONSUMER_MAXNREG = 128
# A consumer's accumulator: wgmma m64n128k32 over one warpgroup (4 warps along M), the
# instruction fp8_gemm's 64-row tiles get
ACC_LAYOUT = gl.constexpr(
    gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 32])
)
# gate/up: a tile's columns of each weight; the two weights' B boxes fill one 128-row ring slot
GATE_UP_COLS = gl.constexpr(64)
# a gate/up consumer's two accumulators: wgmma m64n64k32, the instruction of fp8_gemm's 64-column
# gate/up tiles
GATE_UP_LAYOUT = gl.constexpr(
    gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 32])
)
SMEM_BYTES = 227 * 1024  # what one H100/H200 CTA may use
_STAGE_ROWS = gl.constexpr(int(Stage.ROWS_READY))  # (a stall record's stage: rows that arrive)
# The row tiles walked together (``_tile_origin``) where ``GemmTiles.group_m`` is 0 (automatic)
# and an expert's row tiles do not all run at once (``walk_group``)
AUTO_GROUP_M = 8
# What a consumer's K step computes (``_k_step``)
MM = gl.constexpr(0)  # acc += d * (a_scale * w_scale): one weight scale per row's 128 columns
WGRAD = gl.constexpr(1)  # acc += d * a_scale * b_scale: 128x1 scales on both operands
GATE_UP = gl.constexpr(2)  # MM's for each of two weights (gate, up) into two accumulators
# MM's for each of a 256-column tile's two 128-column blocks into two accumulators, the second
# block's wgmma after the first one's promotion (through one partial accumulator)
WIDE_MM = gl.constexpr(3)
# WGRAD's for each of a 256-column weight-gradient tile's four 64-column blocks into four
# accumulators, one block's wgmma (m64n64k32) after the previous one's promotion, through one
# 64-column partial accumulator (a 128-column one and two full ones spilled)
WIDE_WGRAD = gl.constexpr(4)


def staging_cols(kind: str, cols: int = TILE_COLS.value) -> int:
    """The columns of a consumer's staging tiles of the epilogue, all outputs together, for
    tiles of ``cols`` columns (of each weight, for gate/up): gate/up's three 64-column tiles
    (g, u, h) or a wide tile's two of 128 (h through g's), the SwiGLU backward's two of 128
    (d_g, d_u), else the tile's ``cols`` (``kind``: the ``fp8_gemm.GPU_TILES`` entry)."""
    if kind == "gate_up":
        return 3 * cols if cols == GATE_UP_COLS.value else 2 * cols
    return 2 * TILE_COLS.value if kind == "swiglu_bwd" else cols


def smem_bytes(
    stages: int, out_bytes: int = 2, kind: str = "mm", cols: int = 128, consumers: int = 2
) -> int:
    """The ring (fp8 A tiles, 64 rows a consumer, and the B tiles of a tile's ``cols``
    columns: 128, 256 for a wide tile; gate/up's 64 of each weight), each consumer's staging
    tiles of the epilogue (``staging_cols(kind, cols)`` wide, 64 rows; ``out_bytes`` an
    element: 2 for bf16, 4 for fp32), the barriers."""
    b_rows = 2 * cols if kind == "gate_up" else cols
    # (the weight gradient's ring also holds each step's fp32 column scales, one a column)
    a_rows = consumers * HALF_ROWS.value
    step = (a_rows + b_rows) * BLOCK + (4 * cols if kind.startswith("wgrad") else 0)
    staging = consumers * HALF_ROWS.value * staging_cols(kind, cols) * out_bytes
    # the consumers' exchange of column maxima (``_exchange``, allocated only where the
    # epilogue quantizes): gate/up's of h, the SwiGLU backward's of d_g and d_u
    outputs = {"gate_up": 1, "swiglu_bwd": 2}.get(kind, 0)
    exchange = outputs * (4 * TILE_COLS.value * 4 + 16)
    return stages * step + staging + 16 * stages + exchange


@gluon.jit
def _tile_walk(sched, N, BLOCK_TILES: gl.constexpr, COLS: gl.constexpr):
    """What ``_tile_origin`` reads of the row schedule (``sched``: the row blocks' experts,
    the number of used row blocks): (the experts, row tiles, column tiles of ``COLS``), and
    the number of tiles."""
    block_expert_ptr, num_blocks_ptr = sched
    tiles_m = gl.load(num_blocks_ptr) * BLOCK_TILES
    tiles_n = gl.cdiv(N, COLS)
    return (block_expert_ptr, tiles_m, tiles_n), tiles_m * tiles_n


@gluon.jit
def _tile_origin(tile, walk, BLOCK_TILES: gl.constexpr, COLS: gl.constexpr,
                 GROUP_M: gl.constexpr):  # fmt: skip
    """(expert, first row, first column) of CTA tile ``tile`` (``walk``: ``_tile_walk``'s).
    The tiles go by groups of ``GROUP_M`` row tiles, the row the fast index within a group and
    then the column, so that the CTAs running at once share the weight tiles of a few columns
    (read from memory once a group, not once a row tile, where an expert's weights do not fit
    L2); GROUP_M 1: the column the fast index. The expert is that of the tile's row block."""
    block_expert_ptr, tiles_m, tiles_n = walk
    if GROUP_M == 1:
        mb = tile // tiles_n
        nb = tile % tiles_n
    else:
        per_group = GROUP_M * tiles_n
        first = (tile // per_group) * GROUP_M
        rows = gl.minimum(tiles_m - first, GROUP_M)
        mb = first + (tile % per_group) % rows
        nb = (tile % per_group) // rows
    expert = gl.load(block_expert_ptr + mb // BLOCK_TILES)
    return expert, mb * (2 * HALF_ROWS), nb * COLS


@gluon.jit
def _load_steps(a_desc, b_descs, ring, a_row, b_row, k0, k_steps, it, B_STEP: gl.constexpr = 0,
                col_scales=None):  # fmt: skip
    """``k_steps`` K steps of one tile into the ring, from ring step ``it`` on: the two 64-row
    A boxes at (a_row, k) and (a_row + 64, k) and the B box at (b_row + i * B_STEP, k) of each
    descriptor i of ``b_descs``, stacked in the slot (one; gate/up's two 64-row boxes, B_STEP
    0; a wide tile's two 128-row boxes of one weight, B_STEP 128), k from ``k0`` on in steps
    of 128; with ``col_scales`` (the weight gradient's: descriptor and buffers of the B rows'
    128x1 scales, feature-major) also their box (k // 128, b_row) into the slot's buffer.
    Returns the next ring step."""
    a_bufs, b_bufs, ready, free, STAGES = ring
    CONSUMERS: gl.constexpr = a_bufs.shape[0] // ready.shape[0]  # (64-row A tiles a slot)
    NB: gl.constexpr = len(b_descs)
    B_ROWS: gl.constexpr = b_descs[0].block_type.shape[0]
    STEP_BYTES: gl.constexpr = (
        CONSUMERS * a_desc.block_type.nbytes + NB * b_descs[0].block_type.nbytes
    )
    for kb in range(k_steps):
        slot = it % STAGES
        # The first pass over the ring waits on phase 1, which a fresh barrier has completed:
        # the producer runs STAGES steps ahead from the start.
        mbarrier.wait(free.index(slot), ((it // STAGES) & 1) ^ 1)
        bar = ready.index(slot)
        k = k0 + kb * BK
        if col_scales is None:
            mbarrier.expect(bar, STEP_BYTES)
        else:
            s_desc, s_bufs = col_scales
            mbarrier.expect(bar, STEP_BYTES + s_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(s_desc, [k // BK, b_row], bar, s_bufs.index(slot))
        for half in gl.static_range(CONSUMERS):
            tma.async_copy_global_to_shared(
                a_desc, [a_row + half * HALF_ROWS, k], bar, a_bufs.index(CONSUMERS * slot + half)
            )
        if NB == 1:
            tma.async_copy_global_to_shared(b_descs[0], [b_row, k], bar, b_bufs.index(slot))
        else:
            for i in gl.static_range(NB):
                dst = b_bufs.index(slot).slice(i * B_ROWS, B_ROWS)
                tma.async_copy_global_to_shared(b_descs[i], [b_row + i * B_STEP, k], bar, dst)
        it += 1
    return it


@gluon.jit
def _producer(pairs, ring, sched, N, K, TWO_PAIRS: gl.constexpr, BLOCK_TILES: gl.constexpr,
              NUM_PROGS: gl.constexpr, COLS: gl.constexpr, GROUP_M: gl.constexpr,
              HAS_GU: gl.constexpr = False, gu=None, WAIT_ROWS: gl.constexpr = 0,
              arrivals=None):  # fmt: skip
    """One warp: every K step of every tile of this CTA, in the consumers' order, into the
    ring: the first pair's (``pairs[i]``: A's descriptor, the weights' (one, or gate and up),
    their rows an expert), then with ``TWO_PAIRS`` the second's. A slot is refilled once both
    consumers released it ("free"); its "ready" barrier completes when all of the step's TMA
    bytes have landed. A wide tile (``COLS`` 256) loads its weight rows as two 128-row boxes.
    With ``WAIT_ROWS`` (rows a counter) the A rows arrive while the kernel runs: before a
    tile's first load it waits until the counter of its rows (``_wait_rows``) is complete."""
    B_STEP: gl.constexpr = TILE_COLS if COLS == 2 * TILE_COLS else 0
    walk, num_tiles = _tile_walk(sched, N, BLOCK_TILES, COLS)
    k_steps = gl.cdiv(K, BK)
    it = 0
    n = 0  # tiles loaded so far
    for tile in range(gl.program_id(0), num_tiles, NUM_PROGS):
        expert, row, col = _tile_origin(tile, walk, BLOCK_TILES, COLS, GROUP_M)
        if WAIT_ROWS > 0:
            _wait_rows(arrivals, row // WAIT_ROWS)
        a_desc, b_descs, w_rows = pairs[0]
        b_row = expert * w_rows + col
        it = _load_steps(a_desc, b_descs, ring, row, b_row, 0, k_steps, it, B_STEP)
        if TWO_PAIRS:
            a_desc, b_descs, w_rows = pairs[1]
            b_row = expert * w_rows + col
            it = _load_steps(a_desc, b_descs, ring, row, b_row, 0, k_steps, it, B_STEP)
        if HAS_GU:
            _load_gu(gu, row, col, n)
            n += 1


@gluon.jit
def _wait_rows(arrivals, m):
    """Wait until counter ``m`` of ``arrivals`` (its pointer, the count that completes it and
    the watchdog's (error record, rank, budget)) is complete, then order this warp's later
    TMA loads after the acquire. A wait that gives up has recorded the stall; the loads go on
    (the host raises ``StallError`` at its next check)."""
    counters, wanted, watch = arrivals
    err_ptr, rank, budget = watch
    comm.wait_flag(counters + m, wanted, budget, err_ptr, _STAGE_ROWS, m, rank, rank, "gpu")
    comm.acquire_for_tma(True)


@gluon.jit
def _load_gu(gu, row, col, n):
    """The saved g and u of the CTA's ``n``-th tile (at row, col) into each consumer's staging
    tiles of d_g and d_u, once that consumer has stored its previous tile from them (``gu``:
    g's and u's descriptors, the "ready" and "free" barriers a consumer, the staging tiles)."""
    g_desc, u_desc, ready, free, bufs = gu
    for half in gl.static_range(2):
        mbarrier.wait(free.index(half), (n & 1) ^ 1)
        bar = ready.index(half)
        mbarrier.expect(bar, 2 * g_desc.block_type.nbytes)
        at = [row + half * HALF_ROWS, col]
        tma.async_copy_global_to_shared(g_desc, at, bar, bufs[0].index(half))
        tma.async_copy_global_to_shared(u_desc, at, bar, bufs[1].index(half))


@gluon.jit
def _step_scales(scales, expert, rows, cols, kb):
    """Step ``kb``'s scales of the consumer's rows: a_scale[row, kb] (0 past M) and, for each
    weight scale pointer i of ``scales[1]`` (one; gate's and up's; or one twice for a wide
    tile, all with one set of strides), the scale of the 128-column block of column
    ``cols[i]``, b_scale[expert, cols[i] // 128, kb]. Columns past N (clipped by the store)
    read the expert's last scale block. b_scale is loaded per row, masked as a_scale: a
    scalar (or a row vector ptxas can prove uniform) would live in a uniform register, and
    ptxas waits for the load where it moves it there, before the next wgmma."""
    a_s_ptr, b_s_ptrs, M, N, s_am, s_ak, s_be, s_bn, s_bk = scales
    live = rows < M
    sa = gl.load(a_s_ptr + rows * s_am + kb * s_ak, mask=live, other=0.0)
    last = gl.cdiv(N, TILE_COLS) - 1
    at = expert * s_be + kb * s_bk + rows * 0
    sb = gl.load(b_s_ptrs[0] + at + gl.minimum(cols[0] // TILE_COLS, last) * s_bn, mask=live)
    if len(b_s_ptrs) == 2:
        at1 = at + gl.minimum(cols[1] // TILE_COLS, last) * s_bn
        return sa, sb, gl.load(b_s_ptrs[1] + at1, mask=live)
    else:
        return sa, sb


@gluon.jit
def _wgrad_step_scales(scales, rows, kb):
    """Step ``kb``'s scales of a weight-gradient tile: the 128x1 scales of A^T's rows
    (a_scale[row, kb], 0 past M), and the ring's buffers of its columns' (B^T's rows') scales,
    which the producer loads with the step's tiles (``scales``: A^T's scale pointer, M, which a
    tile without steps sets to 0, its stride along the rows, the column-scale buffers)."""
    a_s_ptr, M, s_ak, col_scales = scales
    return gl.load(a_s_ptr + kb * s_ak + rows, mask=rows < M, other=0.0), col_scales


@gluon.jit
def _scales_at(scales, at, kb, KIND: gl.constexpr):
    """Step ``kb``'s scales: ``_wgrad_step_scales(scales, at, kb)`` for the weight gradient
    (``KIND`` WGRAD or WIDE_WGRAD; at = its rows), else ``_step_scales(scales, *at, kb)`` (at =
    (expert, rows, cols))."""
    if KIND == WGRAD or KIND == WIDE_WGRAD:
        return _wgrad_step_scales(scales, at, kb)
    else:
        expert, rows, cols = at
        return _step_scales(scales, expert, rows, cols, kb)


@gluon.jit
def _k_step(acc, d, scale, ring, it, HALF: gl.constexpr, KIND: gl.constexpr):
    """One K step of a consumer: wait for ring step ``it``, its wgmma into the partial
    accumulator ``d`` (from zero: ``d``'s values are ignored, its registers reused), the wait,
    the slot's release, then ``fp8_gemm.fp8_mma``'s promotion (``KIND``): MM by a row
    vector's product (a_scale * w_scale); GATE_UP the same for each of the slot's two 64-row
    B boxes into its own (acc, d) (both tuples: gate, up); WGRAD by the rows' and then the
    columns' scales, the latter read from the slot while the wgmma runs; WIDE_WGRAD WGRAD's
    for the slot's four 64-column blocks of B^T rows (a 256-column tile) into four
    accumulators (a tuple), each block's wgmma into ``d`` (64 columns) once the previous
    block's product is promoted, its column scales read after its wait; WIDE_MM MM's for the
    slot's two 128-row B boxes (a 256-column tile) into two accumulators (both tuples), the
    second box's wgmma into ``d`` once the first one's product is promoted (two partial
    accumulators and two full ones would not fit). Returns (acc, d)."""
    a_bufs, b_bufs, ready, free, STAGES = ring
    CONSUMERS: gl.constexpr = a_bufs.shape[0] // ready.shape[0]  # (64-row A tiles a slot)
    slot = it % STAGES
    mbarrier.wait(ready.index(slot), (it // STAGES) & 1)
    a = a_bufs.index(CONSUMERS * slot + HALF)
    if KIND == GATE_UP:
        b = b_bufs.index(slot)
        bg = b.slice(0, GATE_UP_COLS).permute((1, 0))  # [64 N, 128 K] viewed K-major
        bu = b.slice(GATE_UP_COLS, GATE_UP_COLS).permute((1, 0))
        dg, du = d
        dg = warpgroup_mma(a, bg, dg, use_acc=False, is_async=True)
        du = warpgroup_mma(a, bu, du, use_acc=False, is_async=True)
        dg, du = warpgroup_mma_wait(num_outstanding=0, deps=(dg, du))
        mbarrier.arrive(free.index(slot), count=1)
        acc_g, acc_u = acc
        sa, sg, su = scale
        return (acc_g + dg * (sa * sg)[:, None], acc_u + du * (sa * su)[:, None]), (dg, du)
    elif KIND == WIDE_MM:
        b = b_bufs.index(slot)
        acc0, acc1 = acc
        sa, s0, s1 = scale
        d = warpgroup_mma(a, b.slice(0, TILE_COLS).permute((1, 0)), d, use_acc=False,
                          is_async=True)  # fmt: skip
        d = warpgroup_mma_wait(num_outstanding=0, deps=(d,))
        acc0 = acc0 + d * (sa * s0)[:, None]
        # A wait with no wgmma outstanding that passes acc0 and d: the next wgmma (which takes
        # d) then follows acc0's promotion (and below, the next step's follows acc1's).
        # Without it LLVM moves a promotion below the wgmma and keeps a copy of d (64 more
        # registers a thread: spills).
        acc0, d = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, d))
        d = warpgroup_mma(a, b.slice(TILE_COLS, TILE_COLS).permute((1, 0)), d, use_acc=False,
                          is_async=True)  # fmt: skip
        d = warpgroup_mma_wait(num_outstanding=0, deps=(d,))
        mbarrier.arrive(free.index(slot), count=1)
        acc1, d = warpgroup_mma_wait(num_outstanding=0, deps=(acc1 + d * (sa * s1)[:, None], d))
        return (acc0, acc1), d
    elif KIND == WIDE_WGRAD:
        b = b_bufs.index(slot)
        CHUNKS: gl.constexpr = b.shape[0] // GATE_UP_COLS
        sa, col_scales = scale
        s_slot = col_scales.index(slot)  # [1, 64 * CHUNKS]
        accs = ()
        for c in gl.static_range(CHUNKS):
            bc = b.slice(c * GATE_UP_COLS, GATE_UP_COLS).permute((1, 0))
            d = warpgroup_mma(a, bc, d, use_acc=False, is_async=True)
            d = warpgroup_mma_wait(num_outstanding=0, deps=(d,))
            # (read after the wait: read before it, the block's column scales were live across
            # the wgmma, and ptxas spilled)
            sb = s_slot.slice(c * GATE_UP_COLS, GATE_UP_COLS, dim=1).load(GATE_UP_LAYOUT)
            if c == CHUNKS - 1:
                fence_async_shared()  # (as WGRAD's)
                mbarrier.arrive(free.index(slot), count=1)
            # (the wait ties the promotion before the next chunk's wgmma, as WIDE_MM's)
            acc_c, d = warpgroup_mma_wait(
                num_outstanding=0, deps=(acc[c] + d * sa[:, None] * sb, d)
            )
            accs = accs + (acc_c,)
        return accs, d
    else:
        b = b_bufs.index(slot).permute((1, 0))  # [128 N, 128 K] viewed K-major
        d = warpgroup_mma(a, b, d, use_acc=False, is_async=True)
        sa, sb = scale
        if KIND == WGRAD:  # the step's column scales from the slot (zeros past N)
            sb = sb.index(slot).load(ACC_LAYOUT)  # [1, 128]
        d = warpgroup_mma_wait(num_outstanding=0, deps=(d,))
        if KIND == WGRAD:
            # The column scales were read through the generic proxy; the producer's next TMA
            # into the slot writes through the async one. Without this fence, a GPU run of 3
            # stages got 0-160 elements a run from overwritten scales.
            fence_async_shared()
        # Both wgmma groups have read the slot: hand it back (the compiler syncs the warpgroup
        # before its one-thread arrive).
        mbarrier.arrive(free.index(slot), count=1)
        if KIND == WGRAD:
            return acc + d * sa[:, None] * sb, d
        else:
            return acc + d * (sa * sb)[:, None], d


@gluon.jit
def _pass(acc, d, scales, ring, it, at, k0, k_steps, HALF: gl.constexpr, KIND: gl.constexpr):
    """``k_steps`` K steps of a tile (``scales``: its scales' pointers, sizes and strides; the
    steps' scale blocks from ``k0`` on; ``at``: where ``_scales_at`` reads), from ring step
    ``it`` on. The scales of step k + 1 are loaded during step k into two register sets by step
    parity (the loop is unrolled by two). Returns (acc, d, the next ring step)."""
    last = k0 + gl.maximum(k_steps - 1, 0)
    scale0 = _scales_at(scales, at, k0, KIND)
    for kb in range(k0, k0 + k_steps - 1, 2):
        scale1 = _scales_at(scales, at, kb + 1, KIND)
        acc, d = _k_step(acc, d, scale0, ring, it, HALF, KIND)
        scale0 = _scales_at(scales, at, gl.minimum(kb + 2, last), KIND)
        acc, d = _k_step(acc, d, scale1, ring, it + 1, HALF, KIND)
        it += 2
    if k_steps % 2:
        acc, d = _k_step(acc, d, scale0, ring, it, HALF, KIND)
        it += 1
    return acc, d, it


@gluon.jit
def _store_tiles(descs, bufs, accs, coords):
    """The epilogue: each fp32 tile of ``accs`` in its output's dtype through this warpgroup's
    staging tile of that output (``descs[i]``, ``bufs[i]``), one TMA store each at
    ``coords[i]`` (clipped at the tensor's edges), once the previous tile's stores have read
    the staging tiles."""
    tma.store_wait(pendings=0)
    for i in gl.static_range(len(descs)):
        if len(descs[i].block_type.shape) == 3:  # a [1, 64, 128] box of an [E, M, N] output
            bufs[i].reshape(accs[i].shape).store(accs[i].to(descs[i].dtype))
        else:
            bufs[i].store(accs[i].to(descs[i].dtype))
    fence_async_shared()
    for i in gl.static_range(len(descs)):
        tma.async_copy_shared_to_global(descs[i], coords[i], bufs[i])


@gluon.jit
def _swiglu_backward(dh, bufs, ready, n):
    """(d_g, d_u) of h = silu(g) * u from d_h (``dh``, fp32) and the saved g and u of the
    CTA's ``n``-th tile, which the producer loaded into this consumer's staging tiles
    (``bufs``; ``ready`` its barrier; zeros past the tensors' edges), by
    ``tiles.swiglu_backward`` (the Triton kernel's device function: the same bits). Each
    thread reads the elements it then writes (one layout)."""
    mbarrier.wait(ready, n & 1)
    g = bufs[0].load(ACC_LAYOUT).to(gl.float32)
    u = bufs[1].load(ACC_LAYOUT).to(gl.float32)
    return tiles.swiglu_backward(dh, g, u)


@gluon.jit
def _consumer(
    c_descs, c_bufs, ring, scales, sched, N, K, gu, quant, stored, HALF: gl.constexpr,
    TWO_PAIRS: gl.constexpr, SWIGLU_BWD: gl.constexpr, COLS: gl.constexpr,
    BLOCK_TILES: gl.constexpr, NUM_PROGS: gl.constexpr, GROUP_M: gl.constexpr,
    QUANT: gl.constexpr, STORED_ROWS: gl.constexpr,
):  # fmt: skip
    """One warpgroup: rows ``HALF * 64`` to ``HALF * 64 + 63`` of every tile of this CTA, the
    first pair's K steps and then, with ``TWO_PAIRS``, the second's into one accumulator (the
    Triton kernel's order). ``scales[i]``: pair i's scale pointers, M, N and the strides.
    ``c_descs``: the output (twice for a wide tile, ``COLS`` 256: one accumulator and staging
    tile per 128 columns), or with ``SWIGLU_BWD`` (``gu``: the barriers of the saved g and u,
    ``_swiglu_backward``'s) the accumulator is d_h and the outputs are d_g and d_u, which with
    ``QUANT`` are stored quantized (``_store_quantized``, ``quant``: d_g's and d_u's), not in
    bf16; ``c_bufs``: their staging tiles. With ``STORED_ROWS`` (not with ``SWIGLU_BWD``) each
    tile's stores are counted once done (``_count_stored``; ``stored``: the counters), at the
    next tile's epilogue (a tile's K loop later: no wait) and after the last tile."""
    KIND: gl.constexpr = WIDE_MM if COLS == 2 * TILE_COLS else MM
    row_layout: gl.constexpr = gl.SliceLayout(1, ACC_LAYOUT)
    bufs = (c_bufs[0].index(HALF),)
    if len(c_descs) == 2:
        bufs = (c_bufs[0].index(HALF), c_bufs[1].index(HALF))
    walk, num_tiles = _tile_walk(sched, N, BLOCK_TILES, COLS)
    k_steps = gl.cdiv(K, BK)
    zero = gl.zeros([HALF_ROWS, TILE_COLS], gl.float32, ACC_LAYOUT)
    d = zero
    it = 0  # ring steps consumed so far (the producer counts the same)
    n = 0  # tiles done so far
    stored_row = 0  # the row of the tile whose stores are not counted yet (STORED_ROWS)
    for tile in range(gl.program_id(0), num_tiles, NUM_PROGS):
        expert, row, col = _tile_origin(tile, walk, BLOCK_TILES, COLS, GROUP_M)
        row += HALF * HALF_ROWS
        rows = row + gl.arange(0, HALF_ROWS, layout=row_layout)
        if KIND == WIDE_MM:
            at = (expert, rows, (col, col + TILE_COLS))
            acc = (zero, zero)
        else:
            at = (expert, rows, (col,))
            acc = zero
        acc, d, it = _pass(acc, d, scales[0], ring, it, at, 0, k_steps, HALF, KIND)
        if TWO_PAIRS:
            acc, d, it = _pass(acc, d, scales[1], ring, it, at, 0, k_steps, HALF, KIND)
        if SWIGLU_BWD:
            ready, free = gu
            dg_du = _swiglu_backward(acc, bufs, ready.index(HALF), n)
            if QUANT:
                # each goes through its staging tile in bf16 (what is quantized), then is
                # quantized from there (d_u's through its tile while d_g's stores run): with
                # both or the SwiGLU backward's values in registers, the quantization spilled
                M = scales[0][2]
                dg, du = dg_du
                bufs[0].store(dg.to(gl.bfloat16))
                bufs[1].store(du.to(gl.bfloat16))
                dg = bufs[0].load(ACC_LAYOUT).to(gl.float32)
                _store_quantized(dg, quant[0], _fp8_staging(bufs[0], quant[0]), row, col, M, N,
                                 n, HALF, 0, 0)  # fmt: skip
                du = bufs[1].load(ACC_LAYOUT).to(gl.float32)
                _store_quantized(du, quant[1], _fp8_staging(bufs[1], quant[1]), row, col, M, N,
                                 n, HALF, 1, 2)  # fmt: skip
            else:
                _store_tiles(c_descs, bufs, dg_du, ([row, col], [row, col]))
            # the producer may load the next tile's g and u once the stores have read these
            tma.store_wait(pendings=0)
            mbarrier.arrive(free.index(HALF), count=1)
        else:
            if STORED_ROWS > 0 and n > 0:
                _count_stored(stored, stored_row, STORED_ROWS)
            if KIND == WIDE_MM:
                _store_tiles(c_descs, bufs, acc, ([row, col], [row, col + TILE_COLS]))
            else:
                _store_tiles(c_descs, bufs, (acc,), ([row, col],))
            stored_row = row
        n += 1
    tma.store_wait(pendings=0)
    if STORED_ROWS > 0 and n > 0:
        _count_stored(stored, stored_row, STORED_ROWS)


@gluon.jit
def _count_stored(counters, row, ROWS: gl.constexpr):
    """Count this warpgroup's last tile (at ``row``) into ``counters[row // ROWS]`` once its
    TMA stores are done and visible (``comm.publish_writes``, then a release): another kernel
    reads the rows meanwhile (``StoredTiles``)."""
    comm.publish_writes(True)
    comm.signal(counters + row // ROWS)


@gluon.jit
def _store_quantized(x, quant, bufs, row, col, M, N, n, HALF: gl.constexpr, T: gl.constexpr,
                     PENDING: gl.constexpr):  # fmt: skip
    """This consumer's [64, 128] of an fp32 output tile ``x`` quantized as ``fp8.
    quantize_rows_cols`` quantizes the output stored in bf16 (the same bits; the bf16 tile
    itself is not stored): 1x128 (a row's 128 columns are one scale block) and 128x1 into the
    packed rows of x^T (the tile's 128 rows are one scale block: each consumer's column maxima
    go through ``xch``, double-buffered by the tile's parity ``n``, once both have arrived on
    ``xbar``; ``T``: which of the kernel's quantized outputs, each its own slots). ``quant``:
    the 1x128 and x^T descriptors, the row scales [M, N / 128] (rows contiguous), x^T's scales
    (``s_tk`` apart a column), ``xch`` and ``xbar``. ``bufs``: staging tiles of the two fp8
    tiles (8 KB each), which the stores that held at most ``PENDING`` TMA store groups ago
    have read."""
    q_desc, qt_desc, s_ptr, st_ptr, s_tk, xch, xbar = quant
    layout: gl.constexpr = x.type.layout
    cols = col + gl.arange(0, TILE_COLS, layout=gl.SliceLayout(0, layout))
    # the values the pass reads of the stored bf16 output; 0 past N (there the B boxes held
    # the next expert's weight rows, whose products the stores would clip)
    x = gl.where((cols < N)[None, :], x.to(gl.bfloat16).to(gl.float32), 0.0)
    q, s = fp8.row_blocks(x, False)
    partial = fp8.block_amax(x, 0)
    p = n & 1
    xch.index(4 * T + 2 * p + HALF).store(partial)
    mbarrier.arrive(xbar.index(2 * T + p), count=1)
    mbarrier.wait(xbar.index(2 * T + p), (n >> 1) & 1)
    other = xch.index(4 * T + 2 * p + 1 - HALF).load(partial.type.layout)
    q_t, s_t = fp8.col_blocks_of(x, gl.maximum(partial, other), False)
    rows = row + gl.arange(0, HALF_ROWS, layout=gl.SliceLayout(1, layout))
    gl.store(s_ptr + (col // BK) * M + rows, s, mask=rows < M)
    if HALF == 0:  # (both hold the block's column scales)
        gl.store(st_ptr + cols * s_tk + row // BK, s_t, mask=cols < N)
    tma.store_wait(pendings=PENDING)
    bufs[0].store(q)
    bufs[1].store(q_t)
    fence_async_shared()
    tma.async_copy_shared_to_global(q_desc, [row, col], bufs[0])
    tma.async_copy_shared_to_global(qt_desc, [col, row], bufs[1])


@gluon.jit
def _fp8_staging(buf, quant):
    """A 16 KB bf16 staging tile ([64, 128]) as the two 8 KB fp8 tiles of
    ``_store_quantized`` (``quant``'s descriptors' layouts): 1x128 rows, then the x^T rows."""
    q_desc, qt_desc = quant[0], quant[1]
    shape: gl.constexpr = [2, HALF_ROWS, TILE_COLS]
    shape_t: gl.constexpr = [2, TILE_COLS, HALF_ROWS]
    q_buf = buf._reinterpret(gl.float8e4nv, shape, q_desc.layout).index(0)
    return q_buf, buf._reinterpret(gl.float8e4nv, shape_t, qt_desc.layout).index(1)


@gluon.jit
def _gate_up_consumer(
    out_descs, c_bufs, ring, scales, sched, N, K, h_quant, HALF: gl.constexpr,
    COLS: gl.constexpr, BLOCK_TILES: gl.constexpr, NUM_PROGS: gl.constexpr,
    GROUP_M: gl.constexpr, QUANT_H: gl.constexpr,
):  # fmt: skip
    """One warpgroup: rows ``HALF * 64`` to ``HALF * 64 + 63`` of every gate/up tile of this
    CTA (``COLS`` columns of g and of u from the slot's two B boxes: 64, each into its own
    partial accumulator, or 128 as a wide tile's two blocks, WIDE_MM), and their SwiGLU
    epilogue. ``out_descs``: g's, u's and h's descriptors; ``c_bufs`` the staging tiles (two
    each) of all three, or of a wide tile's g and u (h goes through g's once g's store has
    read it); ``scales``: the scale pointers (A's, then gate's and up's), M, N and the
    strides. With ``QUANT_H`` (wide tiles) h is stored quantized (``_store_quantized``,
    ``h_quant``), not in bf16."""
    WIDE: gl.constexpr = COLS == TILE_COLS
    M = scales[2]
    layout: gl.constexpr = ACC_LAYOUT if WIDE else GATE_UP_LAYOUT
    bufs = (c_bufs[0].index(HALF), c_bufs[1].index(HALF))
    if not WIDE:
        bufs = bufs + (c_bufs[2].index(HALF),)
    walk, num_tiles = _tile_walk(sched, N, BLOCK_TILES, COLS)
    k_steps = gl.cdiv(K, BK)
    zero = gl.zeros([HALF_ROWS, COLS], gl.float32, layout)
    d = zero if WIDE else (zero, zero)
    it = 0  # ring steps consumed so far (the producer counts the same)
    n = 0  # tiles done so far
    for tile in range(gl.program_id(0), num_tiles, NUM_PROGS):
        expert, row, col = _tile_origin(tile, walk, BLOCK_TILES, COLS, GROUP_M)
        row += HALF * HALF_ROWS
        at = (expert, row + gl.arange(0, HALF_ROWS, layout=gl.SliceLayout(1, layout)), (col, col))
        KIND: gl.constexpr = WIDE_MM if WIDE else GATE_UP
        accs, d, it = _pass((zero, zero), d, scales, ring, it, at, 0, k_steps, HALF, KIND)
        acc_g, acc_u = accs
        coord = [row, col]
        h = tiles.swiglu(acc_g, acc_u)
        if WIDE:
            g_u = (out_descs[0], out_descs[1])
            _store_tiles(g_u, bufs, (acc_g, acc_u), (coord, coord))
            if QUANT_H:
                # (in g's staging tile once g's store has read it; u's may be pending)
                staging = _fp8_staging(bufs[0], h_quant)
                _store_quantized(h, h_quant, staging, row, col, M, N, n, HALF, 0, 1)
            else:
                _store_tiles((out_descs[2],), (bufs[0],), (h,), (coord,))
        else:
            _store_tiles(out_descs, bufs, (acc_g, acc_u, h), (coord, coord, coord))
        n += 1
    tma.store_wait(pendings=0)


@gluon.jit
def _wgrad_tile(tile, row_start_ptr, M, N, COLS: gl.constexpr, ROWS: gl.constexpr):
    """(expert, first row, first column, first K row, K steps) of weight-gradient tile
    ``tile`` (``ROWS`` x ``COLS``): the experts' tiles in order, each expert's column-fast
    (``tiles.tile_of``); its K rows are the expert's rows, 128 a step."""
    tiles_n = gl.cdiv(N, COLS)
    tiles_per_expert = gl.cdiv(M, ROWS) * tiles_n
    expert = tile // tiles_per_expert
    t = tile % tiles_per_expert
    r0 = gl.load(row_start_ptr + expert)
    steps = gl.cdiv(gl.load(row_start_ptr + expert + 1) - r0, BK)
    return expert, (t // tiles_n) * ROWS, (t % tiles_n) * COLS, r0, steps


@gluon.jit
def _wgrad_producer(at_desc, bt_descs, col_scales, ring, row_start_ptr, E, M, N,
                    NUM_PROGS: gl.constexpr, COLS: gl.constexpr):  # fmt: skip
    """One warp: every K step of every weight-gradient tile of this CTA into the ring (the
    A^T rows of the tile's consumers, 64 each, the B^T rows of its columns, one 128-row box
    each of ``bt_descs``, and their 128x1 scales (``col_scales``: descriptor, buffers), at the
    expert's rows)."""
    ROWS: gl.constexpr = ring[0].shape[0] // ring[2].shape[0] * HALF_ROWS  # (consumers)
    tiles = E * gl.cdiv(M, ROWS) * gl.cdiv(N, COLS)
    it = 0
    for tile in range(gl.program_id(0), tiles, NUM_PROGS):
        expert, row, col, r0, steps = _wgrad_tile(tile, row_start_ptr, M, N, COLS, ROWS)
        it = _load_steps(at_desc, bt_descs, ring, row, col, r0, steps, it, TILE_COLS,
                         col_scales)  # fmt: skip


@gluon.jit
def _wgrad_consumer(c_descs, c_bufs, ring, scales, row_start_ptr, E, HALF: gl.constexpr,
                    NUM_PROGS: gl.constexpr, COLS: gl.constexpr):  # fmt: skip
    """One warpgroup: rows ``HALF * 64`` to ``HALF * 64 + 63`` of every weight-gradient tile of
    this CTA (``COLS`` columns: with two consumers 128 in one block, WGRAD, or 256 as four
    64-column blocks, WIDE_WGRAD; with three 128 as two 64-column blocks), the expert's rows
    in order (``fp8_gemm.fp8_wgrad_tile``'s sums). A tile of an expert without rows stores
    zeros. ``c_descs``: the output (once a block), ``c_bufs`` the staging tiles (one a
    block); ``scales``: A^T's scale pointer, M, N, its stride along the rows, and the ring's
    column-scale buffers."""
    ROWS: gl.constexpr = ring[0].shape[0] // ring[2].shape[0] * HALF_ROWS  # (consumers)
    CHUNKS: gl.constexpr = len(c_bufs)
    WIDE: gl.constexpr = CHUNKS > 1
    layout: gl.constexpr = GATE_UP_LAYOUT if WIDE else ACC_LAYOUT
    a_s_ptr, M, N, s_ak, col_scales = scales
    bufs = ()
    for c in gl.static_range(CHUNKS):
        bufs = bufs + (c_bufs[c].index(HALF),)
    tiles = E * gl.cdiv(M, ROWS) * gl.cdiv(N, COLS)
    zero = gl.zeros([HALF_ROWS, COLS // CHUNKS], gl.float32, layout)  # a block's columns
    d = zero
    it = 0
    for tile in range(gl.program_id(0), tiles, NUM_PROGS):
        expert, row, col, r0, steps = _wgrad_tile(tile, row_start_ptr, M, N, COLS, ROWS)
        row += HALF * HALF_ROWS
        rows = row + gl.arange(0, HALF_ROWS, layout=gl.SliceLayout(1, layout))
        # a tile without steps reads no scale (its block index would be past the rows)
        tile_scales = (a_s_ptr, gl.where(steps > 0, M, 0), s_ak, col_scales)
        if WIDE:
            zeros = ()
            coords = ()
            for c in gl.static_range(CHUNKS):
                zeros = zeros + (zero,)
                coords = coords + ([expert, row, col + c * GATE_UP_COLS],)
            accs, d, it = _pass(zeros, d, tile_scales, ring, it, rows, r0 // BK, steps, HALF,
                                WIDE_WGRAD)  # fmt: skip
            _store_tiles(c_descs, bufs, accs, coords)
        else:
            acc, d, it = _pass(zero, d, tile_scales, ring, it, rows, r0 // BK, steps, HALF, WGRAD)
            _store_tiles(c_descs, bufs, (acc,), ([expert, row, col],))
    tma.store_wait(pendings=0)


@gluon.jit
def _exchange(OUTPUTS: gl.constexpr):
    """The shared memory through which the two consumers exchange the column maxima of each
    of ``OUTPUTS`` quantized outputs (``_store_quantized``): [4 * OUTPUTS, 128] fp32 (by
    output, tile parity and consumer), and their barriers [2 * OUTPUTS] (by output and tile
    parity; two arrivals each, one per consumer)."""
    xch = gl.allocate_shared_memory(
        gl.float32, [4 * OUTPUTS, TILE_COLS], gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    )
    xbar = gl.allocate_shared_memory(gl.int64, [2 * OUTPUTS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2 * OUTPUTS):
        mbarrier.init(xbar.index(i), count=2)
    fence_async_shared()
    return xch, xbar


@gluon.jit
def _staging(c_desc, CONSUMERS: gl.constexpr = 2):
    """The consumers' staging tiles of one output."""
    shape: gl.constexpr = [CONSUMERS] + c_desc.block_type.shape
    return gl.allocate_shared_memory(c_desc.dtype, shape, c_desc.layout)


@gluon.jit
def _shared_ring(a_desc, b_desc, c_desc, STAGES: gl.constexpr, B_ROWS: gl.constexpr = TILE_COLS,
                 CONSUMERS: gl.constexpr = 2):  # fmt: skip
    """The ring's shared memory (per slot: a 64-row A tile per consumer, one B tile of
    ``B_ROWS`` rows, 128 (gate/up fills it with two 64-row boxes) or a wide tile's 256, a
    "ready" and a "free" barrier), initialized, and the consumers' staging tiles of the output
    ``c_desc``. The ring: (A tiles, B tiles, ready, free, STAGES)."""
    a_bufs = gl.allocate_shared_memory(
        a_desc.dtype, [CONSUMERS * STAGES] + a_desc.block_type.shape, a_desc.layout
    )
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, B_ROWS, BK], b_desc.layout)
    c_bufs = _staging(c_desc, CONSUMERS)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)  # the producer's expect; TMA adds the bytes
        mbarrier.init(free.index(i), count=CONSUMERS)  # one arrival per consumer warpgroup
    fence_async_shared()
    return (a_bufs, b_bufs, ready, free, STAGES), c_bufs


# Not specialized: an int argument equal to 1 (a unit stride) would become a plain Python int,
# which cannot be handed to a worker partition.
@gluon.jit(
    do_not_specialize=[
        "M", "N", "K", "w_rows", "w2_rows", "s_am", "s_ak", "s_be", "s_bn", "s_bk", "s_tk"
    ]
)  # fmt: skip
def _ws_grouped_mm_kernel(
    a_desc, a_s_ptr, b_desc, b_s_ptr, w_rows,  # the first (A, W) pair and their scales
    a2_desc, a2_s_ptr, b2_desc, b2_s_ptr, w2_rows,  # the second (TWO_PAIRS), scales alike
    c_desc, c2_desc,  # the output; with SWIGLU_BWD d_g and d_u
    g_desc, u_desc,  # SWIGLU_BWD: the saved g and u
    # QUANT: d_g's and d_u's quantizations: their 1x128 and x^T descriptors (a launch takes
    # no descriptor inside a tuple), (d_g's row scales, d_g^T's, d_u's, d_u^T's), and the
    # x^T scales' stride along the columns
    dgq_desc, dgqt_desc, duq_desc, duqt_desc, dgdu_scales, s_tk,
    block_expert_ptr, num_blocks_ptr,  # the row schedule
    stored_ptr,  # STORED_ROWS: the counters of stored tiles (StoredTiles)
    M, N, K,
    s_am, s_ak, s_be, s_bn, s_bk,  # the scales' strides
    TWO_PAIRS: gl.constexpr, SWIGLU_BWD: gl.constexpr, STAGES: gl.constexpr,
    COLS: gl.constexpr,  # the tile's columns: 128, or 256 (wide: two 128-column blocks)
    BLOCK_TILES: gl.constexpr, NUM_PROGS: gl.constexpr, GROUP_M: gl.constexpr,
    QUANT: gl.constexpr,  # SWIGLU_BWD: d_g and d_u quantized in the epilogue, not stored
    STORED_ROWS: gl.constexpr,  # rows a counter of stored tiles; 0: none counted
):  # fmt: skip
    ring, c_bufs = _shared_ring(a_desc, b_desc, c_desc, STAGES, COLS)
    gu_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    gu_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(gu_ready.index(i), count=1)  # the producer's expect; TMA adds the bytes
        mbarrier.init(gu_free.index(i), count=1)  # the consumer, after its stores
    fence_async_shared()
    if QUANT:
        xch, xbar = _exchange(2)  # (d_g's and d_u's)
        dg_s, dg_st, du_s, du_st = dgdu_scales
        quant = (
            (dgq_desc, dgqt_desc, dg_s, dg_st, s_tk, xch, xbar),
            (duq_desc, duqt_desc, du_s, du_st, s_tk, xch, xbar),
        )
    else:  # (None there: placeholders, never read; a worker partition takes no None)
        unused = (g_desc, g_desc, a_s_ptr, a_s_ptr, s_tk, gu_ready, gu_free)
        quant = (unused, unused)
    gu = (gu_ready, gu_free)
    if SWIGLU_BWD:
        c_descs = (c_desc, c2_desc)
        c_bufs = (c_bufs, _staging(c2_desc))
    elif COLS == 2 * TILE_COLS:
        c_descs = (c_desc, c_desc)
        c_bufs = (c_bufs, _staging(c_desc))
    else:
        c_descs = (c_desc,)
        c_bufs = (c_bufs, c_bufs)
    # (a worker partition takes no None: without SWIGLU_BWD the producer ignores these)
    producer_gu = (g_desc, u_desc, gu_ready, gu_free, c_bufs)
    strides = (s_am, s_ak, s_be, s_bn, s_bk)
    if COLS == 2 * TILE_COLS:  # each weight's two 128-row boxes and scale blocks
        b_descs, b2_descs = (b_desc, b_desc), (b2_desc, b2_desc)
        b_scales, b2_scales = (b_s_ptr, b_s_ptr), (b2_s_ptr, b2_s_ptr)
    else:
        b_descs, b2_descs = (b_desc,), (b2_desc,)
        b_scales, b2_scales = (b_s_ptr,), (b2_s_ptr,)
    scales = ((a_s_ptr, b_scales, M, N) + strides, (a2_s_ptr, b2_scales, M, N) + strides)
    pairs = ((a_desc, b_descs, w_rows), (a2_desc, b2_descs, w2_rows))
    sched = (block_expert_ptr, num_blocks_ptr)
    gl.warp_specialize(
        [
            (_consumer, (c_descs, c_bufs, ring, scales, sched, N, K, gu, quant, stored_ptr, 0,
                         TWO_PAIRS, SWIGLU_BWD, COLS, BLOCK_TILES, NUM_PROGS, GROUP_M, QUANT,
                         STORED_ROWS)),
            (_consumer, (c_descs, c_bufs, ring, scales, sched, N, K, gu, quant, stored_ptr, 1,
                         TWO_PAIRS, SWIGLU_BWD, COLS, BLOCK_TILES, NUM_PROGS, GROUP_M, QUANT,
                         STORED_ROWS)),
            (_producer, (pairs, ring, sched, N, K, TWO_PAIRS, BLOCK_TILES, NUM_PROGS, COLS,
                         GROUP_M, SWIGLU_BWD, producer_gu)),
        ],
        [4, 1],
        [CONSUMER_REGS, PRODUCER_REGS],
    )  # fmt: skip


@gluon.jit(
    do_not_specialize=[
        "M", "N", "K", "w_rows", "s_am", "s_ak", "s_be", "s_bn", "s_bk", "s_tk",
        "rows_wanted", "rank", "budget",
    ]
)  # fmt: skip
def _ws_gate_up_kernel(
    a_desc, a_s_ptr,  # the rows and their 1x128 scales
    bg_desc, bg_s_ptr, bu_desc, bu_s_ptr, w_rows,  # gate's and up's 2-D views and scales
    g_desc, u_desc, h_desc,
    # QUANT_H: h's quantizations: its 1x128 and h^T descriptors, (its row scales, h^T's
    # scales), the latter's stride along the columns
    hq_desc, hqt_desc, h_scales, s_tk,
    block_expert_ptr, num_blocks_ptr,  # the row schedule
    # WAIT_ROWS: the rows' arrival counters, the count that completes one, and the
    # watchdog's error record, rank and budget (``RowArrivals``)
    row_counters, rows_wanted, err_ptr, rank, budget,
    M, N, K,
    s_am, s_ak, s_be, s_bn, s_bk,  # the scales' strides (gate's and up's alike)
    STAGES: gl.constexpr,
    COLS: gl.constexpr,  # the columns of each weight a tile: 64, or 128 (wide)
    BLOCK_TILES: gl.constexpr, NUM_PROGS: gl.constexpr, GROUP_M: gl.constexpr,
    QUANT_H: gl.constexpr,  # h quantized in the epilogue, not stored (wide tiles)
    WAIT_ROWS: gl.constexpr,  # rows a counter (0: the rows are all there at the launch)
):  # fmt: skip
    ring, g_bufs = _shared_ring(a_desc, bg_desc, g_desc, STAGES, 2 * COLS)
    c_bufs = (g_bufs, _staging(u_desc))
    if COLS == GATE_UP_COLS:
        c_bufs = c_bufs + (_staging(h_desc),)
    if QUANT_H:
        h_quant = (hq_desc, hqt_desc) + h_scales + (s_tk,) + _exchange(1)
    else:  # (None there: placeholders, never read; a worker partition takes no None)
        h_quant = (h_desc, h_desc, a_s_ptr, a_s_ptr, s_tk, ring[2], ring[3])
    scales = (a_s_ptr, (bg_s_ptr, bu_s_ptr), M, N, s_am, s_ak, s_be, s_bn, s_bk)
    pairs = ((a_desc, (bg_desc, bu_desc), w_rows),)
    sched = (block_expert_ptr, num_blocks_ptr)
    outs = (g_desc, u_desc, h_desc)
    arrivals = (row_counters, rows_wanted, (err_ptr, rank, budget))
    gl.warp_specialize(
        [
            (_gate_up_consumer, (outs, c_bufs, ring, scales, sched, N, K, h_quant, 0, COLS,
                                 BLOCK_TILES, NUM_PROGS, GROUP_M, QUANT_H)),
            (_gate_up_consumer, (outs, c_bufs, ring, scales, sched, N, K, h_quant, 1, COLS,
                                 BLOCK_TILES, NUM_PROGS, GROUP_M, QUANT_H)),
            (_producer, (pairs, ring, sched, N, K, False, BLOCK_TILES, NUM_PROGS, COLS,
                         GROUP_M, False, ring, WAIT_ROWS, arrivals)),
        ],
        [4, 1],
        [CONSUMER_REGS, PRODUCER_REGS],
    )  # fmt: skip


@gluon.jit(do_not_specialize=["E", "M", "N", "s_ak"])
def _ws_wgrad_kernel(
    at_desc, at_s_ptr, bt_desc,  # A^T [M, rows], its 128x1 scales; B^T [N, rows]
    bs_desc,  # B^T's 128x1 scales, feature-major [row blocks, N]: a step's 128 (wide: 256) a box
    c_desc,  # d_W [E, M, N]
    row_start_ptr,  # the experts' first rows
    E, M, N,
    s_ak,  # A^T's scales' stride along the rows (its features' is 1)
    STAGES: gl.constexpr, NUM_PROGS: gl.constexpr,
    COLS: gl.constexpr,  # the tile's columns: 128, or 256 (wide)
    CONSUMERS: gl.constexpr,  # consumer warpgroups, 64 rows each: 2, or 3 (128 columns)
):  # fmt: skip
    ring, staging = _shared_ring(at_desc, bt_desc, c_desc, STAGES, COLS, CONSUMERS)
    s_bufs = gl.allocate_shared_memory(
        bs_desc.dtype, [STAGES] + bs_desc.block_type.shape, bs_desc.layout
    )
    # the output blocks: one 128-column block, else 64-column ones (the consumers' registers)
    CHUNKS: gl.constexpr = 1 if COLS == TILE_COLS and CONSUMERS == 2 else COLS // GATE_UP_COLS
    c_descs = (c_desc,)
    c_bufs = (staging,)
    for _ in gl.static_range(CHUNKS - 1):  # each block's staging tiles
        c_descs = c_descs + (c_desc,)
        c_bufs = c_bufs + (_staging(c_desc, CONSUMERS),)
    bt_descs = (bt_desc,)  # 128-row B^T boxes
    if COLS == 2 * TILE_COLS:
        bt_descs = (bt_desc, bt_desc)
    scales = (at_s_ptr, M, N, s_ak, s_bufs)
    loads = (at_desc, bt_descs, (bs_desc, s_bufs), ring, row_start_ptr, E, M, N, NUM_PROGS, COLS)
    if CONSUMERS == 3:
        gl.warp_specialize(
            [
                (_wgrad_consumer, (c_descs, c_bufs, ring, scales, row_start_ptr, E, 0,
                                   NUM_PROGS, COLS)),
                (_wgrad_consumer, (c_descs, c_bufs, ring, scales, row_start_ptr, E, 1,
                                   NUM_PROGS, COLS)),
                (_wgrad_consumer, (c_descs, c_bufs, ring, scales, row_start_ptr, E, 2,
                                   NUM_PROGS, COLS)),
                (_wgrad_producer, loads),
            ],
            [4, 4, 1],
            [THREE_CONSUMER_REGS, THREE_CONSUMER_REGS, THREE_PRODUCER_REGS],
        )  # fmt: skip
    else:
        gl.warp_specialize(
            [
                (_wgrad_consumer, (c_descs, c_bufs, ring, scales, row_start_ptr, E, 0,
                                   NUM_PROGS, COLS)),
                (_wgrad_consumer, (c_descs, c_bufs, ring, scales, row_start_ptr, E, 1,
                                   NUM_PROGS, COLS)),
                (_wgrad_producer, loads),
            ],
            [4, 1],
            [CONSUMER_REGS, PRODUCER_REGS],
        )  # fmt: skip


def supported(device: torch.device, block_rows: int) -> bool:
    """Whether this kernel can run here: on a Hopper GPU (or in an sm_90a compile check), not
    in the interpreter, with 128-row tiles inside each row block. (``fp8_gemm`` has checked
    the operands' sizes: N % 8, K % 16.)"""
    if compiling_for_hopper():
        hopper = True
    elif interpreting() or device.type != "cuda":
        hopper = False
    else:
        hopper = device_capability(device) == (9, 0)
    return hopper and block_rows % TILE_ROWS == 0


_GL_DTYPES = {FP8: gl.float8e4nv, torch.bfloat16: gl.bfloat16, torch.float32: gl.float32}


@functools.lru_cache(maxsize=None)
def _nvmma_layout(block: tuple[int, ...], dtype: torch.dtype) -> gl.NVMMASharedLayout:
    """The swizzled shared layout wgmma reads of ``block`` boxes (made once: its construction
    cost several microseconds of host time at every launch)."""
    return gl.NVMMASharedLayout.get_default_for(list(block), _GL_DTYPES[dtype])


def _nvmma(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """A TMA descriptor of ``block`` boxes in the swizzled shared layout wgmma reads."""
    return TensorDescriptor.from_tensor(t, block, _nvmma_layout(tuple(block), t.dtype))


def _check_stages(
    stages: int, out_bytes: int, kind: str = "mm", cols: int = 128, consumers: int = 2
) -> None:
    need = smem_bytes(stages, out_bytes, kind, cols, consumers)
    if need > SMEM_BYTES:
        raise ValueError(
            f"stages = {stages} needs {need} B of shared memory with {cols}-column tiles and the "
            f"{kind} epilogue's {out_bytes}-byte outputs; a CTA has {SMEM_BYTES}"
        )


def walk_group(group_m: int, sched, grid: int, tiles_n: int) -> int:
    """``GemmTiles.group_m`` with 0 (automatic) resolved: ``AUTO_GROUP_M`` row tiles a group when
    an expert has more row tiles (``sched.balanced_rows``, a host size) than the ``grid`` CTAs
    cover at once walking ``tiles_n`` columns fast, so that each wave would read the expert's
    weight tiles from memory again; else 1. A walk never changes a bit."""
    if group_m:
        return group_m
    return AUTO_GROUP_M if sched.balanced_rows / TILE_ROWS > grid / tiles_n else 1


def _row_block_launch(sched, n: int, cols: int, device, stages: int, programs, group_m: int):
    """(grid, launch options) of a row-block kernel with ``cols``-wide tiles over ``n``
    columns: one CTA per SM (or ``programs``), the ring's stages, the walk."""
    block_tiles = sched.block_rows // TILE_ROWS
    tiles_n = cdiv(n, cols)
    grid = launch_grid(sched.max_blocks * block_tiles * tiles_n, device, programs)
    return grid, dict(
        STAGES=stages,
        BLOCK_TILES=block_tiles,
        NUM_PROGS=grid[0],
        GROUP_M=walk_group(group_m, sched, grid[0], tiles_n),
        num_warps=4,
        maxnreg=KERNEL_MAXNREG,
    )


# an output's quantizations: ((q, q_scale), (q_t, q_t_scale)) (``fp8.rows_cols_buffers``)
Quantized = tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def _quant_args(rows: int, rows_q: tuple, cols_q: tuple) -> tuple[tuple, tuple]:
    """What ``_store_quantized`` takes of an output's quantizations ``rows_q`` (1x128: q and
    its scales) and ``cols_q`` (128x1: q_t, the transposed rows, and its scales), checked:
    their descriptors, and the scales (q_t's scales' stride along the columns: ``s_tk``)."""
    (q, s), (q_t, s_t) = rows_q, cols_q
    if rows and (s.stride(0) != 1 or s.stride(1) != rows or s_t.stride(1) != 1):
        raise ValueError(
            f"the 1x128 scales must have contiguous rows and the 128x1 ones contiguous row "
            f"blocks (fp8.rows_cols_buffers with cols_out), got strides {s.stride()} and "
            f"{s_t.stride()}"
        )
    descs = (
        _nvmma(q, [HALF_ROWS.value, TILE_COLS.value]),
        _nvmma(q_t, [TILE_COLS.value, HALF_ROWS.value]),
    )
    return descs, (s, s_t)


class RowArrivals(NamedTuple):
    """Rows of A that arrive while the gate/up kernel runs (another kernel copies them in: the
    fused forward's pulls). Counter m (``counters[m]``, int32) reaches ``wanted`` (release) once
    rows ``[m * rows, (m + 1) * rows)`` are written; the producer waits for it (acquire) before
    a tile's first load of them. A wait that runs out of ``budget`` polls records the stall in
    ``errors`` (the workspace's record, as ``rank``)."""

    counters: torch.Tensor
    rows: int
    wanted: int
    errors: torch.Tensor
    rank: int
    budget: int


class StoredTiles(NamedTuple):
    """Output tiles counted as they are stored, for a kernel that reads their rows meanwhile
    (the pipelined fp8 forward's push of z beside its down GEMM). Each consumer warpgroup of a
    tile adds 1 (release) to ``counters[m]``, m = the tile's row // ``rows``, once its stores
    are done: rows ``[m * rows, (m + 1) * rows)`` are all written when the counter reaches its
    row blocks times :func:`stored_signals`."""

    counters: torch.Tensor
    rows: int


def stored_signals(block_rows: int, n: int, cols: int) -> int:
    """What a row block of ``block_rows`` adds to its :class:`StoredTiles` counter: two
    consumers a tile of ``cols`` columns, every tile of its row tiles and ``n`` columns."""
    return 2 * (block_rows // TILE_ROWS) * cdiv(n, cols)


def _stored_args(stored: StoredTiles | None, sched, out: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The grouped-GEMM kernel's (counters, ``STORED_ROWS``), checked (0 rows: not counted)."""
    if stored is None:
        return out, 0
    if stored.rows <= 0 or stored.rows % sched.block_rows:
        raise ValueError(
            f"stored.rows must be a positive multiple of the schedule's {sched.block_rows}-row "
            f"blocks, got {stored.rows}"
        )
    counters = stored.counters
    wanted = cdiv(sched.rows, stored.rows)
    if counters.dtype != torch.int32 or counters.dim() != 1 or counters.numel() < wanted:
        raise ValueError(
            f"stored.counters must be int32 with >= {wanted} counters (one per {stored.rows} "
            f"rows), got {counters.dtype} {list(counters.shape)}"
        )
    return counters, stored.rows


def _arrival_args(arrivals: RowArrivals | None, placeholder: torch.Tensor) -> tuple[tuple, int]:
    """The gate/up kernel's (counters, wanted, errors, rank, budget) and ``WAIT_ROWS``."""
    if arrivals is None:
        return (placeholder, 0, placeholder, 0, 0), 0
    if arrivals.rows <= 0 or arrivals.rows % TILE_ROWS:
        raise ValueError(
            f"arrivals.rows must be a positive multiple of the tiles' {TILE_ROWS} rows, got "
            f"{arrivals.rows}"
        )
    if arrivals.counters.dtype != torch.int32 or arrivals.errors.dtype != torch.int32:
        raise ValueError(
            f"arrivals.counters and arrivals.errors must be int32, got "
            f"{arrivals.counters.dtype} and {arrivals.errors.dtype}"
        )
    a = arrivals
    return (a.counters, a.wanted, a.errors, a.rank, a.budget), a.rows


def launch_gate_up(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    gate: tuple[torch.Tensor, torch.Tensor],
    up: tuple[torch.Tensor, torch.Tensor],
    w_rows: int,
    sched,
    outs: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
    stages: int,
    programs: int | None = None,
    group_m: int = 1,
    cols: int = GATE_UP_COLS.value,
    h_quant: tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    | None = None,
    arrivals: RowArrivals | None = None,
) -> None:
    """(g, u, h) = (a W_g^T, a W_u^T, silu(g) * u) of the used row blocks of ``sched`` into
    ``outs`` (each [rows, I], bf16), ``cols`` columns of each weight a tile (64, or 128:
    wide). ``gate``, ``up``: the weights' 2-D views (``gemm.weight_2d``: expert e's I rows
    start at ``e * w_rows``) and their 128x128 scales (the same strides). ``group_m``: the
    row tiles walked together (``walk_group``). With ``h_quant`` (wide tiles; ``outs[2]``
    None) h goes into ``((hq, hq_scale), (hq_t, hq_t_scale))`` instead, in the layouts of
    ``fp8.rows_cols_buffers(rows, I, pad_to=16, cols_out=...)`` (hq_t and its scales the
    views of packed rows of h^T): ``fp8.quantize_rows_cols``' bits of the bf16 h on the used
    rows. With ``arrivals`` the rows of ``a`` arrive while the kernel runs (``RowArrivals``).
    ``fp8_gemm.gate_up`` has checked the arguments."""
    if cols not in (GATE_UP_COLS.value, TILE_COLS.value):
        raise ValueError(f"cols = {cols}: gate/up tiles are 64 or 128 columns of each weight")
    if h_quant is not None and cols != TILE_COLS.value:
        raise ValueError(f"cols = {cols}: h is quantized in the epilogue of 128-column tiles")
    _check_stages(stages, outs[0].element_size(), "gate_up", cols)
    (wg, sg), (wu, su) = gate, up
    rows, k = a.shape
    n = outs[0].shape[1]
    grid, options = _row_block_launch(sched, n, cols, a.device, stages, programs, group_m)
    b_box = [cols, BLOCK]
    out_box = [HALF_ROWS.value, cols]
    # (no descriptors where nothing is quantized: each costs host time at every launch)
    h_descs, h_scales = (None, None), None
    if h_quant is not None:
        h_descs, h_scales = _quant_args(rows, *h_quant)
    h_desc = _nvmma(outs[2] if h_quant is None else outs[0], out_box)  # (h not stored: unused)
    arrival_args, wait_rows = _arrival_args(arrivals, sched.num_blocks)
    launch(
        _ws_gate_up_kernel,
        grid,
        _nvmma(a, [HALF_ROWS.value, BLOCK]),
        a_scale,
        _nvmma(wg, b_box),
        sg,
        _nvmma(wu, b_box),
        su,
        w_rows,
        *(_nvmma(o, out_box) for o in outs[:2]),
        h_desc,
        *h_descs,
        h_scales,
        0 if h_quant is None else h_quant[1][1].stride(0),
        sched.block_expert,
        sched.num_blocks,
        *arrival_args,
        rows,
        n,
        k,
        *a_scale.stride(),
        *sg.stride(),
        COLS=cols,
        QUANT_H=h_quant is not None,
        WAIT_ROWS=wait_rows,
        **options,
    )


def launch_grouped_mm(
    pairs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]],
    sched,
    outs: list[torch.Tensor],
    stages: int,
    programs: int | None = None,
    group_m: int = 1,
    gu: tuple[torch.Tensor, torch.Tensor] | None = None,
    cols: int = TILE_COLS.value,
    quant: tuple[Quantized, Quantized] | None = None,
    stored: StoredTiles | None = None,
) -> None:
    """outs[0][r] = sum over the (one or two) pairs of a[r] @ W[e(r)]^T, in pair order, for
    the used row blocks of ``sched``; with ``gu`` (the saved g and u, [rows, N] bf16 with
    contiguous rows) that sum is d_h and (outs[0], outs[1]) get the SwiGLU backward's (d_g,
    d_u), or with ``quant`` (``outs`` then unused) d_g's and d_u's quantizations into
    ``((q, q_scale), (q_t, q_t_scale))`` each, in the layouts of ``fp8.rows_cols_buffers(rows,
    N, pad_to=16, cols_out=...)``: ``fp8.quantize_rows_cols``' bits of the bf16 d_g and d_u on
    the used rows. A pair is (a, a_scale, wb, w_scale, w_rows): ``wb`` the weights' 2-D view
    (``gemm.weight_2d``: expert e's N rows start at ``e * w_rows``); the second pair's scales
    have the first's strides. ``group_m``: the row tiles walked together (``walk_group``);
    ``cols``: a tile's columns, 128 or 256 (wide; not with ``gu``); ``stored``: count the
    stored tiles (:class:`StoredTiles`; not with ``gu``). ``fp8_gemm`` has checked the
    arguments."""
    if cols not in (TILE_COLS.value, 2 * TILE_COLS.value) or (gu is not None and cols != 128):
        raise ValueError(
            f"cols = {cols}: the tiles are 128 or 256 columns wide, 128 with the SwiGLU backward"
        )
    if quant is not None and gu is None:
        raise ValueError("quant: only the SwiGLU backward's outputs (gu given) are quantized")
    stored_ptr, stored_rows = _stored_args(stored, sched, outs[0])
    if stored is not None and gu is not None:
        raise ValueError("stored: the SwiGLU backward's tiles are not counted")
    kind = "mm" if gu is None else "swiglu_bwd"
    _check_stages(stages, outs[0].element_size(), kind, cols)
    a, a_scale, wb, w_scale, w_rows = pairs[0]
    a2, a2_scale, wb2, w2_scale, w2_rows = pairs[-1]
    rows, k = a.shape
    n = outs[0].shape[1]
    g, u = gu if gu is not None else (outs[0], outs[0])
    grid, options = _row_block_launch(sched, n, cols, a.device, stages, programs, group_m)
    a_box, b_box = [HALF_ROWS.value, BLOCK], [TILE_COLS.value, BLOCK]
    out_box = [HALF_ROWS.value, TILE_COLS.value]
    # (no descriptors where nothing is quantized: each costs host time at every launch)
    q_descs, q_scales = (None,) * 4, None
    if quant is not None:
        (dg_descs, dg_scales), (du_descs, du_scales) = (_quant_args(rows, *x) for x in quant)
        q_descs, q_scales = dg_descs + du_descs, dg_scales + du_scales
    # (a tensor passed twice gets one descriptor: each costs host time to build)
    a_desc, b_desc = _nvmma(a, a_box), _nvmma(wb, b_box)
    out_desc = _nvmma(outs[0], out_box)
    launch(
        _ws_grouped_mm_kernel,
        grid,
        a_desc,
        a_scale,
        b_desc,
        w_scale,
        w_rows,
        a_desc if a2 is a else _nvmma(a2, a_box),
        a2_scale,
        b_desc if wb2 is wb else _nvmma(wb2, b_box),
        w2_scale,
        w2_rows,
        out_desc,
        *(out_desc if o is outs[0] else _nvmma(o, out_box) for o in (outs[-1], g, u)),
        *q_descs,
        q_scales,
        0 if quant is None else quant[0][1][1].stride(0),
        sched.block_expert,
        sched.num_blocks,
        stored_ptr,
        rows,
        n,
        k,
        *a_scale.stride(),
        *w_scale.stride(),
        TWO_PAIRS=len(pairs) == 2,
        SWIGLU_BWD=gu is not None,
        COLS=cols,
        QUANT=quant is not None,
        STORED_ROWS=stored_rows,
        **options,
    )


def wgrad_tiles(m: int, n: int, wide: tuple[int, int]) -> tuple[int, int, int]:
    """(consumers, columns, stages) of the weight gradient's tiles for an [E, ``m``, ``n``]
    output where the tiles ask for the automatic choice: 128 x ``wide[0]`` tiles of two
    consumers (``wide[1]`` stages: the tile entry's) or 192 x 128 tiles of three (4 stages),
    whichever pads the output less (a tie: three). Three consumers hide more of each one's
    promotion, a wide tile reads fewer operand bytes a FLOP; on the model table the three won
    where the wide tile padded more or neither did, and lost where only they padded
    (BENCHMARKS.md, "The weight gradient on three consumers")."""
    cols, stages = wide

    def padded(rows: int, width: int) -> int:
        return cdiv(m, rows) * rows * cdiv(n, width) * width

    if padded(3 * HALF_ROWS.value, TILE_COLS.value) <= padded(TILE_ROWS, cols):
        return 3, TILE_COLS.value, 4
    return 2, cols, stages


def _features_contiguous(scale: torch.Tensor) -> torch.Tensor:
    """128x1 scales [features, row blocks] with the features contiguous, a row block
    ``features`` apart (``fp8.quantize_cols``'s layout), which the kernel reads as vectors."""
    features = scale.shape[0]
    if scale.stride(0) == 1 and scale.stride(1) == features:
        return scale
    return scale.t().contiguous().t()


# a weight-gradient step's column scales: one unswizzled row of the [row blocks, N] scales
# (512 B; 1 KB for a wide tile)
_SCALE_ROW_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)


def launch_wgrad(
    a_t: torch.Tensor,
    a_t_scale: torch.Tensor,
    b_t: torch.Tensor,
    b_t_scale: torch.Tensor,
    row_start: torch.Tensor,
    out: torch.Tensor,
    stages: int,
    programs: int | None = None,
    cols: int = TILE_COLS.value,
    consumers: int = 2,
) -> None:
    """out[e] = a_e^T @ b_e over expert e's rows (``row_start[e]`` to ``row_start[e + 1]``,
    128-row aligned), from the transposed 128x1-quantized operands a_t [M, rows] and b_t [N,
    rows]; ``out`` an [E, M, N] bf16 or fp32 view with contiguous rows; ``cols``: a tile's
    columns, 128 or 256 (wide); ``consumers``: its 64-row consumer warpgroups, 2 or 3 (128
    columns). ``fp8_gemm.wgrad`` has checked the arguments."""
    if cols not in (TILE_COLS.value, 2 * TILE_COLS.value):
        raise ValueError(f"cols = {cols}: weight-gradient tiles are 128 or 256 columns wide")
    if consumers not in (2, 3) or (consumers == 3 and cols != TILE_COLS.value):
        raise ValueError(
            f"consumers = {consumers} with cols = {cols}: weight-gradient tiles have 2 consumer "
            f"warpgroups, or 3 with 128 columns"
        )
    _check_stages(stages, out.element_size(), "wgrad", cols, consumers)
    a_t_scale, b_t_scale = _features_contiguous(a_t_scale), _features_contiguous(b_t_scale)
    e, m, n = out.shape
    work = e * cdiv(m, consumers * HALF_ROWS.value) * cdiv(n, cols)
    grid = launch_grid(work, a_t.device, programs)
    blocks = GATE_UP_COLS.value if cols > TILE_COLS.value or consumers == 3 else cols
    launch(
        _ws_wgrad_kernel,
        grid,
        _nvmma(a_t, [HALF_ROWS.value, BLOCK]),
        a_t_scale,
        _nvmma(b_t, [TILE_COLS.value, BLOCK]),
        TensorDescriptor.from_tensor(b_t_scale.t(), [1, cols], _SCALE_ROW_LAYOUT),
        _nvmma(out, [1, HALF_ROWS.value, blocks]),  # (the consumers' accumulators' width)
        row_start,
        e,
        m,
        n,
        a_t_scale.stride(1),
        STAGES=stages,
        NUM_PROGS=grid[0],
        COLS=cols,
        CONSUMERS=consumers,
        num_warps=4,
        maxnreg=KERNEL_MAXNREG if consumers == 2 else THREE_CONSUMER_MAXNREG,
    )
