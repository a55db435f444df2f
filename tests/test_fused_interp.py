"""Backend "fused" under the CPU interpreter: the fused forward kernel against the unfused path.

The kernel runs PHASED (one program plays, per minibatch, every comm role's pull, then the
compute tasks whose inputs exist; then the rest); its waits still check every counter. W = 1
uses the backend's private one-rank workspace; W = 2 and 3 are emulated in one process, every
rank's protocol steps in lockstep (tests/test_triton_ep_interp.py).
Checked: y, the shared activations and every gradient bitwise equal to backend "triton" for
several num_comm, minibatch sizes and ring sizes (a ring smaller than the work: several
macrobatches, the backward replays the routed forward; a ring holding every row: the routed
activations are saved and equal too), with and without a shared expert, and with the half tiles
of half-padded row blocks; a missing signal (h tile, pulled rows, a ring slot never freed) ends
in a StallError naming the stage.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from megamoe.kernels.runtime import interpreting, poisoned_buffers  # noqa: E402

if not interpreting():
    pytest.skip("needs TRITON_INTERPRET=1 (GPU runs are in tests/gpu)", allow_module_level=True)

from megamoe.backends import fused as fused_backend  # noqa: E402
from megamoe.backends import triton as backend  # noqa: E402
from megamoe.kernels import fused_forward as ff  # noqa: E402
from megamoe.routing import make_routing  # noqa: E402
from megamoe.types import ExpertWeights  # noqa: E402
from megamoe.workspace import StallError, check_errors, emulated_workspaces  # noqa: E402
from moe_cases import make_config  # noqa: E402
from test_triton_ep_interp import lockstep  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning")

BLOCK_ROWS = 16
ACTIVATIONS = ("xs", "g", "u", "h", "z")
# Tiny spin budget of the watchdog tests: the missing signal never comes, so fail fast.
STALL_BUDGET = 64


def _rnd(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * scale).to(torch.bfloat16)


def _weights(gen, e: int, h: int, i: int, i_s: int) -> ExpertWeights:
    shared = ((_rnd(gen, i_s, h, scale=h**-0.5), _rnd(gen, i_s, h, scale=h**-0.5),
               _rnd(gen, h, i_s, scale=i_s**-0.5)) if i_s else (None, None, None))
    return ExpertWeights(_rnd(gen, e, i, h, scale=h**-0.5), _rnd(gen, e, i, h, scale=h**-0.5),
                         _rnd(gen, e, h, i, scale=i**-0.5), *shared)


def _config(h, i, e, k, i_s, num_comm: int, minibatch_blocks: int,
            ring_blocks: int | None = None):
    """ring_blocks None: the ring holds every row (1024 minibatches)."""
    mb = minibatch_blocks * BLOCK_ROWS
    cfg = make_config(h, i, e, k, i_s, BLOCK_ROWS).replace(comm_programs=num_comm,
                                                           minibatch_rows=mb, ring_rows=mb)
    return cfg.replace(ring_rows=(1024 * minibatch_blocks if ring_blocks is None else
                                  ring_blocks) * BLOCK_ROWS)


def _single_problem(gen, t: int, h: int, i: int, e: int, k: int, i_s: int):
    """Weights, zipf routing (ids, w), x and dy of a one-rank forward; the cached one-rank
    workspace's combine slots poisoned (a slot the kernel forgot to push would keep the NaN)."""
    weights = _weights(gen, e, h, i, i_s)
    ids, w = make_routing(t, e, k, kind="zipf", generator=gen)
    x, dy = _rnd(gen, t, h), _rnd(gen, t, h)
    fused_backend.local_workspace(t, h, k, torch.bfloat16, x.device).combine_buffer.fill_(
        float("nan"))
    return weights, ids, w, x, dy


def _used_rows(sched) -> int:
    return int(sched.num_blocks.item()) * sched.block_rows


