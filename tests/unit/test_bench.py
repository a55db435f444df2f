"""The layer benchmark's parts: tunable sweeps, the accuracy check, the interleaved timing and
the tunables each record carries."""

import pytest
import torch


def test_tuning_variants_cover_what_each_backend_reads():
    from megamoe.tools.bench import parse_tune, tuning_variants

    tune = parse_tune(
        ["comm_programs=8,16", "minibatch_rows=256,1024", "copy_programs=24,32", "down_lag=auto"]
    )
    assert tune == {
        "comm_programs": [8, 16],
        "minibatch_rows": [256, 1024],
        "copy_programs": [24, 32],
        "down_lag": [None],
    }
    fused = tuning_variants("fused", 1, tune)
    assert len(fused) == 4
    assert {"comm_programs": 16, "minibatch_rows": 256, "down_lag": None} in fused
    assert tuning_variants("triton", 1, tune) == [{}]  # nothing moves at W = 1
    assert tuning_variants("triton", 2, tune) == [{"copy_programs": 24}, {"copy_programs": 32}]
    assert tuning_variants("torch-a2a", 2, tune) == [{}]
    assert tuning_variants("fused", 2, {}) == [{}]


def test_accuracy_check_catches_a_wrong_layer():
    """The bench's check must fail a layer that is slightly off (5% on the output)."""
    from megamoe.tools.baselines import torch_a2a_moe
    from megamoe.tools.bench import check_backend, float64_result
    from megamoe.tools.harness import DistEnv, make_case

    env = DistEnv()
    case = make_case("tiny", env, tokens=40, seed=int(torch.randint(0, 2**31 - 1, ()).item()))
    expected = float64_result(case, env)
    assert check_backend(torch_a2a_moe, case, expected, env)["check_ok"] is True

    def off_by_5_percent(*args):
        return torch_a2a_moe(*args) * 1.05

    bad = check_backend(off_by_5_percent, case, expected, env)
    assert bad["check_ok"] is False and bad["check_rel"] > 0.04


def test_iteration_order_gives_every_run_every_predecessor():
    """Each iteration runs every run once, the same order for the same iteration (all ranks
    agree), and over a benchmark's iterations each run follows each other run."""
    from megamoe.tools.bench import iteration_order

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
    from megamoe.tools.baselines import torch_a2a_moe
    from megamoe.tools.bench import BenchOptions, iteration_order, time_interleaved
    from megamoe.tools.harness import DistEnv, make_case

    opts = BenchOptions(shapes=["tiny"], backends=["torch-a2a"], tokens=16, iters=3, warmup=1)
    env = DistEnv()
    case = make_case("tiny", env, tokens=16)
    calls: list[str] = []

    def named(name: str, fail_at: int | None = None):
        def fn(*args):
            calls.append(name)
            if fail_at is not None and calls.count(name) == fail_at:
                raise RuntimeError(f"{name} broke")
            return torch_a2a_moe(*args)

        return fn

    ticks: list[int] = []
    results = time_interleaved(
        [(named("a"), case), (named("b", fail_at=2), case), (named("c"), case)],
        opts,
        env,
        ticks.append,
    )
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
        assert set(r) == {"fwd_ms", "bwd_ms", "fwdbwd_ms", "host_fwd_ms", "host_bwd_ms"}
        assert r["fwdbwd_ms"] > 0 and r["host_fwd_ms"] > 0 and r["host_bwd_ms"] > 0
    assert all(t.grad is None for t in case.leaves())


@pytest.mark.parametrize("mode, syncs_per_iteration", [("throughput", 0), ("latency", 1)])
def test_latency_mode_waits_for_the_device_before_each_iteration(
    monkeypatch, mode, syncs_per_iteration
):
    from megamoe.tools import bench
    from megamoe.tools.baselines import torch_a2a_moe
    from megamoe.tools.harness import DistEnv, make_case

    events: list[str] = []
    monkeypatch.setattr(bench._Clock, "sync", lambda self: events.append("sync"))

    def fn(*args):
        events.append("call")
        return torch_a2a_moe(*args)

    opts = bench.BenchOptions(shapes=["tiny"], backends=["torch-a2a"], iters=2, warmup=1)
    case = make_case("tiny", DistEnv(), tokens=8)
    bench.time_interleaved([(fn, case)], opts, DistEnv(), lambda i: None, mode)
    per_iteration = ["sync"] * syncs_per_iteration + ["call"]
    assert events == per_iteration * 3 + ["sync"]  # and the one sync before reading the clocks


