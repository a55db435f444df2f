"""Backend "reference": the pure-PyTorch layer behind the functional schedule/forward/backward API.

The forward records an autograd graph on detached leaves; the backward replays it with
``torch.autograd.grad``. Always available, on every device and process group. Through the custom
ops (``megamoe.ops``) it saves no tensors: its backward recomputes the forward with autograd
(which custom ops switch off inside them; :func:`_autograd_dispatch` switches it back on).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
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


@dataclass
class RecomputeContext:
    """A forward to run again in the backward (the custom ops' path): its inputs."""

    x: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    weights: ExpertWeights
    config: MoEConfig
    group: dist.ProcessGroup | None


@contextlib.contextmanager
def _autograd_dispatch() -> Iterator[None]:
    """Autograd on inside a custom op's implementation, which runs below the autograd dispatch
    keys (an internal PyTorch guard: the one way to record a graph there)."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for name in ("AutogradFunctionality", "ADInplaceOrView"):
        key = getattr(torch._C.DispatchKey, name, None)
        if key is not None:
            exclude = exclude.remove(key)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude):
        with torch.enable_grad():
            yield


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
        y = moe_reference(
            x_l, topk_ids, w_l, lw, config, group, plan=schedule, precision=config.precision
        )
    return y.detach(), ReferenceContext(y, leaves, weights.has_shared)


def backward(ctx: ReferenceContext | RecomputeContext, grad_y: torch.Tensor) -> MoEGrads:
    if isinstance(ctx, RecomputeContext):
        with _autograd_dispatch():
            plan = plan_routing(ctx.topk_ids, ctx.config, ctx.group)
            _, ctx = forward(
                ctx.x, ctx.topk_ids, ctx.topk_weights, ctx.weights, ctx.config, ctx.group, plan
            )
            return backward(ctx, grad_y)
    grads = torch.autograd.grad(ctx.y, ctx.leaves, grad_y, allow_unused=True)
    grads = [g if g is not None else torch.zeros_like(l) for g, l in zip(grads, ctx.leaves)]
    if not ctx.has_shared:
        grads += [None, None, None]
    return MoEGrads(*grads)


def saved_layout(
    config: MoEConfig, tokens: int, world_size: int, dtype: torch.dtype
) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """Nothing is saved for the custom ops' backward: it recomputes the forward."""
    return []


def save(ctx: ReferenceContext) -> list[torch.Tensor]:
    return []


def restore(
    saved: list[torch.Tensor],
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: ExpertWeights,
    config: MoEConfig,
    group: dist.ProcessGroup | None,
) -> RecomputeContext:
    return RecomputeContext(x, topk_ids, topk_weights, weights, config, group)
