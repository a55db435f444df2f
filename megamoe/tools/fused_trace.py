"""Where the fused forward kernel's time goes: a per-program timeline of one launch.

    python -m megamoe.tools.fused_trace --preset dsv3 --out trace/                       # one GPU
    torchrun --nproc-per-node=2 -m megamoe.tools.fused_trace --preset dsv3 --out trace/  # W = 2

Runs backend "fused"'s forward (no grad) ``--warmup`` times, times ``--iters`` plain forwards,
then runs one forward with a trace buffer (``fused_forward(trace=...)``: every program writes one
event per pulled minibatch or task: kind, index, start and end in GPU nanoseconds; with the comm
kernel, the default with a ring of every row, the compute kernel's tasks only) and one more
timed plain forward. Rank 0 prints, per event kind, the count, the summed time, the median and
10th-percentile duration and the *excess* (time beyond the 10th percentile, summed: mostly
waiting on flags, since tiles of one kind do the same work); then the fraction of the
programs' time over the kernel span spent in pulls or tasks (busy), when the last pull ended,
the launch skew and the traced forward's time outside the kernel's span (the other launches and
the gaps between them; the plain forwards, each timed alone, also wait for the other ranks'
hosts); ``--profile`` lists each launch's GPU time per forward and the idle gaps between
launches (``megamoe.tools.profile``). ``--out`` gets ``trace_rank{r}.json`` (the summary and the
events) and ``timeline_rank0.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any, Sequence

import torch

__all__ = ["summarize", "format_summary", "plot_timeline", "main"]

# Kinds of trace events (kernels.fused_forward.TRACE_KINDS, repeated here so that summaries of
# saved traces need no GPU stack); a CPU test checks that the two agree.
KINDS = {0: "pull", 1: "shared gate/up", 2: "shared down", 3: "gate/up", 4: "down"}
PULL = 0
_NS_PER_US = 1e3
_NS_PER_MS = 1e6
# Percentile of a kind's durations taken as its work without waiting.
FAST_PERCENTILE = 0.10


def _events(trace: torch.Tensor) -> list[tuple[int, int, int, int, int]]:
    """(program, kind, index, start ns, end ns) of every written event."""
    out = []
    for program, rows in enumerate(trace.tolist()):
        for code, start, end in rows:
            if code < 0 or start < 0 or end < start:
                continue
            out.append((program, code >> 32, code & 0xFFFFFFFF, start, end))
    return out


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(trace: torch.Tensor, num_comm: int, comm_kernel: bool = False) -> dict[str, Any]:
    """Per-kind and per-role totals of one traced launch (``trace [programs, events, 3]``).
    ``num_comm``: the kernel's programs that pull first, or with ``comm_kernel`` the programs of
    the comm kernel beside it (its pulls are not in the trace).

    Times are relative to the earliest event start; ``excess_ms`` of a kind sums each event's
    duration beyond the kind's 10th-percentile duration (an estimate of its waiting).
    """
    events = _events(trace)
    if not events:
        raise ValueError("trace holds no events: was it passed to a fused forward on a GPU?")
    t0 = min(e[3] for e in events)
    span = max(e[4] for e in events) - t0
    kinds: dict[str, Any] = {}
    for kind, name in KINDS.items():
        durations = [e[4] - e[3] for e in events if e[1] == kind]
        if not durations:
            continue
        fast = _percentile(durations, FAST_PERCENTILE)
        kinds[name] = {
            "count": len(durations),
            "total_ms": sum(durations) / _NS_PER_MS,
            "median_us": statistics.median(durations) / _NS_PER_US,
            "p10_us": fast / _NS_PER_US,
            "max_us": max(durations) / _NS_PER_US,
            "excess_ms": sum(d - fast for d in durations) / _NS_PER_MS,
        }
    programs = trace.shape[0]
    compute = [e for e in events if e[1] != PULL]  # the comm programs compute after pulling
    pulls = [e for e in events if e[1] == PULL]
    first_start = {}
    for e in events:
        first_start[e[0]] = min(first_start.get(e[0], e[3]), e[3])
    busy = sum(e[4] - e[3] for e in events)
    return {
        "programs": programs,
        "comm_programs": num_comm,
        "comm_kernel": comm_kernel,
        "span_ms": span / _NS_PER_MS,
        "kinds": kinds,
        "busy": busy / (span * programs) if span else 0.0,
        "last_pull_end_ms": (max(e[4] for e in pulls) - t0) / _NS_PER_MS if pulls else None,
        "last_task_end_ms": (max(e[4] for e in compute) - t0) / _NS_PER_MS if compute else None,
        "launch_skew_us": (max(first_start.values()) - t0) / _NS_PER_US,
    }


def format_summary(summary: dict[str, Any]) -> str:
    comm = (
        f"the comm kernel's {summary['comm_programs']} programs beside them"
        if summary.get("comm_kernel")
        else f"{summary['comm_programs']} pull first"
    )
    lines = [
        f"kernel span {summary['span_ms']:.3f} ms, {summary['programs']} programs "
        f"({comm}), busy {100 * summary['busy']:.1f}%"
    ]
    if summary["last_pull_end_ms"] is not None:
        lines.append(f"last pull ended at {summary['last_pull_end_ms']:.3f} ms")
    lines.append(f"launch skew (latest first event) {summary['launch_skew_us']:.1f} us")
    lines.append(
        f"{'kind':<16}{'count':>7}{'total ms':>11}{'median us':>11}{'p10 us':>9}"
        f"{'max us':>9}{'excess ms':>11}"
    )
    for name, k in summary["kinds"].items():
        lines.append(
            f"{name:<16}{k['count']:>7}{k['total_ms']:>11.3f}{k['median_us']:>11.1f}"
            f"{k['p10_us']:>9.1f}{k['max_us']:>9.1f}{k['excess_ms']:>11.3f}"
        )
    return "\n".join(lines)


def plot_timeline(trace: torch.Tensor, path: str, title: str = "") -> None:
    """PNG: one row per program, one bar per event, coloured by kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    events = _events(trace)
    if not events:
        raise ValueError("trace holds no events")
    t0 = min(e[3] for e in events)
    colors = {0: "#7f7f7f", 1: "#9467bd", 2: "#c5b0d5", 3: "#1f77b4", 4: "#d62728"}
    fig, ax = plt.subplots(figsize=(12, 6))
    for kind, name in KINDS.items():
        bars: dict[int, list[tuple[float, float]]] = {}
        for p, k, _, start, end in events:
            if k == kind:
                bars.setdefault(p, []).append(
                    ((start - t0) / _NS_PER_US, (end - start) / _NS_PER_US)
                )
        for i, (p, spans) in enumerate(bars.items()):
            ax.broken_barh(
                spans, (p - 0.4, 0.8), color=colors[kind], label=name if i == 0 else None
            )
    ax.set_xlabel("us since the first event")
    ax.set_ylabel("program")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _timed_forward(run, device: torch.device) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end)


