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

In fp8 (``fused_forward(fp8_weights=...)``) the pulled rows are packed fp8 rows, the tiles
``fp8_gemm``'s, and one more task per row block quantizes its h for the down tiles and the
backward (docs/fused.md, "fp8"); the outputs are the unfused fp8 forward's bits.

Under the interpreter (``INTERPRET``, programs run one after another) one program runs, per
minibatch m, every comm role's pull of m, then the compute tasks in ticket order up to the first
gate/up tile of minibatch m + 1; then the remaining tasks. Same source and the same waits (they
find their counters already complete).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...ep.workspace import Workspace
from ...types import RoutedActivations, SharedActivations
from .. import comm, fp8
from ..fp8_ws import RowArrivals, StoredTiles
from ..gemm import gate_up_2d, weight_2d
from ..runtime import descriptor, empty, interpreting, launch, side_stream
from ..schedule import RowSchedule
from .plan import (
    COMM_KERNEL_REGISTERS,
    COMM_KERNEL_WARPS,
    COMM_PULL,
    COMM_PUSH,
    FusedPlan,
    plan_launch,
    plan_pulls,
)
from .residency import check_side_by_side, prefer_shared
from .roles import comm_role, compute_role, push_minibatches
from .sync import arrive_all, flag_layout, flag_pointers
from .tasks import gate_up_start, gate_up_tasks, task_counts

__all__ = [
    "FusedOutputs",
    "fused_forward",
    "fused_forward_kernel",
    "fused_comm_kernel",
    "Pulls",
    "start_pulls",
]


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
    # fp8's h tasks (128x128 boxes): h, its 1x128 q, its 128x1 q^T; routed and shared
    h_tile,
    hq_tile,
    hqt_tile,
    sh_tile,
    shq_tile,
    shqt_tile,
    fp8,  # (routed, shared) scales and sizes of fp8 (roles' "fp8 bundle")
    rows,  # (x_table, combine_table, xs_ptr, z_ptr, row_src_ptr, block_expert_ptr, num_blocks_ptr)
    dims,  # (T, H, I, IS, ring, slots, max_mb, max_blocks, gate_up_rows, down_rows, row_words)
    sync,  # (flags_ptr, err_ptr, rank, budget, expected_arrivals)
    trace,  # (trace_ptr, max_events)
    C: tl.constexpr,
):
    # (descriptors as separate arguments: Triton 3.6's launcher passes none inside a tuple)
    routed = (xs_desc, wg_desc, wu_desc, g_desc, u_desc, h_desc, h_in_desc, wd_desc, z_desc)
    half = (xs_half, g_half, u_half, h_half, h_in_half, z_half)
    shared = (x_desc, sgw_desc, suw_desc, sg_desc, su_desc, sh_desc, sh_in_desc, sdw_desc, so_desc)
    quant = ((h_tile, hq_tile, hqt_tile), (sh_tile, shq_tile, shqt_tile))
    descs = (routed, half, shared, fp8, quant)
    flags_ptr, err_ptr, rank, budget, expected_arrivals = sync
    watch = (err_ptr, rank, budget)
    T, H, I, IS, ring, slots, max_mb, max_blocks = dims[:8]
    if C.COMM_KERNEL:  # (unconditional: a runtime test around it made ptxas spill)
        arrive_all(flags_ptr, expected_arrivals, watch)
    ticket_ptr, ready_ptr, z_done_ptr, h_done_ptr, sh_done_ptr = flag_pointers(
        flags_ptr, max_mb, max_blocks
    )
    env = (rows, dims, (ready_ptr, z_done_ptr, h_done_ptr, sh_done_ptr), watch, trace)
    counts = task_counts(rows[6], T, H, I, IS, C)
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
                m + 1, n_mb, gate_up_tasks(I, C) * G, tl.cdiv(H, C.BN_DOWN) * G, C.LAG
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
                counts = task_counts(rows[6], T, H, I, IS, C)
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
    routed: tuple[torch.Tensor, ...],
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    shared: tuple[torch.Tensor, ...] | None,
) -> tuple:
    """The 24 descriptors of the compute kernel, in its argument order. ``routed`` / ``shared``:
    each expert set's (A rows, g, u, h, h_in, out), h_in the down tiles' A (h, or in fp8 its
    1x128 quantization; A the packed rows' fp8 bytes); ``weights``: the 2-D views of
    ``gemm.weight_2d`` (gate, up, down), ``shared``'s followed by its own three."""
    m = plan.meta
    bm = m.BM // m.SPLIT_M  # (fp8's tiles: two halves of BM / 2 rows)

    def expert_set(rows, w):
        a, g, u, h, h_in, out = rows
        return (
            descriptor(a, [bm, m.BK_GATE_UP]),
            *(descriptor(wt, [m.BN_GATE_UP, m.BK_GATE_UP]) for wt in w[:2]),
            *(descriptor(o, [bm, m.BN_GATE_UP]) for o in (g, u, h)),
            descriptor(h_in, [bm, m.BK_DOWN]),
            descriptor(w[2], [m.BN_DOWN, m.BK_DOWN]),
            descriptor(out, [bm, m.BN_DOWN]),
        )

    routed_descs = expert_set(routed, weights)
    if m.HALF:
        hm = bm // 2
        a, g, u, h, h_in, z = routed
        half_descs = (
            descriptor(a, [hm, m.BK_GATE_UP]),
            *(descriptor(o, [hm, m.BN_GATE_UP]) for o in (g, u, h)),
            descriptor(h_in, [hm, m.BK_DOWN]),
            descriptor(z, [hm, m.BN_DOWN]),
        )
    else:  # never read
        half_descs = tuple(routed_descs[i] for i in (0, 3, 4, 5, 6, 8))
    if shared is None:  # never read (C.SHARED False removes the shared branch)
        return (*routed_descs, *half_descs, *routed_descs)
    return (*routed_descs, *half_descs, *expert_set(shared[:6], shared[6:]))


