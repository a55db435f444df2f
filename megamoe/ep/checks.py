"""When the device's error records become Python exceptions, without stalling the stream.

Kernels record errors (a stalled wait, a capacity overflow, a bad expert id) in small device
records (``megamoe.errors``); reading them is a host sync. The check mode (``MEGAMOE_EP_CHECK``):

  lagged (default)  at each ``build_schedule``, the records as of the previous one, through an
                    async copy: never stalls the stream, errors show <= 2 steps late
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
    CapacityError,
    CapacityWord,
    ErrorWord,
    describe_capacity,
)
from .workspace import Workspace, take_stall

__all__ = [
    "CHECK_ENV",
    "CHECK_MODES",
    "EpState",
    "state",
    "check",
    "lagged_check",
    "eager_check",
    "capturing",
]

CHECK_ENV = "MEGAMOE_EP_CHECK"
CHECK_MODES = ("lagged", "eager", "off")


@dataclass(eq=False)
class EpState:
    """Host and device state of the expert-parallel protocol on one workspace (shared by every
    layer that uses it)."""

    capacity_record: torch.Tensor  # int32 [CAPACITY_WORDS], set by the capacity kernel
    host_words: torch.Tensor  # (pinned) copy of the stall and capacity records, for lagged checks
    snapshot: torch.cuda.Event | None = None
    snapshot_pending: bool = False
    # The peers may still read our routing_ids (published by the last build_schedule, which ends
    # without a barrier): the next build_schedule must pass a barrier before overwriting them.
    routing_in_use: bool = False


_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def state(ws: Workspace) -> EpState:
    """The protocol state of ``ws`` (created on first use)."""
    found = _STATES.get(ws)
    if found is None:
        pinned = ws.device.type == "cuda"
        found = EpState(
            capacity_record=torch.zeros(CAPACITY_WORDS, dtype=torch.int32, device=ws.device),
            host_words=torch.zeros(
                ERROR_WORDS + CAPACITY_WORDS, dtype=torch.int32, pin_memory=pinned
            ),
        )
        _STATES[ws] = found
    return found


def _device_words(ws: Workspace) -> torch.Tensor:
    return torch.cat([ws.errors, state(ws).capacity_record])


def capturing(ws: Workspace) -> bool:
    """True while the current stream of the workspace's device is being captured in a graph."""
    return ws.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _raise_if_recorded(ws: Workspace, snapshot: list[int] | None = None) -> None:
    """Raise what the device records (stall record, then capacity record) hold, clearing them.

    ``snapshot``: an earlier copy of the words (the lagged check). Only when it shows an error
    are the live records read (blocking) and cleared, so an overflow recorded after the
    snapshot is counted in this report instead of being wiped unseen. None: read them live.
    A capacity error leaves the workspace usable; a stall does not (see ``StallError``).
    """
    if (
        snapshot is not None
        and snapshot[ErrorWord.FLAG] == 0
        and snapshot[ERROR_WORDS + CapacityWord.FLAG] == 0
    ):
        return
    words = _device_words(ws).tolist()  # blocking: everything queued so far has run
    cap = words[ERROR_WORDS:]
    stall = take_stall(ws, words[:ERROR_WORDS])  # the one stall decoder; clears a set record
    if cap[CapacityWord.FLAG]:
        state(ws).capacity_record.zero_()
    if stall is not None:
        if cap[CapacityWord.FLAG]:
            raise type(stall)(
                f"{stall} (The capacity record was set too: {describe_capacity(cap)})"
            )
        raise stall
    if cap[CapacityWord.FLAG]:
        raise CapacityError(describe_capacity(cap))


def check(ws: Workspace) -> None:
    """Raise what the device recorded on this workspace since the last check.

    :class:`~megamoe.errors.CapacityError` when some rank was routed more rows than its
    capacity: every rank records it (the check runs on all ranks' routing), so every rank raises
    at the same check; the message counts the overflowed steps since the last check; the
    workspace stays usable. :class:`~megamoe.errors.StallError` when a wait of this rank gave up:
    recorded only on the rank that waited, so the ranks do not agree, and fatal: drop the
    workspace on every rank (``clear_workspace_cache()``) and let the next step rebuild it. The
    records are cleared as they are raised. A blocking read (host sync): call it at check
    points, never inside a captured graph.
    """
    _raise_if_recorded(ws)


def check_mode() -> str:
    mode = os.environ.get(CHECK_ENV, CHECK_MODES[0])
    if mode not in CHECK_MODES:
        raise ValueError(f"{CHECK_ENV} must be one of {list(CHECK_MODES)}, got {mode!r}")
    return mode


def lagged_check(ws: Workspace) -> None:
    """At a step start: raise what the previous snapshot holds, then snapshot the records again.

    The snapshot is an async copy into pinned memory after everything queued so far; waiting for
    it one step later never stalls the stream (the GPU is still busy with the step in between).
    Only when it shows an error are the live records read (a blocking read, once) before they
    are cleared, so overflows recorded since are counted, not lost. Capacity errors are recorded
    on every rank, so every rank raises them at the same call, before any barrier, and no peer
    is left waiting. A stall is recorded only on the rank that waited: that rank raises alone
    and its peers stall at their next barrier; it is fatal (see ``StallError``).
    """
    st = state(ws)
    if check_mode() == "off" or capturing(ws):
        return
    if st.snapshot_pending:
        if st.snapshot is not None:
            st.snapshot.synchronize()
        st.snapshot_pending = False
        _raise_if_recorded(ws, snapshot=st.host_words.tolist())
    st.host_words.copy_(_device_words(ws), non_blocking=True)
    if ws.device.type == "cuda":
        st.snapshot = torch.cuda.Event()
        st.snapshot.record()
    st.snapshot_pending = True


def eager_check(ws: Workspace) -> None:
    """With ``MEGAMOE_EP_CHECK=eager``: a blocking :func:`check` (outside graph capture)."""
    if check_mode() == "eager" and not capturing(ws):
        check(ws)
