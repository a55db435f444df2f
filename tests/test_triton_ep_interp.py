"""Backend "triton" expert-parallel under the CPU interpreter, with W ranks emulated in one process.

The backend's EP protocol is written as generators that yield where every rank passes a device
barrier; here every emulated rank's steps run in lockstep (each rank up to its next barrier, then
every rank arrives, then every rank waits), over emulated symmetric workspaces. Checked: routed
outputs and gradients at W > 1 are bitwise equal to W = 1 on the same global batch (same kernels,
same rows per expert in the same order), the capacity check (an overflowed step gives NaN, every
overflow is counted), the error reports, and the two new kernel variants.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from megamoe.kernels.runtime import interpreting, poisoned_buffers  # noqa: E402

if not interpreting():
    pytest.skip("needs TRITON_INTERPRET=1 (GPU runs are in tests/gpu)", allow_module_level=True)

from megamoe.backends import triton as backend  # noqa: E402
from megamoe.kernels import comm, rows  # noqa: E402
from megamoe.kernels.schedule import build_row_schedule, max_rows  # noqa: E402
from megamoe.routing import make_routing  # noqa: E402
from megamoe.types import ExpertWeights  # noqa: E402
from megamoe.workspace import emulated_workspaces  # noqa: E402
from moe_cases import make_config  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning")

BLOCK_ROWS = 16
# (world, tokens per rank, hidden, intermediate, local experts, top_k, shared, routing)
CASES = {
    "w2_uniform_shared": (2, 13, 64, 32, 2, 2, 32, "uniform"),
    "w2_one_rank": (2, 11, 64, 32, 3, 2, 0, "one-rank"),
    "w3_zipf_top3": (3, 7, 72, 40, 2, 3, 24, "zipf"),
    # eight ranks, as the x8 run (issue 5): every peer pair, skewed onto the last rank
    "w8_zipf_top4": (8, 5, 64, 32, 1, 4, 16, "zipf"),
    "w8_one_rank": (8, 3, 64, 32, 2, 2, 0, "one-rank"),
}


def lockstep(steps: list, wss: list) -> list:
    """Run every rank's protocol steps, passing each barrier in two phases (arrive, then wait)."""
    results: list = [None] * len(steps)
    done = [False] * len(steps)
    while True:
        for r, s in enumerate(steps):
            try:
                next(s)
            except StopIteration as stop:
                results[r], done[r] = stop.value, True
        if all(done):
            return results
        assert not any(done), "ranks ran different numbers of barriers"
        for ws in wss:
            comm.barrier(ws, backend.EP_CHANNEL, phase=comm.ARRIVE)
        for ws in wss:
            comm.barrier(ws, backend.EP_CHANNEL, phase=comm.WAIT)


def _rnd(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * scale).to(torch.bfloat16)


def _problem(case: str, capacity_factor: float | None = None):
    world, t, h, i, e_local, k, i_s, routing = CASES[case]
    cfg = make_config(h, i, e_local * world, k, i_s, BLOCK_ROWS)
    cfg = cfg.replace(capacity_factor=capacity_factor)
    gen = torch.Generator().manual_seed(sorted(CASES).index(case))
    e = cfg.num_experts
    shared = ((_rnd(gen, i_s, h, scale=h**-0.5), _rnd(gen, i_s, h, scale=h**-0.5),
               _rnd(gen, h, i_s, scale=i_s**-0.5)) if i_s else (None, None, None))
    weights = ExpertWeights(_rnd(gen, e, i, h, scale=h**-0.5), _rnd(gen, e, i, h, scale=h**-0.5),
                            _rnd(gen, e, h, i, scale=i**-0.5), *shared)
    per_rank = []
    for r in range(world):
        ids, w = make_routing(t, e, k, kind=routing, world_size=world, target_rank=world - 1,
                              generator=gen)
        per_rank.append((_rnd(gen, t, h), ids, w, _rnd(gen, t, h)))
    return cfg, world, e_local, weights, per_rank


def _local(weights: ExpertWeights, r: int, e_local: int) -> ExpertWeights:
    sl = slice(r * e_local, (r + 1) * e_local)
    return ExpertWeights(weights.w_gate[sl], weights.w_up[sl], weights.w_down[sl],
                         weights.s_gate, weights.s_up, weights.s_down)


