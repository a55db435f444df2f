"""The layer benchmark: every backend and the torch-a2a baseline on any shapes, in one run.

Per (shape, tokens, backend): optionally check outputs and all gradients against the float64
reference, then time ``warmup + iters`` training iterations (forward, then backward), the backends'
iterations interleaved so that they all run at the same GPU clocks. Each iteration's
forward, backward and forward+backward times are taken per rank (CUDA events on a GPU, the host
clock on the CPU), reduced with MAX over ranks, and the MEDIAN over iterations is reported, with
TFLOP/s per GPU from :meth:`MoEConfig.flops_per_token` (backward counts twice the forward) and
the dense bf16 GEMM rate measured in the same run. BENCHMARKS.md "Method" lists the record
fields.

Backend "triton" at W > 1 on GPUs also gets the bandwidth of its NVLink copies: after its layer
timing, the step's schedule is built once on the case's routing and the dispatch pull, combine
push, dy pull and d_x push are timed alone (``bench_comm.layer_comm_gbps``: GB/s of remote bytes,
median of the per-iteration max over ranks), with the config's ``copy_programs``.

Every rank calls :func:`run_bench` (it uses collectives); rank 0 reports.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import functools
import itertools
import os
import platform
import random
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from .. import functional
from ..backends import (
    BACKENDS,
    available_backends,
    get_backend,
    precision_reason,
    resolve_backend,
)
from ..config import PRECISIONS, TUNABLES, MoEConfig
from ..reference import moe_reference
from .harness import (
    BASELINE,
    DEFAULT_SEED,
    BenchShape,
    Case,
    DistEnv,
    layer_fn,
    make_case,
    resolve_shape,
)
from .report import ProgressBar
from .routing import ROUTING_KINDS
from .testing import MoEFn, RunResult, compare_results, run_with_grads

__all__ = [
    "BASELINE",
    "RECORD_FIELDS",
    "DistEnv",
    "BenchOptions",
    "default_shapes",
    "default_backends",
    "measure_gemm_peak",
    "per_micro_batch",
    "measures_comm",
    "tunable_fields",
    "reads_tunables",
    "parse_tune",
    "tuning_variants",
    "run_bench",
    "git_commit",
]

# The fields of a layer record (BENCHMARKS.md "Method").
RECORD_FIELDS: tuple[str, ...] = (
    "preset",
    "model",
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
    "resolved_backend",
    "backward",
    "precision",
    "fwd_ms",
    "bwd_ms",
    "fwdbwd_ms",
    "host_fwd_ms",
    "host_bwd_ms",
    "fwd_tflops",
    "fwdbwd_tflops",
    "gemm_peak_tflops",
    "routing",
    "iters",
    "micro_batches",
    "check",
    "speedup_vs_torch_a2a",
    "check_rel",
    "check_ok",
    "fwd_speedup_vs_torch_a2a",
    "speedup_vs_bf16",
    "fwd_speedup_vs_bf16",
    "local_experts",
    "warmup",
    "status",
    "note",
    "torch",
    # Where they apply (else null): GB/s of the NVLink copies and the config tunables used.
    "dispatch_gbps",
    "combine_gbps",
    "dispatch_bwd_gbps",
    "combine_bwd_gbps",
    "comm_programs",
    "push_programs",
    "minibatch_rows",
    "ring_rows",
    "down_lag",
    "copy_programs",
    "overlap_shared",
    "comm_kernel",
)
# Worst relative error (norm-wise, output and every gradient) a layer may have vs float64, per
# precision (fp8: docs/fp8.md measures 6.6-6.9% on y).
CHECK_RTOL = {"bf16": 2e-2, "fp8": 1e-1}
# Dense GEMM for the peak: n^3 bf16 (8192 as in docs/hardware.md on a GPU; small on the CPU).
GEMM_PEAK_SIZE = {"cuda": 8192, "cpu": 512}
GEMM_PEAK_WARMUP, GEMM_PEAK_ITERS = 3, 10
# Backward FLOPs are twice the forward's (dgrad + wgrad), so fwd+bwd = 3x forward.
FWDBWD_FLOP_FACTOR = 3
# Config tunables each backend reads, recorded with its results (DESIGN.md: "where they apply")
# and swept by ``--tune``. The unfused "triton" backend moves rows with copy_programs programs
# at W > 1 (nothing moves at W = 1); the fused kernel reads its five at any W (MoEConfig), its
# pipelined fp8 forward push_programs at W > 1, and copy_programs for the pull of its backward
# replay (a ring smaller than the rows). Both run
# the shared expert beside the copies (overlap_shared), "fused" in its (unfused) backward.
BACKEND_TUNABLES: dict[str, tuple[str, ...]] = {
    "triton": ("copy_programs", "overlap_shared"),
    "fused": (
        "comm_programs",
        "push_programs",
        "minibatch_rows",
        "ring_rows",
        "down_lag",
        "overlap_shared",
        "comm_kernel",
    ),
}
# How iterations follow each other. "throughput": back to back, the host running ahead of the
# GPU (a training loop without syncs; the host time then hides behind the GPU's). "latency": a
# device sync before each iteration, so the GPU idles while the host prepares each call and
# the host time adds to the step (a loop that syncs, e.g. for a loss print, or a host-bound one).
# "graph": the forward and the whole step each captured once in a CUDA graph and replayed back
# to back (a loop under torch.compile's CUDA graphs): the host time is the replay's, and a
# backend that synchronizes with the host cannot be captured (its records carry the error).
TIMING_MODES: dict[str, bool] = {"throughput": False, "latency": True, "graph": False}
# The tunables that matter at W = 1 too (no copies there), per backend.
_TUNED_AT_W1: dict[str, tuple[str, ...]] = {
    "fused": ("comm_programs", "minibatch_rows", "ring_rows", "down_lag", "comm_kernel"),
}


@dataclass
class BenchOptions:
    shapes: list[str | BenchShape]  # presets, model names or "H,I,E,K[,Is]" (resolve_shape)
    backends: list[str]
    iters: int = 20
    warmup: int = 3
    tokens: list[int] | None = None  # tokens per rank, one case each (None: the shape's)
    routing: str = "uniform"
    check: bool = True
    seed: int = DEFAULT_SEED
    tune: dict[str, list[int]] = field(default_factory=dict)  # tunable -> values to sweep
    modes: list[str] = field(default_factory=lambda: ["throughput"])  # see TIMING_MODES
    precisions: list[str] = field(default_factory=lambda: ["bf16"])  # MoEConfig.precision
    # timed iterations per optimizer step: fp8 runs quantize their weights again once every
    # this many iterations (as after each optimizer step with gradient accumulation)
    micro_batches: int = 1

    def __post_init__(self) -> None:
        self.shapes = [resolve_shape(s) for s in self.shapes]  # raises with the valid names
        valid = [*BACKENDS, "auto", BASELINE]
        for b in self.backends:
            if b not in valid:
                raise ValueError(f"backend must be one of {valid}, got {b!r}")
        if isinstance(self.modes, str):
            self.modes = [self.modes]
        for m in self.modes:
            if m not in TIMING_MODES:
                raise ValueError(f"mode must be one of {list(TIMING_MODES)}, got {m!r}")
        if not self.modes:
            raise ValueError("modes: give at least one of " + ", ".join(TIMING_MODES))
        if isinstance(self.precisions, str):
            self.precisions = [self.precisions]
        for p in self.precisions:
            if p not in PRECISIONS:
                raise ValueError(f"precision must be one of {list(PRECISIONS)}, got {p!r}")
        if not self.precisions:
            raise ValueError("precisions: give at least one of " + ", ".join(PRECISIONS))
        if self.micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {self.micro_batches}")
        if self.routing not in ROUTING_KINDS:
            raise ValueError(f"routing must be one of {list(ROUTING_KINDS)}, got {self.routing!r}")
        if self.iters < 1:
            raise ValueError(f"iters must be >= 1, got {self.iters}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if isinstance(self.tokens, int):
            self.tokens = [self.tokens]
        for t in self.tokens or ():
            if t < 1:
                raise ValueError(f"tokens must be >= 1, got {t}")
        for name, values in self.tune.items():
            if name not in TUNABLES:
                raise ValueError(f"tune: the tunable must be one of {list(TUNABLES)}, got {name!r}")
            if not values:
                raise ValueError(f"tune: {name} needs at least one value")
        for shape in self.shapes:  # every swept combination must be a valid config
            for combo in _combinations(self.tune):
                shape.config(1, **combo)


# ------------------------------------------------------------------------------------ defaults


def default_shapes(device: torch.device) -> list[str]:
    return ["dsv3"] if device.type == "cuda" else ["tiny"]


# Without a GPU the bench compares the PyTorch paths only: Triton's interpreter (which may be
# switched on for tests) is for correctness, far too slow to time.
CPU_DEFAULT_BACKENDS: tuple[str, ...] = ("reference", BASELINE)


def default_backends(device: torch.device) -> list[str]:
    """On a GPU every backend available there, then the baseline; on the CPU reference and the
    baseline."""
    if device.type != "cuda":
        return list(CPU_DEFAULT_BACKENDS)
    names = [n for n, (ok, _) in available_backends(device).items() if ok]
    return [*names, BASELINE]


def run_precisions(backend: str, opts: BenchOptions) -> list[str]:
    """The precisions ``backend`` gets a run of: every one asked for, the baseline bf16 only
    (once, as the baseline of them all)."""
    return ["bf16"] if backend == BASELINE else list(opts.precisions)


def precision_status(name: str, config: MoEConfig) -> tuple[bool, str]:
    """Whether ``name`` runs ``config.precision`` ("auto" takes a backend that does; the
    baseline runs bf16 only)."""
    if name == "auto":
        return True, ""
    if name == BASELINE:
        if config.precision == "bf16":
            return True, ""
        return False, f"{name} runs precision 'bf16' only, got {config.precision!r}"
    reason = precision_reason(name, config.precision)
    return reason is None, reason or ""


def backend_status(name: str, device: torch.device) -> tuple[bool, str]:
    if name == "auto":
        return True, "the best available backend for the shape (docs/tuning.md)"
    if name == BASELINE:
        how = "torch._grouped_mm" if hasattr(torch, "_grouped_mm") else "per-expert matmul loop"
        return True, f"all_to_all_single + {how}"
    return available_backends(device).get(name, (False, "unknown backend"))


# --------------------------------------------------------------------------------- run facts


def git_commit() -> str:
    """$MEGAMOE_COMMIT when set (a copied tree may carry stale git metadata), else ``git
    rev-parse --short HEAD`` of the source tree, else "unknown"."""
    pinned = os.environ.get("MEGAMOE_COMMIT")
    if pinned:
        return pinned
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        if out:
            return out
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.machine()}, {os.cpu_count()} cores)"


def _utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


# -------------------------------------------------------------------------------------- timing


class _Clock:
    """Marks on the device timeline: CUDA events on a GPU, the host clock on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def elapsed_ms(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) if self.cuda else (end - start) * 1e3