def test_a_run_failing_in_one_mode_keeps_its_records_of_the_others(monkeypatch):
    """(A backend that cannot be captured in a CUDA graph still has its eager records.)"""
    from megamoe.tools import bench
    from megamoe.tools.baselines import torch_a2a_moe
    from megamoe.tools.harness import DistEnv

    timed = bench.time_interleaved

    def fails_in_latency(runs, opts, env, tick, mode="throughput"):
        results = timed(runs, opts, env, tick, mode)
        if mode == "latency":
            results = [
                RuntimeError("cannot capture") if fn is torch_a2a_moe else r
                for (fn, _), r in zip(runs, results)
            ]
        return results

    monkeypatch.setattr(bench, "time_interleaved", fails_in_latency)
    opts = bench.BenchOptions(
        shapes=["tiny"],
        backends=["reference", "torch-a2a"],
        tokens=[8],
        iters=1,
        warmup=0,
        check=False,
        modes=["throughput", "latency"],
    )
    records = bench.run_bench(opts, DistEnv())
    got = {(r["backend"], r["mode"]): r for r in records}
    assert set(got) == {(b, m) for b in ("reference", "torch-a2a") for m in opts.modes}
    assert got["torch-a2a", "throughput"]["fwdbwd_ms"] > 0
    assert got["torch-a2a", "latency"]["status"] == "error"
    assert "cannot capture" in got["torch-a2a", "latency"]["note"]
    assert got["reference", "latency"]["fwdbwd_ms"] > 0
    assert {r["backward"] for r in records} == {"reference", "torch-a2a"}


def test_records_say_which_backward_ran(monkeypatch):
    from megamoe.backends.fused import FUSED_BACKWARD_ENV
    from megamoe.tools.bench import backward_of

    assert backward_of("triton", 1) == "triton"
    monkeypatch.delenv(FUSED_BACKWARD_ENV, raising=False)
    assert backward_of("fused", 1) == "triton"  # opt-in
    monkeypatch.setenv(FUSED_BACKWARD_ENV, "1")
    assert backward_of("fused", 1) == "fused"
    assert backward_of("fused", 2) == "fused"  # dy pull and d_x push inside the kernel
    monkeypatch.setenv(FUSED_BACKWARD_ENV, "yes")
    with pytest.raises(ValueError, match="must be 0 or 1"):
        backward_of("fused", 1)


def test_graph_mode_needs_a_gpu():
    """(The graph mode's replays are timed on the GPU: scripts/gpu_check.sh host.)"""
    from megamoe.tools import bench
    from megamoe.tools.baselines import torch_a2a_moe
    from megamoe.tools.harness import DistEnv, make_case

    opts = bench.BenchOptions(shapes=["tiny"], backends=["torch-a2a"], modes=["graph"], iters=1)
    case = make_case("tiny", DistEnv(), tokens=8)
    with pytest.raises(ValueError, match=r"mode 'graph' needs a CUDA device, got cpu"):
        bench.time_interleaved([(torch_a2a_moe, case)], opts, DistEnv(), lambda i: None, "graph")


def test_tunables_and_copy_timing_only_where_they_apply():
    from megamoe.shapes import get_preset
    from megamoe.tools.bench import measures_comm, tunable_fields
    from megamoe.tools.harness import DistEnv

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