def _run_ep(cfg, world, e_local, weights, per_rank, wss=None):
    t, h = per_rank[0][0].shape
    wss = wss or emulated_workspaces(world, t, h, cfg.top_k)
    scheds = lockstep([backend.schedule_steps(per_rank[r][1], cfg, wss[r])
                       for r in range(world)], wss)
    outs = lockstep([backend.forward_steps(per_rank[r][0], per_rank[r][2],
                                           _local(weights, r, e_local), scheds[r])
                     for r in range(world)], wss)
    grads = lockstep([backend.backward_steps(outs[r][1], per_rank[r][3])
                      for r in range(world)], wss)
    return [o[0] for o in outs], grads, scheds, wss


def _run_single(cfg, weights, per_rank):
    x, ids, w, dy = (torch.cat([p[j] for p in per_rank]) for j in range(4))
    sched = backend.build_schedule(ids, cfg, None)
    y, ctx = backend.forward(x, ids, w, weights, cfg, None, sched)
    return y, backend.backward(ctx, dy)


@pytest.mark.parametrize("case", sorted(CASES))
def test_expert_parallel_is_bitwise_single_process(case: str) -> None:
    cfg, world, e_local, weights, per_rank = _problem(case)
    with poisoned_buffers():
        ys, grads, _, _ = _run_ep(cfg, world, e_local, weights, per_rank)
        y1, g1 = _run_single(cfg, weights, per_rank)
    t = per_rank[0][0].shape[0]
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


def test_capacity_overflow_gives_nan_is_counted_and_recovers(monkeypatch: pytest.MonkeyPatch) -> None:
    case = "w2_one_rank"  # every token to the last rank: it needs W*T*K rows, capacity 1.25*T*K
    monkeypatch.delenv(backend.CHECK_ENV, raising=False)  # the default, lagged
    cfg, world, e_local, weights, per_rank = _problem(case, capacity_factor=1.25)
    (t, h), k = per_rank[0][0].shape, cfg.top_k
    wss = emulated_workspaces(world, t, h, k)
    for ws in wss:
        backend._lagged_check(ws)  # snapshot of the clean records
    with poisoned_buffers():
        for step in range(2):  # two overflowing steps in a row
            ys, grads, scheds, _ = _run_ep(cfg, world, e_local, weights, per_rank, wss)
            for r in range(world):
                routed = scheds[r].routed
                assert routed.num_blocks.item() == 0  # nothing computed, nothing out of bounds
                assert routed.rows < max_rows(world * t * k, e_local, BLOCK_ROWS)  # smaller buffers
                assert scheds[r].ep.invalid.tolist() == [1]
                # The slots were not written this step: NaN, never stale or zero rows.
                assert ys[r].isnan().all(), f"step {step} rank {r}: y"
                assert grads[r].x.isnan().all(), f"step {step} rank {r}: d_x"
                assert grads[r].topk_weights.isnan().all(), f"step {step} rank {r}: d_topk"
            if step == 0:
                for ws in wss:  # raises the clean snapshot (nothing), snapshots step 0's overflow
                    backend._lagged_check(ws)
    # The snapshot holds the first overflow only; the report reads the live record: both count.
    for r in range(world):
        with pytest.raises(backend.CapacityError,
                           match=f"2 steps overflowed since the last check; the first: rank "
                                 f"{world - 1} was routed {world * t * k} rows"):
            backend._lagged_check(wss[r])
        backend.check(wss[r])  # the records were cleared
        assert not wss[r].errors.any()
    # The same workspaces then run a step that fits, exactly like a fresh process would.
    cfg_ok, *_ = _problem(case)
    ys, grads, _, _ = _run_ep(cfg_ok, world, e_local, weights, per_rank, wss)
    y1, g1 = _run_single(cfg_ok, weights, per_rank)
    for r in range(world):
        tok = slice(r * t, (r + 1) * t)
        assert torch.equal(ys[r], y1[tok])
        assert torch.equal(grads[r].x, g1.x[tok])
        assert torch.equal(grads[r].topk_weights, g1.topk_weights[tok])
        backend._lagged_check(wss[r])  # clean snapshot: nothing raised
        backend.check(wss[r])


