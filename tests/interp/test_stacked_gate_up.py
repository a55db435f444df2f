"""A stacked gate/up weight ``[E, 2I, H]`` (transformers' ``gate_up_proj``) under the interpreter:
the kernels read both halves in place and the layer gives the bits of separate weights, forward
and backward, with its gradient one stacked tensor written in place (poisoned buffers: every
element written). W = 1 and expert-parallel W = 2 in lockstep, backends triton and fused."""

from __future__ import annotations

import pytest
import torch

from megamoe import ExpertWeights, functional
from megamoe.kernels import gemm
from megamoe.kernels.runtime import poisoned_buffers
from support.lockstep import ep_step
from support.oracle import reference_grads
from support.problems import Case, make_problem

# I = 40 is not a multiple of the interpreter's 32-wide tiles: the gate tiles' last columns read
# up rows, which must only feed the clipped columns.
CASE = Case(13, 64, 40, 4, 2, shared=32, block_rows=16)
BACKENDS = ["triton", "fused"]


def _stacked(p) -> torch.Tensor:
    return torch.cat([p.weights.w_gate, p.weights.w_up], dim=1)


def test_weight_2d_reads_both_halves_in_place() -> None:
    stacked = torch.randn(3, 2 * 40, 64)
    w = ExpertWeights.from_gate_up(stacked, torch.randn(3, 64, 40)).split_gate_up()
    for half, offset in ((w.w_gate, 0), (w.w_up, 40)):
        view, rows_apart = gemm.weight_2d(half)
        assert rows_apart == 80
        assert view.data_ptr() == stacked.data_ptr() + offset * 64 * stacked.element_size()
        for e in range(3):  # expert e's rows of this half, where the kernels index them
            assert torch.equal(view[e * rows_apart : e * rows_apart + 40], half[e])
    # a layout it cannot read in place (experts not a whole number of rows apart) is copied
    odd = torch.randn(3 * 40 * 64 + 5)[5:].as_strided((3, 40, 63), (40 * 64 + 1, 63, 1))
    view, rows_apart = gemm.weight_2d(odd)
    assert rows_apart == 40 and torch.equal(view.view(3, 40, 63), odd)


@pytest.mark.parametrize("name", BACKENDS)
def test_stacked_gives_the_bits_of_separate_weights(name: str) -> None:
    p = make_problem(CASE, seed=4)
    stacked = _stacked(p).requires_grad_(True)
    rest = [t.clone().requires_grad_(True) for t in p.weights[2:]]
    split = [t.clone().requires_grad_(True) for t in p.weights]

    def run(weights, params):
        x = p.x.clone().requires_grad_(True)
        with poisoned_buffers():
            y = functional.moe(x, p.topk_ids, p.topk_weights, weights, p.config, backend=name)
            y.backward(p.grad_y)
        return y, x.grad, [q.grad for q in params]

    y_s, dx_s, (d_stacked, *d_rest) = run(
        ExpertWeights.from_gate_up(stacked, *rest), [stacked, *rest]
    )
    y, dx, (d_gate, d_up, *d_rest_split) = run(ExpertWeights(*split), split)
    assert torch.equal(y_s, y), "y"
    assert torch.equal(dx_s, dx), "d_x"
    assert d_stacked.shape == stacked.shape
    assert torch.equal(d_stacked, torch.cat([d_gate, d_up], dim=1)), "d_w_gate_up"
    for i, (a, b) in enumerate(zip(d_rest, d_rest_split)):
        assert torch.equal(a, b), f"grad of weight {i + 2}"
    # and the numbers are right (the separate weights are checked against float64 elsewhere)
    y64, g64 = reference_grads(p, torch.float64)
    assert (y_s.double() - y64).abs().max() <= 0.05 * y64.abs().max()
    d64 = torch.cat([g64.w_gate, g64.w_up], dim=1)
    assert (d_stacked.double() - d64).abs().max() <= 0.05 * d64.abs().max()


@pytest.mark.parametrize("name", BACKENDS)
def test_expert_parallel_stacked_gives_the_bits_of_separate_weights(name: str) -> None:
    p = make_problem(CASE._replace(world=2), seed=6)
    split, *_ = ep_step(p, backend=name)
    separate = p.local_weights

    def stacked_local(rank: int) -> ExpertWeights:
        w = separate(rank)
        stacked = torch.cat([w.w_gate, w.w_up], dim=1)
        return ExpertWeights.from_gate_up(stacked, *w[2:]).split_gate_up()  # (as the ops pass)

    p.local_weights = stacked_local
    with poisoned_buffers():
        stacked, *_ = ep_step(p, backend=name)
    for rank, ((y_s, _, g_s), (y, _, g)) in enumerate(zip(stacked, split)):
        assert torch.equal(y_s, y), f"rank {rank}: y"
        assert torch.equal(g_s.w_gate_up, torch.cat([g.w_gate, g.w_up], dim=1)), f"rank {rank}"
        assert g_s.w_gate_up.data_ptr() == g_s.w_gate.data_ptr(), f"rank {rank}: not stacked"
        for field in ("x", "topk_weights", "w_down", "s_gate", "s_up", "s_down"):
            assert torch.equal(getattr(g_s, field), getattr(g, field)), f"rank {rank}: {field}"


def test_functional_backward_gives_one_stacked_gradient() -> None:
    p = make_problem(CASE, seed=5)
    stacked = _stacked(p)
    weights = ExpertWeights.from_gate_up(stacked, *p.weights[2:])
    with poisoned_buffers():
        y, ctx = functional.forward(
            p.x, p.topk_ids, p.topk_weights, weights, p.config, backend="triton"
        )
        grads = functional.backward(ctx, p.grad_y)
    d = grads.w_gate_up  # the two halves are views of one gradient: no concatenation
    assert d.data_ptr() == grads.w_gate.data_ptr() and d.shape == stacked.shape
    assert torch.equal(d[:, : CASE.intermediate], grads.w_gate)
    assert torch.equal(d[:, CASE.intermediate :], grads.w_up)
    assert torch.isfinite(d).all()


def test_a_stacked_view_outside_the_graph_keeps_its_gradient() -> None:
    """DTensor.to_local() returns such a view (its base is no autograd input): the op must take
    the stacked tensor given, not the root of its views."""

    class Local(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.detach().view_as(t)

        @staticmethod
        def backward(ctx, g):
            return g

    p = make_problem(CASE, seed=8)
    param = _stacked(p).requires_grad_(True)
    weights = ExpertWeights.from_gate_up(Local.apply(param), *p.weights[2:])
    y = functional.moe(p.x, p.topk_ids, p.topk_weights, weights, p.config, backend="triton")
    y.backward(p.grad_y)
    assert param.grad is not None and param.grad.shape == param.shape
    assert torch.isfinite(param.grad).all() and param.grad.any()


def test_from_gate_up_refuses_an_odd_row_count() -> None:
    with pytest.raises(ValueError, match=r"w_gate_up .*must have an even dim 1.*\[2, 7, 8\]"):
        ExpertWeights.from_gate_up(torch.zeros(2, 7, 8), torch.zeros(2, 8, 3))
    with pytest.raises(ValueError, match=r"w_gate_up .*must be a 3-D \[E_local, 2 \* I, H\]"):
        ExpertWeights.from_gate_up(torch.zeros(7, 8), torch.zeros(2, 8, 3))
