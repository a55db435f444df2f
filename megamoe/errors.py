"""Errors the device records and Python raises: their exceptions, stage codes and record words.

Kernels never raise. A spin-wait that gives up writes the *stall record* (``ErrorWord``) of its
workspace; the capacity kernel writes the *capacity record* (``CapacityWord``); the id check of a
schedule writes the *id record* (``IdWord``). The host decodes them at its next check
(``megamoe.ep.checks``) into :class:`StallError`, :class:`CapacityError` and
:class:`RoutingError`. Every code and word offset lives here; the device functions use
``tl.constexpr`` copies of them.
"""

from __future__ import annotations

import enum

__all__ = [
    "StallError",
    "CapacityError",
    "RoutingError",
    "Stage",
    "ErrorWord",
    "ERROR_WORDS",
    "CapacityWord",
    "CAPACITY_WORDS",
    "IdWord",
    "ID_WORDS",
    "stage_name",
    "describe_stall",
    "describe_capacity",
    "describe_ids",
]


class StallError(RuntimeError):
    """A device spin-wait ran out of its iteration budget: a peer (or a program) never signalled.

    Fatal for the workspace. The stall is recorded only on the rank that waited (the peers may
    raise nothing, or raise later), that rank went on without the data it waited for, and the
    ranks' barrier epochs may now differ. Clearing the record does not repair that: drop the
    workspace collectively, ``megamoe.ep.workspace.clear_workspace_cache()`` on every rank
    (after the other ranks have stopped using it), and let the next call build a fresh one.
    """


class CapacityError(RuntimeError):
    """A rank was routed more rows than ``MoEConfig.capacity_factor`` allows.

    Recorded on every rank (each checks all ranks' loads), so every rank raises it at the same
    check. The overflowed steps computed no routed rows; their y, d_x and d topk_weights are NaN.
    The workspace stays usable: the next step that fits is exact.
    """


class RoutingError(ValueError):
    """A step's ``topk_ids`` held an expert id outside ``[0, num_experts)``.

    Found on the device by the schedule's id check (so also with ``check_values=False`` and
    inside captured graphs), on every rank (each checks all ranks' ids). The step computed no
    routed rows; its y, d_x and d topk_weights are NaN. The message names the first bad entry.
    """


class Stage(enum.IntEnum):
    """What a spin-wait waited for (the ``STAGE`` word of the stall record)."""

    BARRIER = 1
    ROWS_READY = 10
    H_READY = 11
    Z_READY = 12
    RING_FREE = 13
    SHARED_H_READY = 14
    CORESIDENT = 15
    DGU_READY = 16
    EXPERT_DGU_READY = 17
    SHARED_DGU_READY = 18
    SHARED_ALL_DGU_READY = 19
    DY_READY = 20
    DZ_READY = 21
    DX_READY = 22


_STAGE_TEXT = {
    Stage.BARRIER: "barrier",
    Stage.ROWS_READY: "fused forward: pulled rows of a minibatch",
    Stage.H_READY: "fused forward: h tiles of a row block",
    Stage.Z_READY: "fused forward (comm kernel): down tiles of a minibatch",
    Stage.RING_FREE: "fused forward: ring slot freed by the down tiles of its previous minibatch "
    "(index = the minibatch to pull into it)",
    Stage.SHARED_H_READY: "fused forward: shared-expert h tiles of a row block",
    Stage.CORESIDENT: "fused forward (comm kernel): every program of the compute and the comm "
    "kernel running at once (the flag counts the programs that started; the "
    "GPU did not run the two kernels side by side)",
    Stage.DGU_READY: "fused backward: d_g/d_u tiles of a row block",
    Stage.EXPERT_DGU_READY: "fused backward: d_g/d_u tiles of every row block of an expert "
    "(index = the expert)",
    Stage.SHARED_DGU_READY: "fused backward: shared-expert d_g/d_u tiles of a row block",
    Stage.SHARED_ALL_DGU_READY: "fused backward: shared-expert d_g/d_u tiles of every row block",
    Stage.DY_READY: "fused backward (W > 1): dy rows of a minibatch pulled from the source ranks",
    Stage.DZ_READY: "fused backward (W > 1): route-grad rows dz = w * dy of a row block",
    Stage.DX_READY: "fused backward (W > 1): d_x tiles of a row block, before their push to the "
    "source ranks",
}


