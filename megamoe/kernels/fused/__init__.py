"""The fused kernels: one persistent kernel per pass (today the forward), built from parts a
fused backward reuses.

  tasks      the task list and its tickets (pure index arithmetic)
  sync       the flag buffer, release/acquire counters and waits with the watchdog
  trace      per-program event traces
  roles      the comm roles (pulls, pushes) and compute roles (tiles taken by ticket)
  plan       every launch size, lag and grid derived on the host
  residency  two kernels side by side on every SM (the comm kernel)
  forward    the forward's kernels and launcher
"""

from .forward import FusedOutputs, fused_forward
from .plan import (
    FusedMeta,
    FusedPlan,
    comm_kernel_programs,
    comm_programs_for,
    down_lag_for,
    fused_grid,
    plan_launch,
    routed_lag,
)
from .sync import FlagLayout, flag_layout
from .trace import TRACE_KINDS, new_trace

__all__ = [
    "FusedOutputs",
    "fused_forward",
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