def _max_over_ranks(values: list[list[float]], env: DistEnv) -> torch.Tensor:
    """Per-iteration values [iters, n] reduced with MAX over the ranks of the group."""
    t = torch.tensor(values, dtype=torch.float64, device=env.device)
    if env.group is not None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=env.group)
    return t.cpu()


def _median(column: torch.Tensor) -> float:
    return float(statistics.median(column.tolist()))


def per_micro_batch(column: torch.Tensor, step_starts: list[bool], micro_batches: int) -> float:
    """A timed field's value per micro-batch with the weights quantized once per optimizer step
    of ``micro_batches`` micro-batches: the median of the iterations that did not quantize plus
    1 / ``micro_batches`` of what the iterations that did (``step_starts``) took more, in
    median. A plain median would drop that extra whenever fewer than half the iterations
    quantize. With every iteration quantizing (1) or none (the weights quantized in the
    warm-up: cached) it is the median."""
    starts = [v for v, s in zip(column.tolist(), step_starts, strict=True) if s]
    others = [v for v, s in zip(column.tolist(), step_starts, strict=True) if not s]
    if not starts or not others:
        return _median(column)
    plain = statistics.median(others)
    return float(plain + (statistics.median(starts) - plain) / micro_batches)


def measure_gemm_peak(env: DistEnv) -> float:
    """Dense bf16 n^3 matmul rate (TFLOP/s): median over iterations of the max over ranks."""
    n = GEMM_PEAK_SIZE["cuda" if env.device.type == "cuda" else "cpu"]
    gen = torch.Generator(device=env.device).manual_seed(DEFAULT_SEED + env.rank)
    a = torch.randn((n, n), generator=gen, device=env.device).to(torch.bfloat16)
    b = torch.randn((n, n), generator=gen, device=env.device).to(torch.bfloat16)
    clock = _Clock(env.device)
    for _ in range(GEMM_PEAK_WARMUP):
        torch.matmul(a, b)
    marks = []
    for _ in range(GEMM_PEAK_ITERS):
        m0 = clock.mark()
        torch.matmul(a, b)
        marks.append((m0, clock.mark()))
    clock.sync()
    times = _max_over_ranks([[clock.elapsed_ms(s, e)] for s, e in marks], env)
    return 2 * n**3 / (_median(times[:, 0]) * 1e-3) / 1e12


