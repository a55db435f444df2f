"""An expert-parallel implementation against one process holding every expert (torchrun or
gloo ranks; every rank calls it: it uses collectives)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megamoe.config import MoEConfig
from megamoe.tools.testing import MoEFn, RunResult, compare_results, run_with_grads

from .problems import case_of, make_problem

__all__ = ["ep_vs_single"]


def ep_vs_single(
    fn_ep: MoEFn,
    fn_single: MoEFn,
    config: MoEConfig,
    tokens: int,
    group: dist.ProcessGroup,
    *,
    seed: int,
    routing: str = "uniform",
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> dict[str, float]:
    """Relative errors of ``fn_ep`` run expert-parallel over ``group`` against ``fn_single`` run
    in one process holding every expert and every rank's tokens; the worst over ranks.

    Every rank draws the same problem (``make_problem``, the same seed) and runs its own part.
    Compared: this rank's output, d_x and d_topk_weights, the gradients of the experts it owns,
    and the shared expert's gradients summed over ranks. ``dtype`` casts the leaves (float64 for
    a tight check of the exchange logic).
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    e_local = config.local_experts(world)
    p = make_problem(case_of(config, tokens, routing, world), seed, device)
    x, ids, w, gy = p.ranks[rank]
    ep = run_with_grads(fn_ep, x, ids, w, p.local_weights(rank), gy, config, group, dtype=dtype)
    single = run_with_grads(
        fn_single, *p.single[:3], p.weights, p.single.grad_y, config, None, dtype=dtype
    )

    rows = slice(rank * tokens, (rank + 1) * tokens)
    experts = slice(rank * e_local, (rank + 1) * e_local)
    expected = {"x": single.grads["x"][rows], "topk_weights": single.grads["topk_weights"][rows]}
    for name in ("w_gate", "w_up", "w_down"):
        expected[name] = single.grads[name][experts]
    ep_grads = dict(ep.grads)
    for name in ("s_gate", "s_up", "s_down"):
        if name in single.grads:
            summed = ep_grads[name].double()
            dist.all_reduce(summed, group=group)
            ep_grads[name], expected[name] = summed, single.grads[name]
    errs = compare_results(RunResult(ep.y, ep_grads), RunResult(single.y[rows], expected))

    worst = torch.tensor(list(errs.values()), dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
    return dict(zip(errs, worst.tolist()))
