"""One NCCL process group for the whole torchrun pytest session.

Every expert-parallel GPU test module takes ``nccl_world``: the group is created once and
destroyed once at the end, so several modules can run in one torchrun (NCCL cannot be
re-initialized in a process after ``destroy_process_group``).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist


@pytest.fixture(scope="session")
def nccl_world():
    """(group, device) of all torchrun ranks, one GPU each; skips outside torchrun."""
    if "WORLD_SIZE" not in os.environ:
        pytest.skip("run under torchrun (WORLD_SIZE is not set)")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU per rank")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl", device_id=device)
    yield dist.group.WORLD, device
    torch.cuda.synchronize()
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ep(nccl_world):
    """(group, device) for one expert-parallel test module (>= 2 ranks); frees the module's
    symmetric workspaces at its end."""
    from support.dist import release_workspaces

    world = dist.get_world_size()
    if world < 2:
        pytest.skip(f"needs at least 2 ranks, got WORLD_SIZE={world}")
    yield nccl_world
    release_workspaces()
