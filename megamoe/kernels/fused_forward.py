"""Fused forward: pull dispatch, gate/up + SwiGLU, down and push combine in ONE persistent kernel.

It replaces the unfused sequence ``dispatch_pull -> gate_up -> down -> combine_push`` of backend
"triton"; the barriers around it and the local k-order combine stay small separate launches.

Roles (one program per SM, ``launch_cooperative_grid=True`` so every program is resident):
  * programs ``[0, num_comm)`` communicate. First they pull every minibatch of scheduled rows
    from the peers' ``x_buffer`` into the local row buffer ``xs`` (``comm.copy_rows``; each comm
    program takes a strided share of the minibatch's copy tasks) and count themselves into the
    minibatch's ready counter (release). Then, minibatch by minibatch, they wait until every down
    tile of the minibatch is stored and push its rows into the source ranks' combine slots
    (``comm.push_rows``). Pulls never wait, so all of them finish whatever the compute does.
  * the other programs compute. They take tasks from an atomic ticket over a task list in
    topological order: a row block's down tiles come after all its gate/up tiles (``LAG``
    groups later, :func:`task_of`). A gate/up tile waits for its minibatch's ready counter
    (acquire), runs ``gemm.gate_up_tile`` and counts itself into ``h_done[b]``; a down tile waits
    until ``h_done[b]`` counts every gate/up tile of the block, runs ``gemm.mm_acc`` and counts
    itself into ``z_done[minibatch]``. A task only waits on tasks earlier in the list (already
    taken by running programs) or on the pulls: no deadlock.

The tiles are the unfused kernels' device functions with the same tile shapes and the same row
layout, so ``xs, g, u, h, z`` and the pushed slots have the unfused path's bits for every
``num_comm``. Every spin-wait has a budget (``comm.wait_at_least``): on expiry it records
(stage, index, peer, rank) in the workspace error record and the program stops; the host raises
``StallError`` at its next check.

``PHASED`` (the CPU interpreter, which runs programs one after another): one program runs every
comm role's pulls, then every compute task in ticket order, then every comm role's pushes. Same
source and the same waits (they find their counters already complete).

Not yet (docs/fused.md): the shared expert stays in the unfused launches, the routed rows use the
full row buffer (no ring), and pushes start only after every pull.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..workspace import Workspace, register_stage
from . import comm
from .gemm import _weight_2d, gate_up_tile, mm_acc, tiles_for
from .runtime import descriptor, empty, interpreting, persistent_programs
from .schedule import RowSchedule
from .tiles import cast

__all__ = ["FusedOutputs", "fused_forward", "STAGE_ROWS_READY", "STAGE_H_READY",
           "STAGE_Z_READY", "FLAG_WORDS", "DEFAULT_DOWN_LAG", "task_of", "fused_grid",
           "FUSED_WARPS", "FUSED_STAGES"]

# Stage codes of the fused forward's spin-waits in the error record (workspace.STAGE_NAMES).
STAGE_ROWS_READY = 10
STAGE_H_READY = 11
STAGE_Z_READY = 12
register_stage(STAGE_ROWS_READY, "fused forward: pulled rows of a minibatch")
register_stage(STAGE_H_READY, "fused forward: h tiles of a row block")
register_stage(STAGE_Z_READY, "fused forward: down tiles of a minibatch")

# One warp count and pipeline depth for every role: the gate/up and down tiles must use the
# unfused kernels' warp count (8), which fixes the wgmma shapes and hence the bits. Stages only
# change the pipelining: 4 (as the unfused gate/up) needs ~197 KB of shared memory of 227.
FUSED_WARPS = 8
FUSED_STAGES = 4
# Task-list groups between a block's gate/up tiles and its down tiles (task_of): ~2 groups of
# dsv3 tiles (2 x 44) keep the ~108 compute programs mostly off blocks whose h is still running.
# Not measured yet.
DEFAULT_DOWN_LAG = 2
# Words before the counters in the flag buffer: the compute task ticket.
FLAG_WORDS = 1

_FLAG_WORDS = tl.constexpr(FLAG_WORDS)
_STAGE_ROWS = tl.constexpr(STAGE_ROWS_READY)
_STAGE_H = tl.constexpr(STAGE_H_READY)
_STAGE_Z = tl.constexpr(STAGE_Z_READY)


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
def wait_count(flag_ptr, wanted, err_ptr, stage, index, rank, budget):
    """Spin (acquire) until ``flag >= wanted``; False (and a stall record) if the budget ran out.

    ``comm.wait_at_least`` on one local flag; the record names this rank as the 'peer'.
    """
    one = tl.arange(0, 1)
    return comm.wait_at_least(flag_ptr + one, one == 0, one + rank, wanted, budget, err_ptr,
                              stage, index, rank)


# --------------------------------------------------------------------------------------------
# Roles


@triton.jit
def pull_role(x_table, xs_ptr, row_src_ptr, ready_ptr, used_rows, role, T, H,
              NUM_COMM: tl.constexpr, MB: tl.constexpr, TOP_K: tl.constexpr,
              ROWS: tl.constexpr, COLS: tl.constexpr, UPCAST: tl.constexpr):
    """Comm role ``role``: its share of every minibatch's pulls, then a release per minibatch."""
    n_mb = tl.cdiv(used_rows, MB)
    m = 0
    while m < n_mb:
        row_begin = m * MB
        row_end = tl.minimum(row_begin + MB, used_rows)
        comm.copy_rows(x_table, x_table, xs_ptr + row_begin.to(tl.int64) * H, H, row_src_ptr,
                       row_begin, row_end, role, NUM_COMM, T, H, TOP_K, False, ROWS, COLS,
                       UPCAST)
        signal(ready_ptr + m)
        m += 1


