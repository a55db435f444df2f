"""Communication between expert-parallel ranks over NVLink: barrier, routing exchange, pull, push.

Device functions (``@triton.jit``, reusable by the persistent megakernel):
  wait_at_least   spin (acquire, sys) until flags reach a value; on budget expiry record a stall
  wait_flag       the same on one flag, as scalars (Triton and Gluon kernels)
  publish_writes, acquire_for_tma
                  TMA (async proxy) writes before a release, TMA loads after an acquire
  signal          count this program into a flag (release, GPU scope)
  barrier_arrive  advance this rank's epoch and publish it into every rank's pad (release, sys)
  barrier_wait    wait until every rank published this epoch into our pad
  copy_rows       pull scheduled rows out of the peers' token buffers into a local row buffer
  pull_tokens     the unscaled pull in token order: one read per (source rank, token)
  push_rows       push local rows into the source ranks' slot buffers (one writer per slot)
  push_tile       push one GEMM tile's rows there (the fused kernel's down tiles)
  push_values     the same for one fp32 per row (router-weight gradients)

Thin kernels and host launchers wrap them for the unfused path. Peers are reached through the
int64 address tables of a :class:`~megamoe.ep.workspace.Workspace`. No multicast / multimem
anywhere: every cross-GPU access is a unicast load, store or atomic. See docs/comm.md for the
protocol.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..ep.workspace import BARRIER_CHANNELS, Workspace
from ..errors import ErrorWord, Stage
from .runtime import cdiv, empty, interpreting, launch
from .schedule import RowSchedule
from .tiles import cast

__all__ = [
    "ARRIVE",
    "WAIT",
    "BOTH",
    "DEFAULT_COPY_PROGRAMS",
    "DEFAULT_SPIN_BUDGET",
    "SPIN_BUDGET_ENV",
    "COPY_TILE_BYTES",
    "copy_tile",
    "spin_budget",
    "check_programs",
    "check_schedule",
    "wait_at_least",
    "wait_flag",
    "publish_writes",
    "acquire_for_tma",
    "signal",
    "record_stall",
    "barrier_arrive",
    "barrier_wait",
    "task_slots",
    "slot_region",
    "as_rows",
    "copy_rows",
    "pull_tokens",
    "push_rows",
    "push_tile",
    "push_values",
    "barrier",
    "gather_routing",
    "dispatch_pull",
    "combine_push",
    "push_row_values",
]

# Barrier phases (bit flags, constexpr): the interpreter runs ARRIVE for every emulated rank, then
# WAIT for every rank, because it cannot run two ranks' programs at the same time.
ARRIVE = 1
WAIT = 2
BOTH = ARRIVE | WAIT

# Programs of the standalone copies (config.copy_programs has the same default, from the sweep).
DEFAULT_COPY_PROGRAMS = 24
# Polls of a flag before a wait gives up. One acquire poll of a local flag costs ~0.5-1 us, so
# this is seconds: long enough for a peer still compiling a kernel, short enough to beat a hang.
DEFAULT_SPIN_BUDGET = 1 << 24
SPIN_BUDGET_ENV = "MEGAMOE_SPIN_BUDGET"
# Bytes one program moves per loop iteration: NVLink copies need ~64 KB in flight per program
# (docs/hardware.md: 16 KB blocks are latency bound, 64 KB reach 330+ GB/s with 16 programs).
COPY_TILE_BYTES = 64 * 1024
_MAX_COLS = 1024
COPY_WARPS = 8
# Pulls wait for a load round trip over NVLink per tile and want bigger tiles than pushes: the
# 2026-11-30 H200x2 sweep (benchmarks/results/comm_h200x2_2026-11-30.json) gave 294 GB/s with
# 128 KB / 16 warps vs 249 with 64 KB / 8 warps at 24 programs; pushes peaked at 64 KB / 8 warps
# (319 GB/s). Past 128 KB a pull program's rate grew with the warps issuing the loads, not with
# more bytes in flight: 32 warps gave 314 GB/s vs 291 with 16 (one run,
# benchmarks/results/comm_h200x2_warps_9abc9dd_2026-11-30.json); 256 KB tiles and cp.async
# pipelines (tl.range num_stages) were slower (docs/comm.md).
PULL_TILE_BYTES = 128 * 1024
PULL_WARPS = 32
_ROUTING_BLOCK = 1024

# Stall record word offsets (megamoe.errors.ErrorWord), as constexprs for the device code.
_ERR_STAGE = tl.constexpr(int(ErrorWord.STAGE))
_ERR_INDEX = tl.constexpr(int(ErrorWord.INDEX))
_ERR_PEER = tl.constexpr(int(ErrorWord.PEER))
_ERR_RANK = tl.constexpr(int(ErrorWord.RANK))
_ERR_SEEN = tl.constexpr(int(ErrorWord.SEEN))
_ERR_WANTED = tl.constexpr(int(ErrorWord.WANTED))
_ERR_BUDGET = tl.constexpr(int(ErrorWord.BUDGET))
_NO_PEER = tl.constexpr(2**30)
_STAGE_BARRIER = tl.constexpr(int(Stage.BARRIER))


# --------------------------------------------------------------------------------------------
# Flags, stalls, barrier


@triton.jit
def record_stall(err_ptr, stage, index, peer, rank, seen, wanted, budget):
    """Write the first stall of this rank into the error record (later stalls keep the first)."""
    old = tl.atomic_cas(err_ptr, 0, 1, sem="relaxed", scope="gpu")
    if old == 0:
        tl.store(err_ptr + _ERR_STAGE, stage)
        tl.store(err_ptr + _ERR_INDEX, index)
        tl.store(err_ptr + _ERR_PEER, peer)
        tl.store(err_ptr + _ERR_RANK, rank)
        tl.store(err_ptr + _ERR_SEEN, seen)
        tl.store(err_ptr + _ERR_WANTED, wanted)
        tl.store(err_ptr + _ERR_BUDGET, budget)


@triton.jit
def wait_at_least(
    flag_ptrs, live, who, wanted, budget, err_ptr, stage, index, rank, SCOPE: tl.constexpr
):
    """Spin until every live int32 flag is >= ``wanted`` (mod 2**32); True if they all got there.

    Polls are acquire loads (``atom.acquire.<SCOPE>.add 0``), so whatever the signaller wrote
    before its release is visible to this program afterwards. System scope for flags other GPUs
    set (the barrier); "gpu" suffices when producer and consumer run on this GPU (the fused
    kernel's counters) and spares each poll the system-wide ordering. After ``budget`` polls the
    wait gives up, records (stage, index, first missing peer ``who``, rank) and returns False. If an
    earlier wait of this rank already gave up, it does not spin at all: a broken step ends quickly
    everywhere and the host raises at its next check.
    """
    earlier = tl.load(err_ptr, volatile=True)
    budget = tl.where(earlier != 0, 0, budget)
    seen = tl.atomic_add(flag_ptrs, 0, mask=live, sem="acquire", scope=SCOPE)
    behind = live & ((seen - wanted) < 0)
    missing = tl.sum(behind.to(tl.int32), axis=0)
    spins = 0
    while (missing > 0) & (spins < budget):
        seen = tl.atomic_add(flag_ptrs, 0, mask=live, sem="acquire", scope=SCOPE)
        behind = live & ((seen - wanted) < 0)
        missing = tl.sum(behind.to(tl.int32), axis=0)
        spins += 1
    if (missing > 0) & (earlier == 0):
        peer = tl.min(tl.where(behind, who, _NO_PEER), axis=0)
        got = tl.sum(tl.where(behind & (who == peer), seen, 0), axis=0)
        record_stall(err_ptr, stage, index, peer, rank, got, wanted, budget)
    return missing == 0


@triton.jit
def wait_flag(flag_ptr, wanted, budget, err_ptr, stage, index, peer, rank, SCOPE: tl.constexpr):
    """:func:`wait_at_least` on one flag, as scalars: no block shapes, so Gluon kernels call it
    too (the warp-specialized GEMMs' producer). ``peer``: the stall record's 'peer'."""
    earlier = tl.load(err_ptr, volatile=True)
    if earlier != 0:
        budget = 0
    seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope=SCOPE)
    spins = 0
    while ((seen - wanted) < 0) & (spins < budget):
        seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope=SCOPE)
        spins += 1
    if ((seen - wanted) < 0) & (earlier == 0):
        record_stall(err_ptr, stage, index, peer, rank, seen, wanted, budget)
    return (seen - wanted) >= 0


@triton.jit
def _fence(PTX: tl.constexpr):
    """Inline PTX with no result (an int32 dummy; a scalar operand, so Gluon kernels call it
    too)."""
    tl.inline_asm_elementwise(PTX, "=r,r", [0], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def publish_writes(GPU: tl.constexpr):
    """Make this program's TMA stores (async proxy) complete and visible before a release.

    Triton waits only for the shared-memory source of a TMA store (``wait_group.read``); a
    consumer on another SM needs the global writes done, and generic-proxy readers need the
    proxy fence. Every thread runs it (only the issuing thread has bulk groups); the CTA barrier
    in ``fused.sync.signal`` follows. No-op under the interpreter (stores are immediate there).
    """
    if GPU:
        _fence("cp.async.bulk.wait_group 0; fence.proxy.async.global; mov.u32 $0, 0;")


@triton.jit
def acquire_for_tma(GPU: tl.constexpr):
    """After an acquire: order later TMA loads (async proxy) after the generic-proxy sync."""
    if GPU:
        _fence("fence.proxy.async.global; mov.u32 $0, 0;")
    tl.debug_barrier()


@triton.jit
def signal(flag_ptr):
    """Count this program into ``flag`` (release: everything it wrote before is visible; after
    TMA stores, :func:`publish_writes` first). Scalars only: Gluon kernels call it too."""
    tl.debug_barrier()
    tl.atomic_add(flag_ptr, 1, sem="release", scope="gpu")


@triton.jit
def barrier_arrive(signal_table, epoch_ptr, channel, rank, W: tl.constexpr, W_PAD: tl.constexpr):
    """Advance this rank's epoch on ``channel`` and store it into slot [channel, rank] of every pad.

    The caller's program must have finished its own peer stores: the ``debug_barrier`` makes the
    other threads' stores happen-before the release, and a release at system scope is cumulative,
    so a peer that acquires the new epoch also sees them. Stores of other programs or earlier
    kernels are ordered by whoever launched this (kernel boundary or the megakernel's own flags).
    """
    epoch = tl.atomic_add(epoch_ptr + channel, 1, sem="relaxed", scope="gpu") + 1
    ranks = tl.arange(0, W_PAD)
    live = ranks < W
    pads = tl.load(signal_table + ranks, mask=live, other=0).to(tl.pointer_type(tl.int32))
    tl.debug_barrier()
    tl.atomic_xchg(
        pads + channel * W + rank,
        tl.zeros([W_PAD], tl.int32) + epoch,
        mask=live,
        sem="release",
        scope="sys",
    )
    return epoch


@triton.jit
def barrier_wait(
    signal_table, epoch, err_ptr, channel, rank, budget, W: tl.constexpr, W_PAD: tl.constexpr
):
    """Wait until every rank stored ``epoch`` (or later) into our pad on ``channel``."""
    ranks = tl.arange(0, W_PAD)
    live = ranks < W
    pad = tl.load(signal_table + rank).to(tl.pointer_type(tl.int32))
    ok = wait_at_least(
        pad + channel * W + ranks,
        live,
        ranks,
        epoch,
        budget,
        err_ptr,
        _STAGE_BARRIER,
        channel,
        rank,
        "sys",
    )
    tl.debug_barrier()
    return ok


@triton.jit
def _barrier_kernel(
    signal_table,
    epoch_ptr,
    err_ptr,
    channel,
    rank,
    budget,
    W: tl.constexpr,
    W_PAD: tl.constexpr,
    PHASE: tl.constexpr,
):
    if PHASE & 1:  # ARRIVE (a literal: the interpreter passes PHASE as a plain int)
        epoch = barrier_arrive(signal_table, epoch_ptr, channel, rank, W, W_PAD)
    else:
        epoch = tl.load(epoch_ptr + channel)
    if PHASE & 2:  # WAIT
        barrier_wait(signal_table, epoch, err_ptr, channel, rank, budget, W, W_PAD)


# --------------------------------------------------------------------------------------------
# Row copies


@triton.jit
def task_slots(row_src_ptr, task, n_tasks, row_begin, row_end, n_cols, ROWS: tl.constexpr):
    """Global slots of the ROWS rows of copy task ``task``; -1 for padding, past-the-end rows and
    tasks past ``n_tasks`` (so the last prefetch of a loop reads nothing)."""
    rows = row_begin + (task // n_cols) * ROWS + tl.arange(0, ROWS)
    return tl.load(row_src_ptr + rows, mask=(rows < row_end) & (task < n_tasks), other=-1)


@triton.jit
def slot_region(table, slot, tk):
    """int64 base address of the region (``table``) on the rank that owns each slot; 0 if none."""
    real = slot >= 0
    return tl.load(table + tl.where(real, slot // tk, 0), mask=real, other=0)


@triton.jit
def as_rows(addr, ELEM: tl.constexpr):
    """Pointers from int64 addresses, marked 16-byte aligned (every region is) so that copies use
    16-byte vectors: the hint must sit on the pointer, a hint on the int64 is lost by the cast."""
    return tl.multiple_of(addr.to(tl.pointer_type(ELEM)), 16)


@triton.jit
def copy_rows(
    src_table,
    scale_table,
    dst_ptr,
    dst_stride,
    row_src_ptr,
    row_begin,
    row_end,
    task_begin,
    task_step,
    T,
    H,
    TOP_K: tl.constexpr,
    SCALE: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Pull rows ``[row_begin, row_end)`` of the layout into ``dst`` (row ``row_begin`` -> dst
    row 0).

    Row ``r`` with global slot ``s = row_src[r]`` receives row ``(s % (T*K)) // K`` of rank
    ``s // (T*K)``'s buffer (``src_table``); padding rows (s == -1) are written with zeros.
    With ``SCALE`` the row is multiplied in fp32 by the source rank's weight of that slot
    (``scale_table``: the routing weights) and rounded to nearest even. The work is split into
    tasks of ROWS x COLS elements; this program takes tasks task_begin, task_begin + task_step, ...
    The next task's slots and peer addresses are fetched while this task's rows are in flight, so
    each iteration waits for one NVLink round trip, not three dependent loads.
    """
    ELEM = dst_ptr.dtype.element_ty
    tk = T * TOP_K
    n_cols = tl.cdiv(H, COLS)
    n_tasks = tl.cdiv(row_end - row_begin, ROWS) * n_cols
    task = task_begin
    slot = task_slots(row_src_ptr, task, n_tasks, row_begin, row_end, n_cols, ROWS)
    addr = slot_region(src_table, slot, tk)
    if SCALE:
        waddr = slot_region(scale_table, slot, tk)
    else:
        waddr = addr
    while (
        task < n_tasks
    ):  # a while loop: `range` over loaded bounds breaks the interpreter (numpy>=2.4)
        nxt = task + task_step
        slot_next = task_slots(row_src_ptr, nxt, n_tasks, row_begin, row_end, n_cols, ROWS)
        rows = row_begin + (task // n_cols) * ROWS + tl.arange(0, ROWS)
        cols = (task % n_cols) * COLS + tl.arange(0, COLS)
        row_ok = rows < row_end
        col_ok = cols < H
        real = slot >= 0
        local = tl.where(real, slot % tk, 0)
        offs = (local // TOP_K).to(tl.int64)[:, None] * H + cols[None, :]
        vals = tl.load(
            as_rows(addr, ELEM)[:, None] + offs, mask=real[:, None] & col_ok[None, :], other=0.0
        )
        if SCALE:
            w = tl.load(as_rows(waddr, tl.float32) + local, mask=real, other=0.0)
            vals = cast(vals.to(tl.float32) * w[:, None], ELEM, UPCAST)
            waddr = slot_region(scale_table, slot_next, tk)
        addr = slot_region(src_table, slot_next, tk)
        if not SCALE:
            waddr = addr
        dst = dst_ptr + (rows - row_begin).to(tl.int64)[:, None] * dst_stride + cols[None, :]
        tl.store(dst, vals, mask=row_ok[:, None] & col_ok[None, :])
        slot = slot_next
        task = nxt


@triton.jit
def pull_tokens(
    src_table,
    dst_ptr,
    dst_stride,
    dest_row_ptr,
    row_src_ptr,
    used_rows,
    task_begin,
    task_step,
    W,
    T,
    H,
    TOP_K: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
):
    """:func:`copy_rows` (unscaled) in token order: each (source rank, token) with rows here is
    read once and stored into every layout row it has (``dest_row``, one per k), instead of read
    once per row. A token routed to several experts of this rank (about 4 of its 8 at dsv3,
    W = 2) then crosses NVLink once. Padding rows below ``used_rows`` are written with zeros,
    rows past them are not touched (nor stale ``dest_row`` entries of an overflowed step).

    Tasks: ROWS tokens x COLS columns of one source rank, then ROWS layout rows x COLS columns
    of padding; this program takes tasks task_begin, task_begin + task_step, ...
    """
    ELEM = dst_ptr.dtype.element_ty
    tk = T * TOP_K
    n_cols = tl.cdiv(H, COLS)
    token_tasks = W * tl.cdiv(T, ROWS) * n_cols
    n_tasks = token_tasks + tl.cdiv(used_rows, ROWS) * n_cols
    task = task_begin
    while task < n_tasks:
        cols = (task % n_cols) * COLS + tl.arange(0, COLS)
        col_ok = cols < H
        if task < token_tasks:
            chunk = task // n_cols
            src = chunk // tl.cdiv(T, ROWS)
            tokens = (chunk % tl.cdiv(T, ROWS)) * ROWS + tl.arange(0, ROWS)
            slots = src * tk + tokens * TOP_K
            tok_ok = tokens < T
            wanted = tl.zeros([ROWS], dtype=tl.int1)
            for k in tl.static_range(TOP_K):
                row = tl.load(dest_row_ptr + slots + k, mask=tok_ok, other=-1)
                wanted |= (row >= 0) & (row < used_rows)
            region = as_rows(tl.load(src_table + src), ELEM)
            vals = tl.load(
                region + tokens.to(tl.int64)[:, None] * H + cols[None, :],
                mask=wanted[:, None] & col_ok[None, :],
                other=0.0,
            )
            for k in tl.static_range(TOP_K):
                row = tl.load(dest_row_ptr + slots + k, mask=tok_ok, other=-1)
                here = (row >= 0) & (row < used_rows)
                dst = dst_ptr + row.to(tl.int64)[:, None] * dst_stride + cols[None, :]
                tl.store(dst, vals, mask=here[:, None] & col_ok[None, :])
        else:
            rows = ((task - token_tasks) // n_cols) * ROWS + tl.arange(0, ROWS)
            pad = (rows < used_rows) & (
                tl.load(row_src_ptr + rows, mask=rows < used_rows, other=0) < 0
            )
            dst = dst_ptr + rows.to(tl.int64)[:, None] * dst_stride + cols[None, :]
            tl.store(dst, tl.zeros([ROWS, COLS], dtype=ELEM), mask=pad[:, None] & col_ok[None, :])
        task += task_step


@triton.jit
def push_rows(
    src_ptr,
    src_stride,
    dst_table,
    row_src_ptr,
    row_begin,
    row_end,
    task_begin,
    task_step,
    T,
    H,
    TOP_K: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
):
    """Push rows ``[row_begin, row_end)`` of the layout (``src`` row 0 = layout row ``row_begin``)
    into slot ``s % (T*K)`` of rank ``s // (T*K)``'s slot buffer (``dst_table``), s = row_src[r].

    Padding rows are skipped. The schedule gives every global slot to exactly one row of one rank,
    so each slot has one writer and no atomics are needed. Slots and peer addresses of the next
    task are fetched ahead, as in :func:`copy_rows`.
    """
    ELEM = src_ptr.dtype.element_ty
    tk = T * TOP_K
    n_cols = tl.cdiv(H, COLS)
    n_tasks = tl.cdiv(row_end - row_begin, ROWS) * n_cols
    task = task_begin
    slot = task_slots(row_src_ptr, task, n_tasks, row_begin, row_end, n_cols, ROWS)
    addr = slot_region(dst_table, slot, tk)
    while task < n_tasks:
        nxt = task + task_step
        slot_next = task_slots(row_src_ptr, nxt, n_tasks, row_begin, row_end, n_cols, ROWS)
        rows = row_begin + (task // n_cols) * ROWS + tl.arange(0, ROWS)
        cols = (task % n_cols) * COLS + tl.arange(0, COLS)
        col_ok = cols < H
        real = slot >= 0  # also false for rows past row_end
        mask = real[:, None] & col_ok[None, :]
        src = src_ptr + (rows - row_begin).to(tl.int64)[:, None] * src_stride + cols[None, :]
        vals = tl.load(src, mask=mask, other=0.0)
        local = tl.where(real, slot % tk, 0).to(tl.int64)
        tl.store(as_rows(addr, ELEM)[:, None] + local[:, None] * H + cols[None, :], vals, mask=mask)
        addr = slot_region(dst_table, slot_next, tk)
        slot = slot_next
        task = nxt


@triton.jit
def push_tile(
    src_ptr,
    src_stride,
    dst_table,
    row_src_ptr,
    row,
    col,
    T,
    H,
    TOP_K: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Push the [BM, BN] tile at (layout row ``row``, column ``col``) of local rows ``src`` (src
    row 0 = layout row ``row``) into the source ranks' slot buffers, as :func:`push_rows` does
    for whole rows, CHUNK rows at a time (few registers: the fused kernel's down tiles call it
    right after storing their tile, which is still in L2)."""
    tk = T * TOP_K
    cols = col + tl.arange(0, BN)
    col_ok = cols < H
    for r0 in range(0, BM, CHUNK):
        rows = r0 + tl.arange(0, CHUNK)
        slot = tl.load(row_src_ptr + row + rows)
        real = slot >= 0
        mask = real[:, None] & col_ok[None, :]
        vals = tl.load(src_ptr + rows.to(tl.int64)[:, None] * src_stride + cols[None, :], mask=mask)
        local = tl.where(real, slot % tk, 0).to(tl.int64)
        dst = as_rows(slot_region(dst_table, slot, tk), src_ptr.dtype.element_ty)
        tl.store(dst[:, None] + local[:, None] * H + cols[None, :], vals, mask=mask)


@triton.jit
def push_values(
    src_ptr,
    dst_table,
    row_src_ptr,
    row_begin,
    row_end,
    task_begin,
    task_step,
    T,
    TOP_K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Scalar ``push_rows``: ``dst[s // (T*K)][s % (T*K)] = src[r - row_begin]`` for real rows."""
    ELEM = src_ptr.dtype.element_ty
    tk = T * TOP_K
    n_tasks = tl.cdiv(row_end - row_begin, BLOCK)
    task = task_begin
    while task < n_tasks:
        rows = row_begin + task * BLOCK + tl.arange(0, BLOCK)
        row_ok = rows < row_end
        slot = tl.load(row_src_ptr + rows, mask=row_ok, other=-1)
        real = row_ok & (slot >= 0)
        vals = tl.load(src_ptr + (rows - row_begin), mask=real, other=0.0)
        addr = slot_region(dst_table, slot, tk)
        tl.store(addr.to(tl.pointer_type(ELEM)) + tl.where(real, slot % tk, 0), vals, mask=real)
        task += task_step


@triton.jit
def _pull_kernel(
    src_table,
    scale_table,
    dst_ptr,
    row_src_ptr,
    num_blocks_ptr,
    T,
    H,
    TOP_K: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    SCALE: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    UPCAST: tl.constexpr,
):
    row_end = tl.load(num_blocks_ptr) * BLOCK_ROWS
    copy_rows(
        src_table,
        scale_table,
        dst_ptr,
        H,
        row_src_ptr,
        0,
        row_end,
        tl.program_id(0),
        tl.num_programs(0),
        T,
        H,
        TOP_K,
        SCALE,
        ROWS,
        COLS,
        UPCAST,
    )


@triton.jit
def _pull_tokens_kernel(
    src_table,
    dst_ptr,
    dest_row_ptr,
    row_src_ptr,
    num_blocks_ptr,
    W,
    T,
    H,
    TOP_K: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
):
    pull_tokens(
        src_table,
        dst_ptr,
        H,
        dest_row_ptr,
        row_src_ptr,
        tl.load(num_blocks_ptr) * BLOCK_ROWS,
        tl.program_id(0),
        tl.num_programs(0),
        W,
        T,
        H,
        TOP_K,
        ROWS,
        COLS,
    )


@triton.jit
def _push_kernel(
    src_ptr,
    dst_table,
    row_src_ptr,
    num_blocks_ptr,
    T,
    H,
    TOP_K: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
):
    row_end = tl.load(num_blocks_ptr) * BLOCK_ROWS
    push_rows(
        src_ptr,
        H,
        dst_table,
        row_src_ptr,
        0,
        row_end,
        tl.program_id(0),
        tl.num_programs(0),
        T,
        H,
        TOP_K,
        ROWS,
        COLS,
    )


@triton.jit
def _push_values_kernel(
    src_ptr,
    dst_table,
    row_src_ptr,
    num_blocks_ptr,
    T,
    TOP_K: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row_end = tl.load(num_blocks_ptr) * BLOCK_ROWS
    push_values(
        src_ptr,
        dst_table,
        row_src_ptr,
        0,
        row_end,
        tl.program_id(0),
        tl.num_programs(0),
        T,
        TOP_K,
        BLOCK,
    )


@triton.jit
def _gather_routing_kernel(ids_table, weights_table, ids_out, weights_out, TK, BLOCK: tl.constexpr):
    src = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < TK
    ids = tl.load(tl.load(ids_table + src).to(tl.pointer_type(tl.int32)) + offs, mask=ok)
    w = tl.load(tl.load(weights_table + src).to(tl.pointer_type(tl.float32)) + offs, mask=ok)
    tl.store(ids_out + src * TK + offs, ids, mask=ok)
    tl.store(weights_out + src * TK + offs, w, mask=ok)


# --------------------------------------------------------------------------------------------
# Host launchers


def copy_tile(hidden: int, itemsize: int, tile_bytes: int = COPY_TILE_BYTES) -> tuple[int, int]:
    """(ROWS, COLS) of one copy task: COLS a power of two <= 1024 covering H, ~tile_bytes in all."""
    if tile_bytes < 16:
        raise ValueError(f"tile_bytes must be >= 16, got {tile_bytes}")
    cols = min(_MAX_COLS, triton.next_power_of_2(hidden))
    rows = max(1, tile_bytes // (cols * itemsize))
    return 1 << (rows.bit_length() - 1), cols


def spin_budget(budget: int | None = None) -> int:
    """The polls a spin-wait makes before it gives up: ``budget``, else ``$MEGAMOE_SPIN_BUDGET``,
    else the default."""
    if budget is None:
        budget = int(os.environ.get(SPIN_BUDGET_ENV, DEFAULT_SPIN_BUDGET))
    if not 0 <= budget < 2**31:
        raise ValueError(f"spin budget must be in [0, 2**31), got {budget}")
    return budget


def check_programs(programs: int) -> int:
    if isinstance(programs, bool) or not isinstance(programs, int) or programs < 1:
        raise ValueError(f"programs must be an int >= 1, got {programs!r}")
    return programs


def barrier(ws: Workspace, channel: int = 0, budget: int | None = None, phase: int = BOTH) -> None:
    """Device barrier of the group on ``channel`` (one 1-warp program; no host sync).

    Everything this rank's stream did before it is visible to every peer's kernels launched after
    the peer's barrier, and vice versa. ``phase`` ARRIVE / WAIT split it for the interpreter.
    """
    if not 0 <= channel < BARRIER_CHANNELS:
        raise ValueError(f"channel must be in [0, {BARRIER_CHANNELS}), got {channel}")
    if phase not in (ARRIVE, WAIT, BOTH):
        raise ValueError(f"phase must be ARRIVE, WAIT or BOTH, got {phase}")
    w = ws.world_size
    launch(
        _barrier_kernel,
        (1,),
        ws.peers.signals,
        ws.epochs,
        ws.errors,
        channel,
        ws.rank,
        spin_budget(budget),
        W=w,
        W_PAD=triton.next_power_of_2(w),
        PHASE=phase,
        num_warps=1,
    )


def gather_routing(ws: Workspace) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's published routing, concatenated: (ids [W*T, K] int32, weights [W*T, K] fp32).

    Call after a barrier that follows every rank's :func:`~megamoe.ep.workspace.publish`. The result
    is the input of ``build_row_schedule(ids, E_local, block_rows, expert_lo=rank*E_local)``.
    """
    w, t, k = ws.world_size, ws.num_tokens, ws.top_k
    ids = empty((w * t, k), torch.int32, ws.device)
    weights = empty((w * t, k), torch.float32, ws.device)
    grid = (w, cdiv(t * k, _ROUTING_BLOCK))
    launch(
        _gather_routing_kernel,
        grid,
        ws.peers.ids,
        ws.peers.weights,
        ids,
        weights,
        t * k,
        BLOCK=_ROUTING_BLOCK,
    )
    return ids, weights


def check_schedule(ws: Workspace, sched: RowSchedule) -> None:
    """Refuse a schedule that was not built from every rank's ids of this workspace."""
    if sched.top_k != ws.top_k or sched.num_tokens != ws.world_size * ws.num_tokens:
        raise ValueError(
            f"sched must be built from all ranks' ids [W*T, K] = [{ws.world_size * ws.num_tokens}, "
            f"{ws.top_k}], got num_tokens={sched.num_tokens}, top_k={sched.top_k}"
        )
    if sched.row_src.numel() < sched.rows:
        raise ValueError(
            f"sched.row_src has {sched.row_src.numel()} rows, fewer than sched.rows={sched.rows}"
        )


def dispatch_pull(
    ws: Workspace,
    sched: RowSchedule,
    source: str = "x",
    out: torch.Tensor | None = None,
    programs: int = DEFAULT_COPY_PROGRAMS,
    tile_bytes: int = PULL_TILE_BYTES,
    num_warps: int = PULL_WARPS,
    scale: bool | None = None,
    packed_width: int | None = None,
) -> torch.Tensor:
    """Pull the scheduled rows from every rank into ``out [sched.rows, H]``.

    ``source="x"``: the peers' ``x_buffer`` rows. ``source="dy"``: ``dy_buffer`` rows scaled by the
    router weight of their slot (the backward of the weighted combine); ``scale=False`` pulls them
    unscaled (a backward that also needs ``<dy, z>`` for the router-weight gradient). Padding rows
    are zeros; rows past the used ones are left untouched. Call after a barrier that follows the
    publish. Unscaled pulls go in token order (:func:`pull_tokens`: a token's row crosses NVLink
    once however many of this rank's experts it was routed to); scaled ones in row order.

    ``packed_width``: the buffer holds rows of that many int16 words instead (packed fp8 rows,
    ``fp8.packed_width(H)``, published by ``workspace.publish_packed``), and ``out`` is
    ``[sched.rows, packed_width]`` int16: the copy moves 16-bit words whatever they encode, so
    the token's fp8 bytes and scales arrive unchanged. Unscaled pulls only.
    """
    check_schedule(ws, sched)
    if source not in ("x", "dy"):
        raise ValueError(f"source must be 'x' or 'dy', got {source!r}")
    if source == "dy" and not ws.backward:
        raise ValueError("source='dy' needs a workspace built with backward=True")
    if scale is None:
        scale = source == "dy" and packed_width is None
    elif scale and source != "dy":
        raise ValueError("scale=True needs source='dy' (x rows are never scaled)")
    h, dtype = ws.hidden, ws.dtype
    if packed_width is not None:
        if scale:
            raise ValueError("packed_width needs scale=False: packed rows are words, not values")
        words = h * ws.dtype.itemsize // 2
        if (
            isinstance(packed_width, bool)
            or not isinstance(packed_width, int)
            or not 0 < packed_width <= words
            or packed_width % 8
        ):
            raise ValueError(
                f"packed_width must be a multiple of 8 int16 words (16-byte rows) in [8, "
                f"{words}] (a buffer row of {h} {ws.dtype} holds {words}), got {packed_width!r}"
            )
        h, dtype = packed_width, torch.int16
    if out is None:
        out = empty((sched.rows, h), dtype, ws.device)
    elif out.shape != (sched.rows, h) or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous [{sched.rows}, {h}] {dtype} tensor, "
            f"got {list(out.shape)} {out.dtype}"
        )
    rows, cols = copy_tile(h, dtype.itemsize, tile_bytes)
    table = ws.peers.x if source == "x" else ws.peers.dy
    if scale:  # each row is scaled by its own slot's weight: row order
        launch(
            _pull_kernel,
            (check_programs(programs),),
            table,
            ws.peers.weights,
            out,
            sched.row_src,
            sched.num_blocks,
            ws.num_tokens,
            h,
            TOP_K=ws.top_k,
            BLOCK_ROWS=sched.block_rows,
            SCALE=True,
            ROWS=rows,
            COLS=cols,
            UPCAST=interpreting(),
            num_warps=num_warps,
        )
    else:
        launch(
            _pull_tokens_kernel,
            (check_programs(programs),),
            table,
            out,
            sched.dest_row,
            sched.row_src,
            sched.num_blocks,
            ws.world_size,
            ws.num_tokens,
            h,
            TOP_K=ws.top_k,
            BLOCK_ROWS=sched.block_rows,
            ROWS=rows,
            COLS=cols,
            num_warps=num_warps,
        )
    return out


def combine_push(
    ws: Workspace,
    rows: torch.Tensor,
    sched: RowSchedule,
    target: str = "combine",
    programs: int = DEFAULT_COPY_PROGRAMS,
    tile_bytes: int = COPY_TILE_BYTES,
    num_warps: int = COPY_WARPS,
) -> None:
    """Push each real row of ``rows [sched.rows, H]`` to its source rank's slot buffer.

    ``target="combine"``: ``combine_buffer`` (forward); ``"dx"``: ``dx_slots`` (backward). The
    source rank may read its slots after a barrier that follows every rank's push.
    """
    check_schedule(ws, sched)
    if target not in ("combine", "dx"):
        raise ValueError(f"target must be 'combine' or 'dx', got {target!r}")
    if target == "dx" and not ws.backward:
        raise ValueError("target='dx' needs a workspace built with backward=True")
    h = ws.hidden
    if (
        rows.shape[0] < sched.rows
        or rows.shape[1:] != (h,)
        or rows.dtype != ws.dtype
        or not rows.is_contiguous()
    ):
        raise ValueError(
            f"rows must be a contiguous [>= {sched.rows}, {h}] {ws.dtype} tensor, "
            f"got {list(rows.shape)} {rows.dtype}"
        )
    tr, tc = copy_tile(h, ws.dtype.itemsize, tile_bytes)
    table = ws.peers.combine if target == "combine" else ws.peers.dx
    launch(
        _push_kernel,
        (check_programs(programs),),
        rows,
        table,
        sched.row_src,
        sched.num_blocks,
        ws.num_tokens,
        h,
        TOP_K=ws.top_k,
        BLOCK_ROWS=sched.block_rows,
        ROWS=tr,
        COLS=tc,
        num_warps=num_warps,
    )


def push_row_values(
    ws: Workspace, values: torch.Tensor, sched: RowSchedule, programs: int = DEFAULT_COPY_PROGRAMS
) -> None:
    """Push one fp32 per row (d topk_weights) into the source rank's ``dw_slots``."""
    check_schedule(ws, sched)
    if not ws.backward:
        raise ValueError("push_row_values needs a workspace built with backward=True")
    if values.dim() != 1 or values.shape[0] < sched.rows or values.dtype != torch.float32:
        raise ValueError(
            f"values must be a float32 [>= {sched.rows}] tensor, "
            f"got {list(values.shape)} {values.dtype}"
        )
    launch(
        _push_values_kernel,
        (check_programs(programs),),
        values,
        ws.peers.dw,
        sched.row_src,
        sched.num_blocks,
        ws.num_tokens,
        TOP_K=ws.top_k,
        BLOCK_ROWS=sched.block_rows,
        BLOCK=_ROUTING_BLOCK,
        num_warps=4,
    )