def test_one_overflow_is_reported_once_by_check() -> None:
    case = "w2_one_rank"
    cfg, world, e_local, weights, per_rank = _problem(case, capacity_factor=1.25)
    t, h = per_rank[0][0].shape
    wss = emulated_workspaces(world, t, h, cfg.top_k)
    scheds = lockstep([backend.schedule_steps(per_rank[r][1], cfg, wss[r])
                       for r in range(world)], wss)
    for r in range(world):
        with pytest.raises(backend.CapacityError, match="1 step overflowed"):
            backend.check(scheds[r])
        backend.check(scheds[r])


def test_stall_is_decoded_once_and_fatal() -> None:
    from megamoe.workspace import (ERR_FLAG, ERR_PEER, ERR_RANK, ERR_STAGE, StallError,
                                   check_errors)
    ws = emulated_workspaces(2, 4, 8, 2)[0]
    record = {ERR_FLAG: 1, ERR_STAGE: comm.STAGE_BARRIER, ERR_PEER: 1, ERR_RANK: 0}
    for via in (backend.check, check_errors):  # both go through workspace.take_stall
        for i, v in record.items():
            ws.errors[i] = v
        with pytest.raises(StallError, match=r"rank 0 stalled in barrier .*peer 1.*"
                                             r"clear_workspace_cache\(\) on every rank"):
            via(ws)
        assert not ws.errors.any()
        via(ws)


def test_workspace_layouts_must_agree() -> None:
    from megamoe.workspace import _check_layouts
    same = (8, 64, 2, "torch.bfloat16", True, 4096, 0)
    _check_layouts([same] * 3)
    with pytest.raises(ValueError, match=r"ranks \[2\] .*rank 0: num_tokens=8.*rank 2: num_tokens=9"):
        _check_layouts([same, same, (9, *same[1:])])


def test_capacity_that_fits_changes_nothing() -> None:
    case = "w3_zipf_top3"
    cfg, world, e_local, weights, per_rank = _problem(case)
    ys, grads, _, wss = _run_ep(cfg, world, e_local, weights, per_rank)
    t, k = per_rank[0][1].shape
    ids = torch.cat([p[1] for p in per_rank])
    worst = max(int(((ids // e_local) == r).sum()) for r in range(world))
    cap_cfg = cfg.replace(capacity_factor=worst / (t * k))
    ys2, grads2, scheds, _ = _run_ep(cap_cfg, world, e_local, weights, per_rank, wss)
    for r in range(world):
        backend.check(scheds[r])
        assert scheds[r].ep.invalid.tolist() == [0]  # checked, fits: the same bits as unchecked
        assert torch.equal(ys[r], ys2[r]) and torch.equal(grads[r].x, grads2[r].x)
        assert torch.equal(grads[r].topk_weights, grads2[r].topk_weights)


def test_schedule_twice_in_a_row_adds_a_guard_barrier() -> None:
    """Peers may still read the ids of the last schedule: a second one passes a barrier first."""
    cfg, world, e_local, weights, per_rank = _problem("w2_uniform_shared")
    t, h = per_rank[0][0].shape
    wss = emulated_workspaces(world, t, h, cfg.top_k)
    epochs = lambda: [int(ws.epochs[backend.EP_CHANNEL]) for ws in wss]  # noqa: E731
    lockstep([backend.schedule_steps(p[1], cfg, ws) for p, ws in zip(per_rank, wss)], wss)
    assert epochs() == [1] * world
    lockstep([backend.schedule_steps(p[1], cfg, ws) for p, ws in zip(per_rank, wss)], wss)
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
        acc += slots.view(t, k, h)[:, j].float() * w[:, j:j + 1]
    out = rows.combine_slots(slots, k, w, base, torch.float32)
    assert torch.allclose(out, acc + base.float(), rtol=1e-6, atol=1e-6)
    plain = rows.combine_slots(slots, k, None, None, torch.float32)
    assert torch.allclose(plain, slots.view(t, k, h).float().sum(1), rtol=1e-6, atol=1e-6)


def test_check_mode_is_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(backend.CHECK_ENV, "sometimes")
    with pytest.raises(ValueError, match=backend.CHECK_ENV):
        backend._check_mode()
