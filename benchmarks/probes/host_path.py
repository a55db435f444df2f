"""Probe (no GPU): the host time of backend "triton"'s training step outside Triton's launches,
on any machine.

    PYTHONPATH=. python benchmarks/probes/host_path.py [--model qwen3-30b-a3b] [--tokens 4096]
        [--precision bf16 fp8] [--steps 50] [--out p.json]

Runs the step's host code (schedule, forward, backward) on meta tensors, sized for an H200
(``assume_programs``), with every Triton launch replaced by a no-op, as the compile check
records launches: what is left is megamoe's Python, the descriptors it builds and torch's
dispatch on meta tensors (cheaper than CUDA allocations: a lower bound of a GPU host's time, and
a measure that moves with the host code alone). Reports the median microseconds per step of
``--steps`` steps after five warm-up steps, and the five functions of most own time under
``cProfile``.
"""

import argparse
import cProfile
import json
import os
import pstats
import statistics
import time

os.environ.pop("TRITON_INTERPRET", None)  # (the compiled kernels' host paths, not the interpreter)

from triton.runtime.jit import JITFunction  # noqa: E402

from megamoe.backends import triton as backend  # noqa: E402
from megamoe.ep.checks import CHECK_ENV  # noqa: E402
from megamoe.kernels.runtime import assume_programs  # noqa: E402
from megamoe.tools import compile_check  # noqa: E402
from megamoe.tools.harness import resolve_shape  # noqa: E402

H200_SMS = 132


def step_us(config, tokens: int, steps: int) -> tuple[float, list[str]]:
    def step() -> None:
        compile_check._train_step(backend, config, tokens)

    for _ in range(5):
        step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(10):
        step()
    prof.disable()
    stats = pstats.Stats(prof).sort_stats("tottime")
    top = [
        f"{func[2]} ({os.path.basename(func[0])}:{func[1]}): {row[2] / 10 * 1e6:.1f} us/step"
        for func, row in sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:5]
    ]
    return statistics.median(times) * 1e6, top


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--precision", nargs="+", default=["bf16", "fp8"])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--out")
    args = parser.parse_args()
    os.environ[CHECK_ENV] = "off"  # (no host reads of the never-written device records)
    JITFunction.run = lambda self, *a, grid, warmup, **k: None
    rows = []
    with assume_programs(H200_SMS):
        for precision in args.precision:
            config = resolve_shape(args.model).config(1).replace(precision=precision)
            us, top = step_us(config, args.tokens, args.steps)
            rows.append({"precision": precision, "host_us_per_step": us, "top_own_time": top})
            print(f"{args.model}, {args.tokens} tokens, {precision}: {us:.0f} us a step")
            for line in top:
                print(f"    {line}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "tokens": args.tokens, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