def _fp8_operands(
    a: tuple[torch.Tensor, torch.Tensor], w: tuple[fp8.Fp8Weight, ...], h: torch.Tensor
) -> tuple[tuple, tuple, torch.Tensor, torch.Tensor]:
    """In fp8, one expert set's bundle of what its tiles read besides the descriptors
    (``roles``' "fp8 bundle"), its h task's three 128x128 descriptors, h's 1x128 quantization
    (the down tiles' A) and the packed rows of h^T that its 128x1 quantization goes into
    (``fp8.rows_cols_buffers``: the layouts of the unfused forward's
    ``fp8_gemm.gate_up_quantized``, whose bits the h tasks write). ``a``: the A rows' (q, scale);
    ``w``: (gate, up, down)."""
    a_q, a_s = a
    gate, up, down = w
    if up.scale.stride() != gate.scale.stride():
        raise ValueError(
            f"the gate and up weights' scales must share their strides, got "
            f"{gate.scale.stride()} and {up.scale.stride()}"
        )
    m, inter = h.shape
    cols = empty((inter, fp8.packed_width(m + -m % 16)), torch.int16, h.device)
    (hq, hs), (hq_t, hs_t), m_out = fp8.rows_cols_buffers(m, inter, h.device, 16, cols)
    bundle = (
        (a_s, a_q.shape[0], *a_s.stride()),
        (gate.scale, up.scale, *gate.scale.stride()),
        (down.scale, *down.scale.stride()),
        (m, m_out, (hs, *hs.stride()), (hs_t, *hs_t.stride())),
    )
    tiles = tuple(descriptor(t, [fp8.BLOCK, fp8.BLOCK]) for t in (h, hq, hq_t))
    return bundle, tiles, hq, cols