# ---------------------------------------------------------------------------------- the cases


def float64_result(case: Case, env: DistEnv) -> RunResult:
    """Output and every gradient of the float64 reference path (the accuracy oracle)."""
    fn = functools.partial(moe_reference, compute_dtype=torch.float64)
    return run_with_grads(fn, *case.inputs(), case.config, env.group, dtype=torch.float64)


def check_backend(fn: MoEFn, case: Case, expected: RunResult, env: DistEnv) -> dict[str, Any]:
    """check = max |y - y64| (worst rank); check_rel = worst relative error of y and all grads."""
    got = run_with_grads(fn, *case.inputs(), case.config, env.group)
    errs = compare_results(got, expected)
    max_abs = (got.y.double() - expected.y).abs().max().item() if got.y.numel() else 0.0
    worst = _max_over_ranks([[max_abs, max(errs.values())]], env)[0]
    worst_abs, worst_rel = float(worst[0]), float(worst[1])
    ok = worst_rel <= CHECK_RTOL[case.config.precision]  # NaN/inf fail
    return {"check": worst_abs, "check_rel": worst_rel, "check_ok": ok}


def forget_fp8_weights() -> None:
    """Empty the fp8 weight cache (megamoe.backends.fp8_weights), so that the next forward
    quantizes every weight, as the first forward after an optimizer step does: the timed
    iteration then holds the weight quantization of a training step of one micro-batch. (Graph
    replays quantize in the graph anyway.) Without Triton there is no cache to empty."""
    try:
        from ..backends import fp8_weights
    except ImportError:
        return
    fp8_weights.clear()


