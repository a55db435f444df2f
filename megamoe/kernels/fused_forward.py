"""Fused forward: shared expert, pull dispatch, gate/up + SwiGLU, down and push combine in ONE
persistent kernel.

It replaces the unfused sequence ``dispatch_pull -> gate_up -> down -> combine_push`` (and the
shared expert's two GEMMs) of backend "triton"; the barriers around it and the local k-order
combine stay small separate launches.

Roles (one program per SM, ``launch_cooperative_grid=True`` so every program is resident):
  * programs ``[0, num_comm)`` first pull, minibatch by minibatch: minibatch m goes into ring
    slot ``m % slots`` once every down tile of the slot's previous occupant, minibatch
    ``m - slots``, is done (acquire on ``z_done``); each comm program copies a strided share
    (``comm.copy_rows``) and counts itself into ``ready[m]`` (release).
  * the other programs compute. They take tasks from an atomic ticket over a task list in
    topological order: first the shared expert's tiles over the T local tokens (no
    communication: they hide the first pulls), then the routed tiles. Each part is a list of
    groups of one minibatch of row blocks, column tiles outer (:func:`grouped_task`: L2 reuse),
    and a group's down tiles come ``LAG`` groups after its gate/up tiles. A routed gate/up
    tile waits for its minibatch's ``ready`` (acquire), runs ``gemm.gate_up_tile`` and counts
    itself into ``h_done[b]``; a down tile waits until ``h_done[b]`` counts every gate/up tile
    of the block, runs ``gemm.mm_acc``, stores its z tile, pushes the tile's rows (from L2)
    into the source ranks' combine slots (``comm.push_tile``: no push role) and counts
    itself into ``z_done[minibatch]``. Shared tiles use ``sh_done[b]`` and write
    ``shared_out`` for the combine epilogue.

Deadlock freedom: a task only waits on tasks earlier in the list (already taken by running
programs) or on the pulls, which wait only on down tiles of earlier minibatches that all come
earlier in the list: the routed lag is capped at ``(slots - 1) * blocks per minibatch``
(:func:`routed_lag`) so that every down tile of minibatch ``m - slots`` precedes the first
gate/up tile of minibatch m.

The tiles are the unfused kernels' device functions with the same tile shapes; rows sit at
``row % ring`` of the ring buffers, which changes addresses, not arithmetic. So ``xs, g, u, h,
z``, the pushed slots and the shared activations have the unfused path's bits for every
``num_comm``, ``minibatch_rows`` and ``ring_rows``. Every spin-wait has a budget
(``comm.wait_at_least``): on expiry it records (stage, index, peer, rank) in the workspace error
record and the program stops; the host raises ``StallError`` at its next check.

``PHASED`` (the CPU interpreter, which runs programs one after another): one program runs, per
minibatch m, every comm role's pull of m, then the compute tasks in ticket order up to the first
gate/up tile of minibatch m + 1; then the remaining tasks. Same source and the same waits (they
find their counters already complete).

Not yet (docs/fused.md): with a ring smaller than the rows the forward keeps only the ring, and
the backward replays the routed forward (backends/fused.py).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..workspace import Workspace, register_stage
from . import comm
from .gemm import _weight_2d, gate_up_tile, mm_acc, tiles_for
from .runtime import descriptor, empty, interpreting, persistent_programs
from .schedule import RowSchedule
from .tiles import cast, store_zeros

__all__ = ["FusedOutputs", "fused_forward", "STAGE_ROWS_READY", "STAGE_H_READY",
           "STAGE_RING_FREE", "STAGE_SHARED_H_READY", "FLAG_WORDS",
           "task_of", "grouped_task", "gate_up_start", "routed_lag", "down_lag_for",
           "comm_programs_for", "comm_kernel_programs", "fused_grid", "new_trace", "TRACE_KINDS",
           "flag_layout", "FlagLayout", "FUSED_WARPS", "FUSED_STAGES"]

# Stage codes of the fused forward's spin-waits in the error record (workspace.STAGE_NAMES).
STAGE_ROWS_READY = 10
STAGE_H_READY = 11
STAGE_Z_READY = 12  # the split comm kernel's pushes wait for a minibatch's down tiles
STAGE_RING_FREE = 13
STAGE_CORESIDENT = 15  # split: every program of both kernels running at once
STAGE_SHARED_H_READY = 14
register_stage(STAGE_ROWS_READY, "fused forward: pulled rows of a minibatch")
register_stage(STAGE_H_READY, "fused forward: h tiles of a row block")
register_stage(STAGE_RING_FREE, "fused forward: ring slot freed by the down tiles of its "
                                "previous minibatch (index = the minibatch to pull into it)")
register_stage(STAGE_SHARED_H_READY, "fused forward: shared-expert h tiles of a row block")
register_stage(STAGE_Z_READY, "fused forward (split comm kernel): down tiles of a minibatch")
register_stage(STAGE_CORESIDENT, "fused forward (split): every program of the compute and the "
                                 "comm kernel running at once (the flag counts the programs that "
                                 "started; the GPU did not run the two kernels side by side)")

# One warp count and pipeline depth for every role: the gate/up and down tiles must use the
# unfused kernels' warp count (8), which fixes the wgmma shapes and hence the bits. Stages only
# change the pipelining: 4 (as the unfused gate/up) needs ~197 KB of shared memory of 227.
FUSED_WARPS = 8
FUSED_STAGES = 4
# What one program does on an H200 at dsv3 shapes (BENCHMARKS.md, 2026-11-30): a pull program
# moves ~12 GB/s of rows over NVLink (291 GB/s with 24), a GEMM program ~5 TFLOP/s (660 / 132).
# At W = 1 every pulled row is local: 9 programs copied dsv3's 470 MB in 2.85 ms inside the
# kernel (fused_trace, one H200), 18 GB/s each.
PULL_GBPS_PER_PROGRAM = 12.0
LOCAL_PULL_GBPS_PER_PROGRAM = 18.0
GEMM_TFLOPS_PER_PROGRAM = 5.0
# Rows per step when a down tile pushes its z tile to the source ranks (comm.push_tile): 32 x 256
# bf16 = 16 KB per step, 16 registers per thread (the tile's fp32 accumulator is already dead).
PUSH_CHUNK_ROWS = 32
# Smallest half block that runs as half tiles (routed_task's HALF): tl.dot needs 16 rows.
MIN_HALF_ROWS = 16
# The comm kernel (config.comm_kernel): small programs beside the compute kernel's, at most one
# per SM. Its registers and shared memory must fit next to a compute program (208 registers x
# 256 threads, 192 KB): 4 warps capped at 80 registers and 16 KB copy tiles do (at dsv3 it
# needs 78; a row width that is not a multiple of the tile's 1024 columns wanted 159 uncapped).
COMM_KERNEL_TILE_BYTES = 16 * 1024
COMM_KERNEL_WARPS = 4
COMM_KERNEL_REGISTERS = 80
# One comm program per this many SMs: the rest of the SMs run MMAs undisturbed. dsv3 at W = 2
# (BENCHMARKS.md): 16 programs 7.45 ms (the copies finish last), 24: 6.03, 33: 5.97, 48: 5.94,
# 66: 5.95, 132: 6.16; one kernel with 9 comm programs: 6.27-6.29.
COMM_KERNEL_SM_SHARE = 2
# Per-SM limits of sm_90 that a compute and a comm program must share (CUDA occupancy rules):
# registers are given per warp in units of 256, and each program reserves 1 KB of shared memory.
SM90_REGISTERS_PER_SM = 64 * 1024
SM90_REGISTER_UNIT = 256
SM90_SHARED_PER_SM = 228 * 1024
SM90_SHARED_RESERVED_PER_PROGRAM = 1024
# Phases of the comm kernel (bit flags, constexpr): the interpreter runs the pulls, then the
# compute kernel, then the pushes; a GPU runs both phases in one launch beside the compute kernel.
COMM_PULL, COMM_PUSH, COMM_BOTH = 1, 2, 3
_CU_FUNC_CACHE_PREFER_SHARED = 1
_CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT = 9
_CARVEOUT_ALL_SHARED = 100  # percent of the SM's L1 / shared memory that is shared memory
_PREFERRED: set[int] = set()


def _prefer_shared(kernel):
    """Load ``kernel`` and ask the driver for the largest shared-memory carveout for it: the
    compute and the comm kernel share SMs only if both run with the same one."""
    import ctypes
    kernel._init_handles()
    if kernel.function in _PREFERRED:
        return kernel
    cuda = ctypes.CDLL("libcuda.so.1")
    fn = ctypes.c_void_p(kernel.function)
    for what, err in (("cache config", cuda.cuFuncSetCacheConfig(
            fn, _CU_FUNC_CACHE_PREFER_SHARED)), ("carveout", cuda.cuFuncSetAttribute(
            fn, _CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, _CARVEOUT_ALL_SHARED))):
        if err:
            raise RuntimeError(f"setting a split kernel's shared-memory {what} failed: CUDA "
                               f"error {err}")
    _PREFERRED.add(kernel.function)
    return kernel


def comm_kernel_programs(device: torch.device) -> int:
    """Programs of the comm kernel when the config leaves them to the kernel."""
    return max(1, persistent_programs(device) // COMM_KERNEL_SM_SHARE)


def sm_usage(programs: list[tuple[int, int, int]]) -> tuple[int, int]:
    """(registers, shared memory bytes) that programs given as (registers per thread, warps,
    shared bytes) hold together on one sm_90 SM."""
    regs = sum(-(-r * 32 // SM90_REGISTER_UNIT) * SM90_REGISTER_UNIT * w for r, w, _ in programs)
    return regs, sum(b + SM90_SHARED_RESERVED_PER_PROGRAM for _, _, b in programs)


def _check_side_by_side(compute, comm_kernel) -> None:
    """Refuse a pair of programs that cannot share an SM: the compute kernel's programs would
    wait at the start-up count for comm programs the GPU never places."""
    pair = [(k.n_regs, k.metadata.num_warps, k.metadata.shared) for k in (compute, comm_kernel)]
    regs, smem = sm_usage(pair)
    if regs > SM90_REGISTERS_PER_SM or smem > SM90_SHARED_PER_SM:
        raise RuntimeError(
            f"comm_kernel: a compute program and a comm program (registers per thread, warps, "
            f"shared bytes: {pair[0]} and {pair[1]}) need {regs} registers and {smem} B of "
            f"shared memory per SM, more than the {SM90_REGISTERS_PER_SM} and "
            f"{SM90_SHARED_PER_SM} B an SM has: run with config.comm_kernel=False")


@functools.lru_cache(maxsize=None)
def _comm_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


# Words before the counters in the flag buffer: the compute task ticket.
FLAG_WORDS = 2  # the compute task ticket, then (split) the programs that arrived

_FLAG_WORDS = tl.constexpr(FLAG_WORDS)
# Event kinds of a traced launch (fused_forward(trace=...), megamoe.fused_trace).
TRACE_KINDS = {0: "pull", 1: "shared gate/up", 2: "shared down", 3: "gate/up", 4: "down"}
_TRACE_PULL = tl.constexpr(0)
_TRACE_SHARED_GATE_UP = tl.constexpr(1)
_TRACE_SHARED_DOWN = tl.constexpr(2)
_TRACE_GATE_UP = tl.constexpr(3)
_TRACE_DOWN = tl.constexpr(4)
_STAGE_ROWS = tl.constexpr(STAGE_ROWS_READY)
_STAGE_H = tl.constexpr(STAGE_H_READY)
_STAGE_RING = tl.constexpr(STAGE_RING_FREE)
_STAGE_Z = tl.constexpr(STAGE_Z_READY)
_STAGE_CORESIDENT = tl.constexpr(STAGE_CORESIDENT)
_STAGE_SHARED_H = tl.constexpr(STAGE_SHARED_H_READY)


@triton.jit
def arrive_all(flags_ptr, everyone, err_ptr, rank, budget):
    """Count this program as started and wait until ``everyone`` did (both kernels of the split
    variant): programs that wait on each other must all be resident; if the GPU does not run
    them side by side, this stalls first and names that."""
    tl.atomic_add(flags_ptr + 1, 1, sem="relaxed", scope="gpu")
    return wait_count(flags_ptr + 1, everyone, err_ptr, _STAGE_CORESIDENT, 0, rank, budget)


# --------------------------------------------------------------------------------------------
# Flags


@triton.jit
def publish_writes(GPU: tl.constexpr):
    """Make this program's TMA stores (async proxy) complete and visible before a release.

    Triton waits only for the shared-memory source of a TMA store (``wait_group.read``); a
    consumer on another SM needs the global writes done, and generic-proxy readers need the
    proxy fence. Every thread runs it (only the issuing thread has bulk groups); the CTA barrier
    in :func:`signal` follows. No-op under the interpreter (stores are immediate there).
    """
    if GPU:
        tl.inline_asm_elementwise("cp.async.bulk.wait_group 0; fence.proxy.async.global; "
                                  "mov.u32 $0, 0;", "=r,r", [tl.full([1], 0, tl.int32)],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def acquire_for_tma(GPU: tl.constexpr):
    """After an acquire: order later TMA loads (async proxy) after the generic-proxy sync."""
    if GPU:
        tl.inline_asm_elementwise("fence.proxy.async.global; mov.u32 $0, 0;", "=r,r",
                                  [tl.full([1], 0, tl.int32)], dtype=tl.int32, is_pure=False,
                                  pack=1)
    tl.debug_barrier()


@triton.jit
def signal(flag_ptr):
    """Count this program into ``flag`` (release: everything it wrote before is visible)."""
    tl.debug_barrier()
    tl.atomic_add(flag_ptr, 1, sem="release", scope="gpu")


@triton.jit
def clock(TRACE: tl.constexpr):
    """The GPU's global nanosecond timer when tracing (one read per event), else 0."""
    if TRACE:
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r",
                                      [tl.full([1], 0, tl.int32)], dtype=tl.int64, is_pure=False,
                                      pack=1)
        return tl.sum(t, axis=0)
    else:
        return 0


