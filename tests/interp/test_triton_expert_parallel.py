"""Backend "triton" expert-parallel under the CPU interpreter, with W ranks emulated in one process.

The backends' EP protocol is written as generators that yield where every rank passes a device
barrier; here every emulated rank's steps run in lockstep (``support.lockstep``) over emulated
symmetric workspaces. Checked: routed outputs and gradients at W > 1 are bitwise equal to W = 1 on
the same global batch (same kernels, same rows per expert in the same order), the capacity check
(an overflowed step gives NaN, every overflow is counted), the error reports, and the two
expert-parallel kernel variants.
"""

from __future__ import annotations

import pytest
import torch

from megamoe.backends import steps
from megamoe.backends import triton as backend
from megamoe.ep import checks
from megamoe.ep.workspace import check_errors, emulated_workspaces
from megamoe.errors import CapacityError, ErrorWord, Stage, StallError
from megamoe.kernels import rows
from megamoe.kernels.runtime import poisoned_buffers
from megamoe.kernels.schedule import build_row_schedule, max_rows
from support.lockstep import ep_step, lockstep
from support.problems import Case, make_problem, params

BLOCK_ROWS = 16
CASES = [
    Case(13, 64, 32, 4, 2, shared=32, world=2),
    Case(11, 64, 32, 6, 2, routing="one-rank", world=2),
    Case(7, 72, 40, 6, 3, shared=24, routing="zipf", world=3),
    # eight ranks: every peer pair, skewed onto the last rank
    Case(5, 64, 32, 8, 4, shared=16, routing="zipf", world=8),
    Case(3, 64, 32, 16, 2, routing="one-rank", world=8),
]
ONE_RANK = CASES[1]  # every token to the last rank


