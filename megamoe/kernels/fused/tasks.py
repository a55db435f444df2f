"""The task list of a fused launch, as pure index arithmetic (device functions).

Compute programs take list positions by atomic ticket (:func:`take_task`). The list is made of
parts (the shared expert's tiles, then the routed tiles); a part is a sequence of groups of one
minibatch of row blocks, and a group's down tiles come ``LAG`` groups after its gate/up tiles
(:func:`task_of`, :func:`grouped_task`). The order is topological, which is why no task ever
waits on a task that no running program holds (docs/fused.md, "Task list").

The fused backward's list (docs/fused.md, "Backward") reuses :func:`grouped_task` for its dgrad
parts (SwiGLU-backward tiles in place of gate/up, gate+up dgrad tiles in place of down) and adds
weight-gradient parts (:func:`wgrad_task`, :func:`wgrad_part_length`); :func:`backward_counts`
gives the parts' bounds. At W > 1 each routed block has one more task of the first kind, its
route-grad task (column 0, so a group's route-grad tasks come before its SwiGLU-backward
tiles).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .trace import TRACE_DOWN, TRACE_GATE_UP, TRACE_SHARED_DOWN, TRACE_SHARED_GATE_UP

__all__ = [
    "task_of",
    "grouped_task",
    "part_length",
    "gate_up_start",
    "task_kind",
    "take_task",
    "task_counts",
    "gate_up_tasks",
    "half_padding",
    "wgrad_task",
    "wgrad_part_length",
    "backward_counts",
]


@triton.jit
def task_of(t, num_blocks, n1, n2, LAG: tl.constexpr):
    """(is gate/up, row block, column tile) of task ``t`` of one part of the list.

    The part is made of groups s = 0, 1, ...: group s holds the gate/up tiles of block s (if it
    exists) followed by the down tiles of block s - LAG (if it exists). A block's down tiles thus
    come LAG groups after its gate/up tiles: topological order (no deadlock), and the programs
    that take them rarely find the block's h tiles still running. ``n1`` / ``n2``: the gate/up
    and down column tiles of a block.
    """
    head_blocks = tl.minimum(LAG, num_blocks)
    head = head_blocks * n1  # groups 0..LAG-1: gate/up tiles only
    mid_blocks = num_blocks - head_blocks  # groups LAG..num_blocks-1: both kinds
    mid = mid_blocks * (n1 + n2)
    t_mid = t - head
    t_tail = t_mid - mid  # the last LAG groups: down tiles only
    s = LAG + t_mid // (n1 + n2)
    j = t_mid % (n1 + n2)
    is_gate_up = (t < head) | ((t_mid < mid) & (j < n1))
    block = tl.where(
        t < head,
        t // n1,
        tl.where(t_mid < mid, tl.where(j < n1, s, s - LAG), mid_blocks + t_tail // n2),
    )
    col = tl.where(
        t < head, t % n1, tl.where(t_mid < mid, tl.where(j < n1, j, j - n1), t_tail % n2)
    )
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
def gate_up_start(block, num_blocks, n1, n2, LAG: tl.constexpr):
    """Position (in :func:`task_of`'s list) of the first gate/up tile of ``block``; the part's
    length when ``block >= num_blocks``."""
    pos = tl.where(block < LAG, block * n1, LAG * n1 + (block - LAG) * (n1 + n2))
    return tl.where(block < num_blocks, pos, num_blocks * (n1 + n2))


@triton.jit
def task_kind(
    task, counts, n1_shared, n1, n2, LAG: tl.constexpr, SHARED_LAG: tl.constexpr, G: tl.constexpr
):
    """The trace kind of list position ``task``: shared or routed, gate/up or down
    (``counts``: :func:`task_counts`)."""
    num_blocks, shared_blocks, shared_total = counts[0], counts[1], counts[2]
    if task < shared_total:
        is_gate_up = grouped_task(task, shared_blocks, n1_shared, n2, SHARED_LAG, G)[0]
        kind = tl.where(is_gate_up, TRACE_SHARED_GATE_UP, TRACE_SHARED_DOWN)
    else:
        is_gate_up = grouped_task(task - shared_total, num_blocks, n1, n2, LAG, G)[0]
        kind = tl.where(is_gate_up, TRACE_GATE_UP, TRACE_DOWN)
    return kind


@triton.jit
def take_task(ticket_ptr, limit, INTERPRET: tl.constexpr):
    """The next ticket; under the interpreter's driver only if it is below ``limit`` (else
    ``limit``, untaken): the sequential driver runs the list in rounds."""
    if INTERPRET:
        task = tl.atomic_add(ticket_ptr, 0, sem="relaxed", scope="gpu")
        if task < limit:
            task = tl.atomic_add(ticket_ptr, 1, sem="relaxed", scope="gpu")
        else:
            task = limit
    else:
        task = tl.atomic_add(ticket_ptr, 1, sem="relaxed", scope="gpu")
    return task


@triton.jit
def gate_up_tasks(inter, C: tl.constexpr):
    """Tasks of the first kind per row block of a forward part whose intermediate size is
    ``inter``: its gate/up column tiles and, in fp8 (``C.FP8``), the block's h-quantization
    task, which is their last column (after the group's gate/up tiles, before its down
    tiles)."""
    n = tl.cdiv(inter, C.BN_GATE_UP)
    if C.FP8:
        n += 1
    return n


@triton.jit
def task_counts(num_blocks_ptr, T, H, I, IS, C: tl.constexpr):
    """(routed row blocks, shared row blocks, shared tasks, all tasks) of a forward launch
    (``C``: its constexprs)."""
    num_blocks = tl.load(num_blocks_ptr)
    shared_blocks = tl.cdiv(T, C.BM)
    n2 = tl.cdiv(H, C.BN_DOWN)
    if C.SHARED:
        shared_total = part_length(shared_blocks, gate_up_tasks(IS, C), n2, C.MB // C.BM)
    else:
        shared_total = 0
    total = shared_total + part_length(num_blocks, gate_up_tasks(I, C), n2, C.MB // C.BM)
    return num_blocks, shared_blocks, shared_total, total


@triton.jit
def half_padding(row_src_ptr, row, HALF: tl.constexpr, BM: tl.constexpr):
    """With ``HALF``: is the second half of the row block at layout row ``row`` padding? (An
    expert's padding sits at the end of its last block, so its first padding row decides.)"""
    if HALF:
        return tl.load(row_src_ptr + row + BM // 2) < 0
    else:
        return False


@triton.jit
def wgrad_part_length(experts, m1, n1, m2, n2):
    """Tasks of a weight-gradient part: per expert the ``m1 x n1`` output tiles of d_W_gate,
    as many of d_W_up and the ``m2 x n2`` of d_W_down."""
    return experts * (2 * m1 * n1 + m2 * n2)


@triton.jit
def wgrad_task(t, m1, n1, m2, n2):
    """(expert, kind, m tile, n tile) of task ``t`` of a weight-gradient part: expert by
    expert, its d_W_gate tiles (kind 0), then d_W_up (1), then d_W_down (2), each in the unfused
    kernel's tile order (``tiles.tile_of``: the n tile fast)."""
    gate_up = m1 * n1
    per_expert = 2 * gate_up + m2 * n2
    expert = t // per_expert
    q = t % per_expert
    kind = tl.where(q < gate_up, 0, tl.where(q < 2 * gate_up, 1, 2))
    q = q - kind * gate_up
    tiles_n = tl.where(kind == 2, n2, n1)
    return expert, kind, q // tiles_n, q % tiles_n


@triton.jit
def backward_counts(
    num_blocks_ptr,
    T,
    H,
    I,
    IS,
    E,
    BM: tl.constexpr,
    BN_SWIGLU: tl.constexpr,
    BN_DGRAD: tl.constexpr,
    BM_WGRAD: tl.constexpr,
    BN_WGRAD: tl.constexpr,
    G: tl.constexpr,
    SHARED: tl.constexpr,
    RG: tl.constexpr,
):
    """(routed row blocks, shared row blocks (0 without a shared expert), end of the shared
    dgrad part, end of the shared part, end of the routed dgrad part, all tasks) of a fused
    backward launch: the list is
    [shared dgrad | shared wgrad | routed dgrad | routed wgrad]. ``RG``: route-grad tasks per
    routed row block (1 at W > 1, where each block's first task of the routed dgrad part
    computes its dz rows; else 0)."""
    num_blocks = tl.load(num_blocks_ptr)
    shared_blocks = 0  # (none without a shared expert: the flag buffer has no words for them)
    shared_dgrad = 0
    shared_end = 0
    if SHARED:
        shared_blocks = tl.cdiv(T, BM)
        shared_dgrad = part_length(shared_blocks, tl.cdiv(IS, BN_SWIGLU), tl.cdiv(H, BN_DGRAD), G)
        shared_end = shared_dgrad + wgrad_part_length(
            1,
            tl.cdiv(IS, BM_WGRAD),
            tl.cdiv(H, BN_WGRAD),
            tl.cdiv(H, BM_WGRAD),
            tl.cdiv(IS, BN_WGRAD),
        )
    routed_dgrad = shared_end + part_length(
        num_blocks, tl.cdiv(I, BN_SWIGLU) + RG, tl.cdiv(H, BN_DGRAD), G
    )
    total = routed_dgrad + wgrad_part_length(
        E, tl.cdiv(I, BM_WGRAD), tl.cdiv(H, BN_WGRAD), tl.cdiv(H, BM_WGRAD), tl.cdiv(I, BN_WGRAD)
    )
    return num_blocks, shared_blocks, shared_dgrad, shared_end, routed_dgrad, total
