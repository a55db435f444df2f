"""Work on a second stream beside the NVLink copies (``MoEConfig.overlap_shared``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from ..config import MoEConfig
from ..kernels.runtime import interpreting, persistent_programs, side_stream

__all__ = ["BesideCopies"]

_T = TypeVar("_T")


class BesideCopies:
    """Work on a second stream next to the NVLink copies of the current stream.

    The copies use ``config.copy_programs`` SMs and leave the others idle; GEMMs launched with
    :attr:`programs` (the rest) fill them, and both fit on the GPU at once whichever starts
    first. Off (``config.overlap_shared`` False, copies on more than half of the SMs, no CUDA,
    or under the interpreter), ``run`` calls in line with the default grid. ``run`` forks: the
    side stream first waits for everything queued on the current stream; ``join`` makes the
    current stream wait for the side work (callers join in a ``finally``: an error between fork
    and join must not leave a graph capture unjoined). Tensors made on the side stream are
    recorded on the current one (allocator safety). Graph capture records the fork and join as
    event edges.
    """

    def __init__(self, device: torch.device, config: MoEConfig) -> None:
        self.enabled = config.overlap_shared and device.type == "cuda" and not interpreting()
        self.programs = None
        if self.enabled:
            sms = persistent_programs(device)
            self.programs = sms - config.copy_programs
            # Copies on most of the GPU leave too little beside them: run the GEMMs after.
            self.enabled = self.programs * 2 >= sms
        if self.enabled:
            self.main = torch.cuda.current_stream(device)
            self.side = side_stream(device)
        else:
            self.programs = None

    def run(self, fn: Callable[..., _T], *args, **kwargs) -> _T:
        if not self.enabled:
            return fn(*args, **kwargs)
        self.side.wait_stream(self.main)
        with torch.cuda.stream(self.side):
            out = fn(*args, programs=self.programs, **kwargs)
        for t in _tensors(out):
            t.record_stream(self.main)
        return out

    def join(self) -> None:
        if self.enabled:
            self.main.wait_stream(self.side)


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []
