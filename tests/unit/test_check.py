"""functional.check / MoE.check surface device-recorded errors of the cached EP workspaces."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("triton")

from megamoe import functional  # noqa: E402
from megamoe.ep import workspace  # noqa: E402
from megamoe.errors import ErrorWord, StallError  # noqa: E402


@pytest.fixture
def one_rank_world():
    fd, path = tempfile.mkstemp(prefix="megamoe-check-")
    os.close(fd)
    os.unlink(path)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        workspace.clear_workspace_cache()
        dist.destroy_process_group()


def test_check_raises_a_recorded_stall_once(one_rank_world):
    ws = workspace.emulated_workspaces(1, 4, 16, 2, torch.float32, torch.device("cpu"))[0]
    ws.group_name = one_rank_world.group_name
    workspace._CACHE[("test",)] = ws
    functional.check()  # nothing recorded: no error
    ws.errors[ErrorWord.FLAG] = 1
    ws.errors[ErrorWord.STAGE] = 1  # "barrier"
    ws.errors[ErrorWord.PEER] = 3
    ws.errors[ErrorWord.RANK] = 0
    with pytest.raises(StallError, match="rank 0 stalled in barrier .* waiting for peer 3"):
        functional.check(one_rank_world)
    functional.check()  # the record was cleared when raised


def test_check_without_workspaces_or_process_group_is_a_no_op():
    assert not dist.is_initialized()
    functional.check()