def _placeholder(flags: torch.Tensor) -> tuple:
    """A bf16 launch's fp8 bundles (the kernel's signature; never read)."""
    quant = (0, 0, (flags, 0, 0), (flags, 0, 0))
    one = ((flags, 0, 0, 0), (flags, flags, 0, 0, 0), (flags, 0, 0, 0), quant)
    return one, one


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
    fp8_weights: Sequence[fp8.Fp8Weight | None] | None = None,
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
        fp8_weights: DeepSeek-V3's fp8 recipe (docs/fp8.md): the step's quantized (gate, up,
            down[, s_gate, s_up, s_down]) (``Fp8Weight``; the bf16 weights then give only the
            shapes). The workspace's x buffers hold packed fp8 rows
            (``workspace.publish_packed``), ``shared``'s x is this rank's packed rows ``[T,
            fp8.packed_width(H)]``, every GEMM runs ``fp8_gemm``'s tiles and one task per row
            block quantizes h (1x128 for down, 128x1 for the backward); the ring must hold
            every row. The outputs are the unfused fp8 forward's, bit for bit.

    Returns:
        :class:`FusedOutputs`.
    """
    comm.check_schedule(ws, sched)
    is_fp8 = fp8_weights is not None
    intermediate = w_gate.shape[1]
    shared_intermediate = 0 if shared is None else shared[1].shape[0]
    dev, dtype, t, h = ws.device, ws.dtype, ws.num_tokens, ws.hidden
    row_words = fp8.packed_width(h) if is_fp8 else h
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
        fp8=is_fp8,
        row_words=row_words,
    )
    _check_trace(trace, plan)
    n = plan.buffer_rows
    xs = empty((n, row_words), torch.int16 if is_fp8 else dtype, dev)
    g, u, h_rows = (empty((n, intermediate), dtype, dev) for _ in range(3))
    z = empty((n, h), dtype, dev)
    shared_acts = shared_out = None
    if shared is not None:
        x = shared[0]
        x_dtype = torch.int16 if is_fp8 else dtype
        if x.shape != (t, row_words) or x.dtype != x_dtype or not x.is_contiguous():
            raise ValueError(
                f"shared x must be a contiguous [{t}, {row_words}] {x_dtype} tensor"
                f"{' (packed fp8 rows)' if is_fp8 else ''}, got {list(x.shape)} {x.dtype}"
            )
        sg, su, sh = (empty((t, shared_intermediate), dtype, dev) for _ in range(3))
        shared_out = empty((t, h), dtype, dev)
    flags = _flags(plan, sched.max_blocks, dev, flags)
    if is_fp8:
        f8 = _check_fp8_weights(fp8_weights, shared is not None)
        a = fp8.unpack_rows(xs, h)
        routed_q8, tiles, h_in, h_saved = _fp8_operands(a, f8[:3], h_rows)
        quant_descs = (*tiles, *tiles)
        (wg, gate_up_rows), (wu, _) = gate_up_2d(f8[0].q, f8[1].q)
        wd, down_rows = weight_2d(f8[2].q)
        routed_ops = (a[0], g, u, h_rows, h_in, z)
        q8 = (routed_q8, routed_q8)
        shared_ops = None
        if shared is not None:
            sa = fp8.unpack_rows(shared[0], h)
            shared_q8, shared_tiles, sh_in, sh_saved = _fp8_operands(sa, f8[3:], sh)
            q8 = (routed_q8, shared_q8)
            quant_descs = (*tiles, *shared_tiles)
            s_w = (weight_2d(w.q)[0] for w in f8[3:])
            shared_ops = (sa[0], sg, su, sh, sh_in, shared_out, *s_w)
    else:
        (wg, gate_up_rows), (wu, _) = gate_up_2d(w_gate, w_up)
        wd, down_rows = weight_2d(w_down)
        routed_ops = (xs, g, u, h_rows, h_rows, z)
        h_saved = h_rows
        q8 = _placeholder(flags)
        shared_ops = None
        if shared is not None:
            shared_ops = (shared[0], sg, su, sh, sh, shared_out, *shared[1:])
            sh_saved = sh
    routed = RoutedActivations(xs, g, u, h_saved, z)
    if shared is not None:
        shared_acts = SharedActivations(sg, su, sh_saved)
    descs = _descriptors(plan, routed_ops, (wg, wu, wd), shared_ops)
    if not is_fp8:  # never read
        quant_descs = descs[:6]
    rows = (
        ws.peers.x,
        ws.peers.combine,
        xs,
        z,
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
        row_words,
    )
    budget = comm.spin_budget(budget)
    sync = (flags, ws.errors, ws.rank, budget, plan.expected_arrivals)
    traced = (flags, 0) if trace is None else (trace, trace.shape[1])
    compute_args = (*descs, *quant_descs, q8, rows, dims, sync, traced)
    compute_options = dict(
        C=plan.meta.as_constexprs(),
        num_warps=plan.warps,
        num_stages=plan.stages,
        **({} if plan.registers is None else {"maxnreg": plan.registers}),
        # not cooperative with the comm kernel: its programs run beside
        # these (the start-up count reports programs that are not resident)
        launch_cooperative_grid=plan.meta.GPU and not comm_kernel,
    )
    if not comm_kernel:
        launch(fused_forward_kernel, (plan.grid,), *compute_args, **compute_options)
    else:
        _launch_with_comm_kernel(plan, compute_args, compute_options, (rows, dims, sync), dev)
    return FusedOutputs(routed, plan.full, plan.ring_rows, shared_acts, shared_out)


@dataclass(frozen=True)
class Pulls:
    """The routed rows on their way in (:func:`start_pulls`): ``rows`` [schedule rows, packed
    width] int16, row block by row block as ``arrivals`` counts them (``fp8_ws.RowArrivals``,
    what the warp-specialized gate/up kernel waits on); ``programs``: the SMs the GEMMs may
    take meanwhile. ``stored``: the counters of the down GEMM's stored tiles that
    :meth:`push` waits for (``fp8_ws.StoredTiles``), on ``push_programs`` SMs beside the down
    GEMM's ``down_programs``. :meth:`join` before the rows are read any other way."""

    rows: torch.Tensor
    arrivals: RowArrivals
    programs: int
    stream: torch.cuda.Stream | None
    stored: StoredTiles
    push_programs: int
    down_programs: int
    comm_args: tuple  # the comm kernel's (rows, dims, sync, meta, warps)

    def push(self, z: torch.Tensor, signals: int) -> None:
        """Push the rows of z [schedule rows, H] bf16 into the source ranks' combine slots
        (where ``comm.combine_push`` puts them), minibatch by minibatch as :attr:`stored`
        counts the down tiles that write them (``signals`` a row block:
        ``fp8_gemm.stored_signals``), on :attr:`push_programs` SMs of their own, after the
        pulls. Call it once the down GEMM is launched (it does not wait for that launch: the
        counters order it); :meth:`join` waits for it too."""
        rows, dims, sync, meta, warps = self.comm_args
        programs = self.push_programs
        h = dims[1]
        if z.dtype != torch.bfloat16 or tuple(z.shape) != (self.rows.shape[0], h):
            raise ValueError(
                f"z must be bf16 [{self.rows.shape[0]}, {h}], got {z.dtype} {list(z.shape)}"
            )
        if not z.is_contiguous():
            raise ValueError(f"z must be contiguous, got strides {z.stride()}")
        if isinstance(signals, bool) or not isinstance(signals, int) or signals < 1:
            raise ValueError(
                f"signals must be an int >= 1 (fp8_gemm.stored_signals), got {signals!r}"
            )
        copy_rows, copy_cols = comm.copy_tile(h, 2, comm.COPY_TILE_BYTES)
        meta = meta._replace(
            NUM_COMM=programs, ROWS=copy_rows, COLS=copy_cols, PHASE=COMM_PUSH, Z_SIGNALS=signals
        )
        rows = rows[:3] + (z,) + rows[4:]
        options = dict(C=meta.as_constexprs(), num_warps=warps)
        # (after the pulls; down's counters order it. z outlives the push: the forward keeps
        # it, and the current stream joins this one before anything else reads z)
        with torch.cuda.stream(self.stream):
            launch(fused_comm_kernel, (programs,), rows, dims, sync, **options)

    def join(self) -> None:
        """The current stream waits for the pulls (and the push)."""
        if self.stream is not None:
            torch.cuda.current_stream(self.rows.device).wait_stream(self.stream)


