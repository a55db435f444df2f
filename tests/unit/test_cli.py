"""The command line as a user runs it: subprocesses on the CPU (one process, and 2 ranks of
torchrun)."""

import json
import os
import subprocess
import tarfile

import pytest
import torch

from support.procs import CLI_TIMEOUT_S, assert_ok, run_python

# The record fields (BENCHMARKS.md "Method"); written out here, not imported, so that a field
# dropped from the code fails this test.
DESIGN_FIELDS = (
    "preset",
    "world_size",
    "backend",
    "gpu",
    "commit",
    "date",
    "tokens_per_rank",
    "hidden",
    "intermediate",
    "experts",
    "top_k",
    "shared_intermediate",
    "mode",
    "fwd_ms",
    "bwd_ms",
    "fwdbwd_ms",
    "host_fwd_ms",
    "host_bwd_ms",
    "fwd_tflops",
    "fwdbwd_tflops",
    "gemm_peak_tflops",
)
EXTRA_FIELDS = ("routing", "iters", "micro_batches", "check", "speedup_vs_torch_a2a")
# The "where they apply" fields (+ the backward copies): null unless triton runs at W > 1.
COMM_FIELDS = (
    "dispatch_gbps",
    "combine_gbps",
    "comm_programs",
    "minibatch_rows",
    "ring_rows",
    "down_lag",
    "copy_programs",
    "dispatch_bwd_gbps",
    "combine_bwd_gbps",
    "overlap_shared",
)


def _check_records(
    records: list, world_size: int, backends: set[str], checked: bool = True
) -> None:
    assert {r["backend"] for r in records} == backends
    for r in records:
        missing = [f for f in DESIGN_FIELDS + EXTRA_FIELDS + COMM_FIELDS if f not in r]
        assert not missing, f"record lacks {missing}"
        assert all(r[f] is None for f in COMM_FIELDS), r  # no GPU copies on the CPU
        assert r["status"] == "ok", r
        assert r["preset"] == "tiny" and r["world_size"] == world_size
        assert r["experts"] == 4 * world_size and r["top_k"] == 2
        assert r["fwd_ms"] > 0 and r["bwd_ms"] > 0 and r["fwdbwd_ms"] > 0
        assert r["host_fwd_ms"] > 0 and r["host_bwd_ms"] > 0
        assert r["fwd_tflops"] > 0 and r["fwdbwd_tflops"] > 0 and r["gemm_peak_tflops"] > 0
        if checked:
            assert r["check_ok"] is True and 0 <= r["check"] < 1, r
        else:
            assert r["check"] is None
    for baseline in (r for r in records if r["backend"] == "torch-a2a"):  # one per mode
        assert baseline["speedup_vs_torch_a2a"] == pytest.approx(1.0)


def test_info():
    proc = run_python("-m", "megamoe", "info")
    assert_ok(proc)
    for word in ("torch", "triton", "GPUs", "reference", "torch-a2a", "available"):
        assert word in proc.stdout


def test_bench_cpu_default_checks_and_writes_records(tmp_path):
    out = tmp_path / "results.json"
    proc = run_python("-m", "megamoe", "bench", "--iters", "2", "--out", str(out))
    assert_ok(proc)
    assert "fwd+bwd ms" in proc.stdout and "tiny" in proc.stdout
    assert "GB/s" not in proc.stdout  # no copy-bandwidth columns without values
    assert "ok (" in proc.stdout and "FAIL" not in proc.stdout
    assert "100%" in proc.stderr, "the progress bar should finish"
    _check_records(json.loads(out.read_text()), 1, {"reference", "torch-a2a"})

    table = run_python("-m", "megamoe", "table", str(out), "--markdown")
    assert_ok(table)
    assert "| tiny | 1 | reference |" in table.stdout


def test_bench_under_torchrun_two_gloo_ranks_skewed(tmp_path):
    out = tmp_path / "ep.json"
    args = (
        "-m torch.distributed.run --nproc-per-node=2 -m megamoe bench --iters 2 --warmup "
        "1 --routing one-rank --kernels --out"
    )
    proc = run_python(*args.split(), str(out))
    assert_ok(proc)
    assert "--kernels: skipped, no GPU" in proc.stderr
    records = json.loads(out.read_text())
    _check_records(records, 2, {"reference", "torch-a2a"})
    assert all(r["routing"] == "one-rank" for r in records)


