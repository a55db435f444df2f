"""Backend "fused" under the CPU interpreter: the fused forward kernel against the unfused path.

The kernel runs PHASED (one program plays every comm role's pulls, then every compute task in
ticket order, then every comm role's pushes); its waits still check every counter. W = 1 uses the
backend's private one-rank workspace; W = 2 is emulated in one process, every rank's protocol
steps in lockstep (tests/test_triton_ep_interp.py). Checked: outputs and every routed activation
bitwise equal to backend "triton" for several num_comm and minibatch sizes; the context trains
with the unfused backward; a missing signal ends in a StallError naming the stage.
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


def _config(h, i, e, k, i_s, num_comm: int, minibatch_blocks: int):
    mb = minibatch_blocks * BLOCK_ROWS
    return make_config(h, i, e, k, i_s, BLOCK_ROWS).replace(
        comm_programs=num_comm, minibatch_rows=mb, ring_rows=mb)


def _used_rows(sched) -> int:
    return int(sched.num_blocks.item()) * sched.block_rows


def _assert_same_activations(ctx_a, ctx_b, used: int, what: str) -> None:
    for name in ACTIVATIONS:
        a, b = getattr(ctx_a, name)[:used], getattr(ctx_b, name)[:used]
        assert torch.equal(a, b), f"{what}: {name} differs"


# ------------------------------------------------------------------------------ W = 1

# (num_comm, minibatch in row blocks, down lag); (2, 2, *) has 5 used blocks: a partial last
# minibatch (asserted below, the routing is seeded).
@pytest.mark.parametrize("num_comm,minibatch_blocks,down_lag", [(1, 1, 0), (2, 2, 1), (3, 1, 9)])
def test_single_gpu_forward_is_bitwise_unfused(num_comm: int, minibatch_blocks: int,
                                               down_lag: int,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ff, "DEFAULT_DOWN_LAG", down_lag)
    gen = torch.Generator().manual_seed(num_comm * 10 + minibatch_blocks)
    t, h, i, e, k, i_s = 29, 64, 40, 4, 2, 32  # I = 40: a partial gate/up column tile
    cfg = _config(h, i, e, k, i_s, num_comm, minibatch_blocks)
    weights = _weights(gen, e, h, i, i_s)
    ids, w = make_routing(t, e, k, kind="zipf", generator=gen)
    x, dy = _rnd(gen, t, h), _rnd(gen, t, h)
    # A slot the kernel forgot to push would keep this poison (the workspace is cached).
    fused_backend.local_workspace(t, h, k, torch.bfloat16, x.device).combine_buffer.fill_(
        float("nan"))
    with poisoned_buffers():
        sched = backend.build_schedule(ids, cfg, None)
        y_ref, ctx_ref = backend.forward(x, ids, w, weights, cfg, None, sched)
        y, ctx = fused_backend.forward(x, ids, w, weights, cfg, None, sched)
        assert torch.equal(y, y_ref)
        used = _used_rows(sched.routed)
        if minibatch_blocks == 2:
            assert used // BLOCK_ROWS % 2 == 1, "meant to end in a partial minibatch"
        _assert_same_activations(ctx, ctx_ref, used, "W=1")
        fused_backend.check(ctx)  # W = 1 has no shared workspace: nothing recorded there
        check_errors(fused_backend.local_workspace(t, h, k, torch.bfloat16, x.device))
        g_ref, g = backend.backward(ctx_ref, dy), fused_backend.backward(ctx, dy)
    for name, a, b in zip(g._fields, g, g_ref):
        assert (a is None and b is None) or torch.equal(a, b), f"grad {name} differs"


@triton.jit
def _task_list_kernel(out_ptr, num_blocks, n1, n2, LAG: tl.constexpr):
    total = num_blocks * (n1 + n2)
    for t in range(total):
        is_gate_up, block, col = ff.task_of(t, num_blocks, n1, n2, LAG)
        tl.store(out_ptr + 3 * t, is_gate_up.to(tl.int32))
        tl.store(out_ptr + 3 * t + 1, block)
        tl.store(out_ptr + 3 * t + 2, col)


@pytest.mark.parametrize("num_blocks", [0, 1, 2, 5])
@pytest.mark.parametrize("lag", [0, 1, 3])
def test_task_list_is_every_tile_once_in_topological_order(num_blocks: int, lag: int) -> None:
    n1, n2 = 3, 2
    out = torch.full((max(1, num_blocks * (n1 + n2)), 3), -1, dtype=torch.int32)
    _task_list_kernel[(1,)](out, num_blocks, n1, n2, LAG=lag)
    tasks = [tuple(r) for r in out[:num_blocks * (n1 + n2)].tolist()]
    expected = {(1, b, c) for b in range(num_blocks) for c in range(n1)} | \
        {(0, b, c) for b in range(num_blocks) for c in range(n2)}
    assert len(tasks) == len(expected) and set(tasks) == expected
    for pos, (is_gate_up, block, _) in enumerate(tasks):
        if not is_gate_up:  # every gate/up tile of the block is earlier in the list
            assert all(tasks.index((1, block, c)) < pos for c in range(n1))


# ------------------------------------------------------------------------------ W = 2

def _ep_problem(seed: int, routing: str):
    world, t, h, i, e_local, k, i_s = 2, 13, 64, 32, 2, 2, 32
    gen = torch.Generator().manual_seed(seed)
    weights = _weights(gen, e_local * world, h, i, i_s)
    ranks = []
    for _ in range(world):
        ids, w = make_routing(t, e_local * world, k, kind=routing, world_size=world,
                              target_rank=world - 1, generator=gen)
        ranks.append((_rnd(gen, t, h), ids, w))
    return (world, t, h, i, e_local, k, i_s), weights, ranks


def _local(weights: ExpertWeights, r: int, e_local: int) -> ExpertWeights:
    sl = slice(r * e_local, (r + 1) * e_local)
    return ExpertWeights(weights.w_gate[sl], weights.w_up[sl], weights.w_down[sl],
                         weights.s_gate, weights.s_up, weights.s_down)


def _ep_forward(cfg, shape, weights, ranks, routed):
    world, t, h, _, e_local, k, _ = shape
    wss = emulated_workspaces(world, t, h, k)
    for ws in wss:  # a slot nobody pushed keeps NaN and shows up in y
        ws.combine_buffer.fill_(float("nan"))
    scheds = lockstep([backend.schedule_steps(ranks[r][1], cfg, wss[r]) for r in range(world)],
                      wss)
    outs = lockstep([backend.forward_steps(ranks[r][0], ranks[r][2], _local(weights, r, e_local),
                                           scheds[r], routed) for r in range(world)], wss)
    for ws in wss:
        check_errors(ws)
    return outs, scheds


@pytest.mark.parametrize("routing", ["uniform", "one-rank"])
@pytest.mark.parametrize("num_comm", [1, 2])
def test_two_ranks_forward_is_bitwise_unfused(routing: str, num_comm: int) -> None:
    shape, weights, ranks = _ep_problem(num_comm, routing)
    _, _, h, i, e_local, k, i_s = shape
    cfg = _config(h, i, e_local * 2, k, i_s, num_comm, minibatch_blocks=num_comm)
    with poisoned_buffers():
        ref, _ = _ep_forward(cfg, shape, weights, ranks, backend.routed_unfused)
        out, scheds = _ep_forward(cfg, shape, weights, ranks, fused_backend.routed_fused)
    for r in range(2):
        assert torch.equal(out[r][0], ref[r][0]), f"rank {r}: y"
        _assert_same_activations(out[r][1], ref[r][1], _used_rows(scheds[r].routed), f"rank {r}")


# ------------------------------------------------------------------------------ watchdog

def _stall(skip_tasks: int) -> str:
    """Run the kernel with the ticket pre-advanced by ``skip_tasks`` (those tasks never signal)."""
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
    ff.fused_forward(ws, sched, weights.w_gate, weights.w_up, weights.w_down, num_comm=2,
                     minibatch_rows=BLOCK_ROWS, budget=STALL_BUDGET, flags=flags)
    with pytest.raises(StallError) as info:
        check_errors(ws)
    check_errors(ws)  # the record was cleared
    return str(info.value)


def test_missing_h_tile_signal_is_reported() -> None:
    message = _stall(skip_tasks=1)  # gate/up tile 0 of block 0 never runs
    assert "stalled in fused forward: h tiles of a row block (index 0)" in message
    assert f"after {STALL_BUDGET} polls" in message


def test_missing_down_tiles_are_reported_by_the_pushes() -> None:
    message = _stall(skip_tasks=1 << 20)  # no compute task runs at all
    assert "stalled in fused forward: down tiles of a minibatch (index 0)" in message
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