def _iteration(
    fn: MoEFn, case: Case, env: DistEnv, clock: _Clock, sync: bool, step_starts: bool = True
) -> tuple:
    """One training iteration (grads reset, forward, backward): device marks (forward start,
    forward end, step start, step end) and the host seconds of the forward and the backward
    call. ``sync``: wait for the device first (latency mode). ``step_starts``: the iteration
    is the first micro-batch of an optimizer step, so an fp8 run's forward quantizes its
    weights again (:func:`forget_fp8_weights`)."""
    for t in case.leaves():
        t.grad = None
    if case.config.precision == "fp8" and step_starts:
        forget_fp8_weights()
    if sync:
        clock.sync()
    m0 = clock.mark()
    h0 = time.perf_counter()
    y = fn(case.x, case.topk_ids, case.topk_weights, case.weights, case.config, env.group)
    h1 = time.perf_counter()
    m1 = clock.mark()
    y.backward(case.grad_y)
    h2 = time.perf_counter()
    m2 = clock.mark()
    return m0, m1, m0, m2, h1 - h0, h2 - h1


class _Graphs:
    """One run's forward and whole step (forward + backward), each captured in a CUDA graph
    after an eager step (which compiles and loads every kernel); grads are the graph's own."""

    def __init__(self, fn: MoEFn, case: Case, env: DistEnv) -> None:
        def step(backward: bool) -> None:
            for t in case.leaves():
                t.grad = None
            y = fn(case.x, case.topk_ids, case.topk_weights, case.weights, case.config, env.group)
            if backward:
                y.backward(case.grad_y)

        step(True)
        torch.cuda.synchronize(env.device)
        self.fwd, self.step = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        for graph, backward in ((self.fwd, False), (self.step, True)):
            with torch.cuda.graph(graph):
                step(backward)

    def iteration(self, clock: _Clock) -> tuple:
        """Replay both: the marks of :func:`_iteration` and the host seconds of the forward's
        replay call and of the step's less the forward's."""
        m0 = clock.mark()
        h0 = time.perf_counter()
        self.fwd.replay()
        h1 = time.perf_counter()
        m1 = clock.mark()
        self.step.replay()
        h2 = time.perf_counter()
        m2 = clock.mark()
        return m0, m1, m1, m2, h1 - h0, max(0.0, (h2 - h1) - (h1 - h0))


