"""Helpers shared by the expert-parallel GPU test modules."""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist


def release_workspaces() -> None:
    """Free the symmetric buffers of a module (collectively, on every rank)."""
    from megamoe.workspace import clear_workspace_cache

    torch.cuda.synchronize()
    clear_workspace_cache()
    gc.collect()
    dist.barrier()
