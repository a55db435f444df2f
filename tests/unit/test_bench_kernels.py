"""`megamoe.tools.bench_kernels`' interleaved timing (the CUDA events replaced: no GPU here)."""

from __future__ import annotations

import pytest

from megamoe.tools import bench_kernels


def test_interleaved_timing_takes_turns_and_keeps_errors(monkeypatch) -> None:
    """Every round runs each function once in turn (after its warm-up), the median over all
    rounds is the result, and a function that raises is recorded with its error without
    stopping the others."""
    order: list[str] = []
    ms = {"a": iter([3.0, 1.0, 2.0]), "b": iter([5.0, 4.0, 6.0])}

    def fake_event_times(fn, iters):
        name = fn()
        order.append(name)
        return [next(ms[name])] * iters

    def broken():
        raise RuntimeError("no kernel for this shape")

    monkeypatch.setattr(bench_kernels, "event_times_ms", fake_event_times)
    got = bench_kernels._interleaved_ms({"a": lambda: "a", "b": lambda: "b", "c": broken}, 4)
    assert order == ["a", "b"] * bench_kernels.ROUNDS
    assert got["a"] == pytest.approx(2.0) and got["b"] == pytest.approx(5.0)
    assert got["c"] == "RuntimeError: no kernel for this shape"
