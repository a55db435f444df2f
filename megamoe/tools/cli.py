"""Command line: ``megamoe info``, ``megamoe bench``, ``megamoe train-bench``, ``megamoe table``,
``megamoe plot`` (also ``python -m megamoe``).

``bench`` under torchrun (WORLD_SIZE > 1) runs expert-parallel, one rank per GPU over NCCL (gloo
on the CPU); without a GPU it runs the ``tiny`` preset on the CPU. The other tools are modules
of ``megamoe.tools`` (``python -m megamoe.tools.profile`` ...). Exit status 1 when a backend
errors or fails its accuracy check.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from typing import Sequence

import torch
import torch.distributed as dist

from .. import __version__
from ..backends import available_backends
from ..config import PRECISIONS
from ..shapes import MODEL_SHAPES, PRESETS
from .bench import (
    TIMING_MODES,
    BenchOptions,
    backend_status,
    default_backends,
    default_shapes,
    parse_tune,
    run_bench,
    run_failed,
    total_steps,
)
from .harness import (
    BASELINE,
    DistEnv,
    add_case_arguments,
    finish_distributed,
    init_distributed,
    shapes_of,
)
from .plot import add_x_argument
from .report import ProgressBar, format_generic_table, format_table
from .train_bench import add_arguments as add_train_bench_arguments
from .train_bench import cmd_train_bench

__all__ = ["main", "build_parser", "collect_info"]

# Every variable torchrun sets that says this process is one rank of several.
_TORCHRUN_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK")


# ----------------------------------------------------------------------------------------- info


def _triton_version() -> str:
    try:
        import triton
    except ImportError as exc:
        return f"not installed ({exc})"
    return triton.__version__


def _gpu_lines() -> list[str]:
    if not torch.cuda.is_available():
        return ["GPUs: none visible (CUDA not available)"]
    n = torch.cuda.device_count()
    lines = [f"GPUs: {n}"]
    for i in range(n):
        p = torch.cuda.get_device_properties(i)
        lines.append(
            f"  cuda:{i}  {p.name}  sm_{p.major}{p.minor}  {p.multi_processor_count} SMs  "
            f"{p.total_memory / 2**30:.1f} GiB"
        )
    if n > 1:
        lines.append("Peer access (NVLink/PCIe P2P), row = from, column = to:")
        lines.append("        " + " ".join(f"{j:>4}" for j in range(n)))
        for i in range(n):
            cells = [
                "   -"
                if i == j
                else ("  ok" if torch.cuda.can_device_access_peer(i, j) else "  no")
                for j in range(n)
            ]
            lines.append(f"  cuda:{i} " + " ".join(cells))
    return lines


def collect_info() -> list[str]:
    """Human-readable facts about the software, the GPUs and the backends."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "-"
    lines = [
        f"megamoe {__version__}",
        f"python {platform.python_version()} ({platform.machine()}, {os.cpu_count()} CPU cores)",
        f"torch {torch.__version__}   CUDA {torch.version.cuda or '-'}   NCCL {nccl}",
        f"triton {_triton_version()}",
        *_gpu_lines(),
        f"Backends on {device.type}:",
    ]
    for name, (ok, reason) in available_backends(device).items():
        lines.append(f"  {name:<10} {'available' if ok else 'unavailable'}: {reason}")
    ok, reason = backend_status(BASELINE, device)
    lines.append(f"  {BASELINE:<10} {'available' if ok else 'unavailable'}: {reason} (baseline)")
    lines.append("Presets: " + ", ".join(PRESETS))
    lines.append("Models: " + ", ".join(MODEL_SHAPES))
    return lines


def cmd_info(args: argparse.Namespace) -> int:
    print("\n".join(collect_info()))
    return 0


# ---------------------------------------------------------------------------------------- bench


def _options(args: argparse.Namespace, device: torch.device) -> BenchOptions:
    shapes = shapes_of(args)
    return BenchOptions(
        shapes=shapes or default_shapes(device),
        # "auto" stays a run of its own (resolved per shape: the record's resolved_backend)
        backends=list(dict.fromkeys(args.backend or default_backends(device))),
        iters=args.iters,
        warmup=args.warmup,
        tokens=args.tokens,
        routing=args.routing,
        check=not args.no_check,
        seed=args.seed,
        # a --set is a sweep of one value (applied where a backend reads it)
        tune={**parse_tune(args.set), **parse_tune(args.tune)},
        modes=args.mode,
        precisions=args.precision,
        micro_batches=args.micro_batches,
    )


def _kernel_records(iters: int, env: DistEnv) -> list[dict]:
    """Grouped-GEMM kernel records from megamoe.tools.bench_kernels (rank 0, GPU only)."""
    if env.device.type != "cuda":
        print("--kernels: skipped, no GPU", file=sys.stderr)
        return []
    try:
        from .bench_kernels import bench_grouped_gemm  # written separately; optional
    except ImportError as exc:
        print(
            f"--kernels: skipped, megamoe.tools.bench_kernels is not importable ({exc})",
            file=sys.stderr,
        )
        return []
    records = bench_grouped_gemm(iters=iters)
    return [dict(r) if not isinstance(r, dict) else r for r in records]


