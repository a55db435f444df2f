"""The command line as a user runs it: subprocesses on the CPU (one process, and 2 ranks of torchrun)."""

import json
import os
import subprocess
import sys
import tarfile

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
# DESIGN.md's "where they apply" fields (+ the backward copies): null unless triton runs at W > 1.
COMM_FIELDS = ("dispatch_gbps", "combine_gbps", "comm_programs", "minibatch_rows", "ring_rows",
               "down_lag", "copy_programs", "dispatch_bwd_gbps", "combine_bwd_gbps",
               "overlap_shared")
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
        missing = [f for f in DESIGN_FIELDS + EXTRA_FIELDS + COMM_FIELDS if f not in r]
        assert not missing, f"record lacks {missing}"
        assert all(r[f] is None for f in COMM_FIELDS), r  # no GPU copies on the CPU
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
    assert "GB/s" not in proc.stdout  # no copy-bandwidth columns without values
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


def test_bench_sweeps_tokens_and_skips_tunables_nobody_reads(tmp_path):
    out = tmp_path / "r.json"
    proc = _run("-m", "megamoe", "bench", "--iters", "1", "--warmup", "0", "--no-check",
                "--backend", "torch-a2a", "--tokens", "17", "33",
                "--tune", "comm_programs=4,8", "--out", str(out))
    _assert_ok(proc)
    records = json.loads(out.read_text())
    # torch-a2a reads no tunable: one record per token count, not one per comm_programs value
    assert sorted(r["tokens_per_rank"] for r in records) == [17, 33]
    assert all(r["comm_programs"] is None and r["copy_programs"] is None for r in records)


def test_tuning_variants_cover_what_each_backend_reads():
    from megamoe.bench import parse_tune, tuning_variants

    tune = parse_tune(["comm_programs=8,16", "minibatch_rows=256,1024", "copy_programs=24,32",
                       "down_lag=auto"])
    assert tune == {"comm_programs": [8, 16], "minibatch_rows": [256, 1024],
                    "copy_programs": [24, 32], "down_lag": [None]}
    fused = tuning_variants("fused", 1, tune)
    assert len(fused) == 4
    assert {"comm_programs": 16, "minibatch_rows": 256, "down_lag": None} in fused
    assert tuning_variants("triton", 1, tune) == [{}]  # nothing moves at W = 1
    assert tuning_variants("triton", 2, tune) == [{"copy_programs": 24}, {"copy_programs": 32}]
    assert tuning_variants("torch-a2a", 2, tune) == [{}]
    assert tuning_variants("fused", 2, {}) == [{}]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--backend", "bogus"], "backend must be one of"),
        (["--iters", "0"], "iters must be >= 1, got 0"),
        (["--preset", "nope"], "invalid choice: 'nope'"),
        (["--tune", "comm_programs"], "tune must look like NAME=V1,V2,..., got 'comm_programs'"),
        (["--tune", "warps=4"], "tune: the tunable must be one of"),
        (["--tune", "ring_rows=x"], "tune: ring_rows values must be integers, got 'x'"),
        (["--tune", "ring_rows=3000"], "ring_rows must be a multiple of minibatch_rows (1024), got 3000"),
        (["--tune", "overlap_shared=auto"], "overlap_shared must be a bool (or 0 / 1), got None"),
        (["--tokens", "0"], "tokens must be >= 1, got 0"),
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


def test_iteration_order_gives_every_run_every_predecessor():
    """Each iteration runs every run once, the same order for the same iteration (all ranks
    agree), and over a benchmark's iterations each run follows each other run."""
    from megamoe.bench import iteration_order

    orders = [iteration_order(it, 4) for it in range(23)]
    assert all(sorted(o) == [0, 1, 2, 3] for o in orders)
    assert orders == [iteration_order(it, 4) for it in range(23)]
    sequence = [i for o in orders for i in o]
    follows = {(a, b) for a, b in zip(sequence, sequence[1:])}
    assert follows >= {(a, b) for a in range(4) for b in range(4) if a != b}
    assert len({tuple(o) for o in orders}) > 4  # not a fixed cycle


