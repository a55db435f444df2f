"""Sustained speed: each backend's layer call back to back for seconds at a time, with the GPU's
power draw and SM clock sampled, i.e. what a training run sees once the GPUs sit at their power cap.

    torchrun --nproc-per-node=2 -m megamoe.tools.sustained --preset dsv3 --backend triton fused
    python -m megamoe.tools.sustained --preset tiny --seconds 0.5        (CPU: no telemetry)

``megamoe bench`` interleaves the backends call by call and synchronizes after each call, so the
GPUs idle a little between calls and run cooler than in training. Here each backend runs alone
for ``--seconds`` (a phase), the backends take turns for ``--rounds`` rounds, and per phase this
reports the time per call (wall time of the phase over its calls, max over ranks) and, per GPU,
the median power (W) and SM clock (MHz) sampled by ``nvidia-smi`` (the phase's first
``SETTLE_FRACTION`` left out: the clock follows the load with a lag). Per backend: the median over
rounds, and the speedup of every backend over the first. At the 700 W cap of an H200 the clock
drops as the draw rises; a backend that overlaps more work per second can lose clock for it.
``--precision bf16 fp8`` runs each backend in both; fp8 runs quantize their weights every
``--micro-batches`` calls (0: once).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

__all__ = [
    "Sample",
    "GpuTelemetry",
    "parse_samples",
    "phase_stats",
    "run_phase",
    "summarize",
    "format_summary",
    "main",
]

SAMPLE_PERIOD_MS = 50  # nvidia-smi's sampling loop (-lms)
SETTLE_FRACTION = 0.2  # of each phase left out of its power / clock statistics
CALLS_PER_CHECK = 10  # calls between the ranks' checks of the phase's time
_QUERY = "timestamp,power.draw,clocks.sm,temperature.gpu"
_SMI_TIME_FORMAT = "%Y/%m/%d %H:%M:%S.%f"


@dataclass(frozen=True)
class Sample:
    """One nvidia-smi reading: ``time`` in seconds since the epoch (host clock)."""

    time: float
    power_w: float
    sm_mhz: float
    temp_c: float


def parse_samples(text: str) -> list[Sample]:
    """nvidia-smi ``--query-gpu=timestamp,power.draw,clocks.sm,temperature.gpu --format=csv,
    noheader,nounits`` lines (local time stamps, as ``time.time()`` sees them); lines that do not
    parse (a field "[N/A]", a cut-off last line) are skipped."""
    samples = []
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 4:
            continue
        try:
            stamp = _dt.datetime.strptime(fields[0], _SMI_TIME_FORMAT).timestamp()
            samples.append(Sample(stamp, *(float(f) for f in fields[1:])))
        except ValueError:
            continue
    return samples


def phase_stats(
    samples: Sequence[Sample], start: float, end: float, settle: float = SETTLE_FRACTION
) -> dict[str, float] | None:
    """Median power and SM clock, hottest temperature, of the samples in the phase's settled
    part ``[start + settle * (end - start), end]``; None if there are none."""
    begin = start + settle * (end - start)
    inside = [s for s in samples if begin <= s.time <= end]
    if not inside:
        return None
    return {
        "power_w": statistics.median(s.power_w for s in inside),
        "sm_mhz": statistics.median(s.sm_mhz for s in inside),
        "temp_c": max(s.temp_c for s in inside),
        "samples": len(inside),
    }


class GpuTelemetry:
    """``nvidia-smi`` sampling one GPU in the background (``with`` block); no samples when there
    is no GPU or no nvidia-smi (``available`` False)."""

    def __init__(self, device: torch.device, period_ms: int = SAMPLE_PERIOD_MS) -> None:
        self.available = device.type == "cuda" and shutil.which("nvidia-smi") is not None
        self._device = device
        self._period_ms = period_ms
        self._proc: subprocess.Popen[str] | None = None
        self.samples: list[Sample] = []

    def __enter__(self) -> GpuTelemetry:
        if self.available:
            # by UUID: CUDA_VISIBLE_DEVICES may renumber the GPUs nvidia-smi sees
            uuid = torch.cuda.get_device_properties(self._device).uuid
            self._proc = subprocess.Popen(
                [
                    "nvidia-smi",
                    f"--id=GPU-{uuid}",
                    f"--query-gpu={_QUERY}",
                    "--format=csv,noheader,nounits",
                    f"--loop-ms={self._period_ms}",
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        out, _ = self._proc.communicate(timeout=30)
        self.samples = parse_samples(out)
        self._proc = None


def _max_over_ranks(value: float, device: torch.device, group: dist.ProcessGroup | None) -> float:
    if group is None:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def run_phase(
    call: Callable[[], None], seconds: float, device: torch.device, group: dist.ProcessGroup | None
) -> tuple[int, float, float, float]:
    """Run ``call`` back to back until ``seconds`` have passed on the slowest rank (checked every
    CALLS_PER_CHECK calls, after a device sync); (calls, ms per call max over ranks, start, end
    host time of this rank)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *_: None)
    if group is not None:
        dist.barrier(group=group)
    sync(device)
    start = time.time()
    calls = 0
    while True:
        for _ in range(CALLS_PER_CHECK):
            call()
        calls += CALLS_PER_CHECK
        sync(device)
        if _max_over_ranks(time.time() - start, device, group) >= seconds:
            break
    end = time.time()
    return calls, _max_over_ranks((end - start) * 1e3 / calls, device, group), start, end