class ErrorWord(enum.IntEnum):
    """Word offsets of a workspace's stall record (int32 [ERROR_WORDS]); FLAG != 0: recorded."""

    FLAG = 0
    STAGE = 1
    INDEX = 2
    PEER = 3
    RANK = 4
    SEEN = 5
    WANTED = 6
    BUDGET = 7


ERROR_WORDS = len(ErrorWord)


class CapacityWord(enum.IntEnum):
    """Word offsets of the capacity record (int32 [CAPACITY_WORDS]): the flag, the first
    overflow's offending rank, its routed rows and the capacity, then the number of overflowed
    schedules since the record was last cleared."""

    FLAG = 0
    RANK = 1
    ROWS = 2
    LIMIT = 3
    COUNT = 4


CAPACITY_WORDS = len(CapacityWord)


class IdWord(enum.IntEnum):
    """Word offsets of the id record (int32 [ID_WORDS]): the flag; the rank, token and k of the
    first bad id of the first bad step, its value and the number of global experts; then the
    number of bad steps since the record was last cleared."""

    FLAG = 0
    RANK = 1
    TOKEN = 2
    K = 3
    VALUE = 4
    EXPERTS = 5
    COUNT = 6


ID_WORDS = len(IdWord)


def stage_name(code: int) -> str:
    try:
        return _STAGE_TEXT[Stage(code)]
    except ValueError:
        return f"stage {code}"


def describe_stall(words: list[int]) -> str:
    """The message of a recorded stall (``words``: the stall record)."""
    w = ErrorWord
    return (
        f"rank {words[w.RANK]} stalled in {stage_name(words[w.STAGE])} (index "
        f"{words[w.INDEX]}) waiting for peer {words[w.PEER]}: flag was {words[w.SEEN]}, "
        f"wanted >= {words[w.WANTED]}, gave up after {words[w.BUDGET]} polls. The peer never "
        f"arrived: it crashed, runs a different launch sequence, or is still far behind "
        f"(raise MEGAMOE_SPIN_BUDGET). The workspace is unusable: call "
        f"clear_workspace_cache() on every rank and rebuild it."
    )


def describe_capacity(words: list[int]) -> str:
    """The message of a recorded capacity overflow (``words``: the capacity record)."""
    w = CapacityWord
    n = words[w.COUNT]
    return (
        f"expert-parallel capacity exceeded: {n} step{'s' if n != 1 else ''} overflowed since "
        f"the last check; the first: rank {words[w.RANK]} was routed {words[w.ROWS]} rows, "
        f"its capacity is {words[w.LIMIT]} (MoEConfig.capacity_factor times T*top_k). No "
        f"routed rows were computed in an overflowed step on any rank; its y, d_x and d "
        f"topk_weights are NaN. Raise capacity_factor, or set it to None to allow the worst "
        f"case (W*T*top_k rows)."
    )


def describe_ids(words: list[int], world_size: int = 1) -> str:
    """The message of a recorded bad expert id (``words``: the id record)."""
    w = IdWord
    n = words[w.COUNT]
    where = f"token {words[w.TOKEN]}, k {words[w.K]}"
    if world_size > 1:
        where += f" of rank {words[w.RANK]}"
    return (
        f"topk_ids must be in [0, {words[w.EXPERTS]}), got {words[w.VALUE]} ({where}); "
        f"{n} step{'s' if n != 1 else ''} with bad ids since the last check computed no "
        f"routed rows: their y, d_x and d topk_weights are NaN."
    )