def test_timed_runs_interleave_and_a_failing_run_leaves_the_others():
    """Iterations interleave the runs (same GPU clocks for all), in iteration_order; a run that
    raises is dropped from the rotation and reported, the others finish."""
    from megamoe.baselines import torch_a2a_moe
    from megamoe.bench import (BenchOptions, DistEnv, iteration_order, make_case,
                               time_interleaved)

    opts = BenchOptions(presets=["tiny"], backends=["torch-a2a"], tokens=16, iters=3, warmup=1)
    env = DistEnv()
    case = make_case("tiny", opts, env)
    calls: list[str] = []

    def named(name: str, fail_at: int | None = None):
        def fn(*args):
            calls.append(name)
            if fail_at is not None and calls.count(name) == fail_at:
                raise RuntimeError(f"{name} broke")
            return torch_a2a_moe(*args)
        return fn

    ticks: list[int] = []
    results = time_interleaved([(named("a"), case), (named("b", fail_at=2), case),
                                (named("c"), case)], opts, env, ticks.append)
    expected: list[tuple[int, bool]] = []  # (run, finished) per call
    b_calls = 0
    for it in range(4):  # 1 warm-up + 3 timed
        for i in iteration_order(it, 3):
            if i == 1:
                if b_calls == 2:  # b raised on its second call: out of the rotation
                    continue
                b_calls += 1
            expected.append((i, not (i == 1 and b_calls == 2)))
    assert calls == ["abc"[i] for i, _ in expected]
    assert ticks == [i for i, finished in expected if finished]
    assert isinstance(results[1], RuntimeError) and "b broke" in str(results[1])
    for r in (results[0], results[2]):
        assert set(r) == {"fwd_ms", "bwd_ms", "fwdbwd_ms"} and r["fwdbwd_ms"] > 0
    assert all(t.grad is None for t in case.leaves())


# ------------------------------------------------------------------- copy bandwidth (triton, W > 1)

def _layer_record(backend: str, **fields) -> dict:
    rec = dict(preset="dsv3", world_size=2, backend=backend, routing="uniform",
               tokens_per_rank=4096, fwd_ms=5.0, bwd_ms=10.0, fwdbwd_ms=15.0, fwd_tflops=100.0,
               fwdbwd_tflops=200.0, gemm_peak_tflops=700.0, status="ok")
    rec.update(dict.fromkeys(COMM_FIELDS), **fields)
    return rec


def test_table_shows_copy_bandwidth_only_when_present():
    from megamoe.report import format_layer_table

    triton = _layer_record("triton", dispatch_gbps=301.4, combine_gbps=318.6,
                           dispatch_bwd_gbps=297.0, combine_bwd_gbps=315.2, copy_programs=24)
    base = _layer_record("torch-a2a", speedup_vs_torch_a2a=1.0)
    skipped = _layer_record("fused", status="skipped", note="not built")
    lines = format_layer_table([triton, base, skipped]).splitlines()
    for header in ("dispatch GB/s", "combine GB/s", "dy pull GB/s", "dx push GB/s",
                   "copy programs"):
        assert header in lines[0]
    assert lines[0].rstrip().endswith("check (rel err)")
    assert lines[2].split()[-6:] == ["301", "319", "297", "315", "24", "-"]
    assert lines[3].split()[-6:] == ["-"] * 6
    assert lines[4].endswith("skipped: not built")  # the reason stays in the last column
    md = format_layer_table([triton, base], markdown=True)
    assert "| 301 | 319 | 297 | 315 | 24 | - |" in md
    assert "GB/s" not in format_layer_table([base])