@triton.jit
def trace_start(trace_ptr, max_events, slot, TRACE: tl.constexpr):
    """Start event ``slot`` of this program in ``trace [programs, max_events, 3]`` (int64): its
    start time goes to memory at once, so no timer value stays live across the task."""
    if TRACE:
        if slot < max_events:
            at = trace_ptr + (tl.program_id(0).to(tl.int64) * max_events + slot) * 3
            tl.store(at + 1, clock(TRACE))


@triton.jit
def trace_end(trace_ptr, max_events, slot, kind, index, TRACE: tl.constexpr):
    """End event ``slot``: (kind << 32 | index) and the end time; past ``max_events`` dropped."""
    if TRACE:
        if slot < max_events:
            at = trace_ptr + (tl.program_id(0).to(tl.int64) * max_events + slot) * 3
            tl.store(at + 2, clock(TRACE))
            tl.store(at, (tl.cast(kind, tl.int64) << 32) | tl.cast(index, tl.int64))


@triton.jit
def wait_count(flag_ptr, wanted, err_ptr, stage, index, rank, budget):
    """Spin (acquire) until ``flag >= wanted``; False (and a stall record) if the budget ran out.

    ``comm.wait_at_least`` on one local flag (GPU scope: every counter of the kernel is set by
    this GPU's programs); the record names this rank as the 'peer'.
    """
    one = tl.arange(0, 1)
    return comm.wait_at_least(flag_ptr + one, one == 0, one + rank, wanted, budget, err_ptr,
                              stage, index, rank, "gpu")


