"""The MoE layer as plain functions: build_schedule / forward / backward, no autograd magic.

For users who manage their own autograd (pipeline schedules, activation recomputation) and
the layer's own ``torch.autograd.Function``. ``moe`` is the autograd-enabled one-call form.

    sched = build_schedule(topk_ids, cfg, group, backend="triton")    # once per step
    y, ctx = forward(x, topk_ids, topk_weights, weights, cfg, group=group, schedule=sched, ...)
    grads = backward(ctx, dy)                                         # MoEGrads
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .backends import get_backend, resolve_backend
from .config import MoEConfig
from .types import ExpertWeights, MoEGrads
from .validation import group_size_rank, validate_inputs

__all__ = ["MoEContext", "build_schedule", "forward", "backward", "moe"]


@dataclass
class MoEContext:
    """What ``backward`` needs: the backend that ran and its own saved state."""

    backend: str
    state: Any


def build_schedule(topk_ids: torch.Tensor, config: MoEConfig,
                   group: dist.ProcessGroup | None = None, backend: str = "reference") -> Any:
    """Routing exchange and row layout for one step; reusable by forward and backward."""
    name = resolve_backend(backend, topk_ids.device, group_size_rank(group)[0])
    return get_backend(name).build_schedule(topk_ids, config, group)


def forward(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
            weights: ExpertWeights, config: MoEConfig, *,
            group: dist.ProcessGroup | None = None, backend: str = "reference",
            schedule: Any = None, check_values: bool = True) -> tuple[torch.Tensor, MoEContext]:
    """Run the layer forward; returns ``y`` and the context for :func:`backward`.

    ``schedule`` must come from :func:`build_schedule` with the same backend (built here when
    None). ``check_values=False`` skips the checks that read device values (see validation).
    """
    validate_inputs(x, topk_ids, topk_weights, weights, config, group, check_values=check_values)
    name = resolve_backend(backend, x.device, group_size_rank(group)[0])
    impl = get_backend(name)
    if schedule is None:
        schedule = impl.build_schedule(topk_ids, config, group)
    y, state = impl.forward(x, topk_ids, topk_weights, weights, config, group, schedule)
    return y, MoEContext(name, state)


def backward(ctx: MoEContext, grad_y: torch.Tensor) -> MoEGrads:
    """Gradients of x, the router weights and every weight, given ``dL/dy``."""
    if not isinstance(ctx, MoEContext):
        raise TypeError(f"ctx must be the MoEContext returned by forward, got {type(ctx).__name__}")
    return get_backend(ctx.backend).backward(ctx.state, grad_y.contiguous())


class _MoEFunction(torch.autograd.Function):
    @staticmethod
    def forward(autograd_ctx, options: dict, x: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor, *weight_list: torch.Tensor | None) -> torch.Tensor:
        y, ctx = forward(x, topk_ids, topk_weights, ExpertWeights(*weight_list), **options)
        autograd_ctx.moe_ctx = ctx
        return y

    @staticmethod
    def backward(autograd_ctx, grad_y: torch.Tensor):
        g = backward(autograd_ctx.moe_ctx, grad_y)
        autograd_ctx.moe_ctx = None  # free saved activations
        return (None, g.x, None, g.topk_weights, g.w_gate, g.w_up, g.w_down,
                g.s_gate, g.s_up, g.s_down)


def moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
        weights: ExpertWeights, config: MoEConfig, *,
        group: dist.ProcessGroup | None = None, backend: str = "reference",
        schedule: Any = None, check_values: bool = True) -> torch.Tensor:
    """Autograd-enabled MoE: gradients flow to x, topk_weights and the weights."""
    options = dict(config=config, group=group, backend=backend, schedule=schedule,
                   check_values=check_values)
    return _MoEFunction.apply(options, x, topk_ids, topk_weights, *weights)
