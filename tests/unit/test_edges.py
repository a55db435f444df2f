"""Edge inputs of backend "reference": a step of no tokens, and expert ids outside [0, E) with
the value checks off (the reference checks them on the host and raises on every rank)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from megamoe import RoutingError, functional
from support.problems import Case, make_problem
from support.procs import run_gloo

CASE = Case(13, 64, 32, 4, 2, shared=32, block_rows=16)


def test_no_tokens() -> None:
    p = make_problem(CASE._replace(tokens=0), seed=1)
    x = p.x.requires_grad_(True)
    w = [t.requires_grad_(True) for t in p.weights]
    y = functional.moe(x, p.topk_ids, p.topk_weights, type(p.weights)(*w), p.config)
    assert y.shape == (0, CASE.hidden)
    y.float().sum().backward()
    assert x.grad.shape == (0, CASE.hidden)
    assert all(t.grad is not None and not t.grad.any() for t in w)


@pytest.mark.parametrize("bad", [-1, CASE.experts, 2**40])
def test_bad_id_with_checks_off_raises(bad: int) -> None:
    p = make_problem(CASE, seed=2)
    ids = p.topk_ids.clone()
    ids[5, 1] = bad
    with pytest.raises(
        RoutingError,
        match=rf"topk_ids must be in \[0, 4\), got {bad} "
        rf"\(token 5, k 1\)",
    ):
        functional.moe(p.x, ids, p.topk_weights, p.weights, p.config, check_values=False)


def _bad_id_on_rank_1(rank: int, world: int) -> None:
    case = CASE._replace(experts=4 * world, world=world)
    p = make_problem(case, seed=3)
    x, ids, w, _ = p.ranks[rank]
    if rank == 1:
        ids = ids.clone()
        ids[2, 0] = 99
    with pytest.raises(RoutingError, match=r"got 99 \(token 2, k 0 of rank 1\)"):
        functional.moe(
            x, ids, w, p.local_weights(rank), p.config, group=dist.group.WORLD, check_values=False
        )


@pytest.mark.parametrize("world", [2, 3])
def test_bad_id_of_one_rank_raises_on_every_rank(world: int) -> None:
    run_gloo(world, _bad_id_on_rank_1)