def test_fused_records_the_comm_programs_it_uses(monkeypatch):
    pytest.importorskip("triton")
    from megamoe.backends.fused import resolved_tunables
    from megamoe.kernels import fp8, fp8_gemm
    from megamoe.kernels.fused import comm_kernel_programs, comm_programs_for
    from megamoe.kernels.fused.plan import pull_programs_for, push_programs_for
    from megamoe.kernels.runtime import persistent_programs
    from megamoe.shapes import get_preset
    from megamoe.tools.bench import tunable_fields

    config = get_preset("dsv3").config(2)
    cpu = torch.device("cpu")
    # (push programs: only the pipelined fp8 forward's)
    kernel = {"push_programs": None, "comm_kernel": True, "forward": "comm_kernel"}
    # W = 2 with a ring of every row: the comm kernel, with one program per two SMs
    assert resolved_tunables(config, cpu, 2) == {
        "comm_programs": comm_kernel_programs(cpu),
        **kernel,
    }
    assert resolved_tunables(config.replace(comm_programs=12), cpu, 2) == {
        "comm_programs": 12,
        **kernel,
    }
    # one kernel: with a bounded ring, or when asked (at W = 1 its pull rate is a local copy's)
    one = {
        "comm_programs": comm_programs_for(persistent_programs(cpu), 2048, 2),
        "push_programs": None,
        "comm_kernel": False,
        "forward": "one_kernel",
    }
    assert resolved_tunables(config.replace(comm_kernel=False), cpu, 2) == one
    assert resolved_tunables(config.replace(ring_rows=4096), cpu, 2) == one
    assert resolved_tunables(config.replace(ring_rows=4096), cpu, 1) == {
        **one,
        "comm_programs": comm_programs_for(persistent_programs(cpu), 2048, 1),
    }
    # W = 1 with a ring of every row: the comm kernel too
    assert resolved_tunables(config, cpu, 1) == {
        "comm_programs": comm_kernel_programs(cpu),
        **kernel,
    }
    # fp8: the one kernel where the warp-specialized GEMMs do not run (here: the interpreter);
    # where they run (a Hopper GPU) the pipelined forward at W > 1, its pulls on SMs of their
    # own, and with one process backend triton's forward (no pulls, no comm kernel);
    # MEGAMOE_PIPELINED_FP8=0 or a bounded ring: the one kernel
    fp8_config = config.replace(precision="fp8")
    assert resolved_tunables(fp8_config, cpu, 1)["forward"] == "one_kernel"
    monkeypatch.setattr(fp8_gemm, "warp_specialized", lambda kind, device, rows: True)
    assert resolved_tunables(fp8_config, cpu, 1) == {
        "comm_programs": None,
        "push_programs": None,
        "comm_kernel": False,
        "forward": "unfused",
    }
    assert resolved_tunables(fp8_config.replace(ring_rows=4096), cpu, 2) == one
    monkeypatch.setenv("MEGAMOE_PIPELINED_FP8", "0")
    assert resolved_tunables(fp8_config, cpu, 2) == one
    monkeypatch.delenv("MEGAMOE_PIPELINED_FP8")
    programs = persistent_programs(cpu)
    pulls = pull_programs_for(programs, 7168, 2048, 2 * fp8.packed_width(7168), 2)
    pipelined = {
        "comm_programs": pulls,
        "push_programs": push_programs_for(programs, 2048),
        "comm_kernel": True,
        "forward": "pipelined",
    }
    assert resolved_tunables(fp8_config, cpu, 2) == pipelined
    assert resolved_tunables(fp8_config.replace(push_programs=5), cpu, 2) == {
        **pipelined,
        "push_programs": 5,
    }
    # the push keeps pace with down: more programs where down makes fewer FLOPs a z byte (I)
    assert 1 <= push_programs_for(programs, 2048) <= push_programs_for(programs, 768) < programs
    assert 1 <= pulls <= pull_programs_for(programs, 7168, 768, 2 * fp8.packed_width(7168), 2)
    assert resolved_tunables(fp8_config.replace(comm_kernel=False), cpu, 2) == one
    assert resolved_tunables(fp8_config.replace(comm_kernel=True), cpu, 2) == {
        "comm_programs": comm_kernel_programs(cpu),
        **kernel,
    }
    # no GPU: the record keeps the config's None (derived) rather than a CPU-grid number
    assert tunable_fields("fused", config, 2, cpu)["comm_programs"] is None


def test_set_applies_tunables_and_names_bad_ones(capsys):
    import argparse

    from megamoe.shapes import get_preset
    from megamoe.tools.harness import apply_settings

    parser = argparse.ArgumentParser(prog="tool")
    config = apply_settings(
        get_preset("tiny").config(1),
        ["overlap_shared=0", "down_lag=auto", "comm_programs=4"],
        parser,
    )
    assert (config.overlap_shared, config.down_lag, config.comm_programs) == (False, None, 4)
    for spec, message in (
        ("overlap_shared=2", "overlap_shared must be a bool"),
        ("warps=4", "the tunable must be one of"),
        ("comm_programs=0", "comm_programs must be >= 1"),
    ):
        with pytest.raises(SystemExit):
            apply_settings(config, [spec], parser)
        assert message in capsys.readouterr().err


def _count_fp8_weight_resets(monkeypatch) -> list[int]:
    """A one-element list counting the bench's empties of the fp8 weight cache (which still
    happen)."""
    from megamoe.tools import bench

    cleared = [0]
    real_forget = bench.forget_fp8_weights

    def forget():
        cleared[0] += 1
        real_forget()

    monkeypatch.setattr(bench, "forget_fp8_weights", forget)
    return cleared


