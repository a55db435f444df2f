"""The fused kernels: one persistent kernel per pass (the forward, and the backward's expert
GEMMs with, at W > 1, its dy pull and d_x push), built from shared parts.

  tasks      the task list and its tickets (pure index arithmetic)
  sync       the flag buffer, release/acquire counters and waits with the watchdog
  trace      per-program event traces
  roles      the comm roles (pulls, pushes) and compute roles (tiles taken by ticket)
  plan       every launch size, lag and grid derived on the host
  residency  two kernels side by side on every SM (the comm kernel)
  forward    the forward's kernels and launcher
  backward   the backward's kernel and launchers (W = 1, and W > 1 with its communication)
"""

from .backward import FusedGrads, SharedBackwardInputs, fused_backward, fused_backward_ep
from .forward import FusedOutputs, fused_forward
from .plan import (
    BackwardMeta,
    BackwardPlan,
    FusedMeta,
    FusedPlan,
    backward_lag_for,
    comm_kernel_programs,
    comm_programs_for,
    down_lag_for,
    fused_grid,
    plan_backward,
    plan_launch,
    routed_lag,
)
from .sync import BackwardFlagLayout, FlagLayout, backward_flag_layout, flag_layout
from .trace import TRACE_KINDS, new_trace

__all__ = [
    "FusedOutputs",
    "fused_forward",
    "FusedGrads",
    "SharedBackwardInputs",
    "fused_backward",
    "fused_backward_ep",
    "BackwardMeta",
    "BackwardPlan",
    "plan_backward",
    "backward_lag_for",
    "BackwardFlagLayout",
    "backward_flag_layout",
    "FusedMeta",
    "FusedPlan",
    "plan_launch",
    "comm_kernel_programs",
    "comm_programs_for",
    "down_lag_for",
    "fused_grid",
    "routed_lag",
    "FlagLayout",
    "flag_layout",
    "TRACE_KINDS",
    "new_trace",
]