def _assert_same_activations(ctx_a, ctx_b, used: int, what: str) -> None:
    for name in ACTIVATIONS:
        a, b = getattr(ctx_a, name)[:used], getattr(ctx_b, name)[:used]
        assert torch.equal(a, b), f"{what}: {name} differs"


# ------------------------------------------------------------------------------ W = 1

def _assert_same_shared(ctx_a, ctx_b, what: str) -> None:
    if ctx_b.shared is None:
        assert ctx_a.shared is None, what
        return
    for name, a, b in zip(("sg", "su", "sh"), ctx_a.shared, ctx_b.shared):
        assert torch.equal(a, b), f"{what}: shared {name} differs"


def _assert_same_grads(g, g_ref, what: str) -> None:
    for name, a, b in zip(g._fields, g, g_ref):
        assert (a is None and b is None) or torch.equal(a, b), f"{what}: grad {name} differs"


# (num_comm, minibatch in row blocks, ring in row blocks (None: every row), shared I, down lag
# in task-list groups, one minibatch each; None: derived). The routing is seeded: 5 or 6 used
# blocks. Ring 1 block: every pull waits for the down tiles of the minibatch before; ring 2 x 2
# blocks: 2 slots, a partial last minibatch (asserted); lag 9 is capped by the ring; minibatch 3
# blocks: partial last groups (tasks past the last block do nothing).
SINGLE_CASES = [(1, 1, 1, 32, 0), (2, 2, None, 32, 1), (3, 1, 2, 0, 9), (2, 2, 4, 24, 2),
                (2, 1, None, 0, 9), (2, 3, None, 32, None), (1, 3, 3, 24, None)]


@pytest.mark.parametrize("num_comm,minibatch_blocks,ring_blocks,i_s,down_lag", SINGLE_CASES)
def test_single_gpu_forward_is_bitwise_unfused(num_comm: int, minibatch_blocks: int,
                                               ring_blocks: int | None, i_s: int,
                                               down_lag: int | None) -> None:
    gen = torch.Generator().manual_seed(num_comm * 10 + minibatch_blocks)
    t, h, i, e, k = 29, 64, 40, 4, 2  # I = 40: a partial gate/up column tile
    cfg = _config(h, i, e, k, i_s, num_comm, minibatch_blocks, ring_blocks)
    cfg = cfg.replace(down_lag=down_lag)
    weights, ids, w, x, dy = _single_problem(gen, t, h, i, e, k, i_s)
    with poisoned_buffers():
        sched = backend.build_schedule(ids, cfg, None)
        y_ref, ctx_ref = backend.forward(x, ids, w, weights, cfg, None, sched)
        y, ctx = fused_backend.forward(x, ids, w, weights, cfg, None, sched)
        assert torch.equal(y, y_ref)
        used = _used_rows(sched.routed)
        if (minibatch_blocks, ring_blocks) == (2, 4):
            assert used // BLOCK_ROWS % 2 == 1, "meant to end in a partial minibatch"
        if ring_blocks is not None:
            assert used > cfg.ring_rows, "meant to need several macrobatches"
            assert ctx.xs is None, "a ring smaller than the rows must not claim the context"
        else:
            _assert_same_activations(ctx, ctx_ref, used, "W=1")
        _assert_same_shared(ctx, ctx_ref, "W=1")
        fused_backend.check(ctx)  # W = 1 has no shared workspace: nothing recorded there
        check_errors(fused_backend.local_workspace(t, h, k, torch.bfloat16, x.device))
        g_ref, g = backend.backward(ctx_ref, dy), fused_backend.backward(ctx, dy)
    _assert_same_grads(g, g_ref, "W=1")


