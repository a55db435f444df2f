"""Expert parallelism over gloo ranks equals one process holding every expert."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megamoe import MoE, MoEConfig, functional
from support.oracle import rel_err
from support.problems import Case, make_problem
from support.procs import run_gloo

T, H, I, E_LOCAL, K, I_SHARED = 24, 64, 40, 2, 2, 24


def _global_problem(world_size: int, routing: str):
    """Every rank's inputs ("one-rank": every token to the experts of the last rank)."""
    case = Case(
        T, H, I, E_LOCAL * world_size, K, shared=I_SHARED, routing=routing, world=world_size
    )
    p = make_problem(case, seed=100 + world_size)
    cfg = MoEConfig(H, I, case.experts, K, shared_intermediate_size=I_SHARED)
    x, ids, tw, dy = p.single
    return cfg, x, ids, tw, p, dy


def _ep_vs_single(rank: int, world_size: int, routing: str) -> None:
    cfg, x, ids, tw, p, dy = _global_problem(world_size, routing)
    weights = p.weights
    group = dist.group.WORLD
    tok = slice(rank * T, (rank + 1) * T)
    exp = slice(rank * E_LOCAL, (rank + 1) * E_LOCAL)
    local_w = p.local_weights(rank)
    y, ctx = functional.forward(x[tok].contiguous(), ids[tok], tw[tok], local_w, cfg, group=group)
    g = functional.backward(ctx, dy[tok])

    y1, ctx1 = functional.forward(x, ids, tw, weights, cfg)  # one process, all experts
    g1 = functional.backward(ctx1, dy)

    # Each expert sees its rows in the same (rank, token, k) order as the single process: the
    # routed parts are bitwise equal; only the shared expert's weight gradient is a sum of
    # per-rank partial products, so it matches within rounding.
    assert torch.equal(y, y1[tok])
    assert torch.equal(g.x, g1.x[tok])
    assert torch.equal(g.topk_weights, g1.topk_weights[tok])
    for name in ("w_gate", "w_up", "w_down"):
        assert torch.equal(getattr(g, name), getattr(g1, name)[exp]), name
    for name in ("s_gate", "s_up", "s_down"):
        total = getattr(g, name).float()
        dist.all_reduce(total, group=group)
        assert rel_err(total, getattr(g1, name)) < 1e-2, name
    if routing == "one-rank" and rank != world_size - 1:
        assert torch.count_nonzero(g.w_gate) == 0  # this rank's experts received nothing


# The all-to-all is one code path at every W > 1: the uniform routing at four ranks (every rank
# sends to three peers), every token to the last rank at two (the other rank receives nothing).
@pytest.mark.parametrize("routing, world_size", [("uniform", 4), ("one-rank", 2)])
def test_expert_parallel_equals_single_process(world_size: int, routing: str):
    run_gloo(world_size, _ep_vs_single, routing)


def _module_ep(rank: int, world_size: int) -> None:
    cfg = MoEConfig(H, I, E_LOCAL * world_size, K, shared_intermediate_size=I_SHARED)
    moe = MoE(cfg, group=dist.group.WORLD, seed=3)
    full = MoE(cfg, seed=3)  # same seed: the same global experts whatever the world size
    exp = slice(rank * E_LOCAL, (rank + 1) * E_LOCAL)
    assert torch.equal(moe.w_gate.detach(), full.w_gate.detach()[exp])
    x, ids, tw, _ = make_problem(Case(T, H, I, cfg.num_experts, K), seed=rank).ranks[0]
    y = moe(x, ids, tw)
    y.float().sum().backward()
    assert moe.w_gate.grad is not None and torch.isfinite(y.float()).all()
    # rank-varying token counts are rejected by name
    with pytest.raises(ValueError, match="same number of tokens"):
        n = T - rank
        moe(x[:n], ids[:n], tw[:n])


def test_module_expert_parallel_and_token_count_mismatch():
    run_gloo(2, _module_ep)
