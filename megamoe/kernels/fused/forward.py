"""The fused forward: shared expert, pull dispatch, gate/up + SwiGLU, down and push combine in
one persistent kernel (docs/fused.md).

It replaces the unfused sequence ``dispatch_pull -> gate_up -> down -> combine_push`` (and the
shared expert's two GEMMs) of backend "triton"; the barriers around it and the local k-order
combine stay small separate launches.

One kernel (``comm_kernel=False``; one program per SM, ``launch_cooperative_grid=True`` so
every program is resident): programs ``[0, num_comm)`` first pull, minibatch by minibatch
(``roles.comm_role``), then compute like the others. With the comm kernel the pulls and pushes
run in a small second kernel whose programs sit beside the compute kernel's on the same SMs,
and every compute program computes. Compute programs take tasks by atomic ticket from a list in
topological order (``tasks``): the shared expert's tiles first (no communication: they hide
the first pulls), then the routed tiles.

The tiles are the unfused kernels' device functions with the same tile shapes; rows sit at
``row % ring`` of the ring buffers, which changes addresses, not arithmetic. So ``xs, g, u, h,
z``, the pushed slots and the shared activations have the unfused path's bits for every
tunable. Every spin-wait has a budget (``comm.wait_at_least``): on expiry it records (stage,
index, peer, rank) in the workspace's stall record and the program stops; the host raises
``StallError`` at its next check.

Under the interpreter (``INTERPRET``, programs run one after another) one program runs, per
minibatch m, every comm role's pull of m, then the compute tasks in ticket order up to the first
gate/up tile of minibatch m + 1; then the remaining tasks. Same source and the same waits (they
find their counters already complete).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...ep.workspace import Workspace
from ...types import RoutedActivations, SharedActivations
from .. import comm
from ..gemm import gate_up_2d, tiles_for, weight_2d
from ..runtime import descriptor, empty, interpreting, side_stream
from ..schedule import RowSchedule
from .plan import (
    COMM_KERNEL_REGISTERS,
    COMM_KERNEL_WARPS,
    COMM_PULL,
    COMM_PUSH,
    FUSED_STAGES,
    FUSED_WARPS,
    FusedPlan,
    plan_launch,
)
from .residency import check_side_by_side, prefer_shared
from .roles import comm_role, compute_role, push_minibatches
from .sync import arrive_all, flag_layout, flag_pointers
from .tasks import gate_up_start, task_counts

__all__ = ["FusedOutputs", "fused_forward", "fused_forward_kernel", "fused_comm_kernel"]


@triton.jit
def fused_forward_kernel(
    # routed GEMMs: xs, w_gate, w_up, g, u, h, h_in, w_down, z
    xs_desc,
    wg_desc,
    wu_desc,
    g_desc,
    u_desc,
    h_desc,
    h_in_desc,
    wd_desc,
    z_desc,
    # the same with BM / 2-row boxes: xs, g, u, h, h_in, z
    xs_half,
    g_half,
    u_half,
    h_half,
    h_in_half,
    z_half,
    # shared expert: x, s_gate, s_up, g, u, h, h_in, s_down, out
    x_desc,
    sgw_desc,
    suw_desc,
    sg_desc,
    su_desc,
    sh_desc,
    sh_in_desc,
    sdw_desc,
    so_desc,
    rows,  # (x_table, combine_table, xs_ptr, z_ptr, row_src_ptr, block_expert_ptr, num_blocks_ptr)
    dims,  # (T, H, I, IS, ring, slots, max_mb, max_blocks, gate_up_rows, down_rows)
    sync,  # (flags_ptr, err_ptr, rank, budget, expected_arrivals)
    trace,  # (trace_ptr, max_events)
    C: tl.constexpr,
):
    # (descriptors as separate arguments: Triton 3.6's launcher passes none inside a tuple)
    routed = (xs_desc, wg_desc, wu_desc, g_desc, u_desc, h_desc, h_in_desc, wd_desc, z_desc)
    half = (xs_half, g_half, u_half, h_half, h_in_half, z_half)
    shared = (x_desc, sgw_desc, suw_desc, sg_desc, su_desc, sh_desc, sh_in_desc, sdw_desc, so_desc)
    descs = (routed, half, shared)
    flags_ptr, err_ptr, rank, budget, expected_arrivals = sync
    watch = (err_ptr, rank, budget)
    T, H, I, IS, ring, slots, max_mb, max_blocks = dims[:8]
    if C.COMM_KERNEL:  # (unconditional: a runtime test around it made ptxas spill)
        arrive_all(flags_ptr, expected_arrivals, watch)
    ticket_ptr, ready_ptr, z_done_ptr, h_done_ptr, sh_done_ptr = flag_pointers(
        flags_ptr, max_mb, max_blocks
    )
    env = (rows, dims, (ready_ptr, z_done_ptr, h_done_ptr, sh_done_ptr), watch, trace)
    counts = task_counts(rows[6], T, H, I, IS, C.MB, C.BM, C.BN_GATE_UP, C.BN_DOWN, C.SHARED)
    first_event = 0
    if C.INTERPRET and not C.COMM_KERNEL:  # one program plays every role, in rounds
        used_rows = counts[0] * C.BM
        n_mb = tl.cdiv(used_rows, C.MB)
        G = C.MB // C.BM  # row blocks per task-list group: one minibatch
        m = 0
        while m < n_mb:
            # every task before the first gate/up tile of minibatch m ran: the down tiles of
            # m - slots are done (plan.routed_lag), so the slot is free
            for role in range(C.NUM_COMM):
                comm_role(m, m + 1, role, used_rows, ring, slots, env, C, C.TRACE)
            # every task before the first gate/up tile of minibatch m + 1 has its inputs now
            limit = counts[2] + gate_up_start(
                m + 1, n_mb, tl.cdiv(I, C.BN_GATE_UP) * G, tl.cdiv(H, C.BN_DOWN) * G, C.LAG
            )
            compute_role(limit, counts, ticket_ptr, 0, descs, env, C)
            m += 1
    else:
        # Comm programs pull, then take compute tasks like the others (the ticket hands out
        # what is left). They re-derive the compute role's values after their pulls: values
        # kept live across the pull loop made ptxas spill. A pull that gave up left the stall
        # record, which makes the compute waits give up at once.
        if not C.COMM_KERNEL:  # (with the comm kernel, it pulls)
            if tl.program_id(0) < C.NUM_COMM:
                used_rows = counts[0] * C.BM
                n_mb = tl.cdiv(used_rows, C.MB)
                comm_role(0, n_mb, tl.program_id(0), used_rows, ring, slots, env, C, C.TRACE)
                first_event = n_mb  # trace slots 0..n_mb-1 hold the pulls
                ticket_ptr, ready_ptr, z_done_ptr, h_done_ptr, sh_done_ptr = flag_pointers(
                    flags_ptr, max_mb, max_blocks
                )
                env = (rows, dims, (ready_ptr, z_done_ptr, h_done_ptr, sh_done_ptr), watch, trace)
                counts = task_counts(
                    rows[6], T, H, I, IS, C.MB, C.BM, C.BN_GATE_UP, C.BN_DOWN, C.SHARED
                )
    # every program (the interpreter: the one, after its rounds) takes the tasks that are left
    compute_role(counts[3], counts, ticket_ptr, first_event, descs, env, C)


@triton.jit
def fused_comm_kernel(rows, dims, sync, C: tl.constexpr):
    """``config.comm_kernel``: the forward's communication in a small kernel whose programs sit
    on SMs beside the compute kernel's (at most one per SM), so that the copies overlap the MMAs
    instead of taking SMs of their own: pull every minibatch (the comm role's strided copy
    tasks), then push each minibatch's z rows once all of its down tiles are stored. The ring
    holds every row (no slot reuse). ``C.PHASE``: pulls, pushes or both (the interpreter runs
    the pulls, the compute kernel, then the pushes)."""
    flags_ptr, err_ptr, rank, budget, expected_arrivals = sync
    watch = (err_ptr, rank, budget)
    max_mb, max_blocks = dims[6], dims[7]
    ticket_ptr, ready_ptr, z_done_ptr, h_done_ptr, sh_done_ptr = flag_pointers(
        flags_ptr, max_mb, max_blocks
    )
    # (no trace: the comm kernel's events are not recorded)
    env = (rows, dims, (ready_ptr, z_done_ptr, h_done_ptr, sh_done_ptr), watch, (flags_ptr, 0))
    num_blocks = tl.load(rows[6])
    used_rows = num_blocks * C.BM
    n_mb = tl.cdiv(used_rows, C.MB)
    role = tl.program_id(0)
    alive = True
    if expected_arrivals > 0:  # a stall here makes every later wait give up at once
        alive = arrive_all(flags_ptr, expected_arrivals, watch)
    if C.PHASE & 1:  # COMM_PULL; a ring of every row: no slot waits
        alive = comm_role(0, n_mb, role, used_rows, n_mb * C.MB + C.MB, n_mb + 1, env, C, False)
    if C.PHASE & 2:  # COMM_PUSH
        if alive:
            push_minibatches(role, num_blocks, env, C)


@dataclass(frozen=True)
class FusedOutputs:
    """What one launch leaves behind.

    ``routed``: the routed rows (xs, g, u, h, z) in the schedule's row layout when ``full``
    (the ring holds every row), else the ring (``ring_rows`` rows; row r of the layout was at
    r % ring, the last occupant kept): not the whole context. ``shared`` (g, u, h) [T, Is] and
    ``shared_out`` [T, H] (bf16) when a shared expert ran, else None.
    """

    routed: RoutedActivations
    full: bool
    ring_rows: int
    shared: SharedActivations | None = None
    shared_out: torch.Tensor | None = None


def _flags(
    plan: FusedPlan, max_blocks: int, device: torch.device, flags: torch.Tensor | None
) -> torch.Tensor:
    layout = flag_layout(plan.max_minibatches, max_blocks, plan.shared_blocks)
    if flags is None:
        return torch.zeros(layout.words, dtype=torch.int32, device=device)
    if flags.numel() < layout.words or flags.dtype != torch.int32:
        raise ValueError(
            f"flags must be int32 with >= {layout.words} words, got {flags.dtype} "
            f"with {flags.numel()}"
        )
    return flags


def _check_trace(trace: torch.Tensor | None, plan: FusedPlan) -> None:
    if trace is None:
        return
    if interpreting():
        raise ValueError("trace needs a GPU (the interpreter runs the sequential driver)")
    if (
        trace.dtype != torch.int64
        or trace.dim() != 3
        or trace.shape[0] != plan.grid
        or trace.shape[2] != 3
    ):
        raise ValueError(
            f"trace must be int64 [{plan.grid}, events, 3] (new_trace), got "
            f"{trace.dtype} {list(trace.shape)}"
        )


def _descriptors(
    plan: FusedPlan,
    ws: Workspace,
    routed: RoutedActivations,
    weights,
    shared_inputs,
    shared: SharedActivations | None,
    shared_out: torch.Tensor | None,
) -> tuple:
    """The 24 descriptors of the compute kernel, in its argument order (``weights``: the 2-D
    views of ``gemm.weight_2d``)."""
    bm = plan.meta.BM
    gu, dn = tiles_for("gate_up"), tiles_for("mm")
    w_gate, w_up, w_down = weights
    xs, g, u, h, z = routed
    routed_descs = (
        descriptor(xs, [bm, gu.bk]),
        descriptor(w_gate, [gu.bn, gu.bk]),
        descriptor(w_up, [gu.bn, gu.bk]),
        *(descriptor(o, [bm, gu.bn]) for o in (g, u, h)),
        descriptor(h, [bm, dn.bk]),
        descriptor(w_down, [dn.bn, dn.bk]),
        descriptor(z, [bm, dn.bn]),
    )
    hm = bm // 2 if plan.meta.HALF else bm
    half_descs = (
        descriptor(xs, [hm, gu.bk]),
        *(descriptor(o, [hm, gu.bn]) for o in (g, u, h)),
        descriptor(h, [hm, dn.bk]),
        descriptor(z, [hm, dn.bn]),
    )
    if shared is None:  # never read (C.SHARED False removes the shared branch)
        return (*routed_descs, *half_descs, *routed_descs)
    x, s_gate, s_up, s_down = shared_inputs
    shared_descs = (
        descriptor(x, [bm, gu.bk]),
        descriptor(s_gate, [gu.bn, gu.bk]),
        descriptor(s_up, [gu.bn, gu.bk]),
        *(descriptor(o, [bm, gu.bn]) for o in shared),
        descriptor(shared.h, [bm, dn.bk]),
        descriptor(s_down, [dn.bn, dn.bk]),
        descriptor(shared_out, [bm, dn.bn]),
    )
    return (*routed_descs, *half_descs, *shared_descs)


def fused_forward(
    ws: Workspace,
    sched: RowSchedule,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    num_comm: int | None,
    minibatch_rows: int,
    ring_rows: int | None = None,
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    budget: int | None = None,
    flags: torch.Tensor | None = None,
    down_lag: int | None = None,
    trace: torch.Tensor | None = None,
    comm_kernel: bool = False,
) -> FusedOutputs:
    """Shared expert, pull, routed expert GEMMs and push of this rank in one launch (no host
    sync).

    Call after the barrier that follows every rank's publish of x; the source ranks may read
    their combine slots after the next barrier.

    Arguments:
        ws, sched: the workspace and the schedule built from every rank's ids.
        w_gate, w_up ``[E_local, I, H]``, w_down ``[E_local, H, I]``: bf16 expert weights
            (gate and up may be the halves of one stacked weight: ``gemm.weight_2d``).
        num_comm: pull programs of the one-kernel forward, or the comm kernel's programs (None:
            ``plan.comm_programs_for`` / ``plan.comm_kernel_programs``).
        minibatch_rows: rows per readiness counter and per task-list group.
        ring_rows: rows of the routed buffers (a multiple of ``minibatch_rows``; None: every
            row). Smaller than the schedule's rows, the outputs hold only the ring
            (``FusedOutputs.full`` is False).
        shared: ``(x [T, H], s_gate [Is, H], s_up [Is, H], s_down [H, Is])``: the shared expert
            runs as the first tasks.
        budget: polls of every wait (None: ``comm.spin_budget()``).
        flags: a zeroed int32 flag buffer (``sync.flag_layout``); a test hook: a pre-set
            counter reproduces a missing signal.
        down_lag: groups between a group's gate/up and down tiles (None: ``plan.down_lag_for``).
        trace: int64 ``[programs, events, 3]`` (``trace.new_trace``; GPU only) that receives
            one (kind << 32 | index, start ns, end ns) per pulled minibatch or task.
        comm_kernel: pull and push in ``fused_comm_kernel`` beside this kernel (on a side
            stream, joined before returning); needs a ring of every row.

    Returns:
        :class:`FusedOutputs`.
    """
    comm.check_schedule(ws, sched)
    intermediate = w_gate.shape[1]
    shared_intermediate = 0 if shared is None else shared[1].shape[0]
    plan = plan_launch(
        ws.device,
        rows=sched.rows,
        block_rows=sched.block_rows,
        tokens=ws.num_tokens,
        hidden=ws.hidden,
        intermediate=intermediate,
        shared_intermediate=shared_intermediate,
        top_k=ws.top_k,
        itemsize=ws.dtype.itemsize,
        world_size=ws.world_size,
        num_comm=num_comm,
        minibatch_rows=minibatch_rows,
        ring_rows=ring_rows,
        down_lag=down_lag,
        comm_kernel=comm_kernel,
        traced=trace is not None,
    )
    _check_trace(trace, plan)
    dev, dtype, t, h = ws.device, ws.dtype, ws.num_tokens, ws.hidden
    n = plan.buffer_rows
    routed = RoutedActivations(
        empty((n, h), dtype, dev),
        *(empty((n, intermediate), dtype, dev) for _ in range(3)),
        empty((n, h), dtype, dev),
    )
    shared_acts = shared_out = None
    if shared is not None:
        x = shared[0]
        if x.shape != (t, h) or x.dtype != dtype or not x.is_contiguous():
            raise ValueError(
                f"shared x must be a contiguous [{t}, {h}] {dtype} tensor, got "
                f"{list(x.shape)} {x.dtype}"
            )
        shared_acts = SharedActivations(
            *(empty((t, shared_intermediate), dtype, dev) for _ in range(3))
        )
        shared_out = empty((t, h), dtype, dev)
    (wg, gate_up_rows), (wu, _) = gate_up_2d(w_gate, w_up)
    wd, down_rows = weight_2d(w_down)
    descs = _descriptors(plan, ws, routed, (wg, wu, wd), shared, shared_acts, shared_out)
    flags = _flags(plan, sched.max_blocks, dev, flags)
    rows = (
        ws.peers.x,
        ws.peers.combine,
        routed.xs,
        routed.z,
        sched.row_src,
        sched.block_expert,
        sched.num_blocks,
    )
    dims = (
        t,
        h,
        intermediate,
        shared_intermediate,
        plan.ring_rows,
        plan.slots,
        plan.max_minibatches,
        sched.max_blocks,
        gate_up_rows,
        down_rows,
    )
    budget = comm.spin_budget(budget)
    sync = (flags, ws.errors, ws.rank, budget, plan.expected_arrivals)
    traced = (flags, 0) if trace is None else (trace, trace.shape[1])
    compute_args = (*descs, rows, dims, sync, traced)
    compute_options = dict(
        C=plan.meta.as_constexprs(),
        num_warps=FUSED_WARPS,
        num_stages=FUSED_STAGES,
        # not cooperative with the comm kernel: its programs run beside
        # these (the start-up count reports programs that are not resident)
        launch_cooperative_grid=plan.meta.GPU and not comm_kernel,
    )
    if not comm_kernel:
        fused_forward_kernel[(plan.grid,)](*compute_args, **compute_options)
    else:
        _launch_with_comm_kernel(plan, compute_args, compute_options, (rows, dims, sync), dev)
    return FusedOutputs(routed, plan.full, plan.ring_rows, shared_acts, shared_out)


def _launch_with_comm_kernel(
    plan: FusedPlan,
    compute_args: tuple,
    compute_options: dict,
    comm_args: tuple,
    device: torch.device,
) -> None:
    """The compute kernel and, beside it on a side stream, the comm kernel (joined before
    returning); under the interpreter: the pulls, the compute kernel, the pushes."""
    comm_options = dict(num_warps=COMM_KERNEL_WARPS, maxnreg=COMM_KERNEL_REGISTERS)
    grid, comm_grid = (plan.grid,), (plan.num_comm,)
    if interpreting():
        rows, dims, (flags, err, rank, budget, _) = comm_args
        phase_args = (rows, dims, (flags, err, rank, budget, 0))
        fused_comm_kernel[comm_grid](
            *phase_args, C=plan.comm_meta._replace(PHASE=COMM_PULL).as_constexprs(), **comm_options
        )
        fused_forward_kernel[grid](*compute_args, **compute_options)
        fused_comm_kernel[comm_grid](
            *phase_args, C=plan.comm_meta._replace(PHASE=COMM_PUSH).as_constexprs(), **comm_options
        )
        return
    on_gpu = device.type == "cuda"  # (else a launch recorded for the compile check)
    comm_c = plan.comm_meta.as_constexprs()
    if not on_gpu:
        fused_forward_kernel[grid](*compute_args, **compute_options)
        fused_comm_kernel[comm_grid](*comm_args, C=comm_c, **comm_options)
        return
    # Both kernels compiled, loaded and given the largest carveout before either starts:
    # loading a module waits for running kernels (the first forward stalled at the start-up
    # count while the comm kernel loaded), and an SM set up for a small carveout takes no
    # program of the other kernel (probe on an H200: the two ran side by side only so). The
    # warm-up binds the arguments and finds the compiled kernels; they are then launched as
    # they are, not bound a second time through ``kernel[grid]``.
    compute = prefer_shared(
        fused_forward_kernel.warmup(*compute_args, grid=grid, **compute_options)
    )
    comm_k = prefer_shared(
        fused_comm_kernel.warmup(*comm_args, grid=comm_grid, C=comm_c, **comm_options)
    )
    check_side_by_side(compute, comm_k)
    # the side stream waits for this stream's work so far (the inputs), not for the
    # compute kernel launched next
    main, side = torch.cuda.current_stream(device), side_stream(device)
    side.wait_stream(main)
    compute[(plan.grid, 1, 1)](*compute_args, compute_options["C"])
    with torch.cuda.stream(side):
        comm_k[(plan.num_comm, 1, 1)](*comm_args, comm_c)
    main.wait_stream(side)