def test_tunables_and_copy_timing_only_where_they_apply():
    from megamoe.bench import DistEnv, measures_comm, tunable_fields
    from megamoe.config import get_preset

    config = get_preset("tiny").config(2).replace(copy_programs=12)
    assert tunable_fields("triton", config, 2) == {"copy_programs": 12, "overlap_shared": True}
    assert tunable_fields("triton", config, 1) == {}
    assert "overlap_shared" not in tunable_fields("fused", config, 1)  # no copies at W = 1
    assert tunable_fields("reference", config, 2) == tunable_fields("torch-a2a", config, 2) == {}
    cpu2 = DistEnv(world_size=2, rank=0)
    assert not measures_comm("triton", cpu2)  # no CUDA
    gpu = torch.device("cuda", 0)
    assert measures_comm("triton", DistEnv(world_size=2, device=gpu))
    assert not measures_comm("triton", DistEnv(world_size=1, device=gpu))
    assert not measures_comm("torch-a2a", DistEnv(world_size=2, device=gpu))



def test_fused_records_the_comm_programs_it_uses():
    pytest.importorskip("triton")
    from megamoe.backends.fused import resolved_tunables
    from megamoe.bench import tunable_fields
    from megamoe.config import get_preset
    from megamoe.kernels.fused_forward import comm_kernel_programs, comm_programs_for
    from megamoe.kernels.runtime import persistent_programs

    config = get_preset("dsv3").config(2)
    cpu = torch.device("cpu")
    # W = 2 with a ring of every row: the comm kernel, with one program per two SMs
    assert resolved_tunables(config, cpu, 2) == {
        "comm_programs": comm_kernel_programs(cpu), "comm_kernel": True}
    assert resolved_tunables(config.replace(comm_programs=12), cpu, 2) == {
        "comm_programs": 12, "comm_kernel": True}
    # one kernel: with a bounded ring, or when asked (at W = 1 its pull rate is a local copy's)
    one = {"comm_programs": comm_programs_for(persistent_programs(cpu), 2048, 2),
           "comm_kernel": False}
    assert resolved_tunables(config.replace(comm_kernel=False), cpu, 2) == one
    assert resolved_tunables(config.replace(ring_rows=4096), cpu, 2) == one
    assert resolved_tunables(config.replace(ring_rows=4096), cpu, 1) == {
        "comm_programs": comm_programs_for(persistent_programs(cpu), 2048, 1),
        "comm_kernel": False}
    # W = 1 with a ring of every row: the comm kernel too
    assert resolved_tunables(config, cpu, 1) == {
        "comm_programs": comm_kernel_programs(cpu), "comm_kernel": True}
    # no GPU: the record keeps the config's None (derived) rather than a CPU-grid number
    assert tunable_fields("fused", config, 2, cpu)["comm_programs"] is None


def test_remote_gbps():
    from megamoe.bench_comm import remote_gbps

    assert remote_gbps([3_000_000, 1_000_000], 0.01) == pytest.approx(300.0)  # 3 MB in 10 us
    assert remote_gbps([0, 0], 1.0) == 0.0


def needs_interpreter(test):
    """Emulated ranks run their kernels in the Triton interpreter (tests/conftest.py)."""
    skip = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
                              reason="emulated ranks need the Triton interpreter")
    quiet = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
    return skip(quiet(test))


def _emulated_pair(t: int = 8, h: int = 32, k: int = 2, e_local: int = 2, block_rows: int = 16):
    """Two emulated ranks with random routing, published, and each rank's schedule."""
    from megamoe.kernels.schedule import build_row_schedule
    from megamoe.workspace import emulated_workspaces, publish

    gen = torch.Generator().manual_seed(5)
    ws = emulated_workspaces(2, t, h, k)
    ids = [torch.rand(t, 2 * e_local, generator=gen).argsort(dim=1)[:, :k] for _ in ws]
    for w, i in zip(ws, ids):
        publish(w, x=torch.randn(t, h, generator=gen).to(torch.bfloat16), topk_ids=i,
                topk_weights=torch.rand(t, k, generator=gen),
                dy=torch.randn(t, h, generator=gen).to(torch.bfloat16))
    all_ids = torch.cat(ids).to(torch.int32)
    scheds = [build_row_schedule(all_ids, e_local, block_rows, expert_lo=r * e_local)
              for r in range(2)]
    return ws, ids, scheds, e_local


