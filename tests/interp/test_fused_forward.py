"""Backend "fused" under the CPU interpreter: the fused forward kernel against the unfused path.

The kernel runs its sequential driver (one program plays, per minibatch, every comm role's pull,
then the compute tasks whose inputs exist; then the rest); its waits still check every counter.
W = 1 uses the private one-rank workspace; W = 2, 3 and 8 are emulated in one process, every
rank's protocol steps in lockstep (``support.lockstep``).
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
import triton
import triton.language as tl

from megamoe.backends import fused as fused_backend
from megamoe.backends import triton as backend
from megamoe.ep.workspace import check_errors, emulated_workspaces, local_workspace
from megamoe.errors import CapacityError, StallError
from megamoe.kernels import fused as ff
from megamoe.kernels.fused.tasks import gate_up_start, task_of
from megamoe.kernels.runtime import poisoned_buffers
from support.bits import assert_same_grads, assert_same_routed, assert_same_shared, used_rows
from support.lockstep import ep_step
from support.problems import Case, make_problem, random_weights

BLOCK_ROWS = 16
# Tiny spin budget of the watchdog tests: the missing signal never comes, so fail fast.
STALL_BUDGET = 64


def _tunables(num_comm: int, minibatch_blocks: int, ring_blocks: int | None = None) -> dict:
    """The fused kernel's tunables; ring_blocks None: the ring holds every row (1024
    minibatches)."""
    mb = minibatch_blocks * BLOCK_ROWS
    ring = (1024 * minibatch_blocks if ring_blocks is None else ring_blocks) * BLOCK_ROWS
    return dict(comm_programs=num_comm, minibatch_rows=mb, ring_rows=ring)


def _single(case: Case, seed: int, **tunables):
    """A one-rank problem (zipf routing) with the cached one-rank workspace's combine slots
    poisoned (a slot the kernel forgot to push would keep the NaN)."""
    p = make_problem(case._replace(routing="zipf"), seed, **tunables)
    local_workspace(
        case.tokens, case.hidden, case.top_k, torch.bfloat16, p.x.device
    ).combine_buffer.fill_(float("nan"))
    return p


# ------------------------------------------------------------------------------ W = 1

# (num_comm, minibatch in row blocks, ring in row blocks (None: every row), shared I, down lag
# in task-list groups, one minibatch each; None: derived). The routing is seeded: 5 or 6 used
# blocks. Ring 1 block: every pull waits for the down tiles of the minibatch before; ring 2 x 2
# blocks: 2 slots, a partial last minibatch (asserted); lag 9 is capped by the ring; minibatch 3
# blocks: partial last groups (tasks past the last block do nothing).
SINGLE_CASES = [
    (1, 1, 1, 32, 0),
    (2, 2, None, 32, 1),
    (3, 1, 2, 0, 9),
    (2, 2, 4, 24, 2),
    (2, 1, None, 0, 9),
    (2, 3, None, 32, None),
    (1, 3, 3, 24, None),
]


@pytest.mark.parametrize("num_comm,minibatch_blocks,ring_blocks,i_s,down_lag", SINGLE_CASES)
def test_single_gpu_forward_is_bitwise_unfused(
    num_comm: int, minibatch_blocks: int, ring_blocks: int | None, i_s: int, down_lag: int | None
) -> None:
    case = Case(29, 64, 40, 4, 2, shared=i_s)  # I = 40: a partial gate/up column tile
    p = _single(
        case,
        num_comm * 10 + minibatch_blocks,
        **_tunables(num_comm, minibatch_blocks, ring_blocks),
        down_lag=down_lag,
    )
    cfg, weights, (x, ids, w, dy) = p.config, p.weights, p.single
    t, h, k = case.tokens, case.hidden, case.top_k
    with poisoned_buffers():
        sched = backend.build_schedule(ids, cfg, None)
        y_ref, ctx_ref = backend.forward(x, ids, w, weights, cfg, None, sched)
        y, ctx = fused_backend.forward(x, ids, w, weights, cfg, None, sched)
        assert torch.equal(y, y_ref)
        used = used_rows(sched.routed)
        if (minibatch_blocks, ring_blocks) == (2, 4):
            assert used // BLOCK_ROWS % 2 == 1, "meant to end in a partial minibatch"
        if ring_blocks is not None:
            assert used > cfg.ring_rows, "meant to need several macrobatches"
            assert ctx.routed is None, "a ring smaller than the rows must not claim the context"
        else:
            assert_same_routed(ctx, ctx_ref, used, "W=1")
        assert_same_shared(ctx, ctx_ref, "W=1")
        fused_backend.check(ctx)  # W = 1 has no shared workspace: nothing recorded there
        check_errors(local_workspace(t, h, k, torch.bfloat16, x.device))
        g_ref, g = backend.backward(ctx_ref, dy), fused_backend.backward(ctx, dy)
    assert_same_grads(g, g_ref, "W=1")


def test_ring_keeps_the_last_occupant_of_each_row() -> None:
    """The ring's rows are the layout's rows at row % ring (the last minibatch in each slot)."""
    case = Case(29, 64, 40, 4, 2)
    p = _single(case, 5, **_tunables(2, 1, ring_blocks=2))
    cfg, weights, x = p.config, p.weights, p.x
    sched = backend.build_schedule(p.topk_ids, cfg, None).routed
    from megamoe.backends.experts import routed_forward
    from megamoe.kernels import rows

    ref = routed_forward(rows.gather(x, sched), weights, sched)
    ws = local_workspace(case.tokens, case.hidden, case.top_k, torch.bfloat16, x.device)
    ws.x_buffer.copy_(x)
    out = ff.fused_forward(
        ws,
        sched,
        weights.w_gate,
        weights.w_up,
        weights.w_down,
        num_comm=2,
        minibatch_rows=cfg.minibatch_rows,
        ring_rows=cfg.ring_rows,
    )
    check_errors(ws)
    used, ring = used_rows(sched), cfg.ring_rows
    assert not out.full and out.routed.xs.shape[0] == ring and used > 2 * ring
    last = torch.arange(used - ring, used)  # the last `ring` rows, each at row % ring
    for name, ours, theirs in zip(ref._fields, out.routed, ref):
        assert torch.equal(ours[last % ring], theirs[last]), f"ring {name}"


@triton.jit
def _task_list_kernel(out_ptr, start_ptr, num_blocks, n1, n2, LAG: tl.constexpr):
    total = num_blocks * (n1 + n2)
    for t in range(total):
        is_gate_up, block, col = task_of(t, num_blocks, n1, n2, LAG)
        tl.store(out_ptr + 3 * t, is_gate_up.to(tl.int32))
        tl.store(out_ptr + 3 * t + 1, block)
        tl.store(out_ptr + 3 * t + 2, col)
    for b in range(num_blocks + 1):
        tl.store(start_ptr + b, gate_up_start(b, num_blocks, n1, n2, LAG))


@pytest.mark.parametrize("num_blocks", [0, 1, 2, 5])
@pytest.mark.parametrize("lag", [0, 1, 3])
def test_task_list_is_every_tile_once_in_topological_order(num_blocks: int, lag: int) -> None:
    n1, n2 = 3, 2
    out = torch.full((max(1, num_blocks * (n1 + n2)), 3), -1, dtype=torch.int32)
    starts = torch.full((num_blocks + 1,), -1, dtype=torch.int32)
    _task_list_kernel[(1,)](out, starts, num_blocks, n1, n2, LAG=lag)
    tasks = [tuple(r) for r in out[: num_blocks * (n1 + n2)].tolist()]
    # gate_up_start: where the interpreter's rounds stop (and the list's length past the last block)
    assert starts.tolist() == [tasks.index((1, b, 0)) for b in range(num_blocks)] + [len(tasks)]
    expected = {(1, b, c) for b in range(num_blocks) for c in range(n1)} | {
        (0, b, c) for b in range(num_blocks) for c in range(n2)
    }
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
        _task_list_kernel[(1,)](
            out, torch.empty(num_blocks + 1, dtype=torch.int32), num_blocks, n1, n2, LAG=capped
        )
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


def _ep_case(world: int, routing: str, i_s: int, top_k: int = 2) -> Case:
    # Eight ranks of top-8 routing: 6 tokens a rank already send rows between every pair of
    # ranks (asserted where it matters) and give experts of one and of several row blocks.
    tokens = 6 if world == 8 else 13
    return Case(tokens, 64, 32, 2 * world, top_k, shared=i_s, routing=routing, world=world)


# (world, routing, num_comm, ring in row blocks (None: every row), shared I); three and eight
# ranks: the code is written for any world size.
EP_CASES = [
    (2, "uniform", 1, 1, 32),
    (2, "one-rank", 2, None, 32),
    (2, "one-rank", 1, 2, 0),
    (2, "uniform", 2, None, 0),
    (3, "zipf", 2, None, 24),
    (3, "uniform", 1, 2, 0),
    (8, "zipf", 2, None, 16),
]

_TRITON_STEPS: dict = {}


def _triton_step(p, seed: int) -> list:
    """Backend "triton"'s training step of every rank (poisoned buffers), computed once per drawn
    problem (case and seed) and shared by the tests that compare "fused" against it: "triton"
    reads none of the fused kernel's tunables (comm_programs, minibatch_rows, ring_rows,
    comm_kernel), the only config fields those tests vary on one problem."""
    key = (p.case, seed)
    if key not in _TRITON_STEPS:
        with poisoned_buffers():
            _TRITON_STEPS[key] = ep_step(p)[0]
    return _TRITON_STEPS[key]


def _every_pair_exchanges_rows(p) -> None:
    e_local = p.case.local_experts
    pairs = {(s, int(d)) for s, r in enumerate(p.ranks) for d in (r.topk_ids // e_local).unique()}
    assert len(pairs) == p.case.world**2, "meant to send rows between every pair of ranks"


@pytest.mark.parametrize("world,routing,num_comm,ring_blocks,i_s", EP_CASES)
def test_ep_forward_is_bitwise_unfused(
    world: int, routing: str, num_comm: int, ring_blocks: int | None, i_s: int
) -> None:
    p = make_problem(
        _ep_case(world, routing, i_s, top_k=world), num_comm, **_tunables(num_comm, 1, ring_blocks)
    )
    cfg = p.config
    if world == 8:
        _every_pair_exchanges_rows(p)
    ref = _triton_step(p, num_comm)
    with poisoned_buffers():
        out, scheds, _ = ep_step(p, backend="fused")
    several = False
    for r in range(world):
        what = f"rank {r} of {world}"
        assert torch.equal(out[r][0], ref[r][0]), f"{what}: y"
        used = used_rows(scheds[r].routed)
        several |= used > cfg.ring_rows
        if ring_blocks is None:
            assert_same_routed(out[r][1], ref[r][1], used, what)
        assert_same_shared(out[r][1], ref[r][1], what)
        assert_same_grads(out[r][2], ref[r][2], what)
    if ring_blocks is not None:
        assert several, "meant to need several macrobatches on some rank"


def test_capacity_overflow_gives_nan_like_triton() -> None:
    """backend="auto" takes "fused" with expert parallelism, so its forward must handle an
    overflowed schedule as "triton" does: nothing computed, y (and the backward's d_x) NaN on
    every rank, a CapacityError at the check; with room for the load, "triton"'s bits."""
    case = _ep_case(2, "one-rank", 32)  # every token to the last rank
    p = make_problem(case, 3, **_tunables(2, 1), capacity_factor=1.25)
    world = case.world
    with poisoned_buffers():
        out, scheds, _ = ep_step(p, backend="fused")
    for r in range(world):
        assert scheds[r].routed.num_blocks.item() == 0 and scheds[r].invalid.tolist() == [1]
        assert out[r][0].isnan().all(), f"rank {r}: y"
        assert out[r][2].x.isnan().all(), f"rank {r}: d_x"
        with pytest.raises(CapacityError, match=f"rank {world - 1} was routed"):
            backend.check(scheds[r])
    fits = p.config.replace(capacity_factor=None)
    with poisoned_buffers():
        ref, _, _ = ep_step(p, fits)
        out, _, _ = ep_step(p, fits, backend="fused")
    for r in range(world):
        assert torch.equal(out[r][0], ref[r][0]), f"rank {r}: y"
        assert_same_grads(out[r][2], ref[r][2], f"rank {r}")


# world: (case, seed); W > 1 draws the problems of EP_CASES rows with num_comm 2 and a ring of
# every row (the "triton" step is shared with test_ep_forward_is_bitwise_unfused).
COMM_KERNEL_CASES = {
    1: (_ep_case(1, "zipf", 24), 12),
    2: (_ep_case(2, "one-rank", 32, top_k=2), 2),
    3: (_ep_case(3, "zipf", 24, top_k=3), 2),
    8: (_ep_case(8, "zipf", 16, top_k=8), 2),
}


@pytest.mark.parametrize("world", sorted(COMM_KERNEL_CASES))
def test_comm_kernel_is_bitwise_unfused(world: int) -> None:
    """config.comm_kernel: the pulls and pushes in the second kernel (the interpreter runs its
    pulls, the compute kernel, then its pushes) give "triton"'s bits too."""
    case, seed = COMM_KERNEL_CASES[world]
    p = make_problem(case, seed, **_tunables(2, 1), comm_kernel=True)
    cfg = p.config
    if world == 1:
        x, ids, w, dy = p.single
        # A slot the comm kernel forgot to push would keep this poison (the workspace is cached).
        local_workspace(
            x.shape[0], case.hidden, case.top_k, torch.bfloat16, x.device
        ).combine_buffer.fill_(float("nan"))
        with poisoned_buffers():
            sched = backend.build_schedule(ids, cfg, None)
            y_ref, ctx_ref = backend.forward(x, ids, w, p.weights, cfg, None, sched)
            y, ctx = fused_backend.forward(x, ids, w, p.weights, cfg, None, sched)
            assert torch.equal(y, y_ref)
            assert_same_routed(ctx, ctx_ref, used_rows(sched.routed), "W=1")
            assert_same_grads(fused_backend.backward(ctx, dy), backend.backward(ctx_ref, dy), "W=1")
        return
    if world == 8:
        _every_pair_exchanges_rows(p)
    ref = _triton_step(p, seed)
    with poisoned_buffers():
        out, scheds, _ = ep_step(p, backend="fused")
    for r in range(world):
        assert torch.equal(out[r][0], ref[r][0]), f"rank {r}: y"
        assert_same_routed(out[r][1], ref[r][1], used_rows(scheds[r].routed), f"rank {r}")
        assert_same_grads(out[r][2], ref[r][2], f"rank {r}")


# Row blocks of 32: their half blocks (16 rows) are the smallest the kernel runs as half tiles.
HALF_BLOCK_ROWS = 32


@pytest.mark.parametrize("comm_kernel", [False, True], ids=["one-kernel", "comm-kernel"])
def test_half_padded_blocks_give_the_full_tiles_bits(comm_kernel: bool) -> None:
    """An expert's last row block with at most half its rows real runs half-height gate/up tiles
    (and down tiles with the comm kernel) and zeros the padding half: y, every saved activation
    (padding rows included, in poisoned buffers) and every gradient equal "triton"'s full tiles."""
    case = Case(37, 64, 40, 4, 2, shared=24, block_rows=HALF_BLOCK_ROWS)
    i = case.intermediate
    p = _single(
        case,
        21,
        comm_programs=2,
        minibatch_rows=HALF_BLOCK_ROWS,
        ring_rows=1024 * HALF_BLOCK_ROWS,
        comm_kernel=comm_kernel,
    )
    cfg, weights, (x, ids, w, dy) = p.config, p.weights, p.single
    with poisoned_buffers():
        sched = backend.build_schedule(ids, cfg, None)
        used = used_rows(sched.routed)
        blocks = sched.routed.row_src[:used].view(-1, HALF_BLOCK_ROWS)
        half = blocks[:, HALF_BLOCK_ROWS // 2] < 0
        assert half.any() and not half.all(), "meant to have half-padded and fuller blocks"
        y_ref, ctx_ref = backend.forward(x, ids, w, weights, cfg, None, sched)
        y, ctx = fused_backend.forward(x, ids, w, weights, cfg, None, sched)
        assert torch.equal(y, y_ref)
        assert_same_routed(ctx, ctx_ref, used, "half blocks")
        for name in ("g", "u", "h"):  # the padding halves hold zeros, not the poison
            rows = getattr(ctx.routed, name)[:used].view(-1, HALF_BLOCK_ROWS, i)
            assert torch.equal(
                rows[half, HALF_BLOCK_ROWS // 2 :],
                torch.zeros_like(rows[half, HALF_BLOCK_ROWS // 2 :]),
            ), name
        assert_same_grads(
            fused_backend.backward(ctx, dy), backend.backward(ctx_ref, dy), "half blocks"
        )


# ------------------------------------------------------------------------------ watchdog


def _stall(skip_tasks: int, ring_blocks: int | None = None, never_pulled: bool = False) -> str:
    """Run the kernel with the ticket pre-advanced by ``skip_tasks`` (those tasks never signal);
    ``never_pulled``: minibatch 0's ready counter starts far behind (its pulls never count)."""
    case = Case(11, 64, 32, 2, 2)
    p = make_problem(case, 7, **_tunables(2, 1))
    weights = p.weights
    sched = backend.build_schedule(p.topk_ids, p.config, None).routed
    ws = local_workspace(case.tokens, case.hidden, case.top_k, torch.bfloat16, p.x.device)
    ws.x_buffer.copy_(p.x)
    flags = torch.zeros(4096, dtype=torch.int32)
    flags[0] = skip_tasks
    ring = None if ring_blocks is None else ring_blocks * BLOCK_ROWS
    if never_pulled:
        layout = ff.flag_layout(sched.rows // BLOCK_ROWS, sched.max_blocks, 0)
        flags[layout.ready] = -(1 << 20)
    ff.fused_forward(
        ws,
        sched,
        weights.w_gate,
        weights.w_up,
        weights.w_down,
        num_comm=2,
        minibatch_rows=BLOCK_ROWS,
        ring_rows=ring,
        budget=STALL_BUDGET,
        flags=flags,
    )
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
    assert (
        "stalled in fused forward: ring slot freed by the down tiles of its previous "
        "minibatch (index = the minibatch to pull into it) (index 1)"
    ) in message
    assert "flag was 0" in message


def test_bad_arguments_are_refused() -> None:
    ws = emulated_workspaces(1, 4, 64, 2)[0]
    ids = torch.zeros(4, 2, dtype=torch.int64)
    ids[:, 1] = 1
    cfg = Case(4, 64, 32, 2, 2).config(**_tunables(1, 1))
    sched = backend.build_schedule(ids, cfg, None).routed
    w = random_weights(cfg, 2, torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="num_comm"):
        ff.fused_forward(ws, sched, w.w_gate, w.w_up, w.w_down, num_comm=0, minibatch_rows=16)
    with pytest.raises(ValueError, match="minibatch_rows"):
        ff.fused_forward(ws, sched, w.w_gate, w.w_up, w.w_down, num_comm=1, minibatch_rows=24)
    with pytest.raises(ValueError, match="ring_rows"):
        ff.fused_forward(
            ws, sched, w.w_gate, w.w_up, w.w_down, num_comm=1, minibatch_rows=32, ring_rows=48
        )
    with pytest.raises(ValueError, match="comm_kernel needs a ring that holds every row"):
        ff.fused_forward(
            ws,
            sched,
            w.w_gate,
            w.w_up,
            w.w_down,
            num_comm=1,
            minibatch_rows=16,
            ring_rows=16,
            comm_kernel=True,
        )
    with pytest.raises(ValueError, match="trace needs a GPU"):
        ff.fused_forward(
            ws,
            sched,
            w.w_gate,
            w.w_up,
            w.w_down,
            num_comm=1,
            minibatch_rows=16,
            trace=torch.zeros(1, 4, 3, dtype=torch.int64),
        )
