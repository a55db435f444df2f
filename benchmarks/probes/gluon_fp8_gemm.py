"""Probe: a warp-specialized Gluon kernel for the block-scaled FP8 forward ``grouped_mm``.

Why: ``megamoe.kernels.fp8_gemm`` (plain Triton) promotes every 128-deep K step's fp32 partial
product on the CUDA cores (``acc += dot(a_q, b_q) * (a_scale * b_scale)``). Triton has to wait
for the step's wgmma group before that FMA pass, so within one program the tensor cores idle
during every promotion; at DeepSeek-V3's shapes the kernels reach 585-757 TFLOP/s on an H200.
This kernel splits the work across warps the way DeepGEMM does, so that one warpgroup's
promotion overlaps another's MMAs:

  * one producer warp streams the K steps' A and B tiles into a ring of ``stages`` shared-memory
    slots with TMA (each slot: a "ready" mbarrier the TMA completes, a "free" mbarrier the
    consumers release);
  * two consumer warpgroups each own a 64x128 fp32 accumulator of the CTA's tile: the two
    64-row halves of a 128x128 tile (``128x128``, A 128 rows, B shared) or the two 128-column
    halves of a 64x256 tile (``64x256``, A shared). For every K step a consumer issues the
    step's async wgmma (m64n128k32, x4 along K) into a fresh partial accumulator, waits for
    it, releases the slot and promotes: ``acc + d * (a_scale[:, None] * b_scale)``. The two
    warpgroups run independently, so while one promotes the other's wgmma runs;
  * the scales of step k+1 are loaded during step k, into two register sets by step parity,
    and their product is taken after the step's wgmma wait. (The first version took the
    product at load time: ptxas placed that multiply, and so a wait for the global loads,
    just before the next wgmma issue, so every K step paid the loads' latency; ``early``
    variants keep that order to time against. Issuing step k+1's wgmma before promoting step
    k, a second partial accumulator in flight, made ptxas serialize the wgmmas (C7515) and
    spill, and was dropped.) ``ceiling`` variants leave the scales out, to time the
    pipeline alone;
  * with ``pingpong`` the two consumers take turns at the tensor cores. On the first H200 run
    the plain variant reached only 1.02x grouped_mm at K 7168: both consumers wait on the same
    "ready" barrier, issue together and promote together, so the tensor cores idle during
    every promotion. Two more mbarriers (``turn``) hand the right to issue the next wgmma from
    consumer 0 to consumer 1 and back, right after each issue: consumer 1 issues step k after
    consumer 0 issued step k, consumer 0 step k+1 after consumer 1 issued step k. The
    tensor cores then run 0:k, 1:k, 0:k+1, ... back to back, each consumer promoting (and
    storing a finished tile) while the other's wgmma runs. Per element nothing changes.
    (A "true" ping-pong, each consumer on its own 128x128 tile, does not fit: a 128x128 fp32
    accumulator plus its partial product is 256 registers a thread, over the 232 a consumer
    warpgroup gets, and issuing the two m64 halves one after the other would serialize the
    consumer again.)

The grid is persistent (one CTA per SM) over the tiles of the used row blocks, exactly the
row layout of ``megamoe.kernels.schedule.RowSchedule``: row block ``mb`` holds rows of expert
``block_expert[mb]``, ``num_blocks[0]`` blocks are used, and expert e's weight rows start at
``e * w_rows`` of the 2-D view ``gemm.weight_2d`` gives (as ``fp8_gemm._mm_launch``).

Numerics: per K step, each element's partial product comes from the same four k32 wgmma
instructions, in K order, from a zero accumulator, as in ``fp8_gemm.fp8_mma`` (whose 64x128
tiles issue m64n128k32 too), and the promotion is the same expression in the same order; the
K steps run in order. So the output is meant to be bitwise that of ``fp8_gemm.grouped_mm``
(the GPU mode checks it with ``torch.equal`` on the written rows).

    # on any machine (no GPU): compile for sm_90a, print registers/spills/smem, check the PTX
    # (wgmma present, no local memory, no spills, no ptxas wgmma-serialization warning)
    PYTHONPATH=. python benchmarks/probes/gluon_fp8_gemm.py --compile-only
    # on one H200: correctness against grouped_mm and float64, timing, JSON record
    PYTHONPATH=. python benchmarks/probes/gluon_fp8_gemm.py --out gluon_fp8.json
    # fewer variants or shapes: --variants 128x128:4,128x128:4:pingpong --shapes down

Compiling without a GPU: the launch is recorded on meta tensors (``compile_check``'s
``record_launches``, which binds the arguments as an sm_90a launch would) and compiled with
``triton.compile(GluonASTSource(...), target=GPUTarget("cuda", 90, 32))``: Gluon's source class
in place of ``ASTSource``, the rest of the pipeline (ptxas included) as for the Triton kernels.

Limits (a probe, not a library kernel): forward ``grouped_mm`` only (no two pairs, no SwiGLU
epilogue), bf16 output, N a multiple of 8, K a multiple of 16, ``block_rows`` a multiple of
the tile height; the activation scales are read with plain loads (any strides).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
from dataclasses import dataclass

import torch
import triton
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

from megamoe.kernels.fp8 import BLOCK, FP8, Fp8Weight
from megamoe.kernels.gemm import weight_2d
from megamoe.kernels.runtime import empty
from megamoe.kernels.schedule import RowSchedule

# (constexpr globals: the kernels read them; ``.value`` on the host)
WG_ROWS = gl.constexpr(64)  # rows of one consumer warpgroup's wgmma tile (m64)
WG_COLS = gl.constexpr(128)  # columns of one consumer's tile: one 128-wide weight-scale block
BK = gl.constexpr(BLOCK)  # the K step: one scale block, the promotion interval
# Registers per thread (setmaxnreg) of the consumer warpgroups and of the producer warp's
# warpgroup: 2 * 128 * 232 + 128 * 40 = 64512 of the SM's 65536.
CONSUMER_REGS = gl.constexpr(232)
PRODUCER_REGS = gl.constexpr(40)
KERNEL_MAXNREG = 168  # the average over the 12 warps (3 warpgroups) the kernel launches
SMEM_LIMIT = 227 * 1024  # bytes of shared memory one H100/H200 CTA may use
H200_SMS = 132


# ------------------------------------------------------------------------------------ kernel


@gluon.jit
def _tile_origin(
    tile, tiles_n, block_expert_ptr, BLOCK_TILES: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr
):
    """(expert, first row, first column) of CTA tile ``tile``: the column is the fast index
    (``tiles.tile_of``), the expert that of the tile's row block."""
    mb = tile // tiles_n
    nb = tile % tiles_n
    expert = gl.load(block_expert_ptr + mb // BLOCK_TILES)
    return expert, mb * BM, nb * BN


@gluon.jit
def _producer(
    a_desc,
    b_desc,
    a_bufs,
    b_bufs,
    ready,
    free,
    block_expert_ptr,
    num_blocks_ptr,
    N,
    K,
    w_rows,
    SPLIT_N: gl.constexpr,
    STAGES: gl.constexpr,
    BLOCK_TILES: gl.constexpr,
    NUM_PROGS: gl.constexpr,
):
    """One warp: every K step of every tile of this CTA, in the consumers' order, into the
    ring. A slot is refilled once both consumers released it ("free"); its "ready" barrier
    completes when all of the step's TMA bytes have landed."""
    NA: gl.constexpr = 1 if SPLIT_N else 2  # 64-row A boxes per step
    NB: gl.constexpr = 2 if SPLIT_N else 1  # 128-row B boxes per step
    BM: gl.constexpr = WG_ROWS * NA
    BN: gl.constexpr = WG_COLS * NB
    STEP_BYTES: gl.constexpr = NA * a_desc.block_type.nbytes + NB * b_desc.block_type.nbytes
    tiles_n = gl.cdiv(N, BN)
    num_tiles = gl.load(num_blocks_ptr) * BLOCK_TILES * tiles_n
    k_steps = gl.cdiv(K, BK)
    it = 0
    for tile in range(gl.program_id(0), num_tiles, NUM_PROGS):
        expert, row, col = _tile_origin(tile, tiles_n, block_expert_ptr, BLOCK_TILES, BM, BN)
        w_row = expert * w_rows + col
        for kb in range(k_steps):
            slot = it % STAGES
            # The first pass over the ring waits on phase 1, which a fresh barrier has
            # completed: the producer runs STAGES steps ahead from the start.
            mbarrier.wait(free.index(slot), ((it // STAGES) & 1) ^ 1)
            bar = ready.index(slot)
            mbarrier.expect(bar, STEP_BYTES)
            k = kb * BK
            for i in gl.static_range(NA):
                tma.async_copy_global_to_shared(
                    a_desc, [row + i * WG_ROWS, k], bar, a_bufs.index(slot * NA + i)
                )
            for j in gl.static_range(NB):
                tma.async_copy_global_to_shared(
                    b_desc, [w_row + j * WG_COLS, k], bar, b_bufs.index(slot * NB + j)
                )
            it += 1


@gluon.jit
def _step_scales(scales, expert, rows, col, kb):
    """The K step's scales of the consumer's rows: a_scale[row, kb] (0 past M) and the one
    weight scale of its 128 columns, b_scale[expert, col // 128, kb] (``scales``: the pointers,
    M, N and the strides). A tile's columns past N (clipped by the store) read the expert's
    last scale block, never another expert's or past the tensor. Returned apart: their product
    is taken after the step's wgmma wait (``_scale_product``), so that no instruction before
    the wgmma issue waits for these loads."""
    a_s_ptr, b_s_ptr, M, N, s_am, s_ak, s_be, s_bn, s_bk = scales
    sa = gl.load(a_s_ptr + rows * s_am + kb * s_ak, mask=rows < M, other=0.0)
    nb = gl.minimum(col // WG_COLS, gl.cdiv(N, WG_COLS) - 1)
    # Loaded per row, masked as sa (a product past M is 0 either way): a scalar, or a row
    # vector ptxas can prove uniform, goes into a uniform register at the loop's back edge,
    # and ptxas waits for the load there, before the next step's wgmma.
    sb = gl.load(b_s_ptr + expert * s_be + nb * s_bn + kb * s_bk + rows * 0, mask=rows < M)
    return sa, sb


@gluon.jit
def _issue(
    a_bufs,
    b_bufs,
    ready,
    it,
    regs,
    STAGES: gl.constexpr,
    NA: gl.constexpr,
    NB: gl.constexpr,
    A_SUB: gl.constexpr,
    B_SUB: gl.constexpr,
    USE_ACC: gl.constexpr = False,
):
    """Wait for ring step ``it`` to land and issue its async wgmma (m64n128k32, four along K)
    into a partial accumulator that starts from zero (``use_acc=False``: the values of
    ``regs``, whose registers it takes, are ignored; ``ceiling`` variants add to them)."""
    slot = it % STAGES
    mbarrier.wait(ready.index(slot), (it // STAGES) & 1)
    a = a_bufs.index(slot * NA + A_SUB)
    b = b_bufs.index(slot * NB + B_SUB).permute((1, 0))  # [128 N, 128 K] viewed K-major
    return warpgroup_mma(a, b, regs, use_acc=USE_ACC, is_async=True)


@gluon.jit
def _early(scale, EARLY: gl.constexpr):
    """(``early`` variants) the scales' product taken as soon as they are loaded, as the first
    version of this kernel did: ptxas then placed that multiply, and so a wait for the loads,
    before the next step's wgmma issue."""
    if EARLY:
        sa, sb = scale
        return sa * sb
    else:
        return scale


@gluon.jit
def _promote(acc, d, scale, EARLY: gl.constexpr):
    """fp8_mma's promotion of a step's partial product ``d``: the scales' product first, then
    one FMA per element (so the bits of ``fp8_gemm.grouped_mm``)."""
    if EARLY:
        return acc + d * scale[:, None]
    else:
        sa, sb = scale
        return acc + d * (sa * sb)[:, None]


@gluon.jit
def _k_step(
    acc, ra, scale, ring, it, WG: gl.constexpr, PINGPONG: gl.constexpr, EARLY: gl.constexpr
):
    """One K step of a consumer: ring step ``it``'s wgmma into the partial accumulator ``ra``,
    its wait, the slot's release, the promotion into ``acc``. Returns (acc, ra).

    (pingpong) ``turn``: two mbarriers of one arrival each; ``turn[w]`` completes a phase when
    warpgroup w may issue its next wgmma. Warpgroup 0 issues its ring step j after warpgroup 1
    issued step j - 1, warpgroup 1 its step j after warpgroup 0 issued step j, so the tensor
    cores take the steps' wgmmas in the order 0:j, 1:j, 0:j+1, 1:j+1, ... and each warpgroup's
    promotion of step j runs while the other's wgmma runs. ``it`` counts the same ring steps
    in both warpgroups, so the j-th wait of turn[0] (parity (j & 1) ^ 1; the first passes on a
    fresh barrier) meets warpgroup 1's arrival j - 1, the j-th wait of turn[1] (parity j & 1)
    warpgroup 0's arrival j."""
    a_bufs, b_bufs, ready, free, turn, STAGES, NA, NB, A_SUB, B_SUB = ring
    if PINGPONG:
        mbarrier.wait(turn.index(WG), (it & 1) ^ (1 - WG))
    pa = _issue(a_bufs, b_bufs, ready, it, ra, STAGES, NA, NB, A_SUB, B_SUB)
    if PINGPONG:
        # Hand the turn over as soon as the wgmma is issued (not completed): the other
        # warpgroup's wgmma queues behind it and runs while this one is promoted.
        mbarrier.arrive(turn.index(1 - WG), count=1)
    ra = warpgroup_mma_wait(num_outstanding=0, deps=(pa,))
    # Both wgmma groups have read the slot: hand it back to the producer (the compiler syncs
    # the warpgroup before its one-thread arrive).
    mbarrier.arrive(free.index(it % STAGES), count=1)
    return _promote(acc, ra, scale, EARLY), ra


@gluon.jit
def _consumer(
    c_desc,
    a_bufs,
    b_bufs,
    c_bufs,
    ready,
    free,
    turn,
    a_s_ptr,
    b_s_ptr,
    block_expert_ptr,
    num_blocks_ptr,
    M,
    N,
    K,
    s_am,
    s_ak,
    s_be,
    s_bn,
    s_bk,
    WG: gl.constexpr,
    SPLIT_N: gl.constexpr,
    STAGES: gl.constexpr,
    EARLY: gl.constexpr,
    CEILING: gl.constexpr,
    PINGPONG: gl.constexpr,
    BLOCK_TILES: gl.constexpr,
    NUM_PROGS: gl.constexpr,
):
    """One warpgroup: the [64, 128] part ``WG`` (0 or 1) of every tile of this CTA.

    (pingpong, ``_k_step``) No deadlock: both warpgroups walk the same tiles with the same K
    steps, so each makes as many turn waits as the other makes arrivals (none in a CTA without
    tiles; the count runs across tiles, so an odd tile count changes nothing); warpgroup 0's
    wait j needs only warpgroup 1's step j - 1 issued, warpgroup 1's wait j only warpgroup 0's
    step j issued, and a step's issue needs only its ring slot, which the producer fills once
    both released step j - STAGES: every wait depends only on events earlier in the order 0:0,
    1:0, 0:1, 1:1, ... (no cycle). Neither barrier gets more than one phase ahead of its waiter
    (its next phase needs an arrival the waiter makes only after passing its current wait), so
    no parity wait misses a phase."""
    NA: gl.constexpr = 1 if SPLIT_N else 2
    NB: gl.constexpr = 2 if SPLIT_N else 1
    BM: gl.constexpr = WG_ROWS * NA
    BN: gl.constexpr = WG_COLS * NB
    # This warpgroup's A box and B box within a ring slot, and its offset in the CTA tile.
    A_SUB: gl.constexpr = 0 if SPLIT_N else WG
    B_SUB: gl.constexpr = WG if SPLIT_N else 0
    ROW_OFF: gl.constexpr = 0 if SPLIT_N else WG * WG_ROWS
    COL_OFF: gl.constexpr = WG * WG_COLS if SPLIT_N else 0
    # wgmma m64n128k32 over one warpgroup (4 warps along M): the instruction fp8_gemm's 64x128
    # tiles with 4 warps get.
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, WG_COLS, 32]
    )
    row_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    c_smem = c_bufs.index(WG)
    scales = (a_s_ptr, b_s_ptr, M, N, s_am, s_ak, s_be, s_bn, s_bk)
    ring = (a_bufs, b_bufs, ready, free, turn, STAGES, NA, NB, A_SUB, B_SUB)

    tiles_n = gl.cdiv(N, BN)
    num_tiles = gl.load(num_blocks_ptr) * BLOCK_TILES * tiles_n
    k_steps = gl.cdiv(K, BK)
    zero = gl.zeros([WG_ROWS, WG_COLS], gl.float32, acc_layout)
    ra = zero  # the partial accumulator's registers, handed from step to step
    it = 0  # ring steps consumed so far (the producer counts the same)
    for tile in range(gl.program_id(0), num_tiles, NUM_PROGS):
        expert, row, col = _tile_origin(tile, tiles_n, block_expert_ptr, BLOCK_TILES, BM, BN)
        row += ROW_OFF
        col += COL_OFF
        rows = row + gl.arange(0, WG_ROWS, layout=row_layout)
        acc = zero
        if CEILING:
            # No block scales: the tensor cores accumulate over all of K (wrong numbers; the
            # pipeline's own speed, for timing only).
            for kb in range(k_steps):
                pa = _issue(a_bufs, b_bufs, ready, it, acc, STAGES, NA, NB, A_SUB, B_SUB, True)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(pa,))
                mbarrier.arrive(free.index(it % STAGES), count=1)
                it += 1
        else:
            # The scales are loaded one step ahead, into two register sets by step parity (the
            # loop is unrolled by two): a load's destination is read only after the next step's
            # wgmma, never copied into a loop-carried register before it (such a copy made ptxas
            # wait for the load between a step's wgmma instructions).
            scale0 = _early(_step_scales(scales, expert, rows, col, 0), EARLY)
            for kb in range(0, k_steps - 1, 2):
                scale1 = _early(_step_scales(scales, expert, rows, col, kb + 1), EARLY)
                acc, ra = _k_step(acc, ra, scale0, ring, it, WG, PINGPONG, EARLY)
                last = gl.minimum(kb + 2, k_steps - 1)
                scale0 = _early(_step_scales(scales, expert, rows, col, last), EARLY)
                acc, ra = _k_step(acc, ra, scale1, ring, it + 1, WG, PINGPONG, EARLY)
                it += 2
            if k_steps % 2:
                acc, ra = _k_step(acc, ra, scale0, ring, it, WG, PINGPONG, EARLY)
                it += 1
        # Epilogue: bf16 through this warpgroup's staging buffer, one TMA store (clipped at
        # the tensor's edges). The previous tile's store must have read the buffer first.
        tma.store_wait(pendings=0)
        c_smem.store(acc.to(c_desc.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(c_desc, [row, col], c_smem)
    tma.store_wait(pendings=0)


# Not specialized: an int argument equal to 1 (a unit stride) would become a plain Python int,
# which cannot be handed to a worker partition.
@gluon.jit(do_not_specialize=["M", "N", "K", "w_rows", "s_am", "s_ak", "s_be", "s_bn", "s_bk"])
def _gluon_fp8_grouped_mm_kernel(
    a_desc,
    a_s_ptr,
    b_desc,
    b_s_ptr,
    c_desc,
    block_expert_ptr,
    num_blocks_ptr,
    M,
    N,
    K,
    w_rows,
    s_am,
    s_ak,
    s_be,
    s_bn,
    s_bk,
    SPLIT_N: gl.constexpr,
    STAGES: gl.constexpr,
    EARLY: gl.constexpr,
    CEILING: gl.constexpr,
    PINGPONG: gl.constexpr,
    BLOCK_TILES: gl.constexpr,
    NUM_PROGS: gl.constexpr,
):
    NA: gl.constexpr = 1 if SPLIT_N else 2
    NB: gl.constexpr = 2 if SPLIT_N else 1
    a_bufs = gl.allocate_shared_memory(
        a_desc.dtype, [STAGES * NA] + a_desc.block_type.shape, a_desc.layout
    )
    b_bufs = gl.allocate_shared_memory(
        b_desc.dtype, [STAGES * NB] + b_desc.block_type.shape, b_desc.layout
    )
    c_bufs = gl.allocate_shared_memory(c_desc.dtype, [2] + c_desc.block_type.shape, c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)  # the producer's expect; TMA adds the bytes
        mbarrier.init(free.index(i), count=2)  # one arrival per consumer warpgroup
    if PINGPONG:
        # turn[w]: warpgroup w may issue its next wgmma (one arrival: the other warpgroup's)
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)
    else:
        turn = free  # (not used)
    fence_async_shared()

    # (The argument tuples are written out: concatenating tuples would unwrap the constexprs,
    # which a worker partition cannot take as plain Python values.)
    gl.warp_specialize(
        [
            (
                _consumer,
                (
                    c_desc,
                    a_bufs,
                    b_bufs,
                    c_bufs,
                    ready,
                    free,
                    turn,
                    a_s_ptr,
                    b_s_ptr,
                    block_expert_ptr,
                    num_blocks_ptr,
                    M,
                    N,
                    K,
                    s_am,
                    s_ak,
                    s_be,
                    s_bn,
                    s_bk,
                    gl.constexpr(0),
                    SPLIT_N,
                    STAGES,
                    EARLY,
                    CEILING,
                    PINGPONG,
                    BLOCK_TILES,
                    NUM_PROGS,
                ),
            ),
            (
                _consumer,
                (
                    c_desc,
                    a_bufs,
                    b_bufs,
                    c_bufs,
                    ready,
                    free,
                    turn,
                    a_s_ptr,
                    b_s_ptr,
                    block_expert_ptr,
                    num_blocks_ptr,
                    M,
                    N,
                    K,
                    s_am,
                    s_ak,
                    s_be,
                    s_bn,
                    s_bk,
                    gl.constexpr(1),
                    SPLIT_N,
                    STAGES,
                    EARLY,
                    CEILING,
                    PINGPONG,
                    BLOCK_TILES,
                    NUM_PROGS,
                ),
            ),
            (
                _producer,
                (
                    a_desc,
                    b_desc,
                    a_bufs,
                    b_bufs,
                    ready,
                    free,
                    block_expert_ptr,
                    num_blocks_ptr,
                    N,
                    K,
                    w_rows,
                    SPLIT_N,
                    STAGES,
                    BLOCK_TILES,
                    NUM_PROGS,
                ),
            ),
        ],
        [4, 1],
        [CONSUMER_REGS, PRODUCER_REGS],
    )


# -------------------------------------------------------------------------------------- host


VARIANT_OPTIONS = ("pingpong", "early", "ceiling")


@dataclass(frozen=True)
class Variant:
    """A tile choice: ``split_n`` puts the two consumers side by side along N (a 64x256 CTA
    tile, A shared) instead of stacked along M (128x128, B shared); ``stages`` ring slots;
    ``pingpong`` orders the two consumers' wgmmas (each K step: consumer 0's, then consumer
    1's, then consumer 0's next) so that one's promotion overlaps the other's wgmma; ``early``
    takes the scales' product when they are loaded, before the next wgmma issue (the first
    version's order, kept to time against); ``ceiling`` leaves the block scales out and lets
    the tensor cores accumulate over all of K: wrong numbers, the pipeline's own speed (timed,
    not checked)."""

    split_n: bool = False
    stages: int = 4
    pingpong: bool = False
    early: bool = False
    ceiling: bool = False

    @property
    def bm(self) -> int:
        return WG_ROWS.value * (1 if self.split_n else 2)

    @property
    def bn(self) -> int:
        return WG_COLS.value * (2 if self.split_n else 1)

    @property
    def name(self) -> str:
        options = ":pingpong" * self.pingpong + ":early" * self.early
        options += ":ceiling" * self.ceiling
        return f"{self.bm}x{self.bn}:{self.stages}{options}"

    def smem_bytes(self) -> int:
        """The ring (fp8 A and B tiles), the two bf16 staging tiles and the barriers."""
        step = (self.bm + self.bn) * BK.value
        barriers = 16 * self.stages + (16 if self.pingpong else 0)
        return self.stages * step + 2 * WG_ROWS.value * WG_COLS.value * 2 + barriers

    @staticmethod
    def parse(text: str) -> Variant:
        """``128x128:4``, ``64x256:3``, ``128x128:4:pingpong``, ``128x128:4:pingpong:early``
        (tile, stages, options)."""
        parts = text.split(":")
        options = set(parts[2:])
        if parts[0] not in ("128x128", "64x256") or not options <= set(VARIANT_OPTIONS):
            raise ValueError(
                f"variant {text!r}: want 128x128|64x256[:stages], then options out of "
                f"{VARIANT_OPTIONS}"
            )
        v = Variant(
            split_n=parts[0] == "64x256",
            stages=int(parts[1]) if len(parts) > 1 else 4,
            pingpong="pingpong" in options,
            early="early" in options,
            ceiling="ceiling" in options,
        )
        if v.smem_bytes() > SMEM_LIMIT:
            raise ValueError(f"variant {text!r} needs {v.smem_bytes()} B of shared memory")
        return v


# (The first GPU run's 128x128:6 and 64x256:4 are left out: 128x128:6 was no faster than
# 128x128:4, 64x256:4 slower. Each order of the scales' product is timed, plain and ping-pong.)
DEFAULT_VARIANTS = (
    "128x128:4",
    "128x128:4:early",
    "128x128:4:pingpong",
    "128x128:4:pingpong:early",
    "128x128:4:ceiling",
)


def _nvmma(block: list[int], dtype) -> gl.NVMMASharedLayout:
    return gl.NVMMASharedLayout.get_default_for(block, dtype)


def gluon_grouped_mm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: Fp8Weight,
    sched: RowSchedule,
    variant: Variant = Variant(),
    programs: int | None = None,
) -> torch.Tensor:
    """C[r] = a[r] @ w.q[e(r)]^T in bf16, like ``fp8_gemm.grouped_mm`` (same arguments, same
    written rows: the used row blocks)."""
    from megamoe.kernels.runtime import persistent_programs

    if a.dtype != FP8 or a.dim() != 2 or a.stride(1) != 1 or a.shape[1] % 16:
        raise ValueError(f"a must be float8_e4m3fn [rows, K], K % 16 == 0, got {a.shape}")
    rows, k = a.shape
    q, s = w.q, w.scale
    n = q.shape[1]
    if q.dtype != FP8 or q.shape[2] != k or n % 8:
        raise ValueError(f"w.q must be float8_e4m3fn [E, N, {k}], N % 8 == 0, got {q.shape}")
    if list(a_scale.shape) != [rows, triton.cdiv(k, BK.value)]:
        raise ValueError(f"a_scale must be [{rows}, {triton.cdiv(k, BK.value)}]")
    if sched.block_rows % variant.bm:
        raise ValueError(f"block_rows {sched.block_rows} is not a multiple of {variant.bm}")
    wb, w_rows = weight_2d(q)
    a_box, b_box, c_box = [WG_ROWS.value, BK.value], [WG_COLS.value, BK.value], [64, 128]
    a_desc = TensorDescriptor.from_tensor(a, a_box, _nvmma(a_box, gl.float8e4nv))
    b_desc = TensorDescriptor.from_tensor(wb, b_box, _nvmma(b_box, gl.float8e4nv))
    out = empty((rows, n), torch.bfloat16, a.device)
    c_desc = TensorDescriptor.from_tensor(out, c_box, _nvmma(c_box, gl.bfloat16))
    block_tiles = sched.block_rows // variant.bm
    work = sched.max_blocks * block_tiles * triton.cdiv(n, variant.bn)
    sms = persistent_programs(a.device) if programs is None else programs
    grid = (max(1, min(sms, work)),)
    _gluon_fp8_grouped_mm_kernel[grid](
        a_desc,
        a_scale,
        b_desc,
        s,
        c_desc,
        sched.block_expert,
        sched.num_blocks,
        rows,
        n,
        k,
        w_rows,
        *a_scale.stride(),
        *s.stride(),
        SPLIT_N=variant.split_n,
        STAGES=variant.stages,
        EARLY=variant.early,
        CEILING=variant.ceiling,
        PINGPONG=variant.pingpong,
        BLOCK_TILES=block_tiles,
        NUM_PROGS=grid[0],
        num_warps=4,
        maxnreg=KERNEL_MAXNREG,
    )
    return out


# ------------------------------------------------------------------------------ compile only


def _meta_problem(experts: int, rows_per_expert: int, n: int, k: int):
    """Meta tensors (no memory) of one grouped_mm problem: A, its MN-major 1x128 scales, the
    weight and a schedule of ``experts * rows_per_expert`` rows in 128-row blocks."""
    from megamoe.kernels.schedule import build_row_schedule

    ids = torch.empty((experts * rows_per_expert, 1), dtype=torch.int64, device="meta")
    sched = build_row_schedule(ids, experts, 128)
    kb = triton.cdiv(k, BK.value)
    a = torch.empty((sched.rows, k), dtype=FP8, device="meta")
    a_scale = torch.empty((kb, sched.rows), dtype=torch.float32, device="meta").t()
    w = Fp8Weight(
        torch.empty((experts, n, k), dtype=FP8, device="meta"),
        torch.empty((experts, triton.cdiv(n, 128), kb), dtype=torch.float32, device="meta"),
    )
    return a, a_scale, w, sched


def _ptx_counts(ptx: str) -> dict:
    """What the PTX says about the main loop: the wgmma shapes, local memory, FMAs."""
    shapes = sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx)))
    return dict(
        wgmma=shapes,
        wgmma_count=ptx.count("wgmma.mma_async"),
        local_memory="ld.local" in ptx or "st.local" in ptx,
        setmaxnreg=",".join(
            sorted(
                {
                    a + b
                    for a, b in re.findall(r"setmaxnreg\.(\w+)\.sync\.aligned\.u32\s+(\d+)", ptx)
                }
            )
        ),
        fma_f32=len(re.findall(r"\bfma\.rn\.f32\b", ptx)),
        mul_f32=len(re.findall(r"\bmul\.(?:rn\.)?f32\b", ptx)),
        add_f32=len(re.findall(r"\badd\.(?:rn\.)?f32\b", ptx)),
    )


def _ptxas(ptx: str) -> dict:
    """``ptxas -v`` for sm_90a: registers, spill and stack bytes, and its performance warnings
    (e.g. C7514/C7515: wgmma serialized because registers of an in-flight accumulator were
    read or written)."""
    import subprocess
    import tempfile

    from megamoe.tools.compile_check import _PTXAS

    with tempfile.TemporaryDirectory() as tmp:
        with open(f"{tmp}/k.ptx", "w") as f:
            f.write(ptx)
        info = subprocess.run(
            [_PTXAS, "-arch=sm_90a", "-v", f"{tmp}/k.ptx", "-o", f"{tmp}/k.cubin"],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
        sass = subprocess.run(
            [os.path.join(os.path.dirname(_PTXAS), "cuobjdump"), "-sass", f"{tmp}/k.cubin"],
            capture_output=True,
            text=True,
        ).stdout

    def number(pattern: str) -> int:
        found = re.search(pattern, info)
        return int(found.group(1)) if found else 0

    # ptxas reports the launch's register count (maxnreg); the warpgroups that setmaxnreg
    # raises use more: the highest register the SASS names tells how many.
    used = [int(r) for r in re.findall(r"\bR(\d+)\b", sass)]
    return dict(
        registers=number(r"Used (\d+) registers"),
        sass_max_register=max(used) + 1 if used else None,
        spill_bytes=number(r"(\d+) bytes spill stores"),
        stack_bytes=number(r"(\d+) bytes (?:stack frame|cumulative stack size)"),
        ptxas_warnings=sorted(set(re.findall(r"\((C\d+)\) Potential Performance Loss", info))),
    )


def compile_only(variants: list[Variant], keep: str | None = None) -> int:
    """Compile the Gluon kernel (each variant) and fp8_gemm's Triton kernel for sm_90a on this
    machine, print registers, spills and shared memory, and check the PTX: wgmma, no local
    memory, no spills, shared memory within the limit. Returns the exit status."""
    from triton.compiler import ASTSource
    from triton.compiler import compile as triton_compile
    from triton.experimental.gluon._runtime import GluonASTSource

    from megamoe.kernels import fp8_gemm
    from megamoe.kernels.runtime import assume_programs, interpreting
    from megamoe.tools.compile_check import HOPPER, record_launches

    if interpreting():
        print("run with TRITON_INTERPRET unset (the interpreter cannot compile)")
        return 2
    label = ["?"]
    with assume_programs(H200_SMS), record_launches(lambda: label[0]) as launches:
        for shape, (n, k) in (("down", (7168, 2048)), ("gate", (4096, 7168))):
            problem = _meta_problem(32, 512, n, k)
            for v in variants:
                label[0] = f"gluon {v.name}"  # (one specialization for both shapes)
                gluon_grouped_mm(*problem, variant=v)
            label[0] = f"triton grouped_mm {shape}"
            fp8_gemm.grouped_mm(*problem)
    failures = []
    results = []
    for launch in launches:
        if launch.scenario == "?":  # the schedule's kernels (meta inputs), not compiled
            continue
        options = {
            k: v
            for k, v in launch.options.items()
            if k in ("num_warps", "num_stages", "num_ctas", "maxnreg")
        }
        source = GluonASTSource if launch.fn.is_gluon() else ASTSource
        src = source(launch.fn, launch.signature, constexprs=launch.constexprs, attrs=launch.attrs)
        kernel = triton_compile(src, target=HOPPER, options=options)
        ptx = kernel.asm["ptx"]
        r = dict(
            kernel=launch.scenario,
            shared=kernel.metadata.shared,
            num_warps=kernel.metadata.num_warps,
            **_ptxas(ptx),
            **_ptx_counts(ptx),
        )
        results.append(r)
        print(
            f"{r['kernel']:30s} regs={r['registers']:3d} (SASS {r['sass_max_register']}) "
            f"spill={r['spill_bytes']:4d} "
            f"stack={r['stack_bytes']:3d} smem={r['shared']:6d} warps={r['num_warps']:2d} "
            f"wgmma={','.join(r['wgmma'])}x{r['wgmma_count']} setmaxnreg={r['setmaxnreg']} "
            f"fma={r['fma_f32']} mul={r['mul_f32']} add={r['add_f32']} "
            f"ptxas_warnings={r['ptxas_warnings']}"
        )
        if not r["wgmma"]:
            failures.append(f"{r['kernel']}: no wgmma in the PTX")
        if r["spill_bytes"] or r["local_memory"] or r["stack_bytes"]:
            failures.append(f"{r['kernel']}: spills/local memory/stack")
        if r["ptxas_warnings"]:
            failures.append(f"{r['kernel']}: ptxas serializes wgmma {r['ptxas_warnings']}")
        if r["shared"] > SMEM_LIMIT:
            failures.append(f"{r['kernel']}: {r['shared']} B of shared memory > {SMEM_LIMIT}")
        if keep:
            name = re.sub(r"\W+", "_", launch.scenario)
            for ext in ("ttgir", "ptx"):
                with open(f"{keep}/{name}.{ext}", "w") as f:
                    f.write(kernel.asm[ext])
    for f in failures:
        print("FAIL", f)
    print("compile-only:", "FAILED" if failures else "ok")
    return 1 if failures else 0


# -------------------------------------------------------------------------------------- GPU

# (label, experts, routed rows per expert on average, N, K): DeepSeek-V3 (H 7168, I 2048), one
# routed row per token, uneven expert loads (random top-1 ids), 128-row blocks.
SHAPES = (
    ("down E32 8192 rows", 32, 256, 7168, 2048),
    ("down E32 32768 rows", 32, 1024, 7168, 2048),
    ("gate E8 16384 rows", 8, 2048, 4096, 7168),
    ("gate E32 32768 rows", 32, 1024, 4096, 7168),
)
# Pass/fail bound on max |C - C_fp64| / max |C_fp64| (per expert): rounding to bf16 alone is
# up to 2^-8 of an element; this leaves room for the tensor cores' and fp32 accumulation.
NORM_ERR_LIMIT = 2.0**-7


def _problem(experts: int, per_expert: int, n: int, k: int, seed: int):
    """GPU inputs built with megamoe's own quantizers, rows in the padded layout."""
    from megamoe.kernels import fp8
    from megamoe.kernels.schedule import build_row_schedule
    from megamoe.tools.bench_kernels import rows_padded

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(seed)
    tokens = experts * per_expert
    ids = torch.randint(0, experts, (tokens, 1), device=dev, generator=gen)
    sched = build_row_schedule(ids, experts, 128)
    x = torch.randn(tokens, k, device=dev, generator=gen).bfloat16()
    # token-major x into the padded layout (zeros in the padding rows), then 1x128-quantized
    a, a_scale = fp8.quantize_rows(rows_padded(x, sched))
    w = fp8.quantize_weight(torch.randn(experts, n, k, device=dev, generator=gen).bfloat16() * 0.05)
    return a, a_scale, w, sched, tokens


def _errors(
    outs: dict[str, torch.Tensor], a, a_scale, w: Fp8Weight, sched, experts: list[int]
) -> dict:
    """Per output, over the rows of ``experts``: max |C - C_fp64|, that over max |C_fp64| (per
    expert, the worst), the max elementwise relative error where |C_fp64| >= 1% of the
    expert's max, and the non-finite count; C_fp64 is the float64 product of the dequantized
    operands, expert by expert (padding rows included: they must be 0)."""
    from megamoe.kernels import fp8

    starts = sched.row_start.tolist()
    stats = {name: dict(max_abs=0.0, max_norm=0.0, max_rel=0.0, nonfinite=0) for name in outs}
    for e in experts:
        r0, r1 = starts[e], starts[e + 1]
        if r1 == r0:
            continue
        a_e = fp8.dequantize_rows(a[r0:r1], a_scale[r0:r1]).double()
        s = w.scale[e].repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
        w_e = w.q[e].double() * s[: w.q.shape[1], : w.q.shape[2]].double()
        ref = a_e @ w_e.T
        big = ref.abs().max().item()
        for name, c in outs.items():
            err = (c[r0:r1].double() - ref).abs()
            st = stats[name]
            st["nonfinite"] += int((~torch.isfinite(c[r0:r1])).sum().item())
            st["max_abs"] = max(st["max_abs"], err.max().item())
            if big > 0:
                st["max_norm"] = max(st["max_norm"], err.max().item() / big)
                keep = ref.abs() >= 0.01 * big
                st["max_rel"] = max(st["max_rel"], (err[keep] / ref.abs()[keep]).max().item())
    return stats


def _interleaved_ms(calls: dict, rounds: int, warmup: int = 3) -> dict[str, float]:
    """Median CUDA-event time of one call of each, over ``rounds`` round-robin rounds."""
    for fn in calls.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in calls}
    events = []
    for _ in range(rounds):
        for name, fn in calls.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events.append((name, start, end))
    torch.cuda.synchronize()
    for name, start, end in events:
        times[name].append(start.elapsed_time(end))
    return {name: statistics.median(t) for name, t in times.items()}


def _run_shape(shape: tuple, seed: int, variants: list[Variant], args, failures: list[str]):
    """One shape: every kernel's output checked, then all of them timed round robin."""
    from megamoe.kernels import fp8_gemm, fp8_ws

    label, experts, per_expert, n, k = shape
    a, a_scale, w, sched, tokens = _problem(experts, per_expert, n, k, seed)
    used = int(sched.num_blocks.item()) * sched.block_rows
    calls = {"triton": lambda: fp8_gemm.grouped_mm(a, a_scale, w, sched)}

    def library():  # the library's warp-specialized kernel (fp8_ws), 4 stages
        out = torch.empty((a.shape[0], n), dtype=torch.bfloat16, device=a.device)
        wb, w_rows = weight_2d(w.q)
        fp8_ws.launch_grouped_mm(a, a_scale, wb, w.scale, w_rows, sched, out, 4)
        return out

    calls["fp8_ws:4"] = library
    for v in variants:
        calls[v.name] = lambda v=v: gluon_grouped_mm(a, a_scale, w, sched, variant=v)
    ceilings = {v.name for v in variants if v.ceiling}
    outs = {}
    for name, fn in calls.items():
        try:
            outs[name] = fn()
            torch.cuda.synchronize()
        except Exception as exc:  # a variant that does not compile or launch
            failures.append(f"{label}: {name} failed to run: {exc!r}")
            print(f"FAIL {label}: {name}: {exc!r}")
    calls = {name: fn for name, fn in calls.items() if name in outs}
    # float64 references of a few experts (first, middle, last) keep the run short; the
    # bitwise comparison covers every written row.
    ref_experts = sorted({0, experts // 2, experts - 1})[: max(1, args.ref_experts)]
    errs = _errors(outs, a, a_scale, w, sched, ref_experts)
    ms = _interleaved_ms(calls, args.rounds)
    flop = 2.0 * tokens * n * k  # routed rows only (padding rows are not work)
    entry = dict(label=label, experts=experts, tokens=tokens, used_rows=used, n=n, k=k)
    entry["reference_experts"] = ref_experts
    entry["kernels"] = {}
    base = outs.get("triton")
    for name in calls:
        same = bool(torch.equal(outs[name][:used], base[:used])) if base is not None else None
        e = errs[name]
        speedup = ms["triton"] / ms[name] if "triton" in ms else None
        entry["kernels"][name] = dict(
            ms=ms[name],
            tflops=flop / ms[name] / 1e9,
            speedup=speedup,
            bitwise_equal_to_triton=same,
            **e,
        )
        checked = name not in ceilings
        entry["kernels"][name]["checked"] = checked
        if checked and (e["nonfinite"] or e["max_norm"] > NORM_ERR_LIMIT):
            failures.append(
                f"{label}: {name} max|C-C64|/max|C64| = {e['max_norm']:.3g} "
                f"(limit {NORM_ERR_LIMIT:.3g}), {e['nonfinite']} non-finite"
            )
        if checked and args.require_bitwise and same is False:
            failures.append(f"{label}: {name} is not bitwise equal to grouped_mm")
        print(
            f"{label:22s} {name:16s} {ms[name]:7.3f} ms {flop / ms[name] / 1e9:7.1f} TFLOP/s "
            f"x{speedup or 0:.3f}  bitwise={same}  max_abs={e['max_abs']:.3g} "
            f"norm={e['max_norm']:.3g} rel={e['max_rel']:.3g}",
            flush=True,
        )
    return entry


def gpu_main(variants: list[Variant], args) -> int:
    """Correctness (bits against grouped_mm, error against float64) and interleaved timing of
    grouped_mm and each variant at each shape; a JSON record; non-zero on a failure."""
    if not torch.cuda.is_available():
        print("no CUDA device: use --compile-only on this machine")
        return 2
    if args.rounds < 20:
        print("--rounds must be at least 20")
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    shapes = [s for s in SHAPES if not args.shapes or any(w in s[0] for w in args.shapes)]
    record = dict(
        gpu=torch.cuda.get_device_name(),
        commit=os.environ.get("MEGAMOE_COMMIT"),
        torch=torch.__version__,
        triton=triton.__version__,
        rounds=args.rounds,
        norm_err_limit=NORM_ERR_LIMIT,
        variants=[v.name for v in variants],
        shapes=[],
    )
    failures: list[str] = []
    for seed, shape in enumerate(shapes):
        record["shapes"].append(_run_shape(shape, seed, variants, args, failures))
        torch.cuda.empty_cache()
    record["failures"] = failures
    record["ok"] = not failures
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    for f in failures:
        print("CORRECTNESS FAILED:", f)
    print("gpu mode:", "FAILED" if failures else "ok")
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile-only", action="store_true", help="no GPU: compile and check")
    parser.add_argument("--keep", help="(compile-only) write each kernel's TTGIR/PTX here")
    parser.add_argument(
        "--variants",
        default=",".join(DEFAULT_VARIANTS),
        help="comma-separated tile variants: 128x128|64x256[:stages][:pingpong][:early][:ceiling]",
    )
    parser.add_argument("--out", help="(GPU) write the JSON record here")
    parser.add_argument("--rounds", type=int, default=25, help="(GPU) timed rounds, >= 20")
    parser.add_argument(
        "--shapes", nargs="*", help="(GPU) only shapes whose label contains one of these words"
    )
    parser.add_argument(
        "--ref-experts", type=int, default=3, help="(GPU) first/middle/last experts vs float64"
    )
    parser.add_argument(
        "--require-bitwise",
        action="store_true",
        help="(GPU) also fail when an output is not bitwise grouped_mm's",
    )
    args = parser.parse_args(argv)
    variants = [Variant.parse(v) for v in args.variants.split(",") if v]
    if args.compile_only:
        return compile_only(variants, args.keep)
    return gpu_main(variants, args)


if __name__ == "__main__":
    sys.exit(main())
