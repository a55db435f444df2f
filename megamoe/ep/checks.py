"""When the device's error records become Python exceptions, without stalling the stream.

Kernels record errors (a stalled wait, a capacity overflow, a bad expert id) in small device
records (``megamoe.errors``); reading them is a host sync. The records of one check point are a
:class:`Records`: a workspace's (W > 1) or a device's (W = 1; its one-rank workspaces report into
it too). The check mode (``MEGAMOE_EP_CHECK``):

  lagged (default)  at each ``build_schedule``, the records as of an earlier step, through an
                    async copy the host reads once the GPU has made it: the host never waits
                    for the GPU, errors show at the first check after their step ran
  eager             also a blocking check at the end of every forward and backward (debugging)
  off               never automatically; call :func:`check` yourself

Nothing here runs while a CUDA graph is captured (a host read is impossible there); call
``megamoe.functional.check`` after replays.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass

import torch

from ..errors import (
    CAPACITY_WORDS,
    ERROR_WORDS,
    ID_WORDS,
    CapacityError,
    CapacityWord,
    ErrorWord,
    IdWord,
    RoutingError,
    describe_capacity,
    describe_ids,
)
from .workspace import Workspace, take_stall

__all__ = [
    "CHECK_ENV",
    "CHECK_MODES",
    "Records",
    "records",
    "device_records",
    "check",
    "lagged_check",
    "eager_check",
    "capturing",
    "check_mode",
    "all_device_records",
]

CHECK_ENV = "MEGAMOE_EP_CHECK"
CHECK_MODES = ("lagged", "eager", "off")


@dataclass(eq=False)
class Records:
    """The error records of one check point, and the protocol state kept with them.

    ``stall`` is the workspace's stall record (``Workspace.errors``; a device's own for W = 1),
    ``capacity`` and ``ids`` the records the schedule checks write (``kernels.checks``).
    """

    device: torch.device
    world_size: int
    stall: torch.Tensor  # int32 [ERROR_WORDS]
    capacity: torch.Tensor  # int32 [CAPACITY_WORDS]
    ids: torch.Tensor  # int32 [ID_WORDS]
    host_words: torch.Tensor  # (pinned) copy of all three, for lagged checks
    workspace: Workspace | None = None
    snapshot: torch.cuda.Event | None = None
    snapshot_pending: bool = False
    # The peers may still read our routing_ids (published by the last build_schedule, which ends
    # without a barrier): the next build_schedule must pass a barrier before overwriting them.
    routing_in_use: bool = False

    def device_words(self) -> torch.Tensor:
        return torch.cat([self.stall, self.capacity, self.ids])


def _new_records(
    device: torch.device, world_size: int, stall: torch.Tensor | None, workspace: Workspace | None
) -> Records:
    zeros = lambda n: torch.zeros(n, dtype=torch.int32, device=device)  # noqa: E731
    return Records(
        device=device,
        world_size=world_size,
        stall=zeros(ERROR_WORDS) if stall is None else stall,
        capacity=zeros(CAPACITY_WORDS),
        ids=zeros(ID_WORDS),
        host_words=torch.zeros(
            ERROR_WORDS + CAPACITY_WORDS + ID_WORDS,
            dtype=torch.int32,
            pin_memory=device.type == "cuda",
        ),
        workspace=workspace,
    )


_BY_WORKSPACE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_BY_DEVICE: dict[torch.device, Records] = {}


def records(ws: Workspace) -> Records:
    """The records of an expert-parallel workspace (created on first use)."""
    found = _BY_WORKSPACE.get(ws)
    if found is None:
        found = _BY_WORKSPACE[ws] = _new_records(ws.device, ws.world_size, ws.errors, ws)
    return found


def device_records(device: torch.device) -> Records:
    """The records of one-process steps on ``device`` (created on first use)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    found = _BY_DEVICE.get(device)
    if found is None:
        found = _BY_DEVICE[device] = _new_records(device, 1, None, None)
    return found


def all_device_records() -> list[Records]:
    return list(_BY_DEVICE.values())


