"""Backend "fused" with ``precision="fp8"`` under the interpreter.

Its forward is one fused launch on packed fp8 x rows: ``fp8_gemm``'s gate/up and down tiles as
tasks and one task per row block that quantizes h (1x128 for the down tiles, 128x1 into the
packed rows of h^T the backward reads). Checked: y, every gradient and every saved activation
bitwise backend "triton"'s fp8 layer (poisoned buffers), with the comm kernel and as one
kernel, with minibatches of one and of two row blocks, an expert without rows and experts of
several blocks, a stacked gate/up weight; W = 2, 3 and 8 (lockstep) bitwise one process; the
errors. The pipelined forward (Hopper's default) runs the warp-specialized GEMMs, which the
interpreter cannot: here its pulls alone (the rows and the arrival counters), its choice and
its errors; tests/gpu/test_fused.py runs it whole.
"""

from __future__ import annotations

import pytest
import torch

from megamoe import functional
from megamoe.backends import auto_order, available_backends, fused, resolve_backend
from megamoe.backends import triton as backend
from megamoe.kernels import fp8
from megamoe.kernels.fused import fused_forward
from megamoe.kernels.runtime import poisoned_buffers
from megamoe.types import ExpertWeights
from support.bits import assert_same_grads, assert_same_shared, used_rows
from support.lockstep import ep_against_single_process, ep_step
from support.problems import Case, make_problem, params

FP8 = dict(precision="fp8", ring_rows=None)
# H 144: a partial 128 block along K; T 40: the shared expert's rows are no multiple of 16.
CASE = Case(40, 144, 112, 4, 2, shared=48, block_rows=128)
# 200 tokens over experts 0-2: about 133 rows each (two row blocks), expert 3 without rows
BLOCKS_CASE = Case(200, 128, 64, 4, 2, shared=32, routing="empty_experts", block_rows=128)


def _step(p, backend_name: str, weights: ExpertWeights | None = None):
    """functional.moe forward and backward (the custom ops), every buffer poisoned."""
    x, ids, tw, dy = p.single
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, tw)]
    w = ExpertWeights(
        *(None if t is None else t.detach().requires_grad_(True) for t in weights or p.weights)
    )
    present = leaves + [t for t in w if t is not None]
    with poisoned_buffers():
        y = functional.moe(leaves[0], ids, leaves[1], w, p.config, backend=backend_name)
        grads = torch.autograd.grad(y, present, dy)
    return y.detach(), grads


