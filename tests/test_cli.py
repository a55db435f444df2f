"""The command line as a user runs it: subprocesses on the CPU (one process, and 2 ranks of torchrun)."""

import json
import os
import subprocess
import sys

import pytest
import torch

# DESIGN.md "Benchmark records", plus what the bench adds; written out here, not imported, so
# that a field dropped from the code fails this test.
DESIGN_FIELDS = (
    "preset", "world_size", "backend", "gpu", "commit", "date", "tokens_per_rank", "hidden",
    "intermediate", "experts", "top_k", "shared_intermediate", "fwd_ms", "bwd_ms", "fwdbwd_ms",
    "fwd_tflops", "fwdbwd_tflops", "gemm_peak_tflops",
)
EXTRA_FIELDS = ("routing", "iters", "check", "speedup_vs_torch_a2a")
TIMEOUT_S = 120


def _run(*args: str, timeout: int = TIMEOUT_S) -> subprocess.CompletedProcess:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
    # conftest switches the Triton interpreter on; "auto" would then time the interpreter.
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def _assert_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"


def _check_records(records: list, world_size: int, backends: set[str], checked: bool = True) -> None:
    assert {r["backend"] for r in records} == backends
    for r in records:
        missing = [f for f in DESIGN_FIELDS + EXTRA_FIELDS if f not in r]
        assert not missing, f"record lacks {missing}"
        assert r["status"] == "ok", r
        assert r["preset"] == "tiny" and r["world_size"] == world_size
        assert r["experts"] == 4 * world_size and r["top_k"] == 2
        assert r["fwd_ms"] > 0 and r["bwd_ms"] > 0 and r["fwdbwd_ms"] > 0
        assert r["fwd_tflops"] > 0 and r["fwdbwd_tflops"] > 0 and r["gemm_peak_tflops"] > 0
        if checked:
            assert r["check_ok"] is True and 0 <= r["check"] < 1, r
        else:
            assert r["check"] is None
    baseline = next(r for r in records if r["backend"] == "torch-a2a")
    assert baseline["speedup_vs_torch_a2a"] == pytest.approx(1.0)


def test_info():
    proc = _run("-m", "megamoe", "info")
    _assert_ok(proc)
    for word in ("torch", "triton", "GPUs", "reference", "torch-a2a", "available"):
        assert word in proc.stdout


def test_bench_cpu_default_checks_and_writes_records(tmp_path):
    out = tmp_path / "results.json"
    proc = _run("-m", "megamoe", "bench", "--iters", "2", "--out", str(out))
    _assert_ok(proc)
    assert "fwd+bwd ms" in proc.stdout and "tiny" in proc.stdout
    assert "ok (" in proc.stdout and "FAIL" not in proc.stdout
    assert "100%" in proc.stderr, "the progress bar should finish"
    _check_records(json.loads(out.read_text()), 1, {"reference", "torch-a2a"})

    table = _run("-m", "megamoe", "table", str(out), "--markdown")
    _assert_ok(table)
    assert "| tiny | 1 | reference |" in table.stdout


def test_bench_under_torchrun_two_gloo_ranks_skewed(tmp_path):
    out = tmp_path / "ep.json"
    proc = _run("-m", "torch.distributed.run", "--nproc-per-node=2", "-m", "megamoe", "bench",
                "--iters", "2", "--warmup", "1", "--routing", "one-rank", "--kernels",
                "--out", str(out))
    _assert_ok(proc)
    assert "--kernels: skipped, no GPU" in proc.stderr
    records = json.loads(out.read_text())
    _check_records(records, 2, {"reference", "torch-a2a"})
    assert all(r["routing"] == "one-rank" for r in records)


def test_bench_no_check_and_explicit_backends(tmp_path):
    out = tmp_path / "r.json"
    proc = _run("-m", "megamoe", "bench", "--iters", "1", "--warmup", "0", "--no-check",
                "--backend", "torch-a2a", "auto", "--tokens", "33", "--out", str(out))
    _assert_ok(proc)
    records = json.loads(out.read_text())
    _check_records(records, 1, {"reference", "torch-a2a"}, checked=False)
    assert all(r["tokens_per_rank"] == 33 for r in records)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--backend", "bogus"], "backend must be one of"),
        (["--iters", "0"], "iters must be >= 1, got 0"),
        (["--preset", "nope"], "invalid choice: 'nope'"),
    ],
)
def test_bench_bad_options_are_named(args, message):
    proc = _run("-m", "megamoe", "bench", *args)
    assert proc.returncode == 2
    assert message in proc.stderr


def test_accuracy_check_catches_a_wrong_layer():
    """The bench's check must fail a layer that is slightly off (5% on the output)."""
    from megamoe.baselines import torch_a2a_moe
    from megamoe.bench import BenchOptions, DistEnv, check_backend, float64_result, make_case

    opts = BenchOptions(presets=["tiny"], backends=["torch-a2a"], tokens=40,
                        seed=int(torch.randint(0, 2**31 - 1, ()).item()))
    env = DistEnv()
    case = make_case("tiny", opts, env)
    expected = float64_result(case, env)
    assert check_backend(torch_a2a_moe, case, expected, env)["check_ok"] is True

    def off_by_5_percent(*args):
        return torch_a2a_moe(*args) * 1.05

    bad = check_backend(off_by_5_percent, case, expected, env)
    assert bad["check_ok"] is False and bad["check_rel"] > 0.04
