"""AdamW whose update also writes the fp8 layers' weight copies (docs/fp8.md, "The optimizer
writes the fp8 copies").

An fp8 layer (``MoEConfig(precision="fp8")``) reads 128x128-block E4M3 copies of its expert
weights in both layouts, and every optimizer step changes them: quantized by a pass of their
own in the first forward after the step, they cost 4 bytes an element of a bf16 weight (2.1 ms
of an H100's dsv3 layer step). :class:`AdamW` quantizes each of those weights from the
registers of its own update (``kernels.adamw``) and hands the copies to the layer's cache
(``backends.fp8_weights``), for 2 bytes an element, so the next forward reads them as they are::

    opt = megamoe.optim.AdamW(
        model.parameters(), lr=3e-4, fp8_views=megamoe.optim.fp8_weight_views(model)
    )

Every other parameter gets the same update without copies. The arithmetic is torch's fused
AdamW's (``kernels.adamw``), and the state (``step``, ``exp_avg``, ``exp_avg_sq``) is laid out as
``torch.optim.AdamW``'s, so state dicts move between the two.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

import torch
from torch import nn

from .backends import fp8_weights
from .kernels import adamw as kernels
from .kernels.runtime import interpreting

__all__ = ["AdamW", "fp8_weight_views", "parameters_of"]


def fp8_weight_views(model: nn.Module) -> list[torch.Tensor]:
    """The expert-weight views of every fp8 layer in ``model`` whose copies the layer keeps
    (``megamoe.MoE.fp8_weight_views``, and transformers experts modules running a megamoe fp8
    key: ``integrations.transformers.fp8_weight_views``); layers that quantize for each call
    (``fp8_weight_cache`` off, FSDP2-sharded) have none."""
    hf = sys.modules.get("megamoe.integrations.transformers")
    views: list[torch.Tensor] = []
    for module in model.modules():
        own = getattr(module, "fp8_weight_views", None)
        if callable(own):
            views += own()
        elif hf is not None:
            views += hf.fp8_weight_views(module)
    return views


def parameters_of(views: list[torch.Tensor], params) -> list[torch.Tensor]:
    """The parameters among ``params`` that ``views`` are views of (each once, in ``params``'
    order): those to give :class:`AdamW` with the views, the rest to another optimizer."""
    return [p for p in params if any(_rows_of(view, p) is not None for view in views)]


def _rows_of(view: torch.Tensor, p: torch.Tensor) -> tuple[int, int] | None:
    """(first, count) of the rows (dim 1) of ``p`` that ``view`` is (``p[:, a:b]`` of a 3-D
    parameter, ``p[None]`` of a 2-D one), or None when it is not such a view of ``p``."""
    if view.dtype != p.dtype or view.untyped_storage()._cdata != p.untyped_storage()._cdata:
        return None
    offset = view.storage_offset() - p.storage_offset()
    if p.dim() == 2:
        ok = view.shape == (1, *p.shape) and view.stride()[1:] == p.stride() and offset == 0
        return (0, p.shape[0]) if ok else None
    if p.dim() != 3 or view.stride() != p.stride():
        return None
    if (view.shape[0], view.shape[2]) != (p.shape[0], p.shape[2]) or p.stride(1) == 0:
        return None
    first, rest = divmod(offset, p.stride(1))
    if rest or first < 0 or first + view.shape[1] > p.shape[1]:
        return None
    return first, view.shape[1]


def _same_layout(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``t`` with ``p``'s strides (a copy when they differ)."""
    if t.stride() == p.stride():
        return t
    return torch.empty_like(p, dtype=t.dtype).copy_(t)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2), else ``t``."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


class AdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) in Triton kernels; the parameters behind ``fp8_views``
    (:func:`fp8_weight_views`) also get their fp8 copies written by the update.

    Args:
        params: parameters or parameter groups, as for ``torch.optim.AdamW``.
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW``'s (amsgrad, maximize, capturable
            and a tensor lr are not supported).
        fp8_views: the [E, N, K] views the fp8 layers quantize, of parameters in ``params``:
            whole 3-D parameters, row ranges of one (the halves of a stacked gate/up weight),
            ``p[None]`` of a 2-D one (a shared expert's). Those of one parameter must cover it.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        fp8_views: Iterable[torch.Tensor] = (),
    ) -> None:
        for name, value, ok, want in (
            ("lr", lr, lambda x: x >= 0, ">= 0"),
            ("betas[0]", betas[0], lambda x: 0 <= x < 1, "in [0, 1)"),
            ("betas[1]", betas[1], lambda x: 0 <= x < 1, "in [0, 1)"),
            ("eps", eps, lambda x: x >= 0, ">= 0"),
            ("weight_decay", weight_decay, lambda x: x >= 0, ">= 0"),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
                raise ValueError(f"{name} must be a float {want}, got {value!r}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self._views = self._plan(list(fp8_views))

    def _plan(self, views: list[torch.Tensor]) -> dict[int, list[torch.Tensor]]:
        """id(parameter) -> the views of it to quantize (checked: each a view the layer
        quantizes, together covering the parameter once)."""
        params = [p for group in self.param_groups for p in group["params"]]
        plan: dict[int, list[tuple[int, int, torch.Tensor]]] = {}
        for i, view in enumerate(views):
            if not isinstance(view, torch.Tensor) or view.dim() != 3:
                got = list(view.shape) if isinstance(view, torch.Tensor) else type(view).__name__
                raise ValueError(f"fp8_views[{i}] must be a 3-D [E, N, K] tensor, got {got}")
            if hasattr(view, "to_local"):
                raise ValueError(
                    f"fp8_views[{i}] is a DTensor: FSDP2-sharded layers quantize their gathered "
                    "weights for each call (fp8_weight_cache off), so they have no views here"
                )
            for p in params:
                rows = _rows_of(view, p)
                if rows is not None:
                    plan.setdefault(id(p), []).append((*rows, view))
                    break
            else:
                raise ValueError(
                    f"fp8_views[{i}] (shape {list(view.shape)}, strides {view.stride()}) is not a "
                    "whole 3-D parameter, a row range of one or p[None] of a 2-D one, among the "
                    "parameters this optimizer updates"
                )
        for p in params:
            spans = sorted(plan.get(id(p), []), key=lambda span: span[0])
            at = 0
            for first, count, _ in spans:
                if first != at:
                    break
                at += count
            if spans and at != (p.shape[1] if p.dim() == 3 else p.shape[0]):
                raise ValueError(
                    f"fp8_views of the parameter of shape {list(p.shape)} cover rows "
                    f"{[(f, f + c) for f, c, _ in spans]}: they must cover each row once"
                )
        return {key: [view for *_, view in spans] for key, spans in plan.items()}

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter with a gradient; the fp8 copies of those behind
        ``fp8_views`` go to the layers' cache (the next forward reads them)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr = group["lr"]
            if isinstance(lr, torch.Tensor):
                raise ValueError("lr must be a float, got a tensor (capturable is not supported)")
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, (lr, beta1, beta2, group["eps"], group["weight_decay"]))
        return loss

    def _update(self, param: torch.Tensor, hyper: tuple[float, ...]) -> None:
        p, g = _local(param), _local(param.grad)
        if g.is_sparse or p.is_complex():
            raise ValueError(
                f"megamoe.optim.AdamW updates dense real parameters, got a "
                f"{'sparse gradient' if g.is_sparse else p.dtype} for shape {list(p.shape)}"
            )
        if not (p.is_cuda or interpreting()):
            raise ValueError(
                f"megamoe.optim.AdamW runs Triton kernels: parameters must be on a CUDA device "
                f"(or TRITON_INTERPRET=1), got one on {p.device}"
            )
        if p.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("megamoe.optim.AdamW.step cannot be captured in a CUDA graph")
        state = self.state[param]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        for key in ("exp_avg", "exp_avg_sq"):
            state[key] = _same_layout(_local(state[key]), p)
        m, v = state["exp_avg"], state["exp_avg_sq"]
        g = _same_layout(g, p)
        state["step"] += 1
        step = kernels.AdamWStep(*hyper, step=int(state["step"].item()))
        views = self._views.get(id(param))
        if not views:
            kernels.adamw_(p, g, m, v, step)
            torch.autograd.graph.increment_version(p)
            return
        copies = []
        for view in views:
            offset = view.storage_offset() - p.storage_offset()
            g_, m_, v_ = (
                t.as_strided(view.shape, view.stride(), t.storage_offset() + offset)
                for t in (g, m, v)
            )
            copies.append((view, kernels.adamw_quantize_(view, g_, m_, v_, step)))
        torch.autograd.graph.increment_version(p)
        for view, weight in copies:  # (keyed at the version the update left)
            fp8_weights.CACHE.put(view, weight)