def test_ring_keeps_the_last_occupant_of_each_row() -> None:
    """The ring's rows are the layout's rows at row % ring (the last minibatch in each slot)."""
    gen = torch.Generator().manual_seed(5)
    t, h, i, e, k = 29, 64, 40, 4, 2
    cfg = _config(h, i, e, k, 0, 2, 1, ring_blocks=2)
    weights = _weights(gen, e, h, i, 0)
    ids, _ = make_routing(t, e, k, kind="zipf", generator=gen)
    x = _rnd(gen, t, h)
    sched = backend.build_schedule(ids, cfg, None).routed
    from megamoe.kernels import gemm, rows
    ref_xs = rows.gather(x, sched)
    ref_g, ref_u, ref_h = gemm.gate_up(ref_xs, weights.w_gate, weights.w_up, sched)
    ref_z = gemm.grouped_mm(ref_h, weights.w_down, sched)
    ws = fused_backend.local_workspace(t, h, k, torch.bfloat16, x.device)
    ws.x_buffer.copy_(x)
    out = ff.fused_forward(ws, sched, weights.w_gate, weights.w_up, weights.w_down, num_comm=2,
                           minibatch_rows=cfg.minibatch_rows, ring_rows=cfg.ring_rows)
    check_errors(ws)
    used, ring = _used_rows(sched), cfg.ring_rows
    assert not out.full and out.xs.shape[0] == ring and used > 2 * ring
    last = torch.arange(used - ring, used)  # the last `ring` rows, each at row % ring
    for name, ours, ref in zip(ACTIVATIONS, (out.xs, out.g, out.u, out.h, out.z),
                               (ref_xs, ref_g, ref_u, ref_h, ref_z)):
        assert torch.equal(ours[last % ring], ref[last]), f"ring {name}"


@triton.jit
def _task_list_kernel(out_ptr, start_ptr, num_blocks, n1, n2, LAG: tl.constexpr):
    total = num_blocks * (n1 + n2)
    for t in range(total):
        is_gate_up, block, col = ff.task_of(t, num_blocks, n1, n2, LAG)
        tl.store(out_ptr + 3 * t, is_gate_up.to(tl.int32))
        tl.store(out_ptr + 3 * t + 1, block)
        tl.store(out_ptr + 3 * t + 2, col)
    for b in range(num_blocks + 1):
        tl.store(start_ptr + b, ff.gate_up_start(b, num_blocks, n1, n2, LAG))


@pytest.mark.parametrize("num_blocks", [0, 1, 2, 5])
@pytest.mark.parametrize("lag", [0, 1, 3])
def test_task_list_is_every_tile_once_in_topological_order(num_blocks: int, lag: int) -> None:
    n1, n2 = 3, 2
    out = torch.full((max(1, num_blocks * (n1 + n2)), 3), -1, dtype=torch.int32)
    starts = torch.full((num_blocks + 1,), -1, dtype=torch.int32)
    _task_list_kernel[(1,)](out, starts, num_blocks, n1, n2, LAG=lag)
    tasks = [tuple(r) for r in out[:num_blocks * (n1 + n2)].tolist()]
    # gate_up_start: where the PHASED rounds stop (and the list's length past the last block)
    assert starts.tolist() == [tasks.index((1, b, 0)) for b in range(num_blocks)] + [len(tasks)]
    expected = {(1, b, c) for b in range(num_blocks) for c in range(n1)} | \
        {(0, b, c) for b in range(num_blocks) for c in range(n2)}
    assert len(tasks) == len(expected) and set(tasks) == expected
    for pos, (is_gate_up, block, _) in enumerate(tasks):
        if not is_gate_up:  # every gate/up tile of the block is earlier in the list
            assert all(tasks.index((1, block, c)) < pos for c in range(n1))