def _same_routed(ctx, ctx_ref, used: int, hidden: int) -> None:
    """The saved routed rows bitwise, on the used rows: xs (packed fp8), g, u, z, and h^T's
    128x1 quantization (packed rows of h^T: its used columns and their scales; the unfused
    pass also quantizes the unused rows past the last block, which nothing reads)."""
    for name in ("xs", "g", "u", "z"):
        a, b = getattr(ctx.routed, name), getattr(ctx_ref.routed, name)
        assert torch.equal(a[:used], b[:used]), f"{name} differs"
    rows = ctx_ref.routed.xs.shape[0]
    (q, s), (q_ref, s_ref) = (fp8.unpack_rows(c.routed.h, rows) for c in (ctx, ctx_ref))
    assert torch.equal(q[:, :used].view(torch.uint8), q_ref[:, :used].view(torch.uint8)), "h^T"
    assert torch.equal(s[:, : used // 128], s_ref[:, : used // 128]), "h^T scales"


@pytest.mark.parametrize(
    "case,tunables",
    [
        (CASE, dict(minibatch_rows=128)),  # one kernel (fp8's default)
        (CASE, dict(minibatch_rows=128, comm_kernel=True)),
        (BLOCKS_CASE, dict(minibatch_rows=256, comm_kernel=True)),
        (BLOCKS_CASE, dict(minibatch_rows=128, comm_programs=1, down_lag=0)),
    ],
    ids=["one-kernel", "comm-kernel", "blocks-comm-kernel", "blocks-one-kernel"],
)
def test_fused_fp8_forward_is_bitwise_triton(case: Case, tunables: dict) -> None:
    """y and the saved activations bitwise backend "triton"'s; through the custom ops with
    the backward (backend "triton"'s on them) once, for the default forward (the stacked
    weight's test and the expert-parallel ones run it too)."""
    p = make_problem(case, seed=3, **FP8, **tunables)
    x, ids, tw, _ = p.single
    if case is BLOCKS_CASE:
        assert (ids == 3).sum() == 0 and max((ids == e).sum() for e in range(3)) > 128
    with poisoned_buffers():
        sched = backend.build_schedule(ids, p.config, None)
        y_ref, ctx_ref = backend.forward(x, ids, tw, p.weights, p.config, None, sched)
        y, ctx = fused.forward(x, ids, tw, p.weights, p.config, None, sched)
    assert torch.isfinite(y_ref).all()
    assert torch.equal(y, y_ref)
    _same_routed(ctx, ctx_ref, used_rows(sched.routed), case.hidden)
    assert_same_shared(ctx, ctx_ref, "W=1")
    if tunables.get("comm_kernel") is None and case is CASE:  # (the backward: once here)
        y_ref, g_ref = _step(p, "triton")
        y, g = _step(p, "fused")
        assert torch.equal(y, y_ref)
        assert all(torch.isfinite(t).all() for t in g_ref)
        assert all(torch.equal(a, b) for a, b in zip(g, g_ref))


def test_fused_fp8_with_a_stacked_gate_up_weight() -> None:
    p = make_problem(CASE, seed=4, minibatch_rows=128, **FP8)
    y_ref, g_ref = _step(p, "triton")
    w = p.weights
    y, g = _step(p, "fused", ExpertWeights.from_gate_up(torch.cat([w.w_gate, w.w_up], 1), *w[2:]))
    assert torch.equal(y, y_ref)
    i = CASE.intermediate
    assert torch.equal(g[2][:, :i], g_ref[2]) and torch.equal(g[2][:, i:], g_ref[3])
    for a, b in zip((*g[:2], *g[3:]), (*g_ref[:2], *g_ref[4:])):  # the rest
        assert torch.equal(a, b)


EP_CASES = [
    Case(20, 128, 64, 4, 2, shared=32, world=2, block_rows=128),
    Case(12, 128, 48, 6, 2, world=3, block_rows=128),
    Case(4, 128, 32, 8, 2, routing="zipf", world=8, block_rows=128),  # one expert per rank
]


@pytest.mark.parametrize("case", params(*EP_CASES))
def test_expert_parallel_fused_fp8_is_bitwise_single_process(case: Case) -> None:
    """Every rank's y and gradients bitwise those of one process (backend "triton" on the global
    batch; the shared expert's weight gradients are per-rank partial sums), the fused forward
    pulling packed fp8 rows from the peers; and every gradient and saved shared activation
    bitwise backend "triton"'s at this W."""
    p = make_problem(case, seed=len(EP_CASES) + case.world, minibatch_rows=128, **FP8)
    with poisoned_buffers():
        out, _ = ep_against_single_process(p, backend="fused")
        ref, _, _ = ep_step(p)
    for r, ((_, ctx, g), (_, ctx_ref, g_ref)) in enumerate(zip(out, ref)):
        assert_same_grads(g, g_ref, f"rank {r} (the unfused forward at this W)")
        assert_same_shared(ctx, ctx_ref, f"rank {r}")


def test_fp8_errors() -> None:
    p = make_problem(CASE, seed=0, minibatch_rows=128, **FP8)
    x, ids, tw, _ = p.single
    bounded = p.config.replace(ring_rows=128)
    with pytest.raises(ValueError, match="precision 'fp8' needs a ring that holds every row"):
        fused.forward(x, ids, tw, p.weights, bounded, None, None)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(fused.FUSED_BACKWARD_ENV, "1")
        with pytest.raises(ValueError, match="MEGAMOE_FUSED_BACKWARD=1 selects the fused"):
            fused.forward(x, ids, tw, p.weights, p.config, None, None)
    # the kernel's launcher: every weight's forward copy, the shared expert's too
    from megamoe.backends import fp8_weights, steps

    sched = backend.build_schedule(ids, p.config, None)
    run = steps.single_rank(sched, ids)
    w8 = fp8_weights.step_weights(p.weights)
    packed = fp8.quantize_packed(x)
    shared = (packed, p.weights.s_gate, p.weights.s_up, p.weights.s_down)
    args = (run.ep.workspace, run.routed, *p.weights[:3], None, 128)
    with pytest.raises(ValueError, match=r"fp8_weights must hold 6 Fp8Weight"):
        fused_forward(*args, shared=shared, fp8_weights=w8[:3])
    with pytest.raises(ValueError, match=r"shared x must be a contiguous \[40, \d+\] torch.int16"):
        fused_forward(*args, shared=(x, *shared[1:]), fp8_weights=w8)
    # fp8 resolves the comm kernel to off (its compute programs fit beside it only capped)
    assert not fused.uses_comm_kernel(p.config.replace(comm_kernel=None), 1)
    assert fused.uses_comm_kernel(p.config.replace(precision="bf16", comm_kernel=None), 1)
    # every backend runs fp8; backend "auto" takes backend "triton" first in fp8, at every W
    cpu = torch.device("cpu")
    assert resolve_backend("fused", cpu, 1, p.config, torch.bfloat16) == "fused"
    assert "precision" not in available_backends(cpu, config=p.config)["fused"][1]  # (no GPU)
    assert auto_order(1, p.config, 1 << 20)[0] == "triton"
    assert auto_order(2, p.config)[0] == "triton"


def test_a_missing_gate_up_tile_is_reported_by_the_h_task() -> None:
    """A gate/up tile that never signals (the ticket starts past it): the block's h task and
    down tiles give up after the budget, and the host raises a StallError naming the wait."""
    from megamoe.backends import fp8_weights, steps
    from megamoe.ep.workspace import check_errors, packed_x_buffer
    from megamoe.errors import StallError

    p = make_problem(CASE, seed=2, minibatch_rows=128, **FP8)
    x, ids, _, _ = p.single
    run = steps.single_rank(backend.build_schedule(ids, p.config, None), ids)
    ws = run.ep.workspace
    fp8.quantize_packed(x, out=packed_x_buffer(ws, fp8.packed_width(CASE.hidden)))
    flags = torch.zeros(4096, dtype=torch.int32)
    flags[0] = 1  # (the ticket: task 0, gate/up tile 0 of block 0, is never taken)
    w8 = fp8_weights.step_weights(p.weights)
    fused_forward(
        ws, run.routed, *p.weights[:3], 1, 128, budget=1 << 12, flags=flags, fp8_weights=w8
    )
    with pytest.raises(StallError, match=r"h tiles of a row block \(index 0\)"):
        check_errors(ws)


@pytest.mark.parametrize(
    "case,minibatch,num_comm",
    [(CASE, 128, None), (BLOCKS_CASE, 128, 2), (BLOCKS_CASE, 256, 1)],
    ids=["derived", "two-programs", "one-program-two-blocks"],
)
def test_pipelined_pulls_copy_every_row_and_complete_each_counter(
    case: Case, minibatch: int, num_comm: int | None
) -> None:
    """``start_pulls``, the pipelined fp8 forward's pulls (beside the warp-specialized GEMMs
    on Hopper; here the interpreter runs them alone): the pulled packed rows bitwise the
    gathered ones on the used rows, each used minibatch's arrival counter at the comm programs'
    count (what the gate/up kernel's producer waits for), the others untouched, and the GEMMs
    left the SMs the pulls do not take."""
    from megamoe.backends import steps
    from megamoe.ep.workspace import packed_x_buffer
    from megamoe.kernels import rows
    from megamoe.kernels.fused.forward import start_pulls
    from megamoe.kernels.runtime import persistent_programs

    p = make_problem(case, seed=7, minibatch_rows=minibatch, **FP8)
    x, ids, _, _ = p.single
    sched = backend.build_schedule(ids, p.config, None).routed
    run = steps.single_rank(backend.build_schedule(ids, p.config, None), ids)
    ws = run.ep.workspace
    packed = fp8.quantize_packed(x)
    packed_x_buffer(ws, fp8.packed_width(case.hidden)).copy_(packed)  # (as publish_packed)
    with poisoned_buffers():
        pulls = start_pulls(ws, run.routed, case.intermediate, num_comm, minibatch)
    pulls.join()
    used = used_rows(sched)
    assert torch.equal(pulls.rows[:used], rows.gather(packed, sched)[:used])
    arrivals, n_mb = pulls.arrivals, -(-used // minibatch)
    assert arrivals.rows == minibatch and arrivals.wanted == (num_comm or arrivals.wanted) >= 1
    counters = arrivals.counters[: -(-run.routed.rows // minibatch)]
    assert (counters[:n_mb] == arrivals.wanted).all() and (counters[n_mb:] == 0).all()
    assert pulls.programs == persistent_programs(x.device) - arrivals.wanted >= 1


@pytest.mark.parametrize(
    "minibatch, push_programs",
    [(128, None), (256, 1), (256, 2)],
    ids=["one-block-derived", "two-blocks-one-program", "two-blocks-two-programs"],
)
def test_pipelined_push_fills_the_slots_once_down_counted_its_tiles(
    minibatch: int, push_programs: int | None
) -> None:
    """``Pulls.push``, the pipelined fp8 forward's push of z (on Hopper beside the down GEMM,
    which counts its stored tiles into ``Pulls.stored``; here the interpreter runs it after
    the counters are complete, as down leaves them) on ``push_programs`` programs, down left
    the other SMs: the combine slots bitwise what ``comm.combine_push`` puts there. A
    minibatch one signal short stalls its push: a StallError names the down tiles and the
    minibatch, the minibatches before it are still pushed, and a bad z, signal count or push
    program count is refused by name."""
    from megamoe.backends import steps
    from megamoe.ep.workspace import check_errors
    from megamoe.errors import StallError
    from megamoe.kernels import comm, fp8_ws
    from megamoe.kernels.fused.forward import start_pulls
    from megamoe.kernels.fused.plan import push_programs_for
    from megamoe.kernels.runtime import persistent_programs

    case = BLOCKS_CASE
    p = make_problem(case, seed=8, minibatch_rows=minibatch, **FP8)
    x, ids, _, _ = p.single
    run = steps.single_rank(backend.build_schedule(ids, p.config, None), ids)
    ws, sched = run.ep.workspace, run.routed
    gen = torch.Generator().manual_seed(3)
    z = torch.randn(sched.rows, case.hidden, generator=gen).bfloat16()
    comm.combine_push(ws, z, sched, "combine")
    expected = ws.combine_buffer.clone()
    signals = fp8_ws.stored_signals(sched.block_rows, case.hidden, 256)
    blocks = int(sched.num_blocks)
    per_mb = minibatch // sched.block_rows
    n_mb = -(-blocks // per_mb)
    programs = persistent_programs(x.device)
    with pytest.raises(ValueError, match=rf"push_programs \({programs}\) comm programs must"):
        start_pulls(ws, sched, case.intermediate, 1, minibatch, push_programs=programs)
    for short in (None, n_mb - 1):
        ws.combine_buffer.fill_(float("nan"))
        pulls = start_pulls(
            ws, sched, case.intermediate, 1, minibatch, budget=64, push_programs=push_programs
        )
        assert pulls.stored.rows == minibatch
        pushes = push_programs or push_programs_for(programs, case.intermediate)
        assert pulls.push_programs == pushes and pulls.down_programs == programs - pushes >= 1
        for m in range(n_mb):
            pulls.stored.counters[m] = min(per_mb, blocks - m * per_mb) * signals
        if short is not None:
            pulls.stored.counters[short] -= 1
        with pytest.raises(ValueError, match=r"z must be bf16 \["):
            pulls.push(z.float(), signals)
        with pytest.raises(ValueError, match="signals must be an int >= 1"):
            pulls.push(z, 0)
        pulls.push(z, signals)
        pulls.join()
        if short is None:
            assert torch.equal(ws.combine_buffer, expected)
            continue
        with pytest.raises(StallError, match=f"down tiles.*{short}"):
            check_errors(ws)
        slots = sched.row_src[: short * minibatch].long()  # (the minibatches before it)
        slots = slots[slots >= 0]
        assert slots.numel() and torch.equal(ws.combine_buffer[slots], expected[slots])


def test_pipelined_forward_choice_and_errors(monkeypatch) -> None:
    """Where it runs (fp8, ``comm_kernel`` None, a ring of every row, ``MEGAMOE_PIPELINED_FP8``
    not "0", the warp-specialized gate/up GEMM: Hopper; here forced): the pipelined forward at
    W > 1 and on a one-rank workspace, backend triton's forward with one process; both refuse
    a trace by name. The Triton gate/up kernel refuses rows that arrive while it runs; bad
    arrival counters are named."""
    from megamoe.backends import fp8_weights, steps
    from megamoe.kernels import fp8_gemm, fp8_ws
    from megamoe.kernels.fused import new_trace

    p = make_problem(CASE, seed=1, minibatch_rows=128, **FP8)
    x, ids, tw, _ = p.single
    cpu = torch.device("cpu")
    assert fused.forward_kind(p.config, cpu) == "one_kernel"  # (no Hopper GPU here)
    assert fused.forward_kind(p.config.replace(comm_kernel=True), cpu) == "comm_kernel"
    sched = backend.build_schedule(ids, p.config, None)
    w8 = fp8_weights.step_weights(p.weights)
    xq, xs = fp8.quantize_rows(torch.zeros(sched.routed.rows, CASE.hidden, dtype=torch.bfloat16))
    counters = torch.zeros(8, dtype=torch.int32)
    arrivals = fp8_ws.RowArrivals(counters, 128, 1, counters, 0, 16)
    with pytest.raises(ValueError, match="arrivals: only the warp-specialized gate/up kernel"):
        fp8_gemm.gate_up_quantized(xq, xs, w8.gate, w8.up, sched.routed, None, arrivals)
    with pytest.raises(ValueError, match="arrivals.rows must be a positive multiple of the"):
        fp8_ws._arrival_args(arrivals._replace(rows=64), counters)
    with pytest.raises(ValueError, match="arrivals.counters and arrivals.errors must be int32"):
        fp8_ws._arrival_args(arrivals._replace(counters=counters.long()), counters)
    assert fp8_ws._arrival_args(arrivals, counters) == ((counters, 1, counters, 0, 16), 128)
    stored = fp8_ws.StoredTiles(counters, 64)  # (the down GEMM's counters of stored tiles)
    with pytest.raises(ValueError, match="stored.rows must be a positive multiple of the"):
        fp8_ws._stored_args(stored, sched.routed, counters)
    with pytest.raises(ValueError, match=r"stored.counters must be int32 with >= \d+ counters"):
        fp8_ws._stored_args(stored._replace(rows=128, counters=counters[:0]), sched.routed, xq)
    assert fp8_ws._stored_args(stored._replace(rows=128), sched.routed, xq) == (counters, 128)
    hq, hs = fp8.quantize_rows(torch.zeros(sched.routed.rows, CASE.intermediate).bfloat16())
    with pytest.raises(ValueError, match="stored: only the warp-specialized kernel"):
        fp8_gemm.grouped_mm(hq, hs, w8.down, sched.routed, stored=stored._replace(rows=128))
    monkeypatch.setattr(fp8_gemm, "warp_specialized", lambda kind, device, rows: True)
    monkeypatch.delenv(fused.PIPELINED_FP8_ENV, raising=False)
    assert fused.forward_kind(p.config, cpu) == "unfused"
    assert fused.forward_kind(p.config, cpu, 2) == "pipelined"
    assert fused.forward_kind(p.config.replace(comm_kernel=False), cpu, 2) == "one_kernel"
    assert fused.forward_kind(p.config.replace(ring_rows=128), cpu, 2) == "one_kernel"
    monkeypatch.setenv(fused.PIPELINED_FP8_ENV, "0")
    assert fused.forward_kind(p.config, cpu, 2) == "one_kernel"
    monkeypatch.setenv(fused.PIPELINED_FP8_ENV, "2")
    with pytest.raises(ValueError, match="MEGAMOE_PIPELINED_FP8 must be 0 or 1, got '2'"):
        fused.forward_kind(p.config, cpu)
    monkeypatch.setenv(fused.PIPELINED_FP8_ENV, "1")
    trace = new_trace(cpu, 8)
    with pytest.raises(ValueError, match="the one-process fp8 forward runs no fused kernel"):
        fused.forward(x, ids, tw, p.weights, p.config, None, sched, trace=trace)
    run = steps.single_rank(sched, ids)
    with pytest.raises(ValueError, match="the pipelined fp8 forward runs no fused kernel"):
        steps.run_steps(fused.forward_steps(x, tw, p.weights, run, trace), run.ep.workspace)
