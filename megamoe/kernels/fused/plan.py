"""The launch plan of a fused forward: every size, lag and grid derived from the shapes and the
tunables, once, on the host (no device reads).

The derivations (docs/tuning.md): :func:`comm_programs_for` (pull programs of the one-kernel
forward), :func:`comm_kernel_programs` (programs of the comm kernel), :func:`down_lag_for` and
:func:`routed_lag` (the task list's down lag), :func:`fused_grid`; the pipelined fp8
forward's pulls: :func:`plan_pulls` (:func:`pull_programs_for`). The fused backward's:
:func:`plan_backward` (:class:`BackwardPlan`, :class:`BackwardMeta`) and
:func:`backward_lag_for`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, TypeVar

import torch
import triton
import triton.language as tl

from .. import fp8_gemm
from ..gemm import GemmTiles, tiles_for
from ..runtime import cdiv, interpreting, persistent_programs

P = TypeVar("P")  # a plan (:func:`_once_per_launch`)

__all__ = [
    "FusedMeta",
    "FusedPlan",
    "plan_launch",
    "comm_programs_for",
    "pull_programs_for",
    "push_programs_for",
    "PullPlan",
    "plan_pulls",
    "comm_kernel_programs",
    "down_lag_for",
    "routed_lag",
    "fused_grid",
    "FUSED_WARPS",
    "FUSED_STAGES",
    "FP8_FUSED_WARPS",
    "FP8_FUSED_STAGES",
    "COMM_KERNEL_WARPS",
    "COMM_KERNEL_REGISTERS",
    "COMM_KERNEL_TILE_BYTES",
    "COMM_PULL",
    "COMM_PUSH",
    "COMM_BOTH",
    "PUSH_CHUNK_ROWS",
    "MIN_HALF_ROWS",
    "BackwardMeta",
    "BackwardPlan",
    "plan_backward",
    "backward_lag_for",
    "BACKWARD_STAGES",
]

# One warp count and pipeline depth for every role: the gate/up and down tiles must use the
# unfused kernels' warp count (8), which fixes the wgmma shapes and hence the bits. Stages only
# change the pipelining: 4 (as the unfused gate/up) needs ~197 KB of shared memory of 227.
FUSED_WARPS = 8
FUSED_STAGES = 4
# In fp8 the tiles are the Triton fp8 kernels' widths (``fp8_gemm.triton_tiles``), 128 rows as
# one tile of two warpgroups (64 rows each, as the unfused kernels' halves: the same wgmma
# shapes and bits) rather than two halves of one warpgroup: the halves need 254-255 registers
# a thread in the unfused kernels, and the fused kernel's own state made them spill.
FP8_FUSED_WARPS = 8
FP8_FUSED_STAGES = 4
# ... and beside the comm kernel (80 registers x 128 threads) capped so that both fit one SM's
# 64K registers: 216 (dsv3 at sm_90a: 207 used, no spills; 222 uncapped).
FP8_FUSED_REGISTERS = 216
# The fused backward's pipeline depth: the unfused backward GEMMs' 3 (~144 KB of shared memory).
BACKWARD_STAGES = 3
# The fused backward's route-grad task (W > 1) works on [16, 512] pieces of its row block, the
# route-grad kernel's tile (dz is elementwise: the shape only bounds the registers).
ROUTE_GRAD_ROWS = 16
ROUTE_GRAD_COLS = 512
# Rates of one program on an H200 at dsv3 shapes (docs/tuning.md): a pull program moves
# ~12 GB/s of rows over NVLink and ~18 GB/s of local rows, a GEMM program ~5 TFLOP/s.
PULL_GBPS_PER_PROGRAM = 12.0
LOCAL_PULL_GBPS_PER_PROGRAM = 18.0
GEMM_TFLOPS_PER_PROGRAM = 5.0
# ... and an SM of the warp-specialized fp8 gate/up kernel (``fp8_ws``; 1,167 TFLOP/s over an
# H100's 132 SMs at dsv3's gate/up)
WS_GEMM_TFLOPS_PER_PROGRAM = 8.8
# ... and a comm program pushing z rows (bf16) beside the warp-specialized down GEMM: 14 GB/s,
# fit to the push-program count that ran fastest at dsv3 (32 of an H100's 132 SMs, one-rank
# workspace; docs/tuning.md)
PUSH_GBPS_PER_PROGRAM = 14.0
# Rows per step when a down tile pushes its z tile to the source ranks (comm.push_tile): 32 x 256
# bf16 = 16 KB per step, 16 registers per thread (the tile's fp32 accumulator is already dead).
PUSH_CHUNK_ROWS = 32
# Smallest half block that runs as half tiles: tl.dot needs 16 rows.
MIN_HALF_ROWS = 16
# The comm kernel (config.comm_kernel): small programs beside the compute kernel's, at most one
# per SM. Its registers and shared memory must fit next to a compute program (208 registers x
# 256 threads, 192 KB): 4 warps capped at 80 registers and 16 KB copy tiles do.
COMM_KERNEL_TILE_BYTES = 16 * 1024
COMM_KERNEL_WARPS = 4
COMM_KERNEL_REGISTERS = 80
# One comm program per this many SMs: the rest of the SMs run MMAs undisturbed.
COMM_KERNEL_SM_SHARE = 2
# Phases of the comm kernel (bit flags): the interpreter runs the pulls, then the compute
# kernel, then the pushes; a GPU runs both phases in one launch beside the compute kernel.
COMM_PULL, COMM_PUSH, COMM_BOTH = 1, 2, 3


class FusedMeta(NamedTuple):
    """The constexprs of a fused launch (one ``C`` argument of both kernels; the kernels get
    :meth:`as_constexprs`)."""

    NUM_COMM: int  # pull programs (one kernel) or comm kernel programs
    MB: int  # rows per minibatch
    BM: int  # rows per block (the schedule's block_rows)
    BN_GATE_UP: int
    BK_GATE_UP: int
    BN_DOWN: int
    BK_DOWN: int
    TOP_K: int
    ROWS: int  # copy tile of the pulls (and the comm kernel's pushes)
    COLS: int
    LAG: int  # routed down lag (task-list groups)
    SHARED_LAG: int
    SHARED: bool
    PUSH_CHUNK: int
    RING_WRAPS: bool  # the ring holds fewer minibatches than the schedule
    COMM_KERNEL: bool  # pulls and pushes in the comm kernel
    HALF: bool  # half-height tiles for half-padded blocks
    TRACE: bool
    PHASE: int  # the comm kernel's COMM_PULL / COMM_PUSH / COMM_BOTH; 0 for the compute kernel
    INTERPRET: bool  # the CPU interpreter's sequential driver
    GPU: bool  # inline PTX (fences, timer) allowed
    UPCAST: bool  # fp32 tiles (the interpreter)
    # fp8 (docs/fused.md, "fp8"): block-scaled tiles on packed x rows, and one h task per row
    # block after its gate/up tiles (``roles.quantize_h``); 1 / False in bf16
    FP8: bool = False
    SPLIT_M: int = 1  # the fp8 tiles' row halves: 1, 128 rows on two warpgroups (FP8_FUSED_WARPS)
    STRICT: bool = False  # their ``strict_order``
    # the comm kernel's pushes: signals into z_done a row block once all its down tiles are
    # stored; 0: cdiv(H, BN_DOWN), one a tile (the pipelined fp8 forward's warp-specialized
    # down: ``fp8_gemm.stored_signals``)
    Z_SIGNALS: int = 0

    @functools.lru_cache(maxsize=256)  # (a launch's host time: built once per plan)
    def as_constexprs(self) -> "FusedMeta":
        """The same with every field a ``tl.constexpr``: device code then reads ``C.BM`` as a
        compile-time value (block shapes, static loops); a plain int field would be a
        run-time value there."""
        return FusedMeta(*(tl.constexpr(v) for v in self))


@dataclass(frozen=True)
class FusedPlan:
    """What one launch is: derived sizes, the grid and the constexprs of both kernels."""

    num_comm: int
    minibatch_rows: int
    ring_rows: int
    slots: int  # minibatches the ring holds
    max_minibatches: int
    full: bool  # the ring holds every row of the schedule
    buffer_rows: int  # rows of the routed buffers (the schedule's, or the ring's)
    grid: int
    warps: int  # of the compute kernel
    stages: int
    registers: int | None  # its register cap (None: the compiler's choice)
    expected_arrivals: int  # programs that count in at the start (0: no start-up count)
    shared_blocks: int
    meta: FusedMeta  # the compute kernel's
    comm_meta: FusedMeta | None  # the comm kernel's (None without it)


def _copy_programs(programs: int, flops_per_byte: float, gemm_tflops: float, gbps: float) -> int:
    """The smallest c of ``programs`` whose copies keep up with the other programs' GEMMs:
    c / (programs - c) >= GEMM rate / (``flops_per_byte`` * copy rate), per program."""
    ratio = gemm_tflops * 1e12 / (flops_per_byte * gbps * 1e9)
    return max(1, min(programs - 1, math.ceil(programs * ratio / (1 + ratio))))


def _pull_programs(
    programs: int, flops_per_byte: float, gemm_tflops: float, world_size: int
) -> int:
    """:func:`_copy_programs` of pulls: NVLink's rate at W > 1, a local copy's at W = 1."""
    pull = PULL_GBPS_PER_PROGRAM if world_size > 1 else LOCAL_PULL_GBPS_PER_PROGRAM
    return _copy_programs(programs, flops_per_byte, gemm_tflops, pull)


def comm_programs_for(programs: int, intermediate: int, world_size: int) -> int:
    """Pull programs for a grid of ``programs``: enough that the rows arrive as fast as the
    others compute them. A row of H bf16 (2H bytes) brings 6·H·I FLOPs (3·I a byte) at
    ``GEMM_TFLOPS_PER_PROGRAM`` a program."""
    return _pull_programs(programs, 3 * intermediate, GEMM_TFLOPS_PER_PROGRAM, world_size)


def pull_programs_for(
    programs: int, hidden: int, intermediate: int, row_bytes: int, world_size: int
) -> int:
    """Comm programs of the pipelined fp8 forward (:func:`plan_pulls`): enough that the rows
    (``row_bytes`` each: packed fp8) arrive as fast as the warp-specialized gate/up kernel on
    the other SMs takes them, 4·H·I FLOPs a row at ``WS_GEMM_TFLOPS_PER_PROGRAM`` an SM."""
    flops_per_byte = 4 * hidden * intermediate / row_bytes
    return _pull_programs(programs, flops_per_byte, WS_GEMM_TFLOPS_PER_PROGRAM, world_size)


def push_programs_for(programs: int, intermediate: int) -> int:
    """Comm programs of the pipelined fp8 forward that push z beside the down GEMM
    (``Pulls.push``): enough that z's rows (2·H bytes, bf16) leave as fast as the
    warp-specialized down kernel on the other SMs stores them, 2·H·I FLOPs a row (I a byte)
    at ``WS_GEMM_TFLOPS_PER_PROGRAM`` an SM and ``PUSH_GBPS_PER_PROGRAM`` a push program."""
    return _copy_programs(programs, intermediate, WS_GEMM_TFLOPS_PER_PROGRAM, PUSH_GBPS_PER_PROGRAM)


def comm_kernel_programs(device: torch.device) -> int:
    """Programs of the comm kernel when the config leaves them to the kernel."""
    return max(1, persistent_programs(device) // COMM_KERNEL_SM_SHARE)


def down_lag_for(
    programs: int, group_blocks: int, hidden: int, inter: int, bn_gate_up: int, bn_down: int
) -> int:
    """Groups between a group's gate/up tiles and its down tiles in the task list.

    A down tile should find its block's h done when it is taken: the last gate/up tile of the
    block was taken about ``lag`` groups of work earlier, and runs for one gate/up tile time, in
    which all ``programs`` together take ``programs * gate/up tile work`` of the list. So lag =
    that work over one group's work, rounded up, plus one group of margin (the shapes' FLOPs per
    tile: gate/up 2 * BN_GATE_UP * H, down BN_DOWN * I, per row)."""
    n1, n2 = -(-inter // bn_gate_up), -(-hidden // bn_down)
    gate_up = 2 * bn_gate_up * hidden
    group = group_blocks * (n1 * gate_up + n2 * bn_down * inter)
    return -(-programs * gate_up // group) + 1


def routed_lag(lag: int, slots: int, blocks_per_minibatch: int, max_minibatches: int) -> int:
    """The routed part's down lag: ``lag``, capped so that every down tile of minibatch
    ``m - slots`` comes before the first gate/up tile of minibatch m (whose pull waits for those
    rows' pushes). No cap when the ring never wraps."""
    if slots >= max_minibatches:
        return lag
    return min(lag, (slots - 1) * blocks_per_minibatch)


def fused_grid(num_comm: int, device: torch.device, comm_kernel: bool = False) -> int:
    """Programs of the compute launch: one per SM on a GPU (comm + compute, or all computing
    beside the comm kernel's ``num_comm``); one program under the interpreter."""
    if interpreting():
        return 1
    programs = persistent_programs(device)
    if comm_kernel and num_comm > programs:
        raise ValueError(
            f"num_comm ({num_comm}) comm kernel programs must sit at most one per "
            f"SM: the GPU has {programs} SMs"
        )
    if not comm_kernel and num_comm >= programs:
        raise ValueError(
            f"num_comm ({num_comm}) must leave compute programs: the GPU has {programs} SMs"
        )
    return programs


def _tiles(fp8: bool) -> tuple[GemmTiles, GemmTiles]:
    """(gate/up, down) tiles of a launch: the unfused kernels' (``gemm.tiles_for``), in fp8
    the Triton fp8 kernels' widths (``fp8_gemm.triton_tiles``; the warp-specialized kernels'
    bits), 128 rows on two warpgroups (``FP8_FUSED_WARPS``)."""
    if not fp8:
        return tiles_for("gate_up"), tiles_for("mm")
    return tuple(fp8_gemm.triton_tiles(k, fp8_gemm.tiles_for(k)) for k in ("gate_up", "mm"))


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _once_per_launch(plan: Callable[..., P]) -> Callable[..., P]:
    """``plan`` computed once per distinct arguments and distinct state it reads (the tiles,
    the SM count, the interpreter): a launch's plan is a pure function of them, and building
    it (sizes, grid, lags, two constexpr tuples) on every call was host time."""

    @functools.lru_cache(maxsize=256)
    def cached(reads: tuple, device: torch.device, **kwargs: Any) -> P:
        del reads  # (the key only)
        return plan(device, **kwargs)

    @functools.wraps(plan)
    def once(device: torch.device, **kwargs: Any) -> P:
        reads = (
            *(t(kind) for t in (tiles_for, fp8_gemm.tiles_for) for kind in ("gate_up", "mm")),
            persistent_programs(device),
            interpreting(),
        )
        return cached(reads, device, **kwargs)

    return once


@_once_per_launch
def plan_launch(
    device: torch.device,
    *,
    rows: int,
    block_rows: int,
    tokens: int,
    hidden: int,
    intermediate: int,
    shared_intermediate: int,
    top_k: int,
    itemsize: int,
    world_size: int,
    num_comm: int | None,
    minibatch_rows: int,
    ring_rows: int | None,
    down_lag: int | None,
    comm_kernel: bool,
    traced: bool,
    fp8: bool = False,
    row_words: int | None = None,
) -> FusedPlan:
    """The plan of one launch; a bad value is a ValueError naming it.

    ``rows``: the schedule's (worst-case) rows; ``shared_intermediate`` 0: no shared expert;
    ``num_comm`` / ``ring_rows`` / ``down_lag`` None: derived (see ``fused_forward``);
    ``fp8``: the fp8 recipe's tiles; ``row_words``: ``itemsize`` words of a pulled row (None:
    ``hidden``; packed fp8 rows: ``fp8.packed_width(hidden)``).
    Computed once per distinct launch (:func:`_once_per_launch`).
    """
    from .. import comm

    if num_comm is None:
        num_comm = (
            comm_kernel_programs(device)
            if comm_kernel
            else comm_programs_for(persistent_programs(device), intermediate, world_size)
        )
    _check_int("num_comm", num_comm, 1)
    if down_lag is not None:
        _check_int("down_lag", down_lag, 0)
    bm = block_rows
    _check_int("minibatch_rows", minibatch_rows, bm)
    if minibatch_rows % bm:
        raise ValueError(
            f"minibatch_rows ({minibatch_rows}) must be a multiple of the block rows ({bm})"
        )
    max_mb = cdiv(rows, minibatch_rows)
    if ring_rows is None:
        ring_rows = max_mb * minibatch_rows
    _check_int("ring_rows", ring_rows, minibatch_rows)
    if ring_rows % minibatch_rows:
        raise ValueError(
            f"ring_rows ({ring_rows}) must be a multiple of minibatch_rows ({minibatch_rows})"
        )
    full = ring_rows >= rows
    if fp8 and not full:
        raise ValueError(
            f"precision 'fp8' needs a ring that holds every row (its backward reads the saved "
            f"rows): ring_rows None or >= {rows}, got {ring_rows}"
        )
    if comm_kernel and not full:
        raise ValueError(
            f"comm_kernel needs a ring that holds every row: ring_rows None or >= "
            f"{rows}, got {ring_rows}"
        )
    slots = ring_rows // minibatch_rows
    grid = fused_grid(num_comm, device, comm_kernel)
    gate_up, down = _tiles(fp8)
    group = minibatch_rows // bm  # row blocks per task-list group
    computing = grid if comm_kernel else max(1, grid - num_comm)
    lag = routed_lag(
        down_lag
        if down_lag is not None
        else down_lag_for(computing, group, hidden, intermediate, gate_up.bn, down.bn),
        slots,
        1,
        max_mb,
    )
    has_shared = shared_intermediate > 0
    shared_lag = (
        down_lag
        if down_lag is not None or not has_shared
        else down_lag_for(computing, group, hidden, shared_intermediate, gate_up.bn, down.bn)
    )
    # Programs that count themselves in at the start: with the comm kernel on a GPU those of
    # both kernels (they must run side by side); the interpreter runs the comm kernel's phases
    # before and after the compute kernel, which counts its own program only.
    arrivals = 0
    if comm_kernel:
        arrivals = grid if interpreting() else grid + num_comm
    row_words = hidden if row_words is None else row_words
    copy_rows, copy_cols = comm.copy_tile(row_words, itemsize, comm.COPY_TILE_BYTES)
    meta = FusedMeta(
        NUM_COMM=num_comm,
        MB=minibatch_rows,
        BM=bm,
        BN_GATE_UP=gate_up.bn,
        BK_GATE_UP=gate_up.bk,
        BN_DOWN=down.bn,
        BK_DOWN=down.bk,
        TOP_K=top_k,
        ROWS=copy_rows,
        COLS=copy_cols,
        LAG=lag,
        SHARED_LAG=shared_lag or 0,
        SHARED=has_shared,
        PUSH_CHUNK=min(PUSH_CHUNK_ROWS, bm),
        RING_WRAPS=slots < max_mb,
        COMM_KERNEL=comm_kernel,
        # (the interpreter's small blocks run whole; fp8's tiles have no half-height variant)
        HALF=bm // 2 >= MIN_HALF_ROWS and not fp8,
        TRACE=traced,
        PHASE=0,
        INTERPRET=interpreting(),
        GPU=not interpreting(),
        UPCAST=interpreting(),
        FP8=fp8,
    )
    comm_meta = None
    if comm_kernel:
        kernel_rows, kernel_cols = comm.copy_tile(row_words, itemsize, COMM_KERNEL_TILE_BYTES)
        comm_meta = meta._replace(ROWS=kernel_rows, COLS=kernel_cols, TRACE=False, PHASE=COMM_BOTH)
    return FusedPlan(
        num_comm=num_comm,
        minibatch_rows=minibatch_rows,
        ring_rows=ring_rows,
        slots=slots,
        max_minibatches=max_mb,
        full=full,
        buffer_rows=rows if full else ring_rows,
        grid=grid,
        warps=FP8_FUSED_WARPS if fp8 else FUSED_WARPS,
        stages=FP8_FUSED_STAGES if fp8 else FUSED_STAGES,
        registers=FP8_FUSED_REGISTERS if fp8 and comm_kernel else None,
        expected_arrivals=arrivals,
        shared_blocks=cdiv(tokens, bm) if has_shared else 0,
        meta=meta,
        comm_meta=comm_meta,
    )


class PullPlan(NamedTuple):
    """The pipelined fp8 forward's pulls (:func:`plan_pulls`)."""

    num_comm: int  # comm kernel programs, each on an SM of its own
    programs: int  # the SMs left to the GEMMs while the pulls run
    push_programs: int  # comm kernel programs that push z beside the down GEMM ...
    down_programs: int  # ... on the other SMs
    max_minibatches: int  # arrival counters
    warps: int  # of a comm program
    meta: FusedMeta  # the comm kernel's constexprs (PHASE: COMM_PULL)


@_once_per_launch
def plan_pulls(
    device: torch.device,
    *,
    rows: int,
    block_rows: int,
    tokens: int,
    hidden: int,
    intermediate: int,
    top_k: int,
    world_size: int,
    num_comm: int | None,
    minibatch_rows: int,
    row_words: int,
    push_programs: int | None = None,
) -> PullPlan:
    """The comm kernel that pulls the packed fp8 rows of the schedule (``rows``, a ring of every
    row) minibatch by minibatch while the warp-specialized GEMMs run beside it. Those fill
    their SMs' registers, so the comm programs (``num_comm``; None: :func:`pull_programs_for`)
    take SMs of their own, with the one-kernel forward's pull tiles and warps (``FUSED_WARPS``,
    ``comm.COPY_TILE_BYTES``); the GEMMs get the rest. Later the comm kernel pushes z beside
    the down GEMM on ``push_programs`` SMs of their own (None: :func:`push_programs_for`).
    A bad value is a ValueError naming it."""
    from .. import comm

    programs = persistent_programs(device)
    if num_comm is None:
        num_comm = pull_programs_for(programs, hidden, intermediate, 2 * row_words, world_size)
    if push_programs is None:
        push_programs = push_programs_for(programs, intermediate)
    for name, value in (("num_comm", num_comm), ("push_programs", push_programs)):
        _check_int(name, value, 1)
        if value >= programs:
            raise ValueError(
                f"{name} ({value}) comm programs must leave SMs to the GEMMs: the GPU has "
                f"{programs}"
            )
    plan = plan_launch(
        device,
        rows=rows,
        block_rows=block_rows,
        tokens=tokens,
        hidden=hidden,
        intermediate=intermediate,
        shared_intermediate=0,
        top_k=top_k,
        itemsize=2,
        world_size=world_size,
        num_comm=num_comm,
        minibatch_rows=minibatch_rows,
        ring_rows=None,
        down_lag=None,
        comm_kernel=True,
        traced=False,
        fp8=True,
        row_words=row_words,
    )
    copy_rows, copy_cols = comm.copy_tile(row_words, 2, comm.COPY_TILE_BYTES)
    meta = plan.comm_meta._replace(ROWS=copy_rows, COLS=copy_cols, PHASE=COMM_PULL)
    return PullPlan(
        num_comm,
        programs - num_comm,
        push_programs,
        programs - push_programs,
        plan.max_minibatches,
        FUSED_WARPS,
        meta,
    )


# --------------------------------------------------------------------------------------------
# The fused backward


class BackwardMeta(NamedTuple):
    """The constexprs of a fused backward launch (one ``C`` argument; the kernel gets
    :meth:`as_constexprs`). The tiles are the unfused kernels' (``gemm.tiles_for``)."""

    BM: int  # rows per block (the schedule's block_rows)
    BN_SWIGLU: int  # dgrad of down + SwiGLU backward ("swiglu_bwd")
    BK_SWIGLU: int
    SWIGLU_SPLIT: int  # column pieces of its epilogue
    BN_DGRAD: int  # dgrad of gate + up ("mm")
    BK_DGRAD: int
    BM_WGRAD: int  # weight gradients ("wgrad"; BK: at most the block rows)
    BN_WGRAD: int
    BK_WGRAD: int
    G: int  # row blocks per task-list group
    LAG: int  # groups between a group's SwiGLU-backward tiles and its gate+up dgrad tiles
    SHARED_LAG: int
    SHARED: bool
    INTERPRET: bool
    GPU: bool  # inline PTX (fences) allowed
    UPCAST: bool  # fp32 tiles (the interpreter)
    # W > 1 (the exchange: dy pulled and d_x pushed inside the kernel; else False and unused)
    EXCHANGE: bool
    NUM_COMM: int  # comm programs (roles under the interpreter)
    MB: int  # rows per pulled minibatch (one task-list group)
    TOP_K: int
    ROWS: int  # copy tile of the pulls and pushes (``comm.copy_tile``)
    COLS: int
    RG_ROWS: int  # tile of the route-grad task (elementwise: any shape gives the same dz)
    RG_COLS: int
    # A macrobatch (a launch over one row window of the layout): the routed weight-gradient
    # tiles continue and leave fp32 carries (``gemm.wgrad_tile``'s ``CARRY``)
    CARRY: bool = False

    def as_constexprs(self) -> "BackwardMeta":
        return BackwardMeta(*(tl.constexpr(v) for v in self))


@dataclass(frozen=True)
class BackwardPlan:
    """What one fused backward launch is: its grid, task-list shape and constexprs."""

    grid: int
    group_rows: int
    max_blocks: int
    experts: int
    shared_blocks: int  # 0 without a shared expert
    meta: BackwardMeta
    num_comm: int = 0  # comm programs (W > 1)
    max_minibatches: int = 0  # pulled minibatches at most (W > 1; 0 at W = 1)


def backward_lag_for(
    programs: int, group_blocks: int, hidden: int, inter: int, bn_swiglu: int, bn_dgrad: int
) -> int:
    """Groups between a group's SwiGLU-backward tiles and its gate+up dgrad tiles: as
    :func:`down_lag_for`, with the SwiGLU-backward tile (one GEMM, K = H: BN_SWIGLU * H per
    row) in place of gate/up and the gate+up dgrad tile (two GEMMs, K = I: 2 * BN_DGRAD * I)
    in place of down."""
    n1, n2 = -(-inter // bn_swiglu), -(-hidden // bn_dgrad)
    first = bn_swiglu * hidden
    group = group_blocks * (n1 * first + n2 * 2 * bn_dgrad * inter)
    return -(-programs * first // group) + 1


def plan_backward(
    device: torch.device,
    *,
    rows: int,
    block_rows: int,
    tokens: int,
    hidden: int,
    intermediate: int,
    shared_intermediate: int,
    experts: int,
    group_rows: int,
    lag: int | None,
    programs: int | None,
    swiglu_split: int = 4,
    exchange: bool = False,
    world_size: int = 1,
    num_comm: int | None = None,
    top_k: int = 1,
    itemsize: int = 2,
    carry: bool = False,
) -> BackwardPlan:
    """The plan of one fused backward launch; a bad value is a ValueError naming it.

    ``rows``: the schedule's rows; ``group_rows``: rows per task-list group (a multiple of
    ``block_rows``; at W > 1 also the rows of a pulled minibatch); ``lag`` None:
    :func:`backward_lag_for`; ``programs`` None: one per SM (the interpreter: one);
    ``swiglu_split``: column pieces of the SwiGLU-backward epilogue (1, 2 or 4: the same bits,
    fewer registers). ``exchange`` (W > 1): ``num_comm`` programs pull dy and push d_x (None:
    :func:`comm_programs_for` of the grid; they leave at least one program computing).
    ``carry``: a macrobatch of the layout (``rows``: the window's), whose routed weight
    gradients continue from and leave fp32 carries."""
    from .. import comm

    bm = block_rows
    _check_int("group_rows", group_rows, bm)
    if group_rows % bm:
        raise ValueError(f"group_rows ({group_rows}) must be a multiple of the block rows ({bm})")
    if lag is not None:
        _check_int("lag", lag, 0)
    if swiglu_split not in (1, 2, 4):
        raise ValueError(f"swiglu_split must be 1, 2 or 4, got {swiglu_split!r}")
    sms = persistent_programs(device)
    if programs is None:
        programs = sms
    _check_int("programs", programs, 1)
    if programs > sms:
        raise ValueError(f"programs ({programs}) must be at most one per SM: the GPU has {sms}")
    grid = 1 if interpreting() else programs
    if exchange:
        if num_comm is None:
            num_comm = comm_programs_for(programs, intermediate, world_size)
        _check_int("num_comm", num_comm, 1)
        if not interpreting() and num_comm >= programs:
            raise ValueError(
                f"num_comm ({num_comm}) must leave compute programs: the grid has {programs}"
            )
    else:
        num_comm = 0
    copy_rows, copy_cols = comm.copy_tile(hidden, itemsize, comm.COPY_TILE_BYTES)
    swiglu, dgrad, wgrad = tiles_for("swiglu_bwd"), tiles_for("mm"), tiles_for("wgrad")
    group = group_rows // bm
    has_shared = shared_intermediate > 0
    shared_lag = 0 if lag is None else lag
    if lag is None:
        lag = backward_lag_for(programs, group, hidden, intermediate, swiglu.bn, dgrad.bn)
        if has_shared:
            shared_lag = backward_lag_for(
                programs, group, hidden, shared_intermediate, swiglu.bn, dgrad.bn
            )
    meta = BackwardMeta(
        BM=bm,
        BN_SWIGLU=swiglu.bn,
        BK_SWIGLU=swiglu.bk,
        SWIGLU_SPLIT=swiglu_split,
        BN_DGRAD=dgrad.bn,
        BK_DGRAD=dgrad.bk,
        BM_WGRAD=wgrad.bm,
        BN_WGRAD=wgrad.bn,
        BK_WGRAD=min(wgrad.bk, bm),  # as gemm.wgrad
        G=group,
        LAG=lag,
        SHARED_LAG=shared_lag,
        SHARED=has_shared,
        INTERPRET=interpreting(),
        GPU=not interpreting(),
        UPCAST=interpreting(),
        EXCHANGE=exchange,
        NUM_COMM=num_comm,
        MB=group_rows,
        TOP_K=top_k,
        ROWS=copy_rows,
        COLS=copy_cols,
        RG_ROWS=math.gcd(bm, ROUTE_GRAD_ROWS),
        RG_COLS=min(ROUTE_GRAD_COLS, triton.next_power_of_2(hidden)),
        CARRY=carry,
    )
    if carry and bm % meta.BK_WGRAD:
        raise ValueError(
            f"a macrobatch needs the weight gradients' K step ({meta.BK_WGRAD}) to divide the "
            f"block rows ({bm})"
        )
    return BackwardPlan(
        grid=grid,
        group_rows=group_rows,
        max_blocks=rows // bm,
        experts=experts,
        shared_blocks=cdiv(tokens, bm) if has_shared else 0,
        meta=meta,
        num_comm=num_comm,
        max_minibatches=cdiv(rows, group_rows) if exchange else 0,
    )
