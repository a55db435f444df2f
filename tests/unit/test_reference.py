"""The reference layer against an independent float64 per-token loop, outputs and gradients."""

from __future__ import annotations

import pytest
import torch

from megamoe import ExpertWeights, MoEConfig, functional
from megamoe.reference import moe_reference
from support.oracle import loop_oracle, rel_err
from support.problems import Case, make_problem, params

CASES = [
    Case(1, 64, 32, 4, 2, shared=16),  # a single token
    Case(37, 72, 40, 5, 1),  # top_k = 1, odd sizes, no shared expert
    Case(23, 100, 52, 1, 1, shared=24),  # one expert, H and I not multiples of anything
    Case(64, 96, 48, 8, 3),
]
BF16_TOL = 2e-2  # relative to the largest magnitude: a few bf16 ulps through three GEMMs


def _problem(case: Case, seed: int, dtype=torch.bfloat16):
    p = make_problem(case, seed, dtype=dtype)
    cfg = MoEConfig(
        case.hidden,
        case.intermediate,
        case.experts,
        case.top_k,
        shared_intermediate_size=case.shared,
    )
    return cfg, p.x, p.topk_ids, p.topk_weights, p.weights


def _grads_by_autograd(fn, x, tw, weights: ExpertWeights, dy):
    leaves = [x, tw, *[w for w in weights if w is not None]]
    leaves = [t.detach().clone().requires_grad_(True) for t in leaves]
    x_l, tw_l, *ws = leaves
    ws = ws + [None] * (6 - len(ws))
    y = fn(x_l, tw_l, ExpertWeights(*ws))
    grads = torch.autograd.grad(y, leaves, dy.to(y.dtype))
    return y.detach(), grads


@pytest.mark.parametrize("case", params(*CASES))
def test_float64_reference_equals_token_loop(case: Case):
    cfg, x, ids, tw, weights = _problem(case, seed=1, dtype=torch.float64)
    dy = torch.randn(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    y_ref, g_ref = _grads_by_autograd(
        lambda x, tw, w: moe_reference(x, ids, tw, w, cfg), x, tw, weights, dy
    )
    y_loop, g_loop = _grads_by_autograd(
        lambda x, tw, w: loop_oracle(x, ids, tw, w), x, tw, weights, dy
    )
    assert rel_err(y_ref, y_loop) < 1e-12
    for name, a, b in zip(
        ["x", "topk_weights", "w_gate", "w_up", "w_down", "s_gate", "s_up", "s_down"], g_ref, g_loop
    ):
        assert rel_err(a, b) < 1e-12, name


@pytest.mark.parametrize("case", params(*CASES))
def test_bf16_reference_close_to_float64(case: Case):
    cfg, x, ids, tw, weights = _problem(case, seed=3)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    y, grads = _grads_by_autograd(
        lambda x, tw, w: moe_reference(x, ids, tw, w, cfg), x, tw, weights, dy
    )
    y64, grads64 = _grads_by_autograd(
        lambda x, tw, w: loop_oracle(x, ids, tw, w), x, tw, weights, dy
    )
    assert y.dtype == torch.bfloat16
    assert rel_err(y, y64) < BF16_TOL
    for a, b in zip(grads, grads64):
        assert a.dtype == (torch.float32 if a.shape == tw.shape else torch.bfloat16)
        assert rel_err(a, b) < BF16_TOL


def test_functional_forward_backward_matches_autograd():
    cfg, x, ids, tw, weights = _problem(Case(29, 64, 48, 6, 2, shared=32), seed=5)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    y, ctx = functional.forward(x, ids, tw, weights, cfg)
    grads = functional.backward(ctx, dy)
    y_ag, g_ag = _grads_by_autograd(
        lambda x, tw, w: moe_reference(x, ids, tw, w, cfg), x, tw, weights, dy
    )
    assert torch.equal(y, y_ag)
    for a, b in zip(grads, g_ag):
        assert torch.equal(a, b)


def test_module_run_twice_is_bitwise_identical():
    from megamoe import MoE, TopKRouter

    cfg = MoEConfig(96, 64, 8, 3, shared_intermediate_size=32)
    results = []
    for _ in range(2):
        torch.manual_seed(7)
        router = TopKRouter(96, 8, 3)
        moe = MoE(cfg, seed=11)
        x = torch.randn(50, 96).to(torch.bfloat16).requires_grad_()
        y = moe(x, *router(x))
        (y.float() * torch.linspace(-1, 1, 96)).sum().backward()
        results.append([y, x.grad, router.gate.weight.grad, *[p.grad for p in moe.parameters()]])
    for a, b in zip(*results):
        assert torch.equal(a, b)
    assert all(t.abs().sum() > 0 for t in results[0])
