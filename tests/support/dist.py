"""Helpers of the expert-parallel GPU tests (under torchrun, NCCL): every rank agrees."""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist


def release_workspaces() -> None:
    """Free the symmetric buffers of a module (collectively, on every rank)."""
    from megamoe.ep.workspace import clear_workspace_cache

    torch.cuda.synchronize()
    clear_workspace_cache()
    gc.collect()
    dist.barrier()


def agree(ok: bool, what: str = "") -> None:
    """Assert on every rank that every rank's check passed (so that one rank's failure never
    leaves the other waiting in a collective)."""
    verdicts = [None] * dist.get_world_size()
    dist.all_gather_object(verdicts, (bool(ok), what))
    bad = [f"rank {r}: {w}" for r, (o, w) in enumerate(verdicts) if not o]
    assert not bad, "; ".join(bad)


def shared_seed(device: torch.device) -> int:
    """A fresh seed drawn on rank 0 and broadcast: every rank must build the same problem."""
    seed = torch.randint(0, 2**31 - 1, (1,), device=device)
    dist.broadcast(seed, src=0)
    return int(seed.item())
