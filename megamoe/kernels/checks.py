"""Device checks of a step's schedule: expert ids in range, and the expert-parallel capacity.

Both run as one-program kernels right after the schedule is built, with no host read. A check
that fails empties the local schedule (0 used blocks, every expert 0 rows: every later kernel
stays inside its buffers and computes nothing), sets the schedule's ``invalid`` word (the
combines then write NaN instead of reading stale or missing slots) and keeps the first failure's
description in its record (``megamoe.errors.IdWord`` / ``CapacityWord``) for the host's next
check. At W > 1 every rank checks every rank's ids and loads, so all of them agree.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ..errors import CapacityWord, IdWord
from .runtime import empty, launch
from .schedule import RowSchedule, max_rows

__all__ = ["check_ids", "limit_capacity", "LOAD_BLOCK"]

_CAP_FLAG = tl.constexpr(int(CapacityWord.FLAG))
_CAP_RANK = tl.constexpr(int(CapacityWord.RANK))
_CAP_ROWS = tl.constexpr(int(CapacityWord.ROWS))
_CAP_LIMIT = tl.constexpr(int(CapacityWord.LIMIT))
_CAP_COUNT = tl.constexpr(int(CapacityWord.COUNT))
_ID_FLAG = tl.constexpr(int(IdWord.FLAG))
_ID_RANK = tl.constexpr(int(IdWord.RANK))
_ID_TOKEN = tl.constexpr(int(IdWord.TOKEN))
_ID_K = tl.constexpr(int(IdWord.K))
_ID_VALUE = tl.constexpr(int(IdWord.VALUE))
_ID_EXPERTS = tl.constexpr(int(IdWord.EXPERTS))
_ID_COUNT = tl.constexpr(int(IdWord.COUNT))
_INT32_MAX = tl.constexpr(2**31 - 1)
_INT32_MIN = tl.constexpr(-(2**31))
# Routing entries per step of the checks' loops.
LOAD_BLOCK = 1024


@triton.jit
def empty_schedule(num_blocks_ptr, row_start_ptr, E: tl.constexpr, E1_PAD: tl.constexpr):
    """0 used blocks and every expert 0 rows: later kernels compute (and read) nothing."""
    tl.store(num_blocks_ptr, 0)
    experts = tl.arange(0, E1_PAD)
    tl.store(row_start_ptr + experts, tl.zeros([E1_PAD], dtype=tl.int32), mask=experts <= E)


@triton.jit(do_not_specialize=["n_entries"])  # (a loop-carried minimum starts from it)
def _check_ids_kernel(
    ids_ptr,
    n_entries,
    tokens_per_rank,
    top_k,
    num_experts,
    num_blocks_ptr,
    row_start_ptr,
    record_ptr,
    invalid_ptr,
    E: tl.constexpr,
    E1_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Find the first entry (in global slot order, rank*T*K + t*K + k) outside
    ``[0, num_experts)``. ``invalid_ptr[0]`` is always written: 1 when there is one, else 0.
    The record counts bad schedules and keeps the first one's (rank, token, k, value)."""
    first = n_entries
    for start in range(0, n_entries, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inside = offs < n_entries
        ids = tl.load(ids_ptr + offs, mask=inside, other=0)
        bad = inside & ((ids < 0) | (ids >= num_experts))
        first = tl.minimum(first, tl.min(tl.where(bad, offs, n_entries), axis=0))
    found = first < n_entries
    tl.store(invalid_ptr, found.to(tl.int32))
    if found:
        empty_schedule(num_blocks_ptr, row_start_ptr, E, E1_PAD)
        value = tl.load(ids_ptr + first).to(tl.int64)
        earlier = tl.atomic_add(record_ptr + _ID_COUNT, 1)
        if earlier == 0:  # the first bad schedule since the last check keeps its description
            per_rank = tokens_per_rank * top_k
            tl.store(record_ptr + _ID_RANK, first // per_rank)
            tl.store(record_ptr + _ID_TOKEN, first % per_rank // top_k)
            tl.store(record_ptr + _ID_K, first % top_k)
            tl.store(
                record_ptr + _ID_VALUE,
                tl.minimum(tl.maximum(value, _INT32_MIN), _INT32_MAX).to(tl.int32),
            )
            tl.store(record_ptr + _ID_EXPERTS, num_experts)
        tl.store(record_ptr + _ID_FLAG, 1)


def check_ids(
    ids: torch.Tensor,
    num_experts: int,
    tokens_per_rank: int,
    sched: RowSchedule,
    record: torch.Tensor,
) -> torch.Tensor:
    """The ``invalid`` word (int32 [1]) of ``sched`` built from ``ids`` (every rank's
    ``[W*T, K]``, in global slot order): set on the device when an id is outside
    ``[0, num_experts)`` (the global expert count), which also empties ``sched``."""
    invalid = empty(1, torch.int32, ids.device)
    e = sched.num_experts
    launch(
        _check_ids_kernel,
        (1,),
        ids.reshape(-1),
        ids.numel(),
        tokens_per_rank,
        ids.shape[-1],
        num_experts,
        sched.num_blocks,
        sched.row_start,
        record,
        invalid,
        E=e,
        E1_PAD=triton.next_power_of_2(e + 1),
        BLOCK=LOAD_BLOCK,
    )
    return invalid


@triton.jit
def _capacity_kernel(
    ids_ptr,
    n_entries,
    experts_per_rank,
    capacity,
    cap_rows,
    rank,
    num_blocks_ptr,
    row_start_ptr,
    record_ptr,
    invalid_ptr,
    W: tl.constexpr,
    W_PAD: tl.constexpr,
    E: tl.constexpr,
    E1_PAD: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Count each rank's routed rows; on overflow empty the local schedule and record it.

    The local padded rows are checked too, which the real-row test already implies. An
    overflow sets ``invalid_ptr[0]`` (the id check wrote it before: an or). The record counts
    overflows (atomic add) and keeps the first one's (rank, rows, capacity).
    """
    ranks = tl.arange(0, W_PAD)
    loads = tl.zeros([W_PAD], dtype=tl.int32)
    for start in range(0, n_entries, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ids = tl.load(ids_ptr + offs, mask=offs < n_entries, other=-1)
        dest = tl.where(ids >= 0, ids // experts_per_rank, -1)
        loads += tl.sum((dest[:, None] == ranks[None, :]).to(tl.int32), axis=0)
    over = (ranks < W) & (loads > capacity)
    first = tl.min(tl.where(over, ranks, W_PAD), axis=0)
    local_over = tl.load(num_blocks_ptr) * BLOCK_ROWS > cap_rows
    overflow = (first < W) | local_over
    if overflow:
        tl.store(invalid_ptr, 1)
        culprit = tl.where(first < W, first, rank)
        empty_schedule(num_blocks_ptr, row_start_ptr, E, E1_PAD)
        earlier = tl.atomic_add(record_ptr + _CAP_COUNT, 1)
        if earlier == 0:  # the first overflow since the last check keeps its description
            tl.store(record_ptr + _CAP_RANK, culprit)
            tl.store(record_ptr + _CAP_ROWS, tl.sum(tl.where(ranks == culprit, loads, 0), axis=0))
            tl.store(record_ptr + _CAP_LIMIT, capacity)
        tl.store(record_ptr + _CAP_FLAG, 1)


def limit_capacity(
    full: RowSchedule,
    all_ids: torch.Tensor,
    capacity: int,
    rank: int,
    world: int,
    record: torch.Tensor,
    invalid: torch.Tensor,
) -> RowSchedule:
    """The schedule with its row buffers sized for ``capacity`` real rows (plus tile padding);
    an overflow sets ``invalid`` on the device.

    The schedule's own int32 tables keep their worst-case size (small); the activation buffers
    follow ``rows``. Nothing to check when the capacity is the worst case.
    """
    if capacity >= all_ids.numel():
        return full
    cap_rows = min(full.rows, max_rows(capacity, full.num_experts, full.block_rows))
    e = full.num_experts
    launch(
        _capacity_kernel,
        (1,),
        all_ids,
        all_ids.numel(),
        e,
        capacity,
        cap_rows,
        rank,
        full.num_blocks,
        full.row_start,
        record,
        invalid,
        W=world,
        W_PAD=triton.next_power_of_2(world),
        E=e,
        E1_PAD=triton.next_power_of_2(e + 1),
        BLOCK_ROWS=full.block_rows,
        BLOCK=LOAD_BLOCK,
    )
    return dataclasses.replace(full, rows=cap_rows)
