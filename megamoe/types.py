"""Plain containers passed between the functional API and the backends."""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["ExpertWeights", "MoEGrads", "RoutedActivations", "SharedActivations"]


class ExpertWeights(NamedTuple):
    """Weights of the experts one rank owns (and of the shared expert, or None).

    Layouts follow ``nn.Linear`` (out_features, in_features):
      w_gate, w_up  [E_local, I, H]     w_down [E_local, H, I]
      s_gate, s_up  [Is, H]             s_down [H, Is]
    """

    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor
    s_gate: torch.Tensor | None = None
    s_up: torch.Tensor | None = None
    s_down: torch.Tensor | None = None

    @property
    def has_shared(self) -> bool:
        return self.s_gate is not None


class MoEGrads(NamedTuple):
    """Gradients of one MoE call: inputs, router weights and every weight (None where absent)."""

    x: torch.Tensor
    topk_weights: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor
    s_gate: torch.Tensor | None = None
    s_up: torch.Tensor | None = None
    s_down: torch.Tensor | None = None


class RoutedActivations(NamedTuple):
    """The routed rows of one forward in the schedule's row layout: the gathered or pulled
    inputs ``xs [rows, H]``, ``g, u, h [rows, I]`` (gate, up, SwiGLU) and the down projection
    ``z [rows, H]``; the backward reads them."""

    xs: torch.Tensor
    g: torch.Tensor
    u: torch.Tensor
    h: torch.Tensor
    z: torch.Tensor


class SharedActivations(NamedTuple):
    """The shared expert's ``g, u, h [T, Is]`` over the local tokens (token order)."""

    g: torch.Tensor
    u: torch.Tensor
    h: torch.Tensor
