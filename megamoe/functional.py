"""The MoE layer as plain functions: build_schedule / forward / backward, no autograd magic.

For users who manage their own autograd (pipeline schedules, activation recomputation), and
what the custom ops of :mod:`megamoe.ops` run. ``moe`` is the autograd-enabled one-call form
(through those ops: compile-ready).

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
from .ep import checks
from .ep.workspace import cached_workspaces, local_workspaces
from .types import ExpertWeights, MoEGrads
from .validation import group_size_rank, require_expert_weights, validate_inputs

__all__ = ["MoEContext", "Schedule", "build_schedule", "forward", "backward", "moe", "check"]


@dataclass
class MoEContext:
    """What ``backward`` needs: the backend that ran, its own saved state, and y's signature
    (to check ``grad_y``)."""

    backend: str
    state: Any
    y_shape: tuple[int, ...]
    y_dtype: torch.dtype
    y_device: torch.device


@dataclass(frozen=True)
class Schedule:
    """A backend's schedule plus what it was built for, so ``forward`` can refuse a mismatch.

    ``ids_key`` identifies the ``topk_ids`` tensor it was built from (storage, shape, version): a
    schedule reused with other or modified ids would silently route tokens to the wrong experts.
    """

    backend: str
    config: MoEConfig
    world_size: int
    ids_key: tuple[int, tuple[int, ...], int]
    inner: Any


def _ids_key(topk_ids: torch.Tensor) -> tuple[int, tuple[int, ...], int]:
    return topk_ids.data_ptr(), tuple(topk_ids.shape), topk_ids._version


def build_schedule(
    topk_ids: torch.Tensor,
    config: MoEConfig,
    group: dist.ProcessGroup | None = None,
    backend: str = "reference",
) -> Any:
    """Routing exchange and row layout for one step; reusable by forward and backward.

    Pass it to :func:`forward` with the same ``topk_ids`` tensor (unmodified), config, group and
    backend; anything else is refused.
    """
    world_size = group_size_rank(group)[0]
    name = resolve_backend(backend, topk_ids.device, world_size, config, None, topk_ids.shape[0])
    inner = get_backend(name).build_schedule(topk_ids, config, group)
    return Schedule(name, config, world_size, _ids_key(topk_ids), inner)


def _check_schedule(
    schedule: object, name: str, topk_ids: torch.Tensor, config: MoEConfig, world_size: int
) -> None:
    if not isinstance(schedule, Schedule):
        raise TypeError(
            f"schedule must come from megamoe.functional.build_schedule, "
            f"got {type(schedule).__name__}"
        )
    if schedule.backend != name:
        raise ValueError(
            f"schedule was built for backend {schedule.backend!r}, "
            f"but forward runs backend {name!r}"
        )
    if schedule.config != config:
        raise ValueError(f"schedule was built for config {schedule.config}, got {config}")
    if schedule.world_size != world_size:
        raise ValueError(
            f"schedule was built for world size {schedule.world_size}, got {world_size}"
        )
    if schedule.ids_key != _ids_key(topk_ids):
        raise ValueError(
            "schedule was built from another topk_ids tensor (or the tensor was "
            "modified since): build the schedule from the topk_ids passed to forward"
        )


def forward(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: ExpertWeights,
    config: MoEConfig,
    *,
    group: dist.ProcessGroup | None = None,
    backend: str = "reference",
    schedule: Any = None,
    check_values: bool = True,
) -> tuple[torch.Tensor, MoEContext]:
    """Run the layer forward; returns ``y`` and the context for :func:`backward`.

    ``schedule`` must come from :func:`build_schedule` with the same backend (built here when
    None). ``check_values=False`` skips the checks that read device values (see validation).
    """
    require_expert_weights(weights)
    weights = weights.split_gate_up()  # (a stacked gate/up weight is read through views)
    validate_inputs(x, topk_ids, topk_weights, weights, config, group, check_values=check_values)
    world_size = group_size_rank(group)[0]
    name = resolve_backend(backend, x.device, world_size, config, x.dtype, x.shape[0])
    impl = get_backend(name)
    if schedule is None:
        inner = impl.build_schedule(topk_ids, config, group)
    else:
        _check_schedule(schedule, name, topk_ids, config, world_size)
        inner = schedule.inner
    y, state = impl.forward(x, topk_ids, topk_weights, weights, config, group, inner)
    return y, MoEContext(name, state, tuple(y.shape), y.dtype, y.device)


def backward(ctx: MoEContext, grad_y: torch.Tensor) -> MoEGrads:
    """Gradients of x, the router weights and every weight, given ``dL/dy``."""
    if not isinstance(ctx, MoEContext):
        raise TypeError(f"ctx must be the MoEContext returned by forward, got {type(ctx).__name__}")
    if not isinstance(grad_y, torch.Tensor):
        raise TypeError(f"grad_y must be a torch.Tensor, got {type(grad_y).__name__}")
    if tuple(grad_y.shape) != ctx.y_shape:
        raise ValueError(
            f"grad_y must have the shape of y {list(ctx.y_shape)}, got {list(grad_y.shape)}"
        )
    if not grad_y.is_floating_point():
        raise TypeError(f"grad_y must be a floating tensor, got {grad_y.dtype}")
    if grad_y.device != ctx.y_device:
        raise ValueError(
            f"grad_y must be on device {ctx.y_device} (where y is), got {grad_y.device}"
        )
    return get_backend(ctx.backend).backward(ctx.state, grad_y.to(ctx.y_dtype).contiguous())


def moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: ExpertWeights,
    config: MoEConfig,
    *,
    group: dist.ProcessGroup | None = None,
    backend: str = "reference",
    check_values: bool = True,
) -> torch.Tensor:
    """Autograd-enabled MoE: gradients flow to x, topk_weights and the weights.

    Through the custom ops of :mod:`megamoe.ops`, so ``torch.compile(fullgraph=True)`` traces it
    without graph breaks (value checks are off in a compiled step: the kernels check on the
    device). The schedule is built inside; pass none (``forward`` takes one).
    """
    from . import ops

    return ops.moe(
        x,
        topk_ids,
        topk_weights,
        weights,
        config,
        group=group,
        backend=backend,
        check_values=check_values,
    )


def check(group: dist.ProcessGroup | None = None) -> None:
    """Raise what the device recorded since the last check: ``RoutingError`` (a step's ids were
    outside ``[0, E)``), ``CapacityError`` (a step routed more rows than a rank's capacity;
    every rank raises both) or ``StallError`` (a device wait gave up; fatal, see
    :class:`megamoe.errors.StallError`), for one-process steps on every device and for the
    expert-parallel workspaces of ``group`` (default: the world, when torch.distributed is
    initialized).

    The Triton backends check on their own at the next ``build_schedule``; call this where no
    schedule is built by the library, e.g. after replaying a captured CUDA graph. A host sync.
    """
    targets = [*checks.all_device_records(), *local_workspaces(), *cached_workspaces(group)]
    for target in targets:
        checks.check(target)