def capturing(device: torch.device) -> bool:
    """True while the current stream of ``device`` is being captured in a graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _clear_stall(rec: Records, words: list[int]):
    if rec.workspace is not None:
        return take_stall(rec.workspace, words)  # the one stall decoder; clears a set record
    if words[ErrorWord.FLAG] == 0:
        return None
    from ..errors import StallError, describe_stall

    rec.stall.zero_()
    return StallError(describe_stall(words))


def _raise_if_recorded(rec: Records, snapshot: list[int] | None = None) -> None:
    """Raise what the records hold (stall, then bad ids, then capacity), clearing them.

    ``snapshot``: an earlier copy of the words (the lagged check). Only when it shows an error
    are the live records read (blocking) and cleared, so an error recorded after the snapshot
    is counted in this report instead of being wiped unseen. None: read them live. A capacity
    or id error leaves the workspace usable; a stall does not (see ``StallError``).
    """
    flags = (
        ErrorWord.FLAG,
        ERROR_WORDS + CapacityWord.FLAG,
        ERROR_WORDS + CAPACITY_WORDS + IdWord.FLAG,
    )
    if snapshot is not None and not any(snapshot[f] for f in flags):
        return
    words = rec.device_words().tolist()  # blocking: everything queued so far has run
    cap = words[ERROR_WORDS : ERROR_WORDS + CAPACITY_WORDS]
    ids = words[ERROR_WORDS + CAPACITY_WORDS :]
    stall = _clear_stall(rec, words[:ERROR_WORDS])
    if cap[CapacityWord.FLAG]:
        rec.capacity.zero_()
    if ids[IdWord.FLAG]:
        rec.ids.zero_()
    others = [describe_ids(ids, rec.world_size)] if ids[IdWord.FLAG] else []
    others += [describe_capacity(cap)] if cap[CapacityWord.FLAG] else []
    if stall is not None:
        if others:
            raise type(stall)(f"{stall} (Recorded too: {' '.join(others)})")
        raise stall
    if ids[IdWord.FLAG]:
        extra = f" (Recorded too: {others[1]})" if len(others) > 1 else ""
        raise RoutingError(others[0] + extra)
    if cap[CapacityWord.FLAG]:
        raise CapacityError(others[0])


def check(rec: Records | Workspace) -> None:
    """Raise what the device recorded at this check point since the last check.

    :class:`~megamoe.errors.RoutingError` when a step's ids were outside ``[0, E)`` and
    :class:`~megamoe.errors.CapacityError` when some rank was routed more rows than its
    capacity: every rank records these (each checks all ranks' routing), so every rank raises
    at the same check; the message counts the bad steps since the last check; the workspace
    stays usable. :class:`~megamoe.errors.StallError` when a wait of this rank gave up: recorded
    only on the rank that waited, so the ranks do not agree, and fatal: drop the workspace on
    every rank (``clear_workspace_cache()``) and let the next step rebuild it. The records are
    cleared as they are raised. A blocking read (host sync): call it at check points, never
    inside a captured graph.
    """
    _raise_if_recorded(records(rec) if isinstance(rec, Workspace) else rec)


def check_mode() -> str:
    mode = os.environ.get(CHECK_ENV, CHECK_MODES[0])
    if mode not in CHECK_MODES:
        raise ValueError(f"{CHECK_ENV} must be one of {list(CHECK_MODES)}, got {mode!r}")
    return mode


def lagged_check(rec: Records | Workspace) -> None:
    """At a step start: raise what the last snapshot holds if the GPU has made it, then take a
    new snapshot; while the last one is still pending (the host runs ahead), do nothing.

    The snapshot is an async copy into pinned memory after everything queued so far; the host
    only asks whether it has landed (``Event.query``): no step ever waits for the GPU. Only when
    it shows an error are the live records read (a blocking read, once) before they are
    cleared, so errors recorded since are counted, not lost. Capacity and id errors are recorded
    on every rank, and a rank's GPU reaches the snapshot at the same step of the protocol on
    every rank, so the ranks raise them at the same step unless their hosts run ahead by
    different amounts (call :func:`check` on every rank where they must agree). A stall is
    recorded only on the rank that waited: that rank raises alone and its peers stall at their
    next barrier; it is fatal (see ``StallError``).
    """
    rec = records(rec) if isinstance(rec, Workspace) else rec
    if check_mode() == "off" or capturing(rec.device):
        return
    if rec.snapshot_pending:
        if rec.snapshot is not None and not rec.snapshot.query():
            return  # the GPU is behind: look again at the next step
        rec.snapshot_pending = False
        _raise_if_recorded(rec, snapshot=rec.host_words.tolist())
    rec.host_words.copy_(rec.device_words(), non_blocking=True)
    if rec.device.type == "cuda":
        rec.snapshot = torch.cuda.Event()
        rec.snapshot.record()
    rec.snapshot_pending = True


def eager_check(rec: Records | Workspace) -> None:
    """With ``MEGAMOE_EP_CHECK=eager``: a blocking :func:`check` (outside graph capture)."""
    rec = records(rec) if isinstance(rec, Workspace) else rec
    if check_mode() == "eager" and not capturing(rec.device):
        check(rec)
