"""Checking an MoE implementation: run it with gradients, compare by relative error.

Shared by the benchmark's accuracy check and the tests, so that "the same inputs, every
gradient, compared by relative error" is written once. An implementation is any callable with
the signature of :func:`megamoe.reference.moe_reference`:
``fn(x, topk_ids, topk_weights, weights, config, group) -> y``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from ..config import MoEConfig
from ..types import ExpertWeights

__all__ = ["MoEFn", "GRAD_NAMES", "RunResult", "rel_err", "run_with_grads", "compare_results"]

MoEFn = Callable[..., torch.Tensor]

# Names of the gradients every implementation must produce (shared ones only with a shared expert).
GRAD_NAMES: tuple[str, ...] = (
    "x",
    "topk_weights",
    "w_gate",
    "w_up",
    "w_down",
    "s_gate",
    "s_up",
    "s_down",
)
WEIGHT_NAMES: tuple[str, ...] = GRAD_NAMES[2:]


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
    grads.update(
        {n: t.grad if t.grad is not None else torch.zeros_like(t) for n, t in weight_leaves.items()}
    )
    return RunResult(y.detach(), {n: g.detach() for n, g in grads.items()})


def compare_results(actual: RunResult, expected: RunResult) -> dict[str, float]:
    """Relative error of the output ("y") and of every gradient both results hold."""
    errs = {"y": rel_err(actual.y, expected.y)}
    for name, g in expected.grads.items():
        errs[name] = rel_err(actual.grads[name], g)
    return errs
