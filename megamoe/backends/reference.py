"""Backend "reference": the pure-PyTorch layer behind the functional schedule/forward/backward API.

The forward records an autograd graph on detached leaves; the backward replays it with
``torch.autograd.grad``. Always available, on every device and process group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..config import MoEConfig
from ..reference import RoutingPlan, moe_reference, plan_routing
from ..types import ExpertWeights, MoEGrads


@dataclass
class ReferenceContext:
    y: torch.Tensor
    leaves: tuple[torch.Tensor, ...]
    has_shared: bool


def is_available(device: torch.device | None = None) -> tuple[bool, str]:
    return True, "pure PyTorch"


def build_schedule(
    topk_ids: torch.Tensor, config: MoEConfig, group: dist.ProcessGroup | None
) -> RoutingPlan:
    return plan_routing(topk_ids, config, group)


def forward(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: ExpertWeights,
    config: MoEConfig,
    group: dist.ProcessGroup | None,
    schedule: RoutingPlan,
) -> tuple[torch.Tensor, ReferenceContext]:
    present = [x, topk_weights] + [w for w in weights if w is not None]
    leaves = tuple(t.detach().requires_grad_(True) for t in present)
    x_l, w_l, *rest = leaves
    if weights.has_shared:
        lw = ExpertWeights(*rest)
    else:
        lw = ExpertWeights(*rest, None, None, None)
    with torch.enable_grad():
        y = moe_reference(x_l, topk_ids, w_l, lw, config, group, plan=schedule)
    return y.detach(), ReferenceContext(y, leaves, weights.has_shared)


def backward(ctx: ReferenceContext, grad_y: torch.Tensor) -> MoEGrads:
    grads = torch.autograd.grad(ctx.y, ctx.leaves, grad_y, allow_unused=True)
    grads = [g if g is not None else torch.zeros_like(l) for g, l in zip(grads, ctx.leaves)]
    if not ctx.has_shared:
        grads += [None, None, None]
    return MoEGrads(*grads)