def iteration_order(iteration: int, num_runs: int) -> list[int]:
    """The order the runs take in one interleaved iteration: a shuffle seeded by the iteration
    alone, so every rank draws the same one (the runs are collective).

    A fixed round robin puts each run always after the same other one, and a run right after a
    heavy one starts at a lower clock: backend "fused", always after "triton", measured its
    backward (the same kernels as triton's) 0.7 ms above triton's on dsv3 and 0.3-0.4 ms on
    mok-v4; shuffled 0.5-0.6 ms and none (fresh H200 pair, BENCHMARKS.md). Shuffling gives every
    run every predecessor.
    """
    order = list(range(num_runs))
    random.Random(iteration).shuffle(order)
    return order


def time_interleaved(
    runs: list[tuple[MoEFn, Case]],
    opts: BenchOptions,
    env: DistEnv,
    tick: Callable[[int], None],
    mode: str = "throughput",
) -> list[dict[str, float] | BaseException]:
    """Median over iterations of the per-iteration max over ranks, fwd, bwd and fwd+bwd (ms)
    on the device and the forward's and backward's host time (ms), of every run, their
    iterations interleaved (each iteration in :func:`iteration_order`), in a ``TIMING_MODES``
    mode.

    Interleaving gives every run the same GPU clocks: sustained forward + backward heats an
    H200 and slows its kernels by up to ~20% within ~100 ms (BENCHMARKS.md), so runs timed one
    after another favoured the first. A run that raises is dropped from the rotation; its entry
    is the exception. ``tick(i)`` after each iteration of run i.
    """
    clock = _Clock(env.device)
    sync = TIMING_MODES[mode]
    marks: list[list[tuple]] = [[] for _ in runs]
    step_starts: list[list[bool]] = [[] for _ in runs]  # timed iterations that quantized
    results: list[dict[str, float] | BaseException | None] = [None] * len(runs)
    graphs: list[_Graphs | None] = [None] * len(runs)
    if mode == "graph":
        if env.device.type != "cuda":
            raise ValueError(f"mode 'graph' needs a CUDA device, got {env.device}")
        for i, (fn, case) in enumerate(runs):
            try:
                graphs[i] = _Graphs(fn, case, env)
            except Exception as exc:
                results[i] = exc
                _free_memory(env.device)
    for it in range(opts.warmup + opts.iters):
        for i in iteration_order(it, len(runs)):
            fn, case = runs[i]
            if results[i] is not None:
                continue
            try:
                if graphs[i] is not None:
                    m = graphs[i].iteration(clock)
                else:
                    m = _iteration(fn, case, env, clock, sync, it % opts.micro_batches == 0)
            except Exception as exc:  # the caller records it and goes on with the others
                results[i] = exc
                _free_memory(env.device)
                continue
            if it >= opts.warmup:
                marks[i].append(m)
                step_starts[i].append(
                    graphs[i] is None
                    and case.config.precision == "fp8"
                    and it % opts.micro_batches == 0
                )
            tick(i)
    clock.sync()
    for case in {id(c): c for _, c in runs}.values():
        for t in case.leaves():
            t.grad = None
    del graphs
    for i, run_marks in enumerate(marks):
        if results[i] is None:
            # marks: (forward start, forward end, step start, step end); the backward is the
            # step less the forward (an eager step starts with its forward, a graph's is a
            # replay of its own)
            per_iter = [
                [
                    clock.elapsed_ms(a, b),
                    clock.elapsed_ms(c, d) - clock.elapsed_ms(a, b),
                    clock.elapsed_ms(c, d),
                    host_fwd * 1e3,
                    host_bwd * 1e3,
                ]
                for a, b, c, d, host_fwd, host_bwd in run_marks
            ]
            worst = _max_over_ranks(per_iter, env)
            fields = ("fwd_ms", "bwd_ms", "fwdbwd_ms", "host_fwd_ms", "host_bwd_ms")
            results[i] = {
                name: per_micro_batch(worst[:, j], step_starts[i], opts.micro_batches)
                for j, name in enumerate(fields)
            }
    return results  # type: ignore[return-value]


# ------------------------------------------------------------------------------ communication