def summarize(phases: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per backend (in first-seen order): rounds, median ms per call, and per-GPU medians over
    rounds of power / clock (None without telemetry), speedup of the first backend's ms over
    this one's."""
    out: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(p["backend"] for p in phases):
        mine = [p for p in phases if p["backend"] == name]
        row: dict[str, Any] = {"rounds": len(mine), "ms": statistics.median(p["ms"] for p in mine)}
        gpus = []
        for rank in range(len(mine[0]["gpus"])):
            stats = [p["gpus"][rank] for p in mine if p["gpus"][rank] is not None]
            gpus.append(
                None
                if not stats
                else {k: statistics.median(s[k] for s in stats) for k in ("power_w", "sm_mhz")}
            )
        row["gpus"] = gpus
        out[name] = row
    first = next(iter(out.values()))["ms"] if out else None
    for row in out.values():
        row["speedup_vs_first"] = first / row["ms"]
    return out


def format_summary(summary: dict[str, dict[str, Any]], header: str) -> str:
    lines = [header, f"{'backend':<12} {'ms/call':>8} {'speedup':>8}  per GPU: power, SM clock"]
    for name, row in summary.items():
        gpus = "  ".join(
            "no telemetry" if g is None else f"{g['power_w']:.0f} W {g['sm_mhz']:.0f} MHz"
            for g in row["gpus"]
        )
        lines.append(f"{name:<12} {row['ms']:8.3f} {row['speedup_vs_first']:7.2f}x  {gpus}")
    return "\n".join(lines)


def _steps(call: Callable[[], None], micro_batches: int) -> Callable[[], None]:
    """``call`` with the fp8 weight cache emptied before every ``micro_batches``-th call (the
    first micro-batch of an optimizer step); 0: never."""
    from .bench import forget_fp8_weights

    if not micro_batches:
        return call
    count = [0]

    def step() -> None:
        if count[0] % micro_batches == 0:
            forget_fp8_weights()
        count[0] += 1
        call()

    return step


def main(argv: Sequence[str] | None = None) -> int:
    from . import harness
    from .bench import device_name, git_commit, precision_status

    parser = argparse.ArgumentParser(
        prog="python -m megamoe.tools.sustained", description=__doc__.splitlines()[0]
    )
    harness.add_case_arguments(parser)
    parser.add_argument(
        "--backend",
        nargs="+",
        default=["triton", "fused"],
        help=f"backends (or {harness.BASELINE}), in turn; speedups are over the first",
    )
    parser.add_argument(
        "--precision",
        nargs="+",
        choices=["bf16", "fp8"],
        default=["bf16"],
        help='each backend in each precision (a run "triton fp8")',
    )
    parser.add_argument(
        "--micro-batches",
        type=int,
        default=1,
        help="calls per optimizer step: fp8 runs quantize their weights once every this many "
        "calls (default 1: every call; 0: once, then cached)",
    )
    parser.add_argument("--backward", action="store_true", help="training steps (fwd + bwd)")
    parser.add_argument("--seconds", type=float, default=2.5, help="length of one phase")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls per backend first")
    parser.add_argument("--out", help="JSON record file")
    args = parser.parse_args(argv)
    if not args.seconds > 0:
        parser.error(f"--seconds must be > 0, got {args.seconds}")
    if args.micro_batches < 0:
        parser.error(f"--micro-batches must be >= 0, got {args.micro_batches}")
    if args.rounds < 1 or args.warmup < 0:
        parser.error(
            f"--rounds must be >= 1 and --warmup >= 0, got {args.rounds} and {args.warmup}"
        )
    from ..backends import BACKENDS

    unknown = [b for b in args.backend if b not in (*BACKENDS, harness.BASELINE)]
    if unknown:  # an unknown backend, named
        parser.error(
            f"--backend must be one of {[*BACKENDS, harness.BASELINE]}, got {unknown[0]!r}"
        )
    env = harness.init_distributed()
    shape, case, config = harness.case_of_args(args, parser, env)
    runs = [(b, config.replace(precision=p)) for b in args.backend for p in args.precision]
    for b, c in runs:
        ok, why = precision_status(b, c)
        if not ok:  # (the baseline, or a backend without fp8: it would time bf16 as fp8)
            parser.error(f"--precision {c.precision}: {why}")
    calls = {
        b if c.precision == "bf16" else f"{b} {c.precision}": _steps(
            harness.layer_call(b, case, c, env.group, args.backward),
            args.micro_batches if c.precision == "fp8" else 0,
        )
        for b, c in runs
    }
    for call in calls.values():
        for _ in range(args.warmup):
            call()
    timed = []
    with GpuTelemetry(env.device) as telemetry:
        for round_ in range(args.rounds):
            for name, call in calls.items():
                n, ms, start, end = run_phase(call, args.seconds, env.device, env.group)
                timed.append(dict(backend=name, round=round_, calls=n, ms=ms, start=start, end=end))
                if env.is_main:
                    print(
                        f"round {round_ + 1}/{args.rounds} {name}: {ms:.3f} ms/call ({n} calls)",
                        flush=True,
                    )
    mine = [phase_stats(telemetry.samples, p["start"], p["end"]) for p in timed]
    per_rank: list[Any] = [mine]
    if env.group is not None:
        per_rank = [None] * env.world_size
        dist.all_gather_object(per_rank, mine, group=env.group)
    phases = [dict(p, gpus=[stats[i] for stats in per_rank]) for i, p in enumerate(timed)]
    summary = summarize(phases)
    what = "forward + backward" if args.backward else "forward"
    if env.is_main:
        print(
            format_summary(
                summary,
                f"{shape.name}, {what}, W = {env.world_size}, "
                f"{case.tokens} tokens/rank, {args.rounds} rounds of "
                f"{args.seconds:g} s per backend",
            )
        )
        if args.out:
            record = dict(
                kind="sustained",
                **shape.record_fields(),
                world_size=env.world_size,
                gpu=device_name(env.device),
                commit=git_commit(),
                date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                torch=torch.__version__,
                tokens_per_rank=case.tokens,
                mode=what,
                seconds=args.seconds,
                rounds=args.rounds,
                micro_batches=args.micro_batches,
                telemetry=telemetry.available,
                settle_fraction=SETTLE_FRACTION,
                summary=summary,
                phases=phases,
            )
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    harness.finish_distributed(env)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