@triton.jit
def push_role(z_ptr, combine_table, row_src_ptr, z_done_ptr, used_rows, role, T, H, rank,
              budget, err_ptr, tiles_down, NUM_COMM: tl.constexpr, MB: tl.constexpr,
              BM: tl.constexpr, TOP_K: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Comm role ``role``: per minibatch, wait for all its down tiles, push its share of rows."""
    n_mb = tl.cdiv(used_rows, MB)
    m = 0
    alive = True
    while (m < n_mb) & alive:
        row_begin = m * MB
        row_end = tl.minimum(row_begin + MB, used_rows)
        blocks = (row_end - row_begin) // BM
        alive = wait_count(z_done_ptr + m, blocks * tiles_down, err_ptr, _STAGE_Z, m, rank,
                           budget)
        if alive:
            push_rows_of(z_ptr, combine_table, row_src_ptr, row_begin, row_end, role, T, H,
                         NUM_COMM, TOP_K, ROWS, COLS)
        m += 1


@triton.jit
def push_rows_of(z_ptr, combine_table, row_src_ptr, row_begin, row_end, role, T, H,
                 NUM_COMM: tl.constexpr, TOP_K: tl.constexpr, ROWS: tl.constexpr,
                 COLS: tl.constexpr):
    comm.push_rows(z_ptr + row_begin.to(tl.int64) * H, H, combine_table, row_src_ptr, row_begin,
                   row_end, role, NUM_COMM, T, H, TOP_K, ROWS, COLS)


@triton.jit
def task_of(t, num_blocks, n1, n2, LAG: tl.constexpr):
    """(is gate/up, row block, column tile) of compute task ``t``.

    The list is made of groups s = 0, 1, ...: group s holds the gate/up tiles of block s (if it
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
def compute_role(xs_desc, wg_desc, wu_desc, g_desc, u_desc, h_desc, h_in_desc, wd_desc, z_desc,
                 block_expert_ptr, ticket_ptr, ready_ptr, h_done_ptr, z_done_ptr, num_blocks,
                 H, I, rank, budget, err_ptr, NUM_COMM: tl.constexpr, MB: tl.constexpr,
                 BM: tl.constexpr, BN1: tl.constexpr, BK1: tl.constexpr, BN2: tl.constexpr,
                 BK2: tl.constexpr, LAG: tl.constexpr, GPU: tl.constexpr,
                 UPCAST: tl.constexpr):
    """Take tasks from the ticket (list order of :func:`task_of`) until none is left or a wait
    gave up."""
    n1 = tl.cdiv(I, BN1)
    n2 = tl.cdiv(H, BN2)
    total = num_blocks * (n1 + n2)
    task = tl.atomic_add(ticket_ptr, 1, sem="relaxed", scope="gpu")
    alive = True
    while (task < total) & alive:
        is_gate_up, b, j = task_of(task, num_blocks, n1, n2, LAG)
        expert = tl.load(block_expert_ptr + b)
        row = b * BM
        mb = row // MB
        if is_gate_up:
            alive = wait_count(ready_ptr + mb, NUM_COMM, err_ptr, _STAGE_ROWS, mb, rank, budget)
            if alive:
                acquire_for_tma(GPU)
                gate_up_tile(xs_desc, wg_desc, wu_desc, g_desc, u_desc, h_desc, expert, row,
                             j * BN1, I, H, BM, BN1, BK1, UPCAST)
                publish_writes(GPU)
                signal(h_done_ptr + b)
        else:
            alive = wait_count(h_done_ptr + b, n1, err_ptr, _STAGE_H, b, rank, budget)
            if alive:
                acquire_for_tma(GPU)
                col = j * BN2
                acc = mm_acc(tl.zeros([BM, BN2], dtype=tl.float32), h_in_desc, wd_desc, expert,
                             row, col, H, I, BK2, BN2, False, UPCAST)
                z_desc.store([row, col], cast(acc, z_desc.dtype, UPCAST))
                publish_writes(GPU)
                signal(z_done_ptr + mb)
        task = tl.atomic_add(ticket_ptr, 1, sem="relaxed", scope="gpu")


@triton.jit
def _fused_forward_kernel(x_table, combine_table, row_src_ptr, block_expert_ptr, num_blocks_ptr,
                          xs_ptr, z_ptr, xs_desc, wg_desc, wu_desc, g_desc, u_desc, h_desc,
                          h_in_desc, wd_desc, z_desc, flags_ptr, err_ptr, T, H, I, rank, budget,
                          max_mb, max_blocks, NUM_COMM: tl.constexpr, MB: tl.constexpr,
                          BM: tl.constexpr, BN1: tl.constexpr, BK1: tl.constexpr,
                          BN2: tl.constexpr, BK2: tl.constexpr, TOP_K: tl.constexpr,
                          ROWS: tl.constexpr, COLS: tl.constexpr, LAG: tl.constexpr,
                          PHASED: tl.constexpr,
                          GPU: tl.constexpr, UPCAST: tl.constexpr):
    # Flag buffer (zeroed per launch): [ticket | ready[max_mb] | z_done[max_mb] |
    # h_done[max_blocks]].
    ticket_ptr = flags_ptr
    ready_ptr = flags_ptr + _FLAG_WORDS
    z_done_ptr = ready_ptr + max_mb
    h_done_ptr = z_done_ptr + max_mb
    num_blocks = tl.load(num_blocks_ptr)
    used_rows = num_blocks * BM
    tiles_down = tl.cdiv(H, BN2)
    if PHASED:  # the interpreter: one program plays every role, producers first
        for role in range(NUM_COMM):
            pull_role(x_table, xs_ptr, row_src_ptr, ready_ptr, used_rows, role, T, H, NUM_COMM,
                      MB, TOP_K, ROWS, COLS, UPCAST)
        compute_role(xs_desc, wg_desc, wu_desc, g_desc, u_desc, h_desc, h_in_desc, wd_desc,
                     z_desc, block_expert_ptr, ticket_ptr, ready_ptr, h_done_ptr, z_done_ptr,
                     num_blocks, H, I, rank, budget, err_ptr, NUM_COMM, MB, BM, BN1, BK1, BN2,
                     BK2, LAG, GPU, UPCAST)
        for role in range(NUM_COMM):
            push_role(z_ptr, combine_table, row_src_ptr, z_done_ptr, used_rows, role, T, H,
                      rank, budget, err_ptr, tiles_down, NUM_COMM, MB, BM, TOP_K, ROWS, COLS)
    else:
        pid = tl.program_id(0)
        if pid < NUM_COMM:
            pull_role(x_table, xs_ptr, row_src_ptr, ready_ptr, used_rows, pid, T, H, NUM_COMM,
                      MB, TOP_K, ROWS, COLS, UPCAST)
            push_role(z_ptr, combine_table, row_src_ptr, z_done_ptr, used_rows, pid, T, H, rank,
                      budget, err_ptr, tiles_down, NUM_COMM, MB, BM, TOP_K, ROWS, COLS)
        else:
            compute_role(xs_desc, wg_desc, wu_desc, g_desc, u_desc, h_desc, h_in_desc, wd_desc,
                         z_desc, block_expert_ptr, ticket_ptr, ready_ptr, h_done_ptr,
                         z_done_ptr, num_blocks, H, I, rank, budget, err_ptr, NUM_COMM, MB, BM,
                         BN1, BK1, BN2, BK2, LAG, GPU, UPCAST)


# --------------------------------------------------------------------------------------------
# Host launcher


@dataclass(frozen=True)
class FusedOutputs:
    """Routed activations in the schedule's row layout (what the unfused path returns)."""

    xs: torch.Tensor
    g: torch.Tensor
    u: torch.Tensor
    h: torch.Tensor
    z: torch.Tensor


def fused_grid(num_comm: int, device: torch.device) -> int:
    """Programs of the launch: one per SM on a GPU (comm + compute); one program when phased."""
    if interpreting():
        return 1
    programs = persistent_programs(device)
    if num_comm >= programs:
        raise ValueError(f"num_comm ({num_comm}) must leave compute programs: the GPU has "
                         f"{programs} SMs")
    return programs


def fused_forward(ws: Workspace, sched: RowSchedule, w_gate: torch.Tensor, w_up: torch.Tensor,
                  w_down: torch.Tensor, num_comm: int, minibatch_rows: int,
                  budget: int | None = None, flags: torch.Tensor | None = None,
                  down_lag: int | None = None) -> FusedOutputs:
    """Pull, expert GEMMs and push of this rank's scheduled rows in one launch (no host sync).

    Call after the barrier that follows every rank's publish of x; the source ranks may read
    their combine slots after the next barrier. ``flags`` (int32, zeroed) is a test hook: a
    pre-set counter reproduces a missing signal. ``down_lag``: groups between a row block's
    gate/up tiles and its down tiles in the task list (:func:`task_of`; speed only; default
    ``DEFAULT_DOWN_LAG``).
    """
    if down_lag is None:
        down_lag = DEFAULT_DOWN_LAG
    comm._check_schedule(ws, sched)
    if isinstance(num_comm, bool) or not isinstance(num_comm, int) or num_comm < 1:
        raise ValueError(f"num_comm must be an int >= 1, got {num_comm!r}")
    bm = sched.block_rows
    if isinstance(down_lag, bool) or not isinstance(down_lag, int) or down_lag < 0:
        raise ValueError(f"down_lag must be an int >= 0, got {down_lag!r}")
    if minibatch_rows % bm:
        raise ValueError(f"minibatch_rows ({minibatch_rows}) must be a multiple of the block "
                         f"rows ({bm})")
    dev, dtype = ws.device, ws.dtype
    h, i = ws.hidden, w_gate.shape[1]
    rows = sched.rows
    xs, z = (empty((rows, h), dtype, dev) for _ in range(2))
    g, u, hh = (empty((rows, i), dtype, dev) for _ in range(3))
    t1, t2 = tiles_for("gate_up"), tiles_for("mm")
    max_mb = triton.cdiv(rows, minibatch_rows)
    max_blocks = sched.max_blocks
    n_flags = FLAG_WORDS + 2 * max_mb + max_blocks
    if flags is None:
        flags = torch.zeros(n_flags, dtype=torch.int32, device=dev)
    elif flags.numel() < n_flags or flags.dtype != torch.int32:
        raise ValueError(f"flags must be int32 with >= {n_flags} words")
    copy_r, copy_c = comm.copy_tile(h, dtype.itemsize, comm.COPY_TILE_BYTES)
    grid = (fused_grid(num_comm, dev),)
    _fused_forward_kernel[grid](
        ws.peers.x, ws.peers.combine, sched.row_src, sched.block_expert, sched.num_blocks, xs, z,
        descriptor(xs, [bm, t1.bk]), descriptor(_weight_2d(w_gate), [t1.bn, t1.bk]),
        descriptor(_weight_2d(w_up), [t1.bn, t1.bk]),
        *(descriptor(o, [bm, t1.bn]) for o in (g, u, hh)),
        descriptor(hh, [bm, t2.bk]), descriptor(_weight_2d(w_down), [t2.bn, t2.bk]),
        descriptor(z, [bm, t2.bn]), flags, ws.errors, ws.num_tokens, h, i, ws.rank,
        comm._budget(budget), max_mb, max_blocks, NUM_COMM=num_comm, MB=minibatch_rows, BM=bm,
        BN1=t1.bn, BK1=t1.bk, BN2=t2.bn, BK2=t2.bk, TOP_K=ws.top_k, ROWS=copy_r, COLS=copy_c,
        LAG=down_lag,
        PHASED=interpreting(), GPU=not interpreting(), UPCAST=interpreting(),
        num_warps=FUSED_WARPS, num_stages=FUSED_STAGES,
        launch_cooperative_grid=not interpreting())
    return FusedOutputs(xs, g, u, hh, z)