def cmd_bench(args: argparse.Namespace) -> int:
    env = init_distributed()
    try:
        opts = _options(args, env.device)
        bar = ProgressBar(total_steps(opts, env.world_size), enabled=env.is_main)
        records = run_bench(opts, env, progress=bar)
        bar.close()
        kernel_records = []
        if args.kernels and env.is_main:
            kernel_records = _kernel_records(args.iters, env)
        if env.group is not None:
            dist.barrier(group=env.group)
        if env.is_main:
            print(format_table(records))
            if kernel_records:
                print("\nGrouped GEMM kernels:\n" + format_generic_table(kernel_records))
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(records + kernel_records, f, indent=1)
                    f.write("\n")
                print(f"\nwrote {len(records) + len(kernel_records)} records to {args.out}")
    except BaseException:
        if env.group is not None:
            dist.destroy_process_group()
        raise
    return finish_distributed(env, 1 if run_failed(records) else 0)


# ---------------------------------------------------------------------------------------- table


def cmd_table(args: argparse.Namespace) -> int:
    from .report import main as report_main

    return report_main([*args.results] + (["--markdown"] if args.markdown else []))


def cmd_plot(args: argparse.Namespace) -> int:
    from .plot import main as plot_main

    return plot_main([*args.results, "--out", args.out, "--x", args.x])


# --------------------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megamoe", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p_info = sub.add_parser("info", help="versions, GPUs, NVLink peers, available backends")
    p_info.set_defaults(func=cmd_info)

    p = sub.add_parser(
        "bench", help="benchmark the layer (run under torchrun for expert parallelism)"
    )
    add_case_arguments(p, many=True, default_preset=None)  # (none: dsv3, tiny on the CPU)
    p.add_argument(
        "--backend",
        action="extend",
        nargs="+",
        help=f"backends, 'auto' or {BASELINE!r} (default: every available one + {BASELINE})",
    )
    p.add_argument("--iters", type=int, default=20, help="timed iterations (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed iterations first (default 3)")
    p.add_argument(
        "--tune",
        action="append",
        metavar="NAME=V1,V2,...",
        help="sweep a config tunable (comm_programs, push_programs, minibatch_rows, ring_rows, "
        "down_lag (or auto), copy_programs, overlap_shared, comm_kernel (0 or 1)) for "
        "the backends that read it; repeat for a grid (default: config values)",
    )
    p.add_argument(
        "--mode",
        nargs="+",
        choices=list(TIMING_MODES),
        default=["throughput"],
        help="throughput: iterations back to back, the host running ahead; latency: a device "
        "sync before each iteration; graph: the forward and the step captured in CUDA graphs "
        "and replayed (default throughput; several: one record each)",
    )
    p.add_argument(
        "--precision",
        nargs="+",
        choices=list(PRECISIONS),
        default=["bf16"],
        help="MoEConfig.precision of the megamoe runs (default bf16; several: a run of each, "
        "interleaved; fp8 runs on the backends that have it, the baseline stays bf16)",
    )
    p.add_argument(
        "--micro-batches",
        type=int,
        default=1,
        help="iterations per optimizer step: fp8 runs quantize their weights once every this "
        "many iterations, as with gradient accumulation, and record times per micro-batch with "
        "that cost amortized (default 1: every iteration)",
    )
    p.add_argument("--out", help="write the records as a JSON list here (rank 0)")
    p.add_argument("--no-check", action="store_true", help="skip the float64 accuracy check")
    p.add_argument(
        "--kernels",
        action="store_true",
        help="also run megamoe.tools.bench_kernels.bench_grouped_gemm (GPU)",
    )
    p.set_defaults(func=cmd_bench)

    p_train = sub.add_parser(
        "train-bench",
        help="train a transformers model (DeepSeek-V3 / Qwen3-30B-A3B shaped) with each MoE "
        "implementation and compare them (one GPU; tiny models on the CPU)",
    )
    add_train_bench_arguments(p_train)
    p_train.set_defaults(func=cmd_train_bench)

    p_table = sub.add_parser("table", help="render JSON records written by `bench --out`")
    p_table.add_argument("results", nargs="+")
    p_table.add_argument("--markdown", action="store_true")
    p_table.set_defaults(func=cmd_table)

    p_plot = sub.add_parser("plot", help="plot (PNG) JSON records written by `bench --out`")
    p_plot.add_argument("results", nargs="+")
    p_plot.add_argument("--out", required=True, help="PNG file to write")
    add_x_argument(p_plot)
    p_plot.set_defaults(func=cmd_plot)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (TypeError, ValueError) as exc:  # bad option values: say which, no traceback
        print(f"megamoe {args.command}: error: {exc}", file=sys.stderr)
        return 2