def start_pulls(
    ws: Workspace,
    sched: RowSchedule,
    intermediate: int,
    num_comm: int | None,
    minibatch_rows: int,
    budget: int | None = None,
    push_programs: int | None = None,
) -> Pulls:
    """Start the comm kernel's pulls of the schedule's packed fp8 rows (the workspaces' x
    buffers: ``workspace.publish_packed``) on a side stream, minibatch by minibatch, each
    counted into its arrival counter once its rows are in (release). The pipelined fp8 forward
    (backend "fused") runs its GEMMs meanwhile on ``Pulls.programs`` SMs, the gate/up kernel
    waiting for each row block's counter; the comm programs (``num_comm``; None:
    ``plan.pull_programs_for``) sit on SMs of their own (``plan.plan_pulls``), and so do those
    that push z beside the down GEMM (``push_programs``; None: ``plan.push_programs_for``).
    Call after the barrier that follows every rank's publish; ``budget``: polls of each wait
    (None: ``comm.spin_budget()``)."""
    comm.check_schedule(ws, sched)
    dev, h = ws.device, ws.hidden
    row_words = fp8.packed_width(h)
    plan = plan_pulls(
        dev,
        rows=sched.rows,
        block_rows=sched.block_rows,
        tokens=ws.num_tokens,
        hidden=h,
        intermediate=intermediate,
        top_k=ws.top_k,
        world_size=ws.world_size,
        num_comm=num_comm,
        minibatch_rows=minibatch_rows,
        row_words=row_words,
        push_programs=push_programs,
    )
    xs = empty((sched.rows, row_words), torch.int16, dev)
    layout = flag_layout(plan.max_minibatches, sched.max_blocks, 0)
    flags = torch.zeros(layout.words, dtype=torch.int32, device=dev)
    budget = comm.spin_budget(budget)
    rows = (ws.peers.x, ws.peers.combine, xs, xs, sched.row_src, sched.block_expert)
    rows = rows + (sched.num_blocks,)
    # (T, H, and what the pulls read of the rest: ring rows, slots, minibatches, blocks, row
    # words; the GEMMs' widths are never read)
    dims = (ws.num_tokens, h, intermediate, 0, plan.max_minibatches * minibatch_rows)
    dims = dims + (plan.max_minibatches, plan.max_minibatches, sched.max_blocks, 0, 0, row_words)
    sync = (flags, ws.errors, ws.rank, budget, 0)  # (no start-up count: SMs of their own)
    arrivals = RowArrivals(
        flags[layout.ready :], minibatch_rows, plan.num_comm, ws.errors, ws.rank, budget
    )
    stored = StoredTiles(flags[layout.z_done : layout.h_done], minibatch_rows)
    comm_args = (rows, dims, sync, plan.meta, plan.warps)
    options = dict(C=plan.meta.as_constexprs(), num_warps=plan.warps)
    side = None
    if dev.type == "cuda":
        main, side = torch.cuda.current_stream(dev), side_stream(dev)
        side.wait_stream(main)  # (the published rows, the zeroed counters)
    with torch.cuda.stream(side):  # (None: a launch on the CPU, recorded for the compile check)
        launch(fused_comm_kernel, (plan.num_comm,), rows, dims, sync, **options)
    return Pulls(
        xs, arrivals, plan.programs, side, stored, plan.push_programs, plan.down_programs, comm_args
    )


