"""Backend "triton" expert-parallel over NVLink: every rank runs this file under torchrun.

    torchrun --nproc-per-node=2 -m pytest -q tests/gpu/test_triton_ep.py

Outputs and every gradient against the float64 reference (presets with sliced tokens, odd shapes,
skewed routing), bitwise repeatability, routed results bitwise equal to one process holding every
expert (W = 1 on the same global batch), capacity overflow, a CUDA graph of a whole step, and the
benchmark. Each test does its collective work first and then agrees on a verdict, so one rank's
failure never leaves the other waiting in a collective.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.distributed as dist

from megamoe import MoEConfig
from megamoe.backends import triton as backend
from megamoe.ep import checks
from megamoe.errors import CapacityError
from megamoe.reference import moe_reference
from megamoe.shapes import get_preset
from megamoe.tools.harness import layer_fn
from support.dist import agree, shared_seed
from support.expert_parallel import ep_vs_single
from support.problems import case_of, make_problem, slice_weights

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available()
    or "WORLD_SIZE" not in os.environ
    or torch.cuda.get_device_capability() < (9, 0),
    reason="needs Hopper GPUs and torchrun (WORLD_SIZE)",
)

BF16_RTOL = 2e-2
reference64 = functools.partial(moe_reference, compute_dtype=torch.float64)
PRESET_TOKENS = {"dsv3": 512, "qwen3-30b": 512, "mok-v4": 256}
# The oracle draws every expert's weights on the CPU: the big presets keep their layer shape
# (H, I, top_k, shared) with fewer local experts so that a test takes seconds.
PRESET_LOCAL_EXPERTS = {"dsv3": 4, "qwen3-30b": 64, "mok-v4": 4}
# (H, I, local experts, top_k, shared I, tokens per rank, routing)
ODD = {
    "odd_uniform": (520, 200, 3, 2, 136, 300, "uniform"),
    "zipf_top8": (1024, 512, 16, 8, 0, 333, "zipf"),
    "one_rank": (768, 384, 4, 3, 256, 257, "one-rank"),
    "single_token": (512, 256, 4, 2, 256, 1, "uniform"),
}


triton_moe = layer_fn("triton")


def _check_vs_reference(group, device, cfg: MoEConfig, tokens: int, routing: str) -> None:
    errs = ep_vs_single(
        triton_moe,
        reference64,
        cfg,
        tokens,
        group,
        seed=shared_seed(device),
        routing=routing,
        device=device,
    )
    print(" ".join(f"{k}={v:.2e}" for k, v in errs.items()))
    agree(max(errs.values()) < BF16_RTOL, str(errs))


@pytest.mark.parametrize("name", sorted(PRESET_TOKENS))
def test_preset_matches_reference(ep, name: str) -> None:
    group, device = ep
    _check_vs_reference(
        group,
        device,
        _preset_config(name, dist.get_world_size(group)),
        PRESET_TOKENS[name],
        "uniform",
    )


def _preset_config(name: str, world: int) -> MoEConfig:
    p = get_preset(name)
    return p.config(world).replace(num_experts=PRESET_LOCAL_EXPERTS[name] * world)


@pytest.mark.parametrize("case", sorted(ODD))
def test_odd_shape_matches_reference(ep, case: str) -> None:
    group, device = ep
    h, i, e_local, k, i_s, tokens, routing = ODD[case]
    cfg = MoEConfig(h, i, e_local * dist.get_world_size(group), k, shared_intermediate_size=i_s)
    _check_vs_reference(group, device, cfg, tokens, routing)


# ------------------------------------------------------------------------------ bitwise checks


def _problem(group, device, cfg: MoEConfig, tokens: int, routing: str, seed: int):
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    p = make_problem(case_of(cfg, tokens, routing, world), seed, device)
    return p.weights, tuple(p.ranks[rank])


def _step(inputs, weights, cfg, group):
    x, ids, w, dy = inputs
    sched = backend.build_schedule(ids, cfg, group)
    y, ctx = backend.forward(x, ids, w, weights, cfg, group, sched)
    return y, backend.backward(ctx, dy), sched


def _gather(t: torch.Tensor, group) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


def _mismatches(ep_out, single_out, group, e_local: int, tokens: int) -> list[str]:
    """Names of routed results of this rank that differ in any bit from the one-process run."""
    rank = dist.get_rank(group)
    y, g = ep_out[0], ep_out[1]
    y1, g1 = single_out[0], single_out[1]
    tok = slice(rank * tokens, (rank + 1) * tokens)
    ex = slice(rank * e_local, (rank + 1) * e_local)
    pairs = {
        "y": (y, y1[tok]),
        "x": (g.x, g1.x[tok]),
        "topk_weights": (g.topk_weights, g1.topk_weights[tok]),
    }
    for name in ("w_gate", "w_up", "w_down"):
        pairs[name] = (getattr(g, name), getattr(g1, name)[ex])
    return [n for n, (a, b) in pairs.items() if not _bits_equal(a, b)]


@pytest.mark.parametrize("routing", ["uniform", "zipf", "one-rank"])
def test_routed_results_are_bitwise_those_of_one_process(ep, routing: str) -> None:
    """W ranks == one process holding every expert and every rank's tokens, bit for bit.

    With a shared expert y and d_x include it; its GEMMs are row-local, so they match too.
    """
    group, device = ep
    world = dist.get_world_size(group)
    e_local, tokens = 8, 384
    cfg = MoEConfig(1024, 512, e_local * world, 4, shared_intermediate_size=512)
    weights, inputs = _problem(group, device, cfg, tokens, routing, shared_seed(device))
    out = _step(inputs, slice_weights(weights, dist.get_rank(group), world), cfg, group)
    single_inputs = tuple(_gather(t, group) for t in inputs)
    single = _step(single_inputs, weights, cfg, None)
    bad = _mismatches(out, single, group, e_local, tokens)
    agree(not bad, f"not bitwise equal to W=1: {bad}")


@pytest.mark.parametrize("case", sorted(ODD))
def test_odd_shapes_are_bitwise_those_of_one_process(ep, case: str) -> None:
    """The float64 comparison cannot see a few wrong rows; W = 1's bits can."""
    group, device = ep
    world = dist.get_world_size(group)
    h, i, e_local, k, i_s, tokens, routing = ODD[case]
    cfg = MoEConfig(h, i, e_local * world, k, shared_intermediate_size=i_s)
    weights, inputs = _problem(group, device, cfg, tokens, routing, shared_seed(device))
    out = _step(inputs, slice_weights(weights, dist.get_rank(group), world), cfg, group)
    single = _step(tuple(_gather(t, group) for t in inputs), weights, cfg, None)
    bad = _mismatches(out, single, group, e_local, tokens)
    agree(not bad, f"{case}: not bitwise equal to W=1: {bad}")


