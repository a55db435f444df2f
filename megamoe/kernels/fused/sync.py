"""Flags of the fused kernels: counters in one zeroed int32 buffer per launch, release/acquire.

A producer counts itself into a counter after its writes (:func:`signal`, release); a consumer
spins until the counter reaches what it needs (:func:`wait_count`, acquire, with the watchdog
budget of ``comm.wait_at_least``). TMA traffic runs in the async proxy: a producer that stored
with TMA publishes first (:func:`publish_writes`), a consumer that loads with TMA fences after
its acquire (:func:`acquire_for_tma`).

Flag buffer layout (:func:`flag_layout` on the host, :func:`flag_pointers` on the device)::

    [ticket | arrived | ready[max_mb] | z_done[max_mb] | h_done[max_blocks] | sh_done[blocks]]

``ticket``: the compute task ticket; ``arrived``: programs that started (comm-kernel launches);
``ready[m]``: comm programs that pulled minibatch m; ``z_done[m]``: down tiles of minibatch m
stored (and pushed); ``h_done[b]`` / ``sh_done[b]``: gate/up tiles of routed / shared row block b.

The fused backward's flag buffer (:func:`backward_flag_layout`, :func:`backward_flag_pointers`)::

    [ticket | dgu_done[max_blocks] | expert_done[E] | sdgu_done[shared blocks] | shared_done
     | ready[max_mb] | dz_done[max_blocks] | dx_done[max_blocks]]

``dgu_done[b]`` / ``sdgu_done[b]``: SwiGLU-backward tiles (d_g, d_u) of routed / shared row block
b; ``expert_done[e]``: those of every row block of expert e; ``shared_done``: those of every
shared row block (the shared weight gradients wait for it). At W > 1 (the exchange,
:func:`exchange_flag_pointers`; no words at W = 1): ``ready[m]``: comm programs that pulled
their share of minibatch m's dy rows; ``dz_done[b]``: the route-grad task of row block b;
``dx_done[b]``: gate+up dgrad tiles (d_x) of row block b (the comm programs push it then).
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from ...errors import Stage
from .. import comm
from ..comm import acquire_for_tma, publish_writes, signal

__all__ = [
    "FlagLayout",
    "flag_layout",
    "flag_pointers",
    "signal",
    "wait_count",
    "publish_writes",
    "acquire_for_tma",
    "arrive_all",
    "HEADER_WORDS",
    "BackwardFlagLayout",
    "backward_flag_layout",
    "backward_flag_pointers",
    "exchange_flag_pointers",
]

# Words before the counters: the compute task ticket, then the programs that arrived.
HEADER_WORDS = 2
_HEADER_WORDS = tl.constexpr(HEADER_WORDS)
_ARRIVED = tl.constexpr(1)
_STAGE_CORESIDENT = tl.constexpr(int(Stage.CORESIDENT))


@dataclass(frozen=True)
class FlagLayout:
    """Word offsets of the counters in the flag buffer, and its length."""

    ticket: int
    arrived: int
    ready: int
    z_done: int
    h_done: int
    sh_done: int
    words: int


def flag_layout(max_minibatches: int, max_blocks: int, shared_blocks: int) -> FlagLayout:
    """The flag buffer of a launch, as the kernel addresses it (:func:`flag_pointers`)."""
    ready = HEADER_WORDS
    z_done = ready + max_minibatches
    h_done = z_done + max_minibatches
    sh_done = h_done + max_blocks
    return FlagLayout(0, 1, ready, z_done, h_done, sh_done, sh_done + shared_blocks)


@triton.jit
def flag_pointers(flags_ptr, max_mb, max_blocks):
    """(ticket, ready, z_done, h_done, sh_done) pointers into the flag buffer."""
    ready_ptr = flags_ptr + _HEADER_WORDS
    z_done_ptr = ready_ptr + max_mb
    h_done_ptr = z_done_ptr + max_mb
    return flags_ptr, ready_ptr, z_done_ptr, h_done_ptr, h_done_ptr + max_blocks


@triton.jit
def wait_count(flag_ptr, wanted, stage, index, watch):
    """Spin (acquire) until ``flag >= wanted``; False (and a stall record) if the budget ran out.

    ``comm.wait_flag`` (GPU scope: every counter is set by this GPU's programs); the record
    names this rank as the 'peer'. ``watch``: the watchdog's (error record, rank, budget).
    Scalars only: the warp-specialized fp8 GEMMs' producer (Gluon) calls ``comm.wait_flag``
    too.
    """
    err_ptr, rank, budget = watch
    return comm.wait_flag(flag_ptr, wanted, budget, err_ptr, stage, index, rank, rank, "gpu")


@triton.jit
def arrive_all(flags_ptr, expected_arrivals, watch):
    """Count this program as started and wait until ``expected_arrivals`` did (both kernels of
    a comm-kernel launch): programs that wait on each other must all be resident; if the GPU
    does not run them side by side, this stalls first and names that."""
    tl.atomic_add(flags_ptr + _ARRIVED, 1, sem="relaxed", scope="gpu")
    return wait_count(flags_ptr + _ARRIVED, expected_arrivals, _STAGE_CORESIDENT, 0, watch)


@dataclass(frozen=True)
class BackwardFlagLayout:
    """Word offsets of the fused backward's counters in its flag buffer, and its length."""

    ticket: int
    dgu_done: int
    expert_done: int
    sdgu_done: int
    shared_done: int
    ready: int
    dz_done: int
    dx_done: int
    words: int


def backward_flag_layout(
    max_blocks: int, experts: int, shared_blocks: int, max_minibatches: int = 0
) -> BackwardFlagLayout:
    """The fused backward's flag buffer, as the kernel addresses it
    (:func:`backward_flag_pointers`, :func:`exchange_flag_pointers`); ``max_minibatches`` 0:
    no exchange (W = 1), no words for its counters."""
    dgu_done = 1
    expert_done = dgu_done + max_blocks
    sdgu_done = expert_done + experts
    shared_done = sdgu_done + shared_blocks
    ready = shared_done + 1
    exchange_blocks = max_blocks if max_minibatches else 0
    dz_done = ready + max_minibatches
    dx_done = dz_done + exchange_blocks
    return BackwardFlagLayout(
        0,
        dgu_done,
        expert_done,
        sdgu_done,
        shared_done,
        ready,
        dz_done,
        dx_done,
        dx_done + exchange_blocks,
    )


@triton.jit
def backward_flag_pointers(flags_ptr, max_blocks, experts, shared_blocks):
    """(ticket, dgu_done, expert_done, sdgu_done, shared_done) pointers into the backward's flag
    buffer."""
    dgu_done_ptr = flags_ptr + 1
    expert_done_ptr = dgu_done_ptr + max_blocks
    sdgu_done_ptr = expert_done_ptr + experts
    return flags_ptr, dgu_done_ptr, expert_done_ptr, sdgu_done_ptr, sdgu_done_ptr + shared_blocks


@triton.jit
def exchange_flag_pointers(flags_ptr, max_blocks, experts, shared_blocks, max_mb):
    """(ready, dz_done, dx_done) pointers into the backward's flag buffer (W > 1)."""
    ready_ptr = flags_ptr + 1 + max_blocks + experts + shared_blocks + 1
    dz_done_ptr = ready_ptr + max_mb
    return ready_ptr, dz_done_ptr, dz_done_ptr + max_blocks
