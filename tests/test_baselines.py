"""The torch-a2a baseline: against the float64 reference in one process, and expert-parallel over
2 gloo ranks (spawned processes) against one process holding every expert."""

import functools
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megamoe import MoEConfig
from megamoe import baselines
from megamoe.baselines import torch_a2a_moe
from megamoe.reference import moe_reference
from megamoe.testing import (
    compare_results,
    ep_vs_single,
    global_weights,
    make_inputs,
    run_with_grads,
)

# bf16 operands: relative errors land between 1e-3 and 1e-2 (see METHOD notes); NaN never passes.
BF16_RTOL = 2e-2
FLOAT64_RTOL = 1e-10
reference64 = functools.partial(moe_reference, compute_dtype=torch.float64)


def _fresh_seed() -> int:
    return int(torch.randint(0, 2**31 - 1, ()).item())


def _check_against_float64(cfg: MoEConfig, tokens: int, routing: str = "uniform") -> dict:
    seed = _fresh_seed()
    weights = global_weights(cfg, seed=seed)
    x, ids, w, gy = make_inputs(cfg, tokens, seed=seed + 1, routing=routing)
    got = run_with_grads(torch_a2a_moe, x, ids, w, weights, gy, cfg)
    ref = run_with_grads(reference64, x, ids, w, weights, gy, cfg, dtype=torch.float64)
    assert got.y.dtype == torch.bfloat16 and got.y.shape == x.shape
    return compare_results(got, ref)


@pytest.mark.parametrize(
    "cfg, tokens",
    [
        (MoEConfig(256, 128, 4, 2, shared_intermediate_size=128), 64),  # the tiny preset's shape
        (MoEConfig(72, 40, 5, 3), 37),                     # odd sizes, no shared expert
        (MoEConfig(40, 24, 1, 1, shared_intermediate_size=8), 1),  # one expert, top-1, one token
        (MoEConfig(64, 32, 16, 2), 3),                     # most experts receive no rows
    ],
)
def test_single_process_matches_float64_reference(cfg, tokens):
    errs = _check_against_float64(cfg, tokens)
    assert max(errs.values()) < BF16_RTOL, errs


def test_skewed_routing_matches_float64_reference():
    errs = _check_against_float64(MoEConfig(64, 48, 8, 2, shared_intermediate_size=16), 50, "zipf")
    assert max(errs.values()) < BF16_RTOL, errs


def test_per_expert_fallback_matches_grouped_mm(monkeypatch):
    cfg = MoEConfig(48, 32, 4, 2)
    seed = _fresh_seed()
    weights = global_weights(cfg, seed=seed)
    x, ids, w, gy = make_inputs(cfg, 21, seed=seed + 1)
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
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
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
                    errs = ep_vs_single(fn_ep, fn_single, cfg, tokens, group, seed=seed,
                                        routing=routing, dtype=dtype)
                    if not max(errs.values()) < tol:
                        failures.append(f"{name}, {routing}, {cfg}: {errs}")
        assert not failures, "\n".join(failures)
    finally:
        dist.destroy_process_group()


def test_expert_parallel_two_gloo_ranks_match_single_process():
    mp.spawn(_ep_worker, args=(WORLD_SIZE, _free_port(), _fresh_seed()), nprocs=WORLD_SIZE)
