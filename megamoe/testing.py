"""Helpers to check an MoE implementation: run with gradients, compare, and expert-parallel checks.

Shared by the CPU tests, the GPU tests under torchrun and the benchmark's accuracy check, so that
"the same inputs, every gradient, compared by relative error" is written once. An implementation
is any callable with the signature of :func:`megamoe.reference.moe_reference`:
``fn(x, topk_ids, topk_weights, weights, config, group) -> y``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from .config import MoEConfig
from .routing import make_routing
from .types import ExpertWeights

__all__ = [
    "MoEFn",
    "GRAD_NAMES",
    "RunResult",
    "rel_err",
    "run_with_grads",
    "compare_results",
    "make_inputs",
    "global_weights",
    "slice_weights",
    "ep_vs_single",
]

MoEFn = Callable[..., torch.Tensor]

# Names of the gradients every implementation must produce (shared ones only with a shared expert).
GRAD_NAMES: tuple[str, ...] = ("x", "topk_weights", "w_gate", "w_up", "w_down", "s_gate", "s_up", "s_down")
WEIGHT_NAMES: tuple[str, ...] = GRAD_NAMES[2:]

# Seeds of the per-rank input streams are spread apart so ranks never share a stream.
_RANK_SEED_STRIDE = 7919


@dataclass
class RunResult:
    """Output and gradients of one forward + backward (float tensors, detached)."""

    y: torch.Tensor
    grads: dict[str, torch.Tensor]


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected|| / ||expected||`` in float64 (NaN anywhere gives inf)."""
    a, e = actual.double(), expected.double()
    if not torch.isfinite(a).all():
        return float("inf")
    denom = e.norm().item()
    diff = (a - e).norm().item()
    return diff / denom if denom > 0 else diff


