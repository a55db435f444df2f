"""Backend "triton" on one Hopper GPU: correctness on presets and odd shapes, bitwise
reproducibility, tiles that keep the bits, and no host synchronization in a step (a CUDA graph
of a whole step replays; with the host running ahead, its time stays below the GPU's).

Run on the device: ``python -m pytest tests/gpu/test_triton_backend.py``.
"""

from __future__ import annotations

import time

import pytest
import torch

if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
    pytest.skip("needs a Hopper (sm_90) GPU", allow_module_level=True)

from megamoe.backends import triton as backend  # noqa: E402
from support.oracle import compare, reference_grads, run_backend  # noqa: E402
from support.problems import PRESET_CASES, Case, make_problem, params  # noqa: E402

DEV = torch.device("cuda")

# T not a multiple of 128, experts with no rows, one expert with every token, a single token.
ODD = [
    Case(1000, 1024, 768, 16, 4, shared=512, block_rows=128),
    Case(333, 512, 384, 16, 2, routing="empty_experts", block_rows=128),
    Case(517, 768, 512, 8, 3, shared=256, routing="one_expert", block_rows=128),
    Case(900, 1024, 512, 32, 8, routing="zipf", block_rows=128),
    Case(1, 512, 256, 8, 2, shared=256, block_rows=128),
    Case(300, 520, 200, 6, 2, shared=136, block_rows=128),  # sizes not tile multiples
]


def _preset_problem(name: str, seed: int):
    return make_problem(PRESET_CASES[name], seed, DEV)


def _check(p) -> None:
    errors = compare(
        run_backend(p), reference_grads(p, torch.float64), reference_grads(p, torch.bfloat16)
    )
    print(" ".join(f"{k}={v:.2e}" for k, v in errors.items()))


@pytest.mark.parametrize("name", sorted(PRESET_CASES))
def test_preset_matches_reference(name: str) -> None:
    _check(_preset_problem(name, seed=1))


@pytest.mark.parametrize("case", params(*ODD))
def test_odd_shape_matches_reference(case: Case) -> None:
    _check(make_problem(case, seed=ODD.index(case), device=DEV))


def test_bitwise_reproducible() -> None:
    p = _preset_problem("qwen3-30b", seed=2)
    y1, g1 = run_backend(p)
    y2, g2 = run_backend(p)
    assert torch.equal(y1, y2)
    for name, a, b in zip(g1._fields, g1, g2):
        assert a is None or torch.equal(a, b), name


def _step(p, ids: torch.Tensor, w: torch.Tensor):
    sched = backend.build_schedule(ids, p.config, None)
    y, ctx = backend.forward(p.x, ids, w, p.weights, p.config, None, sched)
    return y, backend.backward(ctx, p.grad_y)


def test_cuda_graph_of_a_whole_step_replays_to_the_same_bits() -> None:
    p = _preset_problem("dsv3", seed=3)
    ids, w = p.topk_ids.clone(), p.topk_weights.clone()
    eager = _step(p, ids, w)  # also compiles every kernel before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = _step(p, ids, w)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static[0], eager[0])
    for a, b in zip(static[1], eager[1]):
        assert a is None or torch.equal(a, b)
    # New routing in the same buffers: the graph must follow it (sizes live on the device).
    q = make_problem(PRESET_CASES["dsv3"]._replace(routing="zipf"), seed=4, device=DEV)
    ids.copy_(q.topk_ids)
    w.copy_(q.topk_weights)
    graph.replay()
    torch.cuda.synchronize()
    fresh = _step(p, ids, w)
    assert torch.equal(static[0], fresh[0])
    for a, b in zip(static[1], fresh[1]):
        assert a is None or torch.equal(a, b)


@pytest.mark.parametrize("bn, row_bm, per_sm", [(64, 0, 1), (128, 0, 1), (128, 64, 2)])
def test_gemm_tile_width_never_changes_bits(monkeypatch, bn: int, row_bm: int, per_sm: int):
    """Other tiles than the defaults give the same bits on the GPU too: narrower output tiles
    (and weight-gradient tiles), 64-row tiles of one warpgroup, two programs per SM. The K loop,
    not the tile, orders each element's sum, so tiles chosen by shape never change results."""
    import dataclasses

    from megamoe.kernels import gemm

    p = _preset_problem("qwen3-30b", seed=5)
    default = run_backend(p)
    tiles = {
        name: dataclasses.replace(
            t,
            bn=min(t.bn, bn),
            bm=(min(t.bm, bn) if name.startswith("wgrad") else row_bm),
            warps=4 if row_bm == 64 else t.warps,
            programs_per_sm=per_sm,
        )
        for name, t in gemm.GPU_TILES.items()
    }
    monkeypatch.setattr(gemm, "GPU_TILES", tiles)
    (y1, g1), (y2, g2) = default, run_backend(p)
    assert torch.equal(y1, y2)
    for name, a, b in zip(g1._fields, g1, g2):
        assert a is None or torch.equal(a, b), name