def test_two_runs_are_bitwise_equal(ep) -> None:
    group, device = ep
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    cfg = _preset_config("qwen3-30b", world)
    weights, inputs = _problem(group, device, cfg, 1024, "zipf", shared_seed(device))
    local = slice_weights(weights, rank, world)
    y1, g1, _ = _step(inputs, local, cfg, group)
    y2, g2, _ = _step(inputs, local, cfg, group)
    bad = [
        n
        for n, a, b in zip(("y",) + g1._fields, (y1, *g1), (y2, *g2))
        if a is not None and not _bits_equal(a, b)
    ]
    agree(not bad, f"runs differ: {bad}")


def test_capacity_overflow_raises_on_every_rank_and_recovers(ep, monkeypatch) -> None:
    """Every token to rank 0 with capacity T*K: every rank reports it (explicit check, and the
    lagged check once the GPU has made its snapshot); afterwards a step that fits has the bits of
    W = 1."""
    group, device = ep
    monkeypatch.setenv(checks.CHECK_ENV, "lagged")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    tokens, e_local = 200, 4  # a shape no other test uses: a fresh workspace and check state
    cfg = MoEConfig(512, 256, e_local * world, 2, capacity_factor=1.0)
    weights, inputs = _problem(group, device, cfg, tokens, "one-rank", shared_seed(device))
    local = slice_weights(weights, rank, world)
    problems = []
    _, _, sched = _step(inputs, local, cfg, group)
    try:
        backend.check(sched)
        problems.append("explicit check did not raise")
    except CapacityError as exc:
        if f"rank 0 was routed {world * tokens * 2} rows" not in str(exc):
            problems.append(f"unexpected message: {exc}")
    _step(inputs, local, cfg, group)  # overflows again, unchecked
    backend.build_schedule(inputs[1], cfg, group)  # snapshots the records after that step
    torch.cuda.synchronize()  # (the lagged check reads a snapshot only once the GPU made it)
    try:
        backend.build_schedule(inputs[1], cfg, group)
        problems.append("lagged check did not raise")
    except CapacityError:
        pass
    fits = cfg.replace(capacity_factor=None)
    out = _step(inputs, local, fits, group)
    backend.check(out[2])
    single = _step(tuple(_gather(t, group) for t in inputs), weights, fits, None)
    bad = _mismatches(out, single, group, e_local, tokens)
    if bad:
        problems.append(f"after recovery not bitwise W=1: {bad}")
    agree(not problems, "; ".join(problems))


def test_cuda_graph_of_a_whole_step_replays_to_the_same_bits(ep) -> None:
    group, device = ep
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    cfg = _preset_config("dsv3", world)
    weights, inputs = _problem(group, device, cfg, 512, "uniform", shared_seed(device))
    local = slice_weights(weights, rank, world)
    x, ids, w, dy = (t.clone() for t in inputs)
    static_in = (x, ids, w, dy)
    eager = _step(static_in, local, cfg, group)[:2]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = _step(static_in, local, cfg, group)[:2]
    problems = []
    for label in ("replay", "new routing"):
        if label == "new routing":
            _, fresh_in = _problem(group, device, cfg, 512, "zipf", shared_seed(device) + 1)
            for dst, src in zip(static_in, fresh_in):
                dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        expected = eager if label == "replay" else _step(static_in, local, cfg, group)[:2]
        bad = [
            n
            for n, a, b in zip(
                ("y",) + expected[1]._fields, (static[0], *static[1]), (expected[0], *expected[1])
            )
            if a is not None and not _bits_equal(a, b)
        ]
        if bad:
            problems.append(f"{label}: {bad}")
    backend.check(backend.build_schedule(ids, cfg, group))
    del graph
    agree(not problems, "; ".join(problems))


def test_bench_runs_triton_expert_parallel(ep) -> None:
    from megamoe.tools.bench import BenchOptions, run_bench
    from megamoe.tools.harness import DistEnv

    group, device = ep
    env = DistEnv(dist.get_world_size(group), dist.get_rank(group), device, group)
    opts = BenchOptions(
        shapes=["tiny"], backends=["triton", "reference", "torch-a2a"], iters=2, warmup=1
    )
    recs = {r["backend"]: r for r in run_bench(opts, env)}
    t = recs["triton"]
    agree(
        t["status"] == "ok" and t["check_ok"] and t["world_size"] == env.world_size,
        f"triton record: {t['status']} {t['note']} check_ok={t['check_ok']}",
    )