@needs_interpreter
def test_remote_rows_count_only_other_ranks_tokens():
    from megamoe.bench_comm import remote_rows

    ws, ids, scheds, e_local = _emulated_pair()
    for r in range(2):
        peer = ids[1 - r]  # entries of the other rank's tokens routed to r's experts
        want = int((peer // e_local == r).sum())
        assert want > 0 and remote_rows(ws[r], scheds[r]) == want


@needs_interpreter
def test_layer_comm_gbps_runs_each_copy_with_the_programs(monkeypatch):
    """The plumbing of the bench's GPU path, with the device timing replaced by fixed times:
    each of the four copies really runs (interpreter) with the given programs."""
    from megamoe import bench_comm
    from megamoe.kernels import comm

    ws, _, scheds, _ = _emulated_pair()
    launches: list[tuple[str, int]] = []

    def spy(name, real):
        def run(*args, **kw):
            launches.append((name, kw["programs"]))
            return real(*args, **kw)
        return run

    monkeypatch.setattr(comm, "dispatch_pull", spy("pull", comm.dispatch_pull))
    monkeypatch.setattr(comm, "combine_push", spy("push", comm.combine_push))
    def fake_time_op(ws, fn, iters, warmup, group=None):
        fn()
        return [4.0, 2.0, 1.0]  # median 2 ms

    monkeypatch.setattr(bench_comm, "time_op", fake_time_op)
    monkeypatch.setattr(bench_comm, "remote_bytes_per_rank",
                        lambda ws, sched, group=None: [2_000_000, 1_000_000])
    got = bench_comm.layer_comm_gbps(ws[0], scheds[0], programs=3, iters=3, warmup=0)
    assert got == {f: pytest.approx(1.0) for f in ("dispatch_gbps", "combine_gbps",
                                                    "dispatch_bwd_gbps", "combine_bwd_gbps")}
    assert launches == [("pull", 3), ("push", 3), ("pull", 3), ("push", 3)]


def test_set_applies_tunables_and_names_bad_ones(capsys):
    import argparse

    from megamoe.cli import apply_settings
    from megamoe.config import get_preset

    parser = argparse.ArgumentParser(prog="tool")
    config = apply_settings(get_preset("tiny").config(1),
                            ["overlap_shared=0", "down_lag=auto", "comm_programs=4"], parser)
    assert (config.overlap_shared, config.down_lag, config.comm_programs) == (False, None, 4)
    for spec, message in (("overlap_shared=2", "overlap_shared must be a bool"),
                          ("warps=4", "the tunable must be one of"),
                          ("comm_programs=0", "comm_programs must be >= 1")):
        with pytest.raises(SystemExit):
            apply_settings(config, [spec], parser)
        assert message in capsys.readouterr().err


def test_gpu_check_script_names_bad_parts_and_needs_a_gpu(tmp_path):
    script = os.path.join(os.path.dirname(__file__), "..", "scripts", "gpu_check.sh")
    env = dict(os.environ, OUT=str(tmp_path), CUDA_VISIBLE_DEVICES="")
    bad = subprocess.run(["bash", script, "tests", "bogus"], capture_output=True, text=True,
                         env=env, timeout=TIMEOUT_S)
    assert bad.returncode == 2 and "unknown part 'bogus'" in bad.stderr
    if torch.cuda.is_available():
        return
    run = subprocess.run(["bash", script, "tests-ep"], capture_output=True, text=True, env=env,
                         timeout=TIMEOUT_S)
    assert run.returncode == 1 and "no CUDA GPU visible" in run.stdout
    packed = tmp_path / "packed"
    run = subprocess.run(["bash", script, "bench"], capture_output=True, text=True,
                         env=dict(env, OUT=str(packed), MEGAMOE_PACK="1"), timeout=TIMEOUT_S)
    assert run.returncode == 1, run.stdout + run.stderr
    assert sorted(p.name for p in packed.iterdir()) == ["gpu_check.tgz", "summary.txt"]
    with tarfile.open(packed / "gpu_check.tgz") as tar:
        assert {"./info.txt", "./summary.txt"} <= set(tar.getnames())
