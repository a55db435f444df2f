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
    """The ``[E, 2I, H]`` tensor whose two halves along dim 1 are ``w_gate`` and ``w_up`` (the
    same storage, each expert's up rows I rows after its gate rows), or None when they are not.

    A layout test, blind to autograd: the backends use it to write a stacked gradient in place.
    The tensor that the halves were sliced from when it has exactly that shape (a gradient
    buffer), else a view of their storage."""
    if w_gate.dim() != 3 or w_up.shape != w_gate.shape or w_up.stride() != w_gate.stride():
        return None
    e, i, h = w_gate.shape
    s0, s1, s2 = w_gate.stride()
    if s2 != 1 or s0 != 2 * i * s1 or w_up.storage_offset() != w_gate.storage_offset() + i * s1:
        return None
    if w_up.untyped_storage().data_ptr() != w_gate.untyped_storage().data_ptr():
        return None
    base = w_gate._base
    if (
        base is not None
        and tuple(base.shape) == (e, 2 * i, h)
        and base.stride() == w_gate.stride()
        and base.storage_offset() == w_gate.storage_offset()
    ):
        return base
    return w_gate.as_strided((e, 2 * i, h), w_gate.stride())


class ExpertWeights(NamedTuple):
    """Weights of the experts one rank owns (and of the shared expert, or None).

    Layouts follow ``nn.Linear`` (out_features, in_features):
      w_gate, w_up  [E_local, I, H]     w_down [E_local, H, I]
      s_gate, s_up  [Is, H]             s_down [H, Is]
    or gate and up stacked (:meth:`from_gate_up`): ``w_gate [E_local, 2I, H]`` and ``w_up``
    None. The layer reads the stacked weight in place and gives it one gradient tensor.
    """

    w_gate: torch.Tensor
    w_up: torch.Tensor | None
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
        rows of each expert, then the I up rows: transformers' ``gate_up_proj``). Nothing is
        copied: the kernels read both halves in place, and the custom ops take the stacked
        tensor itself, so its gradient is one ``[E_local, 2I, H]`` tensor (written in place)."""
        weights = cls(w_gate_up, None, w_down, s_gate, s_up, s_down)
        weights.split_gate_up()  # validates the stacked weight
        return weights

    def split_gate_up(self) -> "ExpertWeights":
        """These weights with a stacked gate/up weight as its two halves (views; no copy), the
        form the backends take; separate weights unchanged."""
        if self.w_up is not None:
            return self
        w = self.w_gate
        if not isinstance(w, torch.Tensor) or w.dim() != 3:
            raise ValueError(
                "w_gate_up (w_gate with w_up None) must be a 3-D [E_local, 2 * I, H] tensor, got "
                f"{list(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__}"
            )
        if w.shape[1] % 2:
            raise ValueError(
                "w_gate_up (w_gate with w_up None) must have an even dim 1 (I gate rows, then "
                f"I up rows), got {list(w.shape)}"
            )
        i = w.shape[1] // 2
        return self._replace(w_gate=w[:, :i], w_up=w[:, i:])


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
        (the backends write it in place for a stacked weight), else the two concatenated."""
        stacked = stacked_gate_up(self.w_gate, self.w_up)
        return stacked if stacked is not None else torch.cat([self.w_gate, self.w_up], dim=1)


class RoutedActivations(NamedTuple):
    """The routed rows of one forward in the schedule's row layout: the gathered or pulled
    inputs ``xs [rows, H]`` (with ``precision="fp8"`` their packed 1x128 quantization, ``[rows,
    fp8.packed_width(H)]`` int16), ``g, u, h [rows, I]`` (gate, up, SwiGLU; in fp8 ``h`` is
    what the weight gradient of down reads, h^T 128x1-quantized as packed rows ``[I,
    fp8.packed_width(rows)]``) and the down projection ``z [rows, H]``; the backward reads
    them."""

    xs: torch.Tensor
    g: torch.Tensor
    u: torch.Tensor
    h: torch.Tensor
    z: torch.Tensor


class SharedActivations(NamedTuple):
    """The shared expert's ``g, u, h [T, Is]`` over the local tokens (token order; in fp8
    ``h`` as :class:`RoutedActivations`' is: ``[Is, fp8.packed_width(T rounded up to 16)]``)."""

    g: torch.Tensor
    u: torch.Tensor
    h: torch.Tensor