@pytest.mark.parametrize("slots,blocks_per_mb", [(1, 1), (1, 4), (2, 1), (2, 3), (3, 2)])
def test_routed_lag_frees_a_slot_before_its_next_pull(slots: int, blocks_per_mb: int) -> None:
    """With the capped lag, every down tile of minibatch m - slots precedes the first gate/up
    tile of minibatch m (the pull of m waits for the down tiles of m - slots): no deadlock."""
    n1, n2, num_blocks = 2, 3, 4 * slots * blocks_per_mb + 1
    for lag in (0, 2, 9):
        capped = ff.routed_lag(lag, slots, blocks_per_mb, max_minibatches=10**6)
        out = torch.full((num_blocks * (n1 + n2), 3), -1, dtype=torch.int32)
        _task_list_kernel[(1,)](out, torch.empty(num_blocks + 1, dtype=torch.int32), num_blocks,
                                n1, n2, LAG=capped)
        tasks = [tuple(r) for r in out.tolist()]
        for b in range(slots * blocks_per_mb, num_blocks):
            mb = b // blocks_per_mb
            first = tasks.index((1, b, 0))
            for old in range((mb - slots) * blocks_per_mb, (mb - slots + 1) * blocks_per_mb):
                assert all(tasks.index((0, old, c)) < first for c in range(n2)), (lag, b, old)


def test_comm_programs_follow_the_pull_rate() -> None:
    """The derived pull programs on an H200's 132 SMs are the sweeps' best (BENCHMARKS.md: dsv3,
    qwen3-30b, mok-v4 at W = 2 and W = 1); local pulls are faster, so W = 1 needs fewer; a
    narrower expert (fewer FLOPs per pulled byte) needs more; never the whole grid."""
    at_w2 = [ff.comm_programs_for(132, i, 2) for i in (2048, 768, 3072)]
    at_w1 = [ff.comm_programs_for(132, i, 1) for i in (2048, 768, 3072)]
    assert at_w2 == [9, 21, 6] and at_w1 == [6, 15, 4]
    assert ff.comm_programs_for(132, 2048, 8) == at_w2[0]
    assert ff.comm_programs_for(4, 1, 2) == 3 and ff.comm_programs_for(2, 64, 1) == 1


# ------------------------------------------------------------------------------ W > 1

def _ep_problem(seed: int, routing: str, i_s: int, world: int = 2, top_k: int = 2):
    t, h, i, e_local, k = 13, 64, 32, 2, top_k
    gen = torch.Generator().manual_seed(seed)
    weights = _weights(gen, e_local * world, h, i, i_s)
    ranks = []
    for _ in range(world):
        ids, w = make_routing(t, e_local * world, k, kind=routing, world_size=world,
                              target_rank=world - 1, generator=gen)
        ranks.append((_rnd(gen, t, h), ids, w, _rnd(gen, t, h)))
    return (world, t, h, i, e_local, k, i_s), weights, ranks


def _local(weights: ExpertWeights, r: int, e_local: int) -> ExpertWeights:
    sl = slice(r * e_local, (r + 1) * e_local)
    return ExpertWeights(weights.w_gate[sl], weights.w_up[sl], weights.w_down[sl],
                         weights.s_gate, weights.s_up, weights.s_down)


def _ep_step(cfg, shape, weights, ranks, fused: bool):
    """(y, ctx, grads) per rank: schedule, forward, backward (the fused one replays if needed)."""
    world, t, h, _, e_local, k, _ = shape
    wss = emulated_workspaces(world, t, h, k)
    for ws in wss:  # a slot nobody pushed keeps NaN and shows up in y
        ws.combine_buffer.fill_(float("nan"))
    scheds = lockstep([backend.schedule_steps(ranks[r][1], cfg, wss[r]) for r in range(world)],
                      wss)
    forward = fused_backend.forward_steps if fused else backend.forward_steps
    outs = lockstep([forward(ranks[r][0], ranks[r][2], _local(weights, r, e_local), scheds[r])
                     for r in range(world)], wss)
    ctxs = [ctx for _, ctx in outs]
    if fused and ctxs[0].xs is None:
        ctxs = lockstep([fused_backend.replay_steps(c) for c in ctxs], wss)
    grads = lockstep([backend.backward_steps(ctxs[r], ranks[r][3]) for r in range(world)], wss)
    for ws in wss:
        check_errors(ws)
    return [(y, ctx, g) for (y, ctx), g in zip(outs, grads)], scheds