def _check_fp8_weights(
    weights: Sequence[fp8.Fp8Weight | None], has_shared: bool
) -> tuple[fp8.Fp8Weight, ...]:
    """``fused_forward``'s ``fp8_weights``: three (six with a shared expert) ``Fp8Weight``
    with their forward copies (q, scale)."""
    wanted = 6 if has_shared else 3
    found = tuple(weights)[:wanted]
    if len(found) < wanted or any(w is None or w.q is None or w.scale is None for w in found):
        raise ValueError(
            f"fp8_weights must hold {wanted} Fp8Weight (gate, up, down"
            f"{', s_gate, s_up, s_down' if has_shared else ''}) with q and scale, got "
            f"{[None if w is None else type(w).__name__ for w in found]}"
        )
    return found


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
        launch(
            fused_comm_kernel,
            comm_grid,
            *phase_args,
            C=plan.comm_meta._replace(PHASE=COMM_PULL).as_constexprs(),
            **comm_options,
        )
        launch(fused_forward_kernel, grid, *compute_args, **compute_options)
        launch(
            fused_comm_kernel,
            comm_grid,
            *phase_args,
            C=plan.comm_meta._replace(PHASE=COMM_PUSH).as_constexprs(),
            **comm_options,
        )
        return
    on_gpu = device.type == "cuda"  # (else a launch recorded for the compile check)
    comm_c = plan.comm_meta.as_constexprs()
    if not on_gpu:
        launch(fused_forward_kernel, grid, *compute_args, **compute_options)
        launch(fused_comm_kernel, comm_grid, *comm_args, C=comm_c, **comm_options)
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