def main(argv: Sequence[str] | None = None) -> int:
    from ..backends import fused
    from ..config import PRECISIONS, TUNABLES
    from ..kernels.fused import new_trace
    from .harness import add_case_arguments, case_of_args, finish_distributed, init_distributed
    from .profile import format_profile, profile_calls

    parser = argparse.ArgumentParser(
        prog="python -m megamoe.tools.fused_trace", description=__doc__.splitlines()[0]
    )
    add_case_arguments(parser)
    parser.add_argument("--iters", type=int, default=10, help="timed plain forwards")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--events", type=int, default=4096, help="trace slots per program")
    parser.add_argument("--out", help="directory for trace_rank*.json and timeline_rank0.png")
    parser.add_argument("--precision", choices=PRECISIONS, default="bf16", help="MoEConfig's")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also list the GPU time per forward of every launch (torch.profiler) "
        "and the idle time between them",
    )
    args = parser.parse_args(argv)
    env = init_distributed()
    if env.device.type != "cuda":
        print("fused_trace: needs a CUDA GPU", file=sys.stderr)
        return 2
    shape, case, config = case_of_args(args, parser, env)
    config = config.replace(precision=args.precision)
    tunables = fused.resolved_tunables(config, env.device, env.world_size)
    if tunables["forward"] in ("pipelined", "unfused"):
        print(
            f"fused_trace: the {tunables['forward']} fp8 forward runs no fused kernel to trace; "
            "--set comm_kernel=0 traces the fused kernel's fp8 tiles, and "
            "megamoe.tools.profile shows the forward's kernels",
            file=sys.stderr,
        )
        return 2
    x, ids, w = case.x.detach(), case.topk_ids, case.topk_weights.detach()
    weights = type(case.weights)(*(None if t is None else t.detach() for t in case.weights))
    schedule = fused.build_schedule(ids, config, env.group)

    def forward(trace: torch.Tensor | None = None) -> None:
        fused.forward(x, ids, w, weights, config, env.group, schedule, trace=trace)

    with torch.no_grad():
        for _ in range(args.warmup):
            forward()
        plain = [_timed_forward(forward, env.device) for _ in range(args.iters)]
        forward(new_trace(env.device, args.events))  # compiles the traced variant
        trace = new_trace(env.device, args.events)
        traced_ms = _timed_forward(lambda: forward(trace), env.device)
        profile = profile_calls(forward, args.iters, env.device) if args.profile else None
    summary = summarize(trace.cpu(), tunables["comm_programs"], tunables["comm_kernel"])
    plain_ms = statistics.median(plain)
    summary.update(
        **shape.record_fields(),
        tokens_per_rank=case.tokens,
        world_size=env.world_size,
        rank=env.rank,
        plain_fwd_ms=plain_ms,
        traced_fwd_ms=traced_ms,
        outside_kernel_ms=traced_ms - summary["span_ms"],
        profile=profile,
        config={name: getattr(config, name) for name in TUNABLES},
    )
    if env.is_main:
        print(
            f"{shape.name}, W = {env.world_size}, {case.tokens} tokens/rank: forward "
            f"{plain_ms:.3f} ms (median of {args.iters}), traced {traced_ms:.3f} ms; "
            f"outside the kernel span {summary['outside_kernel_ms']:.3f} ms"
        )
        print(format_summary(summary))
        if profile:
            print(format_profile(profile))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        record = dict(summary, events=_events(trace.cpu()))  # (program, kind, index, start, end)
        (out / f"trace_rank{env.rank}.json").write_text(json.dumps(record) + "\n")
        if env.is_main:
            plot_timeline(
                trace.cpu(),
                str(out / "timeline_rank0.png"),
                f"fused forward, {shape.name}, W = {env.world_size}, rank 0",
            )
    finish_distributed(env)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
