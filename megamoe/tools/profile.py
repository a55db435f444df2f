"""Where a layer call's GPU time goes between launches: GPU time per kernel and the idle gaps.

    python -m megamoe.tools.profile --preset dsv3 --backend fused --out prof/              # forward
    torchrun --nproc-per-node=2 -m megamoe.tools.profile --preset dsv3 --backend triton --backward

Runs ``--warmup`` calls, then profiles ``--iters`` back-to-back calls (``torch.profiler``, CPU and
CUDA activity) of one backend's forward (no grad) or training step (``--backward``: forward with
grad, then backward). Rank 0 prints, for every rank, the GPU time per call of every kernel, the
wall time per call on the stream, and the largest idle gaps of the GPU: for each, the launches
around it and whether the host issued the launch after the GPU had run dry (host-bound) or
before (something on the device side held the launch back). ``--out`` gets every rank's chrome trace
(``trace_rank{r}.json``, open in https://ui.perfetto.dev) and ``profile_rank{r}.json``.

``--host``: where the host time of a call goes instead, each call after a device sync (so no
launch waits for a full queue): the host time per call inside the layer's functions, inside each
Triton kernel's launch and inside TMA descriptor construction (timers around them,
:func:`host_breakdown`), the host-device synchronizations the call makes (torch's sync debug
mode), the ATen ops' host time (``torch.profiler``, CPU only), then ``cProfile``'s tables.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

__all__ = [
    "Gap",
    "device_events",
    "kernel_ms",
    "busy_ms",
    "idle_gaps",
    "profile_calls",
    "profile_host",
    "host_breakdown",
    "format_breakdown",
    "main",
]

# Chrome-trace categories of work on the GPU, and of the host calls that launch it.
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
DEFAULT_MIN_GAP_US = 5.0
# Calls run under the profiler before it records (see profile_calls).
PROFILER_SKIP = 2


@dataclass(frozen=True)
class Gap:
    """An interval with nothing running on the GPU between two launches of the profiled calls."""

    start_us: float  # trace clock
    idle_us: float
    before: str  # the work that ended last before the gap
    after: str  # the work that started it again
    # When the host call that launched ``after`` returned, relative to the gap's start: > 0 means
    # the host issued it only after the GPU ran dry (host-bound); None when it is not in the trace.
    launch_after_idle_us: float | None
    host_op: str | None  # the innermost CPU op around that host call


def device_events(trace: dict[str, Any]) -> list[dict[str, Any]]:
    """The GPU events (kernels, copies, fills) of a chrome trace, by start time, without those
    launched before the recorded calls (the GPU runs behind the host, so the trace also holds
    the tail of the call before: its launches are missing from the trace)."""
    events = trace.get("traceEvents", [])
    launched = {
        e["args"]["correlation"]
        for e in events
        if e.get("ph") == "X"
        and e.get("cat") in LAUNCH_CATEGORIES
        and "correlation" in e.get("args", {})
    }
    gpu = [
        e
        for e in events
        if e.get("ph") == "X"
        and e.get("cat") in GPU_CATEGORIES
        and (not launched or e.get("args", {}).get("correlation", -1) in launched)
    ]
    return sorted(gpu, key=lambda e: e["ts"])


def kernel_ms(trace: dict[str, Any], calls: int) -> dict[str, float]:
    """GPU milliseconds per call of each kernel / copy name, largest first."""
    out: dict[str, float] = {}
    for e in device_events(trace):
        out[e["name"]] = out.get(e["name"], 0.0) + e["dur"] / 1e3 / calls
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def busy_ms(trace: dict[str, Any], calls: int) -> float:
    """Milliseconds per call in which some GPU event ran (overlapping events, e.g. the shared
    expert beside the copies, count once)."""
    total, busy_until = 0.0, None
    for e in device_events(trace):
        start, end = e["ts"], e["ts"] + e["dur"]
        if busy_until is not None and start < busy_until:
            start = busy_until
        if end > start:
            total += end - start
        busy_until = end if busy_until is None else max(busy_until, end)
    return total / 1e3 / calls


def idle_gaps(trace: dict[str, Any], min_gap_us: float = DEFAULT_MIN_GAP_US) -> list[Gap]:
    """Every interval of at least ``min_gap_us`` in which no GPU event of the trace ran, between
    its first and last event, largest first."""
    events = device_events(trace)
    all_events = trace.get("traceEvents", [])
    launches = {
        e["args"]["correlation"]: e
        for e in all_events
        if e.get("ph") == "X"
        and e.get("cat") in LAUNCH_CATEGORIES
        and "correlation" in e.get("args", {})
    }
    host_ops = [e for e in all_events if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    gaps = []
    busy_until, last = None, None
    for e in events:
        if busy_until is not None and e["ts"] - busy_until >= min_gap_us:
            launch = launches.get(e.get("args", {}).get("correlation"))
            after_idle = op = None
            if launch is not None:
                after_idle = launch["ts"] + launch["dur"] - busy_until
                op = _innermost(host_ops, launch["ts"])
            gaps.append(
                Gap(busy_until, e["ts"] - busy_until, last["name"], e["name"], after_idle, op)
            )
        end = e["ts"] + e["dur"]
        if busy_until is None or end >= busy_until:
            busy_until, last = end, e
    return sorted(gaps, key=lambda g: -g.idle_us)


def _innermost(ops: list[dict[str, Any]], ts: float) -> str | None:
    """Name of the latest-starting op whose interval contains ``ts``."""
    best = None
    for op in ops:
        if op["ts"] <= ts <= op["ts"] + op["dur"] and (best is None or op["ts"] >= best["ts"]):
            best = op
    return None if best is None else best["name"]


def profile_calls(
    run: Callable[[], None],
    calls: int,
    device: torch.device,
    trace_path: str | None = None,
    skip: int = PROFILER_SKIP,
) -> dict[str, Any]:
    """Profile ``calls`` back-to-back ``run()``: kernel GPU ms per call, the wall ms per call on
    the stream (``wall_ms``), the idle ms per call and the gaps (:func:`idle_gaps`).

    The first ``skip`` calls run under the profiler unrecorded: its start-up costs the host
    milliseconds, which would show as idle GPU (and, with several ranks, as barrier time of the
    ranks that started first)."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile, schedule

    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(
        activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
        schedule=schedule(wait=0, warmup=skip, active=calls, repeat=1),
    ) as prof:
        for i in range(skip + calls):
            if i == skip:
                start.record()
            run()
            if i == skip + calls - 1:
                end.record()  # before the step that stops the profiler (it syncs and collects)
            prof.step()
        torch.cuda.synchronize(device)
    with tempfile.TemporaryDirectory() as tmp:
        path = trace_path or os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        trace = json.loads(Path(path).read_text())
    kernels = kernel_ms(trace, calls)
    gaps = idle_gaps(trace)
    return {
        "calls": calls,
        "wall_ms": start.elapsed_time(end) / calls,
        "kernels_ms": kernels,
        "busy_ms": busy_ms(trace, calls),
        "idle_ms": sum(g.idle_us for g in gaps) / 1e3 / calls,
        "gaps": [asdict(g) for g in gaps],
    }


