"""Bitwise comparisons of outputs, saved activations and gradients (the same-bits contracts)."""

from __future__ import annotations

import torch

__all__ = [
    "used_rows",
    "assert_same_routed",
    "assert_same_shared",
    "assert_same_grads",
    "same_fp8_weight",
]


def used_rows(sched) -> int:
    """Rows of the used row blocks of a RowSchedule (a host read: tests only)."""
    return int(sched.num_blocks.item()) * sched.block_rows


def assert_same_routed(ctx_a, ctx_b, used: int, what: str) -> None:
    for name, a, b in zip(ctx_b.routed._fields, ctx_a.routed, ctx_b.routed):
        assert torch.equal(a[:used], b[:used]), f"{what}: {name} differs"


def assert_same_shared(ctx_a, ctx_b, what: str) -> None:
    if ctx_b.shared is None:
        assert ctx_a.shared is None, what
        return
    for name, a, b in zip(ctx_b.shared._fields, ctx_a.shared, ctx_b.shared):
        assert torch.equal(a, b), f"{what}: shared {name} differs"


def assert_same_grads(g, g_ref, what: str) -> None:
    for name, a, b in zip(g._fields, g, g_ref):
        assert (a is None and b is None) or torch.equal(a, b), f"{what}: grad {name} differs"


def same_fp8_weight(a, b) -> bool:
    """Whether two ``fp8.Fp8Weight`` hold the same bytes and scales (None where both are)."""
    return all(
        (x is None and y is None)
        or (
            x is not None
            and y is not None
            and torch.equal(x.view(torch.uint8), y.view(torch.uint8))
        )
        for x, y in zip(a, b, strict=True)
    )