def reads_tunables(backend: str, world_size: int) -> tuple[str, ...]:
    """The config tunables ``backend`` reads at this world size ("triton" none at W = 1)."""
    if world_size == 1:
        return _TUNED_AT_W1.get(backend, ())
    return BACKEND_TUNABLES.get(backend, ())


def tunable_fields(
    backend: str, config: MoEConfig, world_size: int, device: torch.device | None = None
) -> dict[str, int]:
    """The record fields of the tunables ``backend`` reads at this world size; on a GPU, values
    the config leaves to the backend (None) are recorded as the backend resolves them, where it
    says (``resolved_tunables`` of the backend module)."""
    fields = {name: getattr(config, name) for name in reads_tunables(backend, world_size)}
    if fields and backend in BACKENDS and device is not None and device.type == "cuda":
        resolve = getattr(get_backend(backend), "resolved_tunables", None)
        if resolve is not None:
            resolved = resolve(config, device, world_size)
            fields.update({k: v for k, v in resolved.items() if k in fields})
    return fields


def parse_tune(specs: list[str] | None) -> dict[str, list[int]]:
    """``["comm_programs=8,16", "down_lag=auto,2"]`` -> {name: [values]} (``--tune``; "auto" is
    None: derived, for down_lag; 0 / 1 for overlap_shared and comm_kernel)."""
    tune: dict[str, list[int]] = {}
    for spec in specs or ():
        name, sep, values = spec.partition("=")
        if not sep or not values:
            raise ValueError(f"tune must look like NAME=V1,V2,..., got {spec!r}")
        try:
            tune[name.strip()] = [
                None if v.strip() == "auto" else int(v) for v in values.split(",")
            ]
        except ValueError:
            raise ValueError(f"tune: {name} values must be integers, got {values!r}") from None
    return tune


def _combinations(tune: dict[str, list[int]]) -> list[dict[str, int]]:
    names = list(tune)
    return [dict(zip(names, combo)) for combo in itertools.product(*(tune[n] for n in names))]


def tuning_variants(
    backend: str, world_size: int, tune: dict[str, list[int]]
) -> list[dict[str, int]]:
    """Config overrides to run ``backend`` with: every combination of the swept tunables it
    reads; one run with the defaults ([{}]) when it reads none of them."""
    read = reads_tunables(backend, world_size)
    return _combinations({n: v for n, v in tune.items() if n in read})


def measures_comm(backend: str, env: DistEnv) -> bool:
    """Copy bandwidth is timed for backend "triton" expert-parallel on GPUs only."""
    return backend == "triton" and env.world_size > 1 and env.device.type == "cuda"


def time_comm(case: Case, opts: BenchOptions, env: DistEnv) -> dict[str, float]:
    """GB/s of remote bytes of triton's dispatch/combine copies (forward and backward) on the
    case's routing: its schedule is built once, x and dy are published, each copy is timed alone.

    A collective (barriers, all-reduce): every rank calls it.
    """
    from ..ep.workspace import publish
    from .bench_comm import layer_comm_gbps

    schedule = functional.build_schedule(case.topk_ids, case.config, env.group, backend="triton")
    ws = schedule.inner.ep.workspace
    publish(ws, x=case.x.detach(), dy=case.grad_y)  # visible to peers after the next barrier
    return layer_comm_gbps(
        ws, schedule.inner.routed, case.config.copy_programs, opts.iters, opts.warmup, env.group
    )


# ------------------------------------------------------------------------------------ records


def base_record(
    case: Case, backend: str, opts: BenchOptions, env: DistEnv, peak: float, facts: dict[str, str]
) -> dict[str, Any]:
    c = case.config
    rec: dict[str, Any] = dict.fromkeys(RECORD_FIELDS)
    rec.update(
        **case.shape.record_fields(),
        world_size=env.world_size,
        backend=backend,
        tokens_per_rank=case.tokens,
        hidden=c.hidden_size,
        intermediate=c.intermediate_size,
        experts=c.num_experts,
        local_experts=c.local_experts(env.world_size),
        top_k=c.top_k,
        shared_intermediate=c.shared_intermediate_size,
        gemm_peak_tflops=peak,
        precision=c.precision,
        routing=opts.routing,
        iters=opts.iters,
        micro_batches=opts.micro_batches,
        warmup=opts.warmup,
        status="ok",
        note="",
        torch=torch.__version__,
        **facts,
    )
    return rec