def test_bench_auto_is_its_own_run_in_both_modes(tmp_path):
    out = tmp_path / "r.json"
    args = (
        "-m megamoe bench --iters 1 --warmup 0 --no-check --backend torch-a2a auto "
        "--tokens 33 --mode throughput latency --out"
    )
    proc = run_python(*args.split(), str(out))
    assert_ok(proc)
    records = json.loads(out.read_text())
    _check_records(records, 1, {"auto", "torch-a2a"}, checked=False)
    assert all(r["tokens_per_rank"] == 33 for r in records)
    assert sorted((r["backend"], r["mode"]) for r in records) == [
        ("auto", "latency"),
        ("auto", "throughput"),
        ("torch-a2a", "latency"),
        ("torch-a2a", "throughput"),
    ]
    # on the CPU auto is the reference backend; the record says so
    assert {r["resolved_backend"] for r in records if r["backend"] == "auto"} == {"reference"}
    assert "auto (reference)" in proc.stdout and "latency" in proc.stdout


def test_bench_sweeps_tokens_and_skips_tunables_nobody_reads(tmp_path):
    out = tmp_path / "r.json"
    args = (
        "-m megamoe bench --iters 1 --warmup 0 --no-check --backend torch-a2a --tokens 17 "
        "33 --tune comm_programs=4,8 --out"
    )
    proc = run_python(*args.split(), str(out))
    assert_ok(proc)
    records = json.loads(out.read_text())
    # torch-a2a reads no tunable: one record per token count, not one per comm_programs value
    assert sorted(r["tokens_per_rank"] for r in records) == [17, 33]
    assert all(r["comm_programs"] is None and r["copy_programs"] is None for r in records)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--backend", "bogus"], "backend must be one of"),
        (["--iters", "0"], "iters must be >= 1, got 0"),
        (["--preset", "nope"], "invalid choice: 'nope'"),
        (["--tune", "comm_programs"], "tune must look like NAME=V1,V2,..., got 'comm_programs'"),
        (["--tune", "warps=4"], "tune: the tunable must be one of"),
        (["--tune", "ring_rows=x"], "tune: ring_rows values must be integers, got 'x'"),
        (
            ["--tune", "ring_rows=3000"],
            "ring_rows must be a multiple of minibatch_rows (1024), got 3000",
        ),
        (["--tune", "overlap_shared=auto"], "overlap_shared must be a bool (or 0 / 1), got None"),
        (["--tokens", "0"], "tokens must be >= 1, got 0"),
        (["--mode", "fast"], "invalid choice: 'fast'"),
    ],
)
def test_bench_bad_options_are_named(args, message):
    proc = run_python("-m", "megamoe", "bench", *args)
    assert proc.returncode == 2
    assert message in proc.stderr


def test_gpu_check_script_names_bad_parts_and_needs_a_gpu(tmp_path):
    script = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "gpu_check.sh")
    env = dict(os.environ, OUT=str(tmp_path), CUDA_VISIBLE_DEVICES="")
    bad = subprocess.run(
        ["bash", script, "tests", "bogus"],
        capture_output=True,
        text=True,
        env=env,
        timeout=CLI_TIMEOUT_S,
    )
    assert bad.returncode == 2 and "unknown part 'bogus'" in bad.stderr
    if torch.cuda.is_available():
        return
    run = subprocess.run(
        ["bash", script, "tests-ep"], capture_output=True, text=True, env=env, timeout=CLI_TIMEOUT_S
    )
    assert run.returncode == 1 and "no CUDA GPU visible" in run.stdout
    packed = tmp_path / "packed"
    run = subprocess.run(
        ["bash", script, "bench"],
        capture_output=True,
        text=True,
        env=dict(env, OUT=str(packed), MEGAMOE_PACK="1"),
        timeout=CLI_TIMEOUT_S,
    )
    assert run.returncode == 1, run.stdout + run.stderr
    assert sorted(p.name for p in packed.iterdir()) == ["gpu_check.tgz", "summary.txt"]
    with tarfile.open(packed / "gpu_check.tgz") as tar:
        assert {"./info.txt", "./summary.txt"} <= set(tar.getnames())
