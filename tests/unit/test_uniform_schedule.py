"""The shared expert's row layout (``schedule.uniform_schedule``): its tables, built once per
size and device, never while a CUDA graph is captured."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from megamoe.kernels import schedule  # noqa: E402


def test_tables_are_one_expert_over_every_row_in_order() -> None:
    s = schedule.uniform_schedule(300, 128, torch.device("cpu"))
    assert torch.equal(s.dest_row, torch.arange(300, dtype=torch.int32))
    assert torch.equal(s.row_src, torch.arange(300, dtype=torch.int32))
    assert s.row_start.tolist() == [0, 300] and s.counts.tolist() == [300]
    assert s.block_expert.tolist() == [0, 0, 0] and s.num_blocks.tolist() == [3]
    assert (s.rows, s.num_experts, s.top_k, s.balanced_rows) == (384, 1, 1, 300)


def test_built_once_per_size_and_device(monkeypatch) -> None:
    monkeypatch.setattr(schedule, "_UNIFORM", {})
    cpu = torch.device("cpu")
    a = schedule.uniform_schedule(64, 16, cpu)
    assert schedule.uniform_schedule(64, 16, cpu) is a
    assert schedule.uniform_schedule(65, 16, cpu) is not a
    assert schedule.uniform_schedule(64, 32, cpu) is not a


def test_not_kept_while_a_graph_is_captured(monkeypatch) -> None:
    """Kernels recorded in a capture run only at replay: tables made then are not values yet."""
    monkeypatch.setattr(schedule, "_UNIFORM", {})
    monkeypatch.setattr(schedule, "_capturing", lambda device: True)
    cpu = torch.device("cpu")
    a = schedule.uniform_schedule(64, 16, cpu)
    assert schedule.uniform_schedule(64, 16, cpu) is not a
    assert schedule._UNIFORM == {}


def test_the_cache_stays_bounded(monkeypatch) -> None:
    monkeypatch.setattr(schedule, "_UNIFORM", {})
    for rows in range(1, 2 * schedule._UNIFORM_MAX):
        schedule.uniform_schedule(rows, 16, torch.device("cpu"))
    assert len(schedule._UNIFORM) <= schedule._UNIFORM_MAX