def profile_host(run: Callable[[], None], calls: int, top: int = 25) -> tuple[float, str]:
    """Host ms per call of ``run()`` (each after a device sync) and the ``cProfile`` tables of
    those calls: the ``top`` functions by own time and by time inside them."""
    import cProfile
    import io
    import pstats
    import time

    prof = cProfile.Profile()
    total = 0.0
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        prof.enable()
        run()
        prof.disable()
        total += time.perf_counter() - t0
    torch.cuda.synchronize()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    for key in ("tottime", "cumulative"):
        stats.sort_stats(key).print_stats(top)
    return total / calls * 1e3, text.getvalue()


# What host_breakdown times, by label: (module path, attribute). A Triton kernel's launch is timed
# per kernel (JITFunction.run, which every ``kernel[grid](...)`` calls).
HOST_TIMERS = {
    "functional.forward": ("megamoe.functional", "forward"),
    "functional.backward": ("megamoe.functional", "backward"),
    "build_schedule": ("megamoe.functional", "build_schedule"),
    "descriptors": ("triton.tools.tensor_descriptor", "TensorDescriptor.from_tensor"),
}


def host_breakdown(run: Callable[[], None], calls: int) -> dict[str, Any]:
    """Host microseconds per call of ``run()`` (each after a device sync): in all, inside the
    :data:`HOST_TIMERS`, inside each Triton kernel's launch (``launch:<kernel>``, with launches
    per call), the synchronizations per call (``syncs``: torch's sync debug mode counts every
    host wait on the device that torch makes) and the ATen ops' own host time (``aten``)."""
    import importlib
    import time
    import warnings
    from collections import defaultdict

    from torch.profiler import ProfilerActivity, profile
    from triton.runtime.jit import JITFunction

    spent: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)

    def timed(label_of: Callable[..., str], fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            label = label_of(*args)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[label] += time.perf_counter() - t0
                count[label] += 1

        return wrapper

    patches: list[tuple[Any, str, Any]] = []
    for label, (module, attr) in HOST_TIMERS.items():
        owner: Any = importlib.import_module(module)
        *path, name = attr.split(".")
        for part in path:
            owner = getattr(owner, part)
        original = owner.__dict__[name]
        fn = original.__func__ if isinstance(original, (classmethod, staticmethod)) else original
        wrapped = timed(lambda *a, _label=label: _label, fn)
        if isinstance(original, (classmethod, staticmethod)):
            wrapped = type(original)(wrapped)
        patches.append((owner, name, original))
        setattr(owner, name, wrapped)
    patches.append((JITFunction, "run", JITFunction.run))
    JITFunction.run = timed(lambda self, *a: f"launch:{self.__name__}", JITFunction.run)
    cuda = torch.cuda.is_available()  # (without CUDA: the timers only, for the tests)

    def sync_debug(mode: str) -> None:
        if cuda:
            torch.cuda.set_sync_debug_mode(mode)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    total = 0.0
    syncs = 0
    try:
        for _ in range(calls):
            sync()
            sync_debug("warn")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                t0 = time.perf_counter()
                run()
                total += time.perf_counter() - t0
            sync_debug("default")
            syncs += sum("synchroniz" in str(w.message) for w in caught)
    finally:
        sync_debug("default")
        for owner, name, original in reversed(patches):
            setattr(owner, name, original)
    sync()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            run()
        sync()
    aten = sorted(
        ((e.key, e.self_cpu_time_total / calls, e.count / calls) for e in prof.key_averages()),
        key=lambda r: -r[1],
    )
    return {
        "calls": calls,
        "host_us": total / calls * 1e6,
        "syncs_per_call": syncs / calls,
        "timers_us": {k: spent[k] / calls * 1e6 for k in sorted(spent, key=lambda k: -spent[k])},
        "timers_per_call": {k: count[k] / calls for k in count},
        "aten_self_us": [(k, us, n) for k, us, n in aten[:25]],
    }


def format_breakdown(result: dict[str, Any]) -> str:
    launches = {k: v for k, v in result["timers_us"].items() if k.startswith("launch:")}
    lines = [
        f"host {result['host_us']:.1f} us per call, {result['syncs_per_call']:g} syncs per call;"
        f" Triton launches {sum(launches.values()):.1f} us in "
        f"{sum(result['timers_per_call'][k] for k in launches):g} launches"
    ]
    for k, us in result["timers_us"].items():
        lines.append(f"  {us:9.1f} us  x{result['timers_per_call'][k]:g}  {k}")
    lines.append("ATen ops, own host time per call (torch.profiler, CPU only):")
    for k, us, n in result["aten_self_us"]:
        lines.append(f"  {us:9.1f} us  x{n:g}  {k}")
    return "\n".join(lines)


def format_profile(result: dict[str, Any], top_gaps: int = 12) -> str:
    calls = result["calls"]
    lines = [
        f"per call ({calls} back-to-back): wall {result['wall_ms']:.3f} ms, GPU busy "
        f"{result['busy_ms']:.3f} ms, idle in gaps >= {DEFAULT_MIN_GAP_US:g} us "
        f"{result['idle_ms']:.3f} ms"
    ]
    for name, ms in result["kernels_ms"].items():
        lines.append(f"  {ms:8.3f} ms  {name[:90]}")
    gaps = result["gaps"]
    if gaps:
        lines.append(
            f"largest idle gaps ({len(gaps)} in all; 'host late' = the launch returned "
            f"that long after the GPU ran dry):"
        )
    for g in gaps[:top_gaps]:
        late = g["launch_after_idle_us"]
        host = (
            "launch not traced"
            if late is None
            else (f"host late {late:7.1f} us" if late > 0 else f"launched {-late:7.1f} us early")
        )
        lines.append(
            f"  {g['idle_us']:8.1f} us  {host}  {g['before'][:32]} -> "
            f"{g['after'][:32]}  (host: {str(g['host_op'])[:40]})"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    from . import harness

    parser = argparse.ArgumentParser(
        prog="python -m megamoe.tools.profile", description=__doc__.splitlines()[0]
    )
    harness.add_case_arguments(parser)
    parser.add_argument("--backend", default="fused")
    parser.add_argument("--backward", action="store_true", help="profile forward + backward")
    parser.add_argument("--iters", type=int, default=5, help="profiled calls")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", help="directory for trace_rank*.json and profile_rank*.json")
    parser.add_argument(
        "--host", action="store_true", help="profile the host time of the calls (cProfile)"
    )
    parser.add_argument(
        "--precision",
        choices=["bf16", "fp8"],
        default="bf16",
        help="the expert GEMMs' precision (fp8: the weights' fp8 copies stay cached across "
        "the calls, so their quantization is not in the profile, unless --quantize-weights)",
    )
    parser.add_argument(
        "--quantize-weights",
        action="store_true",
        help="fp8: quantize the weights again in every call, as the first micro-batch of an "
        "optimizer step does (the bench's default)",
    )
    args = parser.parse_args(argv)
    env = harness.init_distributed()
    if env.device.type != "cuda":
        print("profile: needs a CUDA GPU", file=sys.stderr)
        return 2
    shape, case, config = harness.case_of_args(args, parser, env)
    config = config.replace(precision=args.precision)
    call = harness.layer_call(args.backend, case, config, env.group, args.backward)
    if args.quantize_weights:
        from .bench import forget_fp8_weights

        layer_step = call

        def call() -> None:
            forget_fp8_weights()
            layer_step()

    for _ in range(args.warmup):
        call()
    what = "forward + backward" if args.backward else "forward"
    out = Path(args.out) if args.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    if args.host:
        breakdown = host_breakdown(call, args.iters)
        ms, text = profile_host(call, args.iters)
        if env.is_main:  # (rank 0's host; cProfile's tables are slower than unprofiled)
            print(f"{shape.name}, backend {args.backend}, {what}: {format_breakdown(breakdown)}")
            print(f"under cProfile: host {ms:.3f} ms per call")
            print(text)
        if out is not None:
            (out / f"host_rank{env.rank}.json").write_text(json.dumps(breakdown) + "\n")
        harness.finish_distributed(env)
        return 0
    result = profile_calls(
        call, args.iters, env.device, str(out / f"trace_rank{env.rank}.json") if out else None
    )
    result.update(
        **shape.record_fields(),
        backend=args.backend,
        backward=args.backward,
        precision=args.precision,
        quantize_weights=args.quantize_weights,
        world_size=env.world_size,
        rank=env.rank,
        tokens_per_rank=case.tokens,
    )
    texts = [f"rank {env.rank}: {format_profile(result)}"]
    if env.group is not None:  # every rank's view: a rank whose host is late stalls the others
        import torch.distributed as dist

        gathered: list = [None] * env.world_size
        dist.all_gather_object(gathered, texts[0], group=env.group)
        texts = gathered
    if env.is_main:
        print(
            f"{shape.name}, backend {args.backend}, {what}, {args.precision}, "
            f"W = {env.world_size}, {case.tokens} tokens/rank"
        )
        print("\n".join(texts))
    if out is not None:
        (out / f"profile_rank{env.rank}.json").write_text(json.dumps(result) + "\n")
    harness.finish_distributed(env)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