def add_rates(rec: dict[str, Any], config: MoEConfig, tokens: int) -> None:
    flops = config.flops_per_token() * tokens
    rec["fwd_tflops"] = flops / (rec["fwd_ms"] * 1e-3) / 1e12
    rec["fwdbwd_tflops"] = FWDBWD_FLOP_FACTOR * flops / (rec["fwdbwd_ms"] * 1e-3) / 1e12


def _case_key(rec: dict[str, Any]) -> tuple:
    return (
        rec.get("mode"),
        rec["preset"],
        rec.get("model"),
        rec["hidden"],
        rec["intermediate"],
        rec["experts"],
        rec["top_k"],
        rec["shared_intermediate"],
        rec["world_size"],
        rec["tokens_per_rank"],
    )


def add_speedups(records: list[dict[str, Any]]) -> None:
    """speedup_vs_torch_a2a = baseline (bf16) fwd+bwd time / this fwd+bwd time (same shape, W,
    tokens, mode); an fp8 record's speedup_vs_bf16 = the same backend's and tunables' bf16
    time / its own."""
    ok = [r for r in records if r["status"] == "ok"]
    base = {_case_key(r): r for r in ok if r["backend"] == BASELINE and r["precision"] == "bf16"}

    def same_run(r):
        return (_case_key(r), r["backend"], *(r.get(t) for t in TUNABLES))

    bf16 = {same_run(r): r for r in ok if r["precision"] == "bf16"}
    for r in ok:
        b = base.get(_case_key(r))
        if b is not None:
            r["speedup_vs_torch_a2a"] = b["fwdbwd_ms"] / r["fwdbwd_ms"]
            r["fwd_speedup_vs_torch_a2a"] = b["fwd_ms"] / r["fwd_ms"]
        b = bf16.get(same_run(r)) if r["precision"] != "bf16" else None
        if b is not None:
            r["speedup_vs_bf16"] = b["fwdbwd_ms"] / r["fwdbwd_ms"]
            r["fwd_speedup_vs_bf16"] = b["fwd_ms"] / r["fwd_ms"]


# ---------------------------------------------------------------------------------------- run


def total_steps(opts: BenchOptions, world_size: int = 1) -> int:
    """Progress steps of :func:`run_bench`: GEMM peak, float64 references, checks, iterations."""
    per_run = (1 if opts.check else 0) + (opts.warmup + opts.iters) * len(opts.modes)
    runs = sum(
        len(run_precisions(b, opts)) * len(tuning_variants(b, world_size, opts.tune))
        for b in opts.backends
    )
    per_case = (1 if opts.check else 0) + per_run * runs
    return 1 + per_case * len(opts.shapes) * len(opts.tokens or [None])


def _free_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_bench(
    opts: BenchOptions, env: DistEnv, *, progress: ProgressBar | None = None
) -> list[dict]:
    """Benchmark every (shape, tokens, backend); returns the records (the same on every
    rank)."""
    bar = progress or ProgressBar(total_steps(opts), enabled=False)
    bar.update("dense GEMM peak")
    peak = measure_gemm_peak(env)
    bar.step()
    facts = {"gpu": device_name(env.device), "commit": git_commit(), "date": _utc_now()}
    records: list[dict] = []
    for shape, tokens in itertools.product(opts.shapes, opts.tokens or [None]):
        bar.update(f"{shape.name}: inputs")
        case = make_case(shape, env, tokens=tokens, routing=opts.routing, seed=opts.seed)
        expected = None
        if opts.check:
            bar.update(f"{shape.name}: float64 reference")
            expected = float64_result(case, env)
            bar.step()
        runs = [
            _Run(
                backend,
                dataclasses.replace(
                    case, config=case.config.replace(precision=precision, **variant)
                ),
            )
            for precision in opts.precisions
            for backend in opts.backends
            if precision in run_precisions(backend, opts)
            for variant in tuning_variants(backend, env.world_size, opts.tune)
        ]
        records.extend(_run_case(runs, expected, opts, env, peak, facts, bar))
        del case, expected, runs
        _free_memory(env.device)
    add_speedups(records)
    return records


