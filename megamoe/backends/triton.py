"""Backend "triton": expert compute with the Triton kernels of ``megamoe.kernels``, on one GPU or
expert-parallel over NVLink (any world size).

One GPU (W = 1):
  Forward:  schedule -> gather rows -> gate/up GEMM + SwiGLU -> down GEMM -> combine (+ shared).
  Backward: route grad (d_z rows, d_w) -> down dgrad + SwiGLU backward -> gate/up dgrad (one
  accumulator) -> combine d_x; weight gradients per expert in fixed row order.

Expert parallel (W > 1), through the symmetric workspace (docs/comm.md):
  Schedule: publish ids -> barrier -> gather every rank's ids -> row schedule of the local
            experts (global slot order) -> capacity check on the device (on overflow: empty
            schedule, and the step's combines write NaN instead of reading stale slots).
  Forward:  publish x, weights -> barrier -> pull x rows from the peers -> the same expert
            GEMMs -> push z rows into the source ranks' combine slots -> barrier -> combine the
            own slots in k order (+ shared).
  Backward: publish dy -> barrier -> pull dy rows (unscaled) -> route grad by row -> the same
            dgrad/wgrad GEMMs -> push d_x rows and d_w values to the source ranks -> barrier ->
            sum the own d_x slots in k order (+ shared d_x).

Each expert sees its rows in the same order and tiles at every world size and the combines run
the same kernels, so routed outputs and gradients at W > 1 have the bits of W = 1 on the same
global batch. Nothing reads the device from the host (a whole step can be captured in a CUDA
graph); device error records (capacity overflow, barrier stalls) reach Python as described at
:func:`check`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import weakref
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from ..config import MoEConfig
from ..types import ExpertWeights, MoEGrads

if TYPE_CHECKING:
    from ..kernels.schedule import RowSchedule
    from ..workspace import Workspace

__all__ = ["is_available", "supports", "build_schedule", "forward", "backward", "check", "CapacityError",
           "TritonSchedule", "TritonContext", "EpRouting", "schedule_steps", "forward_steps",
           "backward_steps", "routed_unfused", "CHECK_ENV"]

# Any expert-parallel world size (the comm layer is written for W ranks).
MAX_WORLD_SIZE = None
# Compute capability the kernels are written for (wgmma, TMA).
MIN_CAPABILITY = (9, 0)
KERNEL_DTYPE = torch.bfloat16
# TMA needs 16-byte row strides: sizes must be multiples of this many bf16 elements.
SIZE_MULTIPLE = 8
# Barrier channel of the layer's protocol (every barrier of a step, in program order).
EP_CHANNEL = 0
# When device error records are turned into exceptions (see `check`):
#   lagged (default) at each build_schedule, the records as of the previous build_schedule,
#                    through an async copy: never stalls the stream, errors show <= 2 steps late
#   eager            also a blocking check at the end of every forward and backward (debugging)
#   off              never automatically; call `check` yourself
CHECK_ENV = "MEGAMOE_EP_CHECK"
CHECK_MODES = ("lagged", "eager", "off")
# Capacity record words (constexprs: the kernel uses them too; lists index with them): flag, then
# the first overflow's offending rank, its routed rows and the capacity, then the number of
# overflowed schedules since the record was last cleared.
_CAP_FLAG, _CAP_RANK, _CAP_ROWS, _CAP_LIMIT, _CAP_COUNT = (tl.constexpr(i) for i in range(5))
_CAP_WORDS = 5
# Routing entries per step of the capacity kernel's loop.
_LOAD_BLOCK = 1024

_T = TypeVar("_T")
# A step of the EP protocol: yields where every rank must pass a device barrier, returns a value.
Steps = Generator[None, None, _T]


class CapacityError(RuntimeError):
    """A rank was routed more rows than ``MoEConfig.capacity_factor`` allows.

    Recorded on every rank (each checks all ranks' loads), so every rank raises it at the same
    check. The overflowed steps computed no routed rows; their y, d_x and d topk_weights are NaN.
    The workspace stays usable: the next step that fits is exact.
    """


def _interpreting() -> bool:
    from ..kernels.runtime import interpreting
    return interpreting()


def is_available(device: torch.device | None = None) -> tuple[bool, str]:
    """CUDA with compute capability >= 9.0 and Triton importable.

    On the CPU the answer is no even under ``TRITON_INTERPRET=1``: the interpreter is far too
    slow for real use and must never be what ``backend="auto"`` picks; tests call this module's
    functions directly there.
    """
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cpu":
        extra = " (the Triton interpreter runs it for tests only)" if _interpreting() else ""
        return False, "needs a CUDA GPU with compute capability >= 9.0" + extra
    if device.type != "cuda" or not torch.cuda.is_available():
        return False, f"needs a CUDA device, got {device}"
    cap = torch.cuda.get_device_capability(device)
    if cap < MIN_CAPABILITY:
        return False, f"needs compute capability >= 9.0 (Hopper), got {cap[0]}.{cap[1]}"
    return True, f"CUDA compute capability {cap[0]}.{cap[1]}"


# --------------------------------------------------------------------------------------------
# Schedule and context


@dataclass(frozen=True)
class EpRouting:
    """What an expert-parallel schedule adds: the workspace and every rank's routing."""

    workspace: Workspace
    all_ids: torch.Tensor  # [W*T, K] int32, the schedule's input (global slot order)
    capacity: int  # real routed rows one rank may hold
    # int32 [1], written by the capacity kernel: 1 when this schedule overflowed (then the
    # combines output NaN), else 0. None when nothing is checked (worst-case capacity).
    invalid: torch.Tensor | None = None


@dataclass(frozen=True)
class TritonSchedule:
    """Row layout of the routed experts (device tensors) plus the config it was built for."""

    routed: RowSchedule
    config: MoEConfig
    ep: EpRouting | None = None


@dataclass
class TritonContext:
    """Activations the backward reads (all in the schedule's row layout unless noted)."""

    schedule: TritonSchedule
    x: torch.Tensor
    slot_weights: torch.Tensor  # router weights by global slot: [T*K] (W=1) or [W*T*K] (W>1)
    weights: ExpertWeights
    xs: torch.Tensor
    g: torch.Tensor
    u: torch.Tensor
    h: torch.Tensor
    z: torch.Tensor
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (g, u, h) in token order


def _world_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def supports(config: MoEConfig, dtype: torch.dtype | None) -> tuple[bool, str]:
    """Whether the kernels handle this shape and dtype (``backend="auto"`` falls back if not)."""
    if dtype is not None and dtype != KERNEL_DTYPE:
        return False, f"x must be bfloat16 for the Triton kernels, got {dtype}"
    for name in ("hidden_size", "intermediate_size", "shared_intermediate_size"):
        value = getattr(config, name)
        if value % SIZE_MULTIPLE:
            return False, (f"{name} must be a multiple of {SIZE_MULTIPLE} for the Triton kernels "
                           f"(TMA row alignment), got {value}")
    return True, "supported"


def _check_supported(x: torch.Tensor, config: MoEConfig) -> None:
    ok, reason = supports(config, x.dtype)
    if not ok:
        raise (TypeError if x.dtype != KERNEL_DTYPE else ValueError)(reason)


def _contiguous(weights: ExpertWeights) -> ExpertWeights:
    return ExpertWeights(*(w.contiguous() if w is not None else None for w in weights))


# --------------------------------------------------------------------------------------------
# Expert compute (the same calls at every world size: the root of W>1 == W=1 bitwise)


def _experts_forward(xs: torch.Tensor, weights: ExpertWeights,
                     sched: RowSchedule) -> tuple[torch.Tensor, ...]:
    """(g, u, h, z) of the routed rows."""
    from ..kernels import gemm
    g, u, h = gemm.gate_up(xs, weights.w_gate, weights.w_up, sched)
    return g, u, h, gemm.grouped_mm(h, weights.w_down, sched)


def _shared_forward(x: torch.Tensor, weights: ExpertWeights, config: MoEConfig,
                    programs: int | None = None
                    ) -> tuple[tuple[torch.Tensor, ...] | None, torch.Tensor | None]:
    """((g, u, h), output) of the shared expert on the local tokens; (None, None) without one.
    ``programs``: the GEMMs' grid (default one per SM)."""
    from ..kernels import gemm
    from ..kernels.schedule import uniform_schedule
    if not weights.has_shared:
        return None, None
    one = uniform_schedule(x.shape[0], config.block_rows, x.device)
    sg, su, sh = gemm.gate_up(x, weights.s_gate[None], weights.s_up[None], one, programs)
    return (sg, su, sh), gemm.grouped_mm(sh, weights.s_down[None], one, programs)


def _experts_dgrad(dz: torch.Tensor, ctx: TritonContext) -> tuple[torch.Tensor, ...]:
    """(d_x rows, d_g, d_u) of the routed rows."""
    from ..kernels import gemm
    sched, w = ctx.schedule.routed, ctx.weights
    dg, du = gemm.dgrad_swiglu(dz, w.w_down, ctx.g, ctx.u, sched)
    return gemm.dgrad_pair(dg, w.w_gate, du, w.w_up, sched), dg, du


def _experts_wgrad(dz: torch.Tensor, dg: torch.Tensor, du: torch.Tensor,
                   ctx: TritonContext) -> tuple[torch.Tensor, ...]:
    """(d_w_gate, d_w_up, d_w_down) of the routed experts."""
    from ..kernels import gemm
    sched = ctx.schedule.routed
    return (gemm.wgrad(dg, ctx.xs, sched), gemm.wgrad(du, ctx.xs, sched),
            gemm.wgrad(dz, ctx.h, sched))


def _shared_dgrad(dy: torch.Tensor, ctx: TritonContext, programs: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, RowSchedule] | None:
    """(shared d_x, d_g, d_u, the token layout they used) over the local tokens; None without
    a shared expert."""
    from ..kernels import gemm
    if ctx.shared is None:
        return None
    w, (sg, su, _), one = ctx.weights, ctx.shared, _token_schedule(ctx)
    dsg, dsu = gemm.dgrad_swiglu(dy, w.s_down[None], sg, su, one, programs)
    return gemm.dgrad_pair(dsg, w.s_gate[None], dsu, w.s_up[None], one, programs), dsg, dsu, one


def _shared_wgrad(dy: torch.Tensor, dgrad: tuple[torch.Tensor, ...] | None, ctx: TritonContext,
                  programs: int | None = None) -> tuple[torch.Tensor | None, ...]:
    """(d_s_gate, d_s_up, d_s_down) from :func:`_shared_dgrad`'s output (three None without a
    shared expert)."""
    from ..kernels import gemm
    if dgrad is None:
        return None, None, None
    _, dsg, dsu, one = dgrad
    pairs = ((dsg, ctx.x), (dsu, ctx.x), (dy, ctx.shared[2]))
    return tuple(gemm.wgrad(a, b, one, programs)[0] for a, b in pairs)


def _token_schedule(ctx: TritonContext) -> RowSchedule:
    """The shared expert's row layout: every local token, in order, as one expert."""
    from ..kernels.schedule import uniform_schedule
    return uniform_schedule(ctx.x.shape[0], ctx.schedule.config.block_rows, ctx.x.device)


class _BesideCopies:
    """Work on a second stream next to the NVLink copies of the current stream.

    The copies use ``config.copy_programs`` SMs and leave the others idle; GEMMs launched with
    :attr:`programs` (the rest) fill them, and both fit on the GPU at once whichever starts
    first. Off (``config.overlap_shared`` False, copies on more than half of the SMs, no CUDA,
    or under the interpreter), ``run`` calls in line with the default grid. ``run`` forks: the
    side stream first waits for everything queued on the current stream; ``join`` makes the
    current stream wait for the side work (callers join in a ``finally``: an error between fork
    and join must not leave a graph capture unjoined). Tensors made on the side stream are
    recorded on the current one (allocator safety). Graph capture records the fork and join as
    event edges.
    """

    def __init__(self, device: torch.device, config: MoEConfig) -> None:
        from ..kernels.runtime import persistent_programs
        self.enabled = (config.overlap_shared and device.type == "cuda"
                        and not _interpreting())
        self.programs = None
        if self.enabled:
            sms = persistent_programs(device)
            self.programs = sms - config.copy_programs
            # Copies on most of the GPU leave too little beside them: run the GEMMs after.
            self.enabled = self.programs * 2 >= sms
        if self.enabled:
            self.main = torch.cuda.current_stream(device)
            self.side = _side_stream(device)
        else:
            self.programs = None

    def run(self, fn: Callable[..., _T], *args, **kwargs) -> _T:
        if not self.enabled:
            return fn(*args, **kwargs)
        self.side.wait_stream(self.main)
        with torch.cuda.stream(self.side):
            out = fn(*args, programs=self.programs, **kwargs)
        for t in _tensors(out):
            t.record_stream(self.main)
        return out

    def join(self) -> None:
        if self.enabled:
            self.main.wait_stream(self.side)


@functools.lru_cache(maxsize=None)
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


# --------------------------------------------------------------------------------------------
# Per-workspace protocol state and error reporting


@dataclass(eq=False)
class _EpState:
    """Host and device state of the EP protocol on one workspace (shared by layers using it)."""

    capacity_record: torch.Tensor  # int32 [_CAP_WORDS], set by the capacity kernel
    host_words: torch.Tensor  # (pinned) copy of the stall and capacity records, for lagged checks
    snapshot: torch.cuda.Event | None = None
    snapshot_pending: bool = False
    # The peers may still read our routing_ids (published by the last build_schedule, which ends
    # without a barrier): the next build_schedule must pass a barrier before overwriting them.
    routing_in_use: bool = False


_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _state(ws: Workspace) -> _EpState:
    state = _STATES.get(ws)
    if state is None:
        from ..workspace import ERROR_WORDS
        pinned = ws.device.type == "cuda"
        state = _EpState(
            capacity_record=torch.zeros(_CAP_WORDS, dtype=torch.int32, device=ws.device),
            host_words=torch.zeros(ERROR_WORDS + _CAP_WORDS, dtype=torch.int32,
                                   pin_memory=pinned))
        _STATES[ws] = state
    return state


def _describe_capacity(cap: list[int]) -> str:
    n = cap[_CAP_COUNT]
    return (f"expert-parallel capacity exceeded: {n} step{'s' if n != 1 else ''} overflowed since "
            f"the last check; the first: rank {cap[_CAP_RANK]} was routed {cap[_CAP_ROWS]} rows, "
            f"its capacity is {cap[_CAP_LIMIT]} (MoEConfig.capacity_factor times T*top_k). No "
            f"routed rows were computed in an overflowed step on any rank; its y, d_x and d "
            f"topk_weights are NaN. Raise capacity_factor, or set it to None to allow the worst "
            f"case (W*T*top_k rows).")


def _raise_if_recorded(ws: Workspace, snapshot: list[int] | None = None) -> None:
    """Raise what the device records (stall record, then capacity record) hold, clearing them.

    ``snapshot``: an earlier copy of the words (the lagged check). Only when it shows an error
    are the live records read (blocking) and cleared, so an overflow recorded after the
    snapshot is counted in this report instead of being wiped unseen. None: read them live.
    A capacity error leaves the workspace usable; a stall does not (see ``StallError``).
    """
    from ..workspace import ERR_FLAG, ERROR_WORDS, take_stall
    if snapshot is not None and snapshot[ERR_FLAG] == 0 and snapshot[ERROR_WORDS + _CAP_FLAG] == 0:
        return
    words = _device_words(ws).tolist()  # blocking: everything queued so far has run
    cap = words[ERROR_WORDS:]
    stall = take_stall(ws, words[:ERROR_WORDS])  # the one stall decoder; clears a set record
    if cap[_CAP_FLAG]:
        _state(ws).capacity_record.zero_()
    if stall is not None:
        if cap[_CAP_FLAG]:
            raise type(stall)(f"{stall} (The capacity record was set too: "
                              f"{_describe_capacity(cap)})")
        raise stall
    if cap[_CAP_FLAG]:
        raise CapacityError(_describe_capacity(cap))


def _device_words(ws: Workspace) -> torch.Tensor:
    return torch.cat([ws.errors, _state(ws).capacity_record])


def _capturing(ws: Workspace) -> bool:
    return ws.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def check(target: TritonSchedule | TritonContext | Workspace) -> None:
    """Raise what the device recorded on this schedule's workspace since the last check.

    :class:`CapacityError` when some rank was routed more rows than its capacity: every rank
    records it (the check runs on all ranks' routing), so every rank raises at the same check;
    the message counts the overflowed steps since the last check; the workspace stays usable.
    ``StallError`` when a barrier of this rank gave up waiting for a peer: recorded only on the
    rank that waited, so the ranks do not agree, and fatal: drop the workspace on every rank
    (``megamoe.workspace.clear_workspace_cache()``) and let the next step rebuild it. The records
    are cleared as they are raised. A blocking read (host sync): call it at check points, never
    inside a captured graph. With W = 1 there is no workspace and nothing to check.
    """
    ws = _workspace_of(target)
    if ws is not None:
        _raise_if_recorded(ws)


def _workspace_of(target: TritonSchedule | TritonContext | Workspace) -> Workspace | None:
    if isinstance(target, TritonContext):
        target = target.schedule
    if isinstance(target, TritonSchedule):
        return target.ep.workspace if target.ep is not None else None
    return target


def _check_mode() -> str:
    mode = os.environ.get(CHECK_ENV, CHECK_MODES[0])
    if mode not in CHECK_MODES:
        raise ValueError(f"{CHECK_ENV} must be one of {list(CHECK_MODES)}, got {mode!r}")
    return mode


def _lagged_check(ws: Workspace) -> None:
    """At a step start: raise what the previous snapshot holds, then snapshot the records again.

    The snapshot is an async copy into pinned memory after everything queued so far; waiting for
    it one step later never stalls the stream (the GPU is still busy with the step in between).
    Only when it shows an error are the live records read (a blocking read, once) before they
    are cleared, so overflows recorded since are counted, not lost. Capacity errors are recorded
    on every rank, so every rank raises them at the same call, before any barrier, and no peer
    is left waiting. A stall is recorded only on the rank that waited: that rank raises alone
    and its peers stall at their next barrier; it is fatal (see ``StallError``).
    """
    state = _state(ws)
    if _check_mode() == "off" or _capturing(ws):
        return
    if state.snapshot_pending:
        if state.snapshot is not None:
            state.snapshot.synchronize()
        state.snapshot_pending = False
        _raise_if_recorded(ws, snapshot=state.host_words.tolist())
    state.host_words.copy_(_device_words(ws), non_blocking=True)
    if ws.device.type == "cuda":
        state.snapshot = torch.cuda.Event()
        state.snapshot.record()
    state.snapshot_pending = True


def _eager_check(ws: Workspace) -> None:
    if _check_mode() == "eager" and not _capturing(ws):
        check(ws)


# --------------------------------------------------------------------------------------------
# Capacity: every rank checks every rank's load, so all of them agree on an overflow


@triton.jit
def _capacity_kernel(ids_ptr, n_entries, experts_per_rank, capacity, cap_rows, rank,
                     num_blocks_ptr, row_start_ptr, record_ptr, invalid_ptr, W: tl.constexpr,
                     W_PAD: tl.constexpr, E: tl.constexpr, E1_PAD: tl.constexpr,
                     BLOCK_ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """Count each rank's routed rows; on overflow empty the local schedule and record it.

    Emptying (0 used blocks, every expert 0 rows) keeps every later kernel inside its buffers.
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


def _limit_capacity(full: RowSchedule, all_ids: torch.Tensor, capacity: int, rank: int,
                    world: int, record: torch.Tensor
                    ) -> tuple[RowSchedule, torch.Tensor | None]:
    """The schedule with its row buffers sized for ``capacity`` real rows (plus tile padding),
    and its ``invalid`` word (int32 [1], set on the device when it overflowed).

    The schedule's own int32 tables keep their worst-case size (small); the activation buffers
    follow ``rows``. Nothing to check when the capacity is the worst case (no word: None).
    """
    from ..kernels.runtime import empty
    from ..kernels.schedule import max_rows
    if capacity >= all_ids.numel():
        return full, None
    cap_rows = min(full.rows, max_rows(capacity, full.num_experts, full.block_rows))
    e = full.num_experts
    invalid = empty(1, torch.int32, all_ids.device)
    _capacity_kernel[(1,)](all_ids, all_ids.numel(), e, capacity, cap_rows, rank,
                           full.num_blocks, full.row_start, record, invalid, W=world,
                           W_PAD=triton.next_power_of_2(world), E=e,
                           E1_PAD=triton.next_power_of_2(e + 1), BLOCK_ROWS=full.block_rows,
                           BLOCK=_LOAD_BLOCK)
    return dataclasses.replace(full, rows=cap_rows), invalid


# --------------------------------------------------------------------------------------------
# The expert-parallel protocol, as generators: the driver runs a device barrier at each yield
# (`_run` on GPUs; the CPU tests run every emulated rank's steps in lockstep instead).


def _barrier_point(ws: Workspace) -> Steps[None]:
    """Every rank passes a device barrier here; afterwards no peer still reads our routing."""
    yield
    _state(ws).routing_in_use = False


def _run(steps: Steps[_T], ws: Workspace) -> _T:
    from ..kernels import comm
    try:
        while True:
            next(steps)
            comm.barrier(ws, EP_CHANNEL)
    except StopIteration as done:
        return done.value


def schedule_steps(topk_ids: torch.Tensor, config: MoEConfig, ws: Workspace) -> Steps[TritonSchedule]:
    """Publish ids, exchange, and lay out the rows of this rank's experts (no host sync)."""
    from ..kernels import comm
    from ..kernels.schedule import build_row_schedule
    from ..workspace import publish
    state = _state(ws)
    if state.routing_in_use:  # two schedules in a row: peers may still read the last ids
        yield from _barrier_point(ws)
    publish(ws, topk_ids=topk_ids.detach())
    yield from _barrier_point(ws)
    all_ids, _ = comm.gather_routing(ws)
    state.routing_in_use = True
    e_local = config.local_experts(ws.world_size)
    full = build_row_schedule(all_ids, e_local, config.block_rows,
                              expert_lo=ws.rank * e_local)
    capacity = config.capacity_rows(ws.num_tokens, ws.world_size)
    routed, invalid = _limit_capacity(full, all_ids, capacity, ws.rank, ws.world_size,
                                      state.capacity_record)
    return TritonSchedule(routed, config, EpRouting(ws, all_ids, capacity, invalid))


def routed_unfused(ws: Workspace, schedule: TritonSchedule,
                   weights: ExpertWeights) -> tuple[torch.Tensor, ...]:
    """(xs, g, u, h, z): pull x rows, expert GEMMs, push z rows into the sources' combine slots."""
    from ..kernels import comm
    sched, config = schedule.routed, schedule.config
    xs = comm.dispatch_pull(ws, sched, "x", programs=config.copy_programs)
    g, u, h, z = _experts_forward(xs, weights, sched)
    comm.combine_push(ws, z, sched, "combine", programs=config.copy_programs)
    return xs, g, u, h, z


def experts_unfused(ws: Workspace, schedule: TritonSchedule, weights: ExpertWeights,
                    x: torch.Tensor) -> ExpertsOutput:
    """The part between the forward's barriers: the shared expert on the local tokens beside
    the dispatch pull (``config.overlap_shared``), and the routed experts
    (:func:`routed_unfused`)."""
    beside = _BesideCopies(ws.device, schedule.config)
    try:
        shared, shared_out = beside.run(_shared_forward, x, weights, schedule.config)
        routed = routed_unfused(ws, schedule, weights)
    finally:
        beside.join()
    return routed, shared, shared_out


# ((xs, g, u, h, z) or five Nones when not kept, shared (sg, su, sh) or None, shared output or
# None), with z pushed into the source ranks' combine slots.
ExpertsOutput = tuple[tuple, "tuple[torch.Tensor, ...] | None", "torch.Tensor | None"]
# (workspace, schedule, local weights, local tokens) -> ExpertsOutput
ExpertsForward = Callable[["Workspace", TritonSchedule, ExpertWeights, torch.Tensor],
                          ExpertsOutput]


def forward_steps(x: torch.Tensor, topk_weights: torch.Tensor, weights: ExpertWeights,
                  schedule: TritonSchedule, experts: ExpertsForward | None = None
                  ) -> Steps[tuple[torch.Tensor, TritonContext]]:
    """Pull dispatch, expert GEMMs, push combine, local k-order combine (+ shared).

    ``experts`` does the part between the two barriers (default :func:`experts_unfused`;
    backend "fused" passes its kernel).
    """
    from ..kernels import comm, rows
    from ..workspace import publish
    ws = schedule.ep.workspace
    publish(ws, x=x.detach(), topk_weights=topk_weights.detach())
    yield from _barrier_point(ws)
    _, slot_weights = comm.gather_routing(ws)
    routed, shared, shared_out = (experts or experts_unfused)(ws, schedule, weights, x)
    yield from _barrier_point(ws)
    # After an overflow nobody pushed into the slots: the combine writes NaN, not stale rows.
    y = rows.combine_slots(ws.combine_buffer, ws.top_k, topk_weights, shared_out, x.dtype,
                           invalid=schedule.ep.invalid)
    ctx = TritonContext(schedule, x, slot_weights.view(-1), weights, *routed, shared)
    return y, ctx


def backward_steps(ctx: TritonContext, dy: torch.Tensor) -> Steps[MoEGrads]:
    """Pull dy rows, route grad by row, dgrad/wgrad GEMMs, push d_x rows and d_w values back."""
    from ..kernels import comm, rows
    from ..workspace import publish
    schedule = ctx.schedule
    ws, sched, programs = schedule.ep.workspace, schedule.routed, schedule.config.copy_programs
    publish(ws, dy=dy.detach())
    # The shared expert needs only the local dy: its d_x runs beside the dy pull, its weight
    # gradients beside the d_x push (config.overlap_shared; each about as long as the copy).
    beside = _BesideCopies(ws.device, schedule.config)
    try:
        shared_dgrad = beside.run(_shared_dgrad, dy, ctx)
        yield from _barrier_point(ws)
        dy_rows = comm.dispatch_pull(ws, sched, "dy", programs=programs, scale=False)
        dz, dw_rows = rows.route_grad_rows(dy_rows, ctx.z, ctx.slot_weights, sched)
        dxs, dg, du = _experts_dgrad(dz, ctx)
        shared_grads = beside.run(_shared_wgrad, dy, shared_dgrad, ctx)
        comm.combine_push(ws, dxs, sched, "dx", programs=programs)
        comm.push_row_values(ws, dw_rows, sched, programs=programs)
        d_w_gate, d_w_up, d_w_down = _experts_wgrad(dz, dg, du, ctx)
    finally:
        beside.join()
    dx_shared = None if shared_dgrad is None else shared_dgrad[0]
    yield from _barrier_point(ws)
    invalid = schedule.ep.invalid
    dx = rows.combine_slots(ws.dx_slots, ws.top_k, None, dx_shared, ctx.x.dtype, invalid=invalid)
    d_topk = ws.dw_slots.view(ws.num_tokens, ws.top_k)
    d_topk = (d_topk.clone() if invalid is None else  # NaN after an overflow (stale slots)
              torch.where(invalid != 0, float("nan"), d_topk))
    return MoEGrads(dx, d_topk, d_w_gate, d_w_up, d_w_down, *shared_grads)


# --------------------------------------------------------------------------------------------
# The backend interface


def build_schedule(topk_ids: torch.Tensor, config: MoEConfig,
                   group: dist.ProcessGroup | None) -> TritonSchedule:
    """Device-side row layout of this step's routing (no host sync).

    With W > 1 this is also the step's check point for errors of earlier steps (see
    :func:`check` and ``MEGAMOE_EP_CHECK``), and the first call for a shape creates the
    symmetric workspace (a collective: every rank must call it).
    """
    from ..kernels.schedule import build_row_schedule
    if _world_size(group) == 1:
        routed = build_row_schedule(topk_ids, config.num_experts, config.block_rows)
        return TritonSchedule(routed, config)
    from ..workspace import get_workspace
    t, k = topk_ids.shape
    ws = get_workspace(group, t, config.hidden_size, k, KERNEL_DTYPE, topk_ids.device)
    _lagged_check(ws)
    return _run(schedule_steps(topk_ids, config, ws), ws)


def forward(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
            weights: ExpertWeights, config: MoEConfig, group: dist.ProcessGroup | None,
            schedule: TritonSchedule | None) -> tuple[torch.Tensor, TritonContext]:
    """y [T, H] bf16 and the context for :func:`backward`."""
    from ..kernels import rows

    _check_supported(x, config)
    if schedule is None:
        schedule = build_schedule(topk_ids, config, group)
    weights = _contiguous(weights)
    x = x.contiguous()
    topk_weights = topk_weights.contiguous()
    if schedule.ep is not None:
        ws = schedule.ep.workspace
        if x.shape[0] != ws.num_tokens:
            raise ValueError(f"x has {x.shape[0]} tokens, the schedule was built for "
                             f"{ws.num_tokens}")
        y, ctx = _run(forward_steps(x, topk_weights, weights, schedule), ws)
        _eager_check(ws)
        return y, ctx
    sched = schedule.routed
    xs = rows.gather(x, sched)
    g, u, h, z = _experts_forward(xs, weights, sched)
    shared, shared_out = _shared_forward(x, weights, config)
    y = rows.combine(z, sched, topk_weights, shared_out, x.dtype)
    return y, TritonContext(schedule, x, topk_weights.view(-1), weights, xs, g, u, h, z, shared)


def backward(ctx: TritonContext, grad_y: torch.Tensor) -> MoEGrads:
    """Gradients of x (bf16), the router weights (fp32) and every weight (weight dtype)."""
    from ..kernels import rows

    dy = grad_y.to(ctx.x.dtype).contiguous()
    if ctx.schedule.ep is not None:
        ws = ctx.schedule.ep.workspace
        grads = _run(backward_steps(ctx, dy), ws)
        _eager_check(ws)
        return grads
    sched = ctx.schedule.routed
    dz, d_topk = rows.route_grad(dy, ctx.z, ctx.slot_weights, sched)
    dxs, dg, du = _experts_dgrad(dz, ctx)
    d_w_gate, d_w_up, d_w_down = _experts_wgrad(dz, dg, du, ctx)
    shared_dgrad = _shared_dgrad(dy, ctx)
    shared_grads = _shared_wgrad(dy, shared_dgrad, ctx)
    dx_shared = None if shared_dgrad is None else shared_dgrad[0]
    dx = rows.combine(dxs, sched, None, dx_shared, ctx.x.dtype)
    return MoEGrads(dx, d_topk, d_w_gate, d_w_up, d_w_down, *shared_grads)