def test_weight_gradient_tiles_by_rows_per_expert_keep_the_bits(monkeypatch) -> None:
    """The weight gradients take their tiles by the balanced rows per expert
    (``gemm.wgrad_kind``): qwen3-30b's slice has 128 rows per expert and takes the few-rows
    tiles, dsv3's 192 the default; forcing the other choice on each gives the same bits."""
    from megamoe.kernels import gemm

    for name, threshold in (("qwen3-30b", 0), ("dsv3", 10**9)):
        p = _preset_problem(name, seed=7)
        (y1, g1) = run_backend(p)
        with monkeypatch.context() as m:
            m.setattr(gemm, "FEW_ROWS_PER_EXPERT", threshold)
            (y2, g2) = run_backend(p)
        assert torch.equal(y1, y2), name
        for field, a, b in zip(g1._fields, g1, g2):
            assert a is None or torch.equal(a, b), f"{name}: {field}"


@pytest.mark.parametrize("name", ["triton", "fused"])
def test_a_step_never_waits_for_the_device(name: str) -> None:
    """With the host running ahead (no sync between steps), the host time of training steps
    stays well below their GPU time: a host-device synchronization anywhere in a step would make
    the host wait for the device and the two equal."""
    from megamoe import functional

    # dsv3's layer with 8192 tokens: 33 ms of GPU time per step (triton; the fused one runs
    # the tests' one-minibatch ring and replays in the backward: 94 ms), some 4 ms of host time
    p = make_problem(PRESET_CASES["dsv3"]._replace(tokens=8192), seed=8, device=DEV)
    x, ids, w, dy = p.x.requires_grad_(True), p.topk_ids, p.topk_weights, p.grad_y

    def step() -> None:
        y = functional.moe(x, ids, w, p.weights, p.config, backend=name, check_values=False)
        y.backward(dy)

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    for _ in range(5):
        step()
    host_ms = (time.perf_counter() - t0) * 1e3
    end.record()
    torch.cuda.synchronize()
    gpu_ms = start.elapsed_time(end)
    print(f"{name}: host {host_ms:.2f} ms, GPU {gpu_ms:.2f} ms for 5 steps")
    assert host_ms < 0.6 * gpu_ms, f"{name}: host {host_ms:.2f} ms vs GPU {gpu_ms:.2f} ms"


@pytest.mark.parametrize("name", ["triton", "fused"])
@pytest.mark.parametrize("case", params(PRESET_CASES["dsv3"], ODD[5]))
def test_stacked_gate_up_gives_the_bits_of_separate_weights(name: str, case: Case) -> None:
    """transformers' [E, 2I, H] gate_up_proj, read in place by TMA (the up half's descriptor
    starts I rows into each expert), gives separate weights' bits; its gradient is one tensor."""
    from megamoe import ExpertWeights, functional
    from megamoe.kernels.runtime import poisoned_buffers

    p = make_problem(case, seed=7, device=DEV)
    stacked = torch.cat([p.weights.w_gate, p.weights.w_up], dim=1)
    runs = []
    for weights in (p.weights, ExpertWeights.from_gate_up(stacked, *p.weights[2:])):
        with poisoned_buffers():
            y, ctx = functional.forward(
                p.x, p.topk_ids, p.topk_weights, weights, p.config, backend=name
            )
            runs.append((y, functional.backward(ctx, p.grad_y)))
    (y, g), (y_s, g_s) = runs
    assert torch.equal(y_s, y), "y"
    assert g_s.w_gate_up.data_ptr() == g_s.w_gate.data_ptr(), "the gradient is not stacked"
    assert torch.equal(g_s.w_gate_up, torch.cat([g.w_gate, g.w_up], dim=1)), "d w_gate_up"
    for field in ("x", "topk_weights", "w_down", "s_gate", "s_up", "s_down"):
        a, b = getattr(g_s, field), getattr(g, field)
        assert (a is None and b is None) or torch.equal(a, b), field


def test_lagged_check_raises_every_bad_step_on_the_gpu(monkeypatch) -> None:
    """The default (lagged) check on one GPU: a step routed to an expert id outside [0, E)
    raises ``RoutingError`` at a later step's start, once the GPU has made the snapshot (the
    event the check records after its copy); clean steps between raise nothing, and a second
    bad step raises again."""
    from megamoe import functional
    from megamoe.ep import checks
    from megamoe.errors import RoutingError

    monkeypatch.setenv(checks.CHECK_ENV, "lagged")
    p = make_problem(ODD[0], seed=9, device=DEV)
    bad = p.topk_ids.clone()
    bad[5, 1] = p.config.num_experts

    def step(ids: torch.Tensor) -> None:
        y = functional.moe(
            p.x, ids, p.topk_weights, p.weights, p.config, backend="triton", check_values=False
        )  # (the device's check, not the host's)
        torch.cuda.synchronize()  # (the snapshot lands before the next step looks)
        assert y.shape == p.x.shape

    for _ in range(3):
        step(p.topk_ids)
    for _ in range(2):
        step(bad)
        with pytest.raises(RoutingError):
            for _ in range(3):  # the next step snapshots the record, the one after raises it
                step(p.topk_ids)
        for _ in range(3):  # the records were cleared: clean steps raise nothing
            step(p.topk_ids)
