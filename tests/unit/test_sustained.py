"""`megamoe.tools.sustained`: telemetry parsing and phase statistics (synthetic samples), and the
tool run on the CPU as a user runs it (one process with --backward, and 2 gloo ranks of
torchrun)."""

import datetime as dt
import json

import pytest

from megamoe.tools.sustained import Sample, parse_samples, phase_stats, summarize
from support.procs import assert_ok as _assert_ok
from support.procs import run_python as _run


def _stamp(seconds: float) -> str:
    return dt.datetime.fromtimestamp(seconds).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]


def test_parse_samples_reads_local_stamps_and_skips_unreadable_lines():
    t0 = 1_790_000_000.0
    text = "\n".join(
        [
            f"{_stamp(t0)}, 695.12, 1410, 59",
            f"{_stamp(t0 + 0.05)}, [N/A], 1410, 59",  # a field nvidia-smi could not read
            f"{_stamp(t0 + 0.10)}, 401.5, 1980, 61",
            f"{_stamp(t0 + 0.15)}, 40",  # cut off when the sampler stopped
        ]
    )
    samples = parse_samples(text)
    assert [s.power_w for s in samples] == [695.12, 401.5]
    assert samples[0].time == pytest.approx(t0, abs=1e-3)
    assert samples[1] == Sample(samples[1].time, 401.5, 1980.0, 61.0)


def test_phase_stats_leave_out_the_settling_start():
    samples = [Sample(float(t), 100.0 + t, 2000.0 - t, 50.0 + t) for t in range(11)]
    stats = phase_stats(samples, 0.0, 10.0, settle=0.2)  # samples at t = 2 .. 10
    assert stats == {"power_w": 106.0, "sm_mhz": 1994.0, "temp_c": 60.0, "samples": 9}
    assert phase_stats(samples, 20.0, 30.0) is None


def test_summarize_takes_medians_over_rounds_and_speedups_over_the_first():
    gpu = lambda w, mhz: {"power_w": w, "sm_mhz": mhz, "temp_c": 60.0, "samples": 9}  # noqa: E731
    phases = [
        dict(backend="triton", ms=7.0, gpus=[gpu(690, 1450), None]),
        dict(backend="fused", ms=6.5, gpus=[gpu(695, 1400), None]),
        dict(backend="triton", ms=7.2, gpus=[gpu(700, 1430), None]),
        dict(backend="fused", ms=6.7, gpus=[gpu(699, 1380), None]),
        dict(backend="triton", ms=7.1, gpus=[gpu(692, 1440), None]),
        dict(backend="fused", ms=6.6, gpus=[gpu(697, 1390), None]),
    ]
    s = summarize(phases)
    assert list(s) == ["triton", "fused"]
    assert s["triton"]["ms"] == 7.1 and s["fused"]["ms"] == 6.6
    assert s["fused"]["speedup_vs_first"] == pytest.approx(7.1 / 6.6)
    assert s["triton"]["speedup_vs_first"] == 1.0
    assert s["fused"]["gpus"] == [{"power_w": 697, "sm_mhz": 1390}, None]


@pytest.mark.parametrize("torchrun", [False, True], ids=["one-process", "two-gloo-ranks"])
def test_sustained_runs_on_the_cpu_and_writes_a_record(tmp_path, torchrun):
    out = tmp_path / "s.json"
    args = [
        "-m",
        "megamoe.tools.sustained",
        "--preset",
        "tiny",
        "--backend",
        "torch-a2a",
        "reference",
        "--seconds",
        "0.2",
        "--rounds",
        "2",
        "--warmup",
        "1",
        "--out",
        str(out),
    ]
    if torchrun:
        args = ["-m", "torch.distributed.run", "--nproc-per-node=2", *args]
    else:
        args.append("--backward")
    proc = _run(*args)
    _assert_ok(proc)
    rec = json.loads(out.read_text())
    world = 2 if torchrun else 1
    assert rec["kind"] == "sustained" and rec["world_size"] == world and not rec["telemetry"]
    assert rec["mode"] == ("forward" if torchrun else "forward + backward")
    assert [p["backend"] for p in rec["phases"]] == ["torch-a2a", "reference"] * 2
    for p in rec["phases"]:
        assert p["calls"] >= 10 and p["ms"] > 0 and p["end"] - p["start"] >= 0.2
        assert p["gpus"] == [None] * world  # no GPU: no samples, one entry per rank
    assert rec["summary"]["torch-a2a"]["speedup_vs_first"] == 1.0
    assert "torch-a2a" in proc.stdout and "no telemetry" in proc.stdout


def test_each_backend_runs_in_each_precision(monkeypatch):
    from megamoe.tools import bench

    proc = _run(
        "-m", "megamoe.tools.sustained", "--preset", "tiny", "--backend", "reference",
        "--precision", "bf16", "fp8", "--seconds", "0.1", "--rounds", "1", "--warmup", "0",
    )  # fmt: skip
    _assert_ok(proc)
    assert "reference fp8" in proc.stdout and "round 1/1 reference:" in proc.stdout
    from megamoe.tools import sustained

    calls, cleared = [], []
    monkeypatch.setattr(bench, "forget_fp8_weights", lambda: cleared.append(len(calls)))
    step = sustained._steps(lambda: calls.append(1), 3)
    for _ in range(7):
        step()
    assert cleared == [0, 3, 6]  # before the first call of every optimizer step

    def call() -> None:
        calls.append(1)

    assert sustained._steps(call, 0) is call  # 0: quantized once, then cached
    proc = _run(
        "-m", "megamoe.tools.sustained", "--preset", "tiny", "--backend", "torch-a2a",
        "--precision", "fp8",
    )  # fmt: skip
    assert proc.returncode == 2 and "--precision fp8: " in proc.stderr, proc.stderr


def test_bad_arguments_are_named():
    proc = _run("-m", "megamoe.tools.sustained", "--preset", "tiny", "--seconds", "0")
    assert proc.returncode == 2 and "--seconds must be > 0, got 0.0" in proc.stderr
    proc = _run("-m", "megamoe.tools.sustained", "--preset", "tiny", "--micro-batches", "-1")
    assert proc.returncode == 2 and "--micro-batches must be >= 0, got -1" in proc.stderr
    proc = _run("-m", "megamoe.tools.sustained", "--preset", "tiny", "--backend", "foo")
    assert proc.returncode == 2 and "backend must be one of" in proc.stderr
    assert "got 'foo'" in proc.stderr and "Traceback" not in proc.stderr