def run_with_grads(
    fn: MoEFn,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: ExpertWeights,
    grad_y: torch.Tensor,
    config: MoEConfig,
    group: dist.ProcessGroup | None = None,
    *,
    dtype: torch.dtype | None = None,
) -> RunResult:
    """Forward + backward of ``fn`` on fresh leaf copies (cast to ``dtype`` when given)."""

    def leaf(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(dtype or t.dtype).clone().requires_grad_(True)

    x_l, w_l = leaf(x), leaf(topk_weights)
    weight_leaves = {n: leaf(t) for n, t in zip(WEIGHT_NAMES, weights) if t is not None}
    lw = ExpertWeights(*(weight_leaves.get(n) for n in WEIGHT_NAMES))
    y = fn(x_l, topk_ids, w_l, lw, config, group)
    y.backward(grad_y.to(y.dtype))
    grads = {"x": x_l.grad, "topk_weights": w_l.grad}
    missing = [n for n, g in grads.items() if g is None]
    if missing:
        raise RuntimeError(f"no gradient reached {missing}: the implementation cut the graph")
    # Experts that received no rows (skewed routing) may legitimately get no gradient at all.
    grads.update({n: t.grad if t.grad is not None else torch.zeros_like(t)
                  for n, t in weight_leaves.items()})
    return RunResult(y.detach(), {n: g.detach() for n, g in grads.items()})


def compare_results(actual: RunResult, expected: RunResult) -> dict[str, float]:
    """Relative error of the output ("y") and of every gradient both results hold."""
    errs = {"y": rel_err(actual.y, expected.y)}
    for name, g in expected.grads.items():
        errs[name] = rel_err(actual.grads[name], g)
    return errs


def make_inputs(
    config: MoEConfig,
    tokens: int,
    *,
    seed: int,
    rank: int = 0,
    world_size: int = 1,
    routing: str = "uniform",
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fresh ``(x, topk_ids, topk_weights, grad_y)`` of one rank; one-rank routing targets rank 0."""
    gen = torch.Generator().manual_seed(seed + _RANK_SEED_STRIDE * rank)
    h = config.hidden_size
    x = torch.randn((tokens, h), generator=gen).to(device=device, dtype=dtype)
    grad_y = torch.randn((tokens, h), generator=gen).to(device=device, dtype=dtype)
    ids, w = make_routing(
        tokens, config.num_experts, config.top_k, kind=routing, world_size=world_size,
        generator=gen, device=device,
    )
    return x, ids, w, grad_y


def global_weights(
    config: MoEConfig, *, seed: int, device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
) -> ExpertWeights:
    """Weights of all ``config.num_experts`` experts, the same on every rank for a seed.

    Random normal scaled by 1/sqrt(fan_in) (not zeros or a tiny range: errors must show).
    """
    gen = torch.Generator().manual_seed(seed)
    e, h, i, i_s = config.num_experts, config.hidden_size, config.intermediate_size, config.shared_intermediate_size

    def draw(*shape: int) -> torch.Tensor:
        t = torch.randn(shape, generator=gen) / shape[-1] ** 0.5
        return t.to(device=device, dtype=dtype)

    shared = (draw(i_s, h), draw(i_s, h), draw(h, i_s)) if i_s else (None, None, None)
    return ExpertWeights(draw(e, i, h), draw(e, i, h), draw(e, h, i), *shared)


def slice_weights(weights: ExpertWeights, rank: int, world_size: int) -> ExpertWeights:
    """The experts rank ``rank`` of ``world_size`` owns: ``[rank*E/W, (rank+1)*E/W)``."""
    e_local = weights.w_gate.shape[0] // world_size
    sl = slice(rank * e_local, (rank + 1) * e_local)
    return ExpertWeights(weights.w_gate[sl], weights.w_up[sl], weights.w_down[sl],
                         weights.s_gate, weights.s_up, weights.s_down)


def _all_gather_rows(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts)


def ep_vs_single(
    fn_ep: MoEFn,
    fn_single: MoEFn,
    config: MoEConfig,
    tokens: int,
    group: dist.ProcessGroup,
    *,
    seed: int,
    routing: str = "uniform",
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> dict[str, float]:
    """Relative errors of ``fn_ep`` run expert-parallel over ``group`` against ``fn_single`` run
    in one process holding every expert and every rank's tokens; the worst over ranks.

    Compared: this rank's output, d_x and d_topk_weights, the gradients of the experts it owns,
    and the shared expert's gradients summed over ranks. ``dtype`` casts the leaves (float64 for
    a tight check of the exchange logic). Every rank must call it (it uses collectives).
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    e_local = config.local_experts(world)
    weights = global_weights(config, seed=seed, device=device)
    x, ids, w, gy = make_inputs(config, tokens, seed=seed + 1, rank=rank, world_size=world,
                                routing=routing, device=device)
    ep = run_with_grads(fn_ep, x, ids, w, slice_weights(weights, rank, world), gy, config, group,
                        dtype=dtype)
    gathered = [_all_gather_rows(t, group) for t in (x, ids, w, gy)]
    single = run_with_grads(fn_single, *gathered[:3], weights, gathered[3], config, None,
                            dtype=dtype)

    rows = slice(rank * tokens, (rank + 1) * tokens)
    experts = slice(rank * e_local, (rank + 1) * e_local)
    expected = {"x": single.grads["x"][rows], "topk_weights": single.grads["topk_weights"][rows]}
    for name in ("w_gate", "w_up", "w_down"):
        expected[name] = single.grads[name][experts]
    ep_grads = dict(ep.grads)
    for name in ("s_gate", "s_up", "s_down"):
        if name in single.grads:
            summed = ep_grads[name].double()
            dist.all_reduce(summed, group=group)
            ep_grads[name], expected[name] = summed, single.grads[name]
    errs = compare_results(RunResult(ep.y, ep_grads), RunResult(single.y[rows], expected))

    worst = torch.tensor(list(errs.values()), dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
    return dict(zip(errs, worst.tolist()))
