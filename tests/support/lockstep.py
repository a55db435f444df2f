"""W expert-parallel ranks emulated in one process: every rank's protocol steps in lockstep.

The Triton backends' expert-parallel protocol is a set of generators that yield where every rank
passes a device barrier (``megamoe.backends.steps``); here each rank runs up to its next barrier,
then every rank arrives, then every rank waits (the interpreter runs one program at a time).
"""

from __future__ import annotations

from megamoe.backends import fused, steps
from megamoe.ep.workspace import check_errors, emulated_workspaces
from megamoe.kernels import comm

from .problems import Problem

__all__ = ["lockstep", "ep_step"]


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