def test_precisions_run_interleaved_with_their_bf16_runs(monkeypatch):
    """--precision bf16 fp8: an fp8 run of each backend that has it, checked with fp8's
    tolerance and compared with its own bf16 run; the baseline runs once, in bf16; a backend
    without fp8 gets a skipped record saying why."""
    from megamoe.tools import bench
    from megamoe.tools.harness import DistEnv

    cleared = _count_fp8_weight_resets(monkeypatch)
    opts = bench.BenchOptions(
        shapes=["tiny"],
        backends=["reference", "fused", "torch-a2a"],
        iters=2,
        warmup=0,
        precisions=["bf16", "fp8"],
    )
    records = bench.run_bench(opts, DistEnv())
    got = {(r["backend"], r["precision"]): r for r in records}
    assert set(got) == {
        ("reference", "bf16"),
        ("reference", "fp8"),
        ("fused", "bf16"),
        ("fused", "fp8"),
        ("torch-a2a", "bf16"),
    }
    fp8 = got["reference", "fp8"]
    assert fp8["status"] == "ok" and fp8["check_ok"] is True
    assert bench.CHECK_RTOL["bf16"] < fp8["check_rel"] <= bench.CHECK_RTOL["fp8"]
    bf16 = got["reference", "bf16"]
    assert fp8["speedup_vs_bf16"] == pytest.approx(bf16["fwdbwd_ms"] / fp8["fwdbwd_ms"])
    assert fp8["speedup_vs_torch_a2a"] == pytest.approx(
        got["torch-a2a", "bf16"]["fwdbwd_ms"] / fp8["fwdbwd_ms"]
    )
    assert bf16["speedup_vs_bf16"] is None
    assert got["fused", "fp8"]["status"] == "skipped"  # (on the CPU: no GPU for it)
    fp8_config = bench.resolve_shape("tiny").config(1).replace(precision="fp8")
    assert bench.precision_status("fused", fp8_config) == (True, "")
    assert bench.precision_status("triton", fp8_config) == (True, "")
    assert not bench.precision_status("torch-a2a", fp8_config)[0]
    assert bench.precision_status("auto", fp8_config) == (True, "")  # resolves to one that does
    assert bench.total_steps(opts) == 1 + 1 + 5 * (1 + 2)  # peak, reference, 5 runs
    assert cleared[0] >= 2  # every timed fp8 iteration starts from an empty weight cache
    with pytest.raises(ValueError, match=r"precision must be one of \['bf16', 'fp8'\], got 'fp4'"):
        bench.BenchOptions(shapes=["tiny"], backends=["reference"], precisions=["fp4"])


def test_micro_batches_quantize_fp8_weights_once_per_optimizer_step(monkeypatch):
    """--micro-batches N: an fp8 run empties its weight cache in every N-th timed iteration
    only (the first micro-batch of each optimizer step), and the records say N."""
    from megamoe.tools import bench
    from megamoe.tools.harness import DistEnv

    cleared = _count_fp8_weight_resets(monkeypatch)
    for micro_batches, want in ((1, 4), (2, 2), (4, 1)):
        cleared[0] = 0
        opts = bench.BenchOptions(
            shapes=["tiny"],
            backends=["reference"],
            iters=4,
            warmup=0,
            check=False,
            precisions=["fp8"],
            micro_batches=micro_batches,
        )
        (rec,) = bench.run_bench(opts, DistEnv())
        assert rec["status"] == "ok" and rec["micro_batches"] == micro_batches
        assert cleared[0] == want, (micro_batches, cleared[0])
    with pytest.raises(ValueError, match="micro_batches must be >= 1, got 0"):
        bench.BenchOptions(shapes=["tiny"], backends=["reference"], micro_batches=0)


def test_per_micro_batch_amortizes_the_quantizing_iterations():
    """The record's time per micro-batch carries 1/N of what the quantizing iterations took
    more: a median of mostly non-quantizing iterations alone would drop it."""
    from megamoe.tools.bench import per_micro_batch

    times = torch.tensor([10.0, 2.0, 2.2, 1.8, 12.0, 2.0, 2.1, 1.9])
    starts = [True, False, False, False, True, False, False, False]
    # median of the others 2.0, of the quantizing ones 11.0: 2.0 + 9.0 / 4
    assert per_micro_batch(times, starts, 4) == pytest.approx(4.25)
    assert per_micro_batch(times, [False] * 8, 4) == pytest.approx(2.05)  # cached: the median
    assert per_micro_batch(times, [True] * 8, 1) == pytest.approx(2.05)  # every one quantizes
    with pytest.raises(ValueError):  # one flag per iteration
        per_micro_batch(times, starts[:-1], 4)
