"""The roles of the fused kernels' programs: comm programs pull, compute programs take tasks.

The fused backward at W > 1 uses the comm roles :func:`pull_dy_role` (dy rows, through the
forward's :func:`pull_rows`) and :func:`push_blocks` (d_x rows); its compute tasks live in
``backward``.

Device functions over bundled arguments (tuples built once at the top of each kernel):

  descs     (routed, half, shared, fp8, quant) tensor descriptors and the fp8 operands' scales:
              routed  (xs, w_gate, w_up, g, u, h, h_in, w_down, z) of the routed GEMMs
              half    (xs, g, u, h, h_in, z) with BM / 2-row boxes (half-padded blocks)
              shared  (x, s_gate, s_up, g, u, h, h_in, s_down, out) of the shared expert
              fp8     (routed, shared) fp8 bundles (below; in bf16 placeholders, never
                      read); in fp8 xs / x are the packed rows' fp8 bytes, the weights their
                      fp8 copies and h_in h's 1x128 quantization
              quant   (routed, shared) (h, h_q, h_q^T) descriptors of the fp8 h tasks
                      (128x128 boxes; in bf16 placeholders)
  env       (rows, dims, counters, watch, trace), what every role reads:
              rows      (x_table, combine_table, xs_ptr, z_ptr, row_src_ptr, block_expert_ptr,
                         num_blocks_ptr): peer tables, the local row buffers and the schedule
              dims      (T, H, I, IS, ring, slots, max_mb, max_blocks, gate_up_rows,
                         down_rows): the last two space the experts of the weights' 2-D views
              counters  (ready, z_done, h_done, sh_done) pointers (``sync.flag_pointers``)
              watch     (err_ptr, rank, budget): the watchdog of every wait (``sync.wait_count``)
              trace     (trace_ptr, max_events)
  C         the launch's constexprs (``plan.FusedMeta``)
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...errors import Stage
from .. import comm
from ..fp8 import col_blocks, row_blocks, source_f32
from ..fp8_gemm import fp8_gate_up_tile, fp8_grouped_mm_tile
from ..gemm import gate_up_tile, mm_acc
from ..tiles import cast, store_zeros
from .sync import acquire_for_tma, publish_writes, signal, wait_count
from .tasks import gate_up_tasks, grouped_task, half_padding, take_task, task_kind
from .trace import TRACE_PULL, trace_end, trace_start

__all__ = [
    "pull_minibatch",
    "pull_rows",
    "comm_role",
    "pull_dy_role",
    "push_blocks",
    "routed_gate_up",
    "routed_down",
    "routed_task",
    "shared_task",
    "fp8_gate_up",
    "fp8_down",
    "quantize_h",
    "compute_role",
    "push_minibatches",
]

_STAGE_ROWS = tl.constexpr(int(Stage.ROWS_READY))
_STAGE_H = tl.constexpr(int(Stage.H_READY))
_STAGE_RING = tl.constexpr(int(Stage.RING_FREE))
_STAGE_Z = tl.constexpr(int(Stage.Z_READY))
_STAGE_SHARED_H = tl.constexpr(int(Stage.SHARED_H_READY))


# --------------------------------------------------------------------------------------------
# Comm roles


@triton.jit
def pull_minibatch(m, role, used_rows, ring, slots, env, C: tl.constexpr):
    """Comm role ``role``: wait until ring slot ``m % slots`` is free (every down tile of its
    previous occupant, minibatch ``m - slots``, stored and pushed), pull its share of minibatch
    m into it, count into ``ready[m]``."""
    rows, dims, counters, watch, trace = env
    x_table, xs_ptr, row_src_ptr = rows[0], rows[2], rows[4]
    T, H, XW = dims[0], dims[1], dims[10]
    ready_ptr, z_done_ptr = counters[0], counters[1]
    alive = True
    if m >= slots:
        # m - slots is a full minibatch (only the last one can be partial)
        alive = wait_count(
            z_done_ptr + m - slots, (C.MB // C.BM) * tl.cdiv(H, C.BN_DOWN), _STAGE_RING, m, watch
        )
    if alive:
        dst = xs_ptr + ((m * C.MB) % ring).to(tl.int64) * XW
        pull_rows(m, role, used_rows, x_table, dst, row_src_ptr, ready_ptr + m, T, XW, C)
    return alive


@triton.jit
def pull_rows(
    m, role, used_rows, src_table, dst_ptr, row_src_ptr, ready_ptr, T, H, C: tl.constexpr
):
    """Comm role ``role``'s strided share of minibatch m's rows (``comm.copy_rows``, unscaled)
    from the source ranks' token buffers (``src_table``: x, or dy in the backward) into
    ``dst`` (its row 0 = the minibatch's first layout row), then one count into ``ready``.
    ``C``: a launch's constexprs with MB, NUM_COMM, TOP_K, ROWS, COLS, UPCAST (the forward's
    and the backward's)."""
    row_begin = m * C.MB
    comm.copy_rows(
        src_table,
        src_table,
        dst_ptr,
        H,
        row_src_ptr,
        row_begin,
        tl.minimum(row_begin + C.MB, used_rows),
        role,
        C.NUM_COMM,
        T,
        H,
        C.TOP_K,
        False,
        C.ROWS,
        C.COLS,
        C.UPCAST,
    )
    signal(ready_ptr)


@triton.jit
def comm_role(
    m_begin, m_end, role, used_rows, ring, slots, env, C: tl.constexpr, TRACE: tl.constexpr
):
    """Comm role ``role``: pull minibatches ``[m_begin, m_end)`` in order; False if a wait gave
    up. Traced: one event per minibatch (kind ``TRACE_PULL``, slot m)."""
    trace = env[4]
    m = m_begin
    alive = True
    while (m < m_end) & alive:
        trace_start(trace, m, TRACE)
        alive = pull_minibatch(m, role, used_rows, ring, slots, env, C)
        trace_end(trace, m, TRACE_PULL, m, TRACE)
        m += 1
    return alive


@triton.jit
def push_minibatches(role, num_blocks, env, C: tl.constexpr):
    """Comm-kernel role ``role``: push each minibatch's z rows into the source ranks' combine
    slots once all of its down tiles are stored (``z_done``: ``C.Z_SIGNALS`` a row block, or
    one a tile)."""
    rows, dims, counters, watch, trace = env
    combine_table, z_ptr, row_src_ptr = rows[1], rows[3], rows[4]
    T, H = dims[0], dims[1]
    z_done_ptr = counters[1]
    used_rows = num_blocks * C.BM
    if C.Z_SIGNALS > 0:
        tiles_down = C.Z_SIGNALS
    else:
        tiles_down = tl.cdiv(H, C.BN_DOWN)
    alive = True
    m = 0
    while (m < tl.cdiv(used_rows, C.MB)) & alive:
        blocks = tl.minimum(C.MB // C.BM, num_blocks - m * (C.MB // C.BM))
        alive = wait_count(z_done_ptr + m, blocks * tiles_down, _STAGE_Z, m, watch)
        if alive:
            row_begin = m * C.MB
            comm.push_rows(
                z_ptr + row_begin.to(tl.int64) * H,
                H,
                combine_table,
                row_src_ptr,
                row_begin,
                tl.minimum(row_begin + C.MB, used_rows),
                role,
                C.NUM_COMM,
                T,
                H,
                C.TOP_K,
                C.ROWS,
                C.COLS,
            )
        m += 1
    return alive


@triton.jit
def pull_dy_role(
    role, used_rows, dy_table, dy_rows_ptr, row_src_ptr, ready_ptr, T, H, C: tl.constexpr
):
    """Backward comm role ``role`` (W > 1): pull its share of every minibatch's dy rows into
    the routed row layout, minibatch by minibatch (all comm roles on the earliest one at a
    time), counting into ``ready[m]``. Never waits."""
    m = 0
    while m < tl.cdiv(used_rows, C.MB):
        dst = dy_rows_ptr + (m * C.MB).to(tl.int64) * H
        pull_rows(m, role, used_rows, dy_table, dst, row_src_ptr, ready_ptr + m, T, H, C)
        m += 1


@triton.jit
def push_blocks(
    role,
    num_blocks,
    src_ptr,
    dst_table,
    row_src_ptr,
    done_ptr,
    wanted,
    T,
    H,
    stage,
    watch,
    C: tl.constexpr,
):
    """Backward comm role ``role`` (W > 1): push each row block's rows of ``src`` (the d_x
    rows) into the source ranks' slots (``dst_table``: their ``dx_slots``; ``comm.push_rows``,
    strided over the comm roles) as soon as ``done[b]`` reaches ``wanted`` (every gate+up dgrad
    tile of block b stored), block by block in layout order. False if a wait gave up."""
    b = 0
    alive = True
    while (b < num_blocks) & alive:
        alive = wait_count(done_ptr + b, wanted, stage, b, watch)
        if alive:
            row = b * C.BM
            comm.push_rows(
                src_ptr + row.to(tl.int64) * H,
                H,
                dst_table,
                row_src_ptr,
                row,
                row + C.BM,
                role,
                C.NUM_COMM,
                T,
                H,
                C.TOP_K,
                C.ROWS,
                C.COLS,
            )
        b += 1
    return alive


# --------------------------------------------------------------------------------------------
# Compute roles


# In fp8 each expert set (routed, shared) has one bundle of what its tiles read besides the
# descriptors (built by ``forward._fp8_operands``):
#   (a_scales, gate_up, down, h_quant)
#     a_scales  (scale_ptr, M, stride_m, stride_k) of the x rows' 1x128 scales; M: their rows
#     gate_up   (gate scale_ptr, up scale_ptr, stride_e, stride_n, stride_k) of the weights'
#               128x128 scales (the two share their strides)
#     down      (scale_ptr, stride_e, stride_n, stride_k)
#     h_quant   (M, M_out, (scale_ptr, stride_m, stride_k), (scale_t_ptr, stride_k, stride_b))
#               of h's M rows: the 1x128 scales of h_in (the down tiles' A) and the 128x1
#               scales of h^T's packed rows (M_out columns: M padded to 16; what the
#               backward's weight gradient of down reads); q and q_t go through ``descs[4]``


@triton.jit
def fp8_gate_up(ops, q8, expert, row, col, N, K, w_rows, C: tl.constexpr):
    """The fp8 gate/up tile (row, col) of one expert set (``ops``: its descriptors in
    ``descs``' order, ``q8``: its fp8 bundle): ``fp8_gemm.fp8_gate_up_tile``, the unfused
    kernel's tile."""
    a_s, gu = q8[0], q8[1]
    fp8_gate_up_tile(
        ops[0], a_s[0], ops[1], gu[0], ops[2], gu[1], ops[3], ops[4], ops[5], expert, row, col,
        w_rows, a_s[1], N, K, a_s[2], a_s[3], gu[2], gu[3], gu[4], C.BM, C.BN_GATE_UP,
        C.BK_GATE_UP, C.SPLIT_M, C.STRICT, C.UPCAST,
    )  # fmt: skip


@triton.jit
def fp8_down(ops, q8, expert, row, col, N, K, w_rows, C: tl.constexpr):
    """The fp8 down tile (row, col) of one expert set: C = h_q W_down^T
    (``fp8_gemm.fp8_grouped_mm_tile``, the unfused kernel's tile) stored into ``ops``' out."""
    dn, M = q8[2], q8[3][0]
    s_ptr, s_m, s_k = q8[3][2]
    fp8_grouped_mm_tile(
        ops[6], s_ptr, ops[7], dn[0], ops[6], s_ptr, ops[7], dn[0], ops[8], ops[8], ops[3],
        ops[4], expert, row, col, w_rows, w_rows, M, N, K, s_m, s_k, dn[1], dn[2], dn[3], C.BM,
        C.BN_DOWN, C.BK_DOWN, False, False, C.SPLIT_M, C.STRICT, C.UPCAST,
    )  # fmt: skip


@triton.jit
def quantize_h(tiles, q8, row, inter, C: tl.constexpr):
    """The h task of the row block at ``row`` (fp8): its h rows quantized 1x128 for the down
    tiles and 128x1 for the backward, one 128x128 tile at a time: loaded by TMA (zeros past
    the rows and columns, as the unfused pass masks them), both quantizations from registers
    (``fp8.row_blocks``, ``fp8.col_blocks``: the unfused ``quantize_rows_cols`` pass's bits),
    q and q_t stored by TMA (clipped at the tensors' ends), the scales by plain stores.
    ``tiles``: the set's (h, h_q, h_q^T) descriptors with 128x128 boxes."""
    h_tile, hq_tile, hqt_tile = tiles
    M, M_out = q8[3][0], q8[3][1]
    s_ptr, s_m, s_k = q8[3][2]
    st_ptr, st_k, st_b = q8[3][3]
    for sub in tl.static_range(C.BM // 128):
        r0 = row + sub * 128
        if r0 < M_out:
            rows = r0 + tl.arange(0, 128)
            for kb in range(tl.cdiv(inter, 128)):
                c0 = kb * 128
                x = source_f32(h_tile.load([r0, c0]), C.UPCAST)
                q, scale = row_blocks(x, C.UPCAST)
                hq_tile.store([r0, c0], q)
                tl.store(s_ptr + rows.to(tl.int64) * s_m + kb * s_k, scale, mask=rows < M)
                q_t, scale_t = col_blocks(x, C.UPCAST)
                hqt_tile.store([c0, r0], q_t)
                cols = c0 + tl.arange(0, 128)
                tl.store(st_ptr + cols * st_k + (r0 // 128) * st_b, scale_t, mask=cols < inter)


@triton.jit
def routed_gate_up(b, j, expert, descs, env, C: tl.constexpr):
    """The gate/up tile (b, j): wait for the block's minibatch to be pulled, run
    ``gemm.gate_up_tile`` (half height when the block's second half is padding, zeros stored
    there), count into ``h_done[b]``."""
    routed, half = descs[0], descs[1]
    rows, dims, counters, watch, trace = env
    xs_desc, wg_desc, wu_desc, g_desc, u_desc, h_desc = (
        routed[0],
        routed[1],
        routed[2],
        routed[3],
        routed[4],
        routed[5],
    )
    row_src_ptr = rows[4]
    H, ring, w_rows = dims[1], dims[4], dims[8]
    ready_ptr, h_done_ptr = counters[0], counters[2]
    row = b * C.BM
    at = row % ring  # the block's rows in the ring
    mb = row // C.MB
    alive = wait_count(ready_ptr + mb, C.NUM_COMM, _STAGE_ROWS, mb, watch)
    if alive:
        acquire_for_tma(C.GPU)
        col = j * C.BN_GATE_UP
        if C.FP8:
            fp8_gate_up(routed, descs[3][0], expert, at, col, dims[2], H, w_rows, C)
        elif half_padding(row_src_ptr, row, C.HALF, C.BM):
            xs_h, g_h, u_h, h_h = half[0], half[1], half[2], half[3]
            gate_up_tile(
                xs_h,
                wg_desc,
                wu_desc,
                g_h,
                u_h,
                h_h,
                expert,
                at,
                col,
                w_rows,
                H,
                C.BM // 2,
                C.BN_GATE_UP,
                C.BK_GATE_UP,
                C.UPCAST,
            )
            store_zeros(g_h, at + C.BM // 2, col, C.BM // 2, C.BN_GATE_UP)
            store_zeros(u_h, at + C.BM // 2, col, C.BM // 2, C.BN_GATE_UP)
            store_zeros(h_h, at + C.BM // 2, col, C.BM // 2, C.BN_GATE_UP)
        else:
            gate_up_tile(
                xs_desc,
                wg_desc,
                wu_desc,
                g_desc,
                u_desc,
                h_desc,
                expert,
                at,
                col,
                w_rows,
                H,
                C.BM,
                C.BN_GATE_UP,
                C.BK_GATE_UP,
                C.UPCAST,
            )
        publish_writes(C.GPU)
        signal(h_done_ptr + b)
    return alive


@triton.jit
def routed_down(b, j, expert, descs, env, C: tl.constexpr):
    """The down tile (b, j): wait for the block's h tiles, store its z tile (TMA), and either
    count into ``z_done`` for the comm kernel's push (``COMM_KERNEL``) or push the tile's rows
    from L2 into the source ranks' combine slots itself (``comm.push_tile``), counting into
    ``z_done`` only when the ring wraps (``RING_WRAPS``: a later minibatch's pull waits for it;
    otherwise nobody reads the count, and a release there may wait for the pushed rows to land
    on the peer). With ``HALF`` and the comm kernel a half-padded block runs half height."""
    routed, half = descs[0], descs[1]
    rows, dims, counters, watch, trace = env
    h_in_desc, wd_desc, z_desc = routed[6], routed[7], routed[8]
    combine_table, z_ptr, row_src_ptr = rows[1], rows[3], rows[4]
    T, H, I, ring, w_rows = dims[0], dims[1], dims[2], dims[4], dims[9]
    z_done_ptr, h_done_ptr = counters[1], counters[2]
    row = b * C.BM
    at = row % ring
    mb = row // C.MB
    alive = wait_count(h_done_ptr + b, gate_up_tasks(I, C), _STAGE_H, b, watch)
    if alive:
        acquire_for_tma(C.GPU)
        col = j * C.BN_DOWN
        # (only with the comm kernel: a half down tile that pushes its rows itself made ptxas
        # spill)
        if C.FP8:
            fp8_down(routed, descs[3][0], expert, at, col, H, I, w_rows, C)
        elif half_padding(row_src_ptr, row, C.HALF and C.COMM_KERNEL, C.BM):
            h_in_h, z_h = half[4], half[5]
            acc_h = mm_acc(
                tl.zeros([C.BM // 2, C.BN_DOWN], dtype=tl.float32),
                h_in_h,
                wd_desc,
                expert,
                at,
                col,
                w_rows,
                I,
                C.BK_DOWN,
                C.BN_DOWN,
                False,
                C.UPCAST,
            )
            z_h.store([at, col], cast(acc_h, z_h.dtype, C.UPCAST))
            store_zeros(z_h, at + C.BM // 2, col, C.BM // 2, C.BN_DOWN)
        else:
            acc = mm_acc(
                tl.zeros([C.BM, C.BN_DOWN], dtype=tl.float32),
                h_in_desc,
                wd_desc,
                expert,
                at,
                col,
                w_rows,
                I,
                C.BK_DOWN,
                C.BN_DOWN,
                False,
                C.UPCAST,
            )
            z_desc.store([at, col], cast(acc, z_desc.dtype, C.UPCAST))
        publish_writes(C.GPU)  # the TMA store is done and visible to the generic loads
        if C.COMM_KERNEL:  # the comm kernel pushes the minibatch once all its tiles are stored
            signal(z_done_ptr + mb)
        else:
            tl.debug_barrier()
            comm.push_tile(
                z_ptr + at.to(tl.int64) * H,
                H,
                combine_table,
                row_src_ptr,
                row,
                col,
                T,
                H,
                C.TOP_K,
                C.BM,
                C.BN_DOWN,
                C.PUSH_CHUNK,
            )
            if C.RING_WRAPS:
                signal(z_done_ptr + mb)
    return alive


@triton.jit
def h_task(b, tiles, q8, inter, done_ptr, watch, stage, C: tl.constexpr):
    """fp8: the h task of row block b (:func:`quantize_h`) once the block's gate/up tiles are
    done (``done[b]``: h_done or sh_done), counting itself there too (the down tiles wait for
    one more). False if the wait gave up."""
    alive = wait_count(done_ptr + b, tl.cdiv(inter, C.BN_GATE_UP), stage, b, watch)
    if alive:
        acquire_for_tma(C.GPU)
        quantize_h(tiles, q8, b * C.BM, inter, C)
        publish_writes(C.GPU)
        signal(done_ptr + b)
    return alive


@triton.jit
def routed_task(t, num_blocks, descs, env, C: tl.constexpr):
    """Routed task t (of the routed part of the list); False if its wait gave up."""
    rows, dims = env[0], env[1]
    H, I = dims[1], dims[2]
    block_expert_ptr = rows[5]
    is_gate_up, b, j, real = grouped_task(
        t, num_blocks, gate_up_tasks(I, C), tl.cdiv(H, C.BN_DOWN), C.LAG, C.MB // C.BM
    )
    expert = tl.load(block_expert_ptr + b, mask=real, other=0)
    alive = True
    if not real:
        pass
    elif is_gate_up:
        if C.FP8 and j == tl.cdiv(I, C.BN_GATE_UP):  # the block's h task
            alive = h_task(b, descs[4][0], descs[3][0], I, env[2][2], env[3], _STAGE_H, C)
        else:
            alive = routed_gate_up(b, j, expert, descs, env, C)
    else:
        alive = routed_down(b, j, expert, descs, env, C)
    return alive


@triton.jit
def shared_task(t, shared_blocks, descs, env, C: tl.constexpr):
    """Shared-expert task t over the T local tokens (one 'expert', rows in token order, as
    ``gemm.gate_up`` / ``gemm.grouped_mm`` over ``uniform_schedule``); False if its wait gave
    up. Its output is read after the kernel (the combine epilogue): no signal."""
    ops, q8 = descs[2], descs[3][1]
    rows, dims, counters, watch, trace = env
    H, IS = dims[1], dims[3]
    sh_done_ptr = counters[3]
    n1 = gate_up_tasks(IS, C)
    is_gate_up, b, j, real = grouped_task(
        t, shared_blocks, n1, tl.cdiv(H, C.BN_DOWN), C.SHARED_LAG, C.MB // C.BM
    )
    row = b * C.BM
    alive = True
    if not real:
        pass
    elif is_gate_up:
        if C.FP8 and j == tl.cdiv(IS, C.BN_GATE_UP):  # the block's h task
            alive = h_task(b, descs[4][1], q8, IS, sh_done_ptr, watch, _STAGE_SHARED_H, C)
        else:
            col = j * C.BN_GATE_UP
            if C.FP8:
                fp8_gate_up(ops, q8, 0, row, col, IS, H, IS, C)
            else:
                gate_up_tile(
                    ops[0], ops[1], ops[2], ops[3], ops[4], ops[5], 0, row, col, IS, H, C.BM,
                    C.BN_GATE_UP, C.BK_GATE_UP, C.UPCAST,
                )  # fmt: skip
            publish_writes(C.GPU)
            signal(sh_done_ptr + b)
    else:
        alive = wait_count(sh_done_ptr + b, n1, _STAGE_SHARED_H, b, watch)
        if alive:
            acquire_for_tma(C.GPU)
            col = j * C.BN_DOWN
            if C.FP8:
                fp8_down(ops, q8, 0, row, col, H, IS, H, C)
            else:
                acc = tl.zeros([C.BM, C.BN_DOWN], dtype=tl.float32)
                acc = mm_acc(
                    acc, ops[6], ops[7], 0, row, col, H, IS, C.BK_DOWN, C.BN_DOWN, False,
                    C.UPCAST,
                )  # fmt: skip
                ops[8].store([row, col], cast(acc, ops[8].dtype, C.UPCAST))
    return alive


@triton.jit
def compute_role(limit, counts, ticket_ptr, first_event, descs, env, C: tl.constexpr):
    """Take tasks from the ticket until ``limit`` or a wait gave up. The list: the shared part
    (``SHARED``: its first ``shared_total`` positions), then the routed part (``counts``:
    ``tasks.task_counts``). Traced: one event per task (its kind, its position in the list),
    the wait included, from trace slot ``first_event`` on."""
    num_blocks, shared_blocks, shared_total = counts[0], counts[1], counts[2]
    dims, trace = env[1], env[4]
    task = take_task(ticket_ptr, limit, C.INTERPRET)
    alive = True
    n = first_event
    while (task < limit) & alive:
        trace_start(trace, n, C.TRACE)
        is_shared = False
        if C.SHARED:
            is_shared = task < shared_total
        if is_shared:
            alive = shared_task(task, shared_blocks, descs, env, C)
        else:
            alive = routed_task(task - shared_total, num_blocks, descs, env, C)
        if C.TRACE:
            H, I, IS = dims[1], dims[2], dims[3]
            kind = task_kind(
                task,
                counts,
                gate_up_tasks(IS, C),
                gate_up_tasks(I, C),
                tl.cdiv(H, C.BN_DOWN),
                C.LAG,
                C.SHARED_LAG,
                C.MB // C.BM,
            )
            trace_end(trace, n, kind, task, C.TRACE)
            n += 1
        if alive:
            task = take_task(ticket_ptr, limit, C.INTERPRET)
