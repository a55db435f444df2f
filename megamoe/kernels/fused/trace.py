"""Per-program event traces of a fused launch (``fused_forward(trace=...)``,
``megamoe.tools.fused_trace``): one (kind << 32 | index, start ns, end ns) per event."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..runtime import persistent_programs

__all__ = [
    "TRACE_KINDS",
    "new_trace",
    "clock",
    "trace_start",
    "trace_end",
    "TRACE_PULL",
    "TRACE_SHARED_GATE_UP",
    "TRACE_SHARED_DOWN",
    "TRACE_GATE_UP",
    "TRACE_DOWN",
]

# Event kinds of a traced launch.
TRACE_KINDS = {0: "pull", 1: "shared gate/up", 2: "shared down", 3: "gate/up", 4: "down"}
TRACE_PULL = tl.constexpr(0)
TRACE_SHARED_GATE_UP = tl.constexpr(1)
TRACE_SHARED_DOWN = tl.constexpr(2)
TRACE_GATE_UP = tl.constexpr(3)
TRACE_DOWN = tl.constexpr(4)


def new_trace(device: torch.device, events: int = 4096) -> torch.Tensor:
    """An empty trace ``[programs, events, 3]`` int64: -1 marks events never written."""
    return torch.full(
        (persistent_programs(device), events, 3), -1, dtype=torch.int64, device=device
    )


@triton.jit
def clock(TRACE: tl.constexpr):
    """The GPU's global nanosecond timer when tracing (one read per event), else 0."""
    if TRACE:
        t = tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;",
            "=l,r",
            [tl.full([1], 0, tl.int32)],
            dtype=tl.int64,
            is_pure=False,
            pack=1,
        )
        return tl.sum(t, axis=0)
    else:
        return 0


@triton.jit
def trace_start(trace, slot, TRACE: tl.constexpr):
    """Start event ``slot`` of this program in ``trace = (ptr [programs, max_events, 3] int64,
    max_events)``: its start time goes to memory at once, so no timer value stays live across
    the task."""
    if TRACE:
        trace_ptr, max_events = trace
        if slot < max_events:
            at = trace_ptr + (tl.program_id(0).to(tl.int64) * max_events + slot) * 3
            tl.store(at + 1, clock(TRACE))


@triton.jit
def trace_end(trace, slot, kind, index, TRACE: tl.constexpr):
    """End event ``slot``: (kind << 32 | index) and the end time; past ``max_events`` dropped."""
    if TRACE:
        trace_ptr, max_events = trace
        if slot < max_events:
            at = trace_ptr + (tl.program_id(0).to(tl.int64) * max_events + slot) * 3
            tl.store(at + 2, clock(TRACE))
            tl.store(at, (tl.cast(kind, tl.int64) << 32) | tl.cast(index, tl.int64))