# --------------------------------------------------------------------------------------------
# Comm roles


@triton.jit
def pull_minibatch(m, x_table, xs_ptr, row_src_ptr, ready_ptr, z_done_ptr, used_rows, ring,
                   slots, role, T, H, rank, budget, err_ptr, tiles_down, NUM_COMM: tl.constexpr,
                   MB: tl.constexpr, BM: tl.constexpr, TOP_K: tl.constexpr, ROWS: tl.constexpr,
                   COLS: tl.constexpr, UPCAST: tl.constexpr):
    """Comm role ``role``: wait until ring slot ``m % slots`` is free (every down tile of its
    previous occupant, minibatch ``m - slots``, stored and pushed), pull its share of minibatch
    m into it, count into ``ready[m]``."""
    alive = True
    if m >= slots:
        # m - slots is a full minibatch (only the last one can be partial)
        alive = wait_count(z_done_ptr + m - slots, (MB // BM) * tiles_down, err_ptr, _STAGE_RING, m,
                           rank, budget)
    if alive:
        row_begin = m * MB
        row_end = tl.minimum(row_begin + MB, used_rows)
        comm.copy_rows(x_table, x_table, xs_ptr + (row_begin % ring).to(tl.int64) * H, H,
                       row_src_ptr, row_begin, row_end, role, NUM_COMM, T, H, TOP_K, False, ROWS,
                       COLS, UPCAST)
        signal(ready_ptr + m)
    return alive


@triton.jit
def comm_role(x_table, xs_ptr, row_src_ptr, ready_ptr, z_done_ptr, used_rows, ring, slots, role,
              T, H, rank, budget, err_ptr, tiles_down, m_begin, m_end, trace_ptr, max_events,
              NUM_COMM: tl.constexpr, MB: tl.constexpr, BM: tl.constexpr, TOP_K: tl.constexpr,
              ROWS: tl.constexpr, COLS: tl.constexpr, TRACE: tl.constexpr,
              UPCAST: tl.constexpr):
    """Comm role ``role``: pull minibatches ``[m_begin, m_end)`` in order; False if a wait gave
    up. Traced: one event per minibatch (kind ``TRACE_PULL``, slot m)."""
    m = m_begin
    alive = True
    while (m < m_end) & alive:
        trace_start(trace_ptr, max_events, m, TRACE)
        alive = pull_minibatch(m, x_table, xs_ptr, row_src_ptr, ready_ptr, z_done_ptr, used_rows,
                               ring, slots, role, T, H, rank, budget, err_ptr, tiles_down,
                               NUM_COMM, MB, BM, TOP_K, ROWS, COLS, UPCAST)
        trace_end(trace_ptr, max_events, m, _TRACE_PULL, m, TRACE)
        m += 1
    return alive


# --------------------------------------------------------------------------------------------
# Task list


@triton.jit
def task_of(t, num_blocks, n1, n2, LAG: tl.constexpr):
    """(is gate/up, row block, column tile) of task ``t`` of one part of the list.

    The part is made of groups s = 0, 1, ...: group s holds the gate/up tiles of block s (if it
    exists) followed by the down tiles of block s - LAG (if it exists). A block's down tiles thus
    come LAG groups after its gate/up tiles: topological order (no deadlock), and the programs
    that take them rarely find the block's h tiles still running.
    """
    head_blocks = tl.minimum(LAG, num_blocks)
    head = head_blocks * n1  # groups 0..LAG-1: gate/up tiles only
    mid_blocks = num_blocks - head_blocks  # groups LAG..num_blocks-1: both kinds
    mid = mid_blocks * (n1 + n2)
    t1 = t - head
    t2 = t1 - mid  # the last LAG groups: down tiles only
    s = LAG + t1 // (n1 + n2)
    j = t1 % (n1 + n2)
    is_gate_up = (t < head) | ((t1 < mid) & (j < n1))
    block = tl.where(t < head, t // n1,
                     tl.where(t1 < mid, tl.where(j < n1, s, s - LAG), mid_blocks + t2 // n2))
    col = tl.where(t < head, t % n1, tl.where(t1 < mid, tl.where(j < n1, j, j - n1), t2 % n2))
    return is_gate_up, block, col


@triton.jit
def grouped_task(t, num_blocks, n1, n2, LAG: tl.constexpr, G: tl.constexpr):
    """(is gate/up, row block, column tile, real) of task ``t`` of a part whose list groups G row
    blocks: :func:`task_of` over groups of G blocks with G-times wider column ranges, the G blocks
    inner. Programs running at the same time then share one weight column tile in L2 and reuse
    the group's A rows across columns. Past the last block (a partial last group) a task is not
    ``real``: it does nothing and signals nothing."""
    is_gate_up, group, jj = task_of(t, tl.cdiv(num_blocks, G), n1 * G, n2 * G, LAG)
    block = group * G + jj % G
    return is_gate_up, block, jj // G, block < num_blocks


@triton.jit
def part_length(num_blocks, n1, n2, G: tl.constexpr):
    """Tasks in a part of :func:`grouped_task`'s list (a partial last group counts whole)."""
    return tl.cdiv(num_blocks, G) * G * (n1 + n2)


@triton.jit
def task_kind(task, shared_total, shared_blocks, num_blocks, n1_shared, n1, n2,
              LAG: tl.constexpr, SHARED_LAG: tl.constexpr, G: tl.constexpr):
    """The trace kind of list position ``task``: shared or routed, gate/up or down."""
    if task < shared_total:
        is_gate_up = grouped_task(task, shared_blocks, n1_shared, n2, SHARED_LAG, G)[0]
        kind = tl.where(is_gate_up, _TRACE_SHARED_GATE_UP, _TRACE_SHARED_DOWN)
    else:
        is_gate_up = grouped_task(task - shared_total, num_blocks, n1, n2, LAG, G)[0]
        kind = tl.where(is_gate_up, _TRACE_GATE_UP, _TRACE_DOWN)
    return kind


@triton.jit
def gate_up_start(block, num_blocks, n1, n2, LAG: tl.constexpr):
    """Position (in :func:`task_of`'s list) of the first gate/up tile of ``block``; the part's
    length when ``block >= num_blocks``."""
    pos = tl.where(block < LAG, block * n1, LAG * n1 + (block - LAG) * (n1 + n2))
    return tl.where(block < num_blocks, pos, num_blocks * (n1 + n2))


def comm_programs_for(programs: int, intermediate: int, world_size: int) -> int:
    """Pull programs for a grid of ``programs``: enough that the rows arrive as fast as the
    others compute them. A row of H bf16 (2H bytes) brings 6·H·I FLOPs, so pulls keep up when
    c / (programs - c) >= 2 * GEMM rate / (6 * I * pull rate) per program; the smallest such c.
    The pull rate is NVLink's at W > 1 and a local copy's at W = 1.
    """
    pull = PULL_GBPS_PER_PROGRAM if world_size > 1 else LOCAL_PULL_GBPS_PER_PROGRAM
    ratio = 2 * GEMM_TFLOPS_PER_PROGRAM * 1e12 / (6 * intermediate * pull * 1e9)
    return max(1, min(programs - 1, math.ceil(programs * ratio / (1 + ratio))))


def down_lag_for(programs: int, group_blocks: int, hidden: int, inter: int, bn1: int,
                 bn2: int) -> int:
    """Groups between a group's gate/up tiles and its down tiles in the task list.

    A down tile should find its block's h done when it is taken: the last gate/up tile of the
    block was taken about ``lag`` groups of work earlier, and runs for one gate/up tile time, in
    which all ``programs`` together take ``programs * gate/up tile work`` of the list. So lag =
    that work over one group's work, rounded up, plus one group of margin (the shapes' FLOPs per
    tile: gate/up 2 * BN1 * H, down BN2 * I, per row)."""
    n1, n2 = -(-inter // bn1), -(-hidden // bn2)
    gate_up = 2 * bn1 * hidden
    group = group_blocks * (n1 * gate_up + n2 * bn2 * inter)
    return -(-programs * gate_up // group) + 1


def routed_lag(lag: int, slots: int, blocks_per_minibatch: int, max_minibatches: int) -> int:
    """The routed part's down lag: ``lag``, capped so that every down tile of minibatch
    ``m - slots`` comes before the first gate/up tile of minibatch m (whose pull waits for those
    rows' pushes). No cap when the ring never wraps."""
    if slots >= max_minibatches:
        return lag
    return min(lag, (slots - 1) * blocks_per_minibatch)


# --------------------------------------------------------------------------------------------
# Compute role


@triton.jit
def take_task(ticket_ptr, limit, PHASED: tl.constexpr):
    """The next ticket; under PHASED only if it is below ``limit`` (else ``limit``, untaken):
    the sequential driver runs the list in rounds."""
    if PHASED:
        task = tl.atomic_add(ticket_ptr, 0, sem="relaxed", scope="gpu")
        if task < limit:
            task = tl.atomic_add(ticket_ptr, 1, sem="relaxed", scope="gpu")
        else:
            task = limit
    else:
        task = tl.atomic_add(ticket_ptr, 1, sem="relaxed", scope="gpu")
    return task


@triton.jit
def half_padding(row_src_ptr, row, HALF: tl.constexpr, BM: tl.constexpr):
    """With ``HALF``: is the second half of the row block at layout row ``row`` padding? (An
    expert's padding sits at the end of its last block, so its first padding row decides.)"""
    if HALF:
        return tl.load(row_src_ptr + row + BM // 2) < 0
    else:
        return False


@triton.jit
def routed_task(t, xs_desc, wg_desc, wu_desc, g_desc, u_desc, h_desc, h_in_desc, wd_desc, z_desc,
                half_descs, combine_table, z_ptr, row_src_ptr, block_expert_ptr, ready_ptr,
                h_done_ptr, z_done_ptr, num_blocks, ring, T, H, I, rank, budget, err_ptr,
                NUM_COMM: tl.constexpr, MB: tl.constexpr, BM: tl.constexpr, BN1: tl.constexpr,
                BK1: tl.constexpr, BN2: tl.constexpr, BK2: tl.constexpr, TOP_K: tl.constexpr,
                PUSH_CHUNK: tl.constexpr, LAG: tl.constexpr, RING_WRAPS: tl.constexpr,
                SPLIT: tl.constexpr, HALF: tl.constexpr, GPU: tl.constexpr,
                UPCAST: tl.constexpr):
    """Routed task t (of the routed part); False if its wait gave up.

    ``HALF``: a block whose second half is padding (an expert's last block with at most BM / 2
    rows) runs its gate/up tiles (and with ``SPLIT`` its down tiles) BM / 2 rows high
    (``half_descs``: xs, g, u, h, h_in and z with BM / 2-row boxes) and stores zeros into the
    padding half, as the full tile would have (the backward reads those rows): the same bits,
    half the MMAs.

    A down tile stores its z tile (TMA), waits for it, and pushes its rows from there (L2) into
    the source ranks' combine slots (``comm.push_tile``). It counts itself into its minibatch's
    ``z_done`` only when the ring wraps (``RING_WRAPS``: the pulls of a later minibatch wait for
    it); otherwise nobody reads the count, and a release there may wait for the pushed rows
    to land on the peer."""
    n1 = tl.cdiv(I, BN1)
    is_gate_up, b, j, real = grouped_task(t, num_blocks, n1, tl.cdiv(H, BN2), LAG, MB // BM)
    expert = tl.load(block_expert_ptr + b, mask=real, other=0)
    row = b * BM
    at = row % ring  # the block's rows in the ring
    mb = row // MB
    alive = True
    if not real:
        pass
    elif is_gate_up:
        alive = wait_count(ready_ptr + mb, NUM_COMM, err_ptr, _STAGE_ROWS, mb, rank, budget)
        if alive:
            acquire_for_tma(GPU)
            col = j * BN1
            if half_padding(row_src_ptr, row, HALF, BM):
                xs_h, g_h, u_h, h_h, _, _ = half_descs
                gate_up_tile(xs_h, wg_desc, wu_desc, g_h, u_h, h_h, expert, at, col, I, H,
                             BM // 2, BN1, BK1, UPCAST)
                store_zeros(g_h, at + BM // 2, col, BM // 2, BN1)
                store_zeros(u_h, at + BM // 2, col, BM // 2, BN1)
                store_zeros(h_h, at + BM // 2, col, BM // 2, BN1)
            else:
                gate_up_tile(xs_desc, wg_desc, wu_desc, g_desc, u_desc, h_desc, expert, at, col,
                             I, H, BM, BN1, BK1, UPCAST)
            publish_writes(GPU)
            signal(h_done_ptr + b)
    else:
        alive = wait_count(h_done_ptr + b, n1, err_ptr, _STAGE_H, b, rank, budget)
        if alive:
            acquire_for_tma(GPU)
            col = j * BN2
            # (only with the comm kernel: a half down tile that pushes its rows itself made
            # ptxas spill)
            if half_padding(row_src_ptr, row, HALF and SPLIT, BM):
                _, _, _, _, h_in_h, z_h = half_descs
                acc_h = mm_acc(tl.zeros([BM // 2, BN2], dtype=tl.float32), h_in_h, wd_desc,
                               expert, at, col, H, I, BK2, BN2, False, UPCAST)
                z_h.store([at, col], cast(acc_h, z_h.dtype, UPCAST))
                store_zeros(z_h, at + BM // 2, col, BM // 2, BN2)
            else:
                acc = mm_acc(tl.zeros([BM, BN2], dtype=tl.float32), h_in_desc, wd_desc, expert,
                             at, col, H, I, BK2, BN2, False, UPCAST)
                z_desc.store([at, col], cast(acc, z_desc.dtype, UPCAST))
            publish_writes(GPU)  # the TMA store is done and visible to the generic loads
            if SPLIT:  # the comm kernel pushes the minibatch once all its tiles are stored
                signal(z_done_ptr + mb)
            else:
                tl.debug_barrier()
                comm.push_tile(z_ptr + at.to(tl.int64) * H, H, combine_table, row_src_ptr, row,
                               col, T, H, TOP_K, BM, BN2, PUSH_CHUNK)
                if RING_WRAPS:
                    signal(z_done_ptr + mb)
    return alive


@triton.jit
def shared_task(t, x_desc, sgw_desc, suw_desc, sg_desc, su_desc, sh_desc, sh_in_desc, sdw_desc,
                so_desc, sh_done_ptr, shared_blocks, H, IS, rank, budget, err_ptr,
                BM: tl.constexpr, BN1: tl.constexpr, BK1: tl.constexpr, BN2: tl.constexpr,
                BK2: tl.constexpr, LAG: tl.constexpr, G: tl.constexpr, GPU: tl.constexpr,
                UPCAST: tl.constexpr):
    """Shared-expert task t over the T local tokens (one 'expert', rows in token order, as
    ``gemm.gate_up`` / ``gemm.grouped_mm`` over ``uniform_schedule``); False if its wait gave
    up. Its output is read after the kernel (the combine epilogue): no signal."""
    n1 = tl.cdiv(IS, BN1)
    is_gate_up, b, j, real = grouped_task(t, shared_blocks, n1, tl.cdiv(H, BN2), LAG, G)
    row = b * BM
    alive = True
    if not real:
        pass
    elif is_gate_up:
        gate_up_tile(x_desc, sgw_desc, suw_desc, sg_desc, su_desc, sh_desc, 0, row, j * BN1, IS,
                     H, BM, BN1, BK1, UPCAST)
        publish_writes(GPU)
        signal(sh_done_ptr + b)
    else:
        alive = wait_count(sh_done_ptr + b, n1, err_ptr, _STAGE_SHARED_H, b, rank, budget)
        if alive:
            acquire_for_tma(GPU)
            col = j * BN2
            acc = mm_acc(tl.zeros([BM, BN2], dtype=tl.float32), sh_in_desc, sdw_desc, 0, row,
                         col, H, IS, BK2, BN2, False, UPCAST)
            so_desc.store([row, col], cast(acc, so_desc.dtype, UPCAST))
    return alive


@triton.jit
def compute_role(limit, xs_desc, wg_desc, wu_desc, g_desc, u_desc, h_desc, h_in_desc, wd_desc,
                 z_desc, half_descs, x_desc, sgw_desc, suw_desc, sg_desc, su_desc, sh_desc,
                 sh_in_desc, sdw_desc, so_desc, combine_table, z_ptr, row_src_ptr,
                 block_expert_ptr, ticket_ptr, ready_ptr, h_done_ptr, z_done_ptr, sh_done_ptr,
                 num_blocks, shared_blocks, shared_total, ring, T, H, I, IS, rank, budget,
                 err_ptr, NUM_COMM: tl.constexpr, MB: tl.constexpr, BM: tl.constexpr,
                 BN1: tl.constexpr, BK1: tl.constexpr, BN2: tl.constexpr, BK2: tl.constexpr,
                 TOP_K: tl.constexpr, PUSH_CHUNK: tl.constexpr, LAG: tl.constexpr,
                 RING_WRAPS: tl.constexpr, SHARED_LAG: tl.constexpr, SHARED: tl.constexpr,
                 SPLIT: tl.constexpr, HALF: tl.constexpr, trace_ptr, max_events, first_event,
                 TRACE: tl.constexpr, PHASED: tl.constexpr, GPU: tl.constexpr,
                 UPCAST: tl.constexpr):
    """Take tasks from the ticket until ``limit`` or a wait gave up. The list: the shared part
    (``SHARED``: its first ``shared_total`` positions, :func:`task_counts`), then the routed
    part. Traced: one event per task (its kind, its position in the list), the wait included,
    from trace slot ``first_event`` on."""
    task = take_task(ticket_ptr, limit, PHASED)
    alive = True
    n = first_event
    while (task < limit) & alive:
        trace_start(trace_ptr, max_events, n, TRACE)
        if SHARED:
            if task < shared_total:
                alive = shared_task(task, x_desc, sgw_desc, suw_desc, sg_desc, su_desc, sh_desc,
                                    sh_in_desc, sdw_desc, so_desc, sh_done_ptr, shared_blocks, H,
                                    IS, rank, budget, err_ptr, BM, BN1, BK1, BN2, BK2,
                                    SHARED_LAG, MB // BM, GPU, UPCAST)
            else:
                alive = routed_task(task - shared_total, xs_desc, wg_desc, wu_desc, g_desc,
                                    u_desc, h_desc, h_in_desc, wd_desc, z_desc, half_descs,
                                    combine_table, z_ptr, row_src_ptr, block_expert_ptr,
                                    ready_ptr, h_done_ptr, z_done_ptr, num_blocks, ring, T, H, I,
                                    rank, budget, err_ptr, NUM_COMM, MB, BM, BN1, BK1, BN2, BK2,
                                    TOP_K, PUSH_CHUNK, LAG, RING_WRAPS, SPLIT, HALF, GPU, UPCAST)
        else:
            alive = routed_task(task, xs_desc, wg_desc, wu_desc, g_desc, u_desc, h_desc,
                                h_in_desc, wd_desc, z_desc, half_descs, combine_table, z_ptr,
                                row_src_ptr, block_expert_ptr, ready_ptr, h_done_ptr, z_done_ptr,
                                num_blocks, ring, T, H, I, rank, budget, err_ptr, NUM_COMM, MB, BM,
                                BN1, BK1, BN2, BK2, TOP_K, PUSH_CHUNK, LAG, RING_WRAPS, SPLIT,
                                HALF, GPU, UPCAST)
        if TRACE:
            trace_end(trace_ptr, max_events, n, task_kind(task, shared_total, shared_blocks,
                                                          num_blocks, tl.cdiv(IS, BN1),
                                                          tl.cdiv(I, BN1), tl.cdiv(H, BN2), LAG,
                                                          SHARED_LAG, MB // BM),
                      task, TRACE)
            n += 1
        if alive:
            task = take_task(ticket_ptr, limit, PHASED)


# --------------------------------------------------------------------------------------------
# The kernel


@triton.jit
def flag_pointers(flags_ptr, max_mb, max_blocks):
    """The counters in the flag buffer (zeroed per launch, :func:`flag_layout`):
    ``[ticket | ready[max_mb] | z_done[max_mb] | h_done[max_blocks] | sh_done[shared blocks]]``."""
    ready_ptr = flags_ptr + _FLAG_WORDS
    z_done_ptr = ready_ptr + max_mb
    h_done_ptr = z_done_ptr + max_mb
    return flags_ptr, ready_ptr, z_done_ptr, h_done_ptr, h_done_ptr + max_blocks


@triton.jit
def task_counts(num_blocks_ptr, T, H, I, IS, MB: tl.constexpr, BM: tl.constexpr,
                BN1: tl.constexpr, BN2: tl.constexpr, SHARED: tl.constexpr):
    """(routed row blocks, shared row blocks, shared tasks, all tasks) of this launch."""
    num_blocks = tl.load(num_blocks_ptr)
    shared_blocks = tl.cdiv(T, BM)
    if SHARED:
        shared_total = part_length(shared_blocks, tl.cdiv(IS, BN1), tl.cdiv(H, BN2), MB // BM)
    else:
        shared_total = 0
    total = shared_total + part_length(num_blocks, tl.cdiv(I, BN1), tl.cdiv(H, BN2), MB // BM)
    return num_blocks, shared_blocks, shared_total, total


@triton.jit
def _fused_forward_kernel(x_table, combine_table, z_ptr, row_src_ptr, block_expert_ptr, num_blocks_ptr,
                          xs_ptr, xs_desc, wg_desc, wu_desc, g_desc, u_desc, h_desc, h_in_desc,
                          wd_desc, z_desc, xs_half_desc, g_half_desc, u_half_desc, h_half_desc,
                          h_in_half_desc, z_half_desc, x_desc, sgw_desc, suw_desc, sg_desc,
                          su_desc, sh_desc, sh_in_desc, sdw_desc, so_desc, flags_ptr, err_ptr,
                          trace_ptr, max_events, T, H, I, IS, rank, budget, ring, slots, max_mb,
                          max_blocks, everyone, NUM_COMM: tl.constexpr,
                          MB: tl.constexpr, BM: tl.constexpr, BN1: tl.constexpr,
                          BK1: tl.constexpr, BN2: tl.constexpr, BK2: tl.constexpr,
                          TOP_K: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
                          LAG: tl.constexpr, SHARED_LAG: tl.constexpr, SHARED: tl.constexpr,
                          PUSH_CHUNK: tl.constexpr, RING_WRAPS: tl.constexpr,
                          SPLIT: tl.constexpr, HALF: tl.constexpr, TRACE: tl.constexpr,
                          PHASED: tl.constexpr, GPU: tl.constexpr, UPCAST: tl.constexpr):
    # (separate arguments: Triton 3.6's launcher cannot pass descriptors inside a tuple)
    half_descs = (xs_half_desc, g_half_desc, u_half_desc, h_half_desc, h_in_half_desc,
                  z_half_desc)
    if SPLIT:  # (unconditional: a runtime test around it made ptxas spill)
        arrive_all(flags_ptr, everyone, err_ptr, rank, budget)
    ticket_ptr, ready_ptr, z_done_ptr, h_done_ptr, sh_done_ptr = flag_pointers(
        flags_ptr, max_mb, max_blocks)
    num_blocks, shared_blocks, shared_total, total = task_counts(
        num_blocks_ptr, T, H, I, IS, MB, BM, BN1, BN2, SHARED)
    used_rows = num_blocks * BM
    n_mb = tl.cdiv(used_rows, MB)
    tiles_down = tl.cdiv(H, BN2)
    n1 = tl.cdiv(I, BN1)
    G = MB // BM  # row blocks per task-list group: one minibatch
    first_event = 0
    if PHASED and not SPLIT:  # the interpreter: one program plays every role, in rounds
        m = 0
        while m < n_mb:
            # every task before the first gate/up tile of minibatch m ran: the down tiles of
            # m - slots are done (routed_lag), so the slot is free
            for role in range(NUM_COMM):
                comm_role(x_table, xs_ptr, row_src_ptr, ready_ptr, z_done_ptr, used_rows, ring,
                          slots, role, T, H, rank, budget, err_ptr, tiles_down, m, m + 1,
                          trace_ptr, max_events, NUM_COMM, MB, BM, TOP_K, ROWS, COLS, TRACE,
                          UPCAST)
            # every task before the first gate/up tile of minibatch m + 1 has its inputs now
            limit = shared_total + gate_up_start(m + 1, n_mb, n1 * G, tiles_down * G, LAG)
            compute_role(limit, xs_desc, wg_desc, wu_desc, g_desc, u_desc, h_desc, h_in_desc,
                         wd_desc, z_desc, half_descs, x_desc, sgw_desc, suw_desc, sg_desc,
                         su_desc, sh_desc, sh_in_desc, sdw_desc, so_desc, combine_table, z_ptr,
                         row_src_ptr, block_expert_ptr, ticket_ptr, ready_ptr, h_done_ptr,
                         z_done_ptr, sh_done_ptr, num_blocks, shared_blocks, shared_total, ring,
                         T, H, I, IS, rank, budget, err_ptr, NUM_COMM, MB, BM, BN1, BK1, BN2, BK2,
                         TOP_K, PUSH_CHUNK, LAG, RING_WRAPS, SHARED_LAG, SHARED, False, HALF,
                         trace_ptr, max_events, 0, TRACE, PHASED, GPU, UPCAST)
            m += 1
    else:
        # Comm programs pull, then take compute tasks like the others (the ticket hands out
        # what is left). They re-derive the compute role's values after their pulls: values
        # kept live across the pull loop made ptxas spill (255 registers; 210 without). A pull
        # that gave up left the error record, which makes the compute waits give up at once.
        if not SPLIT:  # (split: the comm kernel pulls)
            if tl.program_id(0) < NUM_COMM:
                comm_role(x_table, xs_ptr, row_src_ptr, ready_ptr, z_done_ptr, used_rows, ring, slots,
                          tl.program_id(0), T, H, rank, budget, err_ptr, tiles_down, 0, n_mb,
                          trace_ptr, max_events, NUM_COMM, MB, BM, TOP_K, ROWS, COLS, TRACE, UPCAST)
                first_event = n_mb  # trace slots 0..n_mb-1 hold the pulls
                ticket_ptr, ready_ptr, z_done_ptr, h_done_ptr, sh_done_ptr = flag_pointers(
                    flags_ptr, max_mb, max_blocks)
                num_blocks, shared_blocks, shared_total, total = task_counts(
                    num_blocks_ptr, T, H, I, IS, MB, BM, BN1, BN2, SHARED)
    # every program (PHASED: the one, after its rounds) takes the tasks that are left
    compute_role(total, xs_desc, wg_desc, wu_desc, g_desc, u_desc, h_desc, h_in_desc, wd_desc,
                 z_desc, half_descs, x_desc, sgw_desc, suw_desc, sg_desc, su_desc, sh_desc,
                 sh_in_desc, sdw_desc, so_desc, combine_table, z_ptr, row_src_ptr, block_expert_ptr,
                 ticket_ptr, ready_ptr, h_done_ptr, z_done_ptr, sh_done_ptr, num_blocks,
                 shared_blocks, shared_total, ring, T, H, I, IS, rank, budget, err_ptr, NUM_COMM,
                 MB, BM, BN1, BK1, BN2, BK2, TOP_K, PUSH_CHUNK, LAG, RING_WRAPS, SHARED_LAG,
                 SHARED, SPLIT, HALF, trace_ptr, max_events, first_event, TRACE, PHASED, GPU,
                 UPCAST)


@triton.jit
def _fused_comm_kernel(x_table, combine_table, z_ptr, row_src_ptr, num_blocks_ptr, xs_ptr,
                       flags_ptr, err_ptr, T, H, rank, budget, max_mb, max_blocks, everyone,
                       NUM_COMM: tl.constexpr, MB: tl.constexpr, BM: tl.constexpr,
                       BN2: tl.constexpr, TOP_K: tl.constexpr, ROWS: tl.constexpr,
                       COLS: tl.constexpr, PHASE: tl.constexpr, UPCAST: tl.constexpr):
    """``config.comm_kernel``: the forward's communication in a small kernel whose programs sit
    on SMs beside the compute kernel's (at most one per SM), so that the copies overlap the MMAs
    instead of taking SMs of their own: pull every minibatch (strided copy tasks, the
    comm role's), then push each minibatch's z rows once all of its down tiles are stored. The
    ring holds every row (no slot reuse). ``PHASE``: pulls, pushes or both (the interpreter
    runs the pulls, the compute kernel, then the pushes)."""
    ticket_ptr, ready_ptr, z_done_ptr, h_done_ptr, sh_done_ptr = flag_pointers(
        flags_ptr, max_mb, max_blocks)
    num_blocks = tl.load(num_blocks_ptr)
    used_rows = num_blocks * BM
    n_mb = tl.cdiv(used_rows, MB)
    tiles_down = tl.cdiv(H, BN2)
    role = tl.program_id(0)
    alive = True
    if everyone > 0:  # a stall here makes every later wait give up at once
        alive = arrive_all(flags_ptr, everyone, err_ptr, rank, budget)
    if PHASE & 1:  # COMM_PULL (literals: the interpreter passes PHASE as a plain int)
        alive = comm_role(x_table, xs_ptr, row_src_ptr, ready_ptr, z_done_ptr, used_rows,
                          n_mb * MB + MB, n_mb + 1, role, T, H, rank, budget, err_ptr,
                          tiles_down, 0, n_mb, flags_ptr, 0, NUM_COMM, MB, BM, TOP_K, ROWS,
                          COLS, False, UPCAST)  # a ring of every row: no slot waits
    m = 0
    while (m < n_mb) & alive & ((PHASE & 2) != 0):  # COMM_PUSH
        blocks = tl.minimum(MB // BM, num_blocks - m * (MB // BM))
        alive = wait_count(z_done_ptr + m, blocks * tiles_down, err_ptr, _STAGE_Z, m, rank,
                           budget)
        if alive:
            row_begin = m * MB
            comm.push_rows(z_ptr + row_begin.to(tl.int64) * H, H, combine_table, row_src_ptr,
                           row_begin, tl.minimum(row_begin + MB, used_rows), role, NUM_COMM, T,
                           H, TOP_K, ROWS, COLS)
        m += 1


# --------------------------------------------------------------------------------------------
# Host launcher


@dataclass(frozen=True)
class FusedOutputs:
    """What one launch leaves behind.

    ``xs, g, u, h, z``: the routed rows in the schedule's row layout when ``full`` (the ring
    holds every row), else the ring (``ring_rows`` rows; row r of the layout was at r % ring,
    the last occupant kept): not the whole context. ``shared`` = (sg, su, sh) [T, Is] and
    ``shared_out`` [T, H] (bf16) when a shared expert ran, else None.
    """

    xs: torch.Tensor
    g: torch.Tensor
    u: torch.Tensor
    h: torch.Tensor
    z: torch.Tensor
    full: bool
    ring_rows: int
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    shared_out: torch.Tensor | None = None


@dataclass(frozen=True)
class FlagLayout:
    """Word offsets of the counters in the flag buffer, and its length."""

    ticket: int
    ready: int
    z_done: int
    h_done: int
    sh_done: int
    words: int


def flag_layout(max_minibatches: int, max_blocks: int, shared_blocks: int) -> FlagLayout:
    """``[ticket | ready | z_done | h_done | sh_done]``, as the kernel addresses them."""
    ready = FLAG_WORDS
    z_done = ready + max_minibatches
    h_done = z_done + max_minibatches
    sh_done = h_done + max_blocks
    return FlagLayout(0, ready, z_done, h_done, sh_done, sh_done + shared_blocks)


def fused_grid(num_comm: int, device: torch.device, comm_kernel: bool = False) -> int:
    """Programs of the launch: one per SM on a GPU (comm + compute, or all computing beside the
    comm kernel's ``num_comm``); one program when phased."""
    if interpreting():
        return 1
    programs = persistent_programs(device)
    if comm_kernel and num_comm > programs:
        raise ValueError(f"num_comm ({num_comm}) comm kernel programs must sit at most one per "
                         f"SM: the GPU has {programs} SMs")
    if not comm_kernel and num_comm >= programs:
        raise ValueError(f"num_comm ({num_comm}) must leave compute programs: the GPU has "
                         f"{programs} SMs")
    return programs


def new_trace(device: torch.device, events: int = 4096) -> torch.Tensor:
    """An empty trace for :func:`fused_forward`: -1 marks events never written."""
    return torch.full((persistent_programs(device), events, 3), -1, dtype=torch.int64,
                      device=device)


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def fused_forward(ws: Workspace, sched: RowSchedule, w_gate: torch.Tensor, w_up: torch.Tensor,
                  w_down: torch.Tensor, num_comm: int | None, minibatch_rows: int,
                  ring_rows: int | None = None,
                  shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None
                  = None, budget: int | None = None, flags: torch.Tensor | None = None,
                  down_lag: int | None = None, trace: torch.Tensor | None = None,
                  comm_kernel: bool = False) -> FusedOutputs:
    """Shared expert, pull, routed expert GEMMs and push of this rank in one launch (no host sync).

    Call after the barrier that follows every rank's publish of x; the source ranks may read
    their combine slots after the next barrier. ``ring_rows`` (a multiple of ``minibatch_rows``;
    None: every row) bounds the routed buffers; when it is smaller than the schedule's rows the
    outputs hold only the ring (``FusedOutputs.full`` is False). ``shared``: (x [T, H] local
    tokens, s_gate [Is, H], s_up [Is, H], s_down [H, Is]) runs the shared expert as the first
    tasks. ``flags`` (int32, zeroed, :func:`flag_layout`) is a test hook: a pre-set counter
    reproduces a missing signal. ``num_comm`` None: :func:`comm_programs_for` the grid, I and W.
    ``down_lag``: groups (of one minibatch of row blocks) between a
    group's gate/up tiles and its down tiles in the task list (:func:`grouped_task`; speed only;
    None: :func:`down_lag_for` the grid and shapes). ``trace`` (GPU only; :func:`new_trace`):
    int64 ``[programs, events, 3]`` that receives one (kind << 32 | index, start ns, end ns) per
    pulled minibatch or task of each program (``megamoe.fused_trace`` reads it).
    ``comm_kernel`` (``MoEConfig.comm_kernel``): pull and push in :func:`_fused_comm_kernel`
    beside this kernel (on a side stream, joined before returning; ``num_comm`` of its programs,
    None: :func:`comm_kernel_programs`), every program of this kernel computing; needs a ring of
    every row; a ``trace`` then records the compute kernel's tasks (no pulls).
    """
    comm._check_schedule(ws, sched)
    if num_comm is None:
        num_comm = (comm_kernel_programs(ws.device) if comm_kernel else
                    comm_programs_for(persistent_programs(ws.device), w_gate.shape[1],
                                      ws.world_size))
    _check_int("num_comm", num_comm, 1)
    if down_lag is not None:
        _check_int("down_lag", down_lag, 0)
    bm = sched.block_rows
    _check_int("minibatch_rows", minibatch_rows, bm)
    if minibatch_rows % bm:
        raise ValueError(f"minibatch_rows ({minibatch_rows}) must be a multiple of the block "
                         f"rows ({bm})")
    rows = sched.rows
    max_mb = triton.cdiv(rows, minibatch_rows)
    if ring_rows is None:
        ring_rows = max_mb * minibatch_rows
    _check_int("ring_rows", ring_rows, minibatch_rows)
    if ring_rows % minibatch_rows:
        raise ValueError(f"ring_rows ({ring_rows}) must be a multiple of minibatch_rows "
                         f"({minibatch_rows})")
    dev, dtype = ws.device, ws.dtype
    h, i, t = ws.hidden, w_gate.shape[1], ws.num_tokens
    full = ring_rows >= rows
    buf_rows = rows if full else ring_rows
    slots = ring_rows // minibatch_rows
    xs, z = (empty((buf_rows, h), dtype, dev) for _ in range(2))
    g, u, hh = (empty((buf_rows, i), dtype, dev) for _ in range(3))
    t1, t2 = tiles_for("gate_up"), tiles_for("mm")
    xs_desc = descriptor(xs, [bm, t1.bk])
    wg_desc = descriptor(_weight_2d(w_gate), [t1.bn, t1.bk])
    wu_desc = descriptor(_weight_2d(w_up), [t1.bn, t1.bk])
    g_desc, u_desc, h_desc = (descriptor(o, [bm, t1.bn]) for o in (g, u, hh))
    h_in_desc = descriptor(hh, [bm, t2.bk])
    wd_desc = descriptor(_weight_2d(w_down), [t2.bn, t2.bk])
    z_desc = descriptor(z, [bm, t2.bn])
    half = bm // 2 >= MIN_HALF_ROWS  # (the interpreter's small blocks run whole)
    hm = bm // 2 if half else bm
    half_descs = (descriptor(xs, [hm, t1.bk]), *(descriptor(o, [hm, t1.bn]) for o in (g, u, hh)),
                  descriptor(hh, [hm, t2.bk]), descriptor(z, [hm, t2.bn]))
    if shared is not None:
        x, s_gate, s_up, s_down = shared
        i_s = s_gate.shape[0]
        if x.shape != (t, h) or x.dtype != dtype or not x.is_contiguous():
            raise ValueError(f"shared x must be a contiguous [{t}, {h}] {dtype} tensor, got "
                             f"{list(x.shape)} {x.dtype}")
        sg, su, sh = (empty((t, i_s), dtype, dev) for _ in range(3))
        shared_out = empty((t, h), dtype, dev)
        shared_descs = (descriptor(x, [bm, t1.bk]), descriptor(s_gate, [t1.bn, t1.bk]),
                        descriptor(s_up, [t1.bn, t1.bk]),
                        *(descriptor(o, [bm, t1.bn]) for o in (sg, su, sh)),
                        descriptor(sh, [bm, t2.bk]), descriptor(s_down, [t2.bn, t2.bk]),
                        descriptor(shared_out, [bm, t2.bn]))
        shared_blocks = triton.cdiv(t, bm)
    else:  # never read (SHARED=False removes the shared branch)
        i_s, sg, su, sh, shared_out, shared_blocks = 0, None, None, None, None, 0
        shared_descs = (xs_desc, wg_desc, wu_desc, g_desc, u_desc, h_desc, h_in_desc, wd_desc,
                        z_desc)
    layout = flag_layout(max_mb, sched.max_blocks, shared_blocks)
    if flags is None:
        flags = torch.zeros(layout.words, dtype=torch.int32, device=dev)
    elif flags.numel() < layout.words or flags.dtype != torch.int32:
        raise ValueError(f"flags must be int32 with >= {layout.words} words")
    copy_r, copy_c = comm.copy_tile(h, dtype.itemsize, comm.COPY_TILE_BYTES)
    grid = (fused_grid(num_comm, dev, comm_kernel),)
    if trace is not None:
        if interpreting():
            raise ValueError("trace needs a GPU (the interpreter runs the phased schedule)")
        if trace.dtype != torch.int64 or trace.dim() != 3 or trace.shape[0] != grid[0] \
                or trace.shape[2] != 3:
            raise ValueError(f"trace must be int64 [{grid[0]}, events, 3] (new_trace), got "
                             f"{trace.dtype} {list(trace.shape)}")
    if comm_kernel and not full:
        raise ValueError(f"comm_kernel needs a ring that holds every row: ring_rows None or >= "
                         f"{rows}, got {ring_rows}")
    group = minibatch_rows // bm  # row blocks per task-list group
    computing = grid[0] if comm_kernel else max(1, grid[0] - num_comm)
    lag = routed_lag(down_lag if down_lag is not None else
                     down_lag_for(computing, group, h, i, t1.bn, t2.bn), slots, 1, max_mb)
    shared_lag = (down_lag if down_lag is not None or shared is None else
                  down_lag_for(computing, group, h, i_s, t1.bn, t2.bn))
    # Programs that count themselves in at the start: with the comm kernel on a GPU those of both
    # kernels (they must run side by side); the interpreter runs the comm kernel's phases before
    # and after this one, which counts its own program only.
    arrivals = 0
    if comm_kernel:
        arrivals = grid[0] if interpreting() else grid[0] + num_comm
        cargs = (ws.peers.x, ws.peers.combine, z, sched.row_src, sched.num_blocks, xs, flags,
                 ws.errors, t, h, ws.rank, comm._budget(budget), max_mb, sched.max_blocks)
        cr, cc = comm.copy_tile(h, dtype.itemsize, COMM_KERNEL_TILE_BYTES)
        ckw = dict(NUM_COMM=num_comm, MB=minibatch_rows, BM=bm, BN2=t2.bn, TOP_K=ws.top_k,
                   ROWS=cr, COLS=cc, UPCAST=interpreting(), num_warps=COMM_KERNEL_WARPS,
                   maxnreg=COMM_KERNEL_REGISTERS)
        if interpreting():
            _fused_comm_kernel[(num_comm,)](*cargs, 0, PHASE=COMM_PULL, **ckw)
        else:
            # the side stream waits for this stream's work so far (the inputs), not for the
            # compute kernel launched next
            main = torch.cuda.current_stream(dev)
            side = _comm_stream(dev)
            side.wait_stream(main)
    fargs = (
        ws.peers.x, ws.peers.combine, z, sched.row_src, sched.block_expert, sched.num_blocks, xs,
        xs_desc, wg_desc, wu_desc, g_desc, u_desc, h_desc, h_in_desc, wd_desc, z_desc,
        *half_descs, *shared_descs, flags, ws.errors, flags if trace is None else trace,
        0 if trace is None else trace.shape[1], t, h, i, i_s, ws.rank, comm._budget(budget),
        ring_rows, slots, max_mb, sched.max_blocks, arrivals)
    fkw = dict(
        NUM_COMM=num_comm,
        MB=minibatch_rows, BM=bm, BN1=t1.bn, BK1=t1.bk, BN2=t2.bn, BK2=t2.bk, TOP_K=ws.top_k,
        ROWS=copy_r, COLS=copy_c, LAG=lag, SHARED_LAG=shared_lag or 0, SHARED=shared is not None,
        PUSH_CHUNK=min(PUSH_CHUNK_ROWS, bm), RING_WRAPS=slots < max_mb, SPLIT=comm_kernel,
        HALF=half,
        TRACE=trace is not None,
        PHASED=interpreting(), GPU=not interpreting(), UPCAST=interpreting(),
        num_warps=FUSED_WARPS, num_stages=FUSED_STAGES,
        # not cooperative with the comm kernel: its programs run beside these (the start-up
        # count reports programs that are not resident)
        launch_cooperative_grid=not interpreting() and not comm_kernel)
    if comm_kernel and not interpreting():
        # Both kernels compiled, loaded and given the largest carveout before either starts:
        # loading a module waits for running kernels (the first forward stalled at the start-up
        # count while the comm kernel loaded), and an SM set up for a small carveout takes no
        # program of the other kernel (probe on an H200: the two ran side by side only so).
        _check_side_by_side(
            _prefer_shared(_fused_forward_kernel.warmup(*fargs, grid=grid, **fkw)),
            _prefer_shared(_fused_comm_kernel.warmup(*cargs, arrivals, grid=(num_comm,),
                                                     PHASE=COMM_BOTH, **ckw)))
    _fused_forward_kernel[grid](*fargs, **fkw)
    if comm_kernel:
        if interpreting():
            _fused_comm_kernel[(num_comm,)](*cargs, 0, PHASE=COMM_PUSH, **ckw)
        else:
            with torch.cuda.stream(side):
                _fused_comm_kernel[(num_comm,)](*cargs, arrivals, PHASE=COMM_BOTH, **ckw)
            main.wait_stream(side)
    return FusedOutputs(xs, g, u, hh, z, full, ring_rows,
                        None if shared is None else (sg, su, sh), shared_out)
