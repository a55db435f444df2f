"""The torch-a2a baseline: against the float64 reference in one process, and expert-parallel over
2 gloo ranks (spawned processes) against one process holding every expert."""

import functools
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megamoe import MoEConfig
from megamoe.reference import moe_reference
from megamoe.tools import baselines
from megamoe.tools.baselines import torch_a2a_moe
from megamoe.tools.testing import compare_results, run_with_grads
from megamoe.types import ExpertWeights
from support.expert_parallel import ep_vs_single
from support.problems import case_of, make_problem

# bf16 operands: relative errors land between 1e-3 and 1e-2 (see METHOD notes); NaN never passes.
BF16_RTOL = 2e-2
FLOAT64_RTOL = 1e-10
reference64 = functools.partial(moe_reference, compute_dtype=torch.float64)


def _fresh_seed() -> int:
    return int(torch.randint(0, 2**31 - 1, ()).item())


# Rounding dy and z to bf16 moves <dy, z> by about u * sum |dy_i z_i| <= u * ||dy|| * ||z||,
# u = 2^-8 the bf16 unit roundoff (measured: at most 2.4e-3 of the scale over 400 seeds).
ROUTER_GRAD_TOL = 2.0**-8


def _router_grad_scale(x, ids, weights, cfg, gy) -> torch.Tensor:
    """[T, K] ``||dy_t|| * ||z_tk||`` (float64): the size of the terms of the router-weight
    gradient ``<dy_t, z_tk>``, which bounds its bf16 rounding error. z_tk comes from the float64
    reference run with the k-th weight one-hot and no shared expert."""
    routed = ExpertWeights(*(t.detach().double() for t in weights[:3]))
    cfg = cfg.replace(shared_intermediate_size=0)
    columns = []
    for k in range(ids.shape[1]):
        onehot = torch.zeros(ids.shape, dtype=torch.float64)
        onehot[:, k] = 1
        z = reference64(x.detach().double(), ids, onehot, routed, cfg)
        columns.append(gy.double().norm(dim=1) * z.norm(dim=1))
    return torch.stack(columns, dim=1)


def _check_against_float64(cfg: MoEConfig, tokens: int, routing: str = "uniform") -> None:
    """Output and gradients within BF16_RTOL of float64 (norm-wise); the router-weight gradient,
    one dot product per (token, k) that a random dy can make nearly cancel (a few percent of
    relative error in any bf16 layer at one token, top-1), element-wise within ROUTER_GRAD_TOL of
    the size of its terms (:func:`_router_grad_scale`)."""
    seed = _fresh_seed()
    p = make_problem(case_of(cfg, tokens, routing), seed)
    weights, (x, ids, w, gy) = p.weights, p.single
    got = run_with_grads(torch_a2a_moe, x, ids, w, weights, gy, cfg)
    ref = run_with_grads(reference64, x, ids, w, weights, gy, cfg, dtype=torch.float64)
    assert got.y.dtype == torch.bfloat16 and got.y.shape == x.shape
    errs = compare_results(got, ref)
    scale = _router_grad_scale(x, ids, weights, cfg, gy)
    diff = (got.grads["topk_weights"].double() - ref.grads["topk_weights"]).abs()
    router = (diff / scale).max().item()
    del errs["topk_weights"]
    worst = max(errs, key=errs.get)
    assert errs[worst] < BF16_RTOL, f"seed {seed}: {worst} error {errs[worst]:.3e}: {errs}"
    assert router < ROUTER_GRAD_TOL, f"seed {seed}: router-weight gradient error {router:.3e}"


@pytest.mark.parametrize(
    "cfg, tokens",
    [
        (MoEConfig(256, 128, 4, 2, shared_intermediate_size=128), 64),  # the tiny preset's shape
        (MoEConfig(72, 40, 5, 3), 37),  # odd sizes, no shared expert
        (MoEConfig(40, 24, 1, 1, shared_intermediate_size=8), 1),  # one expert, top-1, one token
        (MoEConfig(64, 32, 16, 2), 3),  # most experts receive no rows
    ],
)
def test_single_process_matches_float64_reference(cfg, tokens):
    _check_against_float64(cfg, tokens)


def test_skewed_routing_matches_float64_reference():
    _check_against_float64(MoEConfig(64, 48, 8, 2, shared_intermediate_size=16), 50, "zipf")


def test_per_expert_fallback_matches_grouped_mm(monkeypatch):
    cfg = MoEConfig(48, 32, 4, 2)
    p = make_problem(case_of(cfg, 21), _fresh_seed())
    weights, (x, ids, w, gy) = p.weights, p.single
    grouped = run_with_grads(torch_a2a_moe, x, ids, w, weights, gy, cfg)
    monkeypatch.setattr(baselines, "_has_grouped_mm", lambda: False)
    looped = run_with_grads(torch_a2a_moe, x, ids, w, weights, gy, cfg)
    errs = compare_results(looped, grouped)
    assert max(errs.values()) < BF16_RTOL, errs


# ---------------------------------------------------------------- expert parallel, 2 gloo ranks

WORLD_SIZE = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ep_worker(rank: int, world_size: int, port: int, seed: int) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    try:
        group = dist.group.WORLD
        cases = [
            # (name, EP implementation, single-process oracle, leaf dtype, tolerance)
            ("reference float64", reference64, reference64, torch.float64, FLOAT64_RTOL),
            ("torch-a2a vs reference", torch_a2a_moe, moe_reference, None, BF16_RTOL),
            ("torch-a2a vs float64", torch_a2a_moe, reference64, None, BF16_RTOL),
        ]
        configs = [
            (MoEConfig(64, 48, 4 * world_size, 2, shared_intermediate_size=32), 40),
            (MoEConfig(40, 24, 3 * world_size, 3), 17),
        ]
        failures = []
        for cfg, tokens in configs:
            for routing in ("uniform", "one-rank"):
                for name, fn_ep, fn_single, dtype, tol in cases:
                    errs = ep_vs_single(
                        fn_ep,
                        fn_single,
                        cfg,
                        tokens,
                        group,
                        seed=seed,
                        routing=routing,
                        dtype=dtype,
                    )
                    if not max(errs.values()) < tol:
                        failures.append(f"{name}, {routing}, {cfg}: {errs}")
        assert not failures, "\n".join(failures)
    finally:
        dist.destroy_process_group()


def test_expert_parallel_two_gloo_ranks_match_single_process():
    mp.spawn(_ep_worker, args=(WORLD_SIZE, _free_port(), _fresh_seed()), nprocs=WORLD_SIZE)
