"""Shared helpers for the Triton backend tests (CPU interpreter and GPU): problems and checks.

A problem is a fresh random MoE call (bf16 inputs, never zeros) with a chosen routing pattern;
``check_against_reference`` runs the backend with poisoned buffers and compares outputs and all
gradients with the float64 reference, allowing at most about twice the error of the bf16
reference itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megamoe.config import MoEConfig
from megamoe.reference import moe_reference
from megamoe.testing import rel_err
from megamoe.routing import make_routing
from megamoe.types import ExpertWeights, MoEGrads

GRAD_NAMES = MoEGrads._fields


@dataclass
class Problem:
    config: MoEConfig
    x: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    weights: ExpertWeights
    grad_y: torch.Tensor


def make_config(h: int, i: int, e: int, k: int, i_s: int, block_rows: int) -> MoEConfig:
    return MoEConfig(hidden_size=h, intermediate_size=i, num_experts=e, top_k=k,
                     shared_intermediate_size=i_s, block_rows=block_rows,
                     minibatch_rows=block_rows, ring_rows=block_rows)


def _routing(kind: str, t: int, e: int, k: int,
             gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    if kind in ("uniform", "zipf"):
        return make_routing(t, e, k, kind=kind, generator=gen)
    ids = torch.empty((t, k), dtype=torch.int64)
    if kind == "one_expert":  # expert 0 gets every token; the others share the remaining k-1
        ids[:, 0] = 0
        for j in range(1, k):
            ids[:, j] = 1 + (torch.arange(t) + j) % (e - 1) if e > 1 else 0
    elif kind == "empty_experts":  # only the first k+1 experts get rows, the rest get none
        ids = torch.stack([torch.randperm(k + 1, generator=gen)[:k] for _ in range(t)])
    else:
        raise ValueError(kind)
    w = torch.softmax(torch.randn((t, k), generator=gen), dim=1)
    return ids, w


def make_problem(config: MoEConfig, tokens: int, routing: str, seed: int,
                 device: torch.device, ids_dtype: torch.dtype = torch.int64) -> Problem:
    gen = torch.Generator().manual_seed(seed)
    h, i, e, i_s = (config.hidden_size, config.intermediate_size, config.num_experts,
                    config.shared_intermediate_size)

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, generator=gen) * scale).to(torch.bfloat16).to(device)

    ids, w = _routing(routing, tokens, e, config.top_k, gen)
    shared = (None, None, None)
    if i_s:
        shared = (rnd(i_s, h, scale=h**-0.5), rnd(i_s, h, scale=h**-0.5),
                  rnd(h, i_s, scale=i_s**-0.5))
    weights = ExpertWeights(rnd(e, i, h, scale=h**-0.5), rnd(e, i, h, scale=h**-0.5),
                            rnd(e, h, i, scale=i**-0.5), *shared)
    return Problem(config, rnd(tokens, h), ids.to(device=device, dtype=ids_dtype),
                   w.to(device), weights, rnd(tokens, h))


def reference_grads(p: Problem, dtype: torch.dtype) -> tuple[torch.Tensor, MoEGrads]:
    """y and all gradients of the reference layer computed in ``dtype`` (float64: the oracle)."""
    present = [p.x, p.topk_weights] + [w for w in p.weights if w is not None]
    # The router weights stay fp32 in the bf16 reference, as the layer's contract has them.
    leaves = [t.detach().to(dtype if dtype == torch.float64 or j != 1 else torch.float32)
              .requires_grad_(True) for j, t in enumerate(present)]
    weights = ExpertWeights(*leaves[2:], *([None] * (8 - len(leaves))))
    with torch.enable_grad():
        y = moe_reference(leaves[0], p.topk_ids, leaves[1], weights, p.config)
        grads = torch.autograd.grad(y, leaves, p.grad_y.to(dtype))
    grads = list(grads) + [None] * (8 - len(grads))
    return y.detach(), MoEGrads(*grads)


def compare(ours: tuple[torch.Tensor, MoEGrads], oracle: tuple[torch.Tensor, MoEGrads],
            bf16_ref: tuple[torch.Tensor, MoEGrads], slack: float = 1e-3) -> dict[str, float]:
    """Assert every output is finite, has the reference's shape/dtype class and is at most
    ``2 * err(bf16 reference) + slack`` away from the oracle; return the errors."""
    errors = {}
    names = ("y",) + GRAD_NAMES
    for name, a, o, b in zip(names, (ours[0], *ours[1]), (oracle[0], *oracle[1]),
                             (bf16_ref[0], *bf16_ref[1])):
        if o is None:
            assert a is None, f"{name}: expected None"
            continue
        assert a.shape == o.shape, f"{name}: shape {tuple(a.shape)} != {tuple(o.shape)}"
        assert a.dtype == b.dtype, f"{name}: dtype {a.dtype} != reference {b.dtype}"
        assert torch.isfinite(a).all(), f"{name}: non-finite values (unwritten or leaked padding)"
        err, bound = rel_err(a, o), 2 * rel_err(b, o) + slack
        errors[name] = err
        assert err <= bound, f"{name}: relative error {err:.3e} > {bound:.3e}"
    return errors


def run_backend(p: Problem) -> tuple[torch.Tensor, MoEGrads]:
    """Schedule, forward and backward of backend "triton" with every buffer poisoned."""
    from megamoe.backends import triton as backend
    from megamoe.kernels.runtime import poisoned_buffers

    with poisoned_buffers():
        sched = backend.build_schedule(p.topk_ids, p.config, None)
        y, ctx = backend.forward(p.x, p.topk_ids, p.topk_weights, p.weights, p.config, None, sched)
        grads = backend.backward(ctx, p.grad_y)
    return y, grads
