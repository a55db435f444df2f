"""The schedule and the saved state of the Triton backends ("triton" and "fused" share them)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import MoEConfig
from ..ep.workspace import Workspace
from ..kernels.schedule import RowSchedule
from ..types import ExpertWeights, RoutedActivations, SharedActivations

__all__ = ["EpRouting", "TritonSchedule", "TritonContext", "workspace_of"]


@dataclass(frozen=True)
class EpRouting:
    """What an expert-parallel schedule adds: the workspace and every rank's routing."""

    workspace: Workspace
    all_ids: torch.Tensor  # [W*T, K] int32, the schedule's input (global slot order)
    capacity: int  # real routed rows one rank may hold
    # int32 [1], written by the capacity kernel: 1 when this schedule overflowed (then the
    # combines output NaN), else 0. None when nothing is checked (worst-case capacity).
    invalid: torch.Tensor | None = None


@dataclass(frozen=True)
class TritonSchedule:
    """Row layout of the routed experts (device tensors) plus the config it was built for;
    ``ep`` is None for one process."""

    routed: RowSchedule
    config: MoEConfig
    ep: EpRouting | None = None


@dataclass
class TritonContext:
    """What the backward reads. ``routed`` is None when a bounded ring dropped the routed rows
    (backend "fused"; its backward replays them)."""

    schedule: TritonSchedule
    x: torch.Tensor
    slot_weights: torch.Tensor  # router weights by global slot: [T*K] (W=1) or [W*T*K] (W>1)
    weights: ExpertWeights
    routed: RoutedActivations | None
    shared: SharedActivations | None


def workspace_of(target: TritonSchedule | TritonContext | Workspace) -> Workspace | None:
    """The workspace of a schedule, a context or a workspace; None for one process."""
    if isinstance(target, TritonContext):
        target = target.schedule
    if isinstance(target, TritonSchedule):
        return target.ep.workspace if target.ep is not None else None
    return target