# (world, routing, num_comm, ring in row blocks (None: every row), shared I); three and eight
# ranks: the code is written for any world size (the x8 run is issue 5).
EP_CASES = [(2, "uniform", 1, 1, 32), (2, "one-rank", 2, None, 32), (2, "one-rank", 1, 2, 0),
            (2, "uniform", 2, None, 0), (3, "zipf", 2, None, 24), (3, "uniform", 1, 2, 0),
            (8, "zipf", 2, None, 16)]


@pytest.mark.parametrize("world,routing,num_comm,ring_blocks,i_s", EP_CASES)
def test_ep_forward_is_bitwise_unfused(world: int, routing: str, num_comm: int,
                                       ring_blocks: int | None, i_s: int) -> None:
    shape, weights, ranks = _ep_problem(num_comm, routing, i_s, world, top_k=world)
    _, _, h, i, e_local, k, _ = shape
    cfg = _config(h, i, e_local * world, k, i_s, num_comm, 1, ring_blocks)
    with poisoned_buffers():
        ref, _ = _ep_step(cfg, shape, weights, ranks, fused=False)
        out, scheds = _ep_step(cfg, shape, weights, ranks, fused=True)
    several = False
    for r in range(world):
        what = f"rank {r} of {world}"
        assert torch.equal(out[r][0], ref[r][0]), f"{what}: y"
        used = _used_rows(scheds[r].routed)
        several |= used > cfg.ring_rows
        if ring_blocks is None:
            _assert_same_activations(out[r][1], ref[r][1], used, what)
        _assert_same_shared(out[r][1], ref[r][1], what)
        _assert_same_grads(out[r][2], ref[r][2], what)
    if ring_blocks is not None:
        assert several, "meant to need several macrobatches on some rank"


def test_capacity_overflow_gives_nan_like_triton() -> None:
    """backend="auto" takes "fused" with expert parallelism, so its forward must handle an
    overflowed schedule as "triton" does: nothing computed, y (and the backward's d_x) NaN on
    every rank, a CapacityError at the check; with room for the load, "triton"'s bits."""
    shape, weights, ranks = _ep_problem(3, "one-rank", 32)  # every token to the last rank
    world, t, h, i, e_local, k, i_s = shape
    cfg = _config(h, i, e_local * world, k, i_s, 2, 1).replace(capacity_factor=1.25)
    with poisoned_buffers():
        out, scheds = _ep_step(cfg, shape, weights, ranks, fused=True)
    for r in range(world):
        assert scheds[r].routed.num_blocks.item() == 0 and scheds[r].ep.invalid.tolist() == [1]
        assert out[r][0].isnan().all(), f"rank {r}: y"
        assert out[r][2].x.isnan().all(), f"rank {r}: d_x"
        with pytest.raises(backend.CapacityError, match=f"rank {world - 1} was routed"):
            backend.check(scheds[r])
    fits = cfg.replace(capacity_factor=None)
    with poisoned_buffers():
        ref, _ = _ep_step(fits, shape, weights, ranks, fused=False)
        out, _ = _ep_step(fits, shape, weights, ranks, fused=True)
    for r in range(world):
        assert torch.equal(out[r][0], ref[r][0]), f"rank {r}: y"
        _assert_same_grads(out[r][2], ref[r][2], f"rank {r}")


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_comm_kernel_is_bitwise_unfused(world: int) -> None:
    """config.comm_kernel: the pulls and pushes in the second kernel (the interpreter runs its
    pulls, the compute kernel, then its pushes) give "triton"'s bits too."""
    shape, weights, ranks = _ep_problem(11 + world, "zipf", 24, max(world, 2), top_k=2)
    _, _, h, i, e_local, k, i_s = shape
    cfg = _config(h, i, e_local * max(world, 2), k, i_s, 2, 1).replace(comm_kernel=True)
    if world == 1:
        x, ids, w, dy = ranks[0]
        # A slot the comm kernel forgot to push would keep this poison (the workspace is cached).
        fused_backend.local_workspace(x.shape[0], h, k, torch.bfloat16, x.device).combine_buffer \
            .fill_(float("nan"))
        with poisoned_buffers():
            sched = backend.build_schedule(ids, cfg, None)
            y_ref, ctx_ref = backend.forward(x, ids, w, weights, cfg, None, sched)
            y, ctx = fused_backend.forward(x, ids, w, weights, cfg, None, sched)
            assert torch.equal(y, y_ref)
            _assert_same_activations(ctx, ctx_ref, _used_rows(sched.routed), "W=1")
            _assert_same_grads(fused_backend.backward(ctx, dy), backend.backward(ctx_ref, dy),
                               "W=1")
        return
    shape = (world, *shape[1:])
    with poisoned_buffers():
        ref, _ = _ep_step(cfg, shape, weights, ranks[:world], fused=False)
        out, scheds = _ep_step(cfg, shape, weights, ranks[:world], fused=True)
    for r in range(world):
        assert torch.equal(out[r][0], ref[r][0]), f"rank {r}: y"
        _assert_same_activations(out[r][1], ref[r][1], _used_rows(scheds[r].routed), f"rank {r}")
        _assert_same_grads(out[r][2], ref[r][2], f"rank {r}")


