"""W expert-parallel ranks emulated in one process: every rank's protocol steps in lockstep.

The Triton backends' expert-parallel protocol is a set of generators that yield where every rank
passes a device barrier (``megamoe.backends.steps``); here each rank runs up to its next barrier,
then every rank arrives, then every rank waits (the interpreter runs one program at a time).
"""

from __future__ import annotations

import torch

from megamoe.backends import fused, steps
from megamoe.backends import triton as unfused
from megamoe.ep.workspace import check_errors, emulated_workspaces
from megamoe.kernels import comm

from .problems import Problem

__all__ = ["lockstep", "ep_step", "ep_against_single_process"]


def lockstep(rank_steps: list, wss: list) -> list:
    """Run every rank's protocol steps, passing each barrier in two phases (arrive, then wait)."""
    results: list = [None] * len(rank_steps)
    done = [False] * len(rank_steps)
    while True:
        for r, s in enumerate(rank_steps):
            try:
                next(s)
            except StopIteration as stop:
                results[r], done[r] = stop.value, True
        if all(done):
            return results
        assert not any(done), "ranks ran different numbers of barriers"
        for ws in wss:
            comm.barrier(ws, steps.EP_CHANNEL, phase=comm.ARRIVE)
        for ws in wss:
            comm.barrier(ws, steps.EP_CHANNEL, phase=comm.WAIT)


def ep_step(p: Problem, config=None, backend: str = "triton", wss=None, poison_slots=True):
    """One training step of every emulated rank: (y, ctx, grads) per rank, the schedules and the
    workspaces. ``backend`` "fused" runs its forward (and replays the routed forward when a
    bounded ring dropped it); the backward is the shared one. ``poison_slots``: a combine slot
    nobody pushed keeps NaN and shows in y."""
    cfg = config or p.config
    world, t, h = p.case.world, p.case.tokens, p.case.hidden
    wss = wss or emulated_workspaces(world, t, h, cfg.top_k)
    if poison_slots:
        for ws in wss:
            ws.combine_buffer.fill_(float("nan"))
    scheds = lockstep(
        [steps.schedule_steps(p.ranks[r].topk_ids, cfg, wss[r]) for r in range(world)], wss
    )
    forward = fused.forward_steps if backend == "fused" else steps.forward_steps
    outs = lockstep(
        [
            forward(p.ranks[r].x, p.ranks[r].topk_weights, p.local_weights(r), scheds[r])
            for r in range(world)
        ],
        wss,
    )
    ctxs = [ctx for _, ctx in outs]
    if ctxs[0].routed is None:
        ctxs = lockstep([steps.replay_steps(c) for c in ctxs], wss)
    grads = lockstep([steps.backward_steps(ctxs[r], p.ranks[r].grad_y) for r in range(world)], wss)
    for ws in wss:
        check_errors(ws)
    return [(y, ctx, g) for (y, ctx), g in zip(outs, grads)], scheds, wss


def ep_against_single_process(p: Problem, backend: str = "triton", **kwargs):
    """One :func:`ep_step` of ``backend`` (``kwargs``: its options) checked against backend
    "triton" in one process on the global batch: every rank's y, d_x, d_w and expert weight
    gradients bitwise, the shared expert's weight gradients (per-rank partial sums) equal
    within rounding. Returns the ranks' (y, ctx, grads) and the single process's context. Call
    inside ``poisoned_buffers()``."""
    case = p.case
    e_local, t = case.local_experts, case.tokens
    out, _, _ = ep_step(p, backend=backend, **kwargs)
    x, ids, tw, dy = p.single
    sched = unfused.build_schedule(ids, p.config, None)
    y1, ctx1 = unfused.forward(x, ids, tw, p.weights, p.config, None, sched)
    g1 = unfused.backward(ctx1, dy)
    assert len(out) == case.world
    for r, (y, _, g) in enumerate(out):
        tok, ex = slice(r * t, (r + 1) * t), slice(r * e_local, (r + 1) * e_local)
        assert torch.equal(y, y1[tok]), f"rank {r}: y"
        assert torch.equal(g.x, g1.x[tok]), f"rank {r}: d_x"
        assert torch.equal(g.topk_weights, g1.topk_weights[tok]), f"rank {r}: d_w"
        for name in ("w_gate", "w_up", "w_down"):
            assert torch.equal(getattr(g, name), getattr(g1, name)[ex]), f"rank {r}: {name}"
    for name in ("s_gate", "s_up", "s_down"):  # per-rank partial sums: equal within rounding
        if getattr(g1, name) is not None:
            total = sum(getattr(o[2], name).double() for o in out)
            ref = getattr(g1, name).double()
            assert (total - ref).norm() <= 2e-2 * ref.norm(), name
    return out, ctx1
