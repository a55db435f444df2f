"""`megamoe.tools.profile`: kernel times and idle gaps read from a chrome trace (synthetic on
the CPU); the GPU tools' command lines without a GPU."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from megamoe.tools.profile import busy_ms, format_profile, idle_gaps, kernel_ms


def _x(cat: str, name: str, ts: float, dur: float, corr: int | None = None) -> dict:
    e = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}
    if corr is not None:
        e["args"] = {"correlation": corr}
    return e


def _example() -> dict:
    return {
        "traceEvents": [
            _x("cpu_op", "forward", 0, 400),
            _x("cpu_op", "aten::copy_", 5, 10),
            _x("cuda_runtime", "cudaLaunchKernel", 6, 4, corr=1),
            _x("cuda_runtime", "cuLaunchKernelEx", 20, 3, corr=2),  # early: the GPU held it
            _x("cpu_op", "slow_host_step", 100, 300),
            _x("cuda_runtime", "cudaLaunchKernel", 350, 5, corr=3),  # late: host-bound gap
            _x("kernel", "copy", 10, 20, corr=1),  # busy 10..30
            _x("kernel", "fused", 80, 200, corr=2),  # gap 30..80 (50 us)
            _x("cuda_runtime", "cudaMemsetAsync", 30, 2, corr=4),
            _x("cuda_runtime", "cudaLaunchKernel", 360, 2, corr=5),
            _x("kernel", "before_the_window", 0, 9, corr=99),  # launched before the trace
            _x("gpu_memset", "Memset", 100, 10, corr=4),  # inside fused: no gap
            _x("kernel", "combine", 360, 10, corr=3),  # gap 280..360 (80 us)
            _x("kernel", "tiny", 372, 1, corr=5),  # 2 us: below the minimum
            {"ph": "f", "cat": "ac2g", "name": "flow", "ts": 1},  # ignored
        ]
    }


def test_kernel_ms_sums_per_name_and_call():
    got = kernel_ms(_example(), calls=2)
    assert list(got) == [
        "fused",
        "copy",
        "Memset",
        "combine",
        "tiny",
    ]  # largest first, ties by first use
    assert [got[k] for k in got] == pytest.approx([0.1, 0.01, 0.005, 0.005, 0.0005])


def test_busy_time_counts_overlapping_work_once():
    # copy 20 + fused 200 (the memset inside it adds nothing) + combine 10 + tiny 1 us
    assert busy_ms(_example(), calls=1) == pytest.approx(0.231)
    assert sum(kernel_ms(_example(), calls=1).values()) == pytest.approx(0.241)


def test_idle_gaps_find_both_gaps_and_who_held_them():
    gaps = idle_gaps(_example(), min_gap_us=5)
    assert [(g.idle_us, g.before, g.after) for g in gaps] == [
        (80, "fused", "combine"),
        (50, "copy", "fused"),
    ]
    host_bound, device_held = gaps
    assert host_bound.launch_after_idle_us == pytest.approx(75)  # returned at 355, idle at 280
    assert host_bound.host_op == "slow_host_step"
    assert device_held.launch_after_idle_us == pytest.approx(-7)  # returned at 23, idle at 30
    assert device_held.host_op == "forward"
    text = format_profile(
        {
            "calls": 1,
            "wall_ms": 0.4,
            "busy_ms": 0.24,
            "idle_ms": 0.13,
            "kernels_ms": kernel_ms(_example(), 1),
            "gaps": [g.__dict__ for g in gaps],
        }
    )
    assert "host late    75.0 us" in text and "launched     7.0 us early" in text


@pytest.mark.parametrize("tool", ["profile", "fused_trace"])
def test_gpu_tools_say_they_need_a_gpu(tool: str):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    run = subprocess.run(
        [sys.executable, "-m", f"megamoe.tools.{tool}", "--preset", "tiny"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and f"{tool}: needs a CUDA GPU" in run.stderr


def test_host_breakdown_times_the_layer_and_restores_what_it_wraps():
    """The timers count each wrapped call once per call and leave every wrapped function as it
    was (a CPU run of the reference backend: no Triton launch, no CUDA)."""
    from triton.runtime.jit import JITFunction
    from triton.tools.tensor_descriptor import TensorDescriptor

    from megamoe import functional
    from megamoe.tools.profile import HOST_TIMERS, format_breakdown, host_breakdown
    from support.problems import Case, make_problem

    case = Case(8, 32, 16, 4, 2)
    p = make_problem(case, seed=0)
    before = (functional.forward, functional.backward, JITFunction.run)
    before_desc = TensorDescriptor.__dict__["from_tensor"]

    def call():
        y, ctx = functional.forward(
            p.x, p.topk_ids, p.topk_weights, p.weights, case.config(), backend="reference"
        )
        functional.backward(ctx, torch.ones_like(y))

    result = host_breakdown(call, calls=3)
    assert (functional.forward, functional.backward, JITFunction.run) == before
    assert TensorDescriptor.__dict__["from_tensor"] is before_desc
    assert set(result["timers_per_call"]) == {"functional.forward", "functional.backward"}
    assert all(n == 1 for n in result["timers_per_call"].values())
    assert 0 < result["timers_us"]["functional.forward"] < result["host_us"]
    assert result["syncs_per_call"] == 0
    assert "functional.forward" in format_breakdown(result) and set(HOST_TIMERS) >= {
        "functional.forward",
        "descriptors",
    }
