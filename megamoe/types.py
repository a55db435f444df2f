"""Plain containers passed between the functional API and the backends."""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = [
    "ExpertWeights",
    "MoEGrads",
    "RoutedActivations",
    "SharedActivations",
    "stacked_gate_up",
]


def stacked_gate_up(w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor | None:
    """The ``[E, 2I, H]`` tensor whose two halves along dim 1 are ``w_gate`` and ``w_up`` (views
    made by slicing it, as :meth:`ExpertWeights.from_gate_up` does), or None when they are not.

    The kernels read such views in place; the custom ops take the stacked tensor itself, so its
    gradient arrives as one tensor, written in place by the weight-gradient kernels."""
    base = w_gate._base
    if base is None or w_up._base is not base or w_gate.dim() != 3:
        return None
    e, i, h = w_gate.shape
    if tuple(w_up.shape) != (e, i, h) or tuple(base.shape) != (e, 2 * i, h):
        return None
    if w_gate.stride() != base.stride() or w_up.stride() != base.stride():
        return None
    offset = base.storage_offset()
    if w_gate.storage_offset() != offset or w_up.storage_offset() != offset + i * base.stride(1):
        return None
    return base


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

    @classmethod
    def from_gate_up(
        cls,
        w_gate_up: torch.Tensor,
        w_down: torch.Tensor,
        s_gate: torch.Tensor | None = None,
        s_up: torch.Tensor | None = None,
        s_down: torch.Tensor | None = None,
    ) -> "ExpertWeights":
        """Weights with gate and up stacked in one ``[E_local, 2I, H]`` tensor (first the I gate
        rows of each expert, then the I up rows: transformers' ``gate_up_proj``). No copy: the
        kernels read both halves from it, and its gradient comes as one ``[E_local, 2I, H]``
        tensor (:func:`stacked_gate_up`)."""
        if not isinstance(w_gate_up, torch.Tensor) or w_gate_up.dim() != 3:
            raise ValueError(
                "w_gate_up must be a 3-D [E_local, 2 * I, H] tensor, got "
                f"{getattr(w_gate_up, 'shape', type(w_gate_up).__name__)}"
            )
        if w_gate_up.shape[1] % 2:
            raise ValueError(
                f"w_gate_up must have an even dim 1 (gate rows, then as many up rows), got "
                f"{list(w_gate_up.shape)}"
            )
        i = w_gate_up.shape[1] // 2
        return cls(w_gate_up[:, :i], w_gate_up[:, i:], w_down, s_gate, s_up, s_down)


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

    @property
    def w_gate_up(self) -> torch.Tensor:
        """d of a stacked ``[E, 2I, H]`` gate/up weight: the tensor the two halves are views of
        when the weights were stacked (no copy), else the two concatenated."""
        stacked = stacked_gate_up(self.w_gate, self.w_up)
        return stacked if stacked is not None else torch.cat([self.w_gate, self.w_up], dim=1)


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
