"""Edge inputs of the Triton backends under the interpreter: a step of no tokens, and expert ids
outside [0, E) with the value checks off. A bad id is found on the device by the schedule's id
check: the step computes nothing, its y, d_x and d topk_weights are NaN on every rank, and the
next check raises a RoutingError naming the token, the k and the value (W = 1, 2 and 3)."""

from __future__ import annotations

import pytest
import torch

from megamoe import RoutingError, functional
from megamoe.backends import triton as backend
from megamoe.kernels.runtime import poisoned_buffers
from support.lockstep import ep_step
from support.problems import Case, make_problem

CASE = Case(13, 64, 32, 4, 2, shared=32, block_rows=16)
BACKENDS = ["triton", "fused"]


@pytest.mark.parametrize("name", BACKENDS)
def test_no_tokens(name: str) -> None:
    p = make_problem(CASE._replace(tokens=0), seed=1)
    x = p.x.requires_grad_(True)
    w = [t.requires_grad_(True) for t in p.weights]
    y = functional.moe(x, p.topk_ids, p.topk_weights, type(p.weights)(*w), p.config, backend=name)
    assert y.shape == (0, CASE.hidden)
    y.float().sum().backward()
    assert x.grad.shape == (0, CASE.hidden)
    assert all(t.grad is not None and not t.grad.any() for t in w)


def _nan_step(grads, y) -> None:
    assert y.isnan().all(), "y"
    assert grads.x.isnan().all(), "d_x"
    assert grads.topk_weights.isnan().all(), "d topk_weights"


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("bad", [-3, CASE.experts])
def test_bad_id_gives_nan_and_an_error_at_the_next_check(name: str, bad: int) -> None:
    p = make_problem(CASE, seed=2)
    ids = p.topk_ids.clone()
    ids[7, 1] = bad
    with poisoned_buffers():
        y, ctx = functional.forward(
            p.x, ids, p.topk_weights, p.weights, p.config, backend=name, check_values=False
        )
        grads = functional.backward(ctx, p.grad_y)
    _nan_step(grads, y)
    with pytest.raises(
        RoutingError,
        match=rf"topk_ids must be in \[0, 4\), got {bad} "
        rf"\(token 7, k 1\); 1 step with bad ids",
    ):
        functional.check()
    functional.check()  # reported once
    # the next step with good ids has the bits of a fresh process
    y_ok, _ = functional.forward(p.x, p.topk_ids, p.topk_weights, p.weights, p.config, backend=name)
    y_ref, _ = functional.forward(
        p.x, p.topk_ids, p.topk_weights, p.weights, p.config, backend="triton"
    )
    assert torch.equal(y_ok, y_ref)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("world", [2, 3])
def test_bad_id_of_one_rank_gives_nan_and_an_error_on_every_rank(name: str, world: int) -> None:
    p = make_problem(CASE._replace(experts=2 * world, world=world), seed=3)
    ids = p.ranks[1].topk_ids.clone()
    ids[4, 0] = 2 * world + 1
    p.ranks[1] = p.ranks[1]._replace(topk_ids=ids)
    with poisoned_buffers():
        out, scheds, _ = ep_step(p, backend=name)
    for r in range(world):
        y, _, grads = out[r]
        _nan_step(grads, y)
        with pytest.raises(RoutingError, match=rf"got {2 * world + 1} \(token 4, k 0 of rank 1\)"):
            backend.check(scheds[r])
