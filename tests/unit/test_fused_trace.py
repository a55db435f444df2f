"""`megamoe.tools.fused_trace`: the summary and timeline of a traced fused launch (synthetic events
on the CPU; the kernel side is compiled in tests/compile and run on GPUs)."""

from __future__ import annotations

import pytest
import torch

from megamoe.tools.fused_trace import KINDS, format_summary, plot_timeline, summarize

US = 1000  # ns


def _trace(programs: int, events: list[tuple[int, int, int, int, int]]) -> torch.Tensor:
    """(program, kind, index, start us, end us) -> the kernel's [programs, slots, 3] layout."""
    trace = torch.full((programs, 8, 3), -1, dtype=torch.int64)
    used = [0] * programs
    for p, kind, index, start, end in events:
        trace[p, used[p]] = torch.tensor([(kind << 32) | index, start * US, end * US])
        used[p] += 1
    return trace


def _example() -> torch.Tensor:
    return _trace(
        3,
        [
            (0, 0, 0, 100, 110),
            (0, 0, 1, 110, 125),  # program 0 pulls two minibatches
            (1, 3, 0, 100, 150),
            (1, 4, 5, 150, 170),  # gate/up 50 us, down 20 us
            (2, 3, 1, 105, 185),
            (2, 4, 6, 185, 205),  # gate/up 80 us (30 us waiting)
        ],
    )


def test_summary_counts_times_and_excess():
    s = summarize(_example(), num_comm=1)
    assert s["span_ms"] == pytest.approx(0.105)
    assert s["kinds"]["pull"]["count"] == 2 and s["kinds"]["pull"]["total_ms"] == pytest.approx(
        0.025
    )
    gate_up = s["kinds"]["gate/up"]
    assert gate_up["count"] == 2 and gate_up["p10_us"] == pytest.approx(50)
    assert gate_up["excess_ms"] == pytest.approx(0.030)  # the 80 us tile waited 30 us
    assert s["kinds"]["down"]["excess_ms"] == pytest.approx(0.0)
    assert s["busy"] == pytest.approx((25 + 70 + 100) / (105 * 3))
    assert s["last_pull_end_ms"] == pytest.approx(0.025)
    assert s["launch_skew_us"] == pytest.approx(5)
    text = format_summary(s)
    assert "kernel span 0.105 ms" in text and "gate/up" in text and "busy 61.9%" in text


def test_summary_with_the_comm_kernel():
    # the compute kernel's tasks only: its pulls ran in the comm kernel beside it
    tasks = _trace(2, [(0, 3, 0, 100, 150), (1, 4, 5, 150, 170)])
    s = summarize(tasks, num_comm=66, comm_kernel=True)
    assert s["last_pull_end_ms"] is None and "pull" not in s["kinds"]
    assert s["busy"] == pytest.approx(70 / (70 * 2))
    assert "(the comm kernel's 66 programs beside them)" in format_summary(s)


def test_empty_trace_is_an_error():
    with pytest.raises(ValueError, match="trace holds no events"):
        summarize(torch.full((2, 4, 3), -1, dtype=torch.int64), num_comm=1)


def test_kinds_match_the_kernel():
    pytest.importorskip("triton")
    from megamoe.kernels.fused import TRACE_KINDS

    assert KINDS == TRACE_KINDS


def test_timeline_png(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "t.png"
    plot_timeline(_example(), str(out), "example")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