# Row blocks of 32: their half blocks (16 rows) are the smallest the kernel runs as half tiles.
HALF_BLOCK_ROWS = 32


@pytest.mark.parametrize("comm_kernel", [False, True], ids=["one-kernel", "comm-kernel"])
def test_half_padded_blocks_give_the_full_tiles_bits(comm_kernel: bool) -> None:
    """An expert's last row block with at most half its rows real runs half-height gate/up tiles
    (and down tiles with the comm kernel) and zeros the padding half: y, every saved activation
    (padding rows included, in poisoned buffers) and every gradient equal "triton"'s full tiles."""
    gen = torch.Generator().manual_seed(21)
    t, h, i, e, k, i_s = 37, 64, 40, 4, 2, 24
    cfg = make_config(h, i, e, k, i_s, HALF_BLOCK_ROWS).replace(
        comm_programs=2, minibatch_rows=HALF_BLOCK_ROWS, ring_rows=1024 * HALF_BLOCK_ROWS,
        comm_kernel=comm_kernel)
    weights, ids, w, x, dy = _single_problem(gen, t, h, i, e, k, i_s)
    with poisoned_buffers():
        sched = backend.build_schedule(ids, cfg, None)
        used = _used_rows(sched.routed)
        blocks = sched.routed.row_src[:used].view(-1, HALF_BLOCK_ROWS)
        half = blocks[:, HALF_BLOCK_ROWS // 2] < 0
        assert half.any() and not half.all(), "meant to have half-padded and fuller blocks"
        y_ref, ctx_ref = backend.forward(x, ids, w, weights, cfg, None, sched)
        y, ctx = fused_backend.forward(x, ids, w, weights, cfg, None, sched)
        assert torch.equal(y, y_ref)
        _assert_same_activations(ctx, ctx_ref, used, "half blocks")
        for name in ("g", "u", "h"):  # the padding halves hold zeros, not the poison
            rows = getattr(ctx, name)[:used].view(-1, HALF_BLOCK_ROWS, i)
            assert torch.equal(rows[half, HALF_BLOCK_ROWS // 2:],
                               torch.zeros_like(rows[half, HALF_BLOCK_ROWS // 2:])), name
        _assert_same_grads(fused_backend.backward(ctx, dy), backend.backward(ctx_ref, dy),
                           "half blocks")


# ------------------------------------------------------------------------------ watchdog

def _stall(skip_tasks: int, ring_blocks: int | None = None, never_pulled: bool = False) -> str:
    """Run the kernel with the ticket pre-advanced by ``skip_tasks`` (those tasks never signal);
    ``never_pulled``: minibatch 0's ready counter starts far behind (its pulls never count)."""
    gen = torch.Generator().manual_seed(7)
    t, h, i, e, k = 11, 64, 32, 2, 2
    cfg = _config(h, i, e, k, 0, num_comm=2, minibatch_blocks=1)
    weights = _weights(gen, e, h, i, 0)
    ids, w = make_routing(t, e, k, generator=gen)
    sched = backend.build_schedule(ids, cfg, None).routed
    ws = fused_backend.local_workspace(t, h, k, torch.bfloat16, ids.device)
    ws.x_buffer.copy_(_rnd(gen, t, h))
    flags = torch.zeros(4096, dtype=torch.int32)
    flags[0] = skip_tasks
    ring = None if ring_blocks is None else ring_blocks * BLOCK_ROWS
    if never_pulled:
        layout = ff.flag_layout(sched.rows // BLOCK_ROWS, sched.max_blocks, 0)
        flags[layout.ready] = -(1 << 20)
    ff.fused_forward(ws, sched, weights.w_gate, weights.w_up, weights.w_down, num_comm=2,
                     minibatch_rows=BLOCK_ROWS, ring_rows=ring, budget=STALL_BUDGET,
                     flags=flags)
    with pytest.raises(StallError) as info:
        check_errors(ws)
    check_errors(ws)  # the record was cleared
    return str(info.value)


def test_missing_h_tile_signal_is_reported() -> None:
    message = _stall(skip_tasks=1)  # gate/up tile 0 of block 0 never runs
    assert "stalled in fused forward: h tiles of a row block (index 0)" in message
    assert f"after {STALL_BUDGET} polls" in message


def test_missing_pulls_are_reported_by_the_gate_up_tiles() -> None:
    message = _stall(skip_tasks=0, never_pulled=True)
    assert "stalled in fused forward: pulled rows of a minibatch (index 0)" in message


def test_ring_slot_never_freed_is_reported_by_the_pulls() -> None:
    message = _stall(skip_tasks=1 << 20, ring_blocks=1)  # no down tile of minibatch 0 runs
    assert ("stalled in fused forward: ring slot freed by the down tiles of its previous "
            "minibatch (index = the minibatch to pull into it) (index 1)") in message
    assert "flag was 0" in message


def test_bad_arguments_are_refused() -> None:
    ws = emulated_workspaces(1, 4, 64, 2)[0]
    ids = torch.zeros(4, 2, dtype=torch.int64)
    ids[:, 1] = 1
    sched = backend.build_schedule(ids, _config(64, 32, 2, 2, 0, 1, 1), None).routed
    w = _weights(torch.Generator().manual_seed(1), 2, 64, 32, 0)
    with pytest.raises(ValueError, match="num_comm"):
        ff.fused_forward(ws, sched, w.w_gate, w.w_up, w.w_down, num_comm=0, minibatch_rows=16)
    with pytest.raises(ValueError, match="minibatch_rows"):
        ff.fused_forward(ws, sched, w.w_gate, w.w_up, w.w_down, num_comm=1, minibatch_rows=24)
    with pytest.raises(ValueError, match="ring_rows"):
        ff.fused_forward(ws, sched, w.w_gate, w.w_up, w.w_down, num_comm=1, minibatch_rows=32,
                         ring_rows=48)
    with pytest.raises(ValueError, match="comm_kernel needs a ring that holds every row"):
        ff.fused_forward(ws, sched, w.w_gate, w.w_up, w.w_down, num_comm=1, minibatch_rows=16,
                         ring_rows=16, comm_kernel=True)
    with pytest.raises(ValueError, match="trace needs a GPU"):
        ff.fused_forward(ws, sched, w.w_gate, w.w_up, w.w_down, num_comm=1, minibatch_rows=16,
                         trace=torch.zeros(1, 4, 3, dtype=torch.int64))
