"""Backend "triton" on one Hopper GPU: correctness on presets and odd shapes, bitwise
reproducibility, and a CUDA graph of a whole step (proves there is no host synchronization).

Run on the device: ``python -m pytest tests/gpu/test_triton_backend.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
    pytest.skip("needs a Hopper (sm_90) GPU", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ helpers

from megamoe.backends import triton as backend  # noqa: E402
from megamoe.config import get_preset  # noqa: E402
from moe_cases import (compare, make_config, make_problem, reference_grads,  # noqa: E402
                       run_backend)

DEV = torch.device("cuda")

# Presets keep their layer shape; tokens are sliced to keep the float64 oracle quick.
PRESET_TOKENS = {"dsv3": 768, "qwen3-30b": 1024, "mok-v4": 512}

# (tokens, hidden, intermediate, experts, top_k, shared, routing): T not a multiple of 128,
# experts with no rows, one expert with every token, a single token.
ODD = {
    "odd_tokens_uniform": (1000, 1024, 768, 16, 4, 512, "uniform"),
    "empty_experts": (333, 512, 384, 16, 2, 0, "empty_experts"),
    "one_expert_all_rows": (517, 768, 512, 8, 3, 256, "one_expert"),
    "zipf": (900, 1024, 512, 32, 8, 0, "zipf"),
    "single_token": (1, 512, 256, 8, 2, 256, "uniform"),
    "sizes_not_tile_multiples": (300, 520, 200, 6, 2, 136, "uniform"),
}


def _preset_problem(name: str, seed: int):
    p = get_preset(name)
    cfg = make_config(p.hidden_size, p.intermediate_size, p.local_experts, p.top_k,
                      p.shared_intermediate_size, 128)
    return make_problem(cfg, PRESET_TOKENS[name], "uniform", seed, DEV)


def _check(p) -> None:
    errors = compare(run_backend(p), reference_grads(p, torch.float64),
                     reference_grads(p, torch.bfloat16))
    print(" ".join(f"{k}={v:.2e}" for k, v in errors.items()))


@pytest.mark.parametrize("name", sorted(PRESET_TOKENS))
def test_preset_matches_reference(name: str) -> None:
    _check(_preset_problem(name, seed=1))


@pytest.mark.parametrize("case", sorted(ODD))
def test_odd_shape_matches_reference(case: str) -> None:
    t, h, i, e, k, i_s, routing = ODD[case]
    _check(make_problem(make_config(h, i, e, k, i_s, 128), t, routing,
                        seed=sorted(ODD).index(case), device=DEV))


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
    q = make_problem(p.config, p.x.shape[0], "zipf", seed=4, device=DEV)
    ids.copy_(q.topk_ids)
    w.copy_(q.topk_weights)
    graph.replay()
    torch.cuda.synchronize()
    fresh = _step(p, ids, w)
    assert torch.equal(static[0], fresh[0])
    for a, b in zip(static[1], fresh[1]):
        assert a is None or torch.equal(a, b)
