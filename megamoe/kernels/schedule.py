"""Row schedule on the device: where every routed (source rank, token, k) row goes.

The layout is a pure function of ``topk_ids`` (no atomics, no host reads):
  * experts are laid out one after another, each padded to a multiple of ``block_rows``;
  * inside an expert, rows are in global slot order ``slot = rank*T*K + t*K + k``
    (rank-major, then token, then k), so the layout generalizes to expert parallelism.

Three launches: a per-chunk histogram, a one-program scan (prefix sums, expert starts, the
row-block -> expert table, padded-row markers) and a per-chunk placement. Grids depend only on
static sizes, so the schedule can be captured in a CUDA graph.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .runtime import cdiv, empty, launch

__all__ = ["RowSchedule", "build_row_schedule", "max_rows", "uniform_schedule", "row_window"]

# Elements of the one-hot [chunk, experts] tile a program may hold (registers, not memory).
_ONEHOT_ELEMS = 8192
_MIN_CHUNK = 16
_MAX_CHUNK = 1024
# Row blocks handled per step of the scan's block -> expert loop, and padded rows per step.
_SCAN_BLOCKS = 64
_PAD_STEP = 32


@dataclass(frozen=True)
class RowSchedule:
    """Device tensors of the padded, expert-contiguous row layout, plus its static sizes.

    dest_row     [T*K]  int32  row of slot t*K+k in the layout (-1 if not on this rank)
    row_src      [rows] int32  global slot of each row; -1 for padding (valid below the used rows)
    row_start    [E+1]  int32  first row of each expert (padded), row_start[E] = used rows
    counts       [E]    int32  real rows of each expert
    block_expert [rows / block_rows] int32  expert of each row block, -1 past the used blocks
    num_blocks   [1]    int32  used row blocks
    """

    dest_row: torch.Tensor
    row_src: torch.Tensor
    row_start: torch.Tensor
    counts: torch.Tensor
    block_expert: torch.Tensor
    num_blocks: torch.Tensor
    num_tokens: int
    top_k: int
    num_experts: int
    block_rows: int
    rows: int  # worst-case rows of the layout (buffers are sized for it)
    world_size: int = 1  # ranks whose tokens ``num_tokens`` counts (expert parallel)

    @property
    def max_blocks(self) -> int:
        return self.rows // self.block_rows

    @property
    def balanced_rows(self) -> float:
        """Rows each expert gets when the routing is balanced: a host-side size that picks
        tiles (``gemm.wgrad_kind``), never a result. The layout holds ``num_tokens`` tokens of
        ``world_size`` ranks routed over ``num_experts * world_size`` experts in all."""
        return self.num_tokens * self.top_k / (self.num_experts * self.world_size)


def max_rows(entries: int, num_experts: int, block_rows: int) -> int:
    """Worst-case padded rows: every entry placed plus up to block_rows-1 padding per expert."""
    worst = entries + num_experts * (block_rows - 1)
    return cdiv(worst, block_rows) * block_rows


@triton.jit
def expert_onehot(ids_ptr, offs, n_entries, expert_lo, E: tl.constexpr, E_PAD: tl.constexpr):
    """One-hot [len(offs), E_PAD] int32 of the local expert of each entry (0 rows if not local)."""
    in_range = offs < n_entries
    ids = tl.load(ids_ptr + offs, mask=in_range, other=-1).to(tl.int64) - expert_lo
    valid = in_range & (ids >= 0) & (ids < E)
    experts = tl.arange(0, E_PAD)
    onehot = (ids[:, None] == experts[None, :]) & valid[:, None]
    return onehot.to(tl.int32), valid


@triton.jit
def _histogram_kernel(
    ids_ptr,
    n_entries,
    expert_lo,
    chunk_counts_ptr,
    E: tl.constexpr,
    E_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
):
    c = tl.program_id(0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    onehot, _ = expert_onehot(ids_ptr, offs, n_entries, expert_lo, E, E_PAD)
    tl.store(chunk_counts_ptr + c * E_PAD + tl.arange(0, E_PAD), tl.sum(onehot, axis=0))


@triton.jit
def _scan_kernel(
    chunk_counts_ptr,
    chunk_base_ptr,
    n_chunks,
    counts_ptr,
    row_start_ptr,
    block_expert_ptr,
    num_blocks_ptr,
    row_src_ptr,
    max_blocks,
    E: tl.constexpr,
    E_PAD: tl.constexpr,
    CHUNKS_PER_STEP: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    SCAN_BLOCKS: tl.constexpr,
    PAD_STEP: tl.constexpr,
):
    experts = tl.arange(0, E_PAD)
    is_expert = experts < E
    # Per-expert exclusive prefix over chunks (chunk order == slot order).
    carry = tl.zeros([E_PAD], dtype=tl.int32)
    for c0 in range(0, n_chunks, CHUNKS_PER_STEP):
        chunks = c0 + tl.arange(0, CHUNKS_PER_STEP)
        offs = chunks[:, None] * E_PAD + experts[None, :]
        mask = (chunks < n_chunks)[:, None]
        cnt = tl.load(chunk_counts_ptr + offs, mask=mask, other=0)
        tl.store(chunk_base_ptr + offs, tl.cumsum(cnt, axis=0) - cnt + carry[None, :], mask=mask)
        carry += tl.sum(cnt, axis=0)
    counts = tl.where(is_expert, carry, 0)
    padded = (counts + BLOCK_ROWS - 1) // BLOCK_ROWS * BLOCK_ROWS
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    used_rows = tl.sum(padded, axis=0)
    used_blocks = used_rows // BLOCK_ROWS
    tl.store(counts_ptr + experts, counts, mask=is_expert)
    tl.store(row_start_ptr + experts, starts, mask=is_expert)
    tl.store(row_start_ptr + E, used_rows)
    tl.store(num_blocks_ptr, used_blocks)
    # Row block b belongs to the expert whose padded range holds it: the number of experts
    # that end at or before b (empty experts end where they start, so they are skipped).
    end_blocks = tl.where(is_expert, ends // BLOCK_ROWS, 2147483647)
    for b0 in range(0, max_blocks, SCAN_BLOCKS):
        blocks = b0 + tl.arange(0, SCAN_BLOCKS)
        owner = tl.sum((end_blocks[None, :] <= blocks[:, None]).to(tl.int32), axis=1)
        owner = tl.where(blocks < used_blocks, owner, -1)
        tl.store(block_expert_ptr + blocks, owner, mask=blocks < max_blocks)
    # Padding rows of each expert carry slot -1 (they gather zeros and are never combined).
    for j0 in range(0, BLOCK_ROWS, PAD_STEP):
        j = j0 + tl.arange(0, PAD_STEP)
        pad_rows = (starts + counts)[:, None] + j[None, :]
        pad_mask = is_expert[:, None] & (j[None, :] < (padded - counts)[:, None])
        tl.store(row_src_ptr + pad_rows, tl.full([E_PAD, PAD_STEP], -1, tl.int32), mask=pad_mask)


@triton.jit
def _place_kernel(
    ids_ptr,
    n_entries,
    expert_lo,
    slot_offset,
    chunk_base_ptr,
    row_start_ptr,
    dest_row_ptr,
    row_src_ptr,
    E: tl.constexpr,
    E_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
):
    c = tl.program_id(0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    onehot, valid = expert_onehot(ids_ptr, offs, n_entries, expert_lo, E, E_PAD)
    experts = tl.arange(0, E_PAD)
    # Rank of each entry among the entries of its expert inside this chunk.
    within = tl.sum(onehot * tl.cumsum(onehot, axis=0), axis=1) - 1
    base = tl.load(chunk_base_ptr + c * E_PAD + experts) + tl.load(
        row_start_ptr + experts, mask=experts < E, other=0
    )
    dest = tl.sum(onehot * base[None, :], axis=1) + within
    tl.store(dest_row_ptr + offs, tl.where(valid, dest, -1), mask=offs < n_entries)
    tl.store(row_src_ptr + dest, slot_offset + offs, mask=valid)


def _chunk(e_pad: int) -> int:
    return max(_MIN_CHUNK, min(_MAX_CHUNK, _ONEHOT_ELEMS // e_pad))


def build_row_schedule(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_rows: int,
    expert_lo: int = 0,
    rank: int = 0,
    world_size: int = 1,
) -> RowSchedule:
    """Schedule the rows of local experts ``[expert_lo, expert_lo + num_experts)``.

    ``topk_ids`` is [T, K] (int32/int64, global ids). ``rank`` is the source rank of these ids;
    with one rank every entry is local. ``world_size``: the ranks whose ids ``topk_ids`` holds
    (all of them, stacked, in expert parallelism), for :attr:`RowSchedule.balanced_rows`.
    """
    t, k = topk_ids.shape
    entries = t * k
    dev = topk_ids.device
    ids = topk_ids.contiguous().view(-1)
    e_pad = triton.next_power_of_2(num_experts)
    chunk = _chunk(e_pad)
    n_chunks = max(1, cdiv(entries, chunk))
    rows = max_rows(entries, num_experts, block_rows)
    chunk_counts = empty((n_chunks, e_pad), torch.int32, dev)
    chunk_base = empty((n_chunks, e_pad), torch.int32, dev)
    counts = empty(num_experts, torch.int32, dev)
    row_start = empty(num_experts + 1, torch.int32, dev)
    block_expert = empty(rows // block_rows, torch.int32, dev)
    num_blocks = empty(1, torch.int32, dev)
    dest_row = empty(entries, torch.int32, dev)
    row_src = empty(rows, torch.int32, dev)
    launch(
        _histogram_kernel,
        (n_chunks,),
        ids,
        entries,
        expert_lo,
        chunk_counts,
        E=num_experts,
        E_PAD=e_pad,
        CHUNK=chunk,
    )
    launch(
        _scan_kernel,
        (1,),
        chunk_counts,
        chunk_base,
        n_chunks,
        counts,
        row_start,
        block_expert,
        num_blocks,
        row_src,
        rows // block_rows,
        E=num_experts,
        E_PAD=e_pad,
        CHUNKS_PER_STEP=max(1, _ONEHOT_ELEMS // e_pad),
        BLOCK_ROWS=block_rows,
        SCAN_BLOCKS=_SCAN_BLOCKS,
        PAD_STEP=min(_PAD_STEP, block_rows),
    )
    launch(
        _place_kernel,
        (n_chunks,),
        ids,
        entries,
        expert_lo,
        rank * entries,
        chunk_base,
        row_start,
        dest_row,
        row_src,
        E=num_experts,
        E_PAD=e_pad,
        CHUNK=chunk,
    )
    return RowSchedule(
        dest_row,
        row_src,
        row_start,
        counts,
        block_expert,
        num_blocks,
        num_tokens=t,
        top_k=k,
        num_experts=num_experts,
        block_rows=block_rows,
        rows=rows,
        world_size=world_size,
    )


def row_window(sched: RowSchedule, first: int, rows: int) -> RowSchedule:
    """The layout's rows ``[first, first + rows)`` as a schedule of their own: window row r is
    layout row ``first + r``. Views and a few small device ops (no host read, capturable).

    Each expert keeps the part of its padded rows inside the window (``row_start`` and
    ``counts`` clipped to it: an expert outside has none), the used row blocks are the
    window's (none when the window lies past the used rows: the kernels then do nothing), a
    slot whose row lies outside has ``dest_row`` -1. ``first`` and ``rows``: multiples of the
    block rows within the layout's rows (host-known, so the window never depends on the
    routing)."""
    bm = sched.block_rows
    if first % bm or rows % bm or first < 0 or rows <= 0 or first + rows > sched.rows:
        raise ValueError(
            f"a row window must be whole blocks of {bm} rows inside the layout's {sched.rows}, "
            f"got first {first}, rows {rows}"
        )
    end = first + rows
    starts = (sched.row_start - first).clamp(0, rows)
    real_ends = (sched.row_start[:-1] + sched.counts - first).clamp(0, rows)
    inside = (sched.dest_row >= first) & (sched.dest_row < end)
    return dataclasses.replace(
        sched,
        dest_row=torch.where(inside, sched.dest_row - first, -1),
        row_src=sched.row_src[first:end],
        row_start=starts,
        counts=real_ends - starts[:-1],
        block_expert=sched.block_expert[first // bm : end // bm],
        num_blocks=(sched.num_blocks - first // bm).clamp(0, rows // bm),
        rows=rows,
    )


# uniform_schedule's tables by (rows, block rows, device): constants that no kernel writes.
_UNIFORM: dict[tuple[int, int, torch.device], RowSchedule] = {}
_UNIFORM_MAX = 64


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def uniform_schedule(num_rows: int, block_rows: int, device: torch.device) -> RowSchedule:
    """The layout of one expert that takes all ``num_rows`` rows in order (the shared expert).

    Rows are not padded: the GEMM descriptors clip at ``num_rows``. Built once per size and
    device and then reused (six small launches and allocations per call saved on the host),
    except while a CUDA graph is captured: tensors made during a capture hold their values only
    after a replay, so they are never kept.
    """
    device = torch.device(device)
    key = (num_rows, block_rows, device)
    cached = _UNIFORM.get(key)
    if cached is not None:
        return cached
    sched = _uniform(num_rows, block_rows, device)
    if not _capturing(device):
        if len(_UNIFORM) >= _UNIFORM_MAX:
            _UNIFORM.clear()
        _UNIFORM[key] = sched
    return sched


def _uniform(num_rows: int, block_rows: int, device: torch.device) -> RowSchedule:
    blocks = cdiv(num_rows, block_rows)
    i32 = dict(dtype=torch.int32, device=device)
    row_start = torch.arange(2, **i32) * num_rows  # [0, num_rows], built on the device
    return RowSchedule(
        dest_row=torch.arange(num_rows, **i32),
        row_src=torch.arange(num_rows, **i32),
        row_start=row_start,
        counts=row_start[1:],
        block_expert=torch.zeros(blocks, **i32),
        num_blocks=torch.full((1,), blocks, **i32),
        num_tokens=num_rows,
        top_k=1,
        num_experts=1,
        block_rows=block_rows,
        rows=blocks * block_rows,
    )
