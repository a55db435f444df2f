"""Backend "fused"'s backward under the CPU interpreter: the fused backward kernel against
backend "triton"'s unfused backward, at W = 1 and at W = 2, 3 and 8 emulated in one process
(every rank's protocol steps in lockstep, ``support.lockstep``).

The kernel runs one program that takes the whole task list in order (at W > 1: after it pulled
dy for every comm role, before it pushes d_x for every comm role); its waits still check every
counter. Checked: d_x, d topk_weights and every weight gradient bitwise equal to backend
"triton" at the same W (poisoned buffers and d_x / d_w slots: an output the kernel forgot to
write stays NaN) and, at W > 1, the routed ones equal to W = 1 on the same global batch; zipf
routing, experts and whole ranks without rows, with and without a shared expert, stacked
gate/up weights, T and I not multiples of the tiles, a bounded ring (W = 1: one replay and
launch per macrobatch, test_fused_backward_macrobatch.py; W > 1: the replay, then the fused
kernel), a capacity overflow (NaN and the CapacityError, as "triton"), and every tunable of the
kernel (task-list group, lag, SwiGLU epilogue pieces, grid, comm programs); the weight
gradients leave out the padding rows past an expert's last K step (as the unfused kernel), their
waits still counting every row block; the task list holds
every tile once in topological order; a missing signal ends in a StallError naming the stage;
MEGAMOE_FUSED_BACKWARD unset or 0 keeps backend "triton"'s backward at every W.
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
import triton
import triton.language as tl

from megamoe.backends import experts, steps
from megamoe.backends import fused as fused_backend
from megamoe.backends import triton as backend
from megamoe.ep.workspace import check_errors, emulated_workspaces, local_workspace
from megamoe.errors import CapacityError, StallError, stage_name
from megamoe.kernels import fused as ff
from megamoe.kernels import rows
from megamoe.kernels.fused.backward import BACKWARD_STAGE_CODES
from megamoe.kernels.fused.tasks import backward_counts, grouped_task, wgrad_task
from megamoe.kernels.runtime import poisoned_buffers
from megamoe.types import ExpertWeights
from support.bits import assert_same_grads, used_rows
from support.lockstep import ep_step, lockstep
from support.problems import Case, make_problem, stacked_gate_up

# Tiny spin budget of the watchdog tests: the missing signal never comes, so fail fast.
STALL_BUDGET = 64


@pytest.fixture(autouse=True)
def fused_backward_on(monkeypatch) -> None:
    """The fused backward is opt-in (MEGAMOE_FUSED_BACKWARD=1) until measured on a GPU."""
    monkeypatch.setenv(fused_backend.FUSED_BACKWARD_ENV, "1")


@pytest.fixture
def fused_launches(monkeypatch) -> list:
    """Counts the backend's fused backward launches (so a test knows which backward ran)."""
    calls = []
    launch = fused_backend.fused_backward

    def counted(*args, **kwargs):
        calls.append(kwargs)
        return launch(*args, **kwargs)

    monkeypatch.setattr(fused_backend, "fused_backward", counted)
    return calls


def _train_step(p, weights: ExpertWeights, name: str):
    """Schedule, forward and backward of one backend (poisoned buffers): (y, ctx, grads)."""
    mod = fused_backend if name == "fused" else backend
    x, ids, w, dy = p.single
    with poisoned_buffers():
        sched = mod.build_schedule(ids, p.config, None)
        y, ctx = mod.forward(x, ids, w, weights, p.config, None, sched)
        grads = mod.backward(ctx, dy)
    return y, ctx, grads


# ------------------------------------------------------------------------------ the backend

