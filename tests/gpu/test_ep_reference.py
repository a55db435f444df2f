"""Expert parallelism on GPUs over NCCL: every rank runs this file under torchrun.

    torchrun --nproc-per-node=2 -m pytest tests/gpu/test_ep_reference.py

Checks, with fresh random inputs, that the reference layer run expert-parallel (and through the
public functional API) and the torch-a2a baseline match one process holding every expert and
every rank's tokens: outputs and all gradients, under uniform, Zipf and one-rank routing.
Skipped unless started by torchrun (WORLD_SIZE set) with a GPU per rank.
"""

import functools

import pytest
import torch
import torch.distributed as dist

from megamoe import MoEConfig, functional
from megamoe.reference import moe_reference
from megamoe.tools.baselines import torch_a2a_moe
from support.dist import shared_seed
from support.expert_parallel import ep_vs_single

BF16_RTOL = 2e-2
FLOAT64_RTOL = 1e-10

reference64 = functools.partial(moe_reference, compute_dtype=torch.float64)


def functional_reference(x, topk_ids, topk_weights, weights, config, group):
    return functional.moe(
        x, topk_ids, topk_weights, weights, config, group=group, backend="reference"
    )


# (id, EP implementation, single-process oracle, leaf dtype, tolerance)
CASES = [
    ("reference-float64", reference64, reference64, torch.float64, FLOAT64_RTOL),
    ("reference-bf16", moe_reference, moe_reference, None, BF16_RTOL),
    ("functional-reference", functional_reference, moe_reference, None, BF16_RTOL),
    ("torch-a2a-vs-reference", torch_a2a_moe, moe_reference, None, BF16_RTOL),
    ("torch-a2a-vs-float64", torch_a2a_moe, reference64, None, BF16_RTOL),
]
# Per-rank shapes (hidden sizes are multiples of 8: torch._grouped_mm needs 16-byte strides).
SHAPES = [
    # (H, I, local experts, top_k, shared I, tokens per rank)
    (512, 256, 4, 2, 256, 300),
    (264, 136, 3, 3, 0, 77),
]


@pytest.mark.parametrize("routing", ["uniform", "zipf", "one-rank"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_expert_parallel_matches_single_process(ep, case, shape, routing):
    group, device = ep
    _, fn_ep, fn_single, dtype, tol = case
    h, i, e_local, k, i_s, tokens = shape
    world = dist.get_world_size(group)
    cfg = MoEConfig(h, i, e_local * world, k, shared_intermediate_size=i_s)
    errs = ep_vs_single(
        fn_ep,
        fn_single,
        cfg,
        tokens,
        group,
        seed=shared_seed(device),
        routing=routing,
        device=device,
        dtype=dtype,
    )
    assert max(errs.values()) < tol, errs  # the worst over ranks: every rank agrees