@dataclass
class _Run:
    """One (backend, tunables) of a case: what it runs on and its record."""

    backend: str
    case: Case
    rec: dict[str, Any] = field(default_factory=dict)
    fn: MoEFn | None = None  # None once skipped or failed
    resolved: str = ""  # the backend that runs (auto's choice)

    @property
    def label(self) -> str:
        precision = self.case.config.precision
        tail = "" if precision == "bf16" else f" {precision}"
        return f"{self.case.shape.name} {self.backend}{tail}"

    def stop(self, exc: BaseException, bar: ProgressBar, steps_left: int) -> None:
        """Record why this run ends early (skipped: a backend that cannot run this case)."""
        skipped = isinstance(exc, NotImplementedError)  # e.g. a one-GPU backend under EP
        note = str(exc) if skipped else f"{type(exc).__name__}: {exc}"
        self.rec.update(
            status="skipped" if skipped else "error", note=(note.splitlines() or [""])[0][:300]
        )
        self.fn = None
        bar.step(steps_left, f"{self.label}: {self.rec['status']}")


def backward_of(backend: str, world_size: int) -> str:
    """Which backward a run of ``backend`` takes (backend "fused": its own or "triton"'s)."""
    if backend != "fused":
        return backend
    from ..backends import fused

    return fused.backward_kind(world_size)


def _run_case(
    runs: list[_Run],
    expected: RunResult | None,
    opts: BenchOptions,
    env: DistEnv,
    peak: float,
    facts: dict[str, str],
    bar: ProgressBar,
) -> list[dict[str, Any]]:
    """Check every run, time them interleaved in each mode, then add rates, tunables and copy
    bandwidth: one record per (run, mode)."""
    per_mode = opts.warmup + opts.iters
    per_run = (1 if expected is not None else 0) + per_mode * len(opts.modes)
    for run in runs:
        run.rec = base_record(run.case, run.backend, opts, env, peak, facts)
        ok, reason = backend_status(run.backend, env.device)
        if ok:
            ok, reason = precision_status(run.backend, run.case.config)
        if not ok:
            run.rec.update(status="skipped", note=reason)
            bar.step(per_run, f"{run.label}: skipped")
            continue
        run.resolved = run.backend
        if run.backend == "auto":
            x = run.case.x
            run.resolved = resolve_backend(
                "auto", env.device, env.world_size, run.case.config, x.dtype, x.shape[0]
            )
            run.rec["resolved_backend"] = run.resolved
        run.rec["backward"] = backward_of(run.resolved, env.world_size)
        run.fn = layer_fn(run.backend)
        if expected is not None:
            bar.update(f"{run.label}: check")
            try:
                run.rec.update(check_backend(run.fn, run.case, expected, env))
            except Exception as exc:  # report and go on with the next backend
                run.stop(exc, bar, per_run)
                _free_memory(env.device)
                continue
            bar.step()
    records: dict[int, list[dict[str, Any]]] = {id(run): [] for run in runs}
    for mode in opts.modes:
        timed = [run for run in runs if run.fn is not None]
        done = [0] * len(timed)

        def tick(i: int) -> None:
            done[i] += 1
            bar.step(1, f"{timed[i].label}: timing ({mode})")

        results = time_interleaved([(r.fn, r.case) for r in timed], opts, env, tick, mode)
        for i, (run, result) in enumerate(zip(timed, results)):
            if isinstance(result, BaseException):  # the run's records so far stay
                left = opts.modes[opts.modes.index(mode) + 1 :]
                run.stop(result, bar, per_mode * (1 + len(left)) - done[i])
                records[id(run)].append(dict(run.rec, mode=mode))
                continue
            rec = dict(run.rec, mode=mode, **result)
            add_rates(rec, run.case.config, run.case.tokens)
            rec.update(tunable_fields(run.resolved, run.case.config, env.world_size, env.device))
            records[id(run)].append(rec)
    for run in runs:
        if run.fn is not None and measures_comm(run.backend, env):
            bar.update(f"{run.label}: dispatch/combine GB/s")
            try:
                gbps = time_comm(run.case, opts, env)
            except Exception as exc:
                run.stop(exc, bar, 0)
            else:
                for rec in records[id(run)]:
                    rec.update(gbps)
        if run.fn is None and not records[id(run)]:  # skipped or failed before any timing
            records[id(run)] = [dict(run.rec, mode=None)]
    return [rec for run in runs for rec in records[id(run)]]


def run_failed(records: list[dict]) -> bool:
    """True when a backend errored or failed its accuracy check (skips are fine)."""
    return any(r.get("status") == "error" or r.get("check_ok") is False for r in records)
