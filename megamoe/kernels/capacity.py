"""Capacity check of an expert-parallel schedule: every rank checks every rank's load, so all of
them agree on an overflow without talking to each other.

On overflow the local schedule is emptied (0 used blocks, every expert 0 rows), which keeps every
later kernel inside its buffers, the schedule's ``invalid`` word is set (the combines then write
NaN instead of reading stale slots) and the capacity record (``megamoe.errors.CapacityWord``)
keeps the first overflow's description for the host's next check.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ..errors import CapacityWord
from .runtime import empty
from .schedule import RowSchedule, max_rows

__all__ = ["limit_capacity"]

_CAP_FLAG = tl.constexpr(int(CapacityWord.FLAG))
_CAP_RANK = tl.constexpr(int(CapacityWord.RANK))
_CAP_ROWS = tl.constexpr(int(CapacityWord.ROWS))
_CAP_LIMIT = tl.constexpr(int(CapacityWord.LIMIT))
_CAP_COUNT = tl.constexpr(int(CapacityWord.COUNT))
# Routing entries per step of the kernel's loop.
LOAD_BLOCK = 1024


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

    The local padded rows are checked too, which the real-row test already implies.
    ``invalid_ptr[0]`` (this schedule's word) is always written: 1 on overflow, else 0. The
    record counts overflows (atomic add) and keeps the first one's (rank, rows, capacity).
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
    tl.store(invalid_ptr, overflow.to(tl.int32))
    if overflow:
        culprit = tl.where(first < W, first, rank)
        tl.store(num_blocks_ptr, 0)
        experts = tl.arange(0, E1_PAD)
        tl.store(row_start_ptr + experts, tl.zeros([E1_PAD], dtype=tl.int32), mask=experts <= E)
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
) -> tuple[RowSchedule, torch.Tensor | None]:
    """The schedule with its row buffers sized for ``capacity`` real rows (plus tile padding),
    and its ``invalid`` word (int32 [1], set on the device when it overflowed).

    The schedule's own int32 tables keep their worst-case size (small); the activation buffers
    follow ``rows``. Nothing to check when the capacity is the worst case (no word: None).
    """
    if capacity >= all_ids.numel():
        return full, None
    cap_rows = min(full.rows, max_rows(capacity, full.num_experts, full.block_rows))
    e = full.num_experts
    invalid = empty(1, torch.int32, all_ids.device)
    _capacity_kernel[(1,)](
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
    return dataclasses.replace(full, rows=cap_rows), invalid
