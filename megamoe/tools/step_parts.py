"""Where a training step's device time goes: marks around a model's parts.

``train-bench --breakdown`` splits each timed step into the routed experts, the MoE blocks
(router, experts and shared expert), attention, the optimizer step and the rest (embedding,
norms, dense MLPs, LM head, loss and any time the GPU waited for the host). Each module of a
part gets a mark where its forward starts and ends and where its backward starts (the
gradient of its output arrives) and ends (the gradient of its input is complete): CUDA events
on the stream that runs the step, or host clocks on the CPU (where work runs as it is
issued). The backward marks are identity autograd functions on the module's tensor inputs
and outputs, positional or keyword, so a module called with keywords (as transformers calls
attention) is timed too. A part's time per step is the sum of its modules' intervals; the
stream runs the step in order, so the intervals of one part's modules do not overlap.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Iterable

import torch

__all__ = ["PartMarks", "find_parts", "sync_sites"]


class _Clock:
    """A timestamp now: a recorded CUDA event, or the host clock (ms) on the CPU."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def now(self):
        if not self.cuda:
            return time.perf_counter() * 1e3
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def ms(self, start, end) -> float:
        return start.elapsed_time(end) if self.cuda else end - start


class _Mark(torch.autograd.Function):
    """Identity whose backward calls ``on_backward`` (when the gradient reaches this point)."""

    @staticmethod
    def forward(ctx, x, on_backward):
        ctx.on_backward = on_backward
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.on_backward()
        return grad, None


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``value`` with ``fn`` applied to every tensor that requires grad (in tuples, lists and
    plain dicts)."""
    if isinstance(value, torch.Tensor):
        return fn(value) if value.requires_grad else value
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_map_tensors(v, fn) for v in value)
    if isinstance(value, list):
        return [_map_tensors(v, fn) for v in value]
    if type(value) is dict:  # keyword arguments (not a ModelOutput: its fields stay)
        return {k: _map_tensors(v, fn) for k, v in value.items()}
    return value


class PartMarks:
    """Marks on the modules of named parts (``{part: [modules]}``) and around the optimizer
    step. ``begin_step()`` / ``end_step()`` bracket each step to measure; steps outside them
    are not recorded. ``remove()`` takes every hook off."""

    def __init__(self, parts: dict[str, list[torch.nn.Module]], cuda: bool):
        self.clock = _Clock(cuda)
        self.parts = {name: list(mods) for name, mods in parts.items()}
        self._open: list[tuple[str, str, Any]] | None = None  # (part, which, stamp) of a step
        self._steps: list[list[tuple[str, str, Any]]] = []
        self._handles = []
        for name, mods in self.parts.items():
            for mod in mods:
                self._hook(name, mod)

    def _stamp(self, part: str, which: str) -> None:
        if self._open is not None:
            self._open.append((part, which, self.clock.now()))

    def _hook(self, part: str, mod: torch.nn.Module) -> None:
        def pre(_mod, args, kwargs):
            self._stamp(part, "fwd_start")
            if self._open is None or not torch.is_grad_enabled():
                return None

            def wrap(t):
                return _Mark.apply(t, lambda: self._stamp(part, "bwd_end"))

            return _map_tensors(args, wrap), _map_tensors(kwargs, wrap)

        def post(_mod, _args, _kwargs, output):
            self._stamp(part, "fwd_end")
            if self._open is None or not torch.is_grad_enabled():
                return None
            first = [True]

            def on_backward():
                if first[0]:  # the first output gradient that arrives starts the backward
                    first[0] = False
                    self._stamp(part, "bwd_start")

            return _map_tensors(output, lambda t: _Mark.apply(t, on_backward))

        self._handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
        self._handles.append(mod.register_forward_hook(post, with_kwargs=True))

    def begin_step(self) -> None:
        self._open = [("step", "start", self.clock.now())]

    def optimizer_start(self) -> None:
        self._stamp("optimizer", "start")

    def optimizer_end(self) -> None:
        self._stamp("optimizer", "end")

    def end_step(self) -> None:
        self._stamp("step", "end")
        self._steps.append(self._open)
        self._open = None

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def step_parts_ms(self, stamps: list[tuple[str, str, Any]]) -> dict[str, float]:
        """One step's ms per part: a module's forward (start to end) plus its backward (the
        first output-gradient mark to the last input-gradient mark of the same call, the
        calls matched in reverse order: the backward runs the calls last to first)."""
        clock = self.clock
        total = {name: 0.0 for name in (*self.parts, "optimizer")}
        open_fwd: dict[str, list] = {}
        bwd_starts: dict[str, list] = {}
        bwd_end: dict[str, Any] = {}
        for part, which, stamp in stamps:
            if which == "fwd_start":
                open_fwd.setdefault(part, []).append(stamp)
            elif which == "fwd_end":
                total[part] += clock.ms(open_fwd[part].pop(), stamp)
            elif which == "bwd_start":
                if part in bwd_starts and part in bwd_end:  # the previous call's backward ended
                    total[part] += clock.ms(bwd_starts[part].pop(), bwd_end.pop(part))
                bwd_starts.setdefault(part, []).append(stamp)
            elif which == "bwd_end":
                bwd_end[part] = stamp  # the last input gradient of the call in flight
            elif part == "optimizer":
                open_fwd.setdefault("optimizer", []).append(stamp)
                if which == "end":
                    start, end = open_fwd.pop("optimizer")
                    total["optimizer"] += clock.ms(start, end)
        for part, end in bwd_end.items():
            if bwd_starts.get(part):
                total[part] += clock.ms(bwd_starts[part].pop(), end)
        total["step"] = clock.ms(stamps[0][2], stamps[-1][2])
        return total

    def summary(self, top_level: Iterable[str]) -> dict[str, float]:
        """The median over the recorded steps of each part's ms, and ``rest``: the step less
        the ``top_level`` parts (those that do not nest in each other) and the optimizer."""
        if self.clock.cuda:
            torch.cuda.synchronize()
        per_step = [self.step_parts_ms(s) for s in self._steps]
        if not per_step:
            return {}
        top = list(top_level)
        for p in per_step:
            p["rest"] = p["step"] - p["optimizer"] - sum(p[name] for name in top)
        return {k: float(statistics.median(p[k] for p in per_step)) for k in per_step[0]}


def find_parts(model: torch.nn.Module, moe_blocks: list[torch.nn.Module]) -> dict[str, list]:
    """A transformers decoder's parts: ``experts`` (the MoE blocks' routed experts),
    ``moe_block`` (the MoE blocks) and ``attention`` (every ``self_attn``)."""
    return {
        "experts": [b.experts for b in moe_blocks],
        "moe_block": list(moe_blocks),
        "attention": [m.self_attn for m in model.modules() if hasattr(m, "self_attn")],
    }


def sync_sites(step: Callable[[], None]) -> dict[str, int]:
    """Run ``step`` with PyTorch's CUDA sync debug mode on: ``{"file:line": count}`` of the
    Python lines that made the host wait for the GPU (empty on the CPU or without syncs)."""
    import warnings

    if not torch.cuda.is_available():
        step()
        return {}
    sites: dict[str, int] = {}
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    for w in caught:
        if "synchroniz" in str(w.message):
            site = f"{w.filename}:{w.lineno}"
            sites[site] = sites.get(site, 0) + 1
    return sites