# (case, task-list group in row blocks (config.minibatch_rows), ring in row blocks (None: every
# row), stacked gate/up). T = 29 / 37 / 45: a partial last row block; I = 40 / 48: a partial
# column tile; zipf: skewed; empty_experts: only the first top_k + 1 experts get rows.
BACKEND_CASES = [
    (Case(29, 64, 40, 4, 2, shared=24, routing="zipf"), 1, None, False),
    (Case(29, 64, 40, 4, 2, routing="zipf"), 3, None, False),
    (Case(37, 64, 40, 8, 2, shared=32, routing="empty_experts"), 2, None, False),
    (Case(29, 64, 40, 4, 2, shared=24, routing="zipf"), 2, None, True),
    (Case(29, 64, 40, 4, 2, shared=16, routing="zipf"), 1, 2, False),
    (Case(45, 64, 48, 4, 3, shared=24, routing="zipf", block_rows=32), 1, None, False),
]


@pytest.mark.parametrize("case,group_blocks,ring_blocks,stacked", BACKEND_CASES)
def test_backward_is_bitwise_triton(
    case: Case, group_blocks: int, ring_blocks: int | None, stacked: bool, fused_launches
) -> None:
    bm = case.block_rows
    ring = (ring_blocks or 1024) * group_blocks * bm
    p = make_problem(case, 3, minibatch_rows=group_blocks * bm, ring_rows=ring)
    weights = stacked_gate_up(p.weights) if stacked else p.weights
    assert fused_backend.backward_kind() == "fused"
    y_ref, ctx_ref, g_ref = _train_step(p, weights, "triton")
    y, ctx, g = _train_step(p, weights, "fused")
    sched = ctx_ref.schedule.routed
    # one launch, or with a bounded ring one per macrobatch (window of ring rows) of the layout
    windows = 1 if ring_blocks is None else -(-sched.rows // p.config.ring_rows)
    assert len(fused_launches) == windows, "the fused backward kernel must have run"
    assert torch.equal(y, y_ref)
    if case.routing == "empty_experts":
        assert (sched.counts == 0).any(), "meant to have experts without rows"
    if ring_blocks is not None:
        assert ctx.routed is None and used_rows(sched) > p.config.ring_rows, "meant to replay"
    assert_same_grads(g, g_ref, case.id)
    if stacked:  # the stacked gradient is one tensor, written in place
        assert g.w_gate.data_ptr() + case.intermediate * case.hidden * 2 == g.w_up.data_ptr()
    check_errors(local_workspace(case.tokens, case.hidden, case.top_k, torch.bfloat16, y.device))


def test_switch_picks_the_backward_at_every_world_size(monkeypatch, fused_launches) -> None:
    """MEGAMOE_FUSED_BACKWARD=0 (and unset: the default) runs backend "triton"'s backward
    (steps.backward) at every W, 1 the fused one (W > 1: fused.backward_steps); another value
    is refused by name."""
    p = make_problem(Case(29, 64, 40, 4, 2, shared=24, routing="zipf"), 4)
    assert fused_backend.backward_kind(1) == fused_backend.backward_kind(2) == "fused"
    _, _, g_ref = _train_step(p, p.weights, "triton")
    for value in ("0", None):
        if value is None:
            monkeypatch.delenv(fused_backend.FUSED_BACKWARD_ENV)
        else:
            monkeypatch.setenv(fused_backend.FUSED_BACKWARD_ENV, value)
        assert fused_backend.backward_kind(1) == fused_backend.backward_kind(8) == "triton"
        _, ctx, g = _train_step(p, p.weights, "fused")
        assert not fused_launches
        assert_same_grads(g, g_ref, f"switched off ({value})")
    monkeypatch.setenv(fused_backend.FUSED_BACKWARD_ENV, "yes")
    with pytest.raises(ValueError, match="MEGAMOE_FUSED_BACKWARD must be 0 or 1, got 'yes'"):
        fused_backend.backward_kind()
    # an expert-parallel context runs fused.backward_steps on its workspace (switched on) or
    # steps.backward (off)
    ep = types.SimpleNamespace(workspace=object())
    ep_ctx = dataclasses.replace(ctx, schedule=dataclasses.replace(ctx.schedule, ep=ep))
    monkeypatch.setattr(steps, "run_steps", lambda protocol, ws: protocol)
    monkeypatch.setattr(fused_backend.checks, "eager_check", lambda ws: None)
    monkeypatch.setattr(fused_backend.steps, "backward", lambda c, dy: "triton's")
    monkeypatch.setenv(fused_backend.FUSED_BACKWARD_ENV, "1")
    protocol = fused_backend.backward(ep_ctx, p.grad_y)
    assert protocol.gi_code is fused_backend.backward_steps.__code__
    protocol.close()
    monkeypatch.setenv(fused_backend.FUSED_BACKWARD_ENV, "0")
    assert fused_backend.backward(ep_ctx, p.grad_y) == "triton's"


# ------------------------------------------------------------------------------ W > 1

# (case, task-list group = pulled minibatch in row blocks, ring in row blocks (None: every
# row)). "one-rank": every token to the last rank, the other ranks have no rows at all (no
# pulls, no pushes, zero weight gradients); zipf: experts without rows; T = 13 / 9: a partial
# row block; I = 40: a partial column tile.
EP_CASES = [
    (Case(13, 64, 40, 4, 2, shared=32, routing="zipf", world=2), 1, None),
    (Case(13, 64, 32, 4, 2, routing="one-rank", world=2), 2, 1),
    (Case(6, 64, 32, 6, 2, shared=24, routing="zipf", world=3), 1, None),
    (Case(3, 32, 32, 8, 2, routing="zipf", world=8), 1, None),
]
# Eight ranks: against one process only (no shared expert, so that is every gradient), to keep
# the interpreter's time down.
ONE_PROCESS_ONLY = 8

_REFERENCES: dict = {}


def _ep_problem(case: Case, group_blocks: int, ring_blocks: int | None, **config):
    bm = case.block_rows
    ring = (ring_blocks or 1024) * group_blocks * bm
    return make_problem(case, 5, minibatch_rows=group_blocks * bm, ring_rows=ring, **config)


def _reference(p) -> tuple:
    """Backend "triton"'s training step of every rank (poisoned buffers): (outputs per rank,
    schedules, workspaces), once per problem ("triton" reads none of the fused tunables)."""
    key = (p.case, p.config)
    if key not in _REFERENCES:
        with poisoned_buffers():
            _REFERENCES[key] = ep_step(p)
    return _REFERENCES[key]


def _triton_forward(p) -> tuple:
    """(schedules, contexts, workspaces) of backend "triton"'s forward of every rank."""
    wss = emulated_workspaces(p.case.world, p.case.tokens, p.case.hidden, p.case.top_k)
    with poisoned_buffers():
        scheds = lockstep(
            [steps.schedule_steps(r.topk_ids, p.config, ws) for r, ws in zip(p.ranks, wss)], wss
        )
        outs = lockstep(
            [
                steps.forward_steps(r.x, r.topk_weights, p.local_weights(i), s)
                for i, (r, s) in enumerate(zip(p.ranks, scheds))
            ],
            wss,
        )
    return scheds, [ctx for _, ctx in outs], wss


def _fused_backward(p, ctxs: list, wss: list) -> list:
    """Backend "fused"'s backward of every rank in lockstep (poisoned buffers; the d_x and d_w
    slots poisoned first: a slot nobody pushed stays NaN)."""
    for ws in wss:
        ws.dx_slots.fill_(float("nan"))
        ws.dw_slots.fill_(float("nan"))
    with poisoned_buffers():
        grads = lockstep(
            [fused_backend.backward_steps(c, r.grad_y) for c, r in zip(ctxs, p.ranks)], wss
        )
    for ws in wss:
        check_errors(ws)
    return grads


def _assert_like_one_process(p, grads: list) -> None:
    """The routed gradients of every rank equal one process's on the global batch (the shared
    expert's weight gradients are per-rank partial sums there)."""
    with poisoned_buffers():
        _, _, g1 = _train_step(p, p.weights, "triton")
    t, e_local = p.case.tokens, p.case.local_experts
    for r, g in enumerate(grads):
        tok, ex = slice(r * t, (r + 1) * t), slice(r * e_local, (r + 1) * e_local)
        assert torch.equal(g.x, g1.x[tok]), f"rank {r}: d_x"
        assert torch.equal(g.topk_weights, g1.topk_weights[tok]), f"rank {r}: d_w"
        for name in ("w_gate", "w_up", "w_down"):
            assert torch.equal(getattr(g, name), getattr(g1, name)[ex]), f"rank {r}: {name}"


@pytest.mark.parametrize(
    "case,group_blocks,ring_blocks", EP_CASES, ids=lambda v: getattr(v, "id", v)
)
def test_ep_backward_is_bitwise_triton_and_one_process(
    case: Case, group_blocks: int, ring_blocks: int | None
) -> None:
    p = _ep_problem(case, group_blocks, ring_blocks)
    if case.world == ONE_PROCESS_ONLY:
        ref, (scheds, ctxs, wss) = None, _triton_forward(p)
    else:
        ref, scheds, wss = _reference(p)
        ctxs = [ctx for _, ctx, _ in ref]
    if ring_blocks is not None:  # the fused forward drops the routed rows: the backward replays
        with poisoned_buffers():
            outs = lockstep(
                [
                    fused_backend.forward_steps(r.x, r.topk_weights, p.local_weights(i), s)
                    for i, (r, s) in enumerate(zip(p.ranks, scheds))
                ],
                wss,
            )
        ctxs = [ctx for _, ctx in outs]
        assert all(c.routed is None for c in ctxs), "meant to replay"
    blocks = [int(s.routed.num_blocks) for s in scheds]
    if case.routing == "one-rank":
        assert blocks[:-1] == [0] * (case.world - 1) and blocks[-1] > 1, blocks
    grads = _fused_backward(p, ctxs, wss)
    for r in range(case.world if ref is not None else 0):
        assert_same_grads(grads[r], ref[r][2], f"rank {r} of {case.world}")
    _assert_like_one_process(p, grads)


# (task-list group in row blocks, lag, SwiGLU epilogue pieces, comm programs, grid)
EP_TUNABLES = [(2, 0, 1, 1, None), (3, None, 2, 3, 2)]


def test_every_ep_tunable_gives_the_same_bits(monkeypatch) -> None:
    p = _ep_problem(*EP_CASES[0])
    ref, _, wss = _reference(p)
    launch = fused_backend.fused_backward_ep
    for group_blocks, lag, split, num_comm, programs in EP_TUNABLES:
        tunables = dict(
            group_rows=group_blocks * p.case.block_rows,
            lag=lag,
            swiglu_split=split,
            num_comm=num_comm,
            programs=programs,
        )
        monkeypatch.setattr(
            fused_backend, "fused_backward_ep", lambda *a, **k: launch(*a, **{**k, **tunables})
        )
        grads = _fused_backward(p, [ctx for _, ctx, _ in ref], wss)
        for r in range(p.case.world):
            assert_same_grads(grads[r], ref[r][2], f"rank {r}, {tunables}")


def test_ep_capacity_overflow_gives_nan_like_triton() -> None:
    """An overflowed schedule computes no routed rows: d_x and d topk_weights NaN on every rank
    (nobody pushed), the weight gradients "triton"'s, a CapacityError at the check."""
    case = Case(13, 64, 32, 4, 2, shared=32, routing="one-rank", world=2)
    p = _ep_problem(case, 1, None, capacity_factor=1.25)
    ref, scheds, wss = _reference(p)
    grads = _fused_backward(p, [ctx for _, ctx, _ in ref], wss)
    for r in range(case.world):
        assert scheds[r].invalid.tolist() == [1]
        assert grads[r].x.isnan().all() and grads[r].topk_weights.isnan().all(), f"rank {r}"
        for name in ("w_gate", "w_up", "w_down", "s_gate", "s_up", "s_down"):
            assert torch.equal(getattr(grads[r], name), getattr(ref[r][2], name)), name
        with pytest.raises(CapacityError):
            backend.check(scheds[r])


# ------------------------------------------------------------------------------ tunables


def _unfused_parts(p, weights: ExpertWeights):
    """(ctx, dz, the unfused expert GEMMs' outputs by name) of one problem."""
    _, ctx, _ = _train_step(p, weights, "triton")
    dy = p.grad_y
    with poisoned_buffers():
        dz, _ = rows.route_grad(dy, ctx.routed.z, ctx.slot_weights, ctx.schedule.routed)
        dgrad = experts.routed_dgrad(dz, ctx)
        d_gate, d_up, d_down = experts.routed_wgrad(dgrad, ctx)
        shared = experts.shared_dgrad(dy, ctx)
        d_s = experts.shared_wgrad(shared, ctx)
    ref = dict(dxs=dgrad.dx, d_w_gate=d_gate, d_w_up=d_up, d_w_down=d_down)
    if shared is not None:
        ref.update(dx_shared=shared[0].dx, d_s_gate=d_s[0], d_s_up=d_s[1], d_s_down=d_s[2])
    return ctx, dz, ref


# (group in row blocks, lag, SwiGLU epilogue pieces, programs (None: the derived grid))
TUNABLES = [(1, 0, 4, None), (2, 1, 2, None), (3, None, 1, None), (1, 5, 1, 2), (2, None, 4, 3)]


def test_every_tunable_gives_the_same_bits() -> None:
    case = Case(37, 64, 40, 4, 2, shared=24, routing="zipf")
    p = make_problem(case, 9)
    ctx, dz, ref = _unfused_parts(p, p.weights)
    sched, r, w = ctx.schedule.routed, ctx.routed, ctx.weights
    used = used_rows(sched)
    shared = ff.SharedBackwardInputs(p.grad_y, ctx.x, ctx.shared, w.s_gate, w.s_up, w.s_down)
    ws = local_workspace(case.tokens, case.hidden, case.top_k, torch.bfloat16, dz.device)
    for group_blocks, lag, split, programs in TUNABLES:
        what = f"group {group_blocks}, lag {lag}, split {split}, programs {programs}"
        with poisoned_buffers():
            out = ff.fused_backward(
                ws,
                sched,
                dz,
                r.xs,
                r.g,
                r.u,
                r.h,
                w.w_gate,
                w.w_up,
                w.w_down,
                group_rows=group_blocks * case.block_rows,
                shared=shared,
                lag=lag,
                programs=programs,
                swiglu_split=split,
            )
        check_errors(ws)
        for name, expected in ref.items():
            got = getattr(out, name)
            if name == "dxs":
                got, expected = got[:used], expected[:used]
            assert torch.equal(got, expected), f"{what}: {name} differs"


def test_weight_gradients_skip_the_padding_past_the_last_k_step() -> None:
    """A weight-gradient tile sums an expert's rows up to its last real row rounded up to the K
    step (``gemm.expert_row_range``, as the unfused kernel), and its wait still counts every row
    block: with NaN in every routed input row past that step, the weight gradients keep the
    clean inputs' bits (no wait gives up)."""
    case = Case(50, 64, 48, 4, 2, shared=24, routing="zipf", block_rows=64)  # K step 32
    p = make_problem(case, 23)
    ctx, dz, ref = _unfused_parts(p, p.weights)
    sched, r, w = ctx.schedule.routed, ctx.routed, ctx.weights
    bk = 32
    begin, end = sched.row_start[:-1], sched.row_start[1:]
    summed_end = begin + (sched.counts + bk - 1) // bk * bk
    past = torch.zeros(dz.shape[0], dtype=torch.bool)
    for lo, hi in zip(summed_end.tolist(), end.tolist()):
        past[lo:hi] = True
    assert (end - summed_end >= bk).any(), "the case must skip a whole K step of padding"
    assert (sched.row_src[past] < 0).all()
    poisoned = [t.clone() for t in (dz, r.xs, r.g, r.u, r.h)]
    for t in poisoned:
        t[past] = float("nan")
    shared = ff.SharedBackwardInputs(p.grad_y, ctx.x, ctx.shared, w.s_gate, w.s_up, w.s_down)
    ws = local_workspace(case.tokens, case.hidden, case.top_k, torch.bfloat16, dz.device)
    with poisoned_buffers():
        out = ff.fused_backward(
            ws,
            sched,
            *poisoned,
            w.w_gate,
            w.w_up,
            w.w_down,
            group_rows=case.block_rows,
            shared=shared,
        )
    check_errors(ws)
    for name in ("d_w_gate", "d_w_up", "d_w_down", "d_s_gate", "d_s_up", "d_s_down"):
        assert torch.equal(getattr(out, name), ref[name]), name
    real = sched.row_src >= 0
    assert torch.equal(out.dxs[real], ref["dxs"][real])


def test_bad_arguments_are_refused() -> None:
    p = make_problem(Case(29, 64, 40, 4, 2), 2)
    ctx, dz, _ = _unfused_parts(p, p.weights)
    sched, r, w = ctx.schedule.routed, ctx.routed, ctx.weights
    ws = local_workspace(29, 64, 2, torch.bfloat16, dz.device)
    args = (ws, sched, dz, r.xs, r.g, r.u, r.h, w.w_gate, w.w_up, w.w_down)
    for kwargs, match in (
        (dict(group_rows=24), "group_rows"),
        (dict(group_rows=16, lag=-1), "lag"),
        (dict(group_rows=16, swiglu_split=3), "swiglu_split"),
        (dict(group_rows=16, programs=99), "programs"),
        (dict(group_rows=16, flags=torch.zeros(2, dtype=torch.int32)), "flags"),
    ):
        with pytest.raises(ValueError, match=match):
            ff.fused_backward(*args, **kwargs)
    with pytest.raises(ValueError, match="xs must be"):
        ff.fused_backward(*args[:3], r.xs[:, :32], *args[4:], group_rows=16)


# ------------------------------------------------------------------------------ the task list


@triton.jit
def _dgrad_part_kernel(out_ptr, blocks, n1, n2, LAG: tl.constexpr, G: tl.constexpr):
    for t in range(tl.cdiv(blocks, G) * G * (n1 + n2)):
        is_first, b, j, real = grouped_task(t, blocks, n1, n2, LAG, G)
        tl.store(out_ptr + 4 * t, is_first.to(tl.int32))
        tl.store(out_ptr + 4 * t + 1, b)
        tl.store(out_ptr + 4 * t + 2, j)
        tl.store(out_ptr + 4 * t + 3, real.to(tl.int32))


DGRAD_PARTS = [(0, 1, 0), (1, 1, 0), (5, 1, 1), (5, 2, 0), (7, 3, 2)]


@pytest.mark.parametrize("blocks,group,lag", DGRAD_PARTS)
def test_dgrad_part_is_every_tile_once_in_topological_order(blocks, group, lag) -> None:
    """Every SwiGLU-backward tile (kind 1) and gate+up dgrad tile (kind 0) of every block once;
    each gate+up dgrad tile after all SwiGLU-backward tiles of its block (what it waits for)."""
    n1, n2 = 3, 2
    length = -(-blocks // group) * group * (n1 + n2)
    out = torch.full((max(1, length), 4), -1, dtype=torch.int32)
    _dgrad_part_kernel[(1,)](out, blocks, n1, n2, LAG=lag, G=group)
    tasks = [tuple(t[:3]) for t in out[:length].tolist() if t[3]]
    expected = {(1, b, c) for b in range(blocks) for c in range(n1)}
    expected |= {(0, b, c) for b in range(blocks) for c in range(n2)}
    assert len(tasks) == len(expected) and set(tasks) == expected
    for pos, (first, b, _) in enumerate(tasks):
        if not first:
            assert all(tasks.index((1, b, c)) < pos for c in range(n1))


@triton.jit
def _wgrad_part_kernel(out_ptr, experts, m1, n1, m2, n2):
    for t in range(experts * (2 * m1 * n1 + m2 * n2)):
        e, kind, mt, nt = wgrad_task(t, m1, n1, m2, n2)
        tl.store(out_ptr + 4 * t, e)
        tl.store(out_ptr + 4 * t + 1, kind)
        tl.store(out_ptr + 4 * t + 2, mt)
        tl.store(out_ptr + 4 * t + 3, nt)


@pytest.mark.parametrize("experts,m1,n1,m2,n2", [(1, 1, 1, 1, 1), (3, 2, 3, 3, 2), (2, 4, 1, 1, 4)])
def test_wgrad_part_is_every_tile_once_expert_by_expert(experts, m1, n1, m2, n2) -> None:
    per_expert = 2 * m1 * n1 + m2 * n2
    out = torch.full((experts * per_expert, 4), -1, dtype=torch.int32)
    _wgrad_part_kernel[(1,)](out, experts, m1, n1, m2, n2)
    expected = [
        (e, kind, mt, nt)
        for e in range(experts)
        for kind, (m, n) in enumerate(((m1, n1), (m1, n1), (m2, n2)))
        for mt in range(m)
        for nt in range(n)
    ]
    assert [tuple(t) for t in out.tolist()] == expected


@triton.jit
def _counts_kernel(out_ptr, num_blocks_ptr, T, H, I, IS, E, SHARED: tl.constexpr, RG: tl.constexpr):
    counts = backward_counts(num_blocks_ptr, T, H, I, IS, E, 16, 32, 32, 32, 32, 2, SHARED, RG)
    for k in tl.static_range(6):
        tl.store(out_ptr + k, counts[k])


@pytest.mark.parametrize("shared,route_grad", [(0, 0), (24, 0), (24, 1)])
def test_backward_counts_bound_the_four_parts(shared: int, route_grad: int) -> None:
    """[shared dgrad | shared wgrad | routed dgrad | routed wgrad] with 16-row blocks, 32-wide
    tiles and groups of 2 blocks (a partial last group counts whole); at W > 1 one route-grad
    task more per routed block."""
    t, h, i, e, blocks = 29, 64, 40, 3, 5
    out = torch.zeros(6, dtype=torch.int32)
    nb = torch.tensor([blocks], dtype=torch.int32)
    _counts_kernel[(1,)](out, nb, t, h, i, shared, e, SHARED=shared > 0, RG=route_grad)
    c = lambda a, b: -(-a // b)  # noqa: E731
    shared_blocks = c(t, 16) if shared else 0
    s_dgrad = c(shared_blocks, 2) * 2 * (c(shared, 32) + c(h, 32)) if shared else 0
    s_end = s_dgrad + (2 * c(shared, 32) * c(h, 32) + c(h, 32) * c(shared, 32) if shared else 0)
    r_dgrad = s_end + c(blocks, 2) * 2 * (c(i, 32) + route_grad + c(h, 32))
    total = r_dgrad + e * (2 * c(i, 32) * c(h, 32) + c(h, 32) * c(i, 32))
    assert out.tolist() == [blocks, shared_blocks, s_dgrad, s_end, r_dgrad, total]


# ------------------------------------------------------------------------------ watchdog


def _stall(shared: bool, skip_tasks: int = 0, preset: str | None = None) -> str:
    """Run the kernel with the ticket pre-advanced by ``skip_tasks`` (those tasks never signal)
    or with a counter of the flag buffer (``preset``: a ``BackwardFlagLayout`` field) started
    far behind (its signals never reach the count)."""
    case = Case(29, 64, 40, 4, 2, shared=24 if shared else 0, routing="zipf")
    p = make_problem(case, 7)
    ctx, dz, _ = _unfused_parts(p, p.weights)
    sched, r, w = ctx.schedule.routed, ctx.routed, ctx.weights
    inputs = None
    if shared:
        inputs = ff.SharedBackwardInputs(p.grad_y, ctx.x, ctx.shared, w.s_gate, w.s_up, w.s_down)
    ws = local_workspace(case.tokens, case.hidden, case.top_k, torch.bfloat16, dz.device)
    flags = torch.zeros(4096, dtype=torch.int32)
    flags[0] = skip_tasks
    if preset is not None:
        shared_blocks = -(-case.tokens // case.block_rows) if shared else 0
        layout = ff.backward_flag_layout(sched.max_blocks, case.experts, shared_blocks)
        flags[getattr(layout, preset)] = -(1 << 20)
    ff.fused_backward(
        ws,
        sched,
        dz,
        r.xs,
        r.g,
        r.u,
        r.h,
        w.w_gate,
        w.w_up,
        w.w_down,
        group_rows=case.block_rows,
        shared=inputs,
        lag=0,
        budget=STALL_BUDGET,
        flags=flags,
    )
    with pytest.raises(StallError) as info:
        check_errors(ws)
    check_errors(ws)  # the record was cleared
    message = str(info.value)
    assert f"after {STALL_BUDGET} polls" in message
    return message


# (shared expert, tasks skipped, counter started behind, the stage that waits, its index):
# skipping task 0 drops the first SwiGLU-backward tile of row block 0 (shared or routed), which
# its gate+up dgrad tiles (lag 0: the same group) wait for; expert 0's and the shared expert's
# "all done" counters are what their weight-gradient tiles wait for.
STALLS = [
    (False, 1, None, "DGU_READY", 0),
    (True, 1, None, "SHARED_DGU_READY", 0),
    (False, 0, "expert_done", "EXPERT_DGU_READY", 0),
    (True, 0, "shared_done", "SHARED_ALL_DGU_READY", 0),
]


@pytest.mark.parametrize("shared,skip,preset,stage,index", STALLS)
def test_missing_signal_is_reported(shared, skip, preset, stage, index) -> None:
    message = _stall(shared, skip, preset)
    assert f"stalled in {stage_name(BACKWARD_STAGE_CODES[stage])} (index {index})" in message


def _ep_stall(skip_tasks: int = 0, preset: str | None = None) -> str:
    """Rank 0's kernel of a W = 2 step (random activations: only the waits matter) with the
    ticket pre-advanced or a counter of the flag buffer started far behind."""
    case = Case(13, 64, 32, 4, 2, routing="uniform", world=2)
    p = make_problem(case, 8)
    wss = emulated_workspaces(2, case.tokens, case.hidden, case.top_k)
    scheds = lockstep(
        [steps.schedule_steps(r.topk_ids, p.config, ws) for r, ws in zip(p.ranks, wss)], wss
    )
    sched, ws = scheds[0].routed, wss[0]
    gen = torch.Generator().manual_seed(1)
    acts = [torch.randn(sched.rows, n, generator=gen).bfloat16() for n in (64, 32, 32, 32)]
    w = p.local_weights(0)
    flags = torch.zeros(4096, dtype=torch.int32)
    flags[0] = skip_tasks
    if preset is not None:
        layout = ff.backward_flag_layout(sched.max_blocks, 2, 0, sched.rows // case.block_rows)
        flags[getattr(layout, preset)] = -(1 << 20)
    ff.fused_backward_ep(
        ws,
        sched,
        torch.rand(2 * case.tokens * case.top_k),
        *acts,
        w.w_gate,
        w.w_up,
        w.w_down,
        group_rows=case.block_rows,
        num_comm=2,
        lag=0,
        budget=STALL_BUDGET,
        flags=flags,
    )
    with pytest.raises(StallError) as info:
        check_errors(ws)
    check_errors(ws)  # the record was cleared
    message = str(info.value)
    assert f"after {STALL_BUDGET} polls" in message
    return message


# (tasks skipped, counter started behind, the stage that waits): the dy rows of minibatch 0
# never pulled (its route-grad task waits); block 0's route-grad task skipped (task 0: its
# SwiGLU-backward tiles wait); block 0's d_x tiles never counted (the push waits).
EP_STALLS = [(0, "ready", "DY_READY"), (1, None, "DZ_READY"), (0, "dx_done", "DX_READY")]


@pytest.mark.parametrize("skip,preset,stage", EP_STALLS)
def test_missing_exchange_signal_is_reported(skip, preset, stage) -> None:
    message = _ep_stall(skip, preset)
    assert f"stalled in {stage_name(BACKWARD_STAGE_CODES[stage])} (index 0)" in message