def _rnd(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(torch.bfloat16)


def _problem(case: Case, **tunables):
    return make_problem(case, seed=CASES.index(case), **tunables)


def _run_ep(p, config=None, wss=None):
    out, scheds, wss = ep_step(p, config, wss=wss, poison_slots=False)
    return [o[0] for o in out], [o[2] for o in out], scheds, wss


def _run_single(p, config=None):
    cfg = config or p.config
    x, ids, w, dy = p.single
    sched = backend.build_schedule(ids, cfg, None)
    y, ctx = backend.forward(x, ids, w, p.weights, cfg, None, sched)
    return y, backend.backward(ctx, dy)


_EP_STEPS: dict = {}


def _ep_of(case: Case):
    """(problem, ys, grads, workspaces) of one EP step of ``case`` (poisoned buffers), computed
    once: the bitwise test and the capacity test start from it."""
    if case not in _EP_STEPS:
        p = _problem(case)
        with poisoned_buffers():
            ys, grads, _, wss = _run_ep(p)
        _EP_STEPS[case] = p, ys, grads, wss
    return _EP_STEPS[case]


@pytest.mark.parametrize("case", params(*CASES))
def test_expert_parallel_is_bitwise_single_process(case: Case) -> None:
    p, ys, grads, _ = _ep_of(case)
    world, e_local, t = case.world, case.local_experts, case.tokens
    with poisoned_buffers():
        y1, g1 = _run_single(p)
    for r in range(world):
        tok, ex = slice(r * t, (r + 1) * t), slice(r * e_local, (r + 1) * e_local)
        assert torch.equal(ys[r], y1[tok]), f"rank {r}: y"
        assert torch.equal(grads[r].x, g1.x[tok]), f"rank {r}: d_x"
        assert torch.equal(grads[r].topk_weights, g1.topk_weights[tok]), f"rank {r}: d_w"
        for name in ("w_gate", "w_up", "w_down"):
            assert torch.equal(getattr(grads[r], name), getattr(g1, name)[ex]), f"rank {r}: {name}"
    for name in ("s_gate", "s_up", "s_down"):  # per-rank partial sums: equal within rounding
        if getattr(g1, name) is not None:
            total = sum(getattr(g, name).double() for g in grads)
            ref = getattr(g1, name).double()
            assert (total - ref).norm() <= 2e-2 * ref.norm(), name


def test_capacity_overflow_gives_nan_is_counted_and_recovers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # every token to the last rank: it needs W*T*K rows, capacity 1.25*T*K
    monkeypatch.delenv(checks.CHECK_ENV, raising=False)  # the default, lagged
    p = _problem(ONE_RANK, capacity_factor=1.25)
    world, e_local, t, h, k = (
        ONE_RANK.world,
        ONE_RANK.local_experts,
        ONE_RANK.tokens,
        ONE_RANK.hidden,
        ONE_RANK.top_k,
    )
    wss = emulated_workspaces(world, t, h, k)
    for ws in wss:
        checks.lagged_check(ws)  # snapshot of the clean records
    with poisoned_buffers():
        for step in range(2):  # two overflowing steps in a row
            ys, grads, scheds, _ = _run_ep(p, wss=wss)
            for r in range(world):
                routed = scheds[r].routed
                assert routed.num_blocks.item() == 0  # nothing computed, nothing out of bounds
                assert routed.rows < max_rows(world * t * k, e_local, BLOCK_ROWS)  # smaller buffers
                assert scheds[r].invalid.tolist() == [1]
                # The slots were not written this step: NaN, never stale or zero rows.
                assert ys[r].isnan().all(), f"step {step} rank {r}: y"
                assert grads[r].x.isnan().all(), f"step {step} rank {r}: d_x"
                assert grads[r].topk_weights.isnan().all(), f"step {step} rank {r}: d_topk"
            if step == 0:
                for ws in wss:  # raises the clean snapshot (nothing), snapshots step 0's overflow
                    checks.lagged_check(ws)
    # The snapshot holds the first overflow only; the report reads the live record: both count.
    for r in range(world):
        with pytest.raises(
            CapacityError,
            match=f"2 steps overflowed since the last check; the first: rank "
            f"{world - 1} was routed {world * t * k} rows",
        ):
            checks.lagged_check(wss[r])
        backend.check(wss[r])  # the records were cleared
        assert not wss[r].errors.any()
    # The same workspaces then run a step that fits, exactly like a fresh process would.
    fits = p.config.replace(capacity_factor=None)
    ys, grads, _, _ = _run_ep(p, fits, wss)
    y1, g1 = _run_single(p, fits)
    for r in range(world):
        tok = slice(r * t, (r + 1) * t)
        assert torch.equal(ys[r], y1[tok])
        assert torch.equal(grads[r].x, g1.x[tok])
        assert torch.equal(grads[r].topk_weights, g1.topk_weights[tok])
        checks.lagged_check(wss[r])  # clean snapshot: nothing raised
        backend.check(wss[r])


def test_one_overflow_is_reported_once_by_check() -> None:
    p = _problem(ONE_RANK, capacity_factor=1.25)
    world = ONE_RANK.world
    wss = emulated_workspaces(world, ONE_RANK.tokens, ONE_RANK.hidden, ONE_RANK.top_k)
    scheds = lockstep(
        [steps.schedule_steps(p.ranks[r].topk_ids, p.config, wss[r]) for r in range(world)], wss
    )
    for r in range(world):
        with pytest.raises(CapacityError, match="1 step overflowed"):
            backend.check(scheds[r])
        backend.check(scheds[r])


def test_stall_is_decoded_once_and_fatal() -> None:
    ws = emulated_workspaces(2, 4, 8, 2)[0]
    record = {
        ErrorWord.FLAG: 1,
        ErrorWord.STAGE: Stage.BARRIER,
        ErrorWord.PEER: 1,
        ErrorWord.RANK: 0,
    }
    for via in (backend.check, check_errors):  # both go through workspace.take_stall
        for i, v in record.items():
            ws.errors[i] = v
        with pytest.raises(
            StallError,
            match=r"rank 0 stalled in barrier .*peer 1.*"
            r"clear_workspace_cache\(\) on every rank",
        ):
            via(ws)
        assert not ws.errors.any()
        via(ws)


def test_workspace_layouts_must_agree() -> None:
    from megamoe.ep.workspace import _check_layouts

    same = (8, 64, 2, "torch.bfloat16", True, 4096, 0)
    _check_layouts([same] * 3)
    with pytest.raises(
        ValueError, match=r"ranks \[2\] .*rank 0: num_tokens=8.*rank 2: num_tokens=9"
    ):
        _check_layouts([same, same, (9, *same[1:])])


def test_capacity_that_fits_changes_nothing() -> None:
    case = CASES[2]
    p, ys, grads, wss = _ep_of(case)  # unchecked (capacity_factor None)
    world, e_local, t, k = case.world, case.local_experts, case.tokens, case.top_k
    ids = p.single.topk_ids
    worst = max(int(((ids // e_local) == r).sum()) for r in range(world))
    cap_cfg = p.config.replace(capacity_factor=worst / (t * k))
    ys2, grads2, scheds, _ = _run_ep(p, cap_cfg, wss)  # the same workspaces
    for r in range(world):
        backend.check(scheds[r])
        assert scheds[r].invalid.tolist() == [0]  # checked, fits: the same bits as unchecked
        assert torch.equal(ys[r], ys2[r]) and torch.equal(grads[r].x, grads2[r].x)
        assert torch.equal(grads[r].topk_weights, grads2[r].topk_weights)


def test_schedule_twice_in_a_row_adds_a_guard_barrier() -> None:
    """Peers may still read the ids of the last schedule: a second one passes a barrier first."""
    case = CASES[0]
    p = _problem(case)
    world, cfg = case.world, p.config
    wss = emulated_workspaces(world, case.tokens, case.hidden, cfg.top_k)
    epochs = lambda: [int(ws.epochs[steps.EP_CHANNEL]) for ws in wss]  # noqa: E731
    lockstep([steps.schedule_steps(r.topk_ids, cfg, ws) for r, ws in zip(p.ranks, wss)], wss)
    assert epochs() == [1] * world
    lockstep([steps.schedule_steps(r.topk_ids, cfg, ws) for r, ws in zip(p.ranks, wss)], wss)
    assert epochs() == [3] * world


def test_route_grad_rows_matches_route_grad() -> None:
    t, k, e, h = 21, 2, 3, 72
    gen = torch.Generator().manual_seed(5)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    sched = build_row_schedule(ids, e, BLOCK_ROWS)
    dy, w = _rnd(gen, t, h), torch.rand(t, k, generator=gen)
    z = _rnd(gen, sched.rows, h)
    dz, dw = rows.route_grad(dy, z, w, sched)
    dy_rows = rows.gather(dy, sched)
    with poisoned_buffers():
        dz_r, dw_r = rows.route_grad_rows(dy_rows, z, w, sched)
    used = int(sched.num_blocks.item()) * BLOCK_ROWS
    assert torch.equal(dz_r[:used], dz[:used])
    placed = sched.dest_row.long()
    assert torch.equal(dw_r[placed].view(t, k), dw)


def test_combine_slots_matches_torch() -> None:
    t, k, h = 19, 3, 40
    gen = torch.Generator().manual_seed(6)
    slots, base = _rnd(gen, t * k, h), _rnd(gen, t, h)
    w = torch.rand(t, k, generator=gen)
    acc = torch.zeros(t, h)
    for j in range(k):  # k in order, fp32
        acc += slots.view(t, k, h)[:, j].float() * w[:, j : j + 1]
    out = rows.combine_slots(slots, k, w, base, torch.float32)
    assert torch.allclose(out, acc + base.float(), rtol=1e-6, atol=1e-6)
    plain = rows.combine_slots(slots, k, None, None, torch.float32)
    assert torch.allclose(plain, slots.view(t, k, h).float().sum(1), rtol=1e-6, atol=1e-6)


def test_check_mode_is_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(checks.CHECK_ENV, "sometimes")
    with pytest.raises(ValueError, match=checks.CHECK_ENV):
        checks.check_mode()
